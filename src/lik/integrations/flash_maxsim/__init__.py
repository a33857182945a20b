"""flash-maxsim 0.3.0's public MaxSim API on lik, for people migrating: change the import, keep the calls.

    from lik.integrations.flash_maxsim import flash_maxsim_batched, pack_docs   # was: from flash_maxsim import ...

Covered, with flash-maxsim's signatures and return shapes:

* float scoring (:mod:`.scoring`): :func:`flash_maxsim`, :func:`flash_maxsim_batched`,
  :func:`flash_maxsim_batched_train`, :func:`flash_maxsim_train`, :func:`flash_maxsim_varlen`,
  :func:`flash_maxsim_packed`, :func:`flash_maxsim_pairs`, :func:`flash_maxsim_pairs_dense`, :func:`pack_pairs`,
  :func:`pack_docs`, :func:`warmup`, and the kernel variants :func:`flash_maxsim_persistent`,
  :func:`flash_maxsim_qreuse`, :func:`flash_maxsim_splitk` (the same scores as :func:`flash_maxsim`);
* 8-bit corpora (:mod:`.quantized`): :func:`quantize_int8_symmetric`, :func:`quantize_query_int8`,
  :func:`flash_maxsim_int8x8` and :func:`flash_maxsim_int8_symmetric` run lik's own 8-bit format and kernels
  (:func:`lik.quantize`); the affine uint8 format of :func:`quantize_int8` / :func:`dequantize_int8` /
  :func:`flash_maxsim_int8` is not a lik format: its documents are dequantized a bounded chunk at a time and
  scored with :func:`lik.maxsim`;
* reranking and top-k (:mod:`.ranking`): :func:`flash_maxsim_rerank`, :func:`flash_maxsim_rerank_direct`,
  :func:`flash_maxsim_rerank_padded`, :func:`flash_maxsim_topk`;
* the fused contrastive training step (:mod:`.contrastive`; flash-maxsim keeps it in
  ``flash_maxsim.flash_maxsim_contrastive``): :func:`colbert_contrastive_step` runs :func:`lik.contrastive_loss`
  and accumulates the gradients into ``Q.grad`` / ``D.grad`` as flash-maxsim's does;
* the plain-PyTorch references (:mod:`.references`): :func:`maxsim_naive`, :func:`maxsim_naive_fp32`,
  :func:`maxsim_at_operator`, :func:`maxsim_bmm`, :func:`maxsim_chunked`, :func:`maxsim_naive_batched`,
  :func:`maxsim_naive_int8`, with flash-maxsim's semantics (input-dtype sums, ``-inf`` for an empty document).

flash-maxsim's semantics: ``doc_lengths`` / ``query_lengths`` / ``cu_seqlens`` mark the valid prefix of each
padded item (tokens past it never take part: lik's ``mask_mode="exclude"``); results are float32.

Not covered: Chamfer distance (``flash_chamfer``, ``flash_chamfer_train``, ``flash_chamfer_invgrid_train``,
``naive_chamfer``, ``naive_chamfer_one_direction``: lik's :func:`lik.chamfer_distance` has PyTorch3D's contract),
``flash_maxsim_int8_batched_train`` (training from an 8-bit copy of ``D``: lik's 8-bit scoring is inference only),
and what flash-maxsim keeps in submodules outside its package namespace (the sparse-query scorers of
``flash_maxsim_sparse`` / ``flash_maxsim_sparse_dd``, the experimental ``flash_maxsim_exp`` and ``flash_maxsim_splitd``
kernels, its backward proposals; the fused contrastive step is covered, above).

Deliberate differences (flash-maxsim's behaviour is not reproduced):

* precision: flash-maxsim converts every input to float16 inside its kernels, so float32 inputs lose precision
  and bfloat16 values beyond float16's range (65504) become inf; lik computes in the input dtype (fp32
  accumulation);
* empty documents: a zero-length document scores ``-inf`` in flash-maxsim's kernels (the running max starts at
  -inf and nothing replaces it); lik scores it 0 (an empty sum), with zero gradient;
* bad input raises ``ValueError`` / ``TypeError`` naming the argument instead of a bare ``AssertionError``;
  ``pack_pairs`` / ``pack_docs`` of an empty list raise ``ValueError`` instead of ``IndexError``;
* performance knobs (``query_chunk_size``, ``splitk``, ``pad_lq``, ``grid_factor``, ``num_splits``) are accepted
  and have no effect: lik's launch heuristics choose the tiling;
* gradients of :func:`flash_maxsim_batched_train` and :func:`flash_maxsim_train` come back in the input dtype
  (flash-maxsim computes them from float16 copies); at a near-tie (two tokens' similarities closer than the
  rounding of their fp32 sums) the gradient goes to the token lik's fp32 sum ranks first (the lower index on an
  exact tie), where a reference summing in another order may pick the other: a whole token's difference in that
  row (flash-maxsim's tests/test_backward.py bounds its 51 200-maximum check at 0.1);
* a float query against an int8 corpus (:func:`flash_maxsim_int8_symmetric`) is quantized per token to int8
  first, as everywhere in lik, so it scores as :func:`flash_maxsim_int8x8`; flash-maxsim multiplies the float16
  query with the int8 values;
* :func:`quantize_int8_symmetric` and :func:`quantize_query_int8` round ``x / scale`` in float32
  (:func:`lik.quantize`); flash-maxsim divides in the input dtype (or by ``absmax`` then times 127), so a value
  can land one int8 step away; a row holding NaN or inf gets scale NaN (its scores are NaN);
* :func:`flash_maxsim_int8` scores ``Q`` in its own dtype against the dequantized documents rounded to it, not
  with a fused uint8 kernel (flash-maxsim applies the scale and minimum to float16 products in float32);
* :func:`flash_maxsim_topk` returns the exact top-k with ties by lower index; flash-maxsim's int8 pre-scan may
  miss a document of the true top-k, and its ``torch.topk`` leaves tie order unspecified;
* :func:`colbert_contrastive_step` takes any labels in ``[0, Nd)`` (flash-maxsim only ``arange(Nq)``, compared on
  the device: a synchronisation per step), any ``Lq`` and ``d`` (flash-maxsim: ``Lq <= 32``, ``d`` a power of two up
  to 256), float32 and CPU tensors; it adds each gradient to a present ``.grad`` in that gradient's dtype
  (flash-maxsim adds in float32 and rounds once), and sets an absent one to the step's gradient rather than to
  zeros plus it; bad input raises lik's errors (``TypeError`` for a dtype) before anything is written;
* :func:`flash_maxsim_rerank_direct` gathers the documents' rows into a padded copy (flash-maxsim reads them in
  place).
"""

