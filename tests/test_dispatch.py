"""The dispatch helpers: which door a kernel call takes (eager launch or custom operator) and which of the four
paths a public call takes (reference, autograd Function, compiled inference, eager inference).

A toy op (``y = 2 x``, its own custom operator) checks the helpers in isolation, recording each call; then the
real ops check that eager inference reaches the launcher with no autograd node and that every path still gives
the reference's values. ``torch.compile(fullgraph=True)`` runs with the ``aot_eager`` backend (it traces forward
and backward as inductor would, without generating code), kernels through the interpreter on CPU.
"""

from __future__ import annotations

import pytest
import torch

import lik
from lik._dispatch import kernel_op, router
from lik.ops.maxsim import function as maxsim_function
from lik.ops.maxsim.reference import maxsim_reference
from lik.ops.msda import function as msda_function
from lik.ops.msda.reference import ms_deform_attn_reference

CALLS: list[str] = []
FP32 = dict(atol=1e-5, rtol=1e-5)  # float32 kernels against the float64 reference


def _double_fake(x):
    return torch.empty_like(x)


@kernel_op("lik_test::double", fake=_double_fake)
def _double(x: torch.Tensor) -> torch.Tensor:
    CALLS.append("launcher")
    return x * 2


def _double_grad_fake(grad):
    return torch.empty_like(grad)


@kernel_op("lik_test::double_grad", fake=_double_grad_fake)
def _double_grad(grad: torch.Tensor) -> torch.Tensor:
    CALLS.append("launcher_backward")
    return grad * 2


class _DoubleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        CALLS.append("function")
        return _double(x)

    @staticmethod
    def backward(ctx, grad):
        return _double_grad(grad)


def _reference(x):
    CALLS.append("reference")
    return x * 2


def _launch(x):
    CALLS.append("launch")
    return _double.launch(x)


def _compiled(x):
    CALLS.append("compiled")
    return _double.op(x)


_route = router(reference=_reference, autograd=_DoubleFunction.apply, compiled=_compiled, launch=_launch)


def _toy(x: torch.Tensor, kernels: bool = True) -> torch.Tensor:
    return _route(kernels, torch.is_grad_enabled() and x.requires_grad, x)


@pytest.fixture(autouse=True)
def _clear_calls():
    CALLS.clear()
    yield
    CALLS.clear()


def test_kernel_op_eager_calls_the_launcher_itself():
    x = torch.arange(4.0)
    assert torch.equal(_double(x), 2 * x)
    assert CALLS == ["launcher"]
    assert _double.launch.__name__ == _double.__name__ == "_double"
    # The same function is the operator's implementation, so both doors agree.
    assert torch.equal(torch.ops.lik_test.double(x), 2 * x)
    assert torch.equal(_double.op(x), 2 * x)


def test_route_reference_when_kernels_do_not_apply():
    x = torch.arange(3.0, requires_grad=True)
    y = _toy(x, kernels=False)
    assert CALLS == ["reference"]
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_route_eager_inference_launches_directly():
    x = torch.arange(3.0)
    y = _toy(x)
    assert CALLS == ["launch", "launcher"]
    assert y.grad_fn is None and torch.equal(y, 2 * x)


@pytest.mark.parametrize("no_grad", [True, False])
def test_route_without_grad_skips_the_function(no_grad):
    # A leaf that requires grad under no_grad, or one that does not: either way no autograd node.
    x = torch.arange(3.0, requires_grad=no_grad)
    with torch.set_grad_enabled(not no_grad):
        y = _toy(x)
    assert CALLS == ["launch", "launcher"] and y.grad_fn is None


def test_route_grad_uses_the_function_and_its_backward():
    x = torch.arange(3.0, requires_grad=True)
    y = _toy(x)
    assert CALLS == ["function", "launcher"]
    y.backward(torch.ones(3))
    assert CALLS[-1] == "launcher_backward"
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_route_compiled_uses_the_custom_operators():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: _toy(x) + 1, backend="aot_eager", fullgraph=True)
    x = torch.arange(3.0)
    assert torch.equal(compiled(x), 2 * x + 1)
    # Dynamo traced through `compiled` (recorded once while tracing), and the graph calls the operator.
    assert "compiled" in CALLS and "launch" not in CALLS
    xg = torch.arange(3.0, requires_grad=True)
    compiled(xg).sum().backward()
    assert torch.equal(xg.grad, torch.full((3,), 2.0))


# ------------------------------------------------------------------------------------------------------------
# The real ops
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture
def maxsim_problem(rng):
    q = torch.randn(2, 5, 16, generator=rng)
    d = torch.randn(3, 7, 16, generator=rng)
    d_mask = torch.rand(3, 7, generator=rng) > 0.3
    return q, d, d_mask


def _spy(monkeypatch, module, name, seen):
    original = getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


