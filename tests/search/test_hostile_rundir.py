"""Run directories as a user may leave them: trial records of the wrong shape, a
truncated search.yaml, a damaged or foreign study.db, --plot onto a directory, --out
naming a file, two searches on one directory, a trial number given out twice, Ray
processes left by a killed search. Each ends in a clear message (exit 2) or is handled;
a refused resume changes nothing. No Ray here: the run directories are written by the
runner's own functions up to the point where Ray would start."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

# The search runs through Ray; without it (the GPU machine) this module is skipped whole.
pytest.importorskip("ray.tune")

from archspec.search.cli import main
from archspec.search.live import RecordingCallback
from archspec.search.rundir import LOCK_FILE, RunDir, RunDirError, RunLock, TrialFolderTaken, TrialRecord
from archspec.search.runner import open_study, resolve_run, write_run
from archspec.search.space import load_search_spec
from archspec.search.trial import TrialSetup, execute_trial, report_payload

pytestmark = pytest.mark.ray  # starts Ray: runs on one xdist worker (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "specs" / "search" / "bases" / "tiny-deltanet.yaml"
PYTHON = sys.executable

SPEC = f"""\
name: t
base: {TINY}
space:
  mixer.transition.n_h: {{int: [1, 4]}}
  model.d_model: {{choices: [32, 48, 64]}}
task: {{name: s3, options: {{train_len: 8, eval_size: 64}}}}
objectives:
  - token_acc@16: max
  - params: min
budget: {{trials: 6, steps: 3}}
sampler: random
resources: {{cpu: 1}}
"""

optuna.logging.set_verbosity(optuna.logging.WARNING)


def started_run(tmp_path: Path, trials: int = 3) -> RunDir:
    """A run directory as a search leaves it after `trials` finished trials (and the
    search spec it started from, beside it)."""
    spec_file = tmp_path / "search.yaml"
    spec_file.write_text(SPEC)
    plan = resolve_run(tmp_path / "run", load_search_spec(spec_file), resume=False, trials=None)
    loaded = write_run(plan)
    run = plan.run
    study = open_study(run, loaded.spec, optuna.samplers.RandomSampler(seed=0)).study
    for number in range(trials):
        trial = study.ask()
        overrides = {"mixer.transition.n_h": number + 1, "model.d_model": 32}
        trial.set_user_attr("overrides", overrides)
        run.write_trial_result(TrialRecord(number=trial.number, status="ok", overrides=overrides,
                                           metrics={"token_acc@16": 0.5 + 0.1 * number, "params": 1000.0 + number},
                                           started_at=1.0, finished_at=2.0))
        study.tell(trial, [0.5 + 0.1 * number, 1000.0 + number])
    return run


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return started_run(tmp_path_factory.mktemp("template")).path.parent


@pytest.fixture
def run(tmp_path: Path, template: Path) -> RunDir:
    """A copy of the started run (an Optuna study takes a second to create)."""
    shutil.copytree(template, tmp_path, dirs_exist_ok=True)
    return RunDir(tmp_path / "run")


def snapshot(path: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `path` with its bytes and modification time."""
    return {str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(path.rglob("*")) if p.is_file()}


def resume(run: RunDir, *extra: str) -> int:
    return main(["search", "--resume", "--out", str(run.path), "--no-live", *extra])


# ------------------------------------------------------------------ trial records


