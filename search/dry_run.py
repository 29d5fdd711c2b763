"""`archspec search SPEC --dry-run`: what a search would do, without Ray or training.

Loading the search spec already refuses every problem it can find (fields that do not
exist, conditions that cannot hold, values that never make a valid spec, objectives no
trial reports); the dry run then shows what the spec says: the space and how many
points it has, the values that a constraint always rules out, the tasks and the metrics
their trials report against the objectives, the budget and the sampler.
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from archspec.search.formatting import number
from archspec.search.space import COST_METRICS, MAX_PROBES_PER_VALUE, LoadedSearch, Param, dead_values, space_size
from archspec.search.trial import make_task, reported_metrics


def _values(param: Param) -> str:
    if param.choices is not None:
        return ", ".join(json.dumps(c) if isinstance(c, list) or c is None else str(c) for c in param.choices)
    low, high = param.int_range if param.int_range is not None else param.float_range  # type: ignore[misc]
    kind = "int" if param.int_range is not None else "float"
    extra = "".join([", log scale" if param.log else "", f", step {param.step:g}" if param.step is not None else ""])
    return f"{kind} {number(low)} .. {number(high)}{extra}"


def _condition(param: Param) -> str:
    if not param.when:
        return ""
    parts = [f"{field} in {', '.join(json.dumps(v) if isinstance(v, list) else str(v) for v in values)}"
             for field, values in param.when.items()]
    text = "; ".join(parts)
    if param.has_otherwise:
        text += f" (else {json.dumps(param.otherwise)})"
    return text


def dry_run_report(loaded: LoadedSearch) -> Group:
    """The rich renderable `--dry-run` prints."""
    spec = loaded.spec
    tasks = [make_task(ref) for ref in spec.tasks]
    size = space_size(spec.space, loaded.base_values)
    parts: list[Any] = [Text(f"search {spec.name}: base {loaded.base_file} ({loaded.base.name})", style="bold")]

    space = Table(title=f"space: {len(spec.space)} fields, {size}", title_justify="left")
    for column in ("field", "values", "sampled when"):
        space.add_column(column, overflow="fold")
    for name, param in spec.space.items():
        space.add_row(name, _values(param), _condition(param))
    parts.append(space)

    dead = [d for d in dead_values(spec, loaded.base, tasks) if d.kind == "constrained"]
    constraints = ", ".join(c.shown() for c in spec.constraints) or "none"
    if dead:
        ruled_out = Table(title=f"values every point of which breaks a constraint ({constraints})", title_justify="left")
        for column in ("field", "value", "for example"):
            ruled_out.add_column(column, overflow="fold")
        for d in dead:
            ruled_out.add_row(d.field, json.dumps(d.value), d.reason)
        parts.append(ruled_out)
    else:
        parts.append(Text(f"constraints: {constraints}; every value of every field makes a valid spec within them at "
                          f"some point of the space (up to {MAX_PROBES_PER_VALUE} points tried per value)"))

    reported = reported_metrics(spec, tasks)
    objectives = Table(title="objectives", title_justify="left")
    for column in ("objective", "direction", "reported by the trials"):
        objectives.add_column(column)
    for objective in spec.objectives:
        source = "cost model" if objective.metric in COST_METRICS else "trainer"
        objectives.add_row(objective.metric, "max ↑" if objective.maximise else "min ↓",
                           f"yes ({source})" if objective.metric in reported else "NO")
    parts.append(objectives)
    task_text = "; ".join(
        f"{ref.name} (preset {ref.preset}{', ' + ', '.join(f'{k}={v}' for k, v in ref.options.items()) if ref.options else ''})"
        for ref in spec.tasks
    )
    parts.append(Text(f"tasks: {task_text}"))
    parts.append(Text(f"the trials report: {reported.listing()}"))
    budget = spec.budget
    per_trial = f", at most {number(budget.time_per_trial)} s of training per trial and task" if budget.time_per_trial else ""
    concurrent = f", at most {spec.resources.concurrent} at once" if spec.resources.concurrent else ""
    gpu = ("a share of a GPU sized from its memory estimate (gpu: auto)" if spec.resources.gpu == "auto"
           else f"{number(spec.resources.gpu)} GPU")
    parts.append(Text(
        f"budget: {budget.trials} trials of {budget.steps} steps{per_trial}; sampler {spec.sampler} (seed {spec.seed}); "
        f"each trial reserves {number(spec.resources.cpu)} CPU and {gpu}{concurrent}"
    ))
    if spec.scheduler is not None:
        s = spec.scheduler
        parts.append(Text(f"scheduler: {s.type}, stops trials behind on {s.metric} ({s.mode}) after {s.grace_steps} steps, "
                          f"keeping 1/{number(s.reduction_factor)} at each rung"))
    if spec.train:
        parts.append(Text(f"trainer options: {', '.join(f'{k}={v}' for k, v in spec.train.items())}"))
    return Group(*parts)


def print_dry_run(loaded: LoadedSearch, console: Console | None = None) -> None:
    (console or Console()).print(dry_run_report(loaded))
