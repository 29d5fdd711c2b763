"""`run_search`: a resumable, multi-objective Ray Tune + Optuna search over model specs.

One session of a search:

1. The run directory is checked: a new one must be empty; an existing one is resumed
   (`resume`), from its stored search spec, which a spec given again must match.
2. Ray is started locally (or joined at `address`) and must be able to place one trial
   (`resources`); only then is anything written (the resolved search and base specs).
3. The Optuna study (SQLite in the run directory) is opened and reconciled with the trial
   files: trials that finished but were never told to the study are told now; trials a
   crash cut off are marked `interrupted` and their point is queued to run again.
4. A `Tuner` runs the remaining trials with `ArchspecSearcher`, each trial reserving
   `resources` (GPU trials land on GPU nodes), while the live view shows what runs and
   the current front.

Finished trials are never redone: the budget counts the trials that were trained
(`ok`, `failed`, `diverged`), and only the difference is asked of Ray.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archspec.errors import ArchspecError, Location
from archspec.search.leftovers import driver_alive, kill_session_processes, record_driver
from archspec.search.leftovers import process_start as _process_start
from archspec.search.rundir import (
    INTERRUPTED,
    LOCK_FILE,
    OK,
    STOPPED,
    TRAINED_STATUSES,
    RunDir,
    RunLock,
    TrialRecord,
    study_name_for,
    trained_count,
    write_yaml_atomic,
)
from archspec.search.runcheck import check_resumable
from archspec.search.searcher import DUPLICATE, ArchspecSearcher, Rejection
from archspec.search.space import LoadedSearch, SearchSpec, grid_points, load_search_spec, optuna_params, suggest_overrides
from archspec.search.trial import TrainFn, TrialSetup, make_task, precheck
from archspec.search.worker_state import quiet_retirements

# Ray reads these when it starts: no auth token file in ~/.ray, no usage reporting.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray Tune's own console output (an experiment box, trial tables): the live view replaces it.
os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")


@dataclass
class SearchOutcome:
    run: RunDir
    spec: SearchSpec
    target: int  # trials to train in all (the budget, or the grid's size if smaller)
    trained: int  # trials trained so far, all sessions
    stopped_because: str | None = None  # the searcher gave up (constraints reject everything)
    exhausted: bool = False  # ... because the space has no untried point left (not an error)

    @property
    def complete(self) -> bool:
        return self.trained >= self.target


# --------------------------------------------------------------------------- run directory


@dataclass(frozen=True)
class RunPlan:
    """What a session will run, decided before anything is written or started."""

    run: RunDir
    loaded: LoadedSearch  # the search as it will run (base_file: the run's base.yaml once written)
    fresh: bool  # a new run directory: search.yaml and base.yaml are still to be written
    note: str | None  # why search.yaml is (re)written, or None when it stays as it is


def resolve_run(
    out: str | os.PathLike[str], loaded: LoadedSearch | None, *, resume: bool, trials: int | None, check_objectives: bool = True
) -> RunPlan:
    """Check the run directory and decide the search to run; writes nothing.

    The stored `search.yaml` (with `base: base.yaml`) is what a resumed search runs: the
    base spec file may have changed since, the run must not. Only the number of trials
    may differ (to extend a search).
    """
    run = RunDir(out)
    if run.path.exists() and not run.path.is_dir():
        raise ArchspecError(f"{run.path} is a file, not a run directory",
                            [(Location(origin=f"--out {out}"), None, "give --out a directory (new or empty to start, a run to resume)")])
    if run.exists():
        if not resume:
            raise ArchspecError(
                f"{run.path} already holds a search",
                [(Location(origin=f"--out {out}"), None, "use --resume to continue it, or choose another --out")],
            )
        stored = load_search_spec(run.search_file, check_objectives=check_objectives)
        if loaded is not None:
            _check_same_search(stored, loaded, run)
        check_resumable(run, stored.spec)  # everything a resume touches, before it touches anything
        spec, note = stored.spec, None
        wanted = trials or (loaded.spec.budget.trials if loaded is not None else None)
        if wanted is not None and wanted != spec.budget.trials:
            spec, note = _with_trials(spec, wanted), f"budget.trials changed to {wanted} on resume"
        return RunPlan(run, LoadedSearch(spec, stored.base, run.base_file, str(run.search_file)), False, note)
    if loaded is None:
        raise ArchspecError(f"{run.path}: nothing to resume (no {run.search_file.name}); give the search spec to start one")
    if run.path.exists() and any(p.name != LOCK_FILE for p in run.path.iterdir()):
        raise ArchspecError(
            f"{run.path} is not empty and holds no search",
            [(Location(origin=f"--out {out}"), None, "choose an empty or new directory, so that nothing there is overwritten")],
        )
    spec = _with_trials(loaded.spec, trials) if trials else loaded.spec
    return RunPlan(run, LoadedSearch(spec, loaded.base, loaded.base_file, loaded.source), True, f"resolved from {loaded.source}")


def write_run(plan: RunPlan) -> LoadedSearch:
    """Write what `resolve_run` decided; returns the search as read from the run directory."""
    run, loaded = plan.run, plan.loaded
    if plan.fresh:
        write_yaml_atomic(run.base_file, loaded.base.model_dump(mode="json", exclude_none=True),
                          header=f"# the base spec of this search, resolved from {loaded.base_file}\n")
    if plan.note:
        _write_search(run, loaded.spec, note=plan.note)
    return LoadedSearch(loaded.spec, loaded.base, run.base_file, str(run.search_file))


def _with_trials(spec: SearchSpec, trials: int) -> SearchSpec:
    return spec.model_copy(update={"budget": spec.budget.model_copy(update={"trials": trials})})


def _write_search(run: RunDir, spec: SearchSpec, note: str) -> None:
    data = spec.to_yaml_data()
    data["base"] = run.base_file.name
    write_yaml_atomic(run.search_file, data, header=f"# archspec search, {note}\n")


def _check_same_search(stored: LoadedSearch, given: LoadedSearch, run: RunDir) -> None:
    """A resumed run must search what it started with (the trial count aside)."""
    a = stored.spec.to_yaml_data() | {"base": None}
    b = given.spec.to_yaml_data() | {"base": None}
    a["budget"] = {**a["budget"], "trials": None}
    b["budget"] = {**b["budget"], "trials": None}
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if stored.base.model_dump(mode="json", exclude_none=True) != given.base.model_dump(mode="json", exclude_none=True):
        differ.insert(0, "base (the base spec's contents)")
    if differ:
        raise ArchspecError(
            f"cannot resume {run.path}: the search spec differs from the one it started with",
            [(Location(file=given.source), None, f"changed: {', '.join(differ)} (only budget.trials may change; "
              f"resume with just `--resume --out {run.path}` to continue as it was)")],
        )


# --------------------------------------------------------------------------- study


@dataclass(frozen=True)
class OpenStudy:
    """The search's Optuna study and the storage it lives in (SQLite in the run directory)."""

    study: Any  # optuna.Study
    storage: Any  # optuna.storages.BaseStorage


