"""`osdn_recurrence_in_segments` against the unsegmented OSDN recurrence and the token
loop: outputs, final state, final `d` and every input's gradient."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from archspec.kernels import linear_recurrence, osdn_write_keys
from archspec.kernels.osdn_segments import osdn_recurrence_in_segments, segment_bounds

pytest.importorskip("triton")


def test_segments_hold_whole_chunks_and_cover_the_sequence() -> None:
    assert segment_bounds(256, 1, 4) == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert segment_bounds(200, 1, 3) == [(0, 64), (64, 128), (128, 200)]  # 4 chunks, the last partial
    assert segment_bounds(100, 2, 8) == [(0, 32), (32, 64), (64, 96), (96, 100)]  # 32 tokens a chunk
    assert segment_bounds(40, 1, 4) == [(0, 40)]  # one chunk: one segment
    for T, n_h, s in ((1000, 3, 5), (77, 8, 9), (64, 1, 1)):
        bounds = segment_bounds(T, n_h, s)
        assert bounds[0][0] == 0 and bounds[-1][1] == T
        assert all(b == c for (_, b), (c, _) in itertools.pairwise(bounds))
        assert all(a % (64 // n_h) == 0 for a, _ in bounds)


def _inputs(B, T, H, K, n_h, *, gate: bool, retain: bool, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    TN = T * n_h
    x = {"q": r(B, T, H, K), "k": F.normalize(r(B, TN, H, K), dim=-1), "v": r(B, TN, H, K),
         "beta": torch.sigmoid(r(B, TN, H)), "initial_state": 0.1 * r(B, H, K, K), "d0": 0.8 + 0.4 * torch.rand(B, H, K, generator=gen, dtype=torch.float64)}
    if gate:
        x["g"] = F.logsigmoid(r(B, T, H) + 3.0)
    if retain:
        x["retain"] = 0.9 + 0.1 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return {n: t.requires_grad_() for n, t in x.items()}


def _whole(x: dict, n_h: int, backend: str) -> list[torch.Tensor]:
    w, d = osdn_write_keys(x["k"], x["beta"], retain=x.get("retain"), d0=x["d0"], eta=0.3, n_h=n_h, backend=backend)
    o, s = linear_recurrence(x["q"], x["k"], x["v"], g=x.get("g"), beta=x["beta"], write_key=w, n_h=n_h,
                             initial_state=x["initial_state"], output_final_state=True, backend=backend)
    return [o, s, d]


def _grads(outs: list[torch.Tensor], x: dict) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    loss = sum((t * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t)).sum() for t in outs)
    return list(outs) + list(torch.autograd.grad(loss, list(x.values())))


@pytest.mark.parametrize("n_h,gate,retain", [(1, False, False), (2, True, True)])
def test_segmented_matches_the_whole_and_the_token_loop(n_h: int, gate: bool, retain: bool) -> None:
    x = _inputs(2, 150, 2, 16, n_h, gate=gate, retain=retain, seed=7)
    o, s, d = osdn_recurrence_in_segments(
        x["q"], x["k"], x["v"], x["beta"], segments=3, g=x.get("g"), n_h=n_h, initial_state=x["initial_state"],
        output_final_state=True, retain=x.get("retain"), d0=x["d0"], eta=0.3, backend="triton")
    assert len(segment_bounds(150, n_h, 3)) == 3
    got = _grads([o, s, d], x)
    names = ["o", "final_state", "d_final"] + ["d_" + n for n in x]
    for reference in (_grads(_whole(x, n_h, "triton"), x), _grads(_whole(x, n_h, "naive"), x)):
        for name, a, b in zip(names, got, reference):
            err = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
            assert err < 1e-10, f"{name}: {err:.2e}"


@pytest.mark.gpu
def test_segmented_on_cuda_with_streams_matches_the_whole() -> None:
    """On a GPU the scans run on a side stream: the result and the gradients must not
    depend on when the streams meet (float32 inputs on the device)."""
    cpu = _inputs(2, 300, 2, 32, 1, gate=True, retain=True, seed=9)
    x = {n: t.detach().float().cuda().requires_grad_() for n, t in cpu.items()}
    o, s, d = osdn_recurrence_in_segments(
        x["q"], x["k"], x["v"], x["beta"], segments=4, g=x["g"], initial_state=x["initial_state"],
        output_final_state=True, retain=x["retain"], d0=x["d0"], eta=0.3, backend="triton")
    got = _grads([o, s, d], x)
    want = _grads(_whole(x, 1, "triton"), x)
    for a, b in zip(got, want):
        assert ((a - b).norm() / b.norm()).item() < 1e-5
