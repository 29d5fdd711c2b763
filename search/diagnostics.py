"""What the recurrent state does, measured by replaying a layer's exact kernel inputs.

`collect(model, inputs)` sets `mixer.capture` on every layer (docs/interfaces.md), runs
one forward pass, and replays each layer's captured `linear_recurrence` arguments
through the naive recurrence (`kernels.naive`, float64) one sub-step at a time, keeping
what the kernels never materialise:

- effective rank of the state after each token, per head: `exp(H(p))` with
  `p = sigma / sum(sigma)` over the state's singular values (Roy & Vetterli 2007; the
  DeltaProduct paper's Fig. 9). Undefined (NaN) for a zero state.
- OSDN's residual ratio per sub-step: `q_i = f_i(S_i) / f_i(S_{i-1})` with the local loss
  `f_i(S) = 1/2 |S^T k_i - v_i|^2`, `S_{i-1}` taken after the gate (the residual the
  update corrects). For a unit key and write key `w = d * k` it is
  `(1 - beta <d, k*k>)^2` (OSDN Sec. 2.4). Sub-steps whose residual is already zero
  (0/0) are skipped, as the OSDN notes advise; `q_geo = exp(mean log q)`.
- the spectral norm of each transition factor, `I - beta w k^T` (delta rule) or
  `I - e k^T` (rwkv7), and its maximum: above 1 only for non-normal factors such as
  OSDN's (RECURRENCE.md, "Stability rule"). The gate's `exp(g) <= 1` is left out.
- the write gain `<w, k> / |k|^2` of each delta-rule sub-step: 1 for a tied write key,
  `<d, k*k>` for OSDN's `w = d * k` with a unit key, so its mean shows how far the
  preconditioner has moved the step along the keys.

Metric names: `erank@<layer>.<head>` (mean over sequences and positions),
`q_geo@<layer>` and `q_geo@<layer>.<head>`, `max_factor_norm@<layer>`, `write_gain@<layer>`
(delta-rule layers only), and over the whole model `q_geo` and `max_factor_norm`. Layers
and heads count from 0; a layer is its index in the stack.

These quantities belong to a recurrent state. In a hybrid stack the attention layers
have none of them (their state is a KV cache that grows with the sequence and is not
replayed): they get no metric, and the report says so per layer (`notes`).
"""

from __future__ import annotations

import re

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from archspec.kernels.naive import apply_gate, recurrence_step

from .metrics import geometric_mean

Tensor = torch.Tensor

# The names `summarize` reports, spelled as patterns (layers and heads depend on the
# model): a search checks its objectives against them before anything trains.
METRIC_PATTERNS: dict[str, re.Pattern[str]] = {
    "erank@<layer>.<head>": re.compile(r"erank@\d+\.\d+"),
    "q_geo@<layer>": re.compile(r"q_geo@\d+"),
    "q_geo@<layer>.<head>": re.compile(r"q_geo@\d+\.\d+"),
    "max_factor_norm@<layer>": re.compile(r"max_factor_norm@\d+"),
    "write_gain@<layer>": re.compile(r"write_gain@\d+"),
    "q_geo": re.compile(r"q_geo"),
    "max_factor_norm": re.compile(r"max_factor_norm"),
}

# A residual below this (squared norm, float64) is zero: its ratio is 0/0 and skipped.
ZERO_RESIDUAL = 1e-24


def effective_rank(states: Tensor) -> Tensor:
    """`exp` of the entropy of the normalized singular values of `[..., K, V]` matrices."""
    sv = torch.linalg.svdvals(states.double())
    total = sv.sum(-1, keepdim=True)
    p = sv / total.clamp(min=torch.finfo(torch.float64).tiny)
    entropy = -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(-1)
    return torch.where(total.squeeze(-1) > 0, torch.exp(entropy), torch.full_like(entropy, float("nan")))


def factor(k: Tensor, *, beta: Tensor | None, write_key: Tensor | None, erase: Tensor | None) -> Tensor | None:
    """The sub-step's transition factor `[N, H, K, K]` acting on the state from the left,
    or None for a plain additive write (identity). Shapes as `recurrence_step`."""
    K = k.shape[-1]
    eye = torch.eye(K, dtype=k.dtype, device=k.device)
    if erase is not None:  # S <- (I - e k^T) S + ...
        return eye - erase[..., :, None] * k[..., None, :]
    if beta is not None:  # S <- (I - beta w k^T) S + beta w v^T
        w = k if write_key is None else write_key
        return eye - beta[..., None, None] * w[..., :, None] * k[..., None, :]
    return None


@dataclass
class LayerReplay:
    """One layer's replay: `erank` `[B, T, H]`, `residual_ratio` `[B, T*n_h, H]` (NaN where
    skipped), `factor_norm` `[B, T*n_h, H]` (NaN when the factor is the identity),
    `write_gain` `[B, T*n_h, H]` (NaN without a delta rule)."""

    erank: Tensor
    residual_ratio: Tensor
    factor_norm: Tensor
    write_gain: Tensor
    n_h: int


