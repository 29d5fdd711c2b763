"""The search runner end to end, on Ray, with a cheap objective (tests/search/cheap.py):
constraints skip trials before training, failing and diverging trials are recorded and
kept off the front, a killed search resumes without redoing finished trials, and a
search joins a Ray head on loopback and places GPU trials there.

Ray costs ~4 s to start and ~3 s per trial on 2 cores: few trials, short sleeps."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import optuna
import pytest

# The search runs through Ray; without it (the GPU machine) this module is skipped whole.
cloudpickle = pytest.importorskip("ray.cloudpickle")


import tests.search.cheap as cheap
from archspec.search.cli import main
from archspec.search.pareto import nondominated_mask, read_run
from archspec.search.ray_head import free_port
from archspec.search.rundir import RunDir, TrialRecord
from archspec.search.space import load_search_spec
from archspec.search.trial import TrialSetup, compose_spec, cost_metrics, execute_trial, make_task

# Ray workers cannot import the test package: ship the cheap objective by value.
cloudpickle.register_pickle_by_value(cheap)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "specs" / "search" / "bases" / "tiny-deltanet.yaml"
PYTHON = sys.executable

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.ray]


def write_spec(tmp_path: Path, body: str, name: str = "search.yaml") -> Path:
    path = tmp_path / name
    path.write_text(f"name: t\nbase: {TINY}\n" + textwrap.dedent(body))
    return path


def params_of(tmp_path: Path, overrides: dict) -> float:
    """The cost model's parameter count of the tiny base with overrides, on S3 (vocab 6)."""
    search = load_search_spec(write_spec(tmp_path, FAILURES.format(limit=1e9), "probe.yaml")).spec
    setup = TrialSetup(run_dir=str(tmp_path / "probe"), search=search)
    RunDir(setup.run_dir).path.mkdir(exist_ok=True)
    task = make_task(search.tasks[0])
    from archspec import load_spec

    return cost_metrics(load_spec(TINY, list(overrides.items()) + [("model.vocab_size", task.vocab_size)]), gpu=False)["params"]


FAILURES = """\
space:
  mixer.transition.n_h: {{choices: [1, 2, 3]}}
  mixer.short_conv: {{choices: [4, 2, 3, 5], when: {{mixer.transition.n_h: 1}}}}
task: {{name: s3, options: {{train_len: 8, eval_size: 64}}}}
objectives:
  - token_acc@16: max
  - params: min
constraints: ["params <= {limit}"]
budget: {{trials: 10, steps: 7, time_per_trial: 30}}
sampler: grid
resources: {{cpu: 1}}
train: {{lr: 0.5}}
"""


