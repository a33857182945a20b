"""k-means for PLAID centroids, in plain PyTorch on whatever device holds the data.

Why not a library: ColBERT trains its centroids with faiss and fast-plaid with fastkmeans; both are optional heavy
dependencies (faiss has no maintained wheel for every CUDA, fastkmeans pulls a Triton build of its own), and
Lloyd's algorithm is two operations that PyTorch already runs at the device's matmul and bandwidth rates: the
assignment is a chunked matmul (``argmax_c <x, c> - |c|^2 / 2``, never an ``[N, k]`` matrix beyond one chunk) and
the update an ``index_add_`` of the points into per-centroid sums. Everything accumulates in fp32 whatever the
input dtype. Seeding is deterministic (a CPU generator picks the initial points, so a seed means the same start on
every device); the CPU run is bitwise repeatable, and a CUDA run is too under
``torch.use_deterministic_algorithms(True)`` (``index_add_``'s atomics otherwise reorder fp32 additions).

Empty clusters take a point, as faiss does in spirit: after each update every empty centroid is moved to a
distinct point among those farthest from their own centroid (farthest first, ties to the lower point index), so
``k > N`` and unlucky starts still end with a centroid on every point when there are enough points.
"""

from __future__ import annotations

import torch

from .nearest import nearest_centroid

__all__ = ["kmeans", "assign_to_centroids"]

# CUDA assigns with the fused kernel; False runs the chunked product there too (a comparison, or a fallback).
FUSED = True
# Rows of x per assignment chunk: the [rows, k] fp32 score block stays under about 256 MB.
_CHUNK_BYTES = 1 << 28


def _chunk_rows(k: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * max(k, 1)))


