"""Experiments: a list of training runs compared on one task, as one YAML file.

A reproduction of a paper's finding is an experiment (`specs/experiments/*.yaml`):

```yaml
name: deltaproduct-s3
task: {name: s3, preset: cpu, options: {train_len: 32}}
train: {steps: 3000}                   # keyword options of search.trainer.train
set: [model.layers=1, mixer.short_conv=0]   # overrides for every run
seeds: [0]
runs:
  - {name: "n_h=2, beta in [0,2]", spec: ../models/deltaproduct-2.yaml}
  - {name: "n_h=1, beta in [0,2]", spec: ../models/deltaproduct-2.yaml, set: [mixer.transition.n_h=1]}
report: [token_acc@32, token_acc@64, seq_acc@64]
```

`archspec experiment FILE --out DIR` trains every run and seed into
`DIR/<run>/s<seed>/` and rewrites `DIR/results.json` and `DIR/results.md` (a table of the
report metrics, per seed and the mean) after each one, atomically, so an interrupted
experiment keeps what it finished; running it again skips the runs already done.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from archspec.atomic import write_text_atomic
from archspec.errors import ArchspecError
from archspec.spec.yaml_source import LocatedDocument, Override, load_validated

from .space import COST_METRICS
from .tasks import get_task
from .trainer import METRICS_FILE, json_safe, train

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
# Keyword options an experiment may not pass to train(): the runner sets them (and the
# launcher of a data-parallel search trial sets `data_parallel`, an object, not an option).
RUNNER_SETS: tuple[str, ...] = ("seed", "out_dir", "quiet", "device", "task_options", "preset", "overrides", "diagnostics",
                                "spec_label", "progress_label", "on_validation", "data_parallel")
# What an experiment's `train:` may set: train()'s keyword options less the runner's own.
TRAIN_OPTIONS = [n for n in inspect.signature(train).parameters if n not in ("spec", "task", *RUNNER_SETS)]


class TaskRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    preset: str = "cpu"
    options: dict[str, Any] = Field(default_factory=dict)


class RunRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, description="How the run appears in the results table.")
    spec: str = Field(min_length=1, description="Model spec, relative to the experiment file.")
    set: list[str] = Field(default_factory=list, description="Overrides after the experiment's own.")
    train: dict[str, Any] = Field(default_factory=dict, description="Trainer options over the experiment's.")


class Experiment(BaseModel):
    model_config = ConfigDict(extra="forbid", title="archspec experiment")
    name: str = Field(min_length=1)
    description: str = ""
    task: TaskRef
    train: dict[str, Any] = Field(default_factory=dict)
    set: list[str] = Field(default_factory=list)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    runs: list[RunRef] = Field(min_length=1)
    report: list[str] = Field(min_length=1, description="Metric names shown in results.md.")
    diagnostics: bool = False


def experiment_json_schema() -> dict[str, Any]:
    """The JSON Schema of experiment files, for editors (yaml-language-server)."""
    from archspec.spec.schema import JSON_SCHEMA_DIALECT

    return {"$schema": JSON_SCHEMA_DIALECT, **Experiment.model_json_schema()}


def slug(name: str) -> str:
    """A folder name for a run: `n_h=2, beta in [0,2]` -> `n_h-2-beta-in-0-2`."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", name).strip("-").lower() or "run"


def load_experiment(path: str | os.PathLike[str], overrides: Iterable[Override] = ()) -> tuple[Experiment, Path]:
    """Read and validate an experiment file; every problem at once, each naming
    file:line:column and the field: the runs' specs with their overrides are validated
    and the report's metrics checked against what the runs report, before anything trains."""
    base = Path(path).resolve().parent

    def semantic(exp: Experiment, doc: LocatedDocument) -> list[tuple[tuple[str | int, ...], str]]:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        try:
            task = get_task(exp.task.name, exp.task.preset, **exp.task.options)
        except ArchspecError as exc:
            task = None
            problems.append((("task",), str(exc)))
        names = [r.name for r in exp.runs]
        for i, run in enumerate(exp.runs):
            if not (base / run.spec).is_file():
                problems.append((("runs", i, "spec"), f"no such model spec {run.spec!r} (relative to the experiment file)"))
            elif task is not None:
                problems += _run_spec_problems(base / run.spec, [*exp.set, *run.set], task, ("runs", i))
            if names.count(run.name) > 1 or [slug(n) for n in names].count(slug(run.name)) > 1:
                problems.append((("runs", i, "name"), f"run name {run.name!r} is not unique"))
        for where, options in [(("train",), exp.train)] + [(("runs", i, "train"), r.train) for i, r in enumerate(exp.runs)]:
            for key in options:
                if key in RUNNER_SETS:
                    problems.append((where + (key,), f"{key!r} is set by the experiment runner"))
                elif key not in TRAIN_OPTIONS:
                    problems.append((where + (key,), f"the trainer has no option {key!r}; it takes {', '.join(TRAIN_OPTIONS)}"))
        if task is not None:
            problems += _report_problems(exp, task)
        return problems

    exp, _ = load_validated(path, Experiment, what="experiment", overrides=overrides, semantic=semantic,
                            placeholders=_PLACEHOLDERS)
    return exp, base