def test_search_end_to_end_with_constraint_failure_and_divergence(tmp_path):
    """Grid of 6 points: n_h = 3 breaks the constraint (skipped, never trained); with n_h = 1,
    short_conv 2 raises, 3 diverges and 5 kills its worker; the two healthy trials form
    the front, and the search goes on past every failure."""
    limit = (params_of(tmp_path, {"mixer.transition.n_h": 2}) + params_of(tmp_path, {"mixer.transition.n_h": 3})) / 2
    path = write_spec(tmp_path, FAILURES.format(limit=limit))
    out = tmp_path / "run"
    from archspec.search.runner import run_search

    outcome = run_search(load_search_spec(path), out, train_fn=cheap.cheap_train, live=False)
    assert outcome.complete and outcome.target == 5 and outcome.trained == 5

    run = RunDir(out)
    assert run.search_file.is_file() and run.base_file.is_file() and run.study_file.is_file()
    records = {json.dumps(r.overrides, sort_keys=True): r for r in run.read_trials()}
    by = lambda **o: records[json.dumps({f"mixer.{k}": v for k, v in o.items()}, sort_keys=True)]  # noqa: E731

    skipped = by(**{"transition.n_h": 3})
    assert skipped.status == "skipped" and f"violates params <= {limit:,.0f}" in skipped.reason
    assert skipped.metrics["params"] > limit
    assert not run.trial_dir(skipped.number).joinpath("s3").exists()  # never trained

    crashed = by(**{"transition.n_h": 1, "short_conv": 2})
    assert crashed.status == "failed" and "told to crash" in crashed.reason
    assert "RuntimeError" in (run.trial_dir(crashed.number) / "error.txt").read_text()
    diverged = by(**{"transition.n_h": 1, "short_conv": 3})
    assert diverged.status == "diverged" and "nan" in diverged.reason
    died = by(**{"transition.n_h": 1, "short_conv": 5})
    assert died.status == "failed" and "Ray worker failed" in died.reason, died.reason

    ok = [by(**{"transition.n_h": 1, "short_conv": 4}), by(**{"transition.n_h": 2})]
    from archspec import load_spec

    for record in ok:
        assert record.status == "ok"
        spec = load_spec(run.trial_dir(record.number) / "spec.yaml")
        assert record.metrics["token_acc@16"] == cheap.quality(spec)  # the objective's own numbers
        calls = json.loads((run.trial_dir(record.number) / "s3" / "calls.json").read_text())
        assert calls["steps"] == 7 and calls["options"] == {"lr": 0.5, "quiet": True, "time_limit_s": 30} and calls["device"] == "cpu"

    # The study holds the same story: values for ok trials, FAIL for the rest.
    study = optuna.load_study(study_name="t", storage=run.study_url)  # named after the search
    assert study.metric_names == ["token_acc@16", "params"]  # for optuna-dashboard
    states = {t.number: t for t in study.trials}
    for record in ok:
        assert states[record.number].values == [record.metrics["token_acc@16"], record.metrics["params"]]
    for record in (skipped, crashed, diverged, died):
        assert states[record.number].state == optuna.trial.TrialState.FAIL
        assert states[record.number].user_attrs["status"] == record.status

    # Front: brute force over the ok trials; failed/diverged never enter it.
    summary = read_run(out)
    values = np.array([[r.metrics["token_acc@16"], r.metrics["params"]] for r in ok])
    expected = {r.number for r, keep in zip(ok, nondominated_mask(values, [True, False])) if keep}
    assert {r.number for r in summary.front} == expected == {r.number for r in ok}


def test_repeats_are_not_trained_and_the_search_ends_when_the_space_is_exhausted(tmp_path):
    """A space of two points and a budget of five: two trials train, repeats are told to
    the study as pruned (no trial directory), and the search ends as exhausted. One trial
    at a time, both trials train in the same Ray worker (reused, not started again)."""
    body = """\
    space:
      mixer.transition.n_h: {choices: [1, 2]}
    task: {name: s3, options: {train_len: 8, eval_size: 64}}
    objectives:
      - token_acc@16: max
      - params: min
    budget: {trials: 5, steps: 3}
    sampler: tpe
    resources: {cpu: 1, concurrent: 1}
    """
    from archspec.search import searcher
    from archspec.search.runner import run_search

    old = searcher.MAX_REJECTIONS_IN_A_ROW
    searcher.MAX_REJECTIONS_IN_A_ROW = 20  # give up sooner than a real search would
    try:
        outcome = run_search(load_search_spec(write_spec(tmp_path, body)), tmp_path / "run", train_fn=cheap.cheap_train, live=False)
    finally:
        searcher.MAX_REJECTIONS_IN_A_ROW = old
    assert outcome.trained == 2 and outcome.exhausted and "exhausted" in outcome.stopped_because
    run = RunDir(tmp_path / "run")
    records = run.read_trials()
    assert sorted(r.overrides["mixer.transition.n_h"] for r in records) == [1, 2]
    assert all(r.status == "ok" for r in records)
    assert records[0].pid == records[1].pid != os.getpid()
    study = optuna.load_study(study_name="t", storage=run.study_url)
    repeats = [t for t in study.trials if t.user_attrs.get("status") == "duplicate"]
    assert len(repeats) >= 20 and all(t.state == optuna.trial.TrialState.PRUNED for t in repeats)
    trained = {r.number: r.overrides for r in records}
    for t in repeats:
        original = int(t.user_attrs["reason"].split("trial ")[1].split(",")[0])
        assert t.user_attrs["overrides"] == trained[original]