def open_study(run: RunDir, spec: SearchSpec, sampler: Any) -> OpenStudy:
    """The study of the run, created when the search first starts: named after the search, with
    the objectives' names (`set_metric_names`, for optuna-dashboard and Optuna's plots).
    A run started before the study took the search's name keeps the one study it has."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(run.study_url)
    name = study_name_for(optuna.get_all_study_names(storage), spec.name)
    study = optuna.create_study(
        storage=storage, study_name=name, sampler=sampler, load_if_exists=True,
        directions=["maximize" if o.maximise else "minimize" for o in spec.objectives],
    )
    if study.metric_names != spec.metric_names:
        with warnings.catch_warnings():  # marked experimental since Optuna 3.2; stable in use
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(spec.metric_names)
    return OpenStudy(study, storage)


def reconcile(run: RunDir, opened: OpenStudy, metric_names: list[str]) -> int:
    """Bring the study in line with the trial files after a crash; returns trials requeued.

    A RUNNING study trial whose `result.json` exists finished unheard: tell it. One
    without is interrupted: record that, tell it as failed, queue its point again.
    """
    from optuna.trial import TrialState

    study = opened.study
    requeued = 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        record = run.read_trial(trial.number)
        if record is not None and record.status is None and stop_orphan(record):
            record = run.read_trial(trial.number)  # it may have finished before it stopped
        if record is not None and record.status is not None:
            # The same annotation the searcher writes when it tells a trial itself.
            _annotate(opened, trial, "status", record.status)
            values = [record.metrics.get(m) for m in metric_names] if record.status == OK else None
            if values is not None and all(isinstance(v, (int, float)) for v in values):
                study.tell(trial.number, values, state=TrialState.COMPLETE)
            elif record.status == STOPPED:  # as the searcher tells a trial a scheduler stopped
                study.tell(trial.number, state=TrialState.PRUNED)
            else:
                study.tell(trial.number, state=TrialState.FAIL)
            continue
        overrides = trial.user_attrs.get("overrides", {})
        started = record.started_at if record is not None else None
        run.write_trial_result(TrialRecord(
            number=trial.number, status=INTERRUPTED, overrides=overrides, started_at=started, finished_at=time.time(),
            reason="the search stopped (crash, kill or Ctrl-C) before this trial finished; its point was queued again",
        ))
        _annotate(opened, trial, "status", INTERRUPTED)
        study.tell(trial.number, state=TrialState.FAIL)
        study.enqueue_trial(dict(trial.params), user_attrs={"requeued_from": trial.number})
        requeued += 1
    return requeued


def stop_orphan(record: TrialRecord, grace_s: float = 10.0) -> bool:
    """Stop the worker of a trial that outlived its search; returns whether there was one.

    `kill -9` of a driver leaves its Ray workers running for a while (they sit in process
    groups of their own): one would finish its trial and write its result over the
    `interrupted` that `reconcile` records, while the resumed search trains the same point
    again. Only a process on this host that started before the trial did is stopped, so a
    pid the system has since given to another process is left alone.
    """
    pid = record.pid
    if pid is None or pid == os.getpid() or record.host != socket.gethostname() or record.started_at is None:
        return False
    started = _process_start(pid)
    if started is None or started > record.started_at + 1.0:
        return False
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except OSError:
            return True
        deadline = time.time() + wait_s
        while time.time() < deadline and _process_start(pid) == started:
            time.sleep(0.05)
        if _process_start(pid) != started:
            return True
    return True


def _annotate(opened: OpenStudy, trial: Any, key: str, value: Any) -> None:
    """A user attribute on a running trial known only as a `FrozenTrial` (after a crash,
    no `optuna.Trial` object is left), through the storage's public interface."""
    storage = opened.storage
    study_id = storage.get_study_id_from_name(opened.study.study_name)
    storage.set_trial_user_attr(storage.get_trial_id_from_study_id_trial_number(study_id, trial.number), key, value)


