"""The Triton OSDN phase-1 scan against the naive loop: write keys, final `d`, gradients.

Retain gates near 1 and a large `eta` keep most steps away from the clip bounds, so
that the gradients flow through many steps (a clipped step passes none).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from archspec.kernels import osdn_write_keys
from archspec.kernels.triton.osdn_blocked import _block_rows

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


@pytest.mark.parametrize("blocked", [False, True])
def test_osdn_inputs_that_are_views(monkeypatch, blocked: bool) -> None:
    """Keys, beta and retain gates given as slices of longer sequences (not contiguous),
    and a scan continued from another's final `d`: every gradient as the token loop's.
    (The backward once read the saved beta and retain as if dense.)"""
    from archspec.kernels.triton import osdn

    monkeypatch.setattr(osdn, "BLOCKED", blocked)
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


@pytest.mark.parametrize("blocked", [False, True])
def test_osdn_half_precision_key_gradient_is_stored_by_the_kernel(monkeypatch, blocked: bool) -> None:
    """A bfloat16 key's gradient comes out of the kernel in bfloat16, the float32 scan's
    gradient rounded once (the same scan on the same values): no float32 `dk` and a cast
    after it (201 MB more at the benchmark's shape)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from archspec.kernels.triton import osdn

    monkeypatch.setattr(osdn, "BLOCKED", blocked)
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


@pytest.mark.parametrize("ahead", [True, False])
def test_osdn_loads_ahead_match_naive(monkeypatch, ahead: bool) -> None:
    """Both scans, every step's loads issued ahead (`osdn.AHEAD`, the default) and at their
    use (`ARCHSPEC_TRITON_OSDN_AHEAD=0`), on packed sequences of 0, 1 and several tokens
    (fewer steps than the queue included), with beta, the APF retain gate and n_h = 2."""
    from archspec.kernels.triton import osdn

    monkeypatch.setattr(osdn, "AHEAD", ahead)
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


@pytest.mark.parametrize("prefetch,stats", [(1, False), (3, True), (8, False), (8, True)])
def test_osdn_loads_ahead_queue_lengths(monkeypatch, prefetch: int, stats: bool) -> None:
    """AHEAD with queues shorter and longer than the sequences (unrolled loops with and
    without a remainder), 16-bit keys as packed 32-bit words (`osdn._packed`), and with
    the forward's `|k|^2` and `<d, s>` read by the backward (`osdn.STATS`)."""
    from archspec.kernels.triton import osdn

    monkeypatch.setattr(osdn, "AHEAD", True)
    monkeypatch.setattr(osdn, "PREFETCH", prefetch)
    monkeypatch.setattr(osdn, "STATS", stats)
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


def _blocked(monkeypatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Turn on the blocked forward and backward (`osdn.BLOCKED`); returns the lists that
    collect each call's counts of blocks stepped and held, `[N, H, 2]`
    (`osdn_blocked.block_forward`, `block_backward`)."""
    from archspec.kernels.triton import osdn, osdn_blocked

    forward_counts: list[torch.Tensor] = []
    backward_counts: list[torch.Tensor] = []
    forward, backward = osdn_blocked.block_forward, osdn_blocked.block_backward
    monkeypatch.setattr(osdn, "BLOCKED", True)
    monkeypatch.setattr(osdn_blocked, "block_forward",
                        lambda *a, **kw: forward_counts.append(forward(*a, **kw)) or forward_counts[-1])
    monkeypatch.setattr(osdn_blocked, "block_backward",
                        lambda *a, **kw: backward_counts.append(backward(*a, **kw)) or backward_counts[-1])
    return forward_counts, backward_counts


@pytest.mark.parametrize(
    "n_h,beta_aware,retain,d0",
    [(1, True, False, "ones"), (1, True, True, "shared"), (2, False, True, "per_sequence"), (3, True, True, "ones"),
     (5, True, False, "shared")],
)
def test_osdn_blocked_scan_matches_naive(monkeypatch, n_h: int, beta_aware: bool, retain: bool, d0: str) -> None:
    """The forward and backward in blocks of 8 sub-steps (`osdn_blocked.py`): bounds the
    scan never reaches (every block affine, none stepped), and bounds with a large `eta`,
    where some blocks clip and run step by step
    and others do not (retain gates below 1 pull `d` onto `d_min` and keep it there: with
    them every block clips). 37 tokens: the last block is partial for every n_h. The bounds
    are binary fractions: the kernels take them as float32 scalars, also in a float64 scan."""
    stepped, backward = _blocked(monkeypatch)
    inputs = _inputs(2, 37, 2, 16, n_h, retain=retain, d0=d0, seed=3 + n_h)
    names = ["write_key", "d_final"] + ["d_" + n for n in inputs]
    from archspec.kernels.triton.osdn_blocked import block_tokens

    blocks = 2 * 2 * -(-37 // block_tokens(n_h))  # sequences x heads x blocks per sequence
    clipping = (1, blocks) if retain else (1, blocks - 1)
    for options, stepped_range in ((dict(eta=0.5, d_min=2.0**-7, d_max=128.0), (0, 0)),
                                   (dict(eta=1.0, d_min=0.75, d_max=1.375), clipping)):
        options["beta_aware"] = beta_aware
        _compare(_run(inputs, "triton", **options), _run(inputs, "naive", **options), names, tol=1e-10)
        count = int(stepped[-1][..., 0].sum())
        assert stepped_range[0] <= count <= stepped_range[1], (options, count, blocks)
        # the backward: every block affine without a clip; with one, some step
        count = int(backward[-1][..., 0].sum())
        assert stepped_range[0] <= count <= stepped_range[1], (options, count, blocks)
    # APF with the paper's eta and bounds: the retain gates pull d onto d_min and hold it
    # there (updates of ~eta/K against a decay of (1 - rho) d_min), so most blocks are held
    # (with n_h > 1 the sub-steps after a token's first lift d off the bound between gates:
    # those blocks step)
    if retain:
        held_inputs = dict(inputs, retain=(0.5 + 0.0 * inputs["retain"]).detach().requires_grad_())
        options = dict(beta_aware=beta_aware)
        _compare(_run(held_inputs, "triton", **options), _run(held_inputs, "naive", **options), names, tol=1e-10)
        for counts in (stepped[-1], backward[-1]):  # held in the forward: no gradient through d
            stepped_n, held_n = counts.sum((0, 1)).tolist()
            assert stepped_n + held_n <= blocks and (held_n >= blocks // 2 or n_h > 1), (stepped_n, held_n, blocks)


def test_osdn_blocked_scan_packed_and_low_precision(monkeypatch) -> None:
    """The blocked scan on packed sequences (empty, one token, several blocks), and with
    float32, bfloat16 and float16 keys against the token loop on the same rounded inputs."""
    stepped, backward = _blocked(monkeypatch)
    inputs = _inputs(1, 45, 2, 16, 2, retain=True, d0="none", seed=9)
    gen = torch.Generator().manual_seed(10)
    inputs["d0"] = (0.6 + 1.2 * torch.rand(4, 2, 16, generator=gen, dtype=torch.float64)).to(DEVICE).requires_grad_()
    cu = torch.tensor([0, 7, 7, 8, 45], dtype=torch.int32, device=DEVICE)
    for options in (dict(eta=1.0, d_min=0.75, d_max=1.375, cu_seqlens=cu), dict(eta=0.5, d_min=2.0**-7, d_max=128.0, cu_seqlens=cu)):
        names = ["write_key", "d_final"] + ["d_" + n for n in inputs]
        _compare(_run(inputs, "triton", **options), _run(inputs, "naive", **options), names, tol=1e-10)
    assert int(stepped[-1].sum()) == 0 and int(stepped[-2][..., 0].sum()) > 0
    assert int(backward[-1].sum()) == 0 and int(backward[-2][..., 0].sum()) > 0
    # retain gates below osdn_blocked.RETAIN_FLOOR: no block is affine
    small = dict(inputs, retain=(0.05 * inputs["retain"]).detach().requires_grad_())
    names = ["write_key", "d_final"] + ["d_" + n for n in small]
    options = dict(eta=0.5, d_min=2.0**-7, d_max=128.0, cu_seqlens=cu)
    _compare(_run(small, "triton", **options), _run(small, "naive", **options), names, tol=1e-10)
    assert int(stepped[-1].sum()) == 2 * (-(-7 // 4) + 1 + -(-37 // 4))  # heads x blocks (n_h 2: 4 tokens each): stepped or held
    inputs = _inputs(1, 40, 2, 32, 1, retain=True, d0="none", seed=12)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)):
        low = {k: v.detach().to(dtype).requires_grad_() for k, v in inputs.items()}
        want = _run({k: v.detach().double().requires_grad_() for k, v in low.items()}, "naive", eta=0.01)
        got = _run(low, "triton", eta=0.01)
        assert got[0].dtype == dtype
        _compare(got, want, ["write_key", "d_final", "d_k", "d_beta", "d_retain"], tol=tol)



@triton.jit
def _block_rows_kernel(out, bos, seq_len, NH: tl.constexpr, RT: tl.constexpr, BM: tl.constexpr):
    """Stores, for block `program_id - 1` (from -1), each row's in-sequence flag and row."""
    c = tl.program_id(0) - 1
    m, _, rows, ok = _block_rows(bos, seq_len, c, NH, RT, BM)
    tl.store(out + (c + 1) * BM * 2 + m * 2, tl.where(ok, 1, 0))
    tl.store(out + (c + 1) * BM * 2 + m * 2 + 1, rows)


def test_osdn_blocked_rows_outside_the_sequence_are_masked() -> None:
    """`_block_rows` marks no row of a block outside the sequence as in it, before its
    start included: the backward loads block `c - 1` one block ahead, block -1 at its last
    step, and on the H200 an unmasked row before the key tensor was an illegal address
    (session 9; the interpreter reads such memory silently, so the mask is checked here)."""
    NH, RT, BM, seq_len, bos = 2, 4, 8, 10, 3  # 20 sub-steps: blocks 0, 1 full, block 2 half
    blocks = 5  # -1 .. 3
    out = torch.full((blocks, BM, 2), -7, dtype=torch.int32)
    _block_rows_kernel[(blocks,)](out, bos, seq_len, NH=NH, RT=RT, BM=BM)
    for c in range(-1, blocks - 1):
        for m in range(BM):
            j = c * RT * NH + m
            inside = 0 <= j < seq_len * NH and m < RT * NH
            assert out[c + 1, m, 0].item() == int(inside), (c, m)
            if inside:
                assert out[c + 1, m, 1].item() == bos * NH + j
