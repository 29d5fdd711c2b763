"""archspec.blocks: the modules a `RecurrencePlan` is built into.

`build_model(plan) -> LanguageModel`; `Mixer` is the one mixer layer for every plan;
`cost` holds the analytic parameter, FLOP and state-size model. See `docs/blocks.md`.
"""

from .build import build_model
from .cost import count_params, flops_per_token, state_bytes
from .lm import LanguageModel
from .mixer import Mixer, MixerState
from .plan import ModelPlan, PreconditionerPlan, RecurrencePlan

__all__ = [
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
