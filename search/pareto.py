"""Pareto analysis of search runs: fronts, hypervolume and IGD+ between runs, plots.

The front of a run is its non-dominated `ok` trials (failed, diverged, skipped and
unfinished trials never enter it). Runs are compared in a shared normalised space: for
each objective, the best and worst values over the union of all fronts map to 0 and 1
(0 is best, whatever the direction), so that a parameter count in millions and an
accuracy in [0, 1] weigh alike. There:

- hypervolume is measured against the shared reference point 1.1 in every objective
  (the union's worst value plus a tenth of its range, so that the worst points still add
  volume); larger is better;
- IGD+ is measured against the reference front, the non-dominated points of the union;
  0 means the run found all of it, larger is worse.

Both come from moocore (its exact algorithms); `pareto` only decides what is compared.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import moocore
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from archspec.atomic import write_atomic
from archspec.search.rundir import OK, RunDir, TrialRecord, status_counts, trained_count
from archspec.search.space import Objective

REFERENCE_MARGIN = 0.1  # the reference point lies this fraction of the range beyond the worst


def nondominated_mask(values: np.ndarray, maximise: Sequence[bool]) -> np.ndarray:
    """Rows of `values` that no other row dominates; equal rows are all kept."""
    values = np.asarray(values, dtype=float)
    if values.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    return np.asarray(moocore.is_nondominated(values, maximise=list(maximise), keep_weakly=True), dtype=bool)


def objective_values(record: TrialRecord, objectives: Sequence[Objective]) -> list[float] | None:
    """The trial's objective values, or None if any is missing or not finite."""
    values = []
    for objective in objectives:
        value = record.metrics.get(objective.metric)
        if value is None or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        values.append(float(value))
    return values


def front_of(records: Sequence[TrialRecord], objectives: Sequence[Objective]) -> list[TrialRecord]:
    """The non-dominated `ok` trials, by trial number."""
    scored = [(r, v) for r in records if r.status == OK and (v := objective_values(r, objectives)) is not None]
    if not scored:
        return []
    mask = nondominated_mask(np.array([v for _, v in scored]), [o.maximise for o in objectives])
    return sorted((r for (r, _), keep in zip(scored, mask) if keep), key=lambda r: r.number)


# --------------------------------------------------------------------------- comparison


@dataclass(frozen=True)
class Normalisation:
    """Per objective: the best and worst value over the compared fronts (raw units)."""

    best: list[float]
    worst: list[float]
    maximise: list[bool]

    @classmethod
    def over(cls, fronts: Sequence[np.ndarray], maximise: Sequence[bool]) -> Normalisation:
        union = np.vstack([f for f in fronts if len(f)])
        best = [float(union[:, j].max() if m else union[:, j].min()) for j, m in enumerate(maximise)]
        worst = [float(union[:, j].min() if m else union[:, j].max()) for j, m in enumerate(maximise)]
        return cls(best=best, worst=worst, maximise=list(maximise))

    @property
    def span(self) -> np.ndarray:
        """worst - best per objective; a flat objective gets a unit span (its values map to 0)."""
        best, worst = np.array(self.best), np.array(self.worst)
        unit = np.where(self.maximise, -1.0, 1.0)
        return np.where(worst != best, worst - best, unit)

    def apply(self, values: np.ndarray) -> np.ndarray:
        """Raw values -> [0, 1] per objective, 0 best, as minimisation."""
        values = np.asarray(values, dtype=float).reshape(-1, len(self.best))
        return (values - np.array(self.best)) / self.span

    def reference_point(self, margin: float = REFERENCE_MARGIN) -> list[float]:
        """The shared reference point in raw units (1 + margin in normalised units)."""
        return [float(v) for v in np.array(self.best) + (1.0 + margin) * self.span]


@dataclass(frozen=True)
class Comparison:
    normalisation: Normalisation
    reference_point: list[float]  # raw units
    hypervolume: dict[str, float]
    igd_plus: dict[str, float]
    reference_front_size: int


