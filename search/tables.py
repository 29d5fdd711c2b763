"""Rich tables of search runs: the front, the trial counts, the comparison between runs.

Shared by `archspec pareto`, the live view and the summary `archspec search` prints.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from archspec.search.formatting import number, override_value, short_fields
from archspec.search.pareto import Comparison, RunSummary
from archspec.search.rundir import TrialRecord, status_counts, trained_count
from archspec.search.space import Objective


def front_table(records: Sequence[TrialRecord], objectives: Sequence[Objective], title: str | None = None) -> Table:
    """One row per front trial: its number, its overrides, its objective values."""
    fields: list[str] = []
    for record in records:
        fields += [k for k in record.overrides if k not in fields]
    rows = []
    for record in records:
        row = [str(record.number)]
        row += [override_value(record.overrides[f]) if f in record.overrides else "" for f in fields]
        row += [number(record.metrics.get(o.metric)) for o in objectives]
        rows.append(row)
    short = short_fields(fields)
    headers = ["trial", *(short[f] for f in fields), *(f"{o.metric} {'↑' if o.maximise else '↓'}" for o in objectives)]
    table = Table(title=title, title_justify="left")
    for index, header in enumerate(headers):
        # On a narrow console a header and its values fold onto more lines rather than
        # being cut short (`write_gai…`) or cut off at the console's edge.
        table.add_column(header, justify="left" if 0 < index <= len(fields) else "right", overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def counts_line(records: Sequence[TrialRecord], running: int | None = None) -> str:
    """`12 trained (10 ok, 1 failed, 1 diverged); 3 skipped; 1 running`. `running`
    replaces the count of trials without a result (the live view knows it from Ray)."""
    counts = status_counts(records)
    if running is not None:
        counts["running"] = running
    trained = trained_count(records)
    parts = [f"{trained} trained ({counts['ok']} ok, {counts['failed']} failed, {counts['diverged']} diverged)"]
    for status in ("skipped", "invalid", "interrupted", "running"):
        if counts.get(status):
            parts.append(f"{counts[status]} {status}")
    return "; ".join(parts)


def run_front_table(run: RunSummary) -> Table:
    return front_table(run.front, run.objectives, title=f"{run.name}: front of {len(run.front)} — {counts_line(run.records)}")


def comparison_table(runs: Sequence[RunSummary], comparison: Comparison) -> Table:
    """Hypervolume and IGD+ of each run in the shared normalised space."""
    table = Table(
        title="between runs (objectives normalised over the union of fronts; "
        f"reference point {', '.join(number(v) for v in comparison.reference_point)})",
        title_justify="left",
    )
    for column, justify in (("run", "left"), ("trained", "right"), ("front", "right"), ("hypervolume ↑", "right"), ("IGD+ ↓", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for run in runs:
        key = str(run.path)
        table.add_row(
            run.name, str(trained_count(run.records)), str(len(run.front)),
            f"{comparison.hypervolume[key]:.4f}", f"{comparison.igd_plus[key]:.4f}",
        )
    return table