def assign_to_centroids(
    x: torch.Tensor, centroids: torch.Tensor, *, matmul_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid (L2) of every row of ``x``, in chunks.

    Args:
        x: float ``[N, d]``; centroids: float ``[k, d]`` on the same device.
        matmul_dtype: dtype of the ``x @ centroids.T`` product (fp32 by default, which follows
            ``torch.get_float32_matmul_precision()``; fp16 / bf16 run on tensor cores and keep the scores in that
            dtype, so near-ties may go either way: bf16's 8-bit mantissa makes it the coarser, and fp16 needs the
            scores under 65504, true of embeddings). Norms, distances, sums and means stay fp32.

    Returns:
        ``(codes int64 [N], squared_distance fp32 [N])``. Ties go to the lower centroid index.

    On CUDA the assignment is :func:`lik.compression.nearest.nearest_centroid` (fused, operands in
    ``matmul_dtype``, fp32 accumulation; unless the module's ``FUSED`` is False); elsewhere a chunked product and
    argmax.

    Example::

        >>> assign_to_centroids(torch.tensor([[0.0, 1.0]]), torch.eye(2))[0].tolist()
        [1]
    """
    if matmul_dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"matmul_dtype must be a floating dtype, got {matmul_dtype}")
    if x.is_cuda and FUSED:
        return _assign_fused(x, centroids, matmul_dtype)
    c = centroids.float()
    half_norms = 0.5 * (c * c).sum(-1)
    neg_half_norms = -half_norms
    c_mm = centroids.to(matmul_dtype)
    neg_bias_mm = neg_half_norms.to(matmul_dtype)
    codes = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    dist = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    step = _chunk_rows(c.shape[0])
    for start in range(0, x.shape[0], step):
        chunk = x[start : start + step].float()
        # argmax of <x, c> - |c|^2 / 2 is argmin of |x - c|^2. The bias is added inside the GEMM and the scores
        # stay in the product's dtype: the [rows, k] block is written once and read once by the argmax.
        if matmul_dtype == torch.float32:
            scores = torch.addmm(neg_half_norms, chunk, c.T)
        else:
            scores = torch.addmm(neg_bias_mm, chunk.to(matmul_dtype), c_mm.T)
        idx = scores.argmax(dim=1)  # argmax: the first of equal maxima
        best = scores.gather(1, idx.unsqueeze(1)).squeeze(1).float()
        codes[start : start + step] = idx
        # |x - c|^2 = |x|^2 - 2 (<x, c> - |c|^2 / 2); clamp the rounding below zero.
        dist[start : start + step] = ((chunk * chunk).sum(-1) - 2 * best).clamp_min(0)
    return codes, dist


def _assign_fused(x: torch.Tensor, centroids: torch.Tensor, matmul_dtype: torch.dtype):
    """The CUDA path of :func:`assign_to_centroids`: one fused kernel, no ``[N, k]`` block in memory (a billion
    tokens against 2**16 centroids is 1.7e16 FLOP, minutes of tensor-core time, but 262 TB as a score matrix)."""
    codes, best = nearest_centroid(x, centroids, bias="l2", product_dtype=matmul_dtype)
    dist = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    step = _chunk_rows(x.shape[1])
    for start in range(0, x.shape[0], step):
        chunk = x[start : start + step].float()
        # |x - c|^2 = |x|^2 - 2 (<x, c> - |c|^2 / 2); clamp the rounding below zero.
        dist[start : start + step] = ((chunk * chunk).sum(-1) - 2 * best[start : start + step].float()).clamp_min(0)
    return codes.long(), dist


def kmeans(
    x: torch.Tensor,
    k: int,
    *,
    niters: int = 20,
    seed: int = 0,
    tol: float = 0.0,
    matmul_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Lloyd's k-means on ``x``'s device.

    Args:
        x: float ``[N, d]`` (fp16 / bf16 / fp32 / fp64), finite, ``N >= 1``. Read in chunks, never copied whole.
        k: number of centroids, ``>= 1`` (may exceed ``N``: the surplus centroids repeat points).
        niters: Lloyd iterations (ColBERT runs 4 by default, fast-plaid more; 20 converges on most data).
        seed: the initial centroids are ``k`` distinct rows of ``x`` drawn by ``torch.Generator().manual_seed(seed)``
            on the CPU (so the same on every device).
        tol: stop early once no centroid moves more than ``tol`` (L2); 0 runs every iteration unless nothing moves.
        matmul_dtype: the assignment product's dtype (see :func:`assign_to_centroids`); fp16 / bf16 make the
            assignment a tensor-core product (fast-plaid assigns in fp16 on GPUs). Sums and means stay fp32.

    Returns:
        fp32 ``[k, d]`` on ``x``'s device (not normalised: ColBERT normalises its centroids after training, which
        :meth:`lik.compression.ResidualCodec.train` does).

    Example::

        >>> x = torch.cat([torch.randn(50, 8) * 0.01 + 5, torch.randn(50, 8) * 0.01 - 5])
        >>> c = kmeans(x, 2, seed=0)
        >>> sorted(round(v) for v in c[:, 0].tolist())
        [-5, 5]
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a 2-D tensor [N, d]")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating tensor, got {x.dtype}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"x must have at least one row and one column, got shape {tuple(x.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if isinstance(niters, bool) or not isinstance(niters, int) or niters < 0:
        raise ValueError(f"niters must be a non-negative int, got {niters!r}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x must be finite (no NaN or inf)")
    n, d = x.shape
    generator = torch.Generator().manual_seed(int(seed))
    start = torch.randperm(n, generator=generator)[: min(k, n)]
    if k > n:  # every point once, then the surplus repeats points (moved apart by the empty-cluster rule below)
        extra = torch.randint(0, n, (k - n,), generator=generator)
        start = torch.cat([start, extra])
    centroids = x[start.to(x.device)].float()
    for _ in range(niters):
        codes, dist = assign_to_centroids(x, centroids, matmul_dtype=matmul_dtype)
        sums = torch.zeros(k, d, dtype=torch.float32, device=x.device)
        step = _chunk_rows(k)
        for s in range(0, n, step):
            sums.index_add_(0, codes[s : s + step], x[s : s + step].float())
        counts = torch.bincount(codes, minlength=k)
        filled = counts > 0
        updated = torch.where(filled.unsqueeze(1), sums / counts.clamp_min(1).unsqueeze(1).float(), centroids)
        empty = torch.nonzero(~filled).flatten()
        if empty.numel():
            # Reseed each empty centroid on a distinct far point (stable sort: ties to the lower point index).
            order = torch.sort(dist, descending=True, stable=True).indices[: empty.numel()]
            updated[empty[: order.numel()]] = x[order].float()
        shift = (updated - centroids).norm(dim=1).max()
        centroids = updated
        if empty.numel() == 0 and float(shift) <= tol:
            break
    return centroids
