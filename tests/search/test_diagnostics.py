"""Diagnostics on hand-computed cases, and on a real model's capture against closed forms."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import archspec
from archspec.kernels import linear_recurrence
from archspec.search import diagnostics as dg

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"model.layers": 2, "model.d_model": 32, "mixer.heads": 2, "mixer.head_dim": 8, "model.vocab_size": 11}



def one_head(**tensors):
    """Captured kwargs for B = H = 1 from per-step lists: k, v, write_key, erase `[T, D]`;
    beta `[T]`; g `[T]` (scalar gate)."""
    out = {"n_h": 1, "scale": 1.0}
    for name, value in tensors.items():
        t = torch.tensor(value, dtype=torch.float64)
        out[name] = t[None, :, None] if t.dim() == 1 else t[None, :, None, :]
    out["q"] = torch.ones_like(out["k"])
    return out


def test_effective_rank_by_hand():
    assert dg.effective_rank(torch.diag(torch.tensor([1.0, 1.0, 0.0]))).item() == pytest.approx(2.0)
    assert dg.effective_rank(torch.tensor([[3.0, 0.0], [0.0, 0.0]])).item() == pytest.approx(1.0)
    p = torch.tensor([0.75, 0.25])
    expected = math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    assert dg.effective_rank(torch.diag(torch.tensor([3.0, 1.0]))).item() == pytest.approx(expected)
    # Invariant to rotations and scale: a rotated, scaled copy has the same spectrum.
    rot = torch.tensor([[0.6, -0.8], [0.8, 0.6]], dtype=torch.float64)
    assert dg.effective_rank(5 * rot @ torch.diag(p.double()) @ rot.T).item() == pytest.approx(expected)
    assert math.isnan(dg.effective_rank(torch.zeros(2, 2)).item())


def test_residual_ratio_of_a_preconditioned_write_by_hand():
    # Token 1: S = 0, unit key k = e1, beta = 0.5, write key w = d * k with d = (1.5, 1):
    # residual before = v, after = (1 - beta <w, k>) v = 0.25 v, so q = 0.0625 (the OSDN
    # notes' example); S = [[1.5, 0], [0, 0]]. Token 2: key e2, beta = 1, w = k: q = 0
    # exactly (floored in q_geo); S = diag(1.5, 3). Token 3: key e1, beta 0.5, tied:
    # residual (2, 0) - (1.5, 0) = (0.5, 0), halved by the update: q = 0.25.
    cap = one_head(
        k=[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]],
        v=[[2.0, 0.0], [0.0, 3.0], [2.0, 0.0]],
        beta=[0.5, 1.0, 0.5],
        write_key=[[1.5, 0.0], [0.0, 1.0], [1.0, 0.0]],
    )
    r = dg.replay(cap)
    assert r.residual_ratio[0, :, 0].tolist() == pytest.approx([0.0625, 0.0, 0.25])
    # Effective ranks: 1 for the rank-one state, then that of singular values (1.5, 3).
    p = torch.tensor([1.5, 3.0]) / 4.5
    assert r.erank[0, :2, 0].tolist() == pytest.approx([1.0, math.exp(-(p * p.log()).sum().item())])
    assert r.write_gain[0, :, 0].tolist() == pytest.approx([1.5, 1.0, 1.0])
    report = dg.summarize([r])
    assert report.metrics["write_gain@0"] == pytest.approx(3.5 / 3)
    assert report.metrics["q_geo@0"] == pytest.approx(math.exp((math.log(0.0625) + math.log(1e-12) + math.log(0.25)) / 3))


def test_zero_residual_is_skipped_and_gate_applies_first():
    # v equal to what the (gated) state already predicts: 0/0, skipped. With the scalar
    # gate exp(g) = 0.5 the state predicts 0.5 * 2 = 1 for key e1, so v = 1 is "known".
    cap = one_head(
        k=[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]],
        v=[[2.0], [1.0], [3.0]],
        beta=[1.0, 0.5, 0.5],
        g=[0.0, math.log(0.5), 0.0],
    )
    r = dg.replay(cap)
    ratios = r.residual_ratio[0, :, 0]
    assert ratios[0].item() == pytest.approx(0.0)
    assert math.isnan(ratios[1].item())  # residual 1 - 0.5*2 = 0
    assert ratios[2].item() == pytest.approx(0.25)  # S^T e1 = 1, residual 2 -> (1 - 0.5)^2


def test_factor_norms_by_hand():
    k = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
    # Householder reflection: beta = 2, w = k -> orthogonal, norm 1.
    f = dg.factor(k, beta=torch.tensor([[2.0]], dtype=torch.float64), write_key=None, erase=None)
    assert torch.linalg.matrix_norm(f, ord=2).item() == pytest.approx(1.0)
    # Non-normal: w = (1, 1), beta = 1: F = [[0, 0], [-1, 1]], F^T F has eigenvalues 2, 0.
    f = dg.factor(k, beta=torch.tensor([[1.0]], dtype=torch.float64), write_key=torch.tensor([[[1.0, 1.0]]], dtype=torch.float64), erase=None)
    assert f[0, 0].tolist() == [[0.0, 0.0], [-1.0, 1.0]]
    assert torch.linalg.matrix_norm(f, ord=2).item() == pytest.approx(math.sqrt(2))
    # rwkv7: I - e k^T with e = 0.5 k: eigenvalue 0.5 along k, norm 1.
    f = dg.factor(k, beta=None, write_key=None, erase=0.5 * k)
    assert torch.linalg.matrix_norm(f, ord=2).item() == pytest.approx(1.0)
    assert dg.factor(k, beta=None, write_key=None, erase=None) is None
    cap = one_head(k=[[1.0, 0.0]], v=[[1.0]], beta=[1.0], write_key=[[1.0, 1.0]])
    assert dg.summarize([dg.replay(cap)]).metrics["max_factor_norm"] == pytest.approx(math.sqrt(2))


@pytest.mark.parametrize("spec", ["deltanet.yaml", "osdn.yaml", "gated-deltaproduct-2.yaml"])
def test_capture_of_a_real_model_matches_closed_forms(spec):
    torch.manual_seed(0)
    model = archspec.compile(ROOT / "specs" / "models" / spec, **SMALL)
    ids = torch.randint(11, (3, 12))
    captured = []
    for mixer in model.mixers():
        mixer.capture = True
    model(ids)
    captured = [m.captured for m in model.mixers()]
    for cap in captured:
        r = dg.replay(cap)
        k = cap["k"].double()
        w = k if cap["write_key"] is None else cap["write_key"].double()
        beta = cap["beta"].double()
        # For unit keys each sub-step's ratio is (1 - beta <w, k>)^2 (OSDN Sec. 2.4).
        closed = (1 - beta * (w * k).sum(-1)) ** 2
        ok = torch.isfinite(r.residual_ratio)
        assert ok.float().mean() > 0.9
        torch.testing.assert_close(r.residual_ratio[ok], closed[ok], rtol=1e-6, atol=1e-9)
        # The replayed final state is the kernel's (naive backend, float64).
        _, final = linear_recurrence(
            **{n: (v.double() if torch.is_tensor(v) else v) for n, v in cap.items() if n not in ("osdn_inputs", "output_final_state", "initial_state")},
            output_final_state=True, backend="naive",
        )
        torch.testing.assert_close(r.erank[:, -1], dg.effective_rank(final))
    report = dg.collect(model, ids)
    assert set(report.metrics) >= {"erank@0.0", "erank@1.1", "q_geo@0", "q_geo@1.0", "max_factor_norm@1", "q_geo"}
    if spec == "deltanet.yaml":  # symmetric factors with beta in [0, 1]: norm exactly 1
        assert report.metrics["max_factor_norm"] == pytest.approx(1.0)
        assert report.metrics["write_gain@0"] == pytest.approx(1.0)
    assert all(m.capture is False and m.captured is None for m in model.mixers())


def test_a_hybrid_stack_is_measured_per_recurrent_layer_and_says_so_for_attention():
    """Metrics carry each recurrent layer's index in the stack; the attention layers get
    none and a note; each recurrent layer's numbers are its own replay's."""
    torch.manual_seed(0)
    model = archspec.compile(ROOT / "specs" / "models" / "kimi-linear-hybrid.yaml",
                             **{**SMALL, "model.layers": 4, "layout.ratio": "1:1", "attention.head_dim": 8})
    ids = torch.randint(11, (2, 10))
    report = dg.collect(model, ids)
    assert report.layers == [0, 2] and sorted(report.notes) == [1, 3]
    assert "KV cache" in report.notes[1] and "do not apply" in report.notes[1]
    assert {"erank@0.0", "erank@2.1", "q_geo@2", "max_factor_norm@0"} <= set(report.metrics)
    assert not any(name.split("@")[1].split(".")[0] in ("1", "3") for name in report.metrics if "@" in name)
    for mixer in model.mixers():
        mixer.capture = True
    model(ids)
    for index, mixer in zip((0, 2), model.mixers()):
        alone = dg.summarize([dg.replay(mixer.captured)], [index])
        assert report.metrics[f"q_geo@{index}"] == pytest.approx(alone.metrics[f"q_geo@{index}"])
        assert report.metrics[f"erank@{index}.0"] == pytest.approx(alone.metrics[f"erank@{index}.0"])
