"""When Ray placed, started and finished each trial, as the driver saw it.

A trial's record (`result.json`) holds the time its worker spent on it (`started_at` to
`finished_at`: building, training, evaluating, writing). What the search costs beside
that (Ray placing the trial, starting its worker process, carrying its result back) shows
only from the driver: `TrialTimes` writes, per session, `DIR/ray/session-NNN/trial_times.json`

    {"7": {"added_at": ..., "started_at": ..., "finished_at": ...}, ...}

(seconds since the epoch; `added_at` when Ray took the proposal (to the controller's step), `started_at` when its
worker was up, `finished_at` when Ray heard it ended), rewritten atomically as trials
end. `benchmarks/search_gpu.py` reads it for Ray's overhead per trial.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from ray.tune import Callback

from archspec.atomic import write_text_atomic

TRIAL_TIMES_FILE = "trial_times.json"


class TrialTimes(Callback):
    """Ray's trial events -> `trial_times.json` in the session's folder."""

    def __init__(self, session_dir: Path):
        self.path = Path(session_dir) / TRIAL_TIMES_FILE
        self.times: dict[str, dict[str, float]] = {}
        self.lock = threading.Lock()

    def __reduce__(self):  # Ray pickles its run config; the lock stays here
        return (TrialTimes, (self.path.parent,))

    def _mark(self, trial: Any, event: str, write: bool = False) -> None:
        number = str(int(trial.config["trial_number"]))
        with self.lock:
            self.times.setdefault(number, {})[event] = time.time()
            if write:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                write_text_atomic(self.path, json.dumps(self.times, indent=1, sort_keys=True) + "\n")

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        # Ray's callbacks hear of no new trial before its worker is up: a trial first
        # seen at the end of the controller's step (every few ms) was added in it.
        for trial in trials:
            number = str(int(trial.config.get("trial_number", -1)))
            if number not in self.times and number != "-1":
                self._mark(trial, "added_at")

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._mark(trial, "started_at")
        with self.lock:  # added and started within one step: it was added no later
            entry = self.times[str(int(trial.config["trial_number"]))]
            entry.setdefault("added_at", entry["started_at"])

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._mark(trial, "finished_at", write=True)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._mark(trial, "finished_at", write=True)


def read_trial_times(run_ray_dir: Path) -> dict[int, dict[str, float]]:
    """Every session's `trial_times.json` under `DIR/ray`, by trial number (a later session's
    entry for a trial, run again after a crash, replaces the earlier one)."""
    merged: dict[int, dict[str, float]] = {}
    for file in sorted(Path(run_ray_dir).glob(f"session-*/{TRIAL_TIMES_FILE}")):
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError):
            continue  # written atomically: only a foreign file is unreadable; it times nothing
        if isinstance(data, dict):
            merged.update({int(k): v for k, v in data.items() if str(k).isdigit() and isinstance(v, dict)})
    return merged
