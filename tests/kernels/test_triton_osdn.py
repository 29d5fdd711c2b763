"""The Triton OSDN phase-1 scan against the naive loop: write keys, final `d`, gradients.

Retain gates near 1 and a large `eta` keep most steps away from the clip bounds, so
that the gradients flow through many steps (a clipped step passes none).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from archspec.kernels import osdn_write_keys

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(B, T, H, K, n_h, *, retain: bool, d0: str, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    TN = T * n_h
    norms = 0.5 + torch.rand(B, TN, H, 1, generator=gen, dtype=torch.float64)  # keys of varied length
    out = {
        "k": F.normalize(torch.randn(B, TN, H, K, generator=gen, dtype=torch.float64), dim=-1) * norms,
        "beta": torch.rand(B, TN, H, generator=gen, dtype=torch.float64),
    }
    if retain:
        out["retain"] = 0.9 + 0.1 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    if d0 == "shared":
        out["d0"] = 0.6 + 1.2 * torch.rand(H, K, generator=gen, dtype=torch.float64)
    elif d0 == "per_sequence":
        out["d0"] = 0.6 + 1.2 * torch.rand(B, H, K, generator=gen, dtype=torch.float64)
    return {k: v.to(DEVICE).requires_grad_() for k, v in out.items()}


def _run(inputs: dict, backend: str, **options) -> list[torch.Tensor]:
    w, d = osdn_write_keys(inputs["k"], inputs["beta"], retain=inputs.get("retain"), d0=inputs.get("d0"),
                           backend=backend, **options)
    gen = torch.Generator().manual_seed(11)
    dw = torch.randn(w.shape, generator=gen, dtype=torch.float64).to(w)
    dd = torch.randn(d.shape, generator=gen, dtype=torch.float64).to(d)
    leaves = list(inputs.values())
    grads = torch.autograd.grad((w * dw).sum() + (d * dd).sum(), leaves, allow_unused=True)
    return [w, d] + [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]


def _compare(got: list[torch.Tensor], want: list[torch.Tensor], names: list[str], tol: float) -> None:
    for name, g, w in zip(names, got, want):
        assert torch.isfinite(g).all(), name
        err = ((g.double().cpu() - w.double().cpu()).norm() / w.norm().clamp_min(1e-12)).item()
        assert err < tol, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize(
    "n_h,beta_aware,retain,d0",
    [(n_h, aware, ret, d0) for (n_h, aware), (ret, d0) in zip(
        itertools.product((1, 2, 3), (True, False)),
        itertools.cycle([(False, "ones"), (True, "shared"), (True, "per_sequence")]),
    )],
)
def test_osdn_matches_naive(n_h: int, beta_aware: bool, retain: bool, d0: str) -> None:
    inputs = _inputs(2, 12, 2, 16, n_h, retain=retain, d0=d0, seed=n_h)
    options = dict(eta=0.3, beta_aware=beta_aware)
    names = ["write_key", "d_final"] + ["d_" + n for n in inputs]
    _compare(_run(inputs, "triton", **options), _run(inputs, "naive", **options), names, tol=1e-10)


def test_osdn_packed_sequences_restart_d() -> None:
    inputs = _inputs(1, 20, 2, 16, 2, retain=True, d0="none", seed=9)
    gen = torch.Generator().manual_seed(10)
    inputs["d0"] = (0.6 + 1.2 * torch.rand(4, 2, 16, generator=gen, dtype=torch.float64)).to(DEVICE).requires_grad_()
    # an empty sequence and one of a single token (2 sub-steps: fewer than the scan's prefetch queue)
    cu = torch.tensor([0, 7, 7, 8, 20], dtype=torch.int32, device=DEVICE)
    options = dict(eta=0.3, cu_seqlens=cu)
    names = ["write_key", "d_final"] + ["d_" + n for n in inputs]
    _compare(_run(inputs, "triton", **options), _run(inputs, "naive", **options), names, tol=1e-10)


def test_osdn_float32_and_bfloat16_keys() -> None:
    """Low-precision inputs, float32 scan; the reference sees the same rounded inputs."""
    inputs = _inputs(1, 16, 2, 16, 1, retain=True, d0="none", seed=12)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        low = {k: v.detach().to(dtype).requires_grad_() for k, v in inputs.items()}
        want = _run({k: v.detach().double().requires_grad_() for k, v in low.items()}, "naive", eta=0.3)
        got = _run(low, "triton", eta=0.3)
        assert got[0].dtype == dtype
        _compare(got, want, ["write_key", "d_final", "d_k", "d_beta", "d_retain"], tol=tol)


def test_osdn_inputs_that_are_views() -> None:
    """Keys, beta and retain gates given as slices of longer sequences (not contiguous),
    and a scan continued from another's final `d`: every gradient as the token loop's.
    (The backward once read the saved beta and retain as if dense.)"""
    long = _inputs(2, 30, 2, 16, 2, retain=True, d0="per_sequence", seed=17)
    leaves = list(long.values())

    def chained(backend: str) -> list[torch.Tensor]:
        d = long["d0"]
        outs = []
        for a, b in ((0, 12), (12, 30)):  # tokens; two sub-steps each
            w, d = osdn_write_keys(long["k"][:, 2 * a:2 * b], long["beta"][:, 2 * a:2 * b], retain=long["retain"][:, a:b],
                                   d0=d, eta=0.3, backend=backend)
            outs.append(w)
        w = torch.cat(outs, 1)
        gen = torch.Generator().manual_seed(2)
        loss = (w * torch.randn(w.shape, generator=gen, dtype=w.dtype)).sum() + (d * torch.randn(d.shape, generator=gen, dtype=d.dtype)).sum()
        return [w, d] + list(torch.autograd.grad(loss, leaves))

    assert not long["beta"][:, :24].is_contiguous() and not long["retain"][:, :12].is_contiguous()
    _compare(chained("triton"), chained("naive"), ["write_key", "d_final"] + ["d_" + n for n in long], tol=1e-10)


def test_osdn_half_precision_key_gradient_is_stored_by_the_kernel() -> None:
    """A bfloat16 key's gradient comes out of the kernel in bfloat16, the float32 scan's
    gradient rounded once (the same scan on the same values): no float32 `dk` and a cast
    after it (201 MB more at the benchmark's shape)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    base = _inputs(1, 24, 2, 16, 1, retain=True, d0="none", seed=21)
    low = {n: v.detach().to(torch.bfloat16).requires_grad_() for n, v in base.items()}
    wide = {n: v.detach().float().requires_grad_() for n, v in low.items()}  # the same values
    gen = torch.Generator().manual_seed(5)
    dw = torch.randn(low["k"].shape, generator=gen).to(torch.bfloat16)

    class Casts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].shape == low["k"].shape:
                self.seen.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    grads = {}
    for name, x in (("low", low), ("wide", wide)):
        w, _ = osdn_write_keys(x["k"], x["beta"], retain=x["retain"], eta=0.3, backend="triton")
        dw_x = dw.to(w.dtype)
        with Casts() as casts:
            grads[name] = torch.autograd.grad(w, [x["k"]], dw_x)[0]
        assert casts.seen == [], name
    assert grads["low"].dtype == torch.bfloat16
    # one rounding of the float32 gradient: within a bfloat16 ulp (2^-7 relative; the
    # interpreter's float32 -> bfloat16 store truncates, the GPU's rounds to nearest)
    wide = grads["wide"]
    assert ((grads["low"].float() - wide).abs() <= wide.abs() * 2.0**-7 + 1e-30).all()


