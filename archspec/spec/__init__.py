"""The spec language: typed models, line-aware YAML loading, cross-field rules."""

from archspec.spec.loader import load_spec
from archspec.spec.models import (
    AttentionSpec,
    LayerOverride,
    LayoutSpec,
    MixerSpec,
    ModelSpec,
    PreconditionerSpec,
    Spec,
    TransitionSpec,
)

__all__ = [
    "load_spec", "Spec", "MixerSpec", "ModelSpec", "PreconditionerSpec", "TransitionSpec",
    "AttentionSpec", "LayoutSpec", "LayerOverride",
]
