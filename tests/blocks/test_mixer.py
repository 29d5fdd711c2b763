"""The mixer and the LM stack: every plan builds and trains; the mixer is the composition
it claims to be (checked against a hand-written float64 reference); capture works."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from archspec.blocks import Mixer, build_model
from archspec.kernels import linear_recurrence_naive, osdn_write_keys_naive

from .plans import COMBINATIONS, mixer_plan, model_plan, _osdn


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_every_plan_builds_runs_and_backpropagates(name):
    torch.manual_seed(0)
    model = build_model(model_plan(COMBINATIONS[name], mlp="swiglu" if len(name) % 2 else "gelu"))
    model.set_backend("naive")
    ids = torch.randint(0, 13, (2, 5))
    logits = model(ids)
    assert logits.shape == (2, 5, 13)
    loss = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{pname} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{pname} has a non-finite gradient"
    # the gradient reaches every kind of parameter, not only the residual path
    mixer = model.mixers()[0]
    assert mixer.proj["k"].weight.grad.abs().sum() > 0
    if mixer.gate is not None:  # the learned rate (mamba2) or the bias (every form)
        assert mixer.gate.bias.grad.abs().sum() > 0
        if mixer.gate.form == "mamba2":  # rwkv7's and gla's rates are constants, not parameters
            assert mixer.gate.A_log.grad.abs().sum() > 0
        else:
            assert not hasattr(mixer.gate, "A_log")


def test_mlp_none_and_tied_embeddings():
    model = build_model(model_plan(mixer_plan(), mlp="none", tie=True))
    assert model.head.weight is model.embed.weight
    assert model.blocks[0].mlp is None
    model.set_backend("naive")
    assert torch.isfinite(model(torch.randint(0, 13, (1, 4)))).all()


# --- the mixer against a hand-written composition ------------------------------------


def _causal_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y[t] = sum_j w[j] x[t - (W-1) + j], written as an explicit sum over taps."""
    W = weight.shape[-1]
    y = torch.zeros_like(x)
    for j in range(W):
        shift = W - 1 - j
        shifted = torch.cat([x.new_zeros(x.shape[0], shift, x.shape[2]), x[:, : x.shape[1] - shift]], dim=1)
        y = y + weight[:, 0, j] * shifted
    return y


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True)).clamp_min(1e-6)


