"""The chunked torch backend against the naive loop (the definition).

Every comparison covers outputs, final states and the gradient of every input, taken
with `torch.autograd.grad` of a random projection of `(o, final_state)`, so that each
output element and each state entry contributes with its own weight.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from archspec.kernels import linear_recurrence, osdn_write_keys
from archspec.kernels.chunked import linear_recurrence_chunked
from archspec.kernels.chunking import TORCH_CHUNK_SIZE as CHUNK_SIZE
from archspec.kernels.osdn_scan import ClippedPreconditionerScan

from .cases import Case, all_cases, make_inputs, tensor_args

F64 = dict(atol=1e-9, rtol=1e-9)


def projected_loss(outputs: tuple[torch.Tensor, ...], seed: int = 1) -> torch.Tensor:
    """A random linear functional of all outputs: its gradient weights every element."""
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for out in outputs:
        weights = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.device)
        total = total + (out.double() * weights).sum()
    return total


def run_with_grads(fn, inputs: dict, **kwargs) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Outputs, final state and the gradient of every differentiable input."""
    o, final = fn(**inputs, output_final_state=True, **kwargs)
    leaves = tensor_args(inputs)
    grads = torch.autograd.grad(projected_loss((o, final)), list(leaves.values()), allow_unused=True)
    return o, final, dict(zip(leaves, grads))


def assert_matches_naive(inputs: dict, chunk_sizes=(None,), **tolerance) -> None:
    tolerance = tolerance or F64
    o_ref, s_ref, g_ref = run_with_grads(linear_recurrence, inputs, backend="naive")
    assert g_ref, "the case has differentiable inputs"
    for chunk_size in chunk_sizes:
        o, s, grads = run_with_grads(linear_recurrence_chunked, inputs, chunk_size=chunk_size)
        torch.testing.assert_close(o, o_ref, **tolerance, msg=lambda m: f"o (chunk {chunk_size}): {m}")
        torch.testing.assert_close(s, s_ref, **tolerance, msg=lambda m: f"final state (chunk {chunk_size}): {m}")
        # Without autograd the chain takes its own path (`_chain_without_grad`).
        with torch.no_grad():
            o_ng, s_ng = linear_recurrence_chunked(**inputs, output_final_state=True, chunk_size=chunk_size)
        torch.testing.assert_close(o_ng, o_ref, **tolerance, msg=lambda m: f"o without grad (chunk {chunk_size}): {m}")
        torch.testing.assert_close(s_ng, s_ref, **tolerance, msg=lambda m: f"final state without grad (chunk {chunk_size}): {m}")
        for name, g in grads.items():
            if g_ref[name] is None:  # an input the path ignores (k of an untied diagonal write)
                assert g is None or not g.any(), f"{name} should not influence the result"
                continue
            assert g is not None, f"no gradient for {name}"
            torch.testing.assert_close(g, g_ref[name], **tolerance, msg=lambda m: f"grad {name} (chunk {chunk_size}): {m}")


@pytest.mark.parametrize("case", all_cases(3), ids=lambda c: c.id)
def test_every_path_matches_naive_float64(case: Case):
    # T = 13: not a multiple of the 7-sub-step chunks (2-3 tokens each for n_h = 2, 3), and
    # shorter than the default chunk (one partial chunk).
    inputs = make_inputs(case, B=2, T=13, H=2, K=6, V=5, seed=zlib.crc32(case.id.encode()) % 1000)
    assert_matches_naive(inputs, chunk_sizes=(7, None))


@pytest.mark.parametrize(
    "case",
    [
        Case(gate="scalar", transition="householder", n_h=5, beta_scale=2.0, initial_state=True),
        Case(gate="channel", transition="householder", n_h=8, write_key="preconditioned"),
        Case(gate="channel", transition="rwkv7", n_h=4, write_key="untied", beta_scale=2.0),
        Case(gate="none", transition="householder", n_h=6),
    ],
    ids=lambda c: c.id,
)
def test_many_substeps_match_naive(case: Case):
    inputs = make_inputs(case, B=1, T=7, H=2, K=4, V=3, seed=3)
    assert_matches_naive(inputs, chunk_sizes=(16, None))


