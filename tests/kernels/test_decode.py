"""The decoding step against the chunk path: a prefill through `linear_recurrence` and then
one `decode_step` per token equal the whole sequence through `linear_recurrence`
(outputs and final state; OSDN's `d` too), for every plan the chunk kernel runs: n_h
sub-steps, no / scalar / channel gates, tied, untied and OSDN write keys, beta in [0, 1]
and [0, 2], RWKV-7's erase with and without beta. float32 to 1e-5, float64 to 1e-10, on
the torch step (the definition) and the Triton step (under the interpreter on the CPU;
GPU-marked tests on CUDA). The definition itself is also checked against a hand-written
token of `RECURRENCE.md`.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from archspec.kernels import decode_step, linear_recurrence, osdn_write_keys

from .cases import Case, all_cases, make_inputs

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
CUDA = torch.cuda.is_available()


def _token_slice(inputs: dict, lo: int, hi: int) -> dict:
    """The arguments of tokens `lo..hi-1` (sub-step tensors sliced by `n_h`)."""
    n = inputs["n_h"]
    out = {}
    for name, value in inputs.items():
        if not isinstance(value, torch.Tensor) or name in ("initial_state", "d0"):
            out[name] = value
        elif name in ("q", "g", "retain"):
            out[name] = value[:, lo:hi]
        else:
            out[name] = value[:, lo * n : hi * n]
    return out


def _whole(inputs: dict, backend: str, osdn: dict | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    args = {k: v for k, v in inputs.items() if k not in ("retain", "d0")}
    d = None
    if osdn is not None:
        args["write_key"], d = osdn_write_keys(inputs["k"], inputs["beta"], retain=inputs.get("retain"),
                                               d0=inputs.get("d0"), n_h=inputs["n_h"], backend=backend, **osdn)
    o, state = linear_recurrence(**args, output_final_state=True, backend=backend)
    return o, state, d


def _prefill_then_steps(inputs: dict, prefill: int, backend: str, osdn: dict | None):
    T = inputs["q"].shape[1]
    o_pre, state, d = _whole(_token_slice(inputs, 0, prefill), backend, osdn)
    state = state.contiguous()
    if d is not None:
        d = d.contiguous()
    outs = [o_pre]
    for t in range(prefill, T):
        tok = _token_slice(inputs, t, t + 1)
        step = {name: tok[name] for name in ("g", "beta", "write_key", "erase") if tok.get(name) is not None}
        if osdn is not None:
            step.pop("write_key", None)
            step.update(osdn, d=d, retain=tok.get("retain"))
        outs.append(decode_step(tok["q"], tok["k"], tok["v"], state, n_h=inputs["n_h"], backend=backend, **step))
    return torch.cat(outs, dim=1), state, d


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert torch.isfinite(got).all(), what
    err = (got.double().cpu() - want.double().cpu()).abs().max().item()
    scale = max(1.0, want.double().abs().max().item())
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.2e} (scale {scale:.2f})"


def _check(case: Case, dtype: torch.dtype, backend: str, device: str, *, T: int = 9, prefill: int = 5,
           osdn: dict | None = None, retain: bool = False, d0: bool = False, seed: int = 0) -> None:
    inputs = make_inputs(case, B=2, T=T, H=2, K=8, V=16, dtype=dtype, device=device, seed=seed, requires_grad=False)
    if osdn is not None:
        inputs.pop("write_key", None)
        gen = torch.Generator().manual_seed(seed + 1)
        if retain:
            inputs["retain"] = (0.9 + 0.1 * torch.rand(2, T, 2, generator=gen, dtype=torch.float64)).to(device, dtype)
        if d0:
            inputs["d0"] = (0.6 + 1.2 * torch.rand(2, 2, 8, generator=gen, dtype=torch.float64)).to(device, dtype)
    with torch.no_grad():
        o_want, s_want, d_want = _whole(inputs, backend, osdn)
        o_got, s_got, d_got = _prefill_then_steps(inputs, prefill, backend, osdn)
    _close(o_got, o_want, dtype, "outputs")
    _close(s_got, s_want, dtype, "final state")
    if osdn is not None:
        _close(d_got, d_want, dtype, "OSDN d")


# Every plan; the preconditioned cases of `all_cases` take random write keys (the chunk
# path's view of OSDN); the real OSDN scan is tested below.
PLANS = all_cases(max_n_h=3)
OSDN = dict(eta=0.2, d_min=0.5, d_max=2.0)  # a large eta: d moves visibly every step
OSDN_PLANS = [
    (Case(gate=gate, n_h=n_h, write_key="preconditioned"), aware, retain, d0)
    for gate, n_h, (aware, retain, d0) in itertools.product(
        ("none", "scalar", "channel"), (1, 2), ((True, False, False), (False, True, True), (True, True, False)))
]


def _rwkv7_with_beta(dtype, backend, device):
    """RWKV-7's erase with a write strength `beta` (the kernels' HAS_BETA path)."""
    case = Case(gate="channel", transition="rwkv7", n_h=2, write_key="untied", beta_scale=2.0)
    inputs = make_inputs(case, B=2, T=7, H=2, K=8, V=16, dtype=dtype, device=device, requires_grad=False)
    inputs["beta"] = torch.rand(2, 14, 2, dtype=dtype, generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        o_want, s_want, _ = _whole(inputs, backend, None)
        o_got, s_got, _ = _prefill_then_steps(inputs, 3, backend, None)
    _close(o_got, o_want, dtype, "outputs")
    _close(s_got, s_want, dtype, "final state")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", PLANS, ids=[c.id for c in PLANS])
def test_torch_step_continues_the_chunk_path(case, dtype):
    _check(case, dtype, "torch", "cpu")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case,aware,retain,d0", OSDN_PLANS,
                         ids=[f"{c.gate}-nh{c.n_h}-aware{a}-apf{r}-d0{d}" for c, a, r, d in OSDN_PLANS])
def test_torch_step_with_osdn_continues_the_scan(case, aware, retain, d0, dtype):
    _check(case, dtype, "torch", "cpu", osdn={**OSDN, "beta_aware": aware}, retain=retain, d0=d0)


def test_torch_step_rwkv7_with_beta():
    _rwkv7_with_beta(torch.float64, "torch", "cpu")


# The Triton step: under the interpreter every launch costs tens of milliseconds, so the
# CPU runs one case per (gate, transition) family with the options spread over them, and
# CUDA runs them all.
TRITON_CPU_PLANS = [
    Case(gate="none", transition="householder", n_h=1),
    Case(gate="scalar", transition="householder", n_h=2, beta_scale=2.0, initial_state=True),
    Case(gate="channel", transition="householder", n_h=3, write_key="preconditioned"),
    Case(gate="none", transition="diagonal", write_key="untied", initial_state=True),
    Case(gate="scalar", transition="diagonal"),
    Case(gate="channel", transition="diagonal"),
    Case(gate="none", transition="rwkv7", n_h=1, write_key="untied"),
    Case(gate="channel", transition="rwkv7", n_h=2, write_key="untied", beta_scale=2.0),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", TRITON_CPU_PLANS, ids=[c.id for c in TRITON_CPU_PLANS])
def test_triton_step_continues_the_chunk_kernel(case, dtype):
    pytest.importorskip("triton")
    _check(case, dtype, "triton", "cuda" if CUDA else "cpu", T=6, prefill=4)


@pytest.mark.parametrize("gate,aware,retain", [("scalar", True, True), ("channel", False, False)])
def test_triton_step_with_osdn_continues_the_scan(gate, aware, retain):
    pytest.importorskip("triton")
    case = Case(gate=gate, n_h=2, write_key="preconditioned")
    _check(case, torch.float64, "triton", "cuda" if CUDA else "cpu", T=6, prefill=4,
           osdn={**OSDN, "beta_aware": aware}, retain=retain, d0=True)


def test_triton_step_rwkv7_with_beta():
    pytest.importorskip("triton")
    _rwkv7_with_beta(torch.float64, "triton", "cuda" if CUDA else "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", PLANS, ids=[c.id for c in PLANS])
def test_triton_step_every_plan_on_cuda(case, dtype):
    _check(case, dtype, "triton", "cuda", T=40, prefill=33)


@pytest.mark.gpu
@pytest.mark.parametrize("case,aware,retain,d0", OSDN_PLANS,
                         ids=[f"{c.gate}-nh{c.n_h}-aware{a}-apf{r}-d0{d}" for c, a, r, d in OSDN_PLANS])
def test_triton_step_with_osdn_on_cuda(case, aware, retain, d0):
    for dtype in (torch.float64, torch.float32):
        _check(case, dtype, "triton", "cuda", T=40, prefill=33, osdn={**OSDN, "beta_aware": aware}, retain=retain, d0=d0)


@pytest.mark.gpu
def test_triton_step_in_bfloat16_on_cuda_follows_float64():
    """bfloat16 token vectors over a float32 state: the step against the float64 definition."""
    case = Case(gate="scalar", transition="householder", n_h=2)
    inputs = make_inputs(case, B=4, T=1, H=4, K=128, V=128, dtype=torch.float64, device="cuda", requires_grad=False)
    state = torch.randn(4, 4, 128, 128, device="cuda", dtype=torch.float64) * 0.1
    tok = {n: inputs[n] for n in ("q", "k", "v", "g", "beta")}
    want_state = state.clone()
    want = decode_step(**tok, state=want_state, n_h=2, backend="torch")
    got_state = state.float()
    got = decode_step(**{n: t.bfloat16() for n, t in tok.items()}, state=got_state, n_h=2, backend="triton")
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max().item() < 3e-2 * want.abs().max().item()
    assert (got_state.double() - want_state).abs().max().item() < 1e-2 * want_state.abs().max().item()


def test_the_step_definition_is_one_token_of_recurrence_md():
    """`decode_step_naive` against the token written out here: channel gate, two Householder
    sub-steps with OSDN write keys and APF, then the read-out."""
    gen = torch.Generator().manual_seed(5)
    B, H, K, V = 2, 3, 4, 5

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rand(B, 1, H, K), F.normalize(rand(B, 2, H, K), dim=-1), rand(B, 2, H, V)
    g, beta = -F.softplus(rand(B, 1, H, K)), torch.sigmoid(rand(B, 2, H))
    retain, d = torch.sigmoid(rand(B, 1, H)), 0.5 + torch.rand(B, H, K, generator=gen, dtype=torch.float64)
    state = rand(B, H, K, V)
    eta, eps = 0.1, 1e-6

    S, dd = state.clone(), d.clone()
    want = torch.empty(B, H, V, dtype=torch.float64)
    for b, h in itertools.product(range(B), range(H)):
        M = torch.diag(torch.exp(g[b, 0, h])) @ S[b, h]
        dv = dd[b, h]
        for j in range(2):
            kj, bj = k[b, j, h], beta[b, j, h]
            w = dv * kj
            s = kj * kj
            rho = retain[b, 0, h] if j == 0 else 1.0
            dv = torch.clamp(rho * dv + eta * bj * (1 - bj * (dv @ s)) / max(float(kj @ kj), eps) * s, 0.5, 2.0)
            M = M + bj * torch.outer(w, v[b, j, h] - M.T @ kj)
        want[b, h] = M.T @ (K**-0.5 * q[b, 0, h])
        S[b, h], dd[b, h] = M, dv

    got_state, got_d = state.clone(), d.clone()
    got = decode_step(q, k, v, got_state, g=g, beta=beta, n_h=2, d=got_d, retain=retain, eta=eta, backend="naive")
    torch.testing.assert_close(got[:, 0], want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_state, S, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_d, dd, rtol=0, atol=1e-12)


def test_bad_step_arguments_are_named():
    q, k, v = torch.zeros(2, 1, 3, 4), torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 5)
    state = torch.zeros(2, 3, 4, 5)
    with pytest.raises(ValueError, match=r"decode_step: q must be \[B, 1, H, K\] \(one token\)"):
        decode_step(torch.zeros(2, 2, 3, 4), k, v, state, n_h=2)
    with pytest.raises(ValueError, match=r"k must be \[B, n_h, H, K\] = \(2, 1, 3, 4\)"):
        decode_step(q, k, v, state)
    with pytest.raises(ValueError, match=r"state must be \[B, H, K, V\] = \(2, 3, 4, 5\)"):
        decode_step(q, k, v, torch.zeros(2, 3, 5, 4), n_h=2)
    with pytest.raises(ValueError, match="contiguous float32"):
        decode_step(q, k, v, state.half(), n_h=2)
    with pytest.raises(ValueError, match="OSDN preconditions the delta rule: it needs beta"):
        decode_step(q, k, v, state, n_h=2, d=torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="retain \\(APF\\) acts on OSDN's d"):
        decode_step(q, k, v, state, n_h=2, beta=torch.ones(2, 2, 3), retain=torch.ones(2, 1, 3))
    with pytest.raises(TypeError, match="decode_step: k must be a floating-point tensor"):
        decode_step(q, k.long(), v, state, n_h=2)
    with pytest.raises(ValueError, match="decode_step: eta must be a finite number"):
        decode_step(q, k, v, state, n_h=2, beta=torch.ones(2, 2, 3), d=torch.ones(2, 3, 4), eta=float("nan"))
    with pytest.raises(ValueError, match="gate='channel' does not match g of shape \\(2, 1, 3\\)"):
        decode_step(q, k, v, state, n_h=2, g=torch.zeros(2, 1, 3), gate="channel")


# (conv width, streams as (width, head_dim)): q, k, v as a mixer has them (K = 8, V = 16),
# an untied write key, n_h = 2 sub-steps, no norm (the diagonal transition), one stream,
# and no conv at all (W = 0).
STREAM_CASES = [
    (4, ((16, 8), (16, 8), (32, 0))),
    (4, ((16, 8), (32, 8), (64, 0), (32, 8))),
    (2, ((24, 0), (24, 0), (40, 0))),
    (1, ((16, 16),)),
    (3, ((16, 8), (16, 8), (20, 0))),
    (0, ((16, 8), (16, 8), (32, 0))),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("W,streams", STREAM_CASES, ids=[f"W{w}-{len(s)}streams-{i}" for i, (w, s) in enumerate(STREAM_CASES)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_stream_step_continues_each_streams_conv(backend, W, streams, dtype):
    """The streams' decoding step against the training path, stream by stream, on a
    one-token piece: the output of `short_conv` (with its SiLU and norm) with the carried
    tail, and the tail `conv_tails` carries on. The token's rows are column slices of a
    wider output (as the mixer's joined projection gives them)."""
    if backend == "triton":
        pytest.importorskip("triton")
    from archspec.kernels import conv_tails, short_conv
    from archspec.kernels.short_conv import stream_step

    device = "cuda" if CUDA and backend == "triton" else "cpu"
    gen = torch.Generator().manual_seed(W + len(streams))
    B, C = 3, sum(width for width, _ in streams)
    wide = torch.randn(B, 1, C + 5, generator=gen, dtype=torch.float64).to(device, dtype)
    x = wide[..., :C]
    weight = torch.randn(C, W, generator=gen, dtype=torch.float64).to(device, dtype) if W else None
    tail = torch.randn(B, max(W - 1, 0), C, generator=gen, dtype=torch.float64).to(device, dtype) if W else None
    wants, want_tails, lo = [], [], 0
    for width, head in streams:
        part = slice(lo, lo + width)
        if W:
            wants.append(short_conv(x[..., part], weight[part, None], tail=tail[..., part] if W > 1 else None,
                                    activation=True, head_dim=head, backend="torch"))
            want_tails.append(conv_tails(x[..., part], tail[..., part], None, W))
        else:
            z = torch.nn.functional.silu(x[..., part])
            wants.append(F.normalize(z.unflatten(-1, (-1, head)), dim=-1, eps=1e-6).flatten(-2) if head else z)
        lo += width
    got_tail = None if tail is None else tail.clone()
    got = stream_step(x, weight, got_tail, streams, backend=backend)
    tol = TOL[dtype]
    torch.testing.assert_close(got, torch.cat(wants, dim=-1), rtol=tol, atol=tol)
    if W:
        torch.testing.assert_close(got_tail, torch.cat(want_tails, dim=-1), rtol=0, atol=0)


def test_bad_stream_step_arguments_are_named():
    from archspec.kernels.short_conv import stream_step

    x, weight, tail = torch.zeros(2, 1, 12), torch.zeros(12, 4), torch.zeros(2, 3, 12)
    with pytest.raises(ValueError, match="widths sum to 12"):
        stream_step(x, weight, tail, ((4, 4), (4, 4)))
    with pytest.raises(ValueError, match="head_dim \\(0: no norm\\) divides the width"):
        stream_step(x, weight, tail, ((6, 4), (6, 0)))
    with pytest.raises(ValueError, match="tail must be a contiguous \\[2, 3, 12\\]"):
        stream_step(x, weight, torch.zeros(2, 2, 12), ((12, 0),))
    with pytest.raises(ValueError, match="weight and tail together"):
        stream_step(x, weight, None, ((12, 0),))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("gate", ["scalar", "channel"])
@pytest.mark.parametrize("form", ["mamba2", "rwkv7", "gla"])
def test_raw_projections_equal_the_formed_gate_and_beta(backend, gate, form):
    """`decode_step` with `decay` and `beta_scale` (the gate's projection and beta's logits,
    column slices of one wider row, as the model's step hands them over) against the same
    step with `gate_log_decay`'s g and `beta_scale * sigmoid(logits)` formed first."""
    if backend == "triton":
        pytest.importorskip("triton")
    from archspec.kernels import gate_log_decay

    device = "cuda" if CUDA and backend == "triton" else "cpu"
    gen = torch.Generator().manual_seed(5)
    B, n, H, K, V = 3, 2, 2, 8, 16
    gate_width = H if gate == "scalar" else H * K
    row = torch.randn(B, 1, n * H + gate_width + 3, generator=gen, dtype=torch.float64).to(device)
    logits = row[..., : n * H].reshape(B, n, H)
    proj = row[..., n * H : n * H + gate_width].reshape(B, 1, H, *([K] if gate == "channel" else []))
    A_log = torch.randn(H, generator=gen, dtype=torch.float64).to(device)
    dt_bias = torch.randn(*((H,) if gate == "scalar" else (H, K)), generator=gen, dtype=torch.float64).to(device)
    q = F.normalize(torch.randn(B, 1, H, K, generator=gen, dtype=torch.float64), dim=-1).to(device)
    k = F.normalize(torch.randn(B, n, H, K, generator=gen, dtype=torch.float64), dim=-1).to(device)
    v = torch.randn(B, n, H, V, generator=gen, dtype=torch.float64).to(device)
    state = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64).to(device)
    g = gate_log_decay(A_log[:, None] if gate == "channel" else A_log, proj, dt_bias, form=form, backend="torch")
    want_state = state.clone()
    want = decode_step(q, k, v, want_state, g=g, beta=2.0 * torch.sigmoid(logits), n_h=n, backend="torch")
    got_state = state.clone()
    got = decode_step(q, k, v, got_state, g=proj, decay=(A_log, dt_bias), decay_form=form, beta=logits, beta_scale=2.0,
                      n_h=n, backend=backend)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_state, want_state, rtol=1e-10, atol=1e-10)


