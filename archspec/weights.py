"""Trained weights on disk: `model.safetensors` beside the fully resolved spec.

A weights directory holds

```
DIR/
  model.safetensors   the module's tensors (safetensors: no code is unpickled on load)
  spec.yaml           the fully resolved spec (no `extends:`, every default written out)
```

and `archspec.load(DIR)` rebuilds the module from `spec.yaml` through the compiler, then
fills it from `model.safetensors`. The trainer writes one such directory per run (the best
checkpoint by the task's validation metric, `search/checkpoints.py`); the HuggingFace
wrapper reads the same files.

Tied weights (the head sharing the embedding's matrix) are stored once: safetensors
refuses two names for one buffer, so the second name is dropped and listed in the
file's metadata (`aliases`), and loading checks that exactly those names were missing.
Both files are written atomically (`archspec/atomic.py`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import yaml

from archspec.atomic import write_atomic, write_text_atomic
from archspec.errors import ArchspecError

WEIGHTS_FILE = "model.safetensors"
SPEC_FILE = "spec.yaml"
FORMAT = "archspec-weights/1"
# safetensors metadata keys (string values only)
FORMAT_KEY = "archspec"
ALIASES_KEY = "aliases"
SPEC_HEADER = "# The fully resolved spec of the weights in model.safetensors (written by archspec).\n"


def _unique_tensors(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state without second names for one buffer, and {dropped name: kept name}."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    owners: dict[tuple[int, int, tuple[int, ...], torch.dtype], str] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if tensor.numel() and key in owners:
            aliases[name] = owners[key]
            continue
        owners[key] = name
        kept[name] = tensor.detach().contiguous().cpu()
    return kept, aliases


def save_state(path: str | os.PathLike[str], module: nn.Module, metadata: Mapping[str, str] | None = None) -> None:
    """Write `module`'s state dict to a safetensors file, atomically. `metadata` (strings)
    goes into the file's header beside archspec's own keys."""
    from safetensors.torch import save

    tensors, aliases = _unique_tensors(module.state_dict())
    header = {"format": "pt", FORMAT_KEY: FORMAT, ALIASES_KEY: json.dumps(aliases), **dict(metadata or {})}
    data = save(tensors, metadata=header)
    try:
        write_atomic(path, lambda handle: handle.write(data))
    except OSError as exc:
        raise ArchspecError(f"cannot write {os.fspath(path)}: {exc.strerror or exc}") from None


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The header metadata of a safetensors file written by `save_state`."""
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except FileNotFoundError:
        raise ArchspecError(f"{os.fspath(path)}: no such file") from None
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise ArchspecError(f"{os.fspath(path)}: not a safetensors file ({exc})") from None


def load_state(module: nn.Module, path: str | os.PathLike[str]) -> dict[str, str]:
    """Fill `module` from a file written by `save_state`; returns the file's metadata.

    Every tensor must fit: a name the module lacks, a missing one (other than a tied
    alias the file lists) or a shape that differs is an error naming them.
    """
    from safetensors.torch import load_file

    metadata = read_metadata(path)
    if metadata.get(FORMAT_KEY) != FORMAT:
        raise ArchspecError(f"{os.fspath(path)}: not archspec weights (metadata {FORMAT_KEY!r} is "
                            f"{metadata.get(FORMAT_KEY)!r}, expected {FORMAT!r})")
    aliases = json.loads(metadata.get(ALIASES_KEY, "{}"))
    tensors = load_file(os.fspath(path))
    expected = module.state_dict()
    problems = []
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors) - set(aliases))
    if unknown:
        problems.append(f"tensors the model does not have: {', '.join(unknown)}")
    if missing:
        problems.append(f"tensors missing from the file: {', '.join(missing)}")
    for name, tensor in tensors.items():
        if name in expected and tuple(expected[name].shape) != tuple(tensor.shape):
            problems.append(f"{name}: shape {tuple(tensor.shape)} in the file, {tuple(expected[name].shape)} in the model")
    if problems:
        raise ArchspecError(f"{os.fspath(path)} does not fit the model: " + "; ".join(problems))
    # `strict=False` only for the tied aliases, checked above; they share the kept tensor.
    module.load_state_dict(tensors, strict=False)
    return metadata


def spec_document(spec: Any) -> dict[str, Any]:
    """The resolved spec as plain data (what `spec.yaml` holds)."""
    if isinstance(spec, Mapping):
        return dict(spec)
    return spec.model_dump(mode="json", exclude={"extends"})


def write_spec(directory: str | os.PathLike[str], spec: Any) -> Path:
    """Write the fully resolved `spec` (a `Spec` or its document) as `DIR/spec.yaml`."""
    path = Path(directory) / SPEC_FILE
    text = SPEC_HEADER + yaml.safe_dump(spec_document(spec), sort_keys=False, default_flow_style=None)
    write_text_atomic(path, text)
    return path


def save(model: nn.Module, spec: Any, directory: str | os.PathLike[str], metadata: Mapping[str, str] | None = None) -> Path:
    """Write `model`'s weights and the resolved `spec` it was built from into `directory`."""
    directory = Path(directory)
    write_spec(directory, spec)
    save_state(directory / WEIGHTS_FILE, model, metadata)
    return directory


def weights_dir(path: str | os.PathLike[str]) -> Path:
    """The directory that holds `model.safetensors`: `path` itself, or the folder of a
    `model.safetensors` path. The error names what is missing."""
    path = Path(path)
    if path.is_file() and path.name == WEIGHTS_FILE:
        path = path.parent
    if not path.is_dir():
        raise ArchspecError(f"{path}: no such directory")
    if not (path / WEIGHTS_FILE).is_file():
        raise ArchspecError(f"{path}: no {WEIGHTS_FILE} here (a training run writes it into its output directory)")
    return path


def load(path: str | os.PathLike[str], *, device: torch.device | str | None = None) -> nn.Module:
    """Rebuild a trained model from a weights directory (or its `model.safetensors`):
    the module from `spec.yaml`, its tensors from the file; returned in eval mode."""
    from archspec.blocks import build_model
    from archspec.lowering import lower
    from archspec.memory import check_fits
    from archspec.spec.loader import load_spec

    directory = weights_dir(path)
    spec_path = directory / SPEC_FILE
    if not spec_path.is_file():
        raise ArchspecError(f"{directory}: {WEIGHTS_FILE} without {SPEC_FILE}: the weights were saved from a bare "
                            "ModelPlan; build the model from that plan and fill it with archspec.weights.load_state")
    plan = lower(load_spec(spec_path))
    check_fits(plan, "cpu", what=f"the model saved in {directory}")  # built in float32 on the CPU
    model = build_model(plan)
    load_state(model, directory / WEIGHTS_FILE)
    if device is not None:
        model = model.to(device)
    return model.eval()
