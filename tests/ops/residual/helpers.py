"""Small compressed corpora for the residual tests: a random codec, random codes and packed residuals for given
document lengths, and the float64 scores they must give."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lik.compression import ResidualCodec
from lik.compression.packing import pack_residual_bits
from lik.ops.maxsim.reference_varlen import maxsim_packed_reference
from lik.ops.residual import decode_tokens


def make_codec(dim, nbits, k=5, seed=0, dtype=torch.float32):
    """A codec of ``k`` unit-norm centroids (``dtype``) in ``dim`` dimensions, sorted random weights and cutoffs."""
    g = torch.Generator().manual_seed(seed)
    centroids = F.normalize(torch.randn(k, dim, generator=g), dim=-1).to(dtype)
    weights = torch.sort(torch.randn(2**nbits, generator=g) * 0.1).values
    cutoffs = torch.sort(torch.randn(2**nbits - 1, generator=g) * 0.1).values
    return ResidualCodec(centroids, cutoffs, weights, nbits)


def make_corpus(codec, lengths, seed=1, codes_dtype=torch.int32):
    """``(codes [T], residuals [T, dim * nbits // 8] uint8, cu int32 [B + 1])``: random tokens, ``T = sum(lengths)``
    (``lengths`` may be empty)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    codes = torch.randint(0, codec.num_centroids, (t,), generator=g).to(codes_dtype)
    residuals = pack_residual_bits(torch.randint(0, 2**codec.nbits, (t, codec.dim), generator=g), codec.nbits)
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return codes, residuals, cu


def expected(Q, codes, residuals, codec, cu, q_mask=None):
    """float64 scores ``[Nq, B]``: the tokens decoded in float64, then :func:`maxsim_packed_reference`."""
    d = decode_tokens(codec, codes, residuals, torch.float64)
    return maxsim_packed_reference(Q.detach().double(), d, cu, q_mask)