def _reference_mixer(m: Mixer, x: torch.Tensor) -> torch.Tensor:
    """RECURRENCE.md and the issue's layer description, from the mixer's raw parameters."""
    p = m.plan
    B, T, _ = x.shape
    H, K, V, n = p.heads, p.head_dim, p.value_dim, p.n_h

    def stream(name):
        h = x @ m.proj[name].weight.T
        if p.short_conv:
            h = _causal_conv(h, m.conv[name].conv.weight)
        return h * torch.sigmoid(h)  # SiLU

    q = stream("q").reshape(B, T, H, K)
    k = stream("k").reshape(B, T, n, H, K).reshape(B, T * n, H, K)
    v = stream("v").reshape(B, T, n, H, V).reshape(B, T * n, H, V)
    if p.transition != "diagonal":
        q, k = _unit(q), _unit(k)
    kw = {}
    if p.transition == "householder":
        kw["beta"] = p.beta_scale * torch.sigmoid(x @ m.b_proj.weight.T).reshape(B, T * n, H)
    if p.transition == "rwkv7":
        a_logits = (x @ m.a_proj.down.weight.T) @ m.a_proj.up.weight.T + m.a_proj.up.bias
        kw["erase"] = p.beta_scale * torch.sigmoid(a_logits).reshape(B, T * n, H, K) * k
        kw["write_key"] = _unit(stream("w").reshape(B, T * n, H, K))
    if p.gate == "scalar" and p.decay == "mamba2":
        gate = m.gate
        kw["g"] = -torch.exp(gate.A_log) * F.softplus(x @ gate.a_proj.weight.T + gate.dt_bias)
    elif p.gate == "channel" and p.decay == "mamba2":
        gate = m.gate
        logits = (x @ gate.f_proj.down.weight.T) @ gate.f_proj.up.weight.T + gate.dt_bias
        kw["g"] = -torch.exp(gate.A_log)[:, None] * F.softplus(logits.reshape(B, T, H, K))
    elif p.gate == "channel" and p.decay == "gla":  # GLA: logsigmoid(x W1 W2 + b) / 16
        gate = m.gate
        logits = (x @ gate.f_proj.down.weight.T) @ gate.f_proj.up.weight.T + gate.gk_bias
        kw["g"] = F.logsigmoid(logits.reshape(B, T, H, K)) / 16
    elif p.gate == "channel":  # RWKV-7: w = exp(-e^{-1/2} sigmoid(w0 + tanh(x W1) W2))
        gate = m.gate
        logits = torch.tanh(x @ gate.f_proj.down.weight.T) @ gate.f_proj.up.weight.T + gate.w0
        kw["g"] = -math.exp(-0.5) * torch.sigmoid(logits.reshape(B, T, H, K))
    elif p.gate == "scalar":
        kw["g"] = -math.exp(-0.5) * torch.sigmoid(x @ m.gate.a_proj.weight.T + m.gate.w0)
    if p.preconditioner is not None:
        pre, pp = m.preconditioner, p.preconditioner
        retain = torch.sigmoid(x @ pre.retain_proj.weight.T + pre.retain_proj.bias) if pp.apf else None
        d0 = (1 + pre.d0_delta).clamp(pp.d_min, pp.d_max) if pp.init == "learned" else None
        kw["write_key"], _ = osdn_write_keys_naive(
            k, kw["beta"], eta=pp.eta, d_min=pp.d_min, d_max=pp.d_max, retain=retain, beta_aware=pp.beta_aware, d0=d0
        )
    o, _ = linear_recurrence_naive(q, k, v, n_h=n, scale=K**-0.5, **kw)
    eps = m.o_norm.eps if p.backbone == "deltanet" else m.o_norm.norm.eps
    if p.backbone == "deltanet":
        o = _rms(o, m.o_norm.weight, eps)
    elif p.backbone == "gdn":
        gx = (x @ m.g_proj.weight.T).reshape(B, T, H, V)
        o = _rms(o, m.o_norm.norm.weight, eps) * F.silu(gx)
    else:
        gx = ((x @ m.g_proj.down.weight.T) @ m.g_proj.up.weight.T + m.g_proj.up.bias).reshape(B, T, H, V)
        o = _rms(o, m.o_norm.norm.weight, eps) * torch.sigmoid(gx)
    return o.reshape(B, T, H * V) @ m.o_proj.weight.T


@pytest.mark.parametrize(
    "plan",
    [
        mixer_plan("gdn", "scalar", n_h=2, beta_scale=2.0, short_conv=3),
        mixer_plan("kda", "channel", "rwkv7", n_h=2, beta_scale=2.0, short_conv=4),
        mixer_plan("deltanet", "channel", n_h=2, osdn=_osdn(apf=True, init="learned"), short_conv=2),
        mixer_plan("gdn", "channel", "diagonal", short_conv=0),
        mixer_plan("kda", "channel", "rwkv7", short_conv=4, decay="rwkv7"),
        mixer_plan("gdn", "scalar", short_conv=2, decay="rwkv7"),
        mixer_plan("kda", "channel", "diagonal", short_conv=4, decay="gla"),
    ],
    ids=["gated-deltaproduct", "rwkv7-kda", "osdn-apf-learned", "gla-like", "rwkv7-own-decay", "gdn-rwkv7-decay",
         "gla-own-decay"],
)
def test_mixer_equals_reference_composition(plan):
    torch.manual_seed(1)
    m = Mixer(plan, d_model=12).double()
    # Move the zero-initialised parameters off zero so that every term matters.
    with torch.no_grad():
        for name, param in m.named_parameters():
            if "bias" in name or "d0_delta" in name or "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    m.backend = "naive"
    x = torch.randn(2, 7, 12, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 7, 12, dtype=torch.float64)  # a fixed random cotangent
    params = [x, *m.parameters()]

    y = m(x)[0]
    grads = torch.autograd.grad((y * weight).sum(), params)
    y_ref = _reference_mixer(m, x)
    grads_ref = torch.autograd.grad((y_ref * weight).sum(), params)

    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    names = ["x", *(name for name, _ in m.named_parameters())]
    for name, g, g_ref in zip(names, grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-12, msg=lambda e, n=name: f"grad of {n}: {e}")
        assert g.abs().sum() > 0, f"{name} has a zero gradient"


