"""The search spec: what to search, on what, for which objectives, within which budget.

A search spec is YAML read by the same line-aware loader as model specs
(`archspec.spec.yaml_source`), so every mistake is reported with file:line:column and
the dotted field. Example:

```yaml
name: demo
base: ../models/deltanet.yaml          # the model spec every trial starts from
space:                                 # dotted fields of the model spec, sampled in this order
  mixer.transition.type: {choices: [diagonal, householder]}
  mixer.transition.n_h:  {int: [1, 3], when: {mixer.transition.type: householder}}
  mixer.preconditioner.eta: {float: [1.0e-4, 1.0e-2], log: true,
                             when: {mixer.preconditioner.type: osdn}}
task: {name: s3, options: {train_len: 16}}    # or a list of tasks
objectives:
  - token_acc@16: max
  - params: min
constraints: ["params <= 2e6"]         # checked from the cost model before training
budget: {trials: 12, steps: 150, time_per_trial: 120}
sampler: tpe                           # tpe | nsga2 | random | grid
resources: {cpu: 1, gpu: 0}
seed: 0
```

A parameter whose `when:` does not hold is not sampled and the field keeps the base
spec's value (or `otherwise:`), so invalid combinations such as `n_h` on a diagonal
transition are never produced; every sampled spec is still validated before training.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from archspec.errors import ArchspecError
from archspec.spec.numbers import StrictNumbers
from archspec.spec.yaml_source import (
    LocatedDocument,
    Override,
    load_validated,
    unreadable_reason,
)

# Metrics the cost model gives before anything is trained: the only ones a constraint may use
# (`archspec.cost.cost_metric_names()`, written out here so that reading a search spec does not
# import torch; tests/search/test_space.py checks the two agree). The `@32768` ones are at the
# cost model's long context, where attention layers' KV cache and quadratic work show.
COST_METRICS = ("params", "flops_per_token", "state_bytes", "flops_per_token@32768", "state_bytes@32768")
MAX_GRID_POINTS = 100_000

# PyYAML reads `1e-4` (no dot) as a string (YAML 1.1); users write it all the time.
_BARE_EXPONENT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _yaml_number(value: Any) -> Any:
    return float(value) if isinstance(value, str) and _BARE_EXPONENT.match(value.strip()) else value


class _Section(StrictNumbers):  # finite numbers, no booleans for numbers
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Param(_Section):
    """One searched field: exactly one of `choices`, `int` or `float`, optionally conditional."""

    choices: list[Any] | None = Field(None, description="The values to choose from.")
    int_range: tuple[int, int] | None = Field(None, alias="int", description="[low, high], both included.")
    float_range: tuple[float, float] | None = Field(None, alias="float", description="[low, high].")
    log: bool = Field(False, description="Sample int/float ranges on a log scale.")
    step: float | None = Field(None, gt=0, description="Spacing of int/float values (needed by the grid sampler for floats).")
    when: dict[str, Any] | None = Field(
        None, description="Sample only when every named field (sampled earlier, or in the base spec) has one of the given values."
    )
    otherwise: Any = Field(None, description="The value to set when `when` does not hold (default: leave the base spec's value).")

    @field_validator("choices", mode="before")
    @classmethod
    def _choices_numbers(cls, value: Any) -> Any:
        return [_yaml_number(v) for v in value] if isinstance(value, list) else value

    @field_validator("float_range", mode="before")
    @classmethod
    def _range_numbers(cls, value: Any) -> Any:
        return [_yaml_number(v) for v in value] if isinstance(value, list) else value

    @field_validator("when", mode="before")
    @classmethod
    def _when_lists(cls, value: Any) -> Any:
        """`{field: value}` means `{field: [value]}`."""
        if isinstance(value, dict):
            return {k: [_yaml_number(x) for x in v] if isinstance(v, list) else [_yaml_number(v)] for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> Param:
        kinds = [k for k, v in (("choices", self.choices), ("int", self.int_range), ("float", self.float_range)) if v is not None]
        if len(kinds) != 1:
            found = f"found {', '.join(kinds)}" if kinds else "found none"
            raise ValueError(
                "a searched field takes exactly one of `choices: [...]`, `int: [low, high]` or "
                f"`float: [low, high]` ({found})"
            )
        if self.choices is not None:
            if not self.choices:
                raise ValueError("`choices` is empty: give at least one value")
            labels = [choice_label(c) for c in self.choices]
            if len(set(map(repr, labels))) != len(labels):
                raise ValueError(f"`choices` repeats a value: {self.choices}")
            if self.log or self.step is not None:
                raise ValueError("`log` and `step` apply to int/float ranges, not to `choices`")
            return self
        low, high = self.int_range or self.float_range  # type: ignore[misc]
        if low > high:
            raise ValueError(f"the range [{low}, {high}] is empty: low must be <= high")
        if self.log and low <= 0:
            raise ValueError(f"a log range needs low > 0, got [{low}, {high}]")
        if self.log and self.step is not None:
            raise ValueError("`step` cannot be combined with `log: true` (Optuna samples log ranges continuously)")
        if self.int_range is not None and self.step is not None and self.step != int(self.step):
            raise ValueError(f"an int range takes a whole-number step, got {self.step}")
        return self

    @property
    def kind(self) -> Literal["choices", "int", "float"]:
        if self.choices is not None:
            return "choices"
        return "int" if self.int_range is not None else "float"

    @property
    def has_otherwise(self) -> bool:
        return "otherwise" in self.model_fields_set

    def suggest(self, trial: Any, name: str) -> Any:
        """Draw this field's value from an Optuna trial (define-by-run)."""
        if self.choices is not None:
            labels = [choice_label(c) for c in self.choices]
            label = trial.suggest_categorical(name, labels)
            return self.choices[labels.index(label)]
        if self.int_range is not None:
            low, high = self.int_range
            return trial.suggest_int(name, low, high, step=int(self.step or 1), log=self.log)
        low, high = self.float_range  # type: ignore[misc]
        return trial.suggest_float(name, low, high, step=self.step, log=self.log)

    def grid_values(self) -> list[Any] | None:
        """Every value, for the grid sampler; None for a continuous range."""
        if self.choices is not None:
            return list(self.choices)
        if self.int_range is not None:
            low, high = self.int_range
            return list(range(low, high + 1, int(self.step or 1)))
        if self.step is None:
            return None
        low, high = self.float_range  # type: ignore[misc]
        count = int(math.floor((high - low) / self.step + 1e-9)) + 1
        return [round(low + i * self.step, 12) for i in range(count)]

    def can_take(self, value: Any) -> bool:
        """Whether sampling can produce `value` (exactly: a condition compares equal values)."""
        if self.choices is not None:
            return choice_label(value) in [choice_label(c) for c in self.choices]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        low, high = self.int_range or self.float_range  # type: ignore[misc]
        if not low <= value <= high:  # also False for NaN
            return False
        if self.int_range is not None:
            return value == int(value) and (int(value) - low) % int(self.step or 1) == 0
        if self.step is None:
            return False  # a continuous range draws any one value with probability 0
        steps = (value - low) / self.step
        return abs(steps - round(steps)) < 1e-9

    def describe(self) -> str:
        """What sampling can produce, for messages."""
        if self.choices is not None:
            return f"its choices: {self.choices}"
        low, high = self.int_range or self.float_range  # type: ignore[misc]
        kind = "int" if self.int_range is not None else "float"
        if self.float_range is not None and self.step is None:
            return (f"a continuous float range [{low:g}, {high:g}], which draws any exact value with probability 0; "
                    "give the range a `step:` or use `choices:` to condition on its values")
        step = f" in steps of {self.step:g}" if self.step is not None else ""
        return f"its {kind} range [{low:g}, {high:g}]{step}"

    def to_optuna(self, value: Any) -> Any:
        """The value as the Optuna study stores it (a choice's label)."""
        return choice_label(value) if self.choices is not None else value