def test_repeats_are_explored_away_from(tmp_path):
    """TPE in a small discrete space keeps proposing its best points; the random draws
    after a repeat still reach every point of the space within its size in trials."""
    from archspec.search.searcher import ArchspecSearcher, Rejection
    from archspec.search.samplers import make_sampler
    from archspec.search.space import suggest_overrides

    loaded = load_search_spec(write_spec(tmp_path, RESUMABLE.replace("budget: {trials: 6, steps: 3}", "budget: {trials: 12, steps: 3}")
                                         .replace("sampler: random", "sampler: tpe")))
    spec = loaded.spec
    seen: dict[str, int] = {}

    def reject(number, overrides):
        key = json.dumps(overrides, sort_keys=True)
        if key in seen:
            return Rejection("duplicate", f"the same overrides as trial {seen[key]}, which ended ok")
        seen[key] = number
        return None

    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, study_name="s", sampler=make_sampler(spec), directions=["maximize", "minimize"])
    search = ArchspecSearcher(
        study=study, storage=storage,
        define_by_run=lambda t: {"trial_number": t.number, "overrides": suggest_overrides(t, spec.space, loaded.base_values)},
        reject=reject, metric=spec.metric_names, mode=["max", "min"], seed=0,
    )
    for i in range(12):  # 4 x 3 = 12 points: each round must find a new one
        config = search.suggest(f"t{i}")
        assert isinstance(config, dict), search.stopped_because
        n_h, width = config["overrides"]["mixer.transition.n_h"], config["overrides"]["model.d_model"]
        search.on_trial_complete(f"t{i}", {"status": "ok", "token_acc@16": 0.2 * n_h, "params": float(width)})
    assert len(seen) == 12
    assert search.suggest("t12") == "FINISHED" and search.exhausted
    # Everything went through the study: twelve told with their values, the repeats pruned.
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 12 and all(t.user_attrs["status"] == "ok" for t in done)
    assert sorted(json.dumps(t.user_attrs["overrides"], sort_keys=True) for t in done) == sorted(seen)
    assert all(t.state == optuna.trial.TrialState.PRUNED for t in study.trials if t.user_attrs.get("status") == "duplicate")


# --------------------------------------------------------------------------- resume

RESUMABLE = """\
space:
  mixer.transition.n_h: {int: [1, 4]}
  model.d_model: {choices: [32, 48, 64]}
task: {name: s3, options: {train_len: 8, eval_size: 64}}
objectives:
  - token_acc@16: max
  - params: min
budget: {trials: 6, steps: 3}
sampler: random
resources: {cpu: 1}
"""

DRIVER = """\
import sys
from ray import cloudpickle
import tests.search.cheap as cheap
cloudpickle.register_pickle_by_value(cheap)
from archspec.search.runner import run_search
from archspec.search.space import load_search_spec
run_search(load_search_spec(sys.argv[1]), sys.argv[2], train_fn=cheap.cheap_train, live=False)
"""


def finished(run: RunDir) -> list:
    return [r for r in run.read_trials() if r.status in ("ok", "failed", "diverged")]


def _ray_session_of(driver_pid: int, timeout_s: float = 30.0) -> Path:
    """The private Ray dir whose recorded driver is `driver_pid`."""
    import tempfile

    from archspec.search.leftovers import DRIVER_FILE
    from archspec.search.runner import RAY_DIR_PREFIX

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for path in Path(tempfile.gettempdir()).glob(RAY_DIR_PREFIX + "*"):
            with contextlib.suppress(OSError, ValueError):
                if json.loads((path / DRIVER_FILE).read_text())["pid"] == driver_pid:
                    return path
        time.sleep(0.2)
    raise AssertionError(f"no Ray session dir records driver {driver_pid}")