def replay(captured: dict) -> LayerReplay:
    """Replay the captured keyword arguments of one `linear_recurrence` call (float64)."""

    def get(name: str) -> Tensor | None:
        t = captured.get(name)
        return None if t is None else t.detach().to("cpu", torch.float64)

    q, k, v = get("q"), get("k"), get("v")
    g, beta, write_key, erase = get("g"), get("beta"), get("write_key"), get("erase")
    n_h = int(captured.get("n_h", 1))
    B, T, H, K = q.shape
    V = v.shape[-1]
    initial = get("initial_state")
    state = torch.zeros(B, H, K, V, dtype=torch.float64) if initial is None else initial.clone()

    erank = torch.empty(B, T, H, dtype=torch.float64)
    ratio = torch.full((B, T * n_h, H), float("nan"), dtype=torch.float64)
    norms = torch.full((B, T * n_h, H), float("nan"), dtype=torch.float64)
    gain = torch.full((B, T * n_h, H), float("nan"), dtype=torch.float64)
    if beta is not None and erase is None:
        w = k if write_key is None else write_key
        gain = (w * k).sum(-1) / (k * k).sum(-1).clamp(min=torch.finfo(torch.float64).tiny)
    for t in range(T):
        if g is not None:
            state = apply_gate(state, g[:, t])
        for j in range(n_h):
            i = t * n_h + j
            step = dict(
                beta=None if beta is None else beta[:, i],
                write_key=None if write_key is None else write_key[:, i],
                erase=None if erase is None else erase[:, i],
            )
            ki, vi = k[:, i], v[:, i]
            before = (vi - torch.einsum("bhkv,bhk->bhv", state, ki)).pow(2).sum(-1)
            state = recurrence_step(state, ki, vi, **step)
            after = (vi - torch.einsum("bhkv,bhk->bhv", state, ki)).pow(2).sum(-1)
            ratio[:, i] = torch.where(before > ZERO_RESIDUAL, after / before.clamp(min=ZERO_RESIDUAL), ratio[:, i])
            f = factor(ki, **step)
            if f is not None:
                norms[:, i] = torch.linalg.matrix_norm(f, ord=2)
        erank[:, t] = effective_rank(state)
    return LayerReplay(erank, ratio, norms, gain, n_h)


ATTENTION_NOTE = (
    "attention layer: effective rank, residual ratio, factor norms and write gain describe a "
    "recurrent matrix state; this layer's state is a KV cache, so they do not apply"
)


@dataclass
class DiagnosticsReport:
    """Scalar metrics, and per-layer curves along the sequence for the plots:
    `erank[i]` `[H, T]` (mean over sequences), `residual_ratio[i]` `[T]` (geometric mean
    over sequences, heads and the token's sub-steps), for the recurrent layer
    `layers[i]` of the stack; `notes[layer]` says why a layer has no diagnostics."""

    metrics: dict[str, float]
    erank: list[list[list[float]]] = field(default_factory=list)
    residual_ratio: list[list[float]] = field(default_factory=list)
    layers: list[int] | None = None  # the stack index of each curve; None: 0, 1, ...
    notes: dict[int, str] = field(default_factory=dict)

    def layer_index(self, i: int) -> int:
        return i if self.layers is None else self.layers[i]


def _nanmean(x: Tensor) -> float:
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else float("nan")


def summarize(layers: list[LayerReplay], indices: list[int] | None = None) -> DiagnosticsReport:
    """Metrics and curves from the replays of every recurrent layer; `indices` are their
    places in the stack (default 0, 1, ...)."""
    indices = list(range(len(layers))) if indices is None else indices
    metrics: dict[str, float] = {}
    erank_curves, ratio_curves = [], []
    all_ratios, all_norms = [], []
    for li, layer in zip(indices, layers):
        B, T, H = layer.erank.shape
        for h in range(H):
            metrics[f"erank@{li}.{h}"] = _nanmean(layer.erank[:, :, h])
            metrics[f"q_geo@{li}.{h}"] = geometric_mean(layer.residual_ratio[:, :, h])
        metrics[f"q_geo@{li}"] = geometric_mean(layer.residual_ratio)
        finite_norms = layer.factor_norm[torch.isfinite(layer.factor_norm)]
        metrics[f"max_factor_norm@{li}"] = float(finite_norms.max()) if finite_norms.numel() else 1.0
        if torch.isfinite(layer.write_gain).any():
            metrics[f"write_gain@{li}"] = _nanmean(layer.write_gain)
        all_ratios.append(layer.residual_ratio.flatten())
        all_norms.append(metrics[f"max_factor_norm@{li}"])

        erank_curves.append(
            [[_nanmean(layer.erank[:, t, h]) for t in range(T)] for h in range(H)]
        )
        per_token = layer.residual_ratio.reshape(B, T, layer.n_h, H)
        ratio_curves.append([geometric_mean(per_token[:, t]) for t in range(T)])
    if layers:
        metrics["q_geo"] = geometric_mean(torch.cat(all_ratios))
        metrics["max_factor_norm"] = max(all_norms)
    return DiagnosticsReport(metrics, erank_curves, ratio_curves, layers=indices)


@torch.no_grad()
def collect(model: nn.Module, inputs: Tensor) -> DiagnosticsReport:
    """Run `model` once on `inputs` `[B, T]` with every recurrent mixer capturing, then
    replay; attention layers are noted, not measured.

    The forward runs in float32 without autocast so that the replay sees the values a
    full-precision kernel would.
    """
    mixers = model.mixers()
    recurrent = model.recurrent_layers() if hasattr(model, "recurrent_layers") else list(range(len(mixers)))
    depth = len(model.sequence_mixers()) if hasattr(model, "sequence_mixers") else len(mixers)
    was_training = model.training
    model.eval()
    try:
        for mixer in mixers:
            mixer.capture = True
        device = next(model.parameters()).device
        model(inputs.to(device))
        captured = [mixer.captured for mixer in mixers]
    finally:
        for mixer in mixers:
            mixer.capture = False
            mixer.captured = None
        model.train(was_training)
    missing = [recurrent[i] for i, c in enumerate(captured) if c is None]
    if missing:
        raise RuntimeError(f"diagnostics: layers {missing} captured nothing (mixer.capture not supported?)")
    report = summarize([replay(c) for c in captured], recurrent)
    report.notes = {layer: ATTENTION_NOTE for layer in range(depth) if layer not in recurrent}
    return report