BAD_RECORDS = {
    "a list": ("[1, 2, 3]", "holds list, not a trial record"),
    "a string": ('"ok"', "holds str, not a trial record"),
    "null": ("null", "holds null"),
    "no number": ('{"status": "ok", "metrics": {}}', "has no `number`"),
    "no status": ('{"number": 1, "metrics": {}}', "has no `status`"),
    "unknown status": ('{"number": 1, "status": "great"}', "`status` is 'great', not one of ok, failed"),
    "metric as text": ('{"number": 1, "status": "ok", "metrics": {"params": "many"}}', "metric 'params' is 'many', not a number"),
    "metrics a list": ('{"number": 1, "status": "ok", "metrics": [1, 2]}', "`metrics` must be an object"),
    "number as text": ('{"number": "1", "status": "ok"}', "`number` must be the trial's number"),
    "another trial": ('{"number": 7, "status": "ok"}', "it records trial 7, its folder is trial 1"),
    "truncated": ('{"number": 1, "sta', "not JSON (line 1, column"),
    "not text": (b"\xff\xfe\x00garbage", "not UTF-8 text"),
    "boolean time": ('{"number": 1, "status": "ok", "started_at": true}', "`started_at` must be a number"),
}


@pytest.mark.parametrize("name", list(BAD_RECORDS))
def test_a_record_of_the_wrong_shape_is_named_not_a_traceback(tmp_path, run, capsys, name):
    content, words = BAD_RECORDS[name]
    file = run.trial_dir(1) / "result.json"
    file.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["pareto", str(run.path)]) == 2
    err = capsys.readouterr().err
    assert f"{file}: " in err and words in err and "Traceback" not in err, err
    before = snapshot(run.path)
    assert resume(run, "--trials", "9") == 2
    err = capsys.readouterr().err
    assert f"cannot resume {run.path}: nothing was changed" in err and words in err
    assert snapshot(run.path) == before  # search.yaml keeps its trial count; nothing was added


def test_every_bad_record_is_listed_at_once(tmp_path, run):
    (run.trial_dir(0) / "result.json").write_text("[]")
    (run.trial_dir(2) / "result.json").write_text("{}")
    (run.trial_dir(2) / "trial.json").write_text("{}")  # the result is read first; its start record is not needed
    with pytest.raises(RunDirError) as info:
        run.read_trials()
    assert len(info.value.problems) == 2 and "2 trial record(s) cannot be read" in str(info.value)


# ------------------------------------------------------------------ search.yaml


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.9])
def test_a_truncated_search_yaml_is_located_and_a_resume_changes_nothing(tmp_path, run, capsys, cut):
    text = run.search_file.read_text()
    run.search_file.write_text(text[: int(len(text) * cut)])
    assert main(["pareto", str(run.path)]) == 2
    err = capsys.readouterr().err
    assert str(run.search_file) in err and "Traceback" not in err
    before = snapshot(run.path)
    assert resume(run, "--trials", "9") == 2
    err = capsys.readouterr().err
    assert str(run.search_file) in err and "Traceback" not in err
    assert snapshot(run.path) == before


# ------------------------------------------------------------------ study.db