from __future__ import annotations

from .contrastive import colbert_contrastive_step
from .quantized import (
    dequantize_int8,
    flash_maxsim_int8,
    flash_maxsim_int8_symmetric,
    flash_maxsim_int8x8,
    quantize_int8,
    quantize_int8_symmetric,
    quantize_query_int8,
)
from .ranking import flash_maxsim_rerank, flash_maxsim_rerank_direct, flash_maxsim_rerank_padded, flash_maxsim_topk
from .references import (
    maxsim_at_operator,
    maxsim_bmm,
    maxsim_chunked,
    maxsim_naive,
    maxsim_naive_batched,
    maxsim_naive_fp32,
    maxsim_naive_int8,
)
from .scoring import (
    DEFAULT_SHAPES,
    DEFAULT_TRAIN_SHAPES,
    flash_maxsim,
    flash_maxsim_batched,
    flash_maxsim_batched_train,
    flash_maxsim_packed,
    flash_maxsim_pairs,
    flash_maxsim_pairs_dense,
    flash_maxsim_persistent,
    flash_maxsim_qreuse,
    flash_maxsim_splitk,
    flash_maxsim_train,
    flash_maxsim_varlen,
    pack_docs,
    pack_pairs,
    warmup,
)

__all__ = [
    "flash_maxsim",
    "flash_maxsim_batched",
    "flash_maxsim_batched_train",
    "flash_maxsim_train",
    "flash_maxsim_varlen",
    "flash_maxsim_packed",
    "flash_maxsim_pairs",
    "flash_maxsim_pairs_dense",
    "flash_maxsim_persistent",
    "flash_maxsim_qreuse",
    "flash_maxsim_splitk",
    "pack_pairs",
    "pack_docs",
    "warmup",
    "DEFAULT_SHAPES",
    "DEFAULT_TRAIN_SHAPES",
    "quantize_int8",
    "dequantize_int8",
    "quantize_int8_symmetric",
    "quantize_query_int8",
    "flash_maxsim_int8",
    "flash_maxsim_int8_symmetric",
    "flash_maxsim_int8x8",
    "flash_maxsim_rerank",
    "flash_maxsim_rerank_direct",
    "flash_maxsim_rerank_padded",
    "flash_maxsim_topk",
    "maxsim_naive",
    "maxsim_naive_fp32",
    "maxsim_at_operator",
    "maxsim_bmm",
    "maxsim_chunked",
    "maxsim_naive_batched",
    "maxsim_naive_int8",
    "colbert_contrastive_step",
]