def test_osdn_scan_match_naive() -> None:
    """Both scans on packed sequences of 0, 1 and several tokens (fewer steps than the
    queue of loads included), with beta, the APF retain gate and n_h = 2; then dense
    batches with a shared d0, beta-aware and beta-free."""
    inputs = _inputs(1, 20, 2, 16, 2, retain=True, d0="none", seed=9)
    cu = torch.tensor([0, 7, 7, 8, 20], dtype=torch.int32, device=DEVICE)
    options = dict(eta=0.3, cu_seqlens=cu)
    names = ["write_key", "d_final"] + ["d_" + n for n in inputs]
    _compare(_run(inputs, "triton", **options), _run(inputs, "naive", **options), names, tol=1e-10)
    for n_h, aware in ((1, True), (3, False)):
        inputs = _inputs(2, 12, 2, 16, n_h, retain=False, d0="shared", seed=n_h)
        names = ["write_key", "d_final"] + ["d_" + n for n in inputs]
        options = dict(eta=0.3, beta_aware=aware)
        _compare(_run(inputs, "triton", **options), _run(inputs, "naive", **options), names, tol=1e-10)


@pytest.mark.parametrize("prefetch", [1, 3, 8])
def test_osdn_loads_ahead_queue_lengths(prefetch: int) -> None:
    """Queues of loads shorter and longer than the sequences (the launch table's
    `scan_prefetch`: unrolled loops with and without a remainder), and 16-bit keys as
    packed 32-bit words (`osdn._packed`)."""
    from archspec.kernels.triton import launch, osdn

    with launch.overridden(scan_prefetch=prefetch):
        _queue_lengths(osdn)


def _queue_lengths(osdn) -> None:
    inputs = _inputs(1, 13, 2, 16, 2, retain=True, d0="none", seed=5)
    cu = torch.tensor([0, 5, 5, 6, 13], dtype=torch.int32, device=DEVICE)
    names = ["write_key", "d_final"] + ["d_" + n for n in inputs]
    options = {"eta": 0.3, "cu_seqlens": cu}
    _compare(_run(inputs, "triton", **options), _run(inputs, "naive", **options), names, tol=1e-10)
    inputs = _inputs(1, 11, 2, 16, 1, retain=True, d0="none", seed=12)
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 5e-3)):
        low = {k: v.detach().to(dtype).requires_grad_() for k, v in inputs.items()}
        assert osdn._packed(low["k"].detach())[1] == (1 if dtype == torch.bfloat16 else 2)
        want = _run({k: v.detach().double().requires_grad_() for k, v in low.items()}, "naive", eta=0.3)
        got = _run(low, "triton", eta=0.3)
        _compare(got, want, ["write_key", "d_final", "d_k", "d_beta", "d_retain"], tol=tol)