# --------------------------------------------------------------------------- ray


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[None]:
    """A local Ray started for this search, or a connection to the cluster at `address`."""
    import ray

    temp_dir = None
    from archspec.search.placement import ray_runtime_env

    # runtime_env: what every trial's process carries (NCCL_NVLS_ENABLE=0), on every node.
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, logging_level="WARNING",
                                  runtime_env=ray_runtime_env())
    if address:
        _check_reachable(address)
        kwargs["address"] = address
    else:
        # address="local": a private Ray, even if a `ray start` cluster runs on this machine.
        # A short private temp dir: Ray's socket paths must stay under ~100 characters.
        temp_dir = tempfile.mkdtemp(prefix=RAY_DIR_PREFIX)
        record_driver(Path(temp_dir))  # how a later search tells that this Ray session's processes were left behind
        kwargs.update(address="local", _temp_dir=temp_dir)
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"--address {address}" if address else "a local Ray"
        raise ArchspecError(f"cannot start or join Ray ({where})", [(Location(origin=where), None, str(exc))]) from None
    try:
        yield
    finally:
        ray.shutdown()  # with --address this only disconnects; the cluster keeps running
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)


RAY_DIR_PREFIX = "archspec-ray-"


def remove_stale_ray_dirs(min_age_s: float = 120.0) -> list[Path]:
    """Stop what searches that were killed (`kill -9`, a lost node) left of their private
    Ray sessions, and remove their dirs: their `finally` never ran (`leftovers.py`).

    A session is stale when the driver recorded in its dir no longer runs; for a dir
    without a recorded driver, when no raylet answers on any of its sockets and it is
    older than `min_age_s` (a young one may belong to a search that is still starting).
    Its processes (agents and workers that outlive the driver and ignore SIGTERM) are
    killed before the dir goes."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(RAY_DIR_PREFIX + "*"):
        try:
            if not path.is_dir():
                continue
            age = time.time() - path.stat().st_mtime
        except OSError:
            continue
        alive = driver_alive(path)
        if alive is None:
            alive = age < min_age_s or any(_socket_answers(sock) for sock in path.glob("session_*/sockets/raylet"))
        if not alive:
            stopped = kill_session_processes(path)
            if stopped:  # say so: these were processes of the user's, still running
                print(f"note: stopped {len(stopped)} Ray process(es) left running by a killed search "
                      f"(pids {', '.join(map(str, stopped))}; its Ray dir {path})", file=sys.stderr)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _socket_answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Ray waits for a cluster that does not answer for minutes: ask its port first."""
    if address == "auto" or "://" in address:  # found by Ray itself, or a Ray Client address
        return
    origin = Location(origin=f"--address {address}")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ArchspecError("bad --address", [(origin, None, "give the Ray head as HOST:PORT, e.g. 10.0.0.5:6379")])
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ArchspecError(
            f"no Ray cluster answers at {address}",
            [(origin, None, f"{exc.strerror or exc}; start one there with `ray start --head --port {port}` "
              "(add --num-gpus N to declare GPUs), or leave out --address to run on this machine")],
        ) from None


