"""`load_spec`: a spec file, dict or `Spec`, plus overrides -> a validated `Spec`.

The steps are the ones search specs share (`yaml_source`): read with positions, resolve
`extends:`, apply `--set` overrides, validate; every problem is reported with its place.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from archspec.errors import ArchspecError
from archspec.spec.models import DEFER_RULES, MixerSpec, Spec
from archspec.spec.rules import mixer_problems, spec_problems
from archspec.spec.yaml_source import (
    LocatedDocument,
    Override,
    apply_overrides,
    error_from_problems,
    load_yaml_with_locations,
    locate_problems,
    merge_extends,
    override_keys,
    validation_problems,
)

SpecSource = Spec | Mapping[str, Any] | str | os.PathLike[str]


def spec_document(source: SpecSource, overrides: Iterable[Override] = ()) -> LocatedDocument:
    """The spec's data with positions: extends resolved, overrides applied."""
    if isinstance(source, Spec):
        doc = LocatedDocument(data=source.model_dump(mode="python"))
    elif isinstance(source, Mapping):
        doc = LocatedDocument(data=dict(source))
    elif isinstance(source, (str, os.PathLike)):
        doc = load_yaml_with_locations(source, what="spec")
    else:
        raise ArchspecError(f"cannot load a spec from a {type(source).__name__}; give a path, a dict or a Spec")
    overrides = list(overrides)
    _refuse_late_extends(overrides)
    doc = merge_extends(doc, what="spec")
    return apply_overrides(doc, overrides)


def _refuse_late_extends(overrides: list[Override]) -> None:
    """`extends:` is resolved as the file is read, before any override: setting it with
    `--set` could not take effect, so it is refused rather than silently ignored."""
    for key, origin in override_keys(overrides):
        if key == "extends" or key.startswith("extends."):
            raise ArchspecError(
                "an override that cannot take effect",
                [(origin, "extends", "`extends` is resolved when the spec file is read, before "
                  "overrides apply, so setting it here would do nothing; write `extends:` in the spec file "
                  "(or give the base file as the spec and --set the fields you change)")],
            )


def validate_document(doc: LocatedDocument) -> Spec:
    """Validate the data; all structural and rule problems are raised together, located."""
    title = f"invalid spec {doc.source or '(from Python data)'}"
    try:
        spec = Spec.model_validate(doc.data, context={DEFER_RULES: True})
    except ValidationError as exc:
        problems = validation_problems(exc, doc, model=Spec)
        problems += locate_problems(doc, _mixer_rules_alone(doc.data))
        raise error_from_problems(title, problems) from None
    rule_problems = spec_problems(spec)
    if rule_problems:
        raise error_from_problems(title, locate_problems(doc, rule_problems))
    return spec


def _mixer_rules_alone(data: Any) -> list[tuple[tuple[str, ...], str]]:
    """When the spec does not validate, the mixer's rules can still be checked.

    Each mixer field that is itself invalid (already reported) is left at its default for
    this check, and only that field, so that e.g. an `n_h` out of range does not hide an
    unstable `beta_range` beside it in the same transition.
    """
    mixer = data.get("mixer") if isinstance(data, dict) else None
    if not isinstance(mixer, (dict, type(None))):
        return []
    mixer = copy.deepcopy(mixer or {})
    for _ in range(_MAX_REPAIRS):
        try:
            valid = MixerSpec.model_validate(mixer)
            break
        except ValidationError as exc:
            if not any([_remove_at(mixer, err["loc"]) for err in exc.errors()]):
                return []
    else:
        return []
    return [(("mixer",) + path, message) for path, message in mixer_problems(valid)]


# Rounds of leaving out invalid fields before giving up on the rule check (a field left
# out can reveal one error in the section that held it, at most once per nesting level).
_MAX_REPAIRS = 4


def _remove_at(data: Any, loc: tuple[Any, ...]) -> bool:
    """Delete the deepest key of `loc` that `data` holds (pydantic's loc may end in tags
    that are not keys); returns whether anything was deleted."""
    parent, key = None, None
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            parent, key, node = node, part, node[part]
        else:
            break
    if parent is None:
        return False
    del parent[key]
    return True


def load_spec(source: SpecSource, overrides: Iterable[Override] = ()) -> Spec:
    """A validated `Spec` from a YAML path, a dict or a `Spec`, with `dotted.key=value` overrides.

    Raises `ArchspecError` naming file:line:column (or the override) and the dotted field
    of every problem.
    """
    if isinstance(source, Spec) and not overrides:
        return source
    return validate_document(spec_document(source, list(overrides)))