@pytest.mark.parametrize("name", ["householder-nh2-b2-scalar", "rwkv7-nh2-b2-channel", "osgdn-apf-learned", "diagonal-channel"])
def test_model_on_the_chunked_backend_matches_the_naive_loop(name):
    """End to end in float64: logits and every parameter gradient, torch vs naive backend."""
    torch.manual_seed(3)
    model = build_model(model_plan(COMBINATIONS[name])).double()
    ids = torch.randint(0, 13, (2, 11))
    results = {}
    for backend in ("naive", "torch"):
        model.set_backend(backend)
        model.zero_grad()
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
        results[backend] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(results["torch"][0], results["naive"][0], rtol=1e-9, atol=1e-11)
    for n, g in results["naive"][1].items():
        torch.testing.assert_close(results["torch"][1][n], g, rtol=1e-8, atol=1e-11, msg=lambda e, n=n: f"grad of {n}: {e}")


def test_capture_returns_the_kernel_inputs():
    torch.manual_seed(2)
    m = Mixer(mixer_plan("gdn", "scalar", n_h=2, osdn=_osdn(apf=True)), d_model=12).double()
    m.backend = "naive"
    x = torch.randn(1, 5, 12, dtype=torch.float64)
    m.capture = True
    y, _ = m(x)
    cap = m.captured
    assert m.capture is False  # one-shot: the forward after does not store again
    assert cap["n_h"] == 2 and cap["scale"] == 4**-0.5
    assert cap["k"].shape == (1, 10, 2, 4) and cap["g"].shape == (1, 5, 2) and cap["beta"].shape == (1, 10, 2)
    torch.testing.assert_close(cap["k"].norm(dim=-1), torch.ones(1, 10, 2, dtype=torch.float64))
    assert not cap["q"].requires_grad
    # The captured kernel inputs reproduce the layer's recurrence output ...
    args = {k: v for k, v in cap.items() if k not in ("osdn_inputs", "initial_state", "output_final_state")}
    o, _ = linear_recurrence_naive(**args)
    seen = []  # the recurrence output, as it enters the output norm
    read_out = m.o_norm.project
    m.o_norm.project = lambda o, *rest: seen.append(o) or read_out(o, *rest)
    m(x)
    del m.o_norm.project
    torch.testing.assert_close(o, seen[0])
    # ... and the OSDN inputs reproduce the write keys.
    osdn = cap["osdn_inputs"]
    assert osdn["retain"].shape == (1, 5, 2) and osdn["eta"] == 0.5
    w, _ = osdn_write_keys_naive(**osdn)
    torch.testing.assert_close(w, cap["write_key"])


@pytest.mark.parametrize("backbone,gate", [("deltanet", "none"), ("gdn", "scalar")])
def test_a_hooked_or_replaced_o_proj_keeps_its_own_forward(backbone, gate):
    """The fused read-out uses `o_proj`'s weight alone; an `o_proj` with a forward hook
    or replaced by another module (an adapter) must still run its own forward."""
    torch.manual_seed(3)
    m = Mixer(mixer_plan(backbone, gate), d_model=12).double()
    for module in m.modules():
        if hasattr(module, "fused_backend"):
            module.fused_backend = "triton"  # the fused read-out, on the interpreter
    m.backend = "naive"
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    plain = m(x)[0]
    handle = m.o_proj.register_forward_hook(lambda module, inputs, output: output + 1)
    torch.testing.assert_close(m(x)[0], plain + 1)
    handle.remove()

    class Adapter(torch.nn.Linear):  # what a LoRA wrapper does: its own forward on top
        def forward(self, rows):
            return super().forward(rows) + 2 * rows[..., :1]

    adapter = Adapter(m.o_proj.in_features, m.o_proj.out_features, bias=False).double()
    adapter.weight.data.copy_(m.o_proj.weight.data)
    normed = []
    m.o_norm.register_forward_hook(lambda module, inputs, output: normed.append(output))
    m.o_proj = adapter
    y = m(x)[0]
    torch.testing.assert_close(y, plain + 2 * normed[0].flatten(-2)[..., :1])


