"""lik.quantize / lik.dequantize: the kernel (through the interpreter on CPU) against the reference, and the
reference against float64 arithmetic."""

import pytest
import torch

import lik
from lik.ops.quantization import QUANTIZED_DTYPES, dequantize_reference, quantize_reference
from lik.ops.quantization.kernel import quantize_rows

QMAX = {torch.int8: 127, torch.float8_e4m3fn: 448}


def _rows(shape, rng, dtype=torch.float32):
    return torch.randn(shape, generator=rng, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dim", [1, 3, 16, 96, 200, 384])
@pytest.mark.parametrize("n_rows", [0, 1, 7, 65])
def test_kernel_matches_reference_bitwise(dim, n_rows, rng):
    x = _rows((n_rows, dim), rng)
    x_q, scale = quantize_rows(x, torch.int8)
    ref_q, ref_scale = quantize_reference(x, torch.int8)
    assert torch.equal(x_q, ref_q)
    assert torch.equal(scale, ref_scale)


def _boundary_rows(qmax, amaxes):
    """float32 rows whose quotients ``x / scale`` lie one float32 step below, on and above every ``k + 0.5`` (int8's
    rounding boundaries), both signs, plus -0 and +0; each row starts with its max, so ``scale = amax / qmax``.
    The kernel multiplies by a reciprocal and corrects once: these are the values a wrong last bit would move."""
    rows = []
    for amax in amaxes:
        amax = torch.tensor(amax, dtype=torch.float32)
        scale = amax / qmax
        half = (torch.arange(-qmax, qmax, dtype=torch.float32) + 0.5) * scale
        near = torch.cat([torch.nextafter(half, half + 1), half, torch.nextafter(half, half - 1)])
        near = near[near.abs() <= amax]
        rows.append(torch.cat([amax.reshape(1), near, torch.tensor([-0.0, 0.0, -amax])]))
    width = max(r.numel() for r in rows)
    return torch.stack([torch.cat([r, r[-1:].expand(width - r.numel())]) for r in rows])


@pytest.mark.parametrize("tiny_row", [False, True])
def test_kernel_quotients_at_rounding_boundaries(tiny_row, rng):
    """Bit-equal to the reference's correctly rounded division where rounding is decided, including -0; a row
    whose scale is below 2**-64 sends its block through the division itself (both branches of the kernel)."""
    amaxes = [1.0, 0.7071, 3.3e-3, 12345.678, 2.0**-60] + torch.rand(6, generator=rng).tolist()
    x = _boundary_rows(127.0, amaxes)
    if tiny_row:
        x[1] = x[1] * 2.0**-120  # scale ~ 2**-127, subnormal: the correction's remainder underflows
        x[0] = x[0] * 2.0**-125  # a subnormal scale whose reciprocal overflows
    x_q, scale = quantize_rows(x, torch.int8)
    ref_q, ref_scale = quantize_reference(x, torch.int8)
    assert torch.equal(x_q, ref_q)
    assert torch.equal(scale, ref_scale)
    assert (x_q[:, 0] == 127).all() and (x_q[:, -1] == -127).all()


@pytest.mark.parametrize("dim", [48, 80, 96, 384])
def test_widths_that_are_not_powers_of_two_take_whole_chunks(dim, rng):
    """A width that is a multiple of 16 but not a power of two is walked in chunks of its largest power-of-two
    divisor (no chunk reaches past the row); a zero row, an inf in the last chunk and a NaN in the second."""
    from lik.ops.quantization.kernel import quantize_tiles

    block_d, _ = quantize_tiles(dim, 9)
    assert dim % block_d == 0 and block_d < dim
    x = _rows((9, dim), rng)
    x[2] = 0.0
    x[3, dim - 1] = float("inf")
    x[4, block_d] = float("nan")
    x_q, scale = quantize_rows(x, torch.int8)
    ref_q, ref_scale = quantize_reference(x, torch.int8)
    assert torch.equal(x_q, ref_q)
    torch.testing.assert_close(scale, ref_scale, rtol=0, atol=0, equal_nan=True)
    assert scale[3].isnan() and scale[4].isnan() and scale[2] == 0


def test_kernel_wide_rows_take_the_chunked_path(rng, monkeypatch):
    import lik.ops.quantization.kernel as kernel

    monkeypatch.setattr(kernel, "_MAX_BLOCK_D", 32)
    x = _rows((5, 100), rng)
    x[2] = 0.0
    x[3, 77] = float("inf")
    x_q, scale = kernel.quantize_rows(x, torch.int8)
    ref_q, ref_scale = quantize_reference(x, torch.int8)
    assert torch.equal(x_q, ref_q)
    torch.testing.assert_close(scale, ref_scale, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_reference_against_float64(dtype, rng):
    x = _rows((40, 64), rng, torch.float64) * 3.0
    x_q, scale = quantize_reference(x, dtype)
    assert x_q.dtype == dtype and scale.dtype == torch.float32 and scale.shape == (40,)
    amax = x.abs().amax(-1)
    torch.testing.assert_close(scale.double(), amax / QMAX[dtype], rtol=1e-6, atol=0)
    values = x_q.double()
    assert values.abs().max() <= QMAX[dtype]
    # Each row's largest element maps to +-qmax; the error is at most half a step (int8) or half an e4m3 ulp.
    assert (values.abs().amax(-1) == QMAX[dtype]).all()
    err = (dequantize_reference(x_q, scale).double() - x).abs()
    if dtype == torch.int8:
        assert (err <= 0.5 * scale.double()[:, None] * (1 + 1e-5)).all()
    else:
        assert (err <= x.abs() * 2.0**-4 + scale.double()[:, None] * 2.0**-9).all()


def test_int8_rounds_half_to_even():
    # amax 127 -> scale exactly 1: the values themselves are rounded.
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 3.49]])
    x_q, scale = lik.quantize(x, torch.int8)
    assert scale.item() == 1.0
    assert x_q.tolist() == [[127, 0, 2, 2, -2, 0, 3]]


