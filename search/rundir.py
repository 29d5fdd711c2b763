"""The run directory of a search: its layout, atomic writes, and reading trial records.

Everything a search produces lives under one folder, so a run can be copied, resumed,
compared or opened in optuna-dashboard from that folder alone:

```
DIR/
  search.yaml        the resolved search spec (after --set / --trials); `base: base.yaml`
  base.yaml          the resolved base model spec every trial starts from
  study.db           the Optuna study (SQLite): `optuna-dashboard sqlite:///DIR/study.db`
  trials/00007/
    trial.json       written when the trial starts: number, overrides, host, start time
    spec.yaml        the trial's full model spec (base + overrides + the task's vocab)
    result.json      written once when it ends: status, reason, metrics, timings
    <task>/          whatever the trainer writes for each task (metrics.json, plots)
  ray/               Ray Tune's own experiment folders, one per (resumed) session
```

The files, not the study, are the record of truth: `result.json` is written atomically
before Ray hears of the result, so a search killed at any moment loses at most the
trials that were still running. Readers (`archspec pareto`, the live view) only read
files, which is why they work on a search that is still running.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from archspec.atomic import write_text_atomic

SEARCH_FILE = "search.yaml"
BASE_FILE = "base.yaml"
STUDY_FILE = "study.db"
STUDY_NAME = "archspec"
TRIALS_DIR = "trials"
RAY_DIR = "ray"
TRIAL_START_FILE = "trial.json"
TRIAL_SPEC_FILE = "spec.yaml"
TRIAL_RESULT_FILE = "result.json"

# Trial statuses. `ok`, `failed` and `diverged` trials were trained and count against the
# budget; `skipped` (a constraint failed on the cost model) and `invalid` (the sampled
# spec was refused) never reached training; `interrupted` trials were cut off by a crash
# or Ctrl-C and are tried again on --resume. (Proposals that repeat a trial are kept in
# the study only, as pruned trials: see `searcher.py`.)
OK = "ok"
FAILED = "failed"
DIVERGED = "diverged"
SKIPPED = "skipped"
INVALID = "invalid"
INTERRUPTED = "interrupted"
TRAINED_STATUSES = (OK, FAILED, DIVERGED)
STATUSES = (OK, FAILED, DIVERGED, SKIPPED, INVALID, INTERRUPTED)


def _jsonable(value: Any) -> Any:
    """JSON has no NaN or inf: a diverged metric is written as null, not as invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(_jsonable(data), indent=2, sort_keys=False, allow_nan=False) + "\n")


def write_yaml_atomic(path: Path, data: Any, header: str = "") -> None:
    write_text_atomic(path, header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None))


@dataclass
class TrialRecord:
    """One trial as `result.json` holds it (or, while it runs, as `trial.json` does)."""

    number: int
    status: str | None  # None: started, no result yet (running, or killed)
    overrides: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float | None] = field(default_factory=dict)
    reason: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    host: str | None = None
    device: str | None = None
    placement: dict[str, Any] = field(default_factory=dict)  # Ray node, cluster address, GPU ids
    pid: int | None = None  # the worker process on `host` (a resumed search stops one left running)

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["duration_s"] = self.duration_s
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrialRecord:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


class RunDir:
    """Paths inside one run directory, and reading its trials."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path).resolve()

    @property
    def search_file(self) -> Path:
        return self.path / SEARCH_FILE

    @property
    def base_file(self) -> Path:
        return self.path / BASE_FILE

    @property
    def study_file(self) -> Path:
        return self.path / STUDY_FILE

    @property
    def study_url(self) -> str:
        return f"sqlite:///{self.study_file}"

    @property
    def trials_dir(self) -> Path:
        return self.path / TRIALS_DIR

    @property
    def ray_dir(self) -> Path:
        return self.path / RAY_DIR

    def exists(self) -> bool:
        """Whether a search was started here (its resolved spec was written)."""
        return self.search_file.is_file()

    def trial_dir(self, number: int) -> Path:
        return self.trials_dir / f"{number:05d}"

    def write_trial_start(self, record: TrialRecord) -> None:
        write_json_atomic(self.trial_dir(record.number) / TRIAL_START_FILE, record.to_json())

    def write_trial_result(self, record: TrialRecord) -> None:
        write_json_atomic(self.trial_dir(record.number) / TRIAL_RESULT_FILE, record.to_json())

    def read_trial(self, number: int) -> TrialRecord | None:
        """The trial's result if it ended, else its start record, else None."""
        folder = self.trial_dir(number)
        for name in (TRIAL_RESULT_FILE, TRIAL_START_FILE):
            file = folder / name
            if file.is_file():
                try:
                    data = json.loads(file.read_text(encoding="utf-8"))
                except (OSError, json.JSONDecodeError):
                    continue  # not ours (atomic writes never leave a partial file)
                record = TrialRecord.from_json(data)
                if name == TRIAL_START_FILE:
                    record.status = None
                return record
        return None

    def read_trials(self) -> list[TrialRecord]:
        """Every trial recorded so far, by number."""
        if not self.trials_dir.is_dir():
            return []
        records = []
        for folder in sorted(self.trials_dir.iterdir()):
            if folder.is_dir() and folder.name.isdigit():
                record = self.read_trial(int(folder.name))
                if record is not None:
                    records.append(record)
        return records


def status_counts(records: list[TrialRecord]) -> dict[str, int]:
    """How many trials have each status; `running` counts trials with no result yet."""
    counts = {status: 0 for status in STATUSES}
    counts["running"] = 0
    for record in records:
        counts[record.status or "running"] = counts.get(record.status or "running", 0) + 1
    return counts


def trained_count(records: list[TrialRecord]) -> int:
    """Trials that ran to an end (ok, failed or diverged): what the budget counts."""
    return sum(1 for r in records if r.status in TRAINED_STATUSES)