def test_resume_after_kill_9(tmp_path):
    path = write_spec(tmp_path, RESUMABLE)
    out = tmp_path / "run"
    log = tmp_path / "calls.log"
    # The trials after the first two wait while `hold` exists: the kill comes with exactly two
    # finished, however long `archspec pareto` below takes on a loaded machine (with trials
    # only slowed down, a slow `pareto` once let all six finish before the kill).
    hold = tmp_path / "hold"
    hold.touch()
    env = {**os.environ, "CHEAP_SLEEP": "1.5", "CHEAP_LOG": str(log), "PYTHONPATH": str(REPO),
           "CHEAP_HOLD": str(hold), "CHEAP_HOLD_AFTER": "2"}
    # Its own session, so that the clean-up at the end reaches whatever the test leaves, nothing else.
    proc = subprocess.Popen([PYTHON, "-c", DRIVER, str(path), str(out)], env=env, cwd=REPO,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run = RunDir(out)
    try:
        deadline = time.time() + 120
        while len(finished(run)) < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.3)
        assert len(finished(run)) >= 2, proc.stderr.read().decode() if proc.poll() is not None else "too slow"
        # `archspec pareto` on the running search.
        live = subprocess.run([PYTHON, "-m", "archspec.search.cli", "pareto", str(out), "--json"],
                              capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
        assert live.returncode == 0, live.stderr
        assert json.loads(live.stdout)["trials_completed"] >= 2
        # kill -9 of the driver alone, as a user does: Ray's agents and workers outlive it
        session = _ray_session_of(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        before = {r.number: r for r in finished(run)}
        assert len(before) == 2
        hold.unlink()

        from archspec.search.leftovers import session_processes
        from archspec.search.runner import run_search

        os.environ["CHEAP_LOG"] = str(log)
        try:
            outcome = run_search(None, out, resume=True, train_fn=cheap.cheap_train, live=False)
        finally:
            del os.environ["CHEAP_LOG"]
        # the killed search's Ray is gone: no process holds its session, its dir was removed
        assert not session.exists() and not session_processes(session)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the test itself left
        proc.wait()
    assert outcome.complete and outcome.trained == 6
    after = {r.number: r for r in finished(run)}
    assert len(after) == 6
    for number, record in before.items():  # finished trials were not touched
        assert after[number].finished_at == record.finished_at
    calls = log.read_text().split()
    assert len(calls) == len(set(calls))  # no trial directory trained twice
    assert {str(run.trial_dir(n) / "s3") for n in after} <= set(calls)
    # Trials cut off by the kill are marked and were tried again under new numbers.
    interrupted = [r for r in run.read_trials() if r.status == "interrupted"]
    study = optuna.load_study(study_name="t", storage=run.study_url)
    assert all(t.state != optuna.trial.TrialState.RUNNING for t in study.trials)
    told_ok = {t.number for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs.get("status") == "ok"}
    assert told_ok == {n for n, r in after.items() if r.status == "ok"}
    for record in interrupted:
        assert any(t.user_attrs.get("requeued_from") == record.number for t in study.trials)
    # A second resume has nothing left to do and trains nothing.
    again = run_search(None, out, resume=True, train_fn=cheap.cheap_train, live=False)
    assert again.complete and len(log.read_text().split()) == len(calls)


def test_a_worker_that_outlived_its_search_is_stopped_and_no_other_process():
    """`reconcile` stops a trial's worker left running by a killed driver: the process the
    record names, on this host, started before the trial. A pid now held by a later
    process, or a record from another host, is left alone."""
    from archspec.search.runner import stop_orphan

    worker = subprocess.Popen(["sleep", "60"])
    time.sleep(0.2)
    try:
        record = TrialRecord(number=3, status=None, started_at=time.time(), host=socket.gethostname(), pid=worker.pid)
        assert not stop_orphan(dataclasses.replace(record, host="elsewhere"))
        assert not stop_orphan(dataclasses.replace(record, started_at=time.time() - 3600))  # a later process
        assert worker.poll() is None
        assert stop_orphan(record)
        assert worker.wait(timeout=5) == -signal.SIGTERM
    finally:
        worker.kill()
        worker.wait()


@pytest.fixture
def short_tmp_path():
    """A fresh folder of a short path: a Unix socket's path is at most 107 bytes, which
    pytest's `tmp_path` (longer still under xdist) can exceed."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="rd"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_ray_dirs_of_killed_searches_are_removed_at_the_next_start(short_tmp_path, monkeypatch):
    """A kill -9 skips `ray_session`'s cleanup; the next local search removes what is left,
    but never the dir of a Ray that still answers, nor one that may be starting."""
    import tempfile

    from archspec.search.runner import RAY_DIR_PREFIX, remove_stale_ray_dirs

    tmp_path = short_tmp_path
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def ray_dir(name: str, age_s: float) -> Path:
        sockets = tmp_path / f"{RAY_DIR_PREFIX}{name}" / "session_1" / "sockets"
        sockets.mkdir(parents=True)
        (sockets.parent / "logs").mkdir()
        (sockets.parent / "logs" / "raylet.out").write_text("...")
        old = time.time() - age_s
        os.utime(sockets.parents[1], (old, old))
        return sockets

    dead = ray_dir("dead", 3600)
    with socket.socket(socket.AF_UNIX) as gone:  # a socket file nobody listens on any more
        gone.bind(str(dead / "raylet"))
    live = ray_dir("live", 3600)
    young = ray_dir("young", 5)
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(live / "raylet"))
        listener.listen()
        removed = remove_stale_ray_dirs()
    assert removed == [dead.parents[1]]
    assert not dead.parents[1].exists()
    assert live.parents[1].exists() and young.parents[1].exists()


def test_reconcile_tells_a_trial_that_finished_unheard(tmp_path):
    """The kill can fall between a trial's result.json and the study's tell: on resume the
    study learns the values and the status the searcher would have written."""
    from archspec.search.rundir import TrialRecord
    from archspec.search.runner import OpenStudy, reconcile

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    storage = optuna.storages.RDBStorage(run.study_url)
    study = optuna.create_study(study_name="t", storage=storage, directions=["maximize", "minimize"])
    finished_unheard, failed_unheard = study.ask(), study.ask()
    run.write_trial_result(TrialRecord(number=finished_unheard.number, status="ok", metrics={"acc": 0.75, "flops": 3.0}))
    run.write_trial_result(TrialRecord(number=failed_unheard.number, status="diverged", reason="nan loss"))
    assert reconcile(run, OpenStudy(study, storage), ["acc", "flops"]) == 0  # nothing to requeue
    by_number = {t.number: t for t in study.get_trials()}
    done = by_number[finished_unheard.number]
    assert done.state == optuna.trial.TrialState.COMPLETE and done.values == [0.75, 3.0]
    assert done.user_attrs["status"] == "ok"
    failed = by_number[failed_unheard.number]
    assert failed.state == optuna.trial.TrialState.FAIL and failed.user_attrs["status"] == "diverged"


def test_starting_over_an_existing_run_is_refused(tmp_path, capsys):
    path = write_spec(tmp_path, RESUMABLE)
    out = tmp_path / "run"
    out.mkdir()
    (out / "precious.txt").write_text("mine")
    assert main(["search", str(path), "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (out / "precious.txt").read_text() == "mine"
    assert main(["search", "--resume", "--out", str(tmp_path / "nothing")]) == 2
    assert "nothing to resume" in capsys.readouterr().err


# --------------------------------------------------------------------------- cluster


def test_cluster_mode_places_gpu_trials_on_the_head(tmp_path):
    """`ray start --head` on loopback declaring one (fake) GPU; trials that reserve a GPU
    run there, one at a time, each assigned GPU 0."""
    from archspec.search.ray_head import local_ray_head
    from archspec.search.runner import run_search

    body = RESUMABLE.replace("budget: {trials: 6, steps: 3}", "budget: {trials: 2, steps: 3}").replace(
        "resources: {cpu: 1}", "resources: {cpu: 1, gpu: 1}")
    path = write_spec(tmp_path, body)
    with local_ray_head(cpus=2, gpus=1, pythonpath=REPO, start_timeout_s=60, stop_timeout_s=30) as address:
        port = address.rsplit(":", 1)[1]
        outcome = run_search(load_search_spec(path), tmp_path / "run", address=address,
                             train_fn=cheap.cheap_train, live=False)
        assert outcome.complete
        records = [r for r in RunDir(tmp_path / "run").read_trials() if r.status == "ok"]
        assert len(records) == 2
        for record in records:
            assert record.placement["cluster"].endswith(f":{port}")  # the head we started (its host resolved)
            assert record.placement["gpu_ids"] == ["0"]
            assert record.device == "cpu"  # the GPU is declared, not real: training falls back
        # One GPU, one trial at a time: their runs do not overlap.
        first, second = sorted(records, key=lambda r: r.started_at)
        assert first.finished_at <= second.started_at + 0.5


def test_an_address_where_no_ray_answers_is_refused_at_once(tmp_path, capsys):
    path = write_spec(tmp_path, RESUMABLE)
    started = time.time()
    assert main(["search", str(path), "--out", str(tmp_path / "run"), "--address", f"127.0.0.1:{free_port()}"]) == 2
    assert time.time() - started < 10  # Ray itself would wait for minutes
    assert "no Ray cluster answers at 127.0.0.1:" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_trial_that_asks_for_more_than_the_cluster_has_is_refused(tmp_path, capsys):
    body = RESUMABLE.replace("resources: {cpu: 1}", "resources: {cpu: 64}")
    path = write_spec(tmp_path, body)
    assert main(["search", str(path), "--out", str(tmp_path / "run"), "--no-live"]) == 2
    err = capsys.readouterr().err
    assert "resources.cpu" in err and "asks for 64 CPU" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_execute_trial_records_a_crash_without_ray(tmp_path):
    """The worker-side path alone: a crashing objective gives a failed record, not an exception."""
    search = load_search_spec(write_spec(tmp_path, FAILURES.format(limit=1e9))).spec
    run = RunDir(tmp_path / "run")
    from archspec.search.rundir import write_yaml_atomic

    write_yaml_atomic(run.base_file, {"extends": str(TINY), "name": "tiny"})
    setup = TrialSetup(run_dir=str(run.path), search=search, train_fn=cheap.cheap_train)
    record = execute_trial(setup, 3, {"mixer.short_conv": 2})
    assert record.status == "failed" and "RuntimeError: cheap_train was told to crash" in record.reason
    assert run.read_trial(3).status == "failed"
    spec = compose_spec(run, {"mixer.short_conv": 4}, task=make_task(search.tasks[0]))
    assert spec.model.vocab_size == 6


def test_live_view_shows_running_trials_and_the_front(tmp_path):
    from rich.console import Console

    from archspec.search.live import LiveView
    from archspec.search.rundir import TrialRecord

    spec = load_search_spec(write_spec(tmp_path, RESUMABLE)).spec
    run = RunDir(tmp_path / "run")
    for number, acc, params in ((0, 0.9, 300.0), (1, 0.5, 400.0)):  # trial 1 is dominated
        run.write_trial_result(TrialRecord(number=number, status="ok", overrides={"mixer.transition.n_h": number + 2},
                                           metrics={"token_acc@16": acc, "params": params}, started_at=0.0, finished_at=1.0))
    terminal = Console(record=True, width=150, force_terminal=True)
    view = LiveView(run, spec, target=6, console=terminal)
    view.started(7, {"mixer.transition.n_h": 4, "model.d_model": 32})
    view.started(8, {"mixer.transition.n_h": 1, "mixer.transition.beta_range": None})
    run.write_trial_start(TrialRecord(number=8, status=None, started_at=0.0))  # trial 7 has not written its file yet
    terminal.print(view.render())
    text = terminal.export_text()
    assert "2/6 trained" in text and "n_h=4, d_model=32" in text
    # The header counts what the running table lists (Ray's events), not the trial files;
    # an unset field shows as `-`, not as "unset".
    assert "; 2 running" in text and "running (2)" in text and "n_h=1, beta_range=-" in text
    assert "current front (1 trials)" in text and "0.9" in text and "0.5" not in text

    log = Console(record=True, width=150, force_terminal=False)  # CI logs: a line per finished trial
    view = LiveView(run, spec, target=6, console=log)
    with view:
        run.write_trial_result(TrialRecord(number=2, status="failed", reason="boom", started_at=0.0, finished_at=1.0))
        view.ended(2)
    lines = log.export_text().splitlines()
    assert lines == ["trial 2: failed (boom)   [3/6 trained]"]


def test_reconcile_tells_unheard_results_and_requeues_cut_off_trials(tmp_path):
    """The two crash windows, without Ray: a trial that wrote its result but was never told
    to the study, and one that was running when the driver died."""
    from archspec.search.rundir import TrialRecord
    from archspec.search.runner import OpenStudy, reconcile

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    storage = optuna.storages.RDBStorage(run.study_url)
    study = optuna.create_study(storage=storage, study_name="t", directions=["maximize", "minimize"])
    finished_unheard, cut_off = study.ask(), study.ask()
    for trial in (finished_unheard, cut_off):
        trial.suggest_categorical("mixer.transition.n_h", [1, 2])
        trial.set_user_attr("overrides", {"mixer.transition.n_h": trial.params["mixer.transition.n_h"]})
    run.write_trial_result(TrialRecord(number=finished_unheard.number, status="ok", metrics={"acc": 0.7, "params": 10.0},
                                       started_at=0.0, finished_at=1.0))
    run.write_trial_start(TrialRecord(number=cut_off.number, status=None, started_at=0.0, overrides=cut_off.user_attrs["overrides"]))

    assert reconcile(run, OpenStudy(study, storage), ["acc", "params"]) == 1
    trials = study.get_trials()
    assert trials[0].state == optuna.trial.TrialState.COMPLETE and trials[0].values == [0.7, 10.0]
    assert trials[1].state == optuna.trial.TrialState.FAIL and trials[1].user_attrs["status"] == "interrupted"
    assert run.read_trial(cut_off.number).status == "interrupted"
    assert run.read_trial(cut_off.number).overrides == {"mixer.transition.n_h": cut_off.params["mixer.transition.n_h"]}
    queued = study.ask()  # the cut-off point comes back first, with the same parameters
    assert queued.suggest_categorical("mixer.transition.n_h", [1, 2]) == cut_off.params["mixer.transition.n_h"]


def test_driver_writes_results_it_cannot_see(tmp_path):
    """A trial on another node (no shared files): the driver writes result.json from the report."""
    from archspec.search.live import RecordingCallback
    from archspec.search.rundir import TrialRecord
    from archspec.search.trial import report_payload

    run = RunDir(tmp_path / "run")
    record = TrialRecord(number=4, status="ok", metrics={"acc": 0.8, "params": 5.0}, overrides={"mixer.heads": 2},
                         started_at=1.0, finished_at=2.0, host="node-7")
    payload = report_payload(record, ["acc", "params"])
    assert payload["acc"] == 0.8 and payload["status"] == "ok"
    RecordingCallback(run).on_trial_result(0, [], None, payload)
    assert run.read_trial(4).to_json() == record.to_json()
    # A result the worker wrote itself is never replaced.
    mine = TrialRecord(number=5, status="failed", reason="real", started_at=1.0, finished_at=2.0)
    run.write_trial_result(mine)
    RecordingCallback(run).on_trial_result(0, [], None, report_payload(TrialRecord(number=5, status="ok"), ["acc"]))
    assert run.read_trial(5).reason == "real"
    failed = report_payload(TrialRecord(number=6, status="diverged", metrics={"acc": None}), ["acc", "params"])
    assert failed["acc"] is None and failed["params"] is None  # Ray wants every objective key



def test_an_objective_the_training_function_never_reports_stops_the_search_after_one_trial(tmp_path):
    """The stock trainer's metrics are checked when the spec loads (tests/search/test_checks.py);
    a training function of one's own is not known then. `seq_acc@16` is a metric the
    trainer reports but the cheap objective does not: the first trial shows it, and the
    search stops instead of spending its budget."""
    from archspec.search.runner import run_search

    body = RESUMABLE.replace("token_acc@16: max", "seq_acc@16: max").replace("resources: {cpu: 1}", "resources: {cpu: 1, concurrent: 1}")
    outcome = run_search(load_search_spec(write_spec(tmp_path, body)), tmp_path / "run", train_fn=cheap.cheap_train, live=False)
    assert outcome.stopped_because.startswith("objective metric(s) missing or not finite: seq_acc@16")
    assert "token_acc@16" in outcome.stopped_because  # what the trial did report, to fix the name
    (record,) = [r for r in RunDir(tmp_path / "run").read_trials() if r.status is not None]
    assert record.status == "failed"


def test_the_study_is_named_after_the_search_and_names_its_objectives(tmp_path):
    """A new run's study takes the search's name and the objectives' names; a run whose
    study.db already holds one study (made before the study took the search's name)
    keeps it on resume."""
    from archspec.search.runner import open_study
    from archspec.search.samplers import make_sampler

    spec = load_search_spec(write_spec(tmp_path, RESUMABLE)).spec
    run = RunDir(tmp_path / "new")
    run.path.mkdir()
    opened = open_study(run, spec, make_sampler(spec))
    assert opened.study.study_name == "t" and opened.study.metric_names == ["token_acc@16", "params"]
    assert optuna.get_all_study_names(run.study_url) == ["t"]

    old = RunDir(tmp_path / "old")
    old.path.mkdir()
    optuna.create_study(study_name="archspec", storage=old.study_url, directions=["maximize", "minimize"]).ask()
    opened = open_study(old, spec, make_sampler(spec))
    assert opened.study.study_name == "archspec" and len(opened.study.trials) == 1
    assert opened.study.metric_names == ["token_acc@16", "params"]


def test_tpe_lies_about_running_trials_when_trials_run_at_once(tmp_path):
    from archspec.search.samplers import make_sampler, runs_concurrently

    body = RESUMABLE.replace("sampler: random", "sampler: tpe")
    at_once = load_search_spec(write_spec(tmp_path, body)).spec
    one_by_one = load_search_spec(write_spec(tmp_path, body.replace("resources: {cpu: 1}", "resources: {cpu: 1, concurrent: 1}"), "one.yaml")).spec
    assert runs_concurrently(at_once) and not runs_concurrently(one_by_one)
    # Optuna keeps the setting private; reading it here is the one way to see what was built.
    assert make_sampler(at_once)._constant_liar is True
    assert make_sampler(one_by_one)._constant_liar is False


def test_the_dashboard_hint_says_how_to_install_it_when_missing(monkeypatch):
    import importlib.util

    from archspec.search.cli_search import dashboard_hint

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    hint = dashboard_hint("sqlite:///run/study.db")
    assert 'pip install -e ".[dashboard]"' in hint and hint.endswith("optuna-dashboard sqlite:///run/study.db")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert dashboard_hint("sqlite:///run/study.db") == "the study: optuna-dashboard sqlite:///run/study.db"
