"""The model spec: a typed, closed schema of one recurrence and the LM stack around it.

Every section forbids unknown keys. Settings whose default depends on another field
(the gate on the backbone, beta_range on the transition, the OSDN settings on the
preconditioner type) are `None` when not written and resolved by the properties below,
so that a setting written where it has no effect can be refused instead of ignored.
Cross-field rules live in `rules.py`; `Spec` runs them after the fields validate.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from archspec.spec.numbers import MAX_SPEC_MAGNITUDE, StrictNumbers
from archspec.spec.rules import spec_problems

Backbone = Literal["deltanet", "gdn", "kda"]
GateKind = Literal["none", "scalar", "channel"]
TransitionKind = Literal["diagonal", "householder", "rwkv7"]

# Each backbone's own decay (RECURRENCE.md, "Gate"): DeltaNet has none, Gated DeltaNet a
# scalar Mamba2-style gate, KDA (Kimi Delta Attention) a per-channel gate.
BACKBONE_GATE: dict[str, GateKind] = {"deltanet": "none", "gdn": "scalar", "kda": "channel"}
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
    preconditioner: PreconditionerSpec = Field(default_factory=PreconditionerSpec)
    heads: int = Field(4, gt=0, description="Number of heads.")
    head_dim: int = Field(64, gt=0, description="Key dimension K of each head.")
    expand_v: float = Field(1.0, gt=0, description="Value dimension V = head_dim * expand_v (a whole number).")
    short_conv: int = Field(4, ge=0, description="Kernel size of the causal depthwise conv on q, k, v; 0 = off.")

    @property
    def resolved_gate(self) -> GateKind:
        return self.gate if self.gate is not None else BACKBONE_GATE[self.backbone]

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


class Spec(_Section):
    """An archspec model spec: one linear-RNN mixer design and the LM stack it is compiled into."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="archspec model spec")

    name: str = Field(min_length=1, description="Name of the design (used in tables and saved files).")
    extends: str | list[str] | None = Field(
        None, description="Spec file(s) to start from, relative to this file; this file's keys are deep-merged on top."
    )
    mixer: MixerSpec = Field(default_factory=MixerSpec)
    model: ModelSpec = Field(default_factory=ModelSpec)

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> Spec:
        if info.context and info.context.get(DEFER_RULES):
            return self
        problems = spec_problems(self)
        if problems:
            raise ValueError("; ".join(f"{'.'.join(map(str, path))}: {message}" for path, message in problems))
        return self