@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_zero_and_nonfinite_rows(dtype):
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, float("nan"), 2.0], [float("-inf"), 1.0, 0.0], [1.0, -1.0, 0.25]])
    x_q, scale = lik.quantize(x, dtype)
    assert scale[0].item() == 0.0 and (x_q[0].float() == 0).all()
    assert torch.isnan(scale[1]) and torch.isnan(scale[2])
    assert (x_q[1:3].float() == 0).all()
    back = lik.dequantize(x_q, scale)
    assert (back[0] == 0).all()
    assert torch.isnan(back[1]).all() and torch.isnan(back[2]).all()
    torch.testing.assert_close(back[3], x[3], rtol=0.07, atol=0)


@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_any_leading_shape_noncontiguous_and_empty(dtype, rng):
    base = _rows((3, 8, 2, 24), rng, torch.float16)
    x = base.transpose(1, 2)[..., ::2]  # [3, 2, 8, 12], stride 2 along d
    assert not x.is_contiguous()
    x_q, scale = lik.quantize(x, dtype)
    ref_q, ref_scale = quantize_reference(x, dtype)
    assert x_q.shape == x.shape and scale.shape == x.shape[:-1]
    assert torch.equal(x_q.float(), ref_q.float()) and torch.equal(scale, ref_scale)
    for shape in [(0, 5), (4, 0), (2, 0, 3), (7,)]:
        e_q, e_scale = lik.quantize(torch.ones(shape), dtype)
        assert e_q.shape == shape and e_q.dtype == dtype and e_scale.shape == shape[:-1]
        assert (e_q.float() == QMAX[dtype]).all()
        expected_scale = 0.0 if shape[-1] == 0 else 1.0 / QMAX[dtype]
        torch.testing.assert_close(e_scale, torch.full(shape[:-1], expected_scale))


