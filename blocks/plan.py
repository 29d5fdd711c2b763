"""RecurrencePlan, AttentionPlan, ModelPlan: the frozen IR between the spec language and
the modules.

`archspec.lower` turns a validated spec into a `ModelPlan`; `archspec.blocks.build_model`
turns a `ModelPlan` into an `nn.Module`. Every lowering decision is a field here, so that
`archspec compile` can print it and the kernels never see the spec language. The plan
lives in `blocks` (not in `archspec`) because imports flow `archspec -> blocks -> kernels`.

Plain frozen dataclasses: no pydantic, so blocks and kernels run on a bare GPU machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar, Literal

Backbone = Literal["deltanet", "gdn", "kda"]
Gate = Literal["none", "scalar", "channel"]
DecayForm = Literal["mamba2", "rwkv7", "gla"]
Transition = Literal["diagonal", "householder", "rwkv7"]
WriteKey = Literal["tied", "preconditioned", "untied"]
Mlp = Literal["swiglu", "gelu", "none"]


@dataclass(frozen=True)
class PreconditionerPlan:
    """OSDN phase 1 settings (`RECURRENCE.md`, "OSDN")."""

    eta: float = 0.003
    d_min: float = 0.5
    d_max: float = 2.0
    beta_aware: bool = True
    apf: bool = False  # per-token, per-head retain gate r = sigmoid(w_r . x + b_r) on d
    init: Literal["ones", "learned"] = "ones"
    eps: float = 1e-6


@dataclass(frozen=True)
class RecurrencePlan:
    """One mixer layer's recurrence, fully decided.

    - `gate`: decay applied once per token before the sub-steps.
    - `decay`: how the gate forms its log decay from its projection (`blocks/gates.py`):
      `mamba2` `-exp(A_log) softplus(.)`, `rwkv7` `-exp(-1/2) sigmoid(.)` (at most 0.61 a
      token), `gla` `logsigmoid(.) / 16`.
    - `transition`: `diagonal` (S += w v^T), `householder` (delta rule), `rwkv7`
      (erase vector plus untied write key).
    - `n_h`: sub-steps (Householder factors) per token.
    - `beta_scale`: beta = beta_scale * sigmoid(.), so 1.0 for range [0,1] and 2.0 for
      [0,2]; for rwkv7 it scales the erase vector a in [0, beta_scale]^K. None when the
      transition has no beta (diagonal).
    - `write_key`: `tied` (w = k), `preconditioned` (w = d * k, OSDN), `untied` (its own
      projection, rwkv7).
    - `erase`: the rwkv7 erase vector e = a * k is used.
    - `stable`: every transition factor provably has spectral norm <= 1 (so the state
      cannot blow up through the transitions); `caveats` explain what is not guaranteed.
    """

    backbone: Backbone
    gate: Gate
    transition: Transition
    n_h: int
    beta_scale: float | None
    write_key: WriteKey
    erase: bool
    preconditioner: PreconditionerPlan | None
    heads: int
    head_dim: int  # K
    value_dim: int  # V = head_dim * expand_v
    short_conv: int  # causal depthwise conv kernel size, 0 = off
    stable: bool
    caveats: tuple[str, ...] = ()
    decay: DecayForm = "mamba2"

    kind: ClassVar[str] = "recurrent"

    @property
    def uses_beta(self) -> bool:
        return self.beta_scale is not None

    def to_dict(self) -> dict:
        return {"kind": self.kind, **asdict(self)}


@dataclass(frozen=True)
class AttentionPlan:
    """One causal softmax attention layer (`blocks/attention.py`).

    - `kv_heads`: key/value heads; each serves `heads / kv_heads` query heads (GQA).
    - `rope_theta`: RoPE's base frequency, or None for no position encoding (NoPE).
    - `window`: each query attends to itself and the `window - 1` tokens before it;
      None is full causal attention. The decoding state keeps `window - 1` tokens.
    - `output_gate`: `o * sigmoid(W_g x)` per channel before `o_proj` (Qwen3-Next).
    - `qk_norm`: RMSNorm over each query and key head before RoPE.
    """

    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float | None = 10000.0
    window: int | None = None
    output_gate: bool = False
    qk_norm: bool = False

    kind: ClassVar[str] = "attention"

    def to_dict(self) -> dict:
        return {"kind": self.kind, **asdict(self)}


LayerPlan = RecurrencePlan | AttentionPlan


@dataclass(frozen=True)
class ModelPlan:
    """The language-model stack around the mixer: what `archspec.compile` builds.

    `mixer` is the spec's recurrent mixer. `stack`, when not empty, gives each of the
    `layers` layers its own plan (a `RecurrencePlan`, possibly overridden, or an
    `AttentionPlan`); empty means every layer is `mixer`. `layer_plans` is the one to read.
    """

    name: str
    mixer: RecurrencePlan
    d_model: int
    layers: int
    mlp: Mlp
    vocab_size: int
    mlp_ratio: float = 4.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    stack: tuple[LayerPlan, ...] = ()

    def __post_init__(self) -> None:
        if self.stack and len(self.stack) != self.layers:
            raise ValueError(f"ModelPlan.stack has {len(self.stack)} layer plans for {self.layers} layers")

    @property
    def layer_plans(self) -> tuple[LayerPlan, ...]:
        """One plan per layer, bottom first."""
        return self.stack or (self.mixer,) * self.layers

    @property
    def hybrid(self) -> bool:
        """Whether the layers differ (attention among them, or overridden mixers)."""
        return any(p != self.mixer for p in self.layer_plans)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["mixer"] = self.mixer.to_dict()
        data["stack"] = [p.to_dict() for p in self.stack]
        return data