def compare_fronts(fronts: Mapping[str, np.ndarray], maximise: Sequence[bool], margin: float = REFERENCE_MARGIN) -> Comparison:
    """Hypervolume and IGD+ of each named front in the shared normalised space."""
    arrays = {name: np.asarray(f, dtype=float).reshape(-1, len(maximise)) for name, f in fronts.items()}
    nonempty = [a for a in arrays.values() if len(a)]
    if not nonempty:
        raise ValueError("no run has a trial on its front yet")
    norm = Normalisation.over(nonempty, maximise)
    union = norm.apply(np.vstack(nonempty))
    reference_front = union[nondominated_mask(union, [False] * len(maximise))]
    ref = [1.0 + margin] * len(maximise)
    hv, igd = {}, {}
    for name, values in arrays.items():
        if not len(values):
            hv[name], igd[name] = 0.0, math.inf
            continue
        points = norm.apply(values)
        hv[name] = float(moocore.hypervolume(points, ref=ref))
        igd[name] = float(moocore.igd_plus(points, ref=reference_front))
    return Comparison(norm, norm.reference_point(margin), hv, igd, len(reference_front))


# --------------------------------------------------------------------------- runs


@dataclass
class RunSummary:
    """One run directory, read: its objectives, trials and current front."""

    name: str
    path: Path
    objectives: list[Objective]
    records: list[TrialRecord]
    front: list[TrialRecord]

    @property
    def front_values(self) -> np.ndarray:
        rows = [objective_values(r, self.objectives) for r in self.front]
        return np.array(rows, dtype=float).reshape(-1, len(self.objectives))

    def to_json(self) -> dict[str, Any]:
        counts = status_counts(self.records)
        return {
            "run": str(self.path),
            "objectives": [{"metric": o.metric, "direction": o.direction} for o in self.objectives],
            "front": [
                {"trial": r.number, "overrides": r.overrides, "metrics": r.metrics} for r in self.front
            ],
            "trials_completed": trained_count(self.records),
            "trials_ok": counts["ok"],
            "trials_running": counts["running"],
            "status_counts": counts,
        }


def read_run(path: str | Path) -> RunSummary:
    """Read a run directory (finished or still running) into a `RunSummary`."""
    from archspec.errors import ArchspecError
    from archspec.spec.yaml_source import load_validated

    run = RunDir(path)
    if not run.exists():
        raise ArchspecError(f"{path}: not a search run directory (no {run.search_file.name}; `archspec search ... --out DIR` makes one)")
    # Reading results needs the objectives only; a truncated or edited file is refused, located.
    stored, _ = load_validated(run.search_file, StoredObjectives, what="search spec")
    parsed = list(stored.objectives)
    records = run.read_trials()
    return RunSummary(name=_run_name(run.path), path=run.path, objectives=parsed, records=records, front=front_of(records, parsed))


class StoredObjectives(BaseModel):
    """What `read_run` needs of a run's `search.yaml`; the rest is the runner's business."""

    model_config = ConfigDict(extra="allow")
    objectives: list[Objective] = Field(min_length=1)


def _run_name(path: Path) -> str:
    return path.name or str(path)


def aligned_objectives(runs: Sequence[RunSummary]) -> list[Objective]:
    """The objectives all runs share (same metrics and directions), or a clear error."""
    from archspec.errors import ArchspecError

    first = runs[0]
    for other in runs[1:]:
        if {(o.metric, o.direction) for o in other.objectives} != {(o.metric, o.direction) for o in first.objectives}:
            def show(run: RunSummary) -> str:
                return ", ".join(f"{o.metric} ({o.direction})" for o in run.objectives)

            raise ArchspecError(
                "these runs cannot be compared: they optimise different objectives",
                [(None, None, f"{first.path}: {show(first)}"), (None, None, f"{other.path}: {show(other)}")],
            )
    return first.objectives


