"""The kinds of YAML file archspec reads, so that `archspec validate` and `archspec schema`
handle each: model specs here, search specs and experiment files from `archspec.search`.

Imports flow `search -> archspec`, so the language cannot import the search's file
models; instead each kind registers itself (`register_kind`), the model spec here and
the others in `search/file_kinds.py`, which the `archspec` command imports. A file's kind
is recognised from its top-level keys: each kind names the keys only it has.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from archspec.errors import ArchspecError

MODEL_SPEC = "model"


@dataclass(frozen=True)
class FileKind:
    """One kind of file: how to recognise, validate and describe it."""

    name: str  # the `--kind` value: model, search, experiment
    title: str  # in messages: "model spec", "search spec", "experiment"
    keys: frozenset[str]  # top-level keys that only this kind has
    # Validates the file (with `--set` overrides) and returns a one-line summary of it;
    # raises ArchspecError with every problem.
    check: Callable[[str, list[str]], str]
    schema: Callable[[], dict[str, Any]]  # its JSON Schema
    schema_file: str  # the committed copy under specs/, e.g. spec.schema.json


_KINDS: dict[str, FileKind] = {}


def register_kind(kind: FileKind) -> None:
    _KINDS[kind.name] = kind


def kinds() -> dict[str, FileKind]:
    """Every registered kind, the model spec first."""
    return dict(_KINDS)


def kind_named(name: str) -> FileKind:
    known = kinds()
    if name not in known:
        raise ArchspecError(f"unknown kind of file {name!r}; known: {', '.join(known)}")
    return known[name]


def recognise(data: Mapping[str, Any] | Any) -> FileKind:
    """The kind whose own keys the file's top level uses most; a model spec when none
    does (a model spec needs no key but `name`)."""
    known = kinds()
    if not isinstance(data, Mapping):
        return known[MODEL_SPEC]
    present = set(map(str, data))
    scored = sorted(((len(kind.keys & present), kind.name) for kind in known.values()), reverse=True)
    best, name = scored[0]
    return known[name] if best > 0 else known[MODEL_SPEC]


def recognise_file(path: str | os.PathLike[str]) -> FileKind:
    """Read the file's top level (located errors for unreadable YAML) and recognise it."""
    from archspec.spec.yaml_source import load_yaml_with_locations

    return recognise(load_yaml_with_locations(path, what="spec").data)


def _check_model_spec(path: str, overrides: Iterable[str]) -> str:
    from archspec.spec.loader import load_spec

    spec = load_spec(path, list(overrides))
    m = spec.mixer
    extra = ", osdn" + (" apf" if m.preconditioner.setting("apf") else "") if m.preconditioner.enabled else ""
    gate = m.resolved_gate if m.resolved_gate == "none" else f"{m.resolved_gate} ({m.resolved_decay} decay)"
    return f"model spec {spec.name}: {m.backbone}, {m.transition.type} n_h={m.transition.n_h}, gate {gate}{extra}{_layout_note(spec)}"


def _layout_note(spec) -> str:
    """`; 6 recurrent + 2 attention layers` for a stack with attention or overrides."""
    from archspec.spec.layout import layer_kinds

    kinds = layer_kinds(spec.layout, spec.model.layers)
    attention = kinds.count("attention")
    if not attention and not spec.layout.overrides:
        return ""
    overridden = f", {len(spec.layout.overrides)} override(s)" if spec.layout.overrides else ""
    return f"; {len(kinds) - attention} recurrent + {attention} attention layers{overridden}"


def _model_schema() -> dict[str, Any]:
    from archspec.spec.schema import spec_json_schema

    return spec_json_schema()


# The model spec is always known; `recognise` falls back to it.
register_kind(FileKind(
    name=MODEL_SPEC, title="model spec", keys=frozenset({"mixer", "model", "extends"}),
    check=_check_model_spec, schema=_model_schema, schema_file="spec.schema.json",
))
