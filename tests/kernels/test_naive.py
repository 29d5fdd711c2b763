"""The definition (`kernels/naive.py`) against closed forms and identities, in float64.

The transition of a token is read off the naive loop itself: with `v = 0` (nothing is
written) and the identity as initial state (`K = V`), the final state is the product of
the transition matrices, `A_T ... A_1`.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from archspec.kernels import linear_recurrence, osdn_write_keys

from .cases import Case, make_inputs

F64 = dict(atol=1e-12, rtol=1e-12)


def naive(**kwargs):
    return linear_recurrence(**kwargs, backend="naive")


def transition(k: torch.Tensor, beta: torch.Tensor | None = None, *, g=None, write_key=None, erase=None, n_h: int = 1):
    """The product of all transition matrices of a single head: `k` `[T*n_h, K]`."""
    TN, K = k.shape
    T = TN // n_h
    q = torch.zeros(1, T, 1, K, dtype=torch.float64)
    v = torch.zeros(1, TN, 1, K, dtype=torch.float64)
    extra = {}
    if beta is not None:
        extra["beta"] = beta.reshape(1, TN, 1)
    if g is not None:
        extra["g"] = g.reshape(1, T, 1, *g.shape[1:])
    if write_key is not None:
        extra["write_key"] = write_key.reshape(1, TN, 1, K)
    if erase is not None:
        extra["erase"] = erase.reshape(1, TN, 1, K)
    eye = torch.eye(K, dtype=torch.float64).reshape(1, 1, K, K)
    _, state = naive(q=q, k=k.reshape(1, TN, 1, K), v=v, n_h=n_h, initial_state=eye, output_final_state=True, **extra)
    return state[0, 0]


def unit(*xs: float) -> torch.Tensor:
    return F.normalize(torch.tensor(xs, dtype=torch.float64), dim=0)


def householder(k: torch.Tensor, beta: float, w: torch.Tensor | None = None) -> torch.Tensor:
    w = k if w is None else w
    return torch.eye(k.numel(), dtype=torch.float64) - beta * torch.outer(w, k)


def test_single_step_is_the_delta_rule():
    gen = torch.Generator().manual_seed(0)
    K, V = 4, 3
    k, w = unit(1.0, 2.0, -1.0, 0.5), unit(0.3, -1.0, 2.0, 1.0)
    v = torch.randn(V, generator=gen, dtype=torch.float64)
    q = torch.randn(K, generator=gen, dtype=torch.float64)
    S0 = torch.randn(K, V, generator=gen, dtype=torch.float64)
    beta = 0.7
    o, S1 = naive(
        q=q.reshape(1, 1, 1, K), k=k.reshape(1, 1, 1, K), v=v.reshape(1, 1, 1, V),
        beta=torch.full((1, 1, 1), beta, dtype=torch.float64), write_key=w.reshape(1, 1, 1, K),
        initial_state=S0.reshape(1, 1, K, V), output_final_state=True, scale=0.5,
    )
    expected = S0 + beta * torch.outer(w, v - S0.T @ k)
    torch.testing.assert_close(S1[0, 0], expected, **F64)
    torch.testing.assert_close(o[0, 0, 0], expected.T @ (0.5 * q), **F64)


def test_equal_keys_collapse_to_one_factor():
    # n_h factors with the same key k: prod_j (I - beta_j k k^T) = I - beta_eff k k^T,
    # beta_eff = 1 - prod_j (1 - beta_j).
    k = unit(1.0, -2.0, 0.5)
    betas = torch.tensor([0.3, 1.7, 0.9], dtype=torch.float64)
    product = transition(k.repeat(3, 1), betas, n_h=3)
    beta_eff = 1 - torch.prod(1 - betas)
    torch.testing.assert_close(product, householder(k, float(beta_eff)), **F64)


def test_orthogonal_keys_commute():
    k1, k2, k3 = unit(1.0, 1.0, 0.0, 0.0), unit(1.0, -1.0, 0.0, 0.0), unit(0.0, 0.0, 3.0, 4.0)
    betas = torch.tensor([0.4, 1.9, 1.2], dtype=torch.float64)
    forward = transition(torch.stack([k1, k2, k3]), betas, n_h=3)
    backward = transition(torch.stack([k3, k2, k1]), betas.flip(0), n_h=3)
    torch.testing.assert_close(forward, backward, **F64)
    # ...and non-orthogonal keys do not (the test above can fail).
    k2_bent = unit(1.0, -0.5, 0.0, 0.0)
    a = transition(torch.stack([k1, k2_bent]), betas[:2], n_h=2)
    b = transition(torch.stack([k2_bent, k1]), betas[:2].flip(0), n_h=2)
    assert (a - b).abs().max() > 0.1


def test_two_reflections_rotate_by_120_degrees_modulo_3():
    # DeltaProduct notes: beta = 2 reflections on k1 = (1, 0), k2 = (1/2, sqrt3/2) give
    # F2 F1 = rotation by 120 degrees; three tokens return the state.
    k1, k2 = unit(1.0, 0.0), unit(0.5, math.sqrt(3) / 2)
    keys = torch.stack([k1, k2])
    betas = torch.full((2,), 2.0, dtype=torch.float64)
    c, s = math.cos(2 * math.pi / 3), math.sin(2 * math.pi / 3)
    rotation = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    torch.testing.assert_close(transition(keys, betas, n_h=2), rotation, **F64)
    torch.testing.assert_close(transition(keys.repeat(2, 1), betas.repeat(2), n_h=2), rotation @ rotation, **F64)
    torch.testing.assert_close(transition(keys.repeat(3, 1), betas.repeat(3), n_h=2), torch.eye(2, dtype=torch.float64), **F64)
    # The state vector (1, 0) visits three directions, one per count modulo 3.
    states = [torch.linalg.matrix_power(rotation, t) @ k1 for t in range(3)]
    angles = sorted(round(math.degrees(math.atan2(float(x[1]), float(x[0])))) % 360 for x in states)
    assert angles == [0, 120, 240]


@pytest.mark.parametrize("n_h", [1, 2, 3])
def test_transition_norm_at_most_one_without_preconditioner(n_h: int):
    gen = torch.Generator().manual_seed(n_h)
    K, T = 5, 6
    for trial in range(20):
        keys = F.normalize(torch.randn(T * n_h, K, generator=gen, dtype=torch.float64), dim=-1)
        betas = 2.0 * torch.rand(T * n_h, generator=gen, dtype=torch.float64)
        g = -torch.rand(T, generator=gen, dtype=torch.float64) if trial % 2 else None
        for i in range(T * n_h):  # each factor, then the whole product
            norm = torch.linalg.matrix_norm(householder(keys[i], float(betas[i])), ord=2)
            assert norm <= 1 + 1e-12
        product = transition(keys, betas, g=g, n_h=n_h)
        assert torch.linalg.matrix_norm(product, ord=2) <= 1 + 1e-12
    # With beta > 2 a factor's eigenvalue 1 - beta < -1: the bound is not vacuous.
    assert torch.linalg.matrix_norm(transition(keys[:1], torch.tensor([2.5], dtype=torch.float64)), ord=2) > 1.4


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_gate_applies_once_per_token_before_the_substeps(gate: str):
    gen = torch.Generator().manual_seed(1)
    K, V, n_h, T = 3, 2, 2, 2
    keys = F.normalize(torch.randn(T * n_h, K, generator=gen, dtype=torch.float64), dim=-1)
    betas = torch.rand(T * n_h, generator=gen, dtype=torch.float64)
    values = torch.randn(T * n_h, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(T, *((K,) if gate == "channel" else ()), generator=gen, dtype=torch.float64)
    S0 = torch.randn(K, V, generator=gen, dtype=torch.float64)
    _, S = naive(
        q=torch.zeros(1, T, 1, K, dtype=torch.float64), k=keys.reshape(1, T * n_h, 1, K), v=values.reshape(1, T * n_h, 1, V),
        beta=betas.reshape(1, T * n_h, 1), g=g.reshape(1, T, 1, *g.shape[1:]), n_h=n_h,
        initial_state=S0.reshape(1, 1, K, V), output_final_state=True,
    )
    D = [torch.diag(torch.exp(g[t]).expand(K)) for t in range(T)]
    F_ = [householder(keys[i], float(betas[i])) for i in range(T * n_h)]
    write = [float(betas[i]) * torch.outer(keys[i], values[i]) for i in range(T * n_h)]
    # gate first, then the sub-steps in order (earliest factor rightmost)
    expected = S0
    for t in range(T):
        expected = D[t] @ expected
        for j in range(n_h):
            expected = F_[t * n_h + j] @ expected + write[t * n_h + j]
    torch.testing.assert_close(S[0, 0], expected, **F64)
    # The transitions alone: A_2 A_1 with A_t = F_{t,2} F_{t,1} D_t.
    product = F_[3] @ F_[2] @ D[1] @ F_[1] @ F_[0] @ D[0]
    torch.testing.assert_close(transition(keys, betas, g=g, n_h=n_h), product, **F64)
    # Gating after the sub-steps would decay this token's writes too: a different state.
    gate_last = S0
    for t in range(T):
        for j in range(n_h):
            gate_last = F_[t * n_h + j] @ gate_last + write[t * n_h + j]
        gate_last = D[t] @ gate_last
    assert (expected - gate_last).abs().max() > 1e-3


def test_rwkv7_erase_and_write():
    gen = torch.Generator().manual_seed(2)
    K, V = 3, 2
    k, w = unit(1.0, 1.0, 0.0), unit(0.0, 1.0, -1.0)
    a = torch.tensor([0.2, 0.9, 0.5], dtype=torch.float64)
    S0 = torch.randn(K, V, generator=gen, dtype=torch.float64)
    v = torch.randn(V, generator=gen, dtype=torch.float64)
    b = 0.6
    _, S1 = naive(
        q=torch.zeros(1, 1, 1, K, dtype=torch.float64), k=k.reshape(1, 1, 1, K), v=v.reshape(1, 1, 1, V),
        erase=(a * k).reshape(1, 1, 1, K), write_key=w.reshape(1, 1, 1, K), beta=torch.full((1, 1, 1), b, dtype=torch.float64),
        initial_state=S0.reshape(1, 1, K, V), output_final_state=True,
    )
    expected = (torch.eye(K, dtype=torch.float64) - torch.outer(a * k, k)) @ S0 + b * torch.outer(w, v)
    torch.testing.assert_close(S1[0, 0], expected, **F64)


def test_cu_seqlens_equals_each_sequence_alone():
    case = Case(gate="scalar", transition="householder", n_h=2)
    offsets = [0, 3, 3, 10]
    packed = make_inputs(case, B=1, T=10, H=2, K=4, V=3, seed=3, requires_grad=False)
    init = torch.randn(3, 2, 4, 3, dtype=torch.float64)
    o, s = naive(**packed, initial_state=init, cu_seqlens=torch.tensor(offsets), output_final_state=True)
    for n in range(3):
        tok, sub = slice(offsets[n], offsets[n + 1]), slice(2 * offsets[n], 2 * offsets[n + 1])
        o_n, s_n = naive(
            q=packed["q"][:, tok], k=packed["k"][:, sub], v=packed["v"][:, sub], g=packed["g"][:, tok],
            beta=packed["beta"][:, sub], n_h=2, initial_state=init[n : n + 1], output_final_state=True,
        )
        torch.testing.assert_close(o[:, tok], o_n, **F64)
        torch.testing.assert_close(s[n : n + 1], s_n, **F64)
    torch.testing.assert_close(s[1:2], init[1:2], **F64)  # the empty sequence keeps its state


# ---------------------------------------------------------------------------------------
# OSDN


def test_osdn_two_steps_by_hand():
    # K = 2, eta = 0.1, beta-aware, d_1 = (1, 1), no clipping on the first step.
    k = torch.tensor([[[[0.6, 0.8]], [[1.0, 0.0]]]], dtype=torch.float64)  # [1, 2, 1, 2]
    beta = torch.tensor([[[0.5], [1.0]]], dtype=torch.float64)
    w, d = osdn_write_keys(k, beta, eta=0.1, d_min=0.5, d_max=1.02, backend="naive")
    # step 1: s = (0.36, 0.64), |k|^2 = 1, <d, s> = 1 -> d += 0.1 * 0.5 * (1 - 0.5) * s
    d2 = torch.tensor([1 + 0.025 * 0.36, 1 + 0.025 * 0.64], dtype=torch.float64)  # (1.009, 1.016)
    # step 2: s = (1, 0), <d, s> = 1.009 -> d += 0.1 * 1 * (1 - 1.009) * s = (-0.0009, 0)
    d3 = torch.tensor([1.009 - 0.0009, 1.016], dtype=torch.float64)
    torch.testing.assert_close(w[0, :, 0], torch.stack([torch.ones(2, dtype=torch.float64) * k[0, 0, 0], d2 * k[0, 1, 0]]), **F64)
    torch.testing.assert_close(d[0, 0], d3, **F64)
    # a larger eta hits d_max = 1.02 on the second coordinate and stays clipped there
    _, d_clip = osdn_write_keys(k, beta, eta=1.0, d_min=0.5, d_max=1.02, backend="naive")
    assert float(d_clip[0, 0, 1]) == pytest.approx(1.02, abs=1e-15)


def test_osdn_beta_free_and_retain():
    k = torch.tensor([[[[0.0, 2.0]], [[0.0, 2.0]]]], dtype=torch.float64)  # |k|^2 = 4
    retain = torch.tensor([[[0.5], [1.0]]], dtype=torch.float64)  # T = 2, n_h = 1
    _, d = osdn_write_keys(k, None, eta=0.1, beta_aware=False, retain=retain, d_min=0.1, d_max=5.0, backend="naive")
    # step 1: s = (0, 4), <d, s> = 4: d = 0.5 * (1, 1) + 0.1 * (1 - 4) / 4 * (0, 4) = (0.5, 0.2)
    # step 2: <d, s> = 0.8: d = (0.5, 0.2) + 0.1 * 0.2 / 4 * (0, 4) = (0.5, 0.22)
    torch.testing.assert_close(d[0, 0], torch.tensor([0.5, 0.22], dtype=torch.float64), **F64)


@pytest.mark.parametrize("beta_max, d_max, stable", [(1.0, 2.0, True), (2.0, 1.0, True), (2.0, 2.0, False)])
def test_osdn_stability_rule(beta_max: float, d_max: float, stable: bool):
    # The factor I - beta (d*k) k^T has eigenvalue 1 - beta <d, s> along the write key
    # (and 1 elsewhere); with a unit key <d, s> is in [d_min, d_max].
    gen = torch.Generator().manual_seed(4)
    K = 4
    lowest = 1.0
    for _ in range(200):
        k = F.normalize(torch.randn(K, generator=gen, dtype=torch.float64), dim=0)
        d = 0.5 + (d_max - 0.5) * torch.rand(K, generator=gen, dtype=torch.float64)
        beta = beta_max * torch.rand((), generator=gen, dtype=torch.float64)
        A = transition(k[None], beta[None], write_key=(d * k)[None])
        eigenvalues = torch.linalg.eigvals(A)
        along_key = 1 - beta * (d * k * k).sum()
        assert (eigenvalues.real - along_key).abs().min() < 1e-10 and eigenvalues.imag.abs().max() < 1e-10
        lowest = min(lowest, float(along_key))
    # the worst case beta_max * d_max is reached by beta = beta_max, d = d_max everywhere
    worst = 1 - beta_max * d_max
    assert (worst >= -1) == stable
    if stable:
        assert lowest >= -1
    else:
        k = unit(1.0, 0.0, 0.0, 0.0)
        A = transition(k[None], torch.tensor([beta_max], dtype=torch.float64), write_key=(d_max * k)[None])
        assert torch.linalg.eigvals(A).real.min() == pytest.approx(-3.0)


def test_osdn_cu_seqlens_restarts_d():
    gen = torch.Generator().manual_seed(5)
    k = F.normalize(torch.randn(1, 7, 2, 3, generator=gen, dtype=torch.float64), dim=-1)
    beta = torch.rand(1, 7, 2, generator=gen, dtype=torch.float64)
    d0 = 0.5 + torch.rand(2, 2, 3, generator=gen, dtype=torch.float64)
    w, d = osdn_write_keys(k, beta, eta=0.5, d0=d0, cu_seqlens=torch.tensor([0, 3, 7]), backend="naive")
    w2, d2 = osdn_write_keys(k[:, 3:], beta[:, 3:], eta=0.5, d0=d0[1:], backend="naive")
    torch.testing.assert_close(w[:, 3:], w2, **F64)
    torch.testing.assert_close(d[1:], d2, **F64)
    torch.testing.assert_close(w[0, 3, 0], d0[1, 0] * k[0, 3, 0], **F64)  # restarted from d0 of sequence 2