def comparison_of(runs: Sequence[RunSummary]) -> Comparison | None:
    """Hypervolume and IGD+ of every run against the union of their fronts."""
    objectives = aligned_objectives(runs)
    fronts: dict[str, np.ndarray] = {}
    for run in runs:
        rows = [objective_values(r, objectives) for r in run.front]
        fronts[str(run.path)] = np.array(rows, dtype=float).reshape(-1, len(objectives))
    if not any(len(f) for f in fronts.values()):
        return None
    return compare_fronts(fronts, [o.maximise for o in objectives])


def report_json(runs: Sequence[RunSummary]) -> dict[str, Any]:
    """`archspec pareto --json`: one run's object, or `{"runs": [...], ...}` for several.

    Each run object holds `front`, `trials_completed` and `status_counts`, plus its
    `hypervolume` (and, for several runs, `igd_plus`) in the shared normalised space.
    """
    comparison = comparison_of(runs)
    objects = []
    for run in runs:
        obj = run.to_json()
        key = str(run.path)
        obj["hypervolume"] = comparison.hypervolume[key] if comparison else None
        if len(runs) > 1:
            obj["igd_plus"] = _finite_or_none(comparison.igd_plus[key]) if comparison else None
        objects.append(obj)
    shared = {
        "reference_point": comparison.reference_point if comparison else None,
        "normalisation": {"best": comparison.normalisation.best, "worst": comparison.normalisation.worst} if comparison else None,
    }
    if len(runs) == 1:
        return {**objects[0], **shared}
    return {"runs": objects, **shared, "reference_front_size": comparison.reference_front_size if comparison else 0}


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


# --------------------------------------------------------------------------- plot


# Runs are told apart by colour and by marker; a later run's front points are drawn
# larger and hollow around the earlier ones, so that identical fronts stay visible.
_MARKERS = ("o", "s", "^", "D", "v", "P")
_FRONT_SIZE = 36.0
_FRONT_SIZE_STEP = 40.0