def test_ties_and_extremes_are_symmetric():
    x = torch.tensor([[-3.0, 3.0, 1.0], [65504.0, -65504.0, 1.0]], dtype=torch.float16)
    x_q, scale = lik.quantize(x, torch.int8)
    assert x_q[:, 0].tolist() == [-127, 127] and x_q[:, 1].tolist() == [127, -127]
    assert torch.isfinite(scale).all()


def test_float64_and_bfloat16_inputs(rng):
    x64 = _rows((6, 10), rng, torch.float64)
    q64, s64 = lik.quantize(x64)
    q32, s32 = lik.quantize(x64.float())
    assert torch.equal(q64, q32) and torch.equal(s64, s32)
    xb = x64.to(torch.bfloat16)
    qb, sb = lik.quantize(xb)
    rq, rs = quantize_reference(xb.float(), torch.int8)
    assert torch.equal(qb, rq) and torch.equal(sb, rs)


def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="x must"):
        lik.quantize([1.0, 2.0])
    with pytest.raises(TypeError, match="x must"):
        lik.quantize(torch.ones(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        lik.quantize(torch.ones(2, 3), torch.float16)
    with pytest.raises(ValueError, match="at least one dimension"):
        lik.quantize(torch.tensor(1.0))
    x_q, scale = lik.quantize(torch.ones(2, 3))
    with pytest.raises(ValueError, match="scale must have shape"):
        lik.dequantize(x_q, scale[:1])
    with pytest.raises(TypeError, match="scale must be float32"):
        lik.dequantize(x_q, scale.double())
    with pytest.raises(TypeError, match="x_q must be"):
        lik.dequantize(x_q.float(), scale)


def test_no_gradient_flows():
    x = torch.randn(3, 8, requires_grad=True)
    x_q, scale = lik.quantize(x)
    assert not x_q.requires_grad and not scale.requires_grad


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [3, 80, 96, 128, 384, 768, 8192, 10000])
def test_gpu_kernel_matches_reference(dtype, in_dtype, dim):
    if dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 on this GPU")
    g = torch.Generator(device="cuda").manual_seed(dim)
    x = torch.randn(257, dim, device="cuda", generator=g).to(in_dtype)
    x[3] = 0
    x[5, dim // 2] = float("nan")
    x_q, scale = lik.quantize(x, dtype)
    ref_q, ref_scale = quantize_reference(x.cpu(), dtype)
    assert torch.equal(x_q.cpu().float(), ref_q.float())
    torch.testing.assert_close(scale.cpu(), ref_scale, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16])
def test_gpu_kernel_every_16_bit_value_bitwise(dtype, in_dtype):
    """Every finite 16-bit input value (subnormals, -0) in rows of 300 different maxima, and the rounding-boundary
    rows, bit for bit against the reference (the byte patterns, so -0 is checked too), both branches of the kernel
    (a tiny-scale row sends its block through the division)."""
    if dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 on this GPU")
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(in_dtype).float()
    values = values[torch.isfinite(values)]
    g = torch.Generator().manual_seed(0)
    maxima = values.abs()[torch.randint(0, values.numel(), (300,), generator=g)]
    maxima[:3] = torch.tensor([values.abs().max().item(), 2.0**-70, 0.0])
    rows = []
    for amax in maxima.tolist():
        inside = values[values.abs() <= amax]
        rows.append(torch.cat([torch.tensor([amax]), inside]))
    width = max(r.numel() for r in rows)
    x = torch.stack([torch.cat([r, r[-1:].expand(width - r.numel())]) for r in rows]).to(in_dtype)
    for batch in (x, _boundary_rows(QMAX[dtype], [1.0, 0.37, 4.2e-3, 900.0]).to(in_dtype)):
        x_q, scale = lik.quantize(batch.cuda(), dtype)
        ref_q, ref_scale = quantize_reference(batch, dtype)
        assert torch.equal(x_q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
        torch.testing.assert_close(scale.cpu(), ref_scale, rtol=0, atol=0, equal_nan=True)