def _check_resources_fit(spec: SearchSpec, address: str | None) -> None:
    """A trial that asks for more than the whole cluster has would wait forever: say so."""
    import ray

    from archspec.search.gpu_share import AUTO_STEP
    from archspec.search.space import GPU_AUTO

    total = ray.cluster_resources()
    gpu = AUTO_STEP if spec.resources.gpu == GPU_AUTO else spec.resources.gpu  # auto: a sixteenth at least
    for name, need in (("CPU", spec.resources.cpu), ("GPU", gpu)):
        if need and total.get(name, 0) < need:
            where = f"the Ray cluster at {address}" if address else "this machine"
            raise ArchspecError(
                "the trials cannot be placed",
                [(None, f"resources.{name.lower()}", f"each trial asks for {need:g} {name}, {where} has {total.get(name, 0):g}")],
            )


# --------------------------------------------------------------------------- the search


def run_search(
    loaded: LoadedSearch | None,
    out: str | os.PathLike[str],
    *,
    resume: bool = False,
    trials: int | None = None,
    address: str | None = None,
    train_fn: TrainFn | None = None,
    live: bool = True,
) -> SearchOutcome:
    """Run (or resume) a search into the run directory `out`, holding its lock throughout.

    Nothing is written until the whole run directory has been checked (`resolve_run`); a
    search refused before that leaves no trace, not even the lock file.
    """
    lock = RunLock(out).acquire(origin=f"--out {out}")
    try:
        return _run_locked(lock, loaded, out, resume=resume, trials=trials, address=address, train_fn=train_fn, live=live)
    finally:
        lock.release(remove=lock.created_file and not lock.wrote)


def _run_locked(
    lock: RunLock, loaded: LoadedSearch | None, out: str | os.PathLike[str], *, resume: bool, trials: int | None,
    address: str | None, train_fn: TrainFn | None, live: bool,
) -> SearchOutcome:
    from archspec.search.samplers import make_sampler

    # A killed search's Ray processes could still write trial files: stop them before
    # the files are read (on a cluster, `reconcile` stops such workers by their records).
    remove_stale_ray_dirs()
    # A training function of one's own reports metrics of its own: objectives are then
    # checked on its first trial (searcher.py), not against the stock trainer's.
    plan = resolve_run(out, loaded, resume=resume, trials=trials, check_objectives=train_fn is None)
    run, spec = plan.run, plan.loaded.spec
    _check_scheduler_fits(spec, train_fn)
    gpu_bytes = _gpu_bytes_for_auto(spec)  # before anything is written: a refusal leaves no trace
    base_values = plan.loaded.base_values
    setup = TrialSetup(run_dir=str(run.path), search=spec, train_fn=train_fn)
    tasks = [make_task(ref) for ref in spec.tasks]
    points = grid_points(spec.space, base_values) if spec.sampler == "grid" else []

    def target() -> int:  # needs the run's base.yaml
        return min(spec.budget.trials, _trainable_grid_size(points, setup, tasks)) if points else spec.budget.trials

    outcome = SearchOutcome(run=run, spec=spec, target=spec.budget.trials, trained=trained_count(run.read_trials()))
    if not plan.fresh:
        outcome.target = target()
        if outcome.complete:
            lock.wrote = True
            write_run(plan)
            return outcome

    def define_by_run(trial: Any) -> dict[str, Any]:
        return {"trial_number": trial.number, "overrides": suggest_overrides(trial, spec.space, base_values)}

    handed_out: dict[str, int] = {}  # overrides -> trial number, accepted by this process (no files yet)

    def reject(number: int, overrides: dict[str, Any]) -> Rejection | None:
        repeat = _repeat_of(run, overrides, handed_out)
        if repeat is not None:
            return repeat  # lives in the study only: a run directory of repeats helps nobody
        verdict = precheck(setup, overrides, tasks)
        if verdict.status == OK:
            handed_out[json.dumps(overrides, sort_keys=True)] = number
            return None
        rejection = Rejection(verdict.status, verdict.reason or "")
        _record_rejection(run, number, overrides, rejection, verdict.cost)
        return rejection

    with ray_session(address):
        _check_resources_fit(spec, address)  # before anything is written: a refused run leaves no trace
        lock.wrote = True
        write_run(plan)
        outcome.target = target()
        sampler = make_sampler(spec)
        opened = open_study(run, spec, sampler)
        reconcile(run, opened, spec.metric_names)
        if points and not opened.study.trials:
            _queue_grid(opened.study, points, setup, tasks, base_values)
        remaining = outcome.target - trained_count(run.read_trials())
        if remaining > 0:
            from archspec.search.gpu_share import MeasuredMemory
            from archspec.search.trial import training_bytes_of

            measured = MeasuredMemory(run.read_trials, tasks, functools.partial(training_bytes_of, setup))
            place = functools.partial(placement, setup=setup, tasks=tasks, gpu_bytes=gpu_bytes, measured=measured)
            outcome.stopped_because, outcome.exhausted = _fit(setup, spec, run, opened, define_by_run, reject, remaining,
                                                              outcome.target, live, place)
    outcome.trained = trained_count(run.read_trials())
    return outcome