def plot_fronts(runs: Sequence[RunSummary], path: str | Path) -> Path:
    """Overlay the runs' trials and fronts: one panel for 2 objectives, every pair for more.

    Every `ok` trial is a faint dot, the front is drawn solid; in 2-D the front is joined
    as the staircase it dominates. Each front point is labelled with its trial number and
    its overrides by the tables' short field names (`#3 type=householder n_h=2`), once
    where runs share it; a run whose front equals an earlier run's says so in the legend.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, safe in workers and CI
    import matplotlib.pyplot as plt

    from archspec.search.formatting import overrides_label

    objectives = aligned_objectives(runs)
    pairs = [(i, j) for i in range(len(objectives)) for j in range(i + 1, len(objectives))]
    if not pairs:  # a single objective: plot it against the trial number
        pairs = [(0, -1)]
    columns = min(3, len(pairs))
    rows = math.ceil(len(pairs) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.4 * columns, 5.0 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fields = sorted({k for run in runs for r in run.front for k in r.overrides})
    same_as = _identical_fronts(runs, objectives)
    for panel, (i, j) in enumerate(pairs):
        ax = axes[panel // columns][panel % columns]
        labelled: set[tuple[float, float]] = set()
        for index, run in enumerate(runs):
            color = colors[index % len(colors)]
            marker = _MARKERS[index % len(_MARKERS)]
            size = _FRONT_SIZE + _FRONT_SIZE_STEP * index
            style = dict(s=size, marker=marker, zorder=3 + index, edgecolors=color, linewidths=1.4,
                         facecolors=color if index == 0 else "none")
            legend = f"{run.name} ({len(run.front)})" + (f", the same front as {same_as[index]}" if index in same_as else "")
            every = [r for r in run.records if r.status == OK and objective_values(r, objectives) is not None]
            allv = np.array([objective_values(r, objectives) for r in every], dtype=float).reshape(-1, len(objectives))
            front = np.array([objective_values(r, objectives) for r in run.front], dtype=float).reshape(-1, len(objectives))
            xs = np.array([r.number for r in run.front], dtype=float) if j == -1 else front[:, j]
            if j == -1:
                ax.scatter([r.number for r in every], allv[:, i], s=14, alpha=0.3, color=color, marker=marker)
                ax.set_xlabel("trial")
            else:
                ax.scatter(allv[:, j], allv[:, i], s=14, alpha=0.25, color=color, marker=marker)
                if len(objectives) == 2 and len(front):
                    sx, sy = _staircase(front[:, j], front[:, i], objectives[1].maximise, objectives[0].maximise)
                    ax.plot(sx, sy, color=color, linewidth=1.2, zorder=2, linestyle=("-", "--", ":", "-.")[index % 4])
                ax.set_xlabel(_axis_label(objectives[j]))
            ax.scatter(xs, front[:, i], label=legend, **style)
            for record, x, y in zip(run.front, xs, front[:, i]):
                if (float(x), float(y)) in labelled:
                    continue
                labelled.add((float(x), float(y)))
                ax.annotate(f"#{record.number} {overrides_label(record.overrides, fields)}".strip(), (x, y),
                            xytext=(5, 4), textcoords="offset points", fontsize=7, color=color)
        ax.set_ylabel(_axis_label(objectives[i]))
        if j != -1:
            _log_if_wide(ax, "x", [r for run in runs for r in run.records], objectives[j])
        _log_if_wide(ax, "y", [r for run in runs for r in run.records], objectives[i])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for panel in range(len(pairs), rows * columns):
        axes[panel // columns][panel % columns].set_visible(False)
    fig.suptitle("Pareto fronts: " + " vs ".join(r.name for r in runs))
    fig.tight_layout()
    path = Path(path)
    try:  # atomic: a plot being refreshed is never seen half-written
        check_plot_path(path)
        write_atomic(path, lambda handle: fig.savefig(handle, format="png", dpi=120))
    except OSError as exc:
        from archspec.errors import ArchspecError

        raise ArchspecError(f"cannot write the plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return path


def _identical_fronts(runs: Sequence[RunSummary], objectives: Sequence[Objective]) -> dict[int, str]:
    """Run index -> the name of the first earlier run with the same front values."""
    seen: dict[tuple, str] = {}
    same: dict[int, str] = {}
    for index, run in enumerate(runs):
        key = tuple(sorted(tuple(objective_values(r, objectives) or ()) for r in run.front))
        if key and key in seen:
            same[index] = seen[key]
        else:
            seen.setdefault(key, run.name)
    return same


def check_plot_path(path: str | Path) -> None:
    """Refuse a plot path that cannot take a file (a directory, a missing folder), before
    any run is read."""
    from archspec.errors import ArchspecError

    path = Path(path)
    if path.is_dir():
        raise ArchspecError(f"--plot {path}: is a directory; give a file name such as {path / 'front.png'}")
    if not path.parent.is_dir():
        raise ArchspecError(f"--plot {path}: no folder {path.parent} to write it into")
    if path.exists() and not path.is_file():
        raise ArchspecError(f"--plot {path}: exists and is not a regular file")


def _log_if_wide(ax: Any, axis: str, records: Sequence[TrialRecord], objective: Objective) -> None:
    """A log axis for a positive metric spanning more than a decade (parameters, FLOPs)."""
    values = [v for r in records if r.status == OK
              and isinstance(v := r.metrics.get(objective.metric), (int, float)) and math.isfinite(v)]
    if values and min(values) > 0 and max(values) / min(values) > 10:
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")


def _axis_label(objective: Objective) -> str:
    return f"{objective.metric} ({'higher' if objective.maximise else 'lower'} is better)"


def _staircase(x: np.ndarray, y: np.ndarray, x_max: bool, y_max: bool) -> tuple[list[float], list[float]]:
    """The boundary of what a 2-D front dominates, through its points in x order."""
    order = np.argsort(x if not x_max else -x)
    xs, ys = [], []
    for k, idx in enumerate(order):
        if k:
            xs.append(float(x[idx]))
            ys.append(ys[-1])
        xs.append(float(x[idx]))
        ys.append(float(y[idx]))
    return xs, ys
