"""`get_task(name, preset="cpu", **options)`: every task by name.

A preset (`cpu`, `gpu`) gives a task's data options and training settings; explicit
options override the preset's. Unknown names and options get an `ArchspecError` that
lists what is available.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass
from typing import Any, Callable

from archspec.errors import ArchspecError

from . import bytes_lm, formal, groups, recall
from .base import Preset, Task


@dataclass(frozen=True)
class TaskFamily:
    make: Callable[..., Task]  # (name, **options) -> Task
    task_class: type
    presets: dict[str, Preset]
    fixed: dict[str, Any] = dataclasses.field(default_factory=dict)  # options the name fixes


_NAMED: dict[str, TaskFamily] = {
    "parity": TaskFamily(lambda name, **o: formal.Parity(**o), formal.Parity, formal.PRESETS),
    "mod_arith": TaskFamily(lambda name, **o: formal.ModArith(**o), formal.ModArith, formal.PRESETS),
    "mod_arith_brackets": TaskFamily(
        lambda name, **o: formal.ModArithBrackets(**o), formal.ModArithBrackets, formal.PRESETS
    ),
    "mqar": TaskFamily(
        lambda name, **o: recall.MultiQueryRecall(passes=1, **o), recall.MultiQueryRecall, recall.PRESETS, {"passes": 1}
    ),
    "mqar_twice": TaskFamily(
        lambda name, **o: recall.MultiQueryRecall(passes=2, **o), recall.MultiQueryRecall, recall.PRESETS, {"passes": 2}
    ),
    "bytes_lm": TaskFamily(lambda name, **o: bytes_lm.BytesLM(**o), bytes_lm.BytesLM, bytes_lm.PRESETS),
}
_GROUPS = TaskFamily(
    lambda name, **o: groups.GroupWordProblem(group_name=name, **o),
    groups.GroupWordProblem,
    groups.PRESETS,
    {"group_name": None},
)

PRESET_NAMES = ("cpu", "gpu")


def task_names() -> list[str]:
    """The names `get_task` accepts (group names are patterns)."""
    return ["s3", "s4", "a5", "s5", "zN", "dN", "sN", "aN", *_NAMED]


# The names a typo is most likely meant as: the named tasks and the groups in use.
_COMMON = ("s3", "s4", "a5", "s5", *_NAMED)


def _did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name, _COMMON, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close and close[0] != name else ""


def _family(name: str) -> TaskFamily:
    if name in _NAMED:
        return _NAMED[name]
    if groups.is_group_name(name):
        return _GROUPS
    raise ArchspecError(f"unknown task {name!r}{_did_you_mean(name)}; available: {', '.join(task_names())}")


def task_options(name: str) -> list[str]:
    """The options a task accepts (for error messages and `archspec train --help`)."""
    family = _family(name)
    return [
        f.name
        for f in dataclasses.fields(family.task_class)
        if f.init and f.name not in family.fixed
    ]


def _typed_options(name: str, family: TaskFamily, options: dict[str, Any]) -> dict[str, Any]:
    """Each option as the type its task declares: `train_len: yes`, `.inf`, `2.5` for a
    whole number or a string for a number are refused, naming the option, instead of
    reaching the task as True, infinity or a silently truncated count."""
    from pydantic import TypeAdapter, ValidationError

    from archspec.spec.numbers import number_problem

    hints = typing.get_type_hints(family.task_class)
    typed, problems = {}, []
    for key, value in options.items():
        annotation = hints.get(key, Any)
        problem = number_problem(value, annotation, None)
        if problem is None:
            try:
                value = TypeAdapter(annotation, config={"allow_inf_nan": False}).validate_python(value)
            except ValidationError as exc:
                problem = f"got {value!r}: {exc.errors(include_url=False)[0]['msg'].lower()}"
        if problem:
            problems.append(f"{key}: {problem}")
        typed[key] = value
    if problems:
        raise ArchspecError(f"task {name!r}: bad option value(s): " + "; ".join(problems))
    return typed


def get_task(name: str, preset: str = "cpu", **options: Any) -> Task:
    """Build the task `name` with the preset's options, overridden by `options`."""
    family = _family(name)
    if preset not in family.presets:
        raise ArchspecError(f"task {name!r}: unknown preset {preset!r}; available: {', '.join(family.presets)}")
    allowed = task_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ArchspecError(f"task {name!r}: unknown option(s) {', '.join(unknown)}; it accepts {', '.join(allowed)}")
    options = _typed_options(name, family, options)
    chosen = family.presets[preset]
    try:
        task = family.make(name, **{**chosen.task_options, **options})
    except (TypeError, ValueError) as exc:
        raise ArchspecError(f"task {name!r}: bad option value: {exc}") from exc
    except ArchspecError as exc:  # e.g. `s33`: a group name, but not a group we can build
        raise ArchspecError(f"{exc}{_did_you_mean(name)}") from None
    task.preset = chosen.train
    return task
