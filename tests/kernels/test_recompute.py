"""`linear_recurrence`'s `recompute`: an input the Triton backend forms again in its
backward from a recipe, instead of keeping it. Against the same call keeping every input:
the same output and every gradient, bit for bit; the input's storage is not among the
saved tensors; a second backward through a retained graph; a recipe that forms something
else is refused; bad arguments are named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from archspec.kernels import Recompute, linear_recurrence, short_conv  # noqa: E402

B, T, H, K, V = 2, 40, 2, 16, 16
# The Triton backend on CUDA where there is one, else under the interpreter (conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _streams(seed: int = 0):
    """Leaf projections and a conv weight; q, k, v are their short convs (SiLU, unit q and k),
    as a mixer forms them, each with its recipe."""
    gen = torch.Generator().manual_seed(seed)
    leaves = {name: torch.randn(B, T, H * width, generator=gen, dtype=torch.float32).to(DEVICE).requires_grad_()
              for name, width in (("q", K), ("k", K), ("v", V))}
    weight = torch.randn(H * K, 1, 4, generator=gen).to(DEVICE).requires_grad_()
    weight_v = torch.randn(H * V, 1, 4, generator=gen).to(DEVICE).requires_grad_()
    recipes = {}
    out = {}
    for name, w, head in (("q", weight, K), ("k", weight, K), ("v", weight_v, 0)):
        width = K if name != "v" else V
        recipe = Recompute(short_conv, (leaves[name], w), dict(activation=True, head_dim=head, backend="triton"),
                           (B, T, H, width))
        out[name] = short_conv(leaves[name], w, activation=True, head_dim=head, backend="triton").reshape(B, T, H, width)
        recipes[name] = recipe
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).to(DEVICE).requires_grad_()
    return leaves, (weight, weight_v), out, recipes, beta


def _run(recompute: bool, seed: int = 0):
    leaves, weights, x, recipes, beta = _streams(seed)
    saved: list[int] = []

    def pack(t):
        saved.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, _ = linear_recurrence(x["q"], x["k"], x["v"], beta=beta, recompute=recipes if recompute else None,
                                 backend="triton")
    inputs = [*leaves.values(), *weights, beta]
    grads = torch.autograd.grad((o * torch.linspace(-1, 1, V, device=DEVICE)).sum(), inputs)
    stream_storages = {x[n].untyped_storage().data_ptr() for n in "qkv"}
    return o, grads, stream_storages & set(saved)


def test_formed_again_equals_kept_and_is_not_saved():
    o_kept, grads_kept, kept = _run(False)
    o_again, grads_again, again = _run(True)
    assert kept and not again  # keeping them saves the streams; with recipes none of them
    assert torch.equal(o_kept, o_again)
    for a, b in zip(grads_kept, grads_again):
        assert torch.equal(a, b)


def test_a_retained_graph_forms_them_again_each_backward():
    leaves, weights, x, recipes, beta = _streams(1)
    o, _ = linear_recurrence(x["q"], x["k"], x["v"], beta=beta, recompute=recipes, backend="triton")
    first = torch.autograd.grad(o.sum(), [leaves["q"], beta], retain_graph=True)
    second = torch.autograd.grad(o.sum(), [leaves["q"], beta])
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_a_recipe_that_forms_something_else_is_refused():
    leaves, weights, x, recipes, beta = _streams(2)
    wrong = Recompute(F.silu, (leaves["q"],), {}, (B, T, H * K))  # the wrong shape
    o, _ = linear_recurrence(x["q"], x["k"], x["v"], beta=beta, recompute={"q": wrong}, backend="triton")
    with pytest.raises(RuntimeError, match=r"the recompute of q gave \(2, 40, 32\)"):
        o.sum().backward()


def test_bad_recompute_arguments_are_named():
    _, _, x, recipes, beta = _streams(3)
    with pytest.raises(ValueError, match=r"recompute names \['o'\]; it takes \['q', 'k', 'v', 'write_key', 'g'\]"):
        linear_recurrence(x["q"], x["k"], x["v"], beta=beta, recompute={"o": recipes["q"]}, backend="triton")
    with pytest.raises(ValueError, match="map input names to kernels.recompute.Recompute"):
        linear_recurrence(x["q"], x["k"], x["v"], beta=beta, recompute={"q": lambda: x["q"]}, backend="triton")
    with pytest.raises(ValueError, match="a write_key recipe but no write_key"):
        linear_recurrence(x["q"], x["k"], x["v"], beta=beta, recompute={"write_key": recipes["k"]}, backend="triton")
    with pytest.raises(ValueError, match="a g recipe but no g"):
        linear_recurrence(x["q"], x["k"], x["v"], beta=beta, recompute={"g": recipes["k"]}, backend="triton")


def test_the_torch_backends_ignore_recipes():
    _, _, x, recipes, beta = _streams(4)  # (the torch backend runs on either device)
    want, _ = linear_recurrence(x["q"], x["k"], x["v"], beta=beta, backend="torch")
    got, _ = linear_recurrence(x["q"], x["k"], x["v"], beta=beta, recompute=recipes, backend="torch")
    assert torch.equal(got, want)


@pytest.mark.parametrize("channel", [False, True], ids=["scalar", "channel"])
def test_a_gate_formed_again_keeps_neither_it_nor_its_chunk_sums(channel):
    """The gate's recipe (its log decay from the projection, `gate_log_decay`): the float32
    chunk sums are not saved, every gradient is the one of keeping them."""
    from archspec.kernels import gate_log_decay

    gen = torch.Generator().manual_seed(5)
    _, _, x, recipes, beta = _streams(5)
    shape = (B, T, H, K) if channel else (B, T, H)
    A_log = torch.randn(H, *([1] if channel else []), generator=gen).to(DEVICE).requires_grad_()
    proj = torch.randn(shape, generator=gen).to(DEVICE).requires_grad_()
    bias = torch.randn(shape[2:], generator=gen).to(DEVICE).requires_grad_()
    results = []
    for with_recipe in (False, True):
        g = gate_log_decay(A_log, proj, bias, backend="triton")
        again = dict(recipes, g=Recompute(gate_log_decay, (A_log, proj, bias), dict(backend="triton")))
        floats: list[int] = []

        def pack(t):
            if t.dtype == torch.float32 and t.shape == shape:
                floats.append(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o, _ = linear_recurrence(x["q"], x["k"], x["v"], g=g, beta=beta, recompute=again if with_recipe else recipes,
                                     backend="triton")
        # `proj` (saved by the gate) and a scalar gate's `beta` have the gate's shape and
        # dtype here: only the kernel's chunk sums count
        others = {t.untyped_storage().data_ptr() for t in (proj, beta)}
        kernel_floats = [ptr for ptr in floats if ptr not in others]
        assert bool(kernel_floats) != with_recipe
        results.append([o, *torch.autograd.grad(o.sum(), [A_log, proj, bias, beta])])
    for a, b in zip(*results):
        assert torch.equal(a, b)
