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
  lock               held (flock) by the search that writes here: its pid and host
```

The files, not the study, are the record of truth: `result.json` is written atomically
before Ray hears of the result, so a search killed at any moment loses at most the
trials that were still running. Readers (`archspec pareto`, the live view) only read
files, which is why they work on a search that is still running.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from archspec.atomic import write_text_atomic
from archspec.errors import ArchspecError

SEARCH_FILE = "search.yaml"
BASE_FILE = "base.yaml"
STUDY_FILE = "study.db"
# The study in study.db is named after the search; runs made before it was carry the one
# study named this, and keep it.
LEGACY_STUDY_NAME = "archspec"
TRIALS_DIR = "trials"
RAY_DIR = "ray"
TRIAL_START_FILE = "trial.json"
TRIAL_SPEC_FILE = "spec.yaml"
TRIAL_RESULT_FILE = "result.json"
LOCK_FILE = "lock"

# Trial statuses. `ok`, `failed` and `diverged` trials were trained and count against the
# budget, and so do `stopped` ones (a scheduler such as ASHA ended them early from their
# validation results; their metrics are the last validation's); `skipped` (a constraint failed on the cost model) and `invalid` (the sampled
# spec was refused) never reached training; `interrupted` trials were cut off by a crash
# or Ctrl-C and are tried again on --resume. (Proposals that repeat a trial are kept in
# the study only, as pruned trials: see `searcher.py`.)
OK = "ok"
FAILED = "failed"
DIVERGED = "diverged"
SKIPPED = "skipped"
INVALID = "invalid"
INTERRUPTED = "interrupted"
STOPPED = "stopped"
TRAINED_STATUSES = (OK, FAILED, DIVERGED, STOPPED)
STATUSES = (OK, FAILED, DIVERGED, STOPPED, SKIPPED, INVALID, INTERRUPTED)


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
    def from_json(cls, data: Any) -> TrialRecord:
        """The record `to_json` wrote; a ValueError says what is wrong with anything else."""
        problem = record_problem(data)
        if problem:
            raise ValueError(problem)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# What each field of a record may hold (beside None where the field allows it).
_RECORD_FIELDS: dict[str, tuple[str, Any]] = {
    "reason": ("a string", lambda v: isinstance(v, str)),
    "started_at": ("a number (seconds since the epoch)", _is_number),
    "finished_at": ("a number (seconds since the epoch)", _is_number),
    "host": ("a string", lambda v: isinstance(v, str)),
    "device": ("a string", lambda v: isinstance(v, str)),
    "pid": ("a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool)),
}


def record_problem(data: Any) -> str | None:
    """Why `data` is not a trial record as `TrialRecord.to_json` writes it, or None."""
    if not isinstance(data, dict):
        return f"holds {type(data).__name__ if data is not None else 'null'}, not a trial record (a JSON object)"
    number = data.get("number")
    if "number" not in data or not isinstance(number, int) or isinstance(number, bool) or number < 0:
        return f"`number` must be the trial's number (a whole number >= 0), got {number!r}" if "number" in data else "has no `number`"
    if "status" not in data:
        return "has no `status`"
    if data["status"] is not None and data["status"] not in STATUSES:
        return f"`status` is {data['status']!r}, not one of {', '.join(STATUSES)}"
    for name in ("overrides", "metrics", "placement"):
        value = data.get(name, {})
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            return f"`{name}` must be an object with string keys, got {type(value).__name__}"
    bad = [k for k, v in data.get("metrics", {}).items() if v is not None and not _is_number(v)]
    if bad:
        return f"metric {bad[0]!r} is {data['metrics'][bad[0]]!r}, not a number"
    for name, (kind, ok) in _RECORD_FIELDS.items():
        value = data.get(name)
        if value is not None and not ok(value):
            return f"`{name}` must be {kind} or null, got {value!r}"
    return None


class RunDirError(ArchspecError):
    """A run directory that cannot be read or written as it is; says which file and why."""


class TrialFolderTaken(RunDirError):
    """A trial folder that holds another point's trial: nothing is written into it."""


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
        self._claim(record)
        write_json_atomic(self.trial_dir(record.number) / TRIAL_START_FILE, record.to_json())

    def write_trial_result(self, record: TrialRecord) -> None:
        self._claim(record)
        write_json_atomic(self.trial_dir(record.number) / TRIAL_RESULT_FILE, record.to_json())

    def occupant(self, number: int, overrides: dict[str, Any]) -> str | None:
        """Why trial `number` with `overrides` may not write into its folder (the folder
        holds another point's trial), or None."""
        try:
            existing = self.read_trial(number)
        except RunDirError as exc:
            return str(exc)
        if existing is None or _same_point(existing.overrides, overrides):
            return None
        state = f"the result ({existing.status})" if existing.status else "the start record"
        return (f"{self.trial_dir(number)} already holds {state} of a trial of another point "
                f"({_point(existing.overrides)}, not {_point(overrides)}): two searches, or a study.db "
                "that does not belong to these trials, gave out the same trial number")

    def _claim(self, record: TrialRecord) -> None:
        reason = self.occupant(record.number, record.overrides)
        if reason:
            raise TrialFolderTaken(f"trial {record.number} was not written", [(None, None, reason)])

    def read_trial(self, number: int) -> TrialRecord | None:
        """The trial's result if it ended, else its start record, else None. A file that
        is not a trial record raises `RunDirError` naming it (files here are written
        atomically, so a broken one was not written by a search)."""
        folder = self.trial_dir(number)
        for name in (TRIAL_RESULT_FILE, TRIAL_START_FILE):
            file = folder / name
            if not (file.exists() or file.is_symlink()):
                continue
            record = _read_record(file)
            if record.number != number:
                raise RunDirError(f"{file}: not this folder's trial",
                                  [(None, None, f"{file}: it records trial {record.number}, its folder is trial {number}")])
            if name == TRIAL_START_FILE:
                record.status = None
            return record
        return None

    def read_trials(self) -> list[TrialRecord]:
        """Every trial recorded so far, by number; every unreadable record is reported at once."""
        if not self.trials_dir.is_dir():
            if self.trials_dir.exists():
                raise RunDirError(f"{self.trials_dir}: not a directory", [(None, None, "a run directory keeps its trials in this folder")])
            return []
        records, problems = [], []
        for folder in sorted(self.trials_dir.iterdir()):
            if folder.is_dir() and folder.name.isdigit():
                try:
                    record = self.read_trial(int(folder.name))
                except RunDirError as exc:
                    problems += exc.problems or [(None, None, str(exc))]
                    continue
                if record is not None:
                    records.append(record)
        if problems:
            raise RunDirError(f"{self.path}: {len(problems)} trial record(s) cannot be read", problems)
        return records


def _read_record(file: Path) -> TrialRecord:
    from archspec.spec.yaml_source import unreadable_reason

    where = [(None, None, "")]
    reason = unreadable_reason(file, what="trial record")
    if reason is None:
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            reason = f"not UTF-8 text (byte {exc.start})"
        except json.JSONDecodeError as exc:
            reason = f"not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); a truncated or hand-edited file"
        except OSError as exc:
            reason = f"cannot read: {exc.strerror or exc}"
        else:
            try:
                return TrialRecord.from_json(data)
            except ValueError as exc:
                reason = str(exc)
    where[0] = (None, None, f"{file}: {reason}")
    raise RunDirError(f"{file}: not a trial record", where)


def _same_point(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return json.dumps(_jsonable(a), sort_keys=True) == json.dumps(_jsonable(b), sort_keys=True)


def _point(overrides: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={v}" for k, v in overrides.items()) or "the base spec"
    return text if len(text) <= 120 else text[:117] + "..."


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


class RunLock:
    """An exclusive lock on a run directory: one search writes there at a time.

    `flock` on `DIR/lock`: the kernel releases it when the holding process ends, however
    it ends (`kill -9` included), so a lock is never left behind. A second search is
    refused with the holder's pid and host, which the holder writes into the file. The
    lock file stays (it holds no data); one this lock created, with the directory it
    created, is removed again by `release(remove=True)` when a refused search leaves,
    so that a refusal changes nothing.
    """

    def __init__(self, run_path: str | os.PathLike[str]):
        self.dir = Path(run_path)
        self.file = self.dir / LOCK_FILE
        self._fd: int | None = None
        self.created_dir = False
        self.created_file = False  # no lock file was there: a search that writes nothing removes it again
        self.wrote = False  # set by the holder once it has written into the directory

    def acquire(self, origin: str | None = None) -> RunLock:
        from archspec.errors import Location

        where = Location(origin=origin) if origin else None
        self._make_dir(where)
        self.created_file = not os.path.lexists(self.file)
        while True:
            try:
                fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            except OSError as exc:
                raise RunDirError(f"cannot lock {self.dir}", [(where, None, f"{self.file}: {exc.strerror or exc}")]) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirError(f"{self.dir} is in use by another search", [(where, None, self._holder_text())]) from None
            # A holder that was refused removes the file it created: if it did so between
            # our open and our lock, the lock is on a file nobody else will see. Retry.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.file).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        os.ftruncate(fd, 0)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.write(fd, (json.dumps(holder) + "\n").encode())
        return self

    def _make_dir(self, where: Any) -> None:
        if self.dir.exists() and not self.dir.is_dir():
            raise RunDirError(f"{self.dir} is a file, not a run directory",
                              [(where, None, "give --out a directory (new or empty to start, a run to resume)")])
        if not self.dir.exists():
            try:
                self.dir.mkdir(parents=True)
            except FileExistsError:
                pass  # another search made it a moment ago: the lock decides
            except OSError as exc:
                raise RunDirError(f"cannot create {self.dir}", [(where, None, exc.strerror or str(exc))]) from None
            else:
                self.created_dir = True

    def _holder_text(self) -> str:
        for _ in range(20):  # the holder writes its name just after it takes the lock
            try:
                holder = json.loads(self.file.read_text())
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
                return (f"held by pid {holder['pid']} on {holder['host']} since {since}; wait for that search to end "
                        "or stop it (the lock ends with its process), or choose another --out")
            except (OSError, ValueError, KeyError, TypeError):
                time.sleep(0.05)
        return "held by another process (it has not written its pid yet); choose another --out"

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, *, remove: bool = False) -> None:
        """Give the lock up; with `remove`, also the lock file, and the directory if this
        lock created it and nothing else is in it (a refused search leaves no trace)."""
        if self._fd is None:
            return
        if remove:
            self.file.unlink(missing_ok=True)  # before unlocking: a waiting opener retries (see acquire)
        os.close(self._fd)
        self._fd = None
        if remove and self.created_dir:
            try:
                self.dir.rmdir()
            except OSError:
                pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def study_name_for(existing: list[str], search_name: str) -> str:
    """The name of a run's study among the names study.db holds: the search's own, or in a
    run made before studies were named after their search, `LEGACY_STUDY_NAME`."""
    if search_name not in existing and existing == [LEGACY_STUDY_NAME]:
        return LEGACY_STUDY_NAME
    return search_name
