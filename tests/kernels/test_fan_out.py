"""`kernels.fan_out_linear`: several projections of one input, the input's gradient summed
in the backward's matmuls, against `F.linear` per weight (values and every gradient), and
the modules that use it (a mixer's streams and beta, SwiGLU's gate and up) against their
own forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from archspec.blocks import build_model
from archspec.kernels import fan_out_linear

from ..blocks.plans import COMBINATIONS, model_plan

WIDTHS = (8, 4, 1)  # a stream, a narrower one, beta of one head


def _inputs(dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = torch.randn(3, 5, 16, generator=gen, dtype=dtype, requires_grad=True)
    weights = [torch.randn(width, 16, generator=gen, dtype=dtype, requires_grad=True) for width in WIDTHS]
    return x, weights


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fan_out_equals_each_linear(dtype):
    gen = torch.Generator().manual_seed(0)
    x, weights = _inputs(dtype, gen)
    got = fan_out_linear(x, weights, backend="triton")
    ref = [F.linear(x, w) for w in weights]
    d_outs = [torch.randn(r.shape, generator=gen, dtype=dtype) for r in ref]
    tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **tol)
    names = ["x", *(f"weight {i}" for i in range(len(weights)))]
    for name, a, b in zip(names, torch.autograd.grad(got, [x, *weights], d_outs),
                          torch.autograd.grad(ref, [x, *weights], d_outs)):
        torch.testing.assert_close(a, b, **tol, msg=lambda e, n=name: f"{n}: {e}")


def test_an_output_nobody_reads_and_a_frozen_weight_get_no_gradient():
    gen = torch.Generator().manual_seed(1)
    x, weights = _inputs(torch.float64, gen)
    weights[0].requires_grad_(False)
    outs = fan_out_linear(x, weights, backend="triton")
    dx, d_second, d_third = torch.autograd.grad(outs[0].sum() + outs[2].sum(), [x, weights[1], weights[2]],
                                                allow_unused=True)
    assert d_second is None  # its output was read by nobody
    torch.testing.assert_close(dx, (weights[0].sum(0) + weights[2].sum(0)).expand_as(x))
    torch.testing.assert_close(d_third, x.detach().reshape(-1, 16).sum(0, keepdim=True))


def test_under_autocast_the_products_are_bfloat16_and_the_gradients_keep_their_dtypes():
    """As autocast runs `F.linear`: bfloat16 products of the float32 weights; the
    gradients come back in the input's and the weights' own dtypes, within bfloat16's
    rounding of the plain path's."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 32, generator=gen).bfloat16().requires_grad_()
    weights = [torch.randn(width, 32, generator=gen, requires_grad=True) for width in (16, 16, 2)]
    results = []
    for backend in ("torch", "triton"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = fan_out_linear(x, weights, backend=backend)
        d_outs = [torch.ones_like(o) for o in outs]
        results.append([*outs, *torch.autograd.grad(outs, [x, *weights], d_outs)])
    for plain, joined in zip(*results):
        assert joined.dtype == plain.dtype
        torch.testing.assert_close(joined.float(), plain.float(), atol=3e-2, rtol=2e-2)
    assert [t.dtype for t in results[1][:3]] == [torch.bfloat16] * 3
    assert results[1][3].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in results[1][4:])


def test_fan_out_refuses_weights_of_another_width():
    with pytest.raises(ValueError, match=r"\[out, 16\]"):
        fan_out_linear(torch.randn(2, 16), [torch.randn(4, 16), torch.randn(4, 15)])
    with pytest.raises(ValueError, match="one or more"):
        fan_out_linear(torch.randn(2, 16), [])


@pytest.mark.parametrize("name", ["deltanet-none", "householder-nh2-b2-scalar", "rwkv7-nh2-b2-channel", "noconv-gdn"])
def test_a_model_with_joined_projections_equals_its_own_modules(name):
    """The joined path (`"triton"`) against each module's own forward (`"torch"`): a
    model's loss and every parameter's gradient, float64."""
    torch.manual_seed(0)
    model = build_model(model_plan(COMBINATIONS[name], layers=1)).double()
    ids = torch.randint(0, 13, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    results = {}
    for backend in ("torch", "triton"):
        for module in model.modules():
            if hasattr(module, "fused_backend"):
                module.fused_backend = backend  # the fused pieces only: the recurrence stays on torch
        loss = model(ids, labels=labels)
        results[backend] = [loss, *torch.autograd.grad(loss, list(model.parameters()))]
    for (pname, _), a, b in zip([("loss", None), *model.named_parameters()], results["triton"], results["torch"]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, msg=lambda e, p=pname: f"{p}: {e}")


def test_a_hooked_or_wrapped_projection_keeps_its_own_forward():
    """A forward hook on `proj.k` (a probe, an adapter) and a projection replaced by a
    module of another type both run: the fan-out joins only the plain Linears."""
    torch.manual_seed(0)
    model = build_model(model_plan(COMBINATIONS["deltanet-none"], layers=1)).double()
    model.set_backend("triton")
    mixer = next(iter(model.mixers()))
    seen = []
    mixer.proj["k"].register_forward_hook(lambda module, args, out: seen.append(out.shape))

    class Doubled(torch.nn.Module):
        def __init__(self, linear: torch.nn.Linear):
            super().__init__()
            self.linear = linear

        def forward(self, x):
            return 2 * self.linear(x)

    ids = torch.randint(0, 13, (1, 7), generator=torch.Generator().manual_seed(2))
    before = model(ids).detach()
    mixer.proj["v"] = Doubled(mixer.proj["v"])
    after = model(ids).detach()
    assert len(seen) == 2 and seen[0][-1] == mixer.proj["k"].out_features
    assert not torch.allclose(before, after)  # the wrapper's forward ran
    mixer.proj["v"] = mixer.proj["v"].linear
    torch.testing.assert_close(model(ids).detach(), before)


@pytest.mark.gpu
def test_gpu_fan_out_equals_each_linear_in_autocast():
    """On CUDA the weights' float32 gradients come out of the matmul (`out_dtype`): against
    autocast's `F.linear`, whose bfloat16 products are cast afterwards, and against float64."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 2048, 1024, device="cuda", generator=gen).bfloat16().requires_grad_()
    weights = [(0.03 * torch.randn(width, 1024, device="cuda", generator=gen)).requires_grad_()
               for width in (1024, 1024, 1024, 8)]
    d_outs = [torch.randn(8, 2048, w.shape[0], device="cuda", generator=gen).bfloat16() for w in weights]
    exact = torch.autograd.grad([F.linear(x.double(), w.double()) for w in weights], [x, *weights],
                                [d.double() for d in d_outs])
    errors = {}
    for backend in ("torch", "triton"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs = fan_out_linear(x, weights, backend=backend)
        grads = torch.autograd.grad(outs, [x, *weights], d_outs)
        errors[backend] = [((g.double() - e).norm() / e.norm()).item() for g, e in zip(grads, exact)]
        assert grads[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads[1:])
    for joined, plain in zip(errors["triton"], errors["torch"]):
        assert joined <= 1.5 * plain + 1e-3, (errors["triton"], errors["torch"])
