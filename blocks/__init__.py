"""archspec.blocks: the modules a `ModelPlan` is built into.

`build_model(plan) -> LanguageModel`; `Mixer` is the one mixer layer for every
`RecurrencePlan`, `Attention` the layer of an `AttentionPlan` (hybrid stacks);
`cost` holds the analytic parameter, FLOP and state-size model. See `docs/blocks.md`.
"""

from .attention import Attention, AttentionState
from .build import build_model
from .cost import count_params, flops_per_token, state_bytes
from .lm import LanguageModel
from .mixer import Mixer, MixerState
from .plan import AttentionPlan, LayerPlan, ModelPlan, PreconditionerPlan, RecurrencePlan

__all__ = [
    "Attention",
    "AttentionPlan",
    "AttentionState",
    "LayerPlan",
    "build_model",
    "count_params",
    "flops_per_token",
    "state_bytes",
    "LanguageModel",
    "Mixer",
    "MixerState",
    "ModelPlan",
    "PreconditionerPlan",
    "RecurrencePlan",
]
