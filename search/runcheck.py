"""Before a resumed search changes anything: everything it will touch is read and checked.

A resume rewrites `search.yaml` (a new trial count), tells the study about trials that
finished unheard, marks cut-off trials `interrupted` and adds trials. Done halfway on a
broken directory, that leaves it worse than it was; so `check_resumable` reads it all
first and refuses with every problem found, naming each file:

- every trial record parses and is a record of its folder's trial (`RunDir.read_trials`);
- `study.db` is a regular file, an intact SQLite database (`PRAGMA quick_check`, opened
  read-only, after SQLite's own recovery of a write a kill cut off: `_roll_back_cut_write`),
  an Optuna storage holding the search's study (named after it, or
  `archspec` in runs made before) with its objectives, and it knows every trial the files record, each with the same point;
- `trials/` and `ray/` are directories where they exist.

`search.yaml` and `base.yaml` are checked by loading them (`space.load_search_spec`).
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from archspec.errors import ArchspecError
from archspec.search.rundir import RunDir, TrialRecord, study_name_for
from archspec.search.space import SearchSpec
from archspec.spec.yaml_source import unreadable_reason

Problem = tuple[None, None, str]


def check_resumable(run: RunDir, spec: SearchSpec) -> list[TrialRecord]:
    """Raise one `ArchspecError` with every reason `run` cannot be resumed; returns its trials."""
    problems: list[Problem] = []
    for folder in (run.trials_dir, run.ray_dir):
        if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
            problems.append((None, None, f"{folder}: not a directory"))
    records: list[TrialRecord] = []
    try:
        records = run.read_trials()
    except ArchspecError as exc:
        problems += exc.problems or [(None, None, str(exc))]
    problems += study_problems(run, spec, records)
    if problems:
        raise ArchspecError(f"cannot resume {run.path}: nothing was changed ({len(problems)} problem"
                            f"{'s' if len(problems) != 1 else ''})", problems)
    return records


def study_problems(run: RunDir, spec: SearchSpec, records: list[TrialRecord]) -> list[Problem]:
    file = run.study_file
    if not (file.exists() or file.is_symlink()):
        if records:
            return [(None, None, f"{file} is missing, but {run.trials_dir} holds {len(records)} trial(s): the study "
                     "is the other half of the record; restore it, or start a new search in another directory")]
        return []  # a search killed before it opened the study
    reason = unreadable_reason(file, what="study database")
    if reason is None:
        reason = _sqlite_problem(file)
    if reason:
        return [(None, None, f"{file}: {reason}")]
    try:
        trials, directions = _study_contents(run, spec.name)
    except Exception as exc:  # noqa: BLE001 (Optuna and SQLAlchemy raise many types for a database they cannot use)
        return [(None, None, f"{file}: Optuna cannot read it ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")]
    if trials is None:
        return [(None, None, f"{file}: holds no study named {spec.name!r}; it is not this search's study")]
    problems: list[Problem] = []
    wanted = ["maximize" if o.maximise else "minimize" for o in spec.objectives]
    if directions != wanted:
        problems.append((None, None, f"{file}: the study optimises {directions}, the search {wanted} "
                         f"({', '.join(spec.metric_names)}); it is not this search's study"))
    for record in records:
        if record.number not in trials:
            problems.append((None, None, f"{run.trial_dir(record.number)}: trial {record.number} is not in {file} "
                             f"(which has {len(trials)} trials): the study does not belong to these trial files"))
            continue
        known = trials[record.number]
        if known is not None and record.overrides and _key(known) != _key(record.overrides):
            problems.append((None, None, f"{run.trial_dir(record.number)}: the study's trial {record.number} is another "
                             f"point ({known}, the files say {record.overrides})"))
    return problems


def _roll_back_cut_write(file: Any) -> str | None:
    """A write cut off by a kill leaves its rollback journal (`study.db-journal`) hot, and
    a read-only connection refuses the database ("attempt to write a readonly database"):
    SQLite must first roll the journal back. One read-write read lets it, its own recovery,
    which restores the last committed state (what the resumed study's first read would do
    anyway; no committed trial is touched). Why it could not, or None."""
    if not file.with_name(file.name + "-journal").exists():
        return None
    try:
        connection = sqlite3.connect(file)
        try:
            connection.execute("SELECT count(*) FROM sqlite_master").fetchone()
        finally:
            connection.close()
    except sqlite3.Error as exc:
        return f"an interrupted write's journal could not be rolled back ({exc})"
    return None


def _sqlite_problem(file: Any) -> str | None:
    """Why `file` is not an intact SQLite database, read without changing it (beyond the
    rollback of a write a kill cut off, `_roll_back_cut_write`)."""
    reason = _roll_back_cut_write(file)
    if reason:
        return reason
    try:
        connection = sqlite3.connect(f"{file.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        return f"cannot open it as SQLite ({exc})"
    try:
        (verdict,) = connection.execute("PRAGMA quick_check").fetchone()
        if verdict != "ok":
            return f"a damaged SQLite database ({verdict})"
        tables = {name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as exc:
        return f"not a SQLite database, or a damaged one ({exc})"
    finally:
        connection.close()
    if not {"studies", "trials", "study_directions"} <= tables:
        return "a SQLite database, but not an Optuna study (no studies/trials tables)"
    return None


def _study_contents(run: RunDir, search_name: str) -> tuple[dict[int, dict[str, Any] | None] | None, list[str]]:
    """{trial number: its overrides (None if unrecorded)} and the directions, or (None, [])
    without a study of this search's name. Reads only."""
    import optuna

    storage = optuna.storages.RDBStorage(run.study_url, skip_table_creation=True)
    try:
        name = study_name_for([s.study_name for s in storage.get_all_studies()], search_name)
        if name not in [s.study_name for s in storage.get_all_studies()]:
            return None, []
        study = optuna.load_study(study_name=name, storage=storage)
        trials = {t.number: t.user_attrs.get("overrides") for t in study.get_trials(deepcopy=False)}
        return trials, [d.name.lower() for d in study.directions]
    finally:
        storage.remove_session()
        storage.engine.dispose()


def _key(overrides: dict[str, Any]) -> str:
    return json.dumps(overrides, sort_keys=True, default=str)
