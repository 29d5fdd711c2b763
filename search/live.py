"""What a running search shows, and the driver's bookkeeping of Ray's trial events.

`LiveView` is a rich live display, redrawn about once a second from the run directory
and Ray's events: trials running (their overrides and time so far), trials done by
status, and the current front. On a console that is not a terminal (CI logs, a pipe)
it prints one line per finished trial instead.

`RecordingCallback` completes the run directory from the driver's side: the result of a
trial that ran on a node whose files the driver cannot see, the failure of a trial
whose worker died before it could write anything, and a trial a scheduler stopped early
(its worker is stopped while it waits on a validation result, before it writes one).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text
from ray.tune import Callback

from archspec.search.pareto import front_of
from archspec.search.rundir import FAILED, STOPPED, RunDir, TrialRecord, trained_count
from archspec.search.space import SearchSpec
from archspec.search.trial import PROGRESS, RECORD_KEY, STEP_KEY, record_from_result
from archspec.search.formatting import number, override_value, short_fields
from archspec.search.tables import counts_line, front_table

MAX_FRONT_ROWS = 12


class RecordingCallback(Callback):
    """Writes `result.json` from the driver when the worker's copy is not visible here."""

    def __init__(self, run: RunDir, scheduler_name: str = "scheduler"):
        self.run = run
        self.scheduler_name = scheduler_name  # named in a stopped trial's reason

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        record = record_from_result(result)
        if record is not None and not self.run.occupant(record.number, record.overrides):
            existing = self.run.read_trial(record.number)
            if existing is None or existing.status is None:
                self.run.write_trial_result(record)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        last = dict(trial.last_result or {})
        if last.get("status") != PROGRESS or RECORD_KEY in last:
            return  # it ended on its own: its worker wrote its record
        number = int(trial.config["trial_number"])
        overrides = dict(trial.config.get("overrides", {}))
        existing = self.run.read_trial(number)
        if self.run.occupant(number, overrides) or (existing is not None and existing.status is not None):
            return
        metrics = {k: float(v) for k, v in last.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k in self.reported(last)}
        self.run.write_trial_result(TrialRecord(
            number=number, status=STOPPED, overrides=overrides, metrics=metrics,
            reason=f"stopped early by the {self.scheduler_name} at step {last.get(STEP_KEY)} from its validation results",
            started_at=existing.started_at if existing else None, finished_at=time.time(),
            host=existing.host if existing else None, device=existing.device if existing else None,
            placement=existing.placement if existing else {}, pid=existing.pid if existing else None,
        ))

    @staticmethod
    def reported(result: dict[str, Any]) -> set[str]:
        """The metric names of a validation result (Ray adds its own keys beside them)."""
        from ray.tune.result import AUTO_RESULT_KEYS

        return {k for k in result if k not in AUTO_RESULT_KEYS and k not in ("trial_number", "status", "done", STEP_KEY)}

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        number = int(trial.config["trial_number"])
        if self.run.occupant(number, dict(trial.config.get("overrides", {}))):
            return  # another point's trial holds the folder: it is not written over
        existing = self.run.read_trial(number)
        if existing is not None and existing.status is not None:
            return
        now = time.time()
        self.run.write_trial_result(TrialRecord(
            number=number, status=FAILED, overrides=dict(trial.config.get("overrides", {})),
            reason=f"the trial's Ray worker failed: {_error_text(trial)}",
            started_at=existing.started_at if existing else None, finished_at=now,
        ))


def _error_text(trial: Any, limit: int = 400) -> str:
    """What Ray recorded of a trial's failure, on one line (its local error file first:
    the copy in the experiment storage is synced later)."""
    text = ""
    path = getattr(trial, "error_file", None)
    if path and Path(path).is_file():
        text = Path(path).read_text(errors="replace")
    else:
        with contextlib.suppress(Exception):  # Ray could not read its own record
            text = str(trial.get_error() or "")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("Failure #")]
    flat = " ".join(lines)
    return (flat[:limit] + "...") if len(flat) > limit else (flat or "no error recorded")


class _ViewCallback(Callback):
    """Ray's trial events -> the view's table of running trials."""

    def __init__(self, view: LiveView):
        self.view = view

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.view.started(int(trial.config["trial_number"]), dict(trial.config.get("overrides", {})))

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.view.ended(int(trial.config["trial_number"]))

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.view.ended(int(trial.config["trial_number"]))

    def __reduce__(self):  # Ray pickles its run config; the view (a live console) stays here
        return (_NullCallback, ())


class _NullCallback(Callback):
    pass


class LiveView:
    """A context manager: the live display while the Tuner runs."""

    def __init__(self, run: RunDir, spec: SearchSpec, *, target: int, live: bool = True, console: Console | None = None):
        self.run, self.spec, self.target = run, spec, target
        self.console = console or Console()
        # The redrawn display needs a terminal; elsewhere (or asked not to) a line per trial.
        self.interactive = live and self.console.is_terminal
        self.running: dict[int, tuple[dict[str, Any], float]] = {}
        self.lock = threading.Lock()
        self.callback = _ViewCallback(self)
        self._live: Live | None = None
        self._announced: set[int] = set()

    def __enter__(self) -> LiveView:
        self._announced = {r.number for r in self.run.read_trials() if r.status is not None}
        if self.interactive:
            self._live = Live(console=self.console, get_renderable=self.render, refresh_per_second=1, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None
        self._announce_finished()

    def started(self, number: int, overrides: dict[str, Any]) -> None:
        with self.lock:
            self.running[number] = (overrides, time.time())

    def ended(self, number: int) -> None:
        with self.lock:
            self.running.pop(number, None)
        if not self.interactive:
            self._announce_finished()

    def _announce_finished(self) -> None:
        """Non-interactive: one line per trial that ended since the last call."""
        if self.interactive:
            return
        records = self.run.read_trials()
        trained = trained_count(records)
        for record in records:
            if record.status is None or record.number in self._announced:
                continue
            self._announced.add(record.number)
            values = ", ".join(f"{m}={number(record.metrics.get(m))}" for m in self.spec.metric_names
                               if isinstance(record.metrics.get(m), (int, float)))
            why = f" ({record.reason})" if record.reason else ""
            self.console.print(f"trial {record.number}: {record.status}{why} {values}  [{trained}/{self.target} trained]",
                               markup=False, highlight=False, soft_wrap=True)

    def render(self) -> Group:
        records = self.run.read_trials()
        trained = trained_count(records)
        with self.lock:
            items = sorted(self.running.items())
        # The running count is the table's below (Ray's events), not the trial files: a
        # trial Ray has started may not have written its trial.json yet.
        header = Text(f"search {self.spec.name}: {trained}/{self.target} trained — {counts_line(records, running=len(items))}",
                      style="bold")
        running = Table(title=f"running ({len(items)})", title_justify="left")
        running.add_column("trial", justify="right")
        running.add_column("overrides")
        running.add_column("time", justify="right")
        now = time.time()
        for trial_number, (overrides, started) in items:
            short = short_fields(list(overrides))
            shown = ", ".join(f"{short[k]}={override_value(v)}" for k, v in overrides.items())
            running.add_row(str(trial_number), shown, f"{now - started:.0f} s")
        front = front_of(records, self.spec.objectives)
        parts: list[Any] = [header, running]
        if front:
            title = f"current front ({len(front)} trials{', first ' + str(MAX_FRONT_ROWS) if len(front) > MAX_FRONT_ROWS else ''})"
            parts.append(front_table(front[:MAX_FRONT_ROWS], self.spec.objectives, title=title))
        return Group(*parts)