def test_erase_with_beta_matches_naive():
    # rwkv7 with a given write strength b = beta (make_inputs drops beta for rwkv7).
    case = Case(gate="scalar", transition="rwkv7", n_h=2, write_key="untied", initial_state=True)
    inputs = make_inputs(case, B=2, T=9, H=2, K=5, V=4, seed=4)
    inputs["beta"] = torch.rand(2, 18, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_()
    assert_matches_naive(inputs, chunk_sizes=(6, None))


def test_write_only_path_over_many_chunks():
    # No beta, no erase (diagonal): an untied key and an initial state across five chunks.
    case = Case(gate="channel", transition="diagonal", write_key="untied", initial_state=True)
    assert_matches_naive(make_inputs(case, B=2, T=40, H=1, K=4, V=3, seed=6), chunk_sizes=(8,))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_strong_decays_over_long_chunks_stay_finite(gate: str, dtype: torch.dtype):
    # Log-gates of about -25 per token: within one default chunk the decay accumulates past
    # -709, so the usual exp(-G) factor would overflow even float64; the chunked form only
    # evaluates decay ratios with exponent <= 0.
    case = Case(gate=gate, transition="householder", n_h=1, initial_state=True)
    inputs = make_inputs(case, B=1, T=2 * CHUNK_SIZE, H=2, K=4, V=3, seed=7, gate_strength=60.0)
    assert inputs["g"][:, :CHUNK_SIZE].sum(1).max() < -709  # the regime this test is about
    # The chunk is set explicitly: the default for a delta rule is shorter than CHUNK_SIZE,
    # and the test needs the decay within one chunk past -709.
    leaves = {n: (x.detach().to(dtype).requires_grad_() if n != "n_h" else x) for n, x in inputs.items()}
    o, s, grads = run_with_grads(linear_recurrence_chunked, leaves, chunk_size=CHUNK_SIZE)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert all(torch.isfinite(g).all() for g in grads.values())
    if dtype == torch.float64:
        assert_matches_naive(inputs, chunk_sizes=(CHUNK_SIZE,))
    else:
        o_ref, s_ref, _ = run_with_grads(linear_recurrence, inputs, backend="naive")
        torch.testing.assert_close(o.double(), o_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s.double(), s_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "case",
    [Case(gate="scalar", transition="householder", n_h=2), Case(gate="channel", transition="rwkv7", n_h=1, write_key="untied")],
    ids=lambda c: c.id,
)
def test_low_precision_inputs_accumulate_in_float32(case: Case, dtype: torch.dtype):
    low = make_inputs(case, B=2, T=40, H=2, K=8, V=8, dtype=dtype, seed=8)
    # The reference: the same (rounded) inputs, in float64.
    ref = {n: (x.detach().double().requires_grad_() if isinstance(x, torch.Tensor) else x) for n, x in low.items()}
    o_ref, s_ref, g_ref = run_with_grads(linear_recurrence, ref, backend="naive")
    o, s, grads = run_with_grads(linear_recurrence_chunked, low, chunk_size=16)
    assert o.dtype == dtype and s.dtype == torch.float32
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(o.double(), o_ref.to(dtype).double(), **tol)
    torch.testing.assert_close(s.double(), s_ref, **tol)
    for name, g in grads.items():
        scale = g_ref[name].abs().max().item()
        err = (g.double() - g_ref[name]).abs().max().item()
        assert err <= tol["atol"] * max(1.0, scale) * 10, f"grad {name}: max error {err:.3g} (scale {scale:.3g})"


def test_cu_seqlens_equals_each_sequence_alone_without_leakage():
    case = Case(gate="channel", transition="householder", n_h=2, initial_state=True)
    offsets = [0, 5, 5, 13, 20]  # includes an empty sequence
    N, T = len(offsets) - 1, offsets[-1]
    packed = make_inputs(case, B=1, T=T, H=2, K=4, V=3, seed=9)
    packed["initial_state"] = torch.randn(N, 2, 4, 3, dtype=torch.float64).requires_grad_()
    cu = torch.tensor(offsets)
    assert_matches_naive({**packed, "cu_seqlens": cu}, chunk_sizes=(6, None))

    o, s = linear_recurrence_chunked(**packed, cu_seqlens=cu, output_final_state=True, chunk_size=6)
    for n in range(N):
        tok = slice(offsets[n], offsets[n + 1])
        sub = slice(2 * offsets[n], 2 * offsets[n + 1])
        alone = {
            "q": packed["q"][:, tok], "k": packed["k"][:, sub], "v": packed["v"][:, sub], "g": packed["g"][:, tok],
            "beta": packed["beta"][:, sub], "n_h": 2, "initial_state": packed["initial_state"][n : n + 1],
        }
        o_n, s_n = linear_recurrence(**alone, output_final_state=True, backend="naive")
        torch.testing.assert_close(o[:, tok], o_n, **F64)
        torch.testing.assert_close(s[n : n + 1], s_n, **F64)

    # No leakage: changing the third sequence changes nothing in the others.
    changed = {n: (x.detach().clone() if isinstance(x, torch.Tensor) else x) for n, x in packed.items()}
    changed["v"][:, 10:26] += 1.0
    o2, s2 = linear_recurrence_chunked(**changed, cu_seqlens=cu, output_final_state=True, chunk_size=6)
    torch.testing.assert_close(o2[:, :5], o[:, :5].detach(), **F64)
    torch.testing.assert_close(o2[:, 13:], o[:, 13:].detach(), **F64)
    assert (o2[:, 5:13] - o[:, 5:13]).abs().max() > 1e-3


def test_empty_sequence_returns_initial_state():
    inputs = make_inputs(Case(gate="scalar", initial_state=True), B=2, T=0, H=1, K=3, V=2)
    o, s = linear_recurrence_chunked(**inputs, output_final_state=True)
    assert o.shape == (2, 0, 1, 2)
    torch.testing.assert_close(s, inputs["initial_state"].detach(), **F64)


@pytest.mark.gpu
def test_cuda_matches_naive():
    for case in (Case(gate="channel", transition="householder", n_h=2), Case(gate="scalar", transition="rwkv7", write_key="untied")):
        assert_matches_naive(make_inputs(case, B=2, T=50, H=2, K=8, V=8, seed=10, device="cuda"), chunk_sizes=(16, None))


# ---------------------------------------------------------------------------------------
# OSDN write keys


def osdn_inputs(B=2, T=12, n_h=1, H=2, K=4, *, retain=False, d0_shape=None, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    k = F.normalize(torch.randn(B, T * n_h, H, K, generator=gen, dtype=torch.float64), dim=-1)
    args = {"k": k, "beta": torch.sigmoid(torch.randn(B, T * n_h, H, generator=gen, dtype=torch.float64))}
    if retain:
        args["retain"] = 0.6 + 0.4 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    if d0_shape is not None:
        args["d0"] = 0.6 + 1.2 * torch.rand(*d0_shape, generator=gen, dtype=torch.float64)
    return {n: x.requires_grad_() for n, x in args.items()}


def assert_osdn_matches_naive(inputs: dict, **settings) -> tuple[torch.Tensor, torch.Tensor]:
    results = {}
    for backend in ("naive", "torch"):
        w, d = osdn_write_keys(**inputs, **settings, backend=backend)
        leaves = [x for x in inputs.values() if isinstance(x, torch.Tensor) and x.requires_grad]
        grads = torch.autograd.grad(projected_loss((w, d)), leaves, allow_unused=True)
        results[backend] = (w, d, grads)
    (w_ref, d_ref, g_ref), (w, d, grads) = results["naive"], results["torch"]
    torch.testing.assert_close(w, w_ref, **F64)
    torch.testing.assert_close(d, d_ref, **F64)
    names = [n for n, x in inputs.items() if isinstance(x, torch.Tensor) and x.requires_grad]
    for name, g, gr in zip(names, grads, g_ref):
        if gr is None:  # beta is unused by the beta-free rule
            assert g is None or g.abs().max() == 0, name
            continue
        torch.testing.assert_close(g, gr, **F64, msg=lambda m: f"grad {name}: {m}")
    return w_ref, d_ref


@pytest.mark.parametrize("beta_aware", [True, False], ids=["beta-aware", "beta-free"])
def test_osdn_matches_naive_with_clipping(beta_aware: bool):
    # A large eta drives d into both bounds, so clipped and free steps are both covered.
    inputs = osdn_inputs(T=30, d0_shape=(2, 4), seed=1)
    _, d = assert_osdn_matches_naive(inputs, eta=0.8, d_min=0.7, d_max=1.3, beta_aware=beta_aware)
    w_all, _ = osdn_write_keys(**{n: x.detach() for n, x in inputs.items()}, eta=0.8, d_min=0.7, d_max=1.3, beta_aware=beta_aware, backend="naive")
    d_traj = w_all / inputs["k"].detach()
    assert (d_traj - 1.3).abs().min() < 1e-12 or (d_traj - 0.7).abs().min() < 1e-12, "no clipping happened"


def test_osdn_apf_with_substeps_and_per_batch_d0():
    inputs = osdn_inputs(B=2, T=8, n_h=3, retain=True, d0_shape=(2, 2, 4), seed=2)
    assert_osdn_matches_naive(inputs, eta=0.3)


def test_osdn_cu_seqlens_restarts_d():
    offsets = [0, 4, 4, 11]
    inputs = osdn_inputs(B=1, T=11, n_h=2, retain=True, d0_shape=(3, 2, 4), seed=3)
    cu = torch.tensor(offsets)
    assert_osdn_matches_naive({**inputs, "cu_seqlens": cu}, eta=0.3)
    # The restart: the second non-empty sequence alone gives the same keys and final d.
    w, d = osdn_write_keys(**inputs, cu_seqlens=cu, eta=0.3, backend="torch")
    alone = {"k": inputs["k"][:, 8:], "beta": inputs["beta"][:, 8:], "retain": inputs["retain"][:, 4:], "d0": inputs["d0"][2:3]}
    w2, d2 = osdn_write_keys(**alone, eta=0.3, backend="torch")
    torch.testing.assert_close(w[:, 8:], w2, **F64)
    torch.testing.assert_close(d[2:3], d2, **F64)


def graph_size(t: torch.Tensor) -> int:
    """Number of autograd nodes reachable from `t`."""
    seen, stack = set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return len(seen)


def test_osdn_graph_does_not_grow_with_length():
    short, long = (osdn_inputs(T=T, n_h=2, retain=True, d0_shape=(2, 4)) for T in (4, 300))
    sizes = [graph_size(osdn_write_keys(**x, backend="torch")[0]) for x in (short, long)]
    assert sizes[0] == sizes[1] < 40
    assert graph_size(osdn_write_keys(**short, backend="naive")[0]) > sizes[0]  # the loop's graph grows


def test_osdn_scan_gradcheck():
    gen = torch.Generator().manual_seed(4)
    TN, B, H, K = 5, 1, 2, 3
    s = torch.rand(TN, B, H, K, generator=gen, dtype=torch.float64)
    c = 0.2 * torch.rand(TN, B, H, 1, generator=gen, dtype=torch.float64)
    b = torch.rand(TN, B, H, 1, generator=gen, dtype=torch.float64)
    rho = 0.8 + 0.2 * torch.rand(TN, B, H, 1, generator=gen, dtype=torch.float64)
    d0 = 0.8 + 0.4 * torch.rand(B, H, K, generator=gen, dtype=torch.float64)
    # Bounds far from the trajectory: finite differences never cross a clip kink.
    fn = lambda *xs: ClippedPreconditionerScan.apply(*xs, 0.01, 100.0)  # noqa: E731
    assert torch.autograd.gradcheck(fn, [x.requires_grad_() for x in (s, c, b, rho, d0)])
