"""`archspec.compile`: a spec (path, dict or `Spec`) plus overrides -> a ready `nn.Module`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from archspec.blocks import LanguageModel, build_model
from archspec.lowering import lower
from archspec.spec.loader import load_spec
from archspec.spec.models import Spec
from archspec.spec.yaml_source import overrides_from_kwargs


def compile(spec_or_path: Spec | Mapping[str, Any] | str | os.PathLike[str], **overrides: Any) -> LanguageModel:  # noqa: A001
    """Load, validate, lower and build a spec; returns the `LanguageModel`.

    Overrides are dotted keys written with `__` (`compile(p, mixer__heads=8)`) or with
    dots through a dict (`compile(p, **{"mixer.heads": 8})`); values are Python values.
    """
    spec = load_spec(spec_or_path, overrides_from_kwargs(overrides))
    return build_model(lower(spec))