# A broken required section is replaced by these while the others are checked (its own
# problem is reported either way); see `yaml_source.salvage`.
_PLACEHOLDERS = {"name": "-", "report": []}


def _run_spec_problems(spec: Path, sets: list[str], task: Any, where: tuple[str | int, ...]) -> list[tuple[tuple[str | int, ...], str]]:
    """A run's model spec with the experiment's and the run's overrides, as it will train."""
    from archspec import load_spec

    try:
        load_spec(spec, [*sets, ("model.vocab_size", task.vocab_size)])
    except ArchspecError as exc:
        found = [f"{loc}: {field + ': ' if field else ''}{message}" for loc, field, message in exc.problems] or [str(exc)]
        return [(where, f"the run's spec does not validate: {problem}") for problem in found]
    return []


def _report_problems(exp: Experiment, task: Any) -> list[tuple[tuple[str | int, ...], str]]:
    """Report metrics no run reports (a misspelt name would leave its column empty)."""
    from .trial import trainer_metrics

    options = {**exp.train}
    reported = trainer_metrics(task, throughput=options.get("measure_throughput", True) is not False,
                               cuda=True, diagnostics=exp.diagnostics)
    problems = []
    for index, metric in enumerate(exp.report):
        if metric not in reported:
            close = reported.closest(metric)
            hint = f" (did you mean {close}?)" if close else ""
            problems.append((("report", index), f"no run reports {metric!r}{hint}; the runs report: {reported.listing()}"))
    return problems


