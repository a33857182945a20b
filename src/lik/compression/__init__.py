"""PLAID compression: ColBERTv2's residual codec (k-means centroids plus 1/2/4-bit residual buckets, packed as
ColBERT packs them) and readers for the indexes ColBERT and fast-plaid write.

Files by role: ``kmeans`` (centroid training on the data's device; ``nearest``: the fused assignment kernel),
``sampling`` (ColBERTv2's training plan: sample sizes, centroid count, held-out split, bucket quantiles), ``packing``
(the bit layout and ColBERT's lookup tables), ``codec`` (:class:`ResidualCodec`: compress, decompress, train),
``training`` (ColBERTv2's plan over a packed corpus), ``candidates`` (PLAID's IVF and candidate generation;
``interaction``: its stage-3 kernel; ``candidates_reference``: its float64 specification), ``colbert_format``
(reading a colbert-ai index directory), ``fast_plaid_format`` (reading a fast-plaid one, PyLate's default index).
"""

from .candidates import build_ivf, generate_candidates
from .codec import ResidualCodec
from .colbert_format import PlaidIndex, is_colbert_index, load_colbert_index
from .fast_plaid_format import is_fast_plaid_index, load_fast_plaid_index, load_plaid_index
from .kmeans import assign_to_centroids, kmeans
from .nearest import nearest_centroid, nearest_centroid_reference
from .packing import pack_residual_bits, unpack_residual_bits
from .training import train_codec

__all__ = [
    "ResidualCodec",
    "train_codec",
    "PlaidIndex",
    "load_plaid_index",
    "is_colbert_index",
    "load_colbert_index",
    "is_fast_plaid_index",
    "load_fast_plaid_index",
    "kmeans",
    "assign_to_centroids",
    "nearest_centroid",
    "nearest_centroid_reference",
    "pack_residual_bits",
    "unpack_residual_bits",
    "build_ivf",
    "generate_candidates",
]