def test_rwkv7_decay_is_bounded_and_starts_at_rwkv7s_decay_speeds():
    """The rwkv7 form: w0 at RWKV-7's per-channel speeds for each layer's depth (written
    out here from the reference model's time-mix init), no learned rate in the state dict,
    and never more than e^{-1/2} nats a token, however large the input."""
    layers = 3
    model = build_model(model_plan(COMBINATIONS["rwkv7-decay-channel"], layers=layers))
    for i, mixer in enumerate(model.mixers()):
        gate = mixer.gate
        channels = gate.heads * gate.head_dim
        ratio_0_to_1 = i / (layers - 1)
        speeds = [-7 + 5 * (n / (channels - 1)) ** (0.85 + 1.0 * ratio_0_to_1**0.5) for n in range(channels)]
        torch.testing.assert_close(gate.w0.detach().double(), torch.tensor(speeds, dtype=torch.float64) + 0.5,
                                   rtol=0, atol=1e-6)
        g = gate(1e3 * torch.randn(2, 7, model.plan.d_model))
        assert bool(((g <= 0) & (g >= -math.exp(-0.5))).all())
    keys = model.state_dict().keys()
    assert not any(k.endswith("gate.A_log") or k.endswith("gate.dt_bias") for k in keys)
    assert sum(k.endswith("gate.w0") for k in keys) == layers


def test_mamba2_gates_start_at_mamba2s_rates_and_time_steps():
    """The mamba2 form as flash-linear-attention 0.6 initialises Gated DeltaNet and KDA (and
    transformers' Kimi Linear): `A = exp(A_log)` uniform per head in [0, 16] (scalar) or
    [1, 16] (channel), and `softplus(dt_bias) = dt` log-uniform in [0.001, 0.1], per head
    for the scalar gate and per key channel for KDA's, so that an initialised layer decays
    by `A dt` a token: a fraction of a nat, never the several nats of `dt_bias = 0`."""
    torch.manual_seed(0)
    heads, head_dim = 16, 32
    for plan_name, low, rates_per in (("gdn-scalar", 0.0, "head"), ("kda-channel", 1.0, "channel")):
        mixer = build_model(model_plan(COMBINATIONS[plan_name], layers=1)).mixers()[0]
        plan = dataclasses.replace(mixer.plan, heads=heads, head_dim=head_dim)
        gate = Mixer(plan, 64).gate
        A = gate.A_log.detach().exp()
        dt = F.softplus(gate.dt_bias.detach().double())
        assert A.shape == (heads,) and bool(((A >= low) & (A <= 16)).all()) and A.max() > 12, plan_name
        assert dt.numel() == (heads if rates_per == "head" else heads * head_dim), plan_name
        torch.testing.assert_close(dt.min(), torch.tensor(1e-3, dtype=torch.float64), rtol=0.5, atol=0)
        assert bool((dt <= 0.1 + 1e-6).all()) and dt.max() > 0.05, plan_name
        if rates_per == "channel":  # log-uniform: as many time steps in each decade
            decades = torch.histc(dt.log10(), bins=2, min=-3, max=-1)
            assert bool((decades / dt.numel() - 0.5).abs().max() < 0.1), decades
        g = gate(torch.randn(2, 64, 64))
        assert -g.mean() < 0.5, plan_name