def test_maxsim_eager_inference_launches_without_autograd(monkeypatch, maxsim_problem):
    q, d, d_mask = maxsim_problem
    seen: list[str] = []
    _spy(monkeypatch, maxsim_function, "launch_forward", seen)
    got = lik.maxsim(q, d, d_mask=d_mask)
    assert seen == ["launch_forward"] and got.grad_fn is None
    torch.testing.assert_close(got.double(), maxsim_reference(q.double(), d.double(), d_mask=d_mask), **FP32)


def test_maxsim_paths_agree(maxsim_problem):
    q, d, d_mask = maxsim_problem
    want = maxsim_reference(q.double(), d.double(), d_mask=d_mask)
    qg, dg = q.clone().requires_grad_(), d.clone().requires_grad_()
    trained = lik.maxsim(qg, dg, d_mask=d_mask)
    assert trained.grad_fn is not None and "MaxSimFunction" in type(trained.grad_fn).__name__
    trained.sum().backward()
    qr, dr = q.double().requires_grad_(), d.double().requires_grad_()
    reference = lik.maxsim(qr, dr, d_mask=d_mask)  # float64: the reference path
    assert reference.dtype == torch.float64
    reference.sum().backward()
    torch.testing.assert_close(trained.double(), want, **FP32)
    torch.testing.assert_close(reference, want)
    torch.testing.assert_close(qg.grad.double(), qr.grad, **FP32)
    torch.testing.assert_close(dg.grad.double(), dr.grad, **FP32)


def test_maxsim_eager_training_takes_the_callers_tensors_as_they_are(rng):
    """Eager training is one autograd node over the caller's ``Q`` and ``D`` (no node for the canonical views) and
    gives each gradient in its tensor's shape and dtype, a 2-D query included."""
    Q = torch.randn(5, 16, generator=rng).requires_grad_()
    D = torch.randn(3, 7, 16, generator=rng).requires_grad_()
    scores = lik.maxsim(Q, D)
    assert type(scores.grad_fn).__name__ == "EagerMaxSimFunctionBackward" and scores.shape == (3,)
    assert [f[0].variable is t for f, t in zip(scores.grad_fn.next_functions[:2], (Q, D))] == [True, True]
    gq, gd = torch.autograd.grad(scores.sum(), (Q, D))
    reference = lik.maxsim(Q.double(), D.double())
    rq, rd = torch.autograd.grad(reference.sum(), (Q, D))
    assert gq.shape == Q.shape and gd.shape == D.shape
    torch.testing.assert_close(gq, rq.float(), **FP32)
    torch.testing.assert_close(gd, rd.float(), **FP32)


def test_score_canonical_routes_validated_inputs_without_checking_them_again(monkeypatch, maxsim_problem):
    """The internal entry of callers that validated once: the same route and scores as lik.maxsim, no check."""
    from lik.ops.maxsim.validation import MaxSimInputs

    q, d, d_mask = maxsim_problem
    inputs = MaxSimInputs.build(q, d, None, d_mask)
    monkeypatch.setattr(MaxSimInputs, "build", classmethod(lambda *a, **k: pytest.fail("validated again")))
    got = maxsim_function.score_canonical(inputs)
    monkeypatch.undo()
    assert got.shape == (2, 3) and got.grad_fn is None
    torch.testing.assert_close(got, lik.maxsim(q, d, d_mask=d_mask))
    qg = q.clone().requires_grad_()
    trained = maxsim_function.score_canonical(MaxSimInputs.build(qg, d, None, d_mask), needs_grad=True)
    assert "MaxSimFunction" in type(trained.grad_fn).__name__
    torch.testing.assert_close(trained, got)


@pytest.mark.parametrize("grad", [False, True])
def test_maxsim_compiled_fullgraph(maxsim_problem, grad):
    q, d, d_mask = maxsim_problem
    torch._dynamo.reset()
    score = torch.compile(lambda q, d: lik.maxsim(q, d, d_mask=d_mask), backend="aot_eager", fullgraph=True)
    qc, dc = q.clone().requires_grad_(grad), d.clone().requires_grad_(grad)
    qe, de = q.clone().requires_grad_(grad), d.clone().requires_grad_(grad)
    got, want = score(qc, dc), lik.maxsim(qe, de, d_mask=d_mask)
    assert torch.equal(got, want)
    if grad:
        got.square().sum().backward()
        want.square().sum().backward()
        assert torch.equal(qc.grad, qe.grad) and torch.equal(dc.grad, de.grad)


@pytest.fixture
def msda_problem(rng):
    shapes = torch.tensor([[3, 4], [2, 2]])
    starts = torch.tensor([0, 12])
    value = torch.randn(2, 16, 2, 8, generator=rng)
    loc = torch.rand(2, 5, 2, 2, 3, 2, generator=rng)
    weights = torch.rand(2, 5, 2, 2, 3, generator=rng)
    return value, shapes, starts, loc, weights


