"""The public entry points: argument checks name what is wrong, backends resolve and dispatch."""

from __future__ import annotations

import re

import pytest
import torch

from archspec.kernels import api, linear_recurrence, osdn_write_keys, resolve_backend
from archspec.kernels.chunked import linear_recurrence_chunked
from archspec.kernels.osdn_scan import osdn_write_keys_scan

from .cases import Case, make_inputs


def inputs(**overrides) -> dict:
    base = make_inputs(Case(gate="scalar", transition="householder", n_h=2), B=2, T=5, H=3, K=4, V=6, requires_grad=False)
    base.update(overrides)
    return base


def zeros(*shape) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.float64)


@pytest.mark.parametrize(
    "override, pattern",
    [
        ({"q": zeros(2, 5, 3)}, r"q must be \[B, T, H, K\], got shape \(2, 5, 3\)"),
        ({"k": zeros(2, 5, 3, 4)}, r"k must be \[B, T\*n_h, H, K\] = \(2, 10, 3, 4\), got \(2, 5, 3, 4\)"),
        ({"v": zeros(2, 10, 2, 6)}, r"v must be \[B, T\*n_h, H, V\] .* \(2, 10, 3\), got \(2, 10, 2, 6\)"),
        ({"beta": zeros(2, 5, 3)}, r"beta must be \[B, T\*n_h, H\] = \(2, 10, 3\), got \(2, 5, 3\)"),
        ({"g": zeros(2, 10, 3)}, r"g must be \[B, T, H\] \(scalar gate\) or \[B, T, H, K\] \(channel gate\), got \(2, 10, 3\)"),
        ({"write_key": zeros(2, 10, 3, 5)}, r"write_key must be \[B, T\*n_h, H, K\] = \(2, 10, 3, 4\), got \(2, 10, 3, 5\)"),
        ({"erase": zeros(2, 5, 3, 4)}, r"erase must be \[B, T\*n_h, H, K\] = \(2, 10, 3, 4\)"),
        ({"initial_state": zeros(2, 3, 6, 4)}, r"initial_state must be \[B, H, K, V\] = \(2, 3, 4, 6\), got \(2, 3, 6, 4\)"),
        ({"n_h": 0}, r"n_h must be a positive int, got 0"),
    ],
    ids=lambda x: next(iter(x)) if isinstance(x, dict) else "",
)
def test_shape_errors_name_the_argument_and_expected_shape(override, pattern):
    with pytest.raises(ValueError, match=r"linear_recurrence: " + pattern):
        linear_recurrence(**inputs(**override), backend="torch")


def test_cu_seqlens_errors():
    packed = inputs(q=zeros(1, 5, 3, 4), k=zeros(1, 10, 3, 4), v=zeros(1, 10, 3, 6), beta=zeros(1, 10, 3), g=zeros(1, 5, 3))
    with pytest.raises(ValueError, match="with cu_seqlens the batch must be 1"):
        linear_recurrence(**inputs(), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=re.escape("linear_recurrence: cu_seqlens must run from 0 to T = 5, got [0, 4]")):
        linear_recurrence(**packed, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        linear_recurrence(**packed, cu_seqlens=torch.tensor([0, 4, 2, 5]))
    with pytest.raises(ValueError, match=re.escape("initial_state must be [N, H, K, V] = (2, 3, 4, 6)")):
        linear_recurrence(**packed, cu_seqlens=torch.tensor([0, 2, 5]), initial_state=zeros(1, 3, 4, 6))


def test_osdn_errors():
    k = zeros(2, 6, 3, 4)
    with pytest.raises(ValueError, match=re.escape("beta must be [B, T*n_h, H] = (2, 6, 3), got (2, 6)")):
        osdn_write_keys(k, zeros(2, 6))
    with pytest.raises(ValueError, match="beta_aware=True needs beta"):
        osdn_write_keys(k, None)
    with pytest.raises(ValueError, match="retain must be"):
        osdn_write_keys(k, zeros(2, 6, 3), retain=zeros(2, 4, 3))
    with pytest.raises(ValueError, match=re.escape("d0 must be [H, K] or [B, H, K] = (2, 3, 4), got (3, 5)")):
        osdn_write_keys(k, zeros(2, 6, 3), d0=zeros(3, 5))
    with pytest.raises(ValueError, match="need 0 < d_min <= d_max"):
        osdn_write_keys(k, zeros(2, 6, 3), d_min=2.0, d_max=1.0)
    with pytest.raises(ValueError, match="n_h=4 does not fit"):
        osdn_write_keys(k, zeros(2, 6, 3), n_h=4)
    with pytest.raises(ValueError, match=re.escape("osdn_write_keys: cu_seqlens must run from 0 to T = 3, got [0, 6]")):
        osdn_write_keys(k[:1], zeros(1, 6, 3), n_h=2, cu_seqlens=torch.tensor([0, 6]))


@pytest.mark.parametrize("backend", ["naive", "torch", "triton"])
def test_osdn_packed_offsets_count_tokens_without_retain(backend):
    """`cu_seqlens` are token offsets for `osdn_write_keys` too: with n_h = 2 and no APF,
    each packed sequence equals running it alone (and d restarts at each one)."""
    gen = torch.Generator().manual_seed(3)
    n_h, lengths, H, K = 2, (3, 5), 2, 4
    k = torch.nn.functional.normalize(torch.randn(1, sum(lengths) * n_h, H, K, generator=gen, dtype=torch.float64), dim=-1)
    beta = torch.rand(1, sum(lengths) * n_h, H, generator=gen, dtype=torch.float64)
    d0 = 0.5 + torch.rand(len(lengths), H, K, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, lengths[0], sum(lengths)])
    w, d = osdn_write_keys(k, beta, eta=0.3, d0=d0, cu_seqlens=cu, n_h=n_h, backend=backend)
    start = 0
    for n, length in enumerate(lengths):
        rows = slice(start * n_h, (start + length) * n_h)
        w_alone, d_alone = osdn_write_keys(k[:, rows], beta[:, rows], eta=0.3, d0=d0[n : n + 1], backend="naive")
        torch.testing.assert_close(w[:, rows], w_alone)
        torch.testing.assert_close(d[n : n + 1], d_alone)
        start += length


def test_auto_resolves_to_torch_on_cpu_and_dispatches_to_the_chunked_backend(monkeypatch):
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("naive", torch.device("cuda")) == "naive"
    calls = []
    monkeypatch.setitem(api._RECURRENCE_BACKENDS, "torch", lambda *a, **kw: calls.append("recurrence") or linear_recurrence_chunked(*a, **kw))
    monkeypatch.setitem(api._OSDN_BACKENDS, "torch", lambda *a, **kw: calls.append("osdn") or osdn_write_keys_scan(*a, **kw))
    o, _ = linear_recurrence(**inputs())
    osdn_write_keys(zeros(1, 2, 1, 3) + 0.5, zeros(1, 2, 1) + 0.5)
    assert calls == ["recurrence", "osdn"]
    o_ref, _ = linear_recurrence(**inputs(), backend="naive")
    torch.testing.assert_close(o, o_ref)


def test_torch_backend_is_registered_by_importing_chunked():
    import archspec.kernels.chunked  # noqa: F401

    assert api._RECURRENCE_BACKENDS["torch"] is linear_recurrence_chunked
    assert api._OSDN_BACKENDS["torch"] is osdn_write_keys_scan


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match=r"backend must be one of \('naive', 'torch', 'triton', 'auto'\), got 'cuda'"):
        linear_recurrence(**inputs(), backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        osdn_write_keys(zeros(1, 2, 1, 3), None, beta_aware=False, backend="fast")