def choice_label(value: Any) -> Any:
    """Optuna stores None, bool, int, float and str choices; others (lists) as JSON text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value)


class TaskRef(_Section):
    """A task from `archspec.search.tasks` and the options it is built with."""

    name: str = Field(min_length=1)
    preset: str = Field("cpu", description="The task's size preset: cpu or gpu (data options and training settings).")
    options: dict[str, Any] = Field(default_factory=dict, description="Task options over the preset's, e.g. {train_len: 16}.")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value


class Objective(_Section):
    """A metric to maximise or minimise; written `- token_acc@16: max`."""

    metric: str
    direction: Literal["max", "min"]

    @model_validator(mode="before")
    @classmethod
    def _from_pair(cls, value: Any) -> Any:
        if isinstance(value, dict) and len(value) == 1 and "metric" not in value:
            (metric, direction), = value.items()
            return {"metric": str(metric), "direction": direction}
        if isinstance(value, dict) and "metric" in value:
            return value
        raise ValueError(f"an objective is written `- metric_name: max` or `- metric_name: min`, got {value!r}")

    @property
    def maximise(self) -> bool:
        return self.direction == "max"


_CONSTRAINT = re.compile(r"^\s*([A-Za-z_][\w@.]*)\s*(<=|>=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


class Constraint(_Section):
    """`params <= 2e6`: a bound on a cost-model metric, checked before any training."""

    metric: str
    op: Literal["<=", ">=", "<", ">"]
    bound: float

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        match = _CONSTRAINT.match(value)
        if not match:
            raise ValueError(f"a constraint is written `metric <= number`, e.g. `params <= 2e6`; got {value!r}")
        metric, op, bound = match.groups()
        return {"metric": metric, "op": op, "bound": float(bound)}

    @model_validator(mode="after")
    def _cost_metric(self) -> Constraint:
        if self.metric not in COST_METRICS:
            raise ValueError(
                f"{self.metric!r} cannot be constrained: constraints are checked from the cost model before "
                f"any training, which knows {', '.join(COST_METRICS)}"
            )
        return self

    def holds(self, value: float) -> bool:
        return {"<=": value <= self.bound, ">=": value >= self.bound, "<": value < self.bound, ">": value > self.bound}[self.op]

    def __str__(self) -> str:
        """The form written in (and read back from) a search spec."""
        return f"{self.metric} {self.op} {self.bound:g}"

    def shown(self) -> str:
        """For people: the bound as the tables write numbers (`params <= 2,000,000`)."""
        from archspec.search.formatting import number

        return f"{self.metric} {self.op} {number(self.bound)}"


class Budget(_Section):
    trials: int = Field(gt=0, description="Trials to train (skipped and invalid ones do not count).")
    steps: int = Field(gt=0, description="Training steps per trial and task.")
    time_per_trial: float | None = Field(None, gt=0, description="Seconds one trial's training may take (per task); none by default.")


GPU_AUTO = "auto"  # `resources.gpu: auto`: each trial's share of a GPU from its memory estimate


class Resources(_Section):
    cpu: float = Field(1, gt=0, description="CPUs reserved per trial.")
    gpu: float | Literal["auto"] = Field(
        0.0, description="GPUs reserved per trial: a number (a fraction such as 0.125 packs 8 trials onto one GPU; "
        "above 1 a whole number), or `auto`: each trial's share from its memory estimate (docs/search.md). "
        "Trials train on CUDA (Triton kernels, bfloat16 autocast) when it is not 0.")
    gpu_memory_gib: float | None = Field(
        None, gt=0, le=1e6, description="With `gpu: auto`: one GPU's memory in GiB (default: read from the driver's "
        "first CUDA device).")
    concurrent: int | None = Field(None, gt=0, description="At most this many trials at once (default: as many as fit).")
    data_parallel: int | None = Field(
        None, gt=0, le=1024, description="Processes that train one trial's model together (DistributedDataParallel): "
        "one per GPU, the default with gpu >= 2; with gpu 0, CPU processes over gloo.")

    @field_validator("gpu")
    @classmethod
    def _whole_above_one(cls, value: float) -> float:
        from archspec.search.distributed import gpu_problem

        problem = gpu_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("data_parallel")
    @classmethod
    def _data_parallel_fits(cls, value: int | None, info: ValidationInfo) -> int | None:
        from archspec.search.distributed import data_parallel_problem

        # cpu and gpu come first in the class: validated already (absent if they were wrong)
        problem = data_parallel_problem(info.data.get("gpu", 0), info.data.get("cpu", 1), value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("gpu", mode="before")
    @classmethod
    def _whole_as_float(cls, value: Any) -> Any:
        # `gpu: 1` is the number 1.0, not a second type of the union (it dumps as written).
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("gpu")
    @classmethod
    def _not_negative(cls, value: float | str) -> float | str:
        if isinstance(value, (int, float)) and value < 0:
            raise ValueError(f"a trial cannot reserve {value:g} GPUs; give 0 (CPU), a fraction of one GPU, a whole number or auto")
        return value

    @model_validator(mode="after")
    def _memory_with_auto(self) -> Resources:
        if self.gpu_memory_gib is not None and self.gpu != GPU_AUTO:
            raise ValueError("gpu_memory_gib is read only with `gpu: auto` (it sizes each trial's share); remove it")
        return self

    @property
    def uses_gpu(self) -> bool:
        """Whether trials reserve a GPU (and train on CUDA where one is visible)."""
        return self.gpu == GPU_AUTO or self.gpu > 0


class Scheduler(_Section):
    """A Ray Tune scheduler that stops trials early from their validation results."""

    type: Literal["asha"] = Field(description="asha: Ray Tune's ASHAScheduler (asynchronous successive halving).")
    metric: str = Field(min_length=1, description="A validation metric the trials report while training "
                        "(`task/metric` with several tasks), e.g. token_acc@16.")
    mode: Literal["max", "min"] = Field("max", description="Whether larger or smaller values of the metric are better.")
    grace_steps: int = Field(gt=0, description="Training steps every trial gets before it can be stopped.")
    reduction_factor: float = Field(3, gt=1, le=100, description="Keep the best 1/reduction_factor at each rung.")


class SearchSpec(_Section):
    """An archspec search spec."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, title="archspec search spec")

    name: str = Field(min_length=1)
    base: str = Field(min_length=1, description="The model spec every trial starts from, relative to this file.")
    space: dict[str, Param] = Field(description="Dotted model-spec fields to search, sampled in the order written.")
    tasks: list[TaskRef] = Field(alias="task", min_length=1, description="A task, or a list of tasks, with options.")
    objectives: list[Objective] = Field(min_length=1)
    constraints: list[Constraint] = Field(default_factory=list)
    budget: Budget
    sampler: Literal["tpe", "nsga2", "random", "grid"] = "tpe"
    resources: Resources = Field(default_factory=Resources)
    scheduler: Scheduler | None = Field(None, description="Stop hopeless trials early from their validation results (ASHA).")
    train: dict[str, Any] = Field(default_factory=dict, description="Extra keyword options for the trainer (e.g. batch_size, lr).")
    seed: int = Field(0, ge=0, lt=2**32, description="Seeds the sampler (NumPy takes seeds below 2**32).")

    @field_validator("tasks", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return value if isinstance(value, list) else [value]

    @field_validator("objectives")
    @classmethod
    def _distinct(cls, value: list[Objective]) -> list[Objective]:
        names = [o.metric for o in value]
        if len(set(names)) != len(names):
            raise ValueError(f"an objective is listed twice: {names}")
        return value

    def to_yaml_data(self) -> dict[str, Any]:
        """Plain data that loads back into an equal spec (aliases, field order kept)."""
        data = self.model_dump(mode="json", by_alias=True, exclude_defaults=False)
        data["space"] = {
            name: param.model_dump(mode="json", by_alias=True, exclude_defaults=True)
            | ({"otherwise": param.otherwise} if param.has_otherwise else {})
            for name, param in self.space.items()
        }
        data["task"] = [t.model_dump(mode="json") for t in self.tasks]
        data["objectives"] = [{o.metric: o.direction} for o in self.objectives]
        data["constraints"] = [str(c) for c in self.constraints]
        return data

    @property
    def metric_names(self) -> list[str]:
        return [o.metric for o in self.objectives]

    @property
    def maximise(self) -> list[bool]:
        return [o.maximise for o in self.objectives]


def search_spec_json_schema() -> dict[str, Any]:
    """The JSON Schema of search spec files, for editors (yaml-language-server).

    pydantic describes the models after their `mode="before"` validators; the file is
    written before them, so the short forms are described here: an objective as
    `- metric: max`, a constraint as the text `params <= 2e6`, a task as its name or a
    mapping, `task:` as one task or a list.
    """
    from archspec.spec.schema import JSON_SCHEMA_DIALECT

    schema = SearchSpec.model_json_schema()
    defs = schema["$defs"]
    defs["Objective"] = {
        "description": Objective.__doc__,
        "anyOf": [
            {"type": "object", "minProperties": 1, "maxProperties": 1,
             "additionalProperties": {"enum": ["max", "min"]}},
            defs["Objective"],
        ],
    }
    defs["Constraint"] = {"description": Constraint.__doc__, "type": "string", "pattern": _CONSTRAINT.pattern}
    task_ref = {"anyOf": [{"type": "string", "minLength": 1}, {"$ref": "#/$defs/TaskRef"}]}
    tasks = schema["properties"]["task"]
    schema["properties"]["task"] = {
        "description": tasks.get("description"),
        "anyOf": [task_ref, {"type": "array", "items": task_ref, "minItems": 1}],
    }
    return {"$schema": JSON_SCHEMA_DIALECT, **schema}


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class LoadedSearch:
    """A validated search spec with its resolved base model spec."""

    spec: SearchSpec
    base: Any  # archspec.Spec
    base_file: Path
    source: str | None  # the search spec file

    @property
    def base_values(self) -> dict[str, Any]:
        """The base spec's fields as written (None where unset), dotted."""
        return flatten(self.base.model_dump(mode="json"))


# A broken required section is replaced by these while the other sections are checked
# (its own problem is reported either way); see `yaml_source.salvage`.
_PLACEHOLDERS = {"name": "-", "budget": {"trials": 1, "steps": 1}}

Problems = list[tuple[tuple[str | int, ...], str]]


def load_search_spec(
    path: str | os.PathLike[str], overrides: Iterable[Override] = (), *, check_objectives: bool = True
) -> LoadedSearch:
    """Read, override (`--set budget.trials=4`) and validate a search spec file.

    Every problem, structural or semantic, is raised at once as one `ArchspecError`, each
    located at file:line:column (or the `--set`) and the dotted field: a value out of
    range does not hide a misspelt objective or a choice no spec can take. The objectives
    are checked against what the stock trainer reports; `check_objectives=False` for a
    search that trains with a function of its own (`run_search(..., train_fn=...)`).
    """
    loaded: list[LoadedSearch] = []

    def semantic(spec: SearchSpec, doc: LocatedDocument) -> Problems:
        base_file = ((Path(doc.source).resolve().parent / spec.base) if doc.source else Path(spec.base)).resolve()
        base, problems = _load_base(base_file)
        if base is not None:
            loaded.append(LoadedSearch(spec=spec, base=base, base_file=base_file, source=doc.source))
        return problems + semantic_problems(spec, base, check_objectives=check_objectives)

    load_validated(path, SearchSpec, what="search spec", overrides=overrides, semantic=semantic, placeholders=_PLACEHOLDERS)
    return loaded[0]


def _load_base(base_file: Path) -> tuple[Any, Problems]:
    """The base model spec, or the problems that keep it from loading (its own, each
    with its place in the base file)."""
    from archspec import load_spec

    reason = unreadable_reason(base_file, what="model spec")
    if reason:
        return None, [(("base",), f"{'no such model spec' if reason == 'no such file' else reason}: "
                                  f"{str(base_file)!r} (`base` is relative to the search spec's directory)")]
    try:
        return load_spec(base_file), []
    except ArchspecError as exc:
        found = [f"{loc}: {field + ': ' if field else ''}{message}" for loc, field, message in exc.problems] or [str(exc)]
        return None, [(("base",), f"the base spec does not validate: {problem}") for problem in found]


def semantic_problems(spec: SearchSpec, base: Any | None, *, check_objectives: bool = True) -> Problems:
    """What pydantic cannot see: fields that exist, conditions that can hold, choices that
    make a valid spec, tasks that exist, objectives the trials report, a discrete grid.
    Without a base spec (it did not load) the checks that need it are left out."""
    tasks, problems = _task_problems(spec)
    if check_objectives:
        problems += _objective_problems(spec, tasks)
    problems += _trainer_problems(spec)
    problems += _scheduler_problems(spec, tasks)
    if base is None:
        return problems
    base_values = flatten(base.model_dump(mode="json"))
    space_problems = _space_problems(spec, base_values)
    problems += space_problems
    if not space_problems and None not in tasks:
        # Only in a space whose fields all exist: otherwise every value would fail alike.
        problems += [(dead.where, dead.message) for dead in dead_values(spec, base, tasks, constraints=False)]
    if spec.sampler == "grid" and not problems:
        count = len(grid_points(spec.space, base_values, limit=MAX_GRID_POINTS + 1))
        if count > MAX_GRID_POINTS:
            problems.append((("sampler",), f"the grid has more than {MAX_GRID_POINTS} points; use tpe, nsga2 or random"))
    return problems


def _space_problems(spec: SearchSpec, base_values: Mapping[str, Any]) -> Problems:
    """Fields that are not in the model spec, overlapping fields, conditions that cannot hold."""
    from archspec.spec.models import Spec

    problems: Problems = []
    names = list(spec.space)
    for index, (name, param) in enumerate(spec.space.items()):
        where = ("space", name)
        missing = unknown_field(Spec, name)
        if missing:
            problems.append((where, missing))
        elif name in ("model", "model.vocab_size"):  # each trial sets it from its task, after the overrides
            problems.append((where, "model.vocab_size is set from each task's vocabulary, so searching it would "
                             "do nothing; search the other model fields one by one"))
        for other in names[:index]:
            if name.startswith(other + ".") or other.startswith(name + "."):
                problems.append((where, f"{name!r} overlaps {other!r}: search a section or a field inside it, not both"))
        for field, values in (param.when or {}).items():
            cond = where + ("when", field)
            if field in names[index:]:
                problems.append((cond, f"`when` refers to {field!r}, which is sampled at or after {name!r}; conditions may only use fields listed before"))
                continue
            if field in spec.space:
                earlier = spec.space[field]
                fallback = _fallback(earlier, field, base_values)
                for value in values:
                    if not earlier.can_take(value) and not (fallback and choice_label(value) == choice_label(fallback[0])):
                        problems.append((cond, f"{value!r} is never sampled for {field!r} ({earlier.describe()}), "
                                         f"so {name!r} would never be searched"))
                continue
            if unknown_field(Spec, field):
                problems.append((cond, f"`when` refers to {field!r}: {unknown_field(Spec, field)}"))
            elif field not in base_values:
                problems.append((cond, f"`when` refers to {field!r}, a section; name one of its fields"))
            elif base_values[field] not in values:
                problems.append((cond, f"{field!r} is {base_values[field]!r} in the base spec and not searched, so {name!r} would never be searched"))
        if spec.sampler == "grid" and param.grid_values() is None:
            problems.append((where, "the grid sampler needs discrete values: give `step:` or use `choices:`"))
    return problems


def _fallback(param: Param, field: str, base_values: Mapping[str, Any]) -> tuple[Any] | None:
    """The value a conditional field keeps when its own `when` fails (its `otherwise`, or
    the base spec's), as a 1-tuple; None for a field that is always sampled."""
    if not param.when:
        return None
    return (param.otherwise,) if param.has_otherwise else (base_values.get(field),)


def _task_problems(spec: SearchSpec) -> tuple[list[Any], Problems]:
    """The tasks (None where one cannot be built) and the problems of those that cannot."""
    from archspec.search.tasks import get_task

    tasks: list[Any] = []
    problems: Problems = []
    for index, ref in enumerate(spec.tasks):
        try:
            tasks.append(get_task(ref.name, preset=ref.preset, **ref.options))
        except ArchspecError as exc:
            tasks.append(None)
            problems.append((("task", index), str(exc)))
    names = [t.name for t in spec.tasks]
    if len(set(names)) != len(names):
        problems.append((("task",), f"a task is listed twice: {names}"))
    return tasks, problems


def _objective_problems(spec: SearchSpec, tasks: list[Any]) -> Problems:
    """Objectives no trial will report: refused before anything trains, with the names
    the trials do report (a misspelt objective would otherwise fail every trial)."""
    from archspec.search.trial import reported_metrics

    problems: Problems = []
    names = [t.name for t in spec.tasks]
    if None in tasks or len(set(names)) != len(names):
        return problems  # the task problems are reported; what they would report is unknown
    reported = reported_metrics(spec, tasks)
    for index, objective in enumerate(spec.objectives):
        if objective.metric in reported:
            continue
        head = objective.metric.split("/", 1)[0]
        if len(tasks) > 1 and head not in names:
            example = f"{names[0]}/{objective.metric}"
            listing = "" if example in reported else f"; the trials report: {reported.listing()}"
            problems.append((("objectives", index),
                             f"with several tasks a quality metric names its task, e.g. {example}; "
                             f"the cost metrics {', '.join(COST_METRICS)} need no task{listing}"))
            continue
        close = reported.closest(objective.metric)
        hint = f" (did you mean {close}?)" if close else ""
        problems.append((("objectives", index),
                         f"no trial reports {objective.metric!r}{hint}; the trials report: {reported.listing()}"))
    return problems


def _trainer_problems(spec: SearchSpec) -> Problems:
    """`train:` options and a time limit the trainer does not take."""
    from archspec.search.trial import SEARCH_SETS, default_train, unaccepted

    train = default_train()
    problems: Problems = []
    for key in spec.train:
        if key in SEARCH_SETS:
            problems.append((("train", key), f"{key!r} is set by the search itself (budget, seed, resources), not in `train:`"))
        elif unaccepted(train, [key]):
            import inspect

            options = [n for n in inspect.signature(train).parameters if n not in SEARCH_SETS and n not in ("spec", "task")]
            problems.append((("train", key), f"the trainer has no option {key!r}; it takes {', '.join(options)}"))
    if spec.budget.time_per_trial is not None and unaccepted(train, ["time_limit_s"]):
        problems.append((("budget", "time_per_trial"), "the trainer does not support a time limit yet (no `time_limit_s`); remove time_per_trial"))
    return problems


def _scheduler_problems(spec: SearchSpec, tasks: list[Any]) -> Problems:
    """A scheduler watches a metric the trials report at each validation, and needs
    validations before a trial's last step to stop anything."""
    scheduler = spec.scheduler
    if scheduler is None:
        return []
    problems: Problems = []
    from archspec.search.distributed import world_size

    if world_size(spec.resources) > 1:
        # the ranks run in processes of their own and report once, at the trial's end
        problems.append((("scheduler",), f"data-parallel trials ({world_size(spec.resources)} processes each) report "
                         "only when they end, so a scheduler would never see a validation to stop them at; "
                         "remove `scheduler:` or train each trial in one process"))
    total = spec.budget.steps * len(spec.tasks)
    if scheduler.grace_steps >= total:
        problems.append((("scheduler", "grace_steps"), f"{scheduler.grace_steps} steps of grace leave nothing to stop: "
                         f"a trial trains {total} steps (budget.steps x {len(spec.tasks)} task(s)); give fewer"))
    if None in tasks:
        return problems  # the task's own problem is reported; its metrics are unknown
    if len(tasks) == 1:
        names = tasks[0].validation_metric_names()
    else:
        names = [f"{task.name}/{name}" for task in tasks for name in task.validation_metric_names()]
    if scheduler.metric not in names:
        import difflib

        close = difflib.get_close_matches(scheduler.metric, names, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        problems.append((("scheduler", "metric"), f"the trials do not report {scheduler.metric!r} while they train{hint}; "
                         f"each validation reports: {', '.join(names)}"))
    return problems


def unknown_field(model: type[BaseModel], dotted_name: str) -> str | None:
    """Why `dotted_name` is not a field of the model spec, or None if it is one."""
    current: type[BaseModel] | None = model
    walked: list[str] = []
    for part in dotted_name.split("."):
        if current is None:
            return f"{'.'.join(walked)} is a single value, it has no field {part!r}"
        fields = current.model_fields
        if part not in fields:
            import difflib

            close = difflib.get_close_matches(part, list(fields), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            here = ".".join(walked) or "the top level"
            return f"the model spec has no field {part!r} under {here}{hint}; fields there: {', '.join(fields)}"
        walked.append(part)
        annotation = fields[part].annotation
        current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return None


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> `{"a.b.c": value}` (sections are listed too, as their mappings)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        out[name] = value
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
    return out


# --------------------------------------------------------------------------- sampling


class SuggestingTrial(Protocol):
    """The part of `optuna.Trial` the space uses."""

    def suggest_categorical(self, name: str, choices: list[Any]) -> Any: ...
    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int: ...
    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None, log: bool = False) -> float: ...


def active(param: Param, values: Mapping[str, Any], base_values: Mapping[str, Any]) -> bool:
    """Whether every `when` condition holds, looking at values sampled so far, then the base."""
    for field, allowed in (param.when or {}).items():
        current = values[field] if field in values else base_values.get(field)
        if choice_label(current) not in [choice_label(a) for a in allowed]:
            return False
    return True


def suggest_overrides(trial: SuggestingTrial, space: Mapping[str, Param], base_values: Mapping[str, Any]) -> dict[str, Any]:
    """Define-by-run: sample the space in order into `{dotted field: value}` overrides.

    A parameter whose conditions fail is not sampled (Optuna never sees it), so the
    study's parameters are exactly the ones that shaped the trial.
    """
    values: dict[str, Any] = {}
    for name, param in space.items():
        if active(param, values, base_values):
            values[name] = param.suggest(trial, name)
        elif param.has_otherwise:
            values[name] = param.otherwise
    return values


def grid_points(space: Mapping[str, Param], base_values: Mapping[str, Any], limit: int | None = None) -> list[dict[str, Any]]:
    """Every distinct point of a discrete space, conditions respected, as overrides.

    Optuna's GridSampler takes a fixed product of all parameters, which with conditions
    would repeat each point once per value of every parameter it does not use; walking
    the conditions instead yields each distinct spec once.
    """
    items = list(space.items())
    points: list[dict[str, Any]] = []

    def walk(index: int, values: dict[str, Any]) -> None:
        if limit is not None and len(points) >= limit:
            return
        if index == len(items):
            points.append(values)
            return
        name, param = items[index]
        if not active(param, values, base_values):
            walk(index + 1, {**values, name: param.otherwise} if param.has_otherwise else values)
            return
        for value in param.grid_values() or []:
            walk(index + 1, {**values, name: value})

    walk(0, {})
    return points


def optuna_params(space: Mapping[str, Param], overrides: Mapping[str, Any], base_values: Mapping[str, Any]) -> dict[str, Any]:
    """The Optuna parameters that produce `overrides` (for `study.enqueue_trial`)."""
    params: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for name, param in space.items():
        if name in overrides:
            if active(param, values, base_values):
                params[name] = param.to_optuna(overrides[name])
            values[name] = overrides[name]
    return params


# --------------------------------------------------------------------------- what a space holds

# Values of one field that `dead_values` tries (all of a choice list; a range's ends and
# evenly spaced values between), and points it composes per value before it gives up.
MAX_PROBE_VALUES = 64
MAX_PROBES_PER_VALUE = 256
# Beyond this many points a space is described as "more than" it.
MAX_COUNTED_POINTS = 10_000_000


def probe_values(param: Param) -> list[Any]:
    """The values of a field that are checked before a search: every choice and every
    value of a small discrete range; a range's ends (and evenly spaced values between,
    up to `MAX_PROBE_VALUES`) otherwise."""
    values = param.grid_values()
    if values is None:
        low, high = param.float_range  # type: ignore[misc]
        return [low] if low == high else [low, high]
    if len(values) <= MAX_PROBE_VALUES:
        return values
    stride = (len(values) - 1) / (MAX_PROBE_VALUES - 1)
    return [values[round(i * stride)] for i in range(MAX_PROBE_VALUES)]


@dataclass(frozen=True)
class SpaceSize:
    """How many distinct points a space has, conditions respected."""

    points: int  # distinct discrete points, a continuous range counted as one value
    capped: bool  # more than MAX_COUNTED_POINTS
    continuous: tuple[str, ...]  # fields whose values are a continuous range

    def __str__(self) -> str:
        count = f"more than {MAX_COUNTED_POINTS:,}" if self.capped else f"{self.points:,}"
        if not self.continuous:
            return f"{count} point{'s' if self.points != 1 else ''}"
        return f"{count} discrete combination{'s' if self.points != 1 else ''}, each with a continuous {', '.join(self.continuous)}"


def space_size(space: Mapping[str, Param], base_values: Mapping[str, Any]) -> SpaceSize:
    """Count the distinct points without listing them (a conditional field multiplies only
    the branches where it is active)."""
    items = list(space.items())
    continuous = tuple(name for name, param in items if param.grid_values() is None)

    def count(index: int, values: dict[str, Any]) -> int:
        if index == len(items):
            return 1
        name, param = items[index]
        if not active(param, values, base_values):
            return count(index + 1, {**values, name: param.otherwise} if param.has_otherwise else values)
        choices = param.grid_values()
        if choices is None:
            return count(index + 1, values)  # a continuous value decides no condition
        total = 0
        for value in choices:
            total += count(index + 1, {**values, name: value})
            if total > MAX_COUNTED_POINTS:
                break
        return total

    total = count(0, {})
    return SpaceSize(points=min(total, MAX_COUNTED_POINTS), capped=total > MAX_COUNTED_POINTS, continuous=continuous)


def describe_size(loaded: LoadedSearch) -> str:
    return str(space_size(loaded.spec.space, loaded.base_values))


def probe_points(
    space: Mapping[str, Param], base_values: Mapping[str, Any], fixed: tuple[str, Any] | None = None
) -> Iterator[dict[str, Any]]:
    """Points of the space as overrides, in order, each field taking its `probe_values`;
    with `fixed = (field, value)` only the points where that field is sampled and takes
    that value. Lazy: a caller that stops early does not pay for the rest."""
    items = list(space.items())

    def walk(index: int, values: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if index == len(items):
            yield values
            return
        name, param = items[index]
        if not active(param, values, base_values):
            if fixed is not None and fixed[0] == name:
                return  # the fixed field is not sampled on this branch
            yield from walk(index + 1, {**values, name: param.otherwise} if param.has_otherwise else values)
            return
        choices = [fixed[1]] if fixed is not None and fixed[0] == name else probe_values(param)
        for value in choices:
            yield from walk(index + 1, {**values, name: value})

    yield from walk(0, {})


@dataclass(frozen=True)
class DeadValue:
    """A value of a searched field that no point of the space can use."""

    field: str
    value: Any
    kind: Literal["invalid", "constrained"]  # never a valid spec / always breaks a constraint
    reason: str  # why, for the first point tried
    where: tuple[str | int, ...]  # its place in the search spec

    @property
    def message(self) -> str:
        if self.kind == "invalid":
            return f"{self.value!r} never makes a valid spec, so every trial with it would be refused: {self.reason}"
        return f"{self.value!r} breaks a constraint at every point of the space, so it is never trained: {self.reason}"


def dead_values(spec: SearchSpec, base: Any, tasks: list[Any], *, constraints: bool = True) -> list[DeadValue]:
    """Every value of every searched field that cannot compose into a valid spec with
    any choice of the other fields (and, with `constraints`, every value whose specs all
    break a constraint), found by composing points as a trial would (base spec, sampled
    overrides, the task's vocabulary) before anything is proposed. A value is reported
    only when all its points were tried (at most `MAX_PROBES_PER_VALUE`)."""
    from archspec.search.rundir import INVALID as INVALID_STATUS
    from archspec.search.rundir import OK as OK_STATUS
    from archspec.search.rundir import SKIPPED as SKIPPED_STATUS
    from archspec.search.trial import check_proposal

    base_values = flatten(base.model_dump(mode="json"))
    found: list[DeadValue] = []
    verdicts: dict[str, Any] = {}  # one check per distinct point
    for name, param in spec.space.items():
        key = "choices" if param.choices is not None else param.kind
        for value in probe_values(param):
            reasons: dict[str, str] = {}  # the first reason of each status seen
            exhausted, usable = True, False
            for tried, point in enumerate(probe_points(spec.space, base_values, (name, value))):
                if tried == MAX_PROBES_PER_VALUE:
                    exhausted = False
                    break
                label = json.dumps({k: choice_label(v) for k, v in point.items()}, sort_keys=True)
                if label not in verdicts:
                    verdicts[label] = check_proposal(base, point, spec.constraints if constraints else [], tasks,
                                                     gpu=spec.resources.uses_gpu)
                verdict = verdicts[label]
                if verdict.status == OK_STATUS:
                    usable = True
                    break
                reasons.setdefault(verdict.status, verdict.reason or "")
            if usable or not exhausted or not reasons:
                continue
            # One valid spec that breaks a constraint shows the value composes.
            kind = "constrained" if SKIPPED_STATUS in reasons else "invalid"
            reason = reasons[SKIPPED_STATUS if kind == "constrained" else INVALID_STATUS]
            found.append(DeadValue(name, value, kind, reason, ("space", name, key)))
    return found
