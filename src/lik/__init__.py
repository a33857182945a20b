"""lik: fused Triton GPU kernels for late-interaction retrieval and multi-scale deformable attention.

Public functions (see README.md for shapes and semantics):

* :func:`lik.maxsim` -- ColBERT / ColPali MaxSim scores with a training backward.
* :func:`lik.maxsim_reference` -- the pure-PyTorch specification (CPU path, tests).
* :func:`lik.maxsim_varlen` / :func:`lik.maxsim_packed` -- packed variable-length MaxSim (ragged pairs, ragged
  corpora, no padding); :func:`lik.pack` / :func:`lik.unpack` build and split the packed layout.
* :func:`lik.maxsim_from_hidden` -- MaxSim of documents given as hidden states, the projection head fused in
  (the projected documents are never written), trainable.
* :func:`lik.contrastive_loss` -- in-batch contrastive loss on MaxSim scores (cross-entropy, hard negatives) as one
  fused autograd node.
* :func:`lik.maxsim_residual` -- MaxSim against ColBERTv2 / PLAID residual codes decoded on chip
  (:mod:`lik.compression` holds the codec), with the gradient to the queries.
* :func:`lik.search` -- exact top-k MaxSim search over a corpus, in memory-bounded chunks.
* :class:`lik.DocumentBatch` -- an encoder's batch (padded with a mask or lengths, or packed) for ``Index.build``.
* :class:`lik.Index` -- a saved, sharded corpus searched exactly on the GPU, in host RAM, on disk or across GPUs.
* :func:`lik.quantize` / :func:`lik.dequantize` -- per-row symmetric int8 / float8 storage of embeddings.
* :func:`lik.warmup` -- compile the kernel variants given query shapes need, before serving.
* :func:`lik.chamfer_distance` / :func:`lik.nearest_neighbors` -- Chamfer distance (PyTorch3D's contract) and
  k = 1 nearest neighbours between point sets, trainable, O(P) memory.
* :func:`lik.knn_points` -- K nearest neighbours (PyTorch3D's ``knn_points``), trainable, O(P K) memory.
* :func:`lik.ms_deform_attn_v2` -- RT-DETRv2 / D-FINE's variant (points per level, ``"discrete"`` sampling).
* :func:`lik.ms_deform_attn` -- multi-scale deformable attention (Deformable DETR family), trainable; aliases
  :class:`lik.MSDeformAttnFunction` / :class:`lik.MultiScaleDeformableAttnFunction` and the stateless
  :class:`lik.MultiScaleDeformableAttention` module with the transformers signature.
* :mod:`lik.integrations` -- lik inside PyLate, colpali-engine, sentence-transformers and transformers (one-line
  ``enable()`` switches) and the peer libraries' APIs; host libraries are imported only when used.

Subpackages are named after what they hold (``lik.ops.maxsim``, ``lik.ops.msda``, ``lik.retrieval``, ``lik.index``),
never
after a public function, so ``lik.search`` is always the function.
"""

from .ops.maxsim import (
    maxsim,
    maxsim_packed,
    maxsim_packed_reference,
    maxsim_reference,
    maxsim_varlen,
    maxsim_varlen_reference,
    pack,
    unpack,
)
from .integrations.transformers import MultiScaleDeformableAttention
from .ops.chamfer import chamfer_distance, nearest_neighbors
from .ops.contrastive import contrastive_loss, contrastive_loss_reference
from .ops.fused_head import maxsim_from_hidden, maxsim_from_hidden_reference
from .ops.knn import knn_points
from .ops.msda import (
    MSDeformAttnFunction,
    MultiScaleDeformableAttnFunction,
    MSDeformAttnV2Function,
    ms_deform_attn,
    ms_deform_attn_reference,
    ms_deform_attn_v2,
    ms_deform_attn_v2_reference,
)
from .ops.quantization import dequantize, quantize
from .ops.residual import maxsim_residual
from .precompile import warmup
from .retrieval import search
from .index import DocumentBatch, Index

__version__ = "0.1.0"

__all__ = [
    "maxsim",
    "maxsim_reference",
    "maxsim_varlen",
    "maxsim_packed",
    "maxsim_varlen_reference",
    "maxsim_packed_reference",
    "pack",
    "unpack",
    "maxsim_from_hidden",
    "maxsim_from_hidden_reference",
    "contrastive_loss",
    "contrastive_loss_reference",
    "maxsim_residual",
    "search",
    "Index",
    "DocumentBatch",
    "quantize",
    "dequantize",
    "warmup",
    "chamfer_distance",
    "nearest_neighbors",
    "knn_points",
    "ms_deform_attn",
    "ms_deform_attn_reference",
    "ms_deform_attn_v2",
    "ms_deform_attn_v2_reference",
    "MSDeformAttnV2Function",
    "MSDeformAttnFunction",
    "MultiScaleDeformableAttnFunction",
    "MultiScaleDeformableAttention",
    "__version__",
]
