"""`build_model(plan)`: the `nn.Module` that `archspec.compile` returns."""

from __future__ import annotations

from .lm import LanguageModel
from .plan import ModelPlan


def build_model(plan: ModelPlan) -> LanguageModel:
    return LanguageModel(plan)