def test_msda_eager_inference_launches_without_autograd(monkeypatch, msda_problem):
    seen: list[str] = []
    # The route holds the launcher itself: spy on the kernel launch one level down.
    import lik.ops.msda.forward as msda_forward_module

    _spy(monkeypatch, msda_forward_module, "launch", seen)
    got = lik.ms_deform_attn(*msda_problem)
    assert seen == ["launch"] and got.grad_fn is None
    want = ms_deform_attn_reference(*(t.double() if t.is_floating_point() else t for t in msda_problem))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_msda_paths_agree(msda_problem):
    value, shapes, starts, loc, weights = msda_problem
    vg, lg, wg = (t.clone().requires_grad_() for t in (value, loc, weights))
    trained = lik.ms_deform_attn(vg, shapes, starts, lg, wg)
    assert trained.grad_fn is not None
    trained.square().sum().backward()
    vr, lr, wr = (t.double().requires_grad_() for t in (value, loc, weights))
    reference = lik.ms_deform_attn(vr, shapes, starts, lr, wr)  # float64: the reference path
    reference.square().sum().backward()
    torch.testing.assert_close(trained.double(), reference, atol=1e-5, rtol=1e-5)
    for got, want in ((vg, vr), (lg, lr), (wg, wr)):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("grad", [False, True])
def test_msda_compiled_fullgraph(msda_problem, grad):
    value, shapes, starts, loc, weights = msda_problem
    torch._dynamo.reset()
    call = torch.compile(lambda v, lc, w: lik.ms_deform_attn(v, shapes, starts, lc, w), backend="aot_eager",
                         fullgraph=True)
    compiled_inputs = [t.clone().requires_grad_(grad) for t in (value, loc, weights)]
    eager_inputs = [t.clone().requires_grad_(grad) for t in (value, loc, weights)]
    got = call(*compiled_inputs)
    want = lik.ms_deform_attn(eager_inputs[0], shapes, starts, *eager_inputs[1:])
    assert torch.equal(got, want)
    if grad:
        got.square().sum().backward()
        want.square().sum().backward()
        for a, b in zip(compiled_inputs, eager_inputs):
            assert torch.equal(a.grad, b.grad)


def test_operator_names_are_kept():
    """Compiled graphs and saved programs name the operators: the helper registers them under the same names."""
    for name in ("maxsim_forward", "maxsim_backward_dq", "maxsim_backward_dd", "msda_forward", "msda_backward"):
        assert hasattr(torch.ops.lik, name), name
    assert maxsim_function._forward.op._qualname == "lik::maxsim_forward"
    assert msda_function._backward_kernels.op._qualname == "lik::msda_backward"


@pytest.mark.gpu
def test_gpu_inference_and_autograd_paths_give_the_same_forward(maxsim_problem, msda_problem):
    """On the GPU, eager inference (direct launch), the autograd Function and torch.compile run the same kernels."""
    q, d, d_mask = (t.cuda() for t in maxsim_problem)
    q, d = q.half(), d.half()
    inference = lik.maxsim(q, d, d_mask=d_mask)
    trained = lik.maxsim(q.clone().requires_grad_(), d, d_mask=d_mask)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, d: lik.maxsim(q, d, d_mask=d_mask), fullgraph=True)(q, d)
    assert inference.grad_fn is None and trained.grad_fn is not None
    assert torch.equal(inference, trained.detach()) and torch.equal(inference, compiled)
    value, shapes, starts, loc, weights = (t.cuda() for t in msda_problem)
    inference = lik.ms_deform_attn(value, shapes, starts, loc, weights)
    trained = lik.ms_deform_attn(value.clone().requires_grad_(), shapes, starts, loc, weights)
    assert inference.grad_fn is None and torch.equal(inference, trained.detach())


def test_one_query_and_mask_check_for_padded_and_packed_scorers(rng):
    """lik.maxsim and lik.maxsim_packed check a query's mask the same way (one function), with the same message."""
    from lik.ops.maxsim.validation import canonical_query

    Q = torch.randn(2, 5, 16, generator=rng)
    d, cu_d, _ = lik.pack([torch.randn(n, 16, generator=rng) for n in (3, 7)])
    bad = torch.ones(2, 6, dtype=torch.bool)
    messages = []
    for call in (lambda: lik.maxsim(Q, torch.randn(2, 7, 16), bad), lambda: lik.maxsim_packed(Q, d, cu_d, bad)):
        with pytest.raises(ValueError, match="q_mask must have shape") as error:
            call()
        messages.append(str(error.value))
    assert messages[0] == messages[1]
    q, q_mask, squeeze = canonical_query(Q[0], torch.tensor([1, 0, 1, 1, 0]))  # integer 0/1 masks are accepted
    assert q.shape == (1, 5, 16) and q_mask.dtype == torch.bool and q_mask.shape == (1, 5) and squeeze