def _mean(values: list[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def _heading(exp: Experiment) -> list[str]:
    lines = [f"# {exp.name}", ""]
    if exp.description:
        lines += [exp.description.strip(), ""]
    opts = ", ".join(f"{k}={v}" for k, v in exp.task.options.items())
    lines += [f"Task `{exp.task.name}` (preset {exp.task.preset}{', ' + opts if opts else ''}); seeds {exp.seeds}.", ""]
    return lines


def results_rows(exp: Experiment, results: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The results table's header and rows: one row per run, the report metrics as mean
    over finished seeds (and each seed's value when there are several), status, steps
    and seconds."""
    header = ["run", *exp.report, "status", "steps", "seconds"]
    rows = []
    for run in exp.runs:
        per_seed = results.get(run.name, {})
        cells = [run.name]
        for metric in exp.report:
            values = [per_seed[str(s)]["metrics"].get(metric) for s in exp.seeds if str(s) in per_seed]
            mean = _mean(values)
            cell = "-" if mean is None else f"{mean:.3f}"
            if len(values) > 1:
                cell += " (" + ", ".join("-" if v is None else f"{v:.3f}" for v in values) + ")"
            cells.append(cell)
        done = [per_seed[str(s)] for s in exp.seeds if str(s) in per_seed]
        cells.append(", ".join(sorted({d["status"] for d in done})) or "not run")
        cells.append(", ".join(str(d["steps_done"]) for d in done) or "-")
        cells.append(", ".join(f"{d['seconds']:.0f}" for d in done) or "-")
        rows.append(cells)
    return header, rows


def results_table(exp: Experiment, results: dict[str, dict[str, Any]]) -> str:
    """Markdown: the heading and the results table (`results_rows`)."""
    header, rows = results_rows(exp, results)
    lines = _heading(exp)
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


def results_renderable(exp: Experiment, results: dict[str, dict[str, Any]]) -> Any:
    """The same table for a terminal, one column per run and one row per metric: metric
    names are never cut short (`write_gai…`), and values wrap between seeds."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    header, rows = results_rows(exp, results)
    table = Table(show_lines=True)
    table.add_column("", no_wrap=True, min_width=max(len(name) for name in header[1:]))
    for cells in rows:
        table.add_column(cells[0], justify="right", overflow="fold")
    for index, name in enumerate(header[1:], start=1):
        table.add_row(name, *(cells[index] for cells in rows))
    heading = [line for line in _heading(exp) if line]
    return Group(Text(heading[0].lstrip("# "), style="bold"), *(Text(line.replace("`", "")) for line in heading[1:]), table)


def run_experiment(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    device: str | None = None,
    overrides: Iterable[Override] = (),
    only: Iterable[str] = (),
    fresh: bool = False,
    quiet: bool = False,
) -> dict[str, dict[str, Any]]:
    """Train every run and seed of the experiment (or the runs named in `only`)."""
    exp, base = load_experiment(path, overrides)
    wanted = set(only)
    unknown = wanted - {r.name for r in exp.runs} - {slug(r.name) for r in exp.runs}
    if unknown:
        raise ArchspecError(f"--only {', '.join(sorted(unknown))}: no such run; runs: {', '.join(r.name for r in exp.runs)}")
    out = Path(out_dir)

    def selected(run: RunRef) -> bool:
        return not wanted or run.name in wanted or slug(run.name) in wanted

    # First what earlier invocations finished, so that results.md shows it from the start.
    results: dict[str, dict[str, Any]] = {run.name: {} for run in exp.runs}
    todo: list[tuple[RunRef, int, Path]] = []
    for run in exp.runs:
        for seed in exp.seeds:
            folder = out / slug(run.name) / f"s{seed}"
            metrics_file = folder / METRICS_FILE
            if metrics_file.exists() and not (fresh and selected(run)):
                record = _read_metrics(metrics_file)
                if record.get("status") in ("ok", "diverged"):
                    results[run.name][str(seed)] = _summary(record)
                    continue
            if selected(run):
                todo.append((run, seed, folder))
    _write_results(out, exp, results)
    for run, seed, folder in todo:
        task = get_task(exp.task.name, exp.task.preset, **exp.task.options)
        result = train(
            str(base / run.spec),
            task,
            seed=seed,
            device=device,
            out_dir=folder,
            overrides=[*exp.set, *run.set],
            diagnostics=exp.diagnostics,
            quiet=quiet,
            preset=exp.task.preset,
            spec_label=run.spec,
            progress_label=f"{run.name}, seed {seed} ({exp.task.name})",
            **{**exp.train, **run.train},
        )
        results[run.name][str(seed)] = _summary(result.record)
        _write_results(out, exp, results)
    return results


def _read_metrics(file: Path) -> dict[str, Any]:
    """A finished run's metrics.json, or an `ArchspecError` naming the file (written
    atomically by the trainer, a broken one was truncated or edited by hand)."""
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArchspecError(f"{file}: not a metrics file the trainer wrote ({exc}); delete it to train that run again") from None
    shapes = {"metrics": dict, "train": dict}
    bad = [k for k, kind in shapes.items() if not isinstance(record, dict) or not isinstance(record.get(k, kind()), kind)]
    if not isinstance(record, dict) or bad:
        what = type(record).__name__ if not isinstance(record, dict) else f"`{bad[0]}` of the wrong type"
        raise ArchspecError(f"{file}: not a metrics file the trainer wrote ({what}); delete it to train that run again")
    return record


def _summary(record: dict[str, Any]) -> dict[str, Any]:
    train = record.get("train", {})
    return {
        "status": record.get("status"),
        "reason": record.get("reason"),
        "metrics": {k: v for k, v in record.get("metrics", {}).items()},
        "steps_done": train.get("steps_done", 0),
        "seconds": train.get("seconds", 0.0),
        "device": train.get("device"),
    }


def _write_results(out: Path, exp: Experiment, results: dict[str, dict[str, Any]]) -> None:
    payload = {"experiment": exp.model_dump(mode="json"), "results": results}
    write_text_atomic(out / RESULTS_JSON, json.dumps(json_safe(payload), indent=2, allow_nan=False) + "\n")
    write_text_atomic(out / RESULTS_MD, results_table(exp, results))


# --------------------------------------------------------------------------- cost columns

# The metrics the cost model gives (analytic functions of the spec, not measurements):
# what `refresh_costs` recomputes when the cost model changes.
COST_COLUMNS = COST_METRICS


def run_costs(exp: Experiment, experiment_dir: Path, run: RunRef, device: str = "cpu") -> dict[str, float]:
    """A run's cost metrics as the trainer computes them now on `device` (the FLOPs are
    those of the recurrence's path there): its spec with the experiment's and the run's
    overrides and the task's vocabulary, lowered and costed."""
    import archspec

    from .trainer import cost_metrics

    task = get_task(exp.task.name, exp.task.preset, **exp.task.options)
    spec = archspec.load_spec(experiment_dir / run.spec, [*exp.set, *run.set, ("model.vocab_size", task.vocab_size)])
    costs = cost_metrics(archspec.lower(spec), device)
    return {name: costs[name] for name in COST_COLUMNS}


def refresh_costs(results_file: str | os.PathLike[str], experiment_file: str | os.PathLike[str]) -> list[str]:
    """Recompute the cost columns of a results file (an experiment's `results.json`, or a
    committed copy) from the current code, leaving every measured number as it is, and
    rewrite it and the Markdown table beside it (same name, `.md`). The runs, their
    overrides and the device each ran on are those recorded in the file; their spec paths
    are relative to `experiment_file`. Returns what changed, one line per run, seed and
    metric."""
    path = Path(results_file)
    payload = json.loads(path.read_text())
    exp = Experiment.model_validate(payload["experiment"])
    experiment_dir = Path(experiment_file).resolve().parent
    changes = []
    for run in exp.runs:
        for seed, summary in payload["results"].get(run.name, {}).items():
            costs = run_costs(exp, experiment_dir, run, summary.get("device") or "cpu")
            for name, value in costs.items():
                if summary["metrics"].get(name) != value:
                    changes.append(f"{run.name}, seed {seed}: {name} {summary['metrics'].get(name)} -> {value}")
                    summary["metrics"][name] = value
    write_text_atomic(path, json.dumps(json_safe(payload), indent=2, allow_nan=False) + "\n")
    markdown = path.with_suffix(".md")
    if markdown.exists():
        write_text_atomic(markdown, results_table(exp, payload["results"]))
    return changes