def test_bad_raw_projection_arguments_are_named():
    q, k, v = torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 5)
    state = torch.zeros(2, 3, 4, 5)
    with pytest.raises(ValueError, match="beta_scale turns beta's logits into beta: pass beta too"):
        decode_step(q, k, v, state, beta_scale=1.0)
    with pytest.raises(ValueError, match="decay's A_log must be \\[H\\] = \\(3,\\)"):
        decode_step(q, k, v, state, g=torch.zeros(2, 1, 3), decay=(torch.zeros(4), torch.zeros(3)))
    with pytest.raises(ValueError, match="decay's bias must be one of \\[\\(3, 4\\), \\(12,\\)\\]"):
        decode_step(q, k, v, state, g=torch.zeros(2, 1, 3, 4), decay=(torch.zeros(3), torch.zeros(3)))
    with pytest.raises(ValueError, match="decay forms the log decay from the gate's projection: pass g too"):
        decode_step(q, k, v, state, decay=(torch.zeros(3), torch.zeros(3)))
    with pytest.raises(ValueError, match="decay form must be one of \\['mamba2', 'rwkv7', 'gla'\\], got 'softplus'"):
        decode_step(q, k, v, state, g=torch.zeros(2, 1, 3), decay=(torch.zeros(3), torch.zeros(3)), decay_form="softplus")
