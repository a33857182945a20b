"""late-interaction-kernels 0.4.5's public API on lik, for people migrating: change the import, keep the calls.

    from lik.integrations.late_interaction_kernels import maxsim, retrieve   # was: from late_interaction_kernels ...
    from lik.integrations.late_interaction_kernels.fp8 import maxsim_inference_fp8   # was: ...kernels.fp8 ...
    from lik.integrations.late_interaction_kernels.fused_head import maxsim_from_hidden   # was: ...fused_head ...

Covered, with its signatures, shapes and mask semantics (``True`` = valid token; a masked document token never
takes part in the max, a masked query token adds 0, a document with no valid token scores 0: lik's
``mask_mode="exclude"``):

* the top level: :func:`maxsim`, :func:`maxsim_pairs`, :func:`maxsim_varlen` (packed queries against packed
  documents, every query with every document), :func:`retrieve`, :class:`MaxSimScorer`, :func:`maxsim_padded`,
  :func:`patch_pylate` / :func:`unpatch_pylate` (lik's :func:`lik.integrations.pylate.enable` /
  ``disable``), :func:`patch_colpali_engine` / :func:`unpatch_colpali_engine` (lik's
  :func:`lik.integrations.colpali.enable` / ``disable``);
* the submodules :mod:`.fp8` (``maxsim_inference_fp8``, ``quantize_fp8_per_tensor`` / ``_per_token``,
  ``dequantize_fp8_per_tensor`` / ``_per_token``), :mod:`.padded` (``maxsim_padded``, ``pack_padded``,
  ``PackedBatch``), :mod:`.topk` (``maxsim_topk``), :mod:`.score_pairs` (``score_pairs_packed``),
  :mod:`.fused_head` (``maxsim_from_hidden``: lik's :func:`lik.maxsim_from_hidden`, the projection head fused
  into scoring, with gradients to ``Q``, ``H_d``, ``W`` and ``b``), :mod:`.plaid` (``maxsim_residual`` on
  padded and ``maxsim_residual_varlen`` on ragged PLAID / ColBERTv2 residual codes, ``plaid_approx_score``, and
  ``maxsim_residual_reference`` / ``plaid_approx_score_reference`` with the peer's reference semantics),
  :mod:`.pylate_compat` and :mod:`.colpali_compat` (the switches above).

Not covered: the Apple ``mps`` backend, the peer's internals (``autograd``, ``forward``, ``backward``,
``_autotune``, ``_utils``) and its ``reference`` module (lik's own specification is :func:`lik.maxsim_reference`).

Deliberate differences (its behaviour is not reproduced):

* non-finite values: its reference (the CPU path of ``retrieve``) replaces a non-finite per-token maximum by 0, so
  a NaN or inf in a valid token silently scores like padding; lik propagates NaN to the pairs it touches and
  ``retrieve`` ranks NaN scores last;
* ties in ``retrieve`` / ``maxsim_topk``: ``torch.topk`` leaves their order unspecified; lik returns the lower
  document index first;
* ``backward="lowmem"`` reduces ``grad_D`` with half-precision products there (fp32 inputs get fp16-precision
  gradients); here ``"lowmem"`` selects lik's deterministic backward, which keeps fp32 accumulation, and
  ``"unified"`` its fast one (:class:`MaxSimScorer` likewise);
* ``normalize=True`` L2-normalises copies of ``Q`` and ``D`` before scoring (the peer does it inside its kernel;
  half-precision rows are normalised in float32 and rounded once to their dtype): pass normalised embeddings with
  ``normalize=False`` to avoid the copy; no warning is printed for unnormalised inputs (its one-shot norm check and
  ``LIK_SUPPRESS_NORM_WARN`` do not exist);
* ``max_seqlen_*`` of :func:`maxsim_varlen` / ``score_pairs_packed`` are hints here: a value below the true longest
  sequence costs speed, never tokens (the peer asserts on the device);
* ``maxsim_padded`` scores the padded tensors with prefix masks in one call (no packing, nothing read on the host
  unless ``validate``); a length past the padding counts as the whole padded sequence, a length of 0 scores 0;
  ``score_pairs_packed`` gathers each pair's rows into a copy;
* ``pack_padded`` refuses a length past the padding with a ``ValueError`` naming the argument, checked in the one
  host read the packing makes anyway (the peer's device-side assert raises a ``RuntimeError`` that leaves the
  CUDA context unusable);
* float8: only ``torch.float8_e4m3fn`` is quantized (``dtype=float8_e5m2`` raises ``ValueError``); scores are
  MaxSim of the dequantized operands with fp32 products on every device (CPU included, where the peer rounds to
  bfloat16 with a warning); the fallback to dequantized float32, with a one-time ``RuntimeWarning``, is kept for
  a GPU without FP8 and for e5m2 inputs; a zero tensor or row gets scale 0 (the peer: ``1e-6 / 448``) and one
  holding NaN or inf scale NaN;
* ``patch_pylate`` / ``patch_colpali_engine`` throw lik's own switches: on every device and every host version
  (the peer steps aside as a deprecated no-op on PyLate >= 1.5.1 and colpali-engine >= 0.3.17, which ship a
  backend of their own, and falls back to the host's code on the CPU or with ``LIK_DISABLE=1``, which is not
  read here); PyLate's masks keep PyLate's meaning (mask-by-multiplication, any pattern) where PyLate's own
  ``auto`` backend, which the peer leaves in charge, reads each mask as a prefix length (``mask.sum``) when
  flash-maxsim is installed; the host's function objects are switched in place, so no name is rebound
  (``pylate.scores.colbert_scores`` stays the object it was) and the peer's internals (``_ORIGINAL``,
  ``patched_colbert_scores``, ``package_at_least``) do not exist;
* ``fused_head.maxsim_from_hidden`` computes in the inputs' dtype (fp32 inputs get fp32 products under
  ``torch.get_float32_matmul_precision()``; the peer rounds every operand to fp16 or bf16), casts ``Q``, ``W`` and
  ``b`` to ``H_d``'s dtype when they differ, projects and normalises each tile once for every query (the peer
  once per query and document), and its backward recomputes the projection a chunk of documents at a time
  (the peer gathers ``Nq * Nd * Lq`` hidden rows of ``d_model``: more than ``H_d`` itself in in-batch training);
  a NaN or inf in a valid token gives NaN, and masked hidden rows, garbage included, get exactly 0 gradient;
* the winners MaxSim's training forward keeps for the backward are int16 when ``Ld < 32 768`` (int32 beyond; the
  peer's always int32): half the buffer, none under ``torch.no_grad()`` (as the peer);
* ``plaid``: the peer's residual bytes (first dimension in the low bits) are rewritten through a 256-entry table
  into ColBERT's order and, for ``nbits`` 2 or 4 with ``normalize=True``, ``d`` a multiple of 8 and finite bucket
  weights, scored on chip by :func:`lik.maxsim_residual`; ``nbits=8`` and ``normalize=False`` (no lik codec
  format) decode the documents' valid tokens once in fp32 and score them with :func:`lik.maxsim_packed`. Both
  compute in ``Q``'s dtype (the peer multiplies in bf16 or fp16, fp32 ``Q`` included), float64 ``Q`` in float64;
  ``normalize=True`` normalises a copy of ``Q`` (fp32, rounded once); the padded layout is packed first (one
  host read of the lengths, a length past the padding counting as the padding, a negative one as 0); an empty
  document gets a zero gradient (the peer refuses it in training with ``ValueError``); codes outside the
  centroids raise ``ValueError`` (the peer reads out of bounds); ``maxsim_residual_varlen`` is differentiable
  and its ``max_seqlen_d`` a hint; ``plaid_approx_score`` is a PyTorch gather and masked max, a bounded block of
  documents at a time (no fused kernel), keeping a ``+inf`` maximum as the peer's kernel does (its reference
  counts it 0);
* bad input raises ``ValueError`` / ``TypeError`` naming the argument (the peer's messages' key phrases are kept
  where it checks the same thing).
"""

from __future__ import annotations

from . import fp8, fused_head, padded, plaid, score_pairs, topk
from .colpali_compat import patch_colpali_engine, unpatch_colpali_engine
from .padded import maxsim_padded
from .pylate_compat import patch_pylate, unpatch_pylate
from .scoring import MaxSimScorer, maxsim, maxsim_pairs, maxsim_varlen, retrieve

__all__ = [
    "MaxSimScorer",
    "retrieve",
    "maxsim_padded",
    "patch_pylate",
    "unpatch_pylate",
    "patch_colpali_engine",
    "unpatch_colpali_engine",
    "maxsim",
    "maxsim_pairs",
    "maxsim_varlen",
    "fp8",
    "fused_head",
    "padded",
    "plaid",
    "score_pairs",
    "topk",
]