def _check_scheduler_fits(spec: SearchSpec, train_fn: TrainFn | None) -> None:
    """A scheduler stops trials from the results they report while they train: a training
    function of one's own that reports none would never be stopped."""
    from archspec.search.trial import ON_VALIDATION, takes_progress

    if spec.scheduler is not None and train_fn is not None and not takes_progress(train_fn):
        raise ArchspecError(
            "the search's scheduler would never hear from a trial before it ends",
            [(None, "scheduler", f"the training function {getattr(train_fn, '__name__', train_fn)!r} takes no "
              f"`{ON_VALIDATION}(step, metrics)` to report validation results while it trains; add it, or remove `scheduler:`")],
        )


def _gpu_bytes_for_auto(spec: SearchSpec) -> int | None:
    """One GPU's memory when trials' shares are sized from their estimates (`gpu: auto`)."""
    from archspec.search.gpu_share import gpu_memory_bytes
    from archspec.search.space import GPU_AUTO

    return gpu_memory_bytes(spec.resources) if spec.resources.gpu == GPU_AUTO else None


def placement(config: dict[str, Any], *, setup: TrialSetup, tasks: list[Any], gpu_bytes: int | None,
              measured: Any = None) -> dict[str, Any]:
    """What an accepted proposal's config carries for its placement: its share of a GPU
    when it reserves less than one (a fixed fraction, or `auto` from its memory estimate,
    scaled by what finished trials measured: `measured`, a `gpu_share.MeasuredMemory`)."""
    from archspec.search.gpu_share import AUTO_FACTOR, auto_share, calibrated_factor
    from archspec.search.space import GPU_AUTO
    from archspec.search.trial import GPU_SHARE_KEY, training_bytes_of

    gpu = setup.search.resources.gpu
    if gpu == GPU_AUTO:
        assert gpu_bytes is not None
        needs = [training_bytes_of(setup, config["overrides"], task) for task in tasks]
        factor = AUTO_FACTOR if measured is None else calibrated_factor(measured.measurements())
        return {GPU_SHARE_KEY: auto_share(needs, gpu_bytes, factor)}
    return {GPU_SHARE_KEY: float(gpu)} if 0 < gpu < 1 else {}


def trial_resources(config: dict[str, Any], *, cpu: float, gpu: float) -> Any:
    """Ray's placement of one trial: its CPUs and its GPUs or share of one (from its config)."""
    from ray.tune import PlacementGroupFactory

    from archspec.search.trial import GPU_SHARE_KEY

    return PlacementGroupFactory([{"CPU": cpu, "GPU": float(config.get(GPU_SHARE_KEY, gpu))}])


def _record_rejection(run: RunDir, number: int, overrides: dict[str, Any], rejection: Rejection, metrics: dict[str, float]) -> None:
    now = time.time()
    run.write_trial_result(TrialRecord(
        number=number, status=rejection.status, reason=rejection.reason, overrides=dict(overrides),
        metrics=metrics, started_at=now, finished_at=now,
    ))


