"""The model spec: a typed, closed schema of one recurrence and the LM stack around it,
and of which layer of the stack is what (`layout`: the recurrent mixer, with per-layer
overrides, or softmax `attention`).

Every section forbids unknown keys. Settings whose default depends on another field
(the gate on the backbone, beta_range on the transition, the OSDN settings on the
preconditioner type) are `None` when not written and resolved by the properties below,
so that a setting written where it has no effect can be refused instead of ignored.
Cross-field rules live in `rules.py`; `Spec` runs them after the fields validate.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FieldSerializationInfo,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from archspec.spec.numbers import MAX_SPEC_MAGNITUDE, StrictNumbers
from archspec.spec.rules import spec_problems

Backbone = Literal["deltanet", "gdn", "kda"]
GateKind = Literal["none", "scalar", "channel"]
DecayForm = Literal["mamba2", "rwkv7", "gla"]
TransitionKind = Literal["diagonal", "householder", "rwkv7"]

# Each backbone's own decay (RECURRENCE.md, "Gate"): DeltaNet has none, Gated DeltaNet a
# scalar Mamba2-style gate, KDA (Kimi Delta Attention) a per-channel gate.
BACKBONE_GATE: dict[str, GateKind] = {"deltanet": "none", "gdn": "scalar", "kda": "channel"}
DEFAULT_DECAY: DecayForm = "mamba2"
DEFAULT_BETA_RANGE = (0.0, 1.0)
# OSDN paper defaults (Zhou, Li et al. 2026, 340M configuration).
OSDN_DEFAULTS: dict[str, Any] = {"apf": False, "eta": 0.003, "bounds": (0.5, 2.0), "beta_aware": True, "init": "ones"}

# Context flag for `Spec.model_validate`: report rule problems separately (the loader
# maps them to file positions) instead of raising them from inside validation.
DEFER_RULES = "archspec_defer_rules"


class _Section(StrictNumbers):
    model_config = ConfigDict(extra="forbid", frozen=True)
    number_limit = MAX_SPEC_MAGNITUDE  # finite, no booleans, at most 2**53 (numbers.py)


class TransitionSpec(_Section):
    """What each sub-step does to the state (RECURRENCE.md, "Sub-steps")."""

    type: TransitionKind = Field(
        "householder",
        description="diagonal: S += w v^T (linear attention, GLA); householder: the delta rule "
        "S += beta w (v - S^T k)^T (DeltaNet, DeltaProduct); rwkv7: S -= e (S^T k)^T, S += w v^T "
        "with erase vector e = a * k and an untied write key.",
    )
    n_h: int = Field(1, ge=1, le=8, description="Sub-steps (Householder factors) per token, 1..8 (DeltaProduct's n_h).")
    beta_range: tuple[float, float] | None = Field(
        None,
        description="[0, 1] or [0, 2] (default [0, 1]). Range of beta (householder) or of the erase "
        "vector a (rwkv7). [0, 2] lets each factor's eigenvalues reach -1 (reflections). Not for diagonal.",
        json_schema_extra={"enum": [[0, 1], [0, 2], None]},
    )

    @field_validator("beta_range")
    @classmethod
    def _known_range(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and value not in ((0, 1), (0, 2)):
            raise ValueError(
                f"beta_range must be [0, 1] or [0, 2], got {list(value)}: [0, 1] keeps each factor's "
                "eigenvalues in [0, 1], [0, 2] lets them reach -1 (reflections, needed for state "
                "tracking such as parity); anything wider lets an eigenvalue leave [-1, 1]"
            )
        return value

    @property
    def beta_max(self) -> float | None:
        """Upper end of beta (of the erase vector for rwkv7); None: the transition has no beta."""
        if self.type == "diagonal":
            return None
        return float((self.beta_range or DEFAULT_BETA_RANGE)[1])


class PreconditionerSpec(_Section):
    """OSDN, the online diagonal preconditioner of the write key (RECURRENCE.md, "OSDN")."""

    type: Literal["none", "osdn"] = Field("none", description="none, or osdn (only with transition householder).")
    apf: bool | None = Field(None, description="Adaptive preconditioner forgetting: a learned per-token, per-head retain gate on d. Default false.")
    eta: float | None = Field(None, description="Online step size of d, > 0. Default 0.003.", json_schema_extra={"exclusiveMinimum": 0})
    bounds: tuple[float, float] | None = Field(
        None, description="[d_min, d_max], the box d is clipped to; 0 < d_min <= 1 <= d_max. Default [0.5, 2]."
    )
    beta_aware: bool | None = Field(None, description="Use beta in d's update (paper's main rule); false is the 1.3B run's beta-free rule. Default true.")
    init: Literal["ones", "learned"] | None = Field(None, description="d at the start of a sequence: ones, or a learned per-head vector. Default ones.")

    @field_validator("eta")
    @classmethod
    def _positive_eta(cls, value: float | None) -> float | None:
        if value is not None and not value > 0:
            raise ValueError(
                f"eta must be > 0, got {value}: it is d's online step size (eta = 0 would freeze d at "
                "its initial value, a negative eta climbs the loss that d is meant to reduce)"
            )
        return value

    @field_validator("bounds")
    @classmethod
    def _box_contains_one(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None:
            d_min, d_max = value
            if not (0 < d_min <= 1 <= d_max):
                raise ValueError(
                    f"bounds [d_min, d_max] must satisfy 0 < d_min <= 1 <= d_max, got {list(value)}: d "
                    "scales each key coordinate's step and starts at 1, so 1 must lie in the box, and "
                    "d_min > 0 keeps a preconditioned write key from vanishing or flipping sign"
                )
        return value

    @property
    def enabled(self) -> bool:
        return self.type == "osdn"

    def setting(self, name: str) -> Any:
        """A setting as written, or the paper default."""
        value = getattr(self, name)
        return OSDN_DEFAULTS[name] if value is None else value

    def settings_written(self) -> list[str]:
        return [name for name in OSDN_DEFAULTS if getattr(self, name) is not None]


class MixerSpec(_Section):
    """One sequence-mixer layer: backbone macro design, recurrence, head shape."""

    backbone: Backbone = Field(
        "deltanet",
        description="The layer's macro design: deltanet, gdn (Gated DeltaNet) or kda (Kimi Delta "
        "Attention). Sets the default gate.",
    )
    transition: TransitionSpec = Field(default_factory=TransitionSpec)
    gate: GateKind | None = Field(
        None, description="Decay once per token: none, scalar or channel. Default from the backbone: deltanet none, gdn scalar, kda channel."
    )
    decay: DecayForm | None = Field(
        None,
        description="How the gate forms its log decay g: mamba2 g = -exp(A) softplus(W x + dt_bias), learned "
        "rate A per head (Mamba2, Gated DeltaNet, KDA; unbounded; Mamba2's initial time steps, 0.001-1.6 nats a token), "
        "rwkv7 g = -exp(-1/2) sigmoid(z), z = w0 + tanh(x W1) W2 per channel (W x + w0 per head for a scalar "
        "gate): RWKV-7's decay, at most 0.61 nats a token, or gla g = logsigmoid(W x + b) / 16: GLA's decay. "
        "Default mamba2; only with a gate.",
    )
    preconditioner: PreconditionerSpec = Field(default_factory=PreconditionerSpec)
    heads: int = Field(4, gt=0, description="Number of heads.")
    head_dim: int = Field(64, gt=0, description="Key dimension K of each head.")
    expand_v: float = Field(1.0, gt=0, description="Value dimension V = head_dim * expand_v (a whole number).")
    short_conv: int = Field(4, ge=0, description="Kernel size of the causal depthwise conv on q, k, v; 0 = off.")

    @property
    def resolved_gate(self) -> GateKind:
        return self.gate if self.gate is not None else BACKBONE_GATE[self.backbone]

    @property
    def resolved_decay(self) -> DecayForm:
        return self.decay if self.decay is not None else DEFAULT_DECAY

    @property
    def value_dim(self) -> float:
        return self.head_dim * self.expand_v


class ModelSpec(_Section):
    """The language-model stack around the mixer."""

    d_model: int = Field(256, gt=0, description="Width of the residual stream.")
    layers: int = Field(2, gt=0, description="Number of blocks (norm, mixer, norm, MLP).")
    mlp: Literal["swiglu", "gelu", "none"] = Field("swiglu", description="Feed-forward layer of each block.")
    vocab_size: int = Field(256, gt=0, description="Vocabulary size (training sets it from the task).")
    mlp_ratio: float = Field(4.0, gt=0, description="MLP hidden width as a multiple of d_model.")
    norm_eps: float = Field(1e-6, gt=0, description="Epsilon of the RMS norms.")
    tie_embeddings: bool = Field(False, description="Share the input embedding with the output head.")


# A sliding window longer than this many tokens is no window: 1M tokens is beyond every
# context a model in this project is trained or decoded at; write `window: null` for
# full attention instead.
MAX_WINDOW = 1 << 20
DEFAULT_ROPE_THETA = 10000.0
LayerKind = Literal["recurrent", "attention"]
LayerIndex = Annotated[int, Field(ge=0)]
_RATIO = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


class AttentionSpec(_Section):
    """A causal softmax attention layer: grouped-query heads, RoPE, optional sliding
    window and output gate (`blocks/attention.py`)."""

    heads: int = Field(4, gt=0, description="Query heads.")
    kv_heads: int | None = Field(
        None, gt=0,
        description="Key/value heads (grouped-query attention); must divide heads. Default: heads (multi-head attention).",
    )
    head_dim: int = Field(64, gt=0, description="Dimension of each query, key and value head (even with rope).")
    rope: bool = Field(True, description="Rotary position embedding on queries and keys; false: no position encoding (NoPE).")
    rope_theta: float | None = Field(None, gt=0, description="RoPE base frequency (only with rope). Default 10000.")
    window: int | None = Field(
        None,
        description=f"Sliding window: each token attends to itself and the window - 1 tokens before it; 1..{MAX_WINDOW}. "
        "Default: none (full causal attention).",
        json_schema_extra={"minimum": 1, "maximum": MAX_WINDOW},
    )
    output_gate: bool = Field(False, description="Gate the attention output elementwise by sigmoid(W_g x) (Qwen3-Next's gated attention).")
    qk_norm: bool = Field(False, description="RMS-normalise each query and key head before RoPE (as Qwen3 and Qwen3-Next do).")

    @field_validator("window")
    @classmethod
    def _sensible_window(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_WINDOW:
            raise ValueError(
                f"window must be between 1 and {MAX_WINDOW} tokens, got {value}: it counts the tokens each "
                "query attends to (itself included); for full causal attention write window: null"
            )
        return value

    @property
    def resolved_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def resolved_rope_theta(self) -> float | None:
        """The RoPE base, or None without RoPE."""
        if not self.rope:
            return None
        return DEFAULT_ROPE_THETA if self.rope_theta is None else float(self.rope_theta)


def _written(section: BaseModel | None, info: FieldSerializationInfo) -> dict[str, Any] | None:
    """An override section as written: its unset fields must not travel, or a saved and
    reloaded spec would override the base section with defaults."""
    if section is None:
        return None
    return section.model_dump(mode=info.mode, exclude_unset=True)


class LayerOverride(_Section):
    """Settings for some layers over the section of their kind: `mixer:` for recurrent
    layers (so a stack can mix, say, KDA and Gated DeltaProduct), `attention:` for
    attention layers (say, a sliding window on a few of them)."""

    layers: list[LayerIndex] = Field(min_length=1, description="Layer indices (from 0) this override applies to.")
    mixer: MixerSpec | None = Field(None, description="Mixer fields that replace the spec's mixer fields on these (recurrent) layers.")
    attention: AttentionSpec | None = Field(
        None, description="Attention fields that replace the spec's attention fields on these (attention) layers."
    )

    @model_validator(mode="after")
    def _one_section(self) -> LayerOverride:
        if (self.mixer is None) == (self.attention is None):
            raise ValueError(
                "an override gives exactly one of `mixer:` (for recurrent layers) or `attention:` "
                "(for attention layers), with the fields that change"
            )
        return self

    @field_serializer("mixer", "attention")
    def _as_written(self, section: BaseModel | None, info: FieldSerializationInfo) -> dict[str, Any] | None:
        return _written(section, info)

    @property
    def kind(self) -> LayerKind:
        return "recurrent" if self.mixer is not None else "attention"


class LayoutSpec(_Section):
    """Which layer is what. Every layer is the recurrent `mixer` unless `pattern` or
    `ratio` (a repeating pattern) or `attention_at` (explicit indices) makes it attention."""

    pattern: list[LayerKind] | None = Field(
        None,
        min_length=1,
        description="Layer kinds repeated over the depth (cut at model.layers), e.g. [recurrent, recurrent, recurrent, attention].",
    )
    ratio: str | None = Field(
        None,
        description="'R:A': R recurrent layers then A attention layers, repeated over the depth; '3:1' is "
        "[recurrent, recurrent, recurrent, attention]. Not with pattern.",
        json_schema_extra={"pattern": _RATIO.pattern},
    )
    attention_at: list[LayerIndex] = Field(
        default_factory=list, description="Layer indices (from 0) that are attention, besides those of the pattern."
    )
    overrides: list[LayerOverride] = Field(
        default_factory=list, description="Per-layer settings over the mixer or attention section; a layer takes at most one."
    )

    @field_validator("ratio", mode="before")
    @classmethod
    def _unquoted_ratio(cls, value: Any) -> Any:
        # YAML 1.1 (PyYAML) reads an unquoted 3:1 as the base-60 integer 181.
        if isinstance(value, int) and not isinstance(value, bool) and value >= 60:
            written = f"{value // 60}:{value % 60}"
            raise ValueError(
                f"got the number {value}: YAML reads an unquoted {written} as a base-60 number; "
                f"quote the ratio: '{written}'"
            )
        return value

    @field_validator("ratio")
    @classmethod
    def _ratio_form(cls, value: str | None) -> str | None:
        if value is None:
            return value
        match = _RATIO.match(str(value))
        if match is None:
            raise ValueError(
                f"ratio is written 'R:A' (R recurrent layers, then A attention layers, repeated), e.g. '3:1'; got {value!r}"
            )
        recurrent, attention = int(match.group(1)), int(match.group(2))
        if recurrent + attention == 0:
            raise ValueError("ratio '0:0' names no layer; '1:0' is all recurrent, '0:1' all attention")
        return f"{recurrent}:{attention}"

    def period(self) -> list[LayerKind] | None:
        """The repeating pattern, from `pattern` or `ratio`; None when neither is given."""
        if self.pattern is not None:
            return list(self.pattern)
        if self.ratio is not None:
            recurrent, attention = (int(x) for x in self.ratio.split(":"))
            return ["recurrent"] * recurrent + ["attention"] * attention
        return None


class Spec(_Section):
    """An archspec model spec: one linear-RNN mixer design and the LM stack it is compiled into."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="archspec model spec")

    name: str = Field(min_length=1, description="Name of the design (used in tables and saved files).")
    extends: str | list[str] | None = Field(
        None, description="Spec file(s) to start from, relative to this file; this file's keys are deep-merged on top."
    )
    mixer: MixerSpec = Field(default_factory=MixerSpec)
    attention: AttentionSpec = Field(
        default_factory=AttentionSpec, description="The attention layers' settings (used by the layers that `layout` makes attention)."
    )
    layout: LayoutSpec = Field(default_factory=LayoutSpec, description="Which layer is what; default: every layer is the mixer.")
    model: ModelSpec = Field(default_factory=ModelSpec)

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> Spec:
        if info.context and info.context.get(DEFER_RULES):
            return self
        problems = spec_problems(self)
        if problems:
            raise ValueError("; ".join(f"{'.'.join(map(str, path))}: {message}" for path, message in problems))
        return self
