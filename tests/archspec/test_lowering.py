"""Lowering: every shipped spec lowers to the plan its paper describes, and the `stable`
flag agrees with the spectral norms of the transition factors, computed here directly
from the definitions of RECURRENCE.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from archspec.errors import ArchspecError
from archspec.lowering import lower
from archspec.spec import load_spec

MODELS = Path(__file__).resolve().parents[2] / "specs" / "models"

# name: (backbone, gate, transition, n_h, beta_scale, write_key, erase, osdn, apf, stable)
EXPECTED = {
    "deltanet": ("deltanet", "none", "householder", 1, 1.0, "tied", False, False, False, True),
    "gated-deltanet": ("gdn", "scalar", "householder", 1, 1.0, "tied", False, False, False, True),
    "deltaproduct-2": ("deltanet", "none", "householder", 2, 2.0, "tied", False, False, False, True),
    "deltaproduct-3": ("deltanet", "none", "householder", 3, 2.0, "tied", False, False, False, True),
    "gated-deltaproduct-2": ("gdn", "scalar", "householder", 2, 2.0, "tied", False, False, False, True),
    "kda": ("kda", "channel", "householder", 1, 1.0, "tied", False, False, False, True),
    "rwkv7": ("kda", "channel", "rwkv7", 1, 1.0, "untied", True, False, False, False),
    "osdn": ("deltanet", "none", "householder", 1, 1.0, "preconditioned", False, True, False, False),
    "osdn-apf": ("deltanet", "none", "householder", 1, 1.0, "preconditioned", False, True, True, False),
    "osgdn-apf": ("gdn", "scalar", "householder", 1, 1.0, "preconditioned", False, True, True, False),
    "oskda": ("kda", "channel", "householder", 1, 1.0, "preconditioned", False, True, False, False),
    "gla": ("kda", "channel", "diagonal", 1, None, "tied", False, False, False, True),
}


# Hybrid stacks: their placement is checked in test_layout.py.
HYBRIDS = {"qwen3-next-hybrid", "kimi-linear-hybrid", "jet-nemotron-placement"}


def test_every_published_design_has_a_spec():
    assert {p.stem for p in MODELS.glob("*.yaml")} == set(EXPECTED) | HYBRIDS


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_spec_lowers_to_its_design(name):
    path = MODELS / f"{name}.yaml"
    text = path.read_text()
    assert "yaml-language-server: $schema=" in text.splitlines()[0]
    assert any(word in text for word in ("Yang", "Siems", "Kimi", "Peng", "Zhou")), "names its paper"
    plan = lower(path)
    m = plan.mixer
    got = (m.backbone, m.gate, m.transition, m.n_h, m.beta_scale, m.write_key, m.erase,
           m.preconditioner is not None, bool(m.preconditioner and m.preconditioner.apf), m.stable)
    assert got == EXPECTED[name]
    assert plan.name == name
    assert (plan.d_model, plan.layers) == (256, 2)  # small by default, through the shared base
    assert bool(m.caveats) == (not m.stable)
    if m.preconditioner is not None:
        p = m.preconditioner
        assert (p.eta, p.d_min, p.d_max, p.beta_aware, p.init) == (0.003, 0.5, 2.0, True, "ones")


def test_value_dim_and_overrides_reach_the_plan():
    plan = lower(load_spec(MODELS / "gated-deltanet.yaml", ["mixer.head_dim=32", "model.layers=5"]))
    assert (plan.mixer.head_dim, plan.mixer.value_dim, plan.layers) == (32, 64, 5)


# ---------------------------------------------------------------- the stable flag, checked


def spectral_norm(a: torch.Tensor) -> float:
    return torch.linalg.matrix_norm(a, ord=2).item()


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm()


def test_tied_householder_products_never_expand():
    """stable=True plans: I - beta k k^T (unit k, beta in [0, 2]) times a decay in (0, 1]."""
    g = torch.Generator().manual_seed(0)
    K = 8
    for scale in (1.0, 2.0):
        for _ in range(200):
            a = torch.diag(torch.rand(K, generator=g, dtype=torch.float64))  # channel gate
            for _ in range(3):  # n_h = 3 factors
                k = unit(torch.randn(K, generator=g, dtype=torch.float64))
                beta = scale * torch.rand((), generator=g, dtype=torch.float64)
                a = (torch.eye(K, dtype=torch.float64) - beta * torch.outer(k, k)) @ a
            assert spectral_norm(a) <= 1 + 1e-12
    plan = lower({"name": "x", "mixer": {"backbone": "kda", "transition": {"n_h": 3, "beta_range": [0, 2]}}})
    assert plan.mixer.stable and plan.mixer.caveats == ()


def test_osdn_factor_can_expand_inside_the_stability_rule():
    """The caveat is real: beta <= 1, d in [0.5, 2], yet |I - beta (d*k) k^T| > 1."""
    k = unit(torch.tensor([1.0, 1.0], dtype=torch.float64))
    d = torch.tensor([0.5, 2.0], dtype=torch.float64)
    factor = torch.eye(2, dtype=torch.float64) - 1.0 * torch.outer(d * k, k)
    eigenvalues = torch.linalg.eigvals(factor).real
    assert eigenvalues.min() >= -1 and eigenvalues.max() <= 1  # the rule holds ...
    assert spectral_norm(factor) > 1.1  # ... the norm bound does not
    plan = lower(MODELS / "osdn.yaml")
    assert not plan.mixer.stable
    assert "spectral norm can exceed 1" in plan.mixer.caveats[0] and "non-normal" in plan.mixer.caveats[0]


def test_rwkv7_factor_can_expand():
    k = unit(torch.tensor([1.0, 1.0], dtype=torch.float64))
    a = torch.tensor([0.0, 1.0], dtype=torch.float64)
    factor = torch.eye(2, dtype=torch.float64) - torch.outer(a * k, k)
    assert torch.linalg.eigvals(factor).real.min() >= 0  # eigenvalues 1 - <a, k*k> in [0, 1]
    assert spectral_norm(factor) > 1.1
    plan = lower(MODELS / "rwkv7.yaml")
    assert not plan.mixer.stable
    assert "[0, 1]" in plan.mixer.caveats[0] and "spectral norm can exceed 1" in plan.mixer.caveats[0]


@pytest.mark.parametrize("beta_max", [1.0, 2.0])
@pytest.mark.parametrize("d_max", [1.0, 1.5, 2.0, 3.0])
def test_osdn_rule_refuses_exactly_when_an_eigenvalue_leaves_the_unit_interval(beta_max, d_max):
    """Worst case of RECURRENCE.md's rule: unit key, d = d_max everywhere, beta = beta_max."""
    K = 4
    k = unit(torch.arange(1.0, K + 1, dtype=torch.float64))
    d = torch.full((K,), d_max, dtype=torch.float64)
    factor = torch.eye(K, dtype=torch.float64) - beta_max * torch.outer(d * k, k)
    leaves = torch.linalg.eigvals(factor).real.min().item() < -1 - 1e-12
    data = {"name": "x", "mixer": {"transition": {"beta_range": [0, beta_max]},
                                    "preconditioner": {"type": "osdn", "bounds": [0.5, d_max]}}}
    if leaves:
        with pytest.raises(ArchspecError, match="unstable"):
            lower(data)
    else:
        assert lower(data).mixer.preconditioner.d_max == d_max
