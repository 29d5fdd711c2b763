"""`archspec.compile`: a spec (path, dict or `Spec`) plus overrides -> a ready `nn.Module`.

`save_compiled` / `load_compiled` keep a compiled module with the fully resolved spec it
came from, so that a saved file rebuilds the same module without the original YAML.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from archspec.atomic import write_atomic
from archspec.blocks import LanguageModel, build_model
from archspec.errors import ArchspecError
from archspec.lowering import lower
from archspec.memory import check_fits
from archspec.spec.loader import load_spec
from archspec.spec.models import Spec
from archspec.spec.yaml_source import overrides_from_kwargs

SAVE_FORMAT = "archspec-module/1"


def compile(spec_or_path: Spec | Mapping[str, Any] | str | os.PathLike[str], **overrides: Any) -> LanguageModel:  # noqa: A001
    """Load, validate, lower and build a spec; returns the `LanguageModel`.

    Overrides are dotted keys written with `__` (`compile(p, mixer__heads=8)`) or with
    dots through a dict (`compile(p, **{"mixer.heads": 8})`); values are Python values.
    """
    spec = load_spec(spec_or_path, overrides_from_kwargs(overrides))
    plan = lower(spec)
    check_fits(plan, "cpu", what=f"spec {spec.name!r}")  # built in float32 on the CPU
    return build_model(plan)


def save_compiled(model: LanguageModel, spec: Spec, path: str | os.PathLike[str]) -> None:
    """Write the module's weights with the resolved spec and plan, atomically."""
    payload = {
        "format": SAVE_FORMAT,
        "spec": spec.model_dump(mode="json", exclude={"extends"}),
        "plan": model.plan.to_dict(),
        "state_dict": model.state_dict(),
    }
    try:
        write_atomic(path, lambda handle: torch.save(payload, handle))
    except OSError as exc:
        raise ArchspecError(f"cannot write {os.fspath(path)}: {exc.strerror or exc}") from None


def load_compiled(path: str | os.PathLike[str]) -> LanguageModel:
    """Rebuild a module written by `save_compiled` (weights only: no code is unpickled)."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ArchspecError(f"{os.fspath(path)}: no such file") from None
    except Exception as exc:  # torch raises several types for a file it cannot read
        raise ArchspecError(f"{os.fspath(path)}: not a saved archspec module ({exc.__class__.__name__})") from None
    if not isinstance(payload, dict) or payload.get("format") != SAVE_FORMAT:
        raise ArchspecError(f"{os.fspath(path)}: not a saved archspec module (expected format {SAVE_FORMAT})")
    plan = lower(load_spec(payload["spec"]))
    check_fits(plan, "cpu", what=f"the module saved in {os.fspath(path)}")
    model = build_model(plan)
    model.load_state_dict(payload["state_dict"])
    return model