def _queue_grid(study: Any, points: list[dict[str, Any]], setup: TrialSetup, tasks: list[Any], base_values: dict[str, Any]) -> None:
    """A fresh grid: record the points the precheck refuses, queue the others once each.

    Refused points are asked and told one by one before anything else is queued, so
    that the study hands back exactly that point (it pops the oldest queued trial).
    """
    from optuna.trial import TrialState

    space = setup.search.space
    good = []
    for point in points:
        verdict = precheck(setup, point, tasks)
        if verdict.status == OK:
            good.append(point)
            continue
        study.enqueue_trial(optuna_params(space, point, base_values))
        trial = study.ask()
        overrides = suggest_overrides(trial, space, base_values)
        rejection = Rejection(verdict.status, verdict.reason or "")
        trial.set_user_attr("overrides", overrides)
        trial.set_user_attr("status", rejection.status)
        trial.set_user_attr("reason", rejection.reason)
        study.tell(trial, state=TrialState.FAIL)
        _record_rejection(setup.run, trial.number, overrides, rejection, verdict.cost)
    for point in good:
        study.enqueue_trial(optuna_params(space, point, base_values))


def _repeat_of(run: RunDir, overrides: dict[str, Any], handed_out: dict[str, int]) -> Rejection | None:
    """A proposal identical to a trial that trained or is training is not trained again.

    `handed_out` covers trials accepted moments ago whose worker has not started yet.
    """
    key = json.dumps(overrides, sort_keys=True)
    records = run.read_trials()
    finished = {r.number for r in records if r.status is not None}
    if key in handed_out and handed_out[key] not in finished:
        return Rejection(DUPLICATE, f"the same overrides as trial {handed_out[key]}, which is still training")
    for record in records:
        if record.status not in (None, *TRAINED_STATUSES) or json.dumps(record.overrides, sort_keys=True) != key:
            continue
        state = "is still training" if record.status is None else f"ended {record.status}"
        return Rejection(DUPLICATE, f"the same overrides as trial {record.number}, which {state}")
    return None


def _trainable_grid_size(points: list[dict[str, Any]], setup: TrialSetup, tasks: list[Any]) -> int:
    """Grid points that pass the precheck: the number of trials the grid can train."""
    return sum(precheck(setup, point, tasks).status == OK for point in points)


def _fit(
    setup: TrialSetup,
    spec: SearchSpec,
    run: RunDir,
    opened: OpenStudy,
    define_by_run: Callable[[Any], dict[str, Any]],
    reject: Callable[[int, dict[str, Any]], Rejection | None],
    remaining: int,
    target: int,
    live: bool,
    place: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> tuple[str | None, bool]:
    """Run `remaining` trials with Ray Tune; returns why the searcher stopped early, if it did."""
    from ray import tune

    from archspec.search.live import LiveView, RecordingCallback
    from archspec.search.schedulers import make_scheduler, scheduler_name
    from archspec.search.space import GPU_AUTO
    from archspec.search.timing import TrialTimes
    from archspec.search.trial import trainable

    searcher = ArchspecSearcher(
        study=opened.study, storage=opened.storage, define_by_run=define_by_run, reject=reject,
        metric=spec.metric_names, mode=[o.direction for o in spec.objectives], seed=spec.seed, place=place,
    )
    run.ray_dir.mkdir(parents=True, exist_ok=True)
    session = f"session-{sum(1 for _ in run.ray_dir.iterdir()):03d}"
    gpu = 0.0 if spec.resources.gpu == GPU_AUTO else float(spec.resources.gpu)  # auto: every config has its share
    resources = functools.partial(trial_resources, cpu=spec.resources.cpu, gpu=gpu)
    view = LiveView(run, spec, target=target, live=live)
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(trainable, setup=setup), resources),
        tune_config=tune.TuneConfig(
            search_alg=searcher, num_samples=remaining, max_concurrent_trials=spec.resources.concurrent,
            scheduler=make_scheduler(spec),
            # A worker trains trial after trial of the same resources: no process start,
            # imports, CUDA context or kernel loading per trial (search/worker_state.py).
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            name=session, storage_path=str(run.ray_dir), verbose=0,
            callbacks=[RecordingCallback(run, scheduler_name(spec)), view.callback, TrialTimes(run.ray_dir / session)],
            failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
        ),
    )
    # Ray Tune's warnings on Ctrl-C point to `Tuner.restore`; here `--resume` is the way back.
    logging.getLogger("ray.tune").setLevel(logging.ERROR)
    quiet_retirements()
    with view:
        tuner.fit()
    return searcher.stopped_because, searcher.exhausted