def _damage_half(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _foreign_sqlite(file: Path) -> None:
    import sqlite3

    file.unlink()
    with sqlite3.connect(file) as db:
        db.execute("CREATE TABLE notes (x TEXT)")


def _other_directions(file: Path) -> None:
    file.unlink()
    optuna.create_study(study_name="archspec", storage=f"sqlite:///{file}", directions=["minimize", "minimize"])


def _fresh_study(file: Path) -> None:  # a study that never heard of these trials
    file.unlink()
    optuna.create_study(study_name="archspec", storage=f"sqlite:///{file}", directions=["maximize", "minimize"])


def _other_name(file: Path) -> None:
    file.unlink()
    optuna.create_study(study_name="someone-else", storage=f"sqlite:///{file}", directions=["maximize", "minimize"])


STUDY_DAMAGE = {
    "garbage": (lambda f: f.write_bytes(os.urandom(4096)), "not a SQLite database"),
    "cut in half": (_damage_half, f"study.db: "),
    "empty": (lambda f: f.write_bytes(b""), "not an Optuna study"),
    "a directory": (lambda f: (f.unlink(), f.mkdir()), "is a directory"),
    "missing": (lambda f: f.unlink(), "study.db is missing, but"),
    "another database": (_foreign_sqlite, "not an Optuna study"),
    "other objectives": (_other_directions, "the study optimises ['minimize', 'minimize']"),
    "another study": (_fresh_study, "trial 0 is not in"),
    "another name": (_other_name, "holds no study named 't'"),  # the study is named after the search
}


@pytest.mark.parametrize("name", list(STUDY_DAMAGE))
def test_a_bad_study_is_refused_before_the_resume_changes_anything(tmp_path, run, capsys, name):
    damage, words = STUDY_DAMAGE[name]
    damage(run.study_file)
    before = snapshot(run.path)
    assert resume(run, "--trials", "9") == 2
    err = capsys.readouterr().err
    assert f"cannot resume {run.path}: nothing was changed" in err and words in err and "Traceback" not in err, err
    assert snapshot(run.path) == before
    assert not (run.path / LOCK_FILE).exists() or (run.path / LOCK_FILE).read_text()  # the lock file holds no data


def test_a_point_that_disagrees_with_the_study_is_refused(tmp_path, run, capsys):
    record = run.read_trial(1)
    record.overrides = {"mixer.transition.n_h": 4, "model.d_model": 64}
    (run.trial_dir(1) / "result.json").write_text(json.dumps(record.to_json()))
    assert resume(run) == 2
    assert "the study's trial 1 is another point" in capsys.readouterr().err


# ------------------------------------------------------------------ --out and --plot


def test_out_naming_a_file_is_refused_and_the_file_kept(tmp_path, capsys):
    (tmp_path / "search.yaml").write_text(SPEC)
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    assert main(["search", str(tmp_path / "search.yaml"), "--out", str(target), "--no-live"]) == 2
    assert f"{target} is a file, not a run directory" in capsys.readouterr().err
    assert resume(RunDir(target)) == 2
    assert f"{target} is a file" in capsys.readouterr().err
    assert target.read_text() == "mine"
    assert main(["search", str(tmp_path / "search.yaml"), "--out", str(target / "sub"), "--no-live"]) == 2
    assert "cannot create" in capsys.readouterr().err


def test_plot_onto_a_directory_or_nowhere_is_refused_before_reading(tmp_path, run, capsys):
    for plot, words in ((tmp_path, "is a directory; give a file name"), (tmp_path / "no" / "f.png", "no folder")):
        assert main(["pareto", str(run.path), "--plot", str(plot)]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err
    assert main(["pareto", str(run.path), "--plot", str(tmp_path / "front.png")]) == 0
    assert (tmp_path / "front.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------ the lock


HOLDER = """\
import sys, time
from archspec.search.rundir import RunLock
RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_writer_is_refused_with_the_holders_pid_and_host_until_it_dies(tmp_path, run, capsys):
    holder = subprocess.Popen([PYTHON, "-c", HOLDER, str(run.path)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(run.path)
        assert resume(run) == 2
        err = capsys.readouterr().err
        assert f"{run.path} is in use by another search" in err
        assert f"held by pid {holder.pid} on {socket.gethostname()}" in err
        assert snapshot(run.path) == before
        with pytest.raises(RunDirError, match="in use by another search"):
            RunLock(run.path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)  # the kernel releases the lock with the process
        holder.wait()
    with RunLock(run.path) as lock:
        assert lock.held and json.loads((run.path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_two_locks_in_one_process_exclude_each_other_and_a_refused_start_leaves_nothing(tmp_path, capsys):
    out = tmp_path / "new"
    first = RunLock(out).acquire()
    try:
        assert first.created_dir
        with pytest.raises(RunDirError, match=f"held by pid {os.getpid()}"):
            RunLock(out).acquire()
    finally:
        first.release(remove=True)
    assert not out.exists()
    # a search refused after taking the lock (here: its resources) leaves no directory behind
    (tmp_path / "search.yaml").write_text(SPEC.replace("resources: {cpu: 1}", "resources: {cpu: 1, gpu: -1}"))
    assert main(["search", str(tmp_path / "search.yaml"), "--out", str(out), "--no-live"]) == 2
    assert not out.exists()


def test_a_symlinked_lock_file_is_not_followed(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (out / LOCK_FILE).symlink_to(victim)
    with pytest.raises(RunDirError, match="cannot lock"):
        RunLock(out).acquire()
    assert victim.read_text() == "keep"


# ------------------------------------------------------------------ trial folders


def test_a_trial_never_writes_into_a_folder_that_holds_another_point(tmp_path, run):
    theirs = run.read_trial(1)
    search = load_search_spec(tmp_path / "search.yaml").spec
    setup = TrialSetup(run_dir=str(run.path), search=search, train_fn=lambda *a, **k: pytest.fail("trained"))
    mine = {"mixer.transition.n_h": 4, "model.d_model": 64}
    before = snapshot(run.path)

    record = execute_trial(setup, 1, mine)
    assert record.status == "failed" and "already holds the result (ok) of a trial of another point" in record.reason
    with pytest.raises(TrialFolderTaken):
        run.write_trial_start(TrialRecord(number=1, status=None, overrides=mine))
    with pytest.raises(TrialFolderTaken):
        run.write_trial_result(TrialRecord(number=1, status="failed", overrides=mine))
    callback = RecordingCallback(run)
    callback.on_trial_result(0, [], None, report_payload(TrialRecord(number=1, status="ok", overrides=mine), search.metric_names))

    class Errored:
        config = {"trial_number": 1, "overrides": mine}

    callback.on_trial_error(0, [], Errored())
    assert snapshot(run.path) == before and run.read_trial(1).to_json() == theirs.to_json()
    # the same point may write its own folder again (the driver completing a worker's result)
    run.write_trial_result(theirs)


# ------------------------------------------------------------------ Ray left behind


AGENT = """\
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)        # as Ray's agents do
log = open(sys.argv[1], "a")                          # an agent holds its log open
print("ready", flush=True)
time.sleep(300)
"""


def _agent(log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([PYTHON, "-c", AGENT, str(log)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_processes_of_a_killed_search_are_stopped_and_no_other(tmp_path, monkeypatch, capsys):
    import tempfile

    from archspec.search.leftovers import DRIVER_FILE, process_start
    from archspec.search.runner import RAY_DIR_PREFIX, remove_stale_ray_dirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead_driver = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(60)"])
    time.sleep(0.2)
    dead_record = {"pid": dead_driver.pid, "started": process_start(dead_driver.pid)}
    dead_driver.kill()
    dead_driver.wait()

    dead = tmp_path / f"{RAY_DIR_PREFIX}dead"
    live = tmp_path / f"{RAY_DIR_PREFIX}live"
    for session, driver in ((dead, dead_record), (live, {"pid": os.getpid(), "started": process_start(os.getpid())})):
        (session / "logs").mkdir(parents=True)
        (session / DRIVER_FILE).write_text(json.dumps(driver))
    orphans = [_agent(dead / "logs" / f"agent{i}.log") for i in range(2)]
    alive = _agent(live / "logs" / "agent.log")
    bystander = _agent(tmp_path / "elsewhere.log")
    try:
        removed = remove_stale_ray_dirs()
        assert removed == [dead] and not dead.exists() and live.exists()
        for proc in orphans:
            assert proc.wait(timeout=10) == -signal.SIGKILL  # SIGTERM is ignored: killed outright
        assert alive.poll() is None and bystander.poll() is None
        note = capsys.readouterr().err
        assert f"note: stopped 2 Ray process(es) left running by a killed search" in note and str(dead) in note
    finally:
        for proc in (*orphans, alive, bystander):
            proc.kill()
            proc.wait()


LATE_AGENT = """\
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(float(sys.argv[2]))                        # still starting when the session is first looked at
log = open(sys.argv[1], "a")
time.sleep(300)
"""


def test_a_process_that_opens_its_log_after_the_first_look_is_stopped_too(tmp_path, monkeypatch):
    """A killed search's Ray may still be starting a process when the next search looks:
    it holds nothing in the session yet. The look is repeated until two looks in a row
    find nothing, so that process is stopped as well."""
    from archspec.search import leftovers

    monkeypatch.setattr(leftovers, "RESCAN_AFTER_S", 1.0)  # the look after the process opened its log
    (tmp_path / "logs").mkdir()
    late = subprocess.Popen([PYTHON, "-c", LATE_AGENT, str(tmp_path / "logs" / "late.log"), "0.2"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert late.stdout.readline().strip() == "ready"
        assert leftovers.session_processes(tmp_path) == []  # nothing held yet
        assert leftovers.kill_session_processes(tmp_path) == [late.pid]
        assert late.wait(timeout=10) == -signal.SIGKILL
    finally:
        late.kill()
        late.wait()


# ------------------------------------------------------------------ experiment directories


@pytest.mark.parametrize("content, words", [
    ('{"status": "ok", "metr', "not a metrics file the trainer wrote"),
    ("[1, 2]", "(list)"),
    ('{"status": "ok", "metrics": [0.5]}', "`metrics` of the wrong type"),
])
def test_a_broken_metrics_file_in_an_experiment_is_named(tmp_path, capsys, content, words):
    import yaml

    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump({
        "name": "tiny", "task": {"name": "s3", "options": {"train_len": 4, "eval_size": 8}},
        "train": {"steps": 1, "batch_size": 2, "measure_throughput": False},
        "seeds": [0], "runs": [{"name": "dn", "spec": str(REPO / "specs" / "models" / "deltanet.yaml")}], "report": ["token_acc@4"],
    }))
    broken = tmp_path / "out" / "dn" / "s0" / "metrics.json"
    broken.parent.mkdir(parents=True)
    broken.write_text(content)
    assert main(["experiment", str(exp), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{broken}: " in err and words in err and "delete it to train that run again" in err and "Traceback" not in err


def test_a_write_cut_off_by_a_kill_is_rolled_back_not_called_damage(tmp_path):
    """kill -9 in the middle of a study write leaves SQLite's rollback journal hot, and a
    read-only connection refuses such a database ("attempt to write a readonly
    database"): the resume check lets SQLite roll it back and finds the last committed
    study, untouched, instead of refusing it as damaged."""
    import sqlite3
    import subprocess
    import sys

    from archspec.search.runcheck import _sqlite_problem

    file = tmp_path / "study.db"
    study = optuna.create_study(study_name="t", storage=f"sqlite:///{file}", directions=["maximize", "minimize"])
    study.add_trial(optuna.trial.create_trial(values=[0.5, 10.0]))
    # a writer that dies mid-transaction: its cache is too small to hold the changes, so
    # they reach the database file, with the original pages in the journal
    crash = f"""
import os, sqlite3
db = sqlite3.connect({str(file)!r}, isolation_level=None)
db.execute("PRAGMA cache_size=1")
db.execute("BEGIN IMMEDIATE")
db.execute("CREATE TABLE filler (x BLOB)")
for _ in range(64):
    db.execute("INSERT INTO filler VALUES (randomblob(4096))")
db.execute("UPDATE trials SET state = 'FAIL'")
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", crash], check=True)
    journal = file.with_name("study.db-journal")
    assert journal.exists() and journal.stat().st_size > 0
    with pytest.raises(sqlite3.OperationalError, match="readonly"):  # what the check met before
        with sqlite3.connect(f"{file.as_uri()}?mode=ro", uri=True) as db:
            db.execute("PRAGMA quick_check").fetchone()
    assert _sqlite_problem(file) is None
    with sqlite3.connect(file) as db:
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        states = [state for (state,) in db.execute("SELECT state FROM trials")]
    assert "filler" not in tables and states == ["COMPLETE"]  # the last committed study
