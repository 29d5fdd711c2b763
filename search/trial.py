"""One trial: the spec from base + overrides, the cost check, training, the record.

`precheck` runs in the driver for every proposal (it is cheap: the spec is validated and
costed analytically, nothing is built), so that a spec the language refuses or a
constraint rejects never costs a Ray worker. `execute_trial` runs in the Ray worker:
it trains on every task, gathers the metrics and writes `result.json` atomically
*before* Ray hears of the result, so that a driver killed right after still finds it.

Metric names: with one task, the trainer's names as they are (`token_acc@32`, `params`,
`tokens_per_s`, ...); with several, `task/metric` for each task's metrics, plus the cost
model's `params`, `flops_per_token` and `state_bytes` (of the first task's vocabulary).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from archspec.errors import ArchspecError
from archspec.search.formatting import number
from archspec.search.rundir import DIVERGED, FAILED, INVALID, OK, SKIPPED, TRIAL_SPEC_FILE, RunDir, TrialRecord, write_yaml_atomic
from archspec.search.space import SearchSpec, TaskRef

TrainFn = Callable[..., Any]  # train(spec, task, *, steps, seed, device, out_dir, ...) -> TrainResult
RECORD_KEY = "archspec_record"  # the reported result's copy of the trial record
# Starts the reason of a trial whose training went fine but did not produce an objective:
# a misspelt metric name, which every further trial would repeat.
MISSING_OBJECTIVES = "objective metric(s) missing or not finite:"


@dataclass(frozen=True)
class TrialSetup:
    """What every trial of a search needs; shipped to the Ray workers."""

    run_dir: str
    search: SearchSpec
    # The training function; None means `archspec.search.trainer.train`. Tests and
    # researchers with their own training loop inject one with the same signature.
    train_fn: TrainFn | None = None

    @property
    def run(self) -> RunDir:
        return RunDir(self.run_dir)


@dataclass
class Verdict:
    """Whether a proposal may be trained; its cost-model metrics either way."""

    status: str  # OK, SKIPPED or INVALID
    reason: str | None = None
    cost: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ReportedMetrics:
    """The metric names a trial of a search reports, known before anything trains:
    exact names, and patterns for names that depend on the model (`q_geo@<layer>`)."""

    names: tuple[str, ...]
    patterns: dict[str, Any] = field(default_factory=dict)  # shown form -> compiled regex

    def __contains__(self, metric: object) -> bool:
        return metric in self.names or any(p.fullmatch(str(metric)) for p in self.patterns.values())

    def listing(self) -> str:
        return ", ".join([*self.names, *self.patterns])

    def closest(self, metric: str) -> str | None:
        import difflib

        close = difflib.get_close_matches(metric, [*self.names, *self.patterns], n=1, cutoff=0.6)
        return close[0] if close else None


def trainer_metrics(task: Any, *, throughput: bool = True, cuda: bool = False, diagnostics: bool = False) -> ReportedMetrics:
    """What the stock trainer reports for `task`: its evaluation metrics
    (`Task.metric_names`), the cost model's, the measured `tokens_per_s` (with
    `throughput`), `peak_mem_bytes` (on CUDA only: it is not measured on the CPU) and,
    with `diagnostics`, the diagnostics (their names depend on the model: patterns)."""
    from archspec.search.space import COST_METRICS

    names = [*task.metric_names(), *COST_METRICS]
    if throughput:
        names.append("tokens_per_s")
        if cuda:
            names.append("peak_mem_bytes")
    patterns: dict[str, Any] = {}
    if diagnostics:
        from archspec.search.diagnostics import METRIC_PATTERNS

        patterns = dict(METRIC_PATTERNS)
    return ReportedMetrics(tuple(names), patterns)


def reported_metrics(search: SearchSpec, tasks: list[Any]) -> ReportedMetrics:
    """What `execute_trial` puts in a record's metrics with the stock trainer: the
    trainer's metrics (`trainer_metrics`; trials train on CUDA when they reserve a GPU);
    with several tasks each prefixed `task/`, plus the cost metrics unprefixed (see the
    module docstring)."""
    import re

    from archspec.search.space import COST_METRICS

    options = dict(throughput=search.train.get("measure_throughput", True) is not False,
                   cuda=search.resources.uses_gpu, diagnostics=bool(search.train.get("diagnostics")))
    per_task = {task.name: trainer_metrics(task, **options) for task in tasks}
    if len(tasks) == 1:
        return per_task[tasks[0].name]
    names = [f"{name}/{metric}" for name, reported in per_task.items() for metric in reported.names]
    patterns = {f"{name}/{shown}": re.compile(re.escape(name + "/") + pattern.pattern)
                for name, reported in per_task.items() for shown, pattern in reported.patterns.items()}
    return ReportedMetrics(tuple([*names, *COST_METRICS]), patterns)


def make_task(ref: TaskRef) -> Any:
    from archspec.search.tasks import get_task

    return get_task(ref.name, preset=ref.preset, **ref.options)


def compose_spec(base: Any, overrides: Mapping[str, Any], *, name: str | None = None, task: Any = None) -> Any:
    """The trial's model spec: the base spec (a `RunDir`'s base.yaml, a file or a `Spec`),
    the sampled overrides, the task's vocabulary."""
    from archspec import load_spec

    items: list[tuple[str, Any]] = list(overrides.items())
    if name is not None:
        items.append(("name", name))
    if task is not None:
        items.append(("model.vocab_size", int(task.vocab_size)))
    return load_spec(base.base_file if isinstance(base, RunDir) else base, items)


def cost_metrics(spec: Any, gpu: bool) -> dict[str, float]:
    """Params, FLOPs per token (at the cost model's reference length, of the recurrence's
    path where the trial runs: the Triton kernel on a GPU) and state bytes."""
    from archspec.cost import estimate

    return estimate(spec, device="cuda" if gpu else "cpu").metrics()


def check_proposal(base: Any, overrides: Mapping[str, Any], constraints: list[Any], tasks: list[Any], *, gpu: bool) -> Verdict:
    """Whether base + overrides is a valid spec (for every task's vocabulary) within the
    constraints, from the cost model (of the path the trial runs: `gpu`): nothing is built."""
    first_cost: dict[str, float] = {}
    for task in tasks:
        try:
            spec = compose_spec(base, overrides, task=task)
        except ArchspecError as exc:
            return Verdict(INVALID, _one_line(exc))
        cost = cost_metrics(spec, gpu=gpu)
        first_cost = first_cost or cost
        broken = [f"{c.metric} = {number(cost[c.metric])} violates {c.shown()}" for c in constraints if not c.holds(cost[c.metric])]
        if broken:
            suffix = f" (task {task.name})" if len(tasks) > 1 else ""
            return Verdict(SKIPPED, "; ".join(broken) + suffix, cost)
    return Verdict(OK, None, first_cost)


def precheck(setup: TrialSetup, overrides: Mapping[str, Any], tasks: list[Any] | None = None) -> Verdict:
    """Validate the trial's spec and check the constraints from the cost model, per task."""
    tasks = tasks if tasks is not None else [make_task(ref) for ref in setup.search.tasks]
    return check_proposal(setup.run, overrides, setup.search.constraints, tasks, gpu=setup.search.resources.uses_gpu)


def _one_line(exc: ArchspecError) -> str:
    problems = [f"{f + ': ' if f else ''}{m}" for _, f, m in exc.problems]
    return "; ".join(problems) if problems else str(exc)


def device_for(setup: TrialSetup) -> str:
    """`cuda:0`, the first GPU Ray made visible (CUDA_VISIBLE_DEVICES), when the trial
    reserved a GPU and CUDA is there, else CPU (`search/placement.py`)."""
    import torch

    from archspec.search.placement import trial_device

    return trial_device(setup.search.resources.uses_gpu, torch.cuda.device_count() if torch.cuda.is_available() else 0)


# Keyword arguments the search passes itself; `train:` in the search spec may not set them.
SEARCH_SETS = ("steps", "seed", "device", "out_dir", "quiet", "time_limit_s", "on_validation", "data_parallel")
# The training function's hook for validation results during training: passed only to a
# function that names it (the stock trainer does), whose results then reach Ray as they come.
ON_VALIDATION = "on_validation"
STEP_KEY = "step"  # the training steps a reported result stands at (all tasks so far): ASHA's time


def train_kwargs(search: SearchSpec, device: str, out_dir: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(steps=search.budget.steps, seed=search.seed, device=device, out_dir=out_dir, quiet=True)
    if search.budget.time_per_trial is not None:
        kwargs["time_limit_s"] = search.budget.time_per_trial
    return {**kwargs, **search.train}


def unaccepted(train_fn: TrainFn, names: list[str]) -> list[str]:
    """The keyword arguments `train_fn` would refuse."""
    parameters = inspect.signature(train_fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []
    return [n for n in names if n not in parameters]


def takes_progress(train_fn: TrainFn) -> bool:
    """Whether `train_fn` reports validation results while it trains (names `on_validation`)."""
    return ON_VALIDATION in inspect.signature(train_fn).parameters


def _call_train(train_fn: TrainFn, spec: Any, task: Any, setup: TrialSetup, out_dir: str, device: str,
                on_validation: Callable[[int, dict[str, float]], None] | None = None) -> Any:
    kwargs = train_kwargs(setup.search, device, out_dir)
    from archspec.search.distributed import train_data_parallel, world_size

    processes = world_size(setup.search.resources)
    refused = unaccepted(train_fn, list(kwargs) + (["data_parallel"] if processes > 1 else []))
    if refused:
        raise ArchspecError(f"the training function does not accept {', '.join(refused)} (set by the search spec)")
    if processes > 1:  # one model on several GPUs (or CPU processes): DistributedDataParallel
        # The ranks run in processes of their own, which cannot call back into this Ray
        # worker: a data-parallel trial reports once, at its end (no early stopping).
        return train_data_parallel(train_fn, spec, task, kwargs, processes, cuda=device.startswith("cuda"),
                                   threads=int(setup.search.resources.cpu) // processes)
    if on_validation is not None and takes_progress(train_fn):
        kwargs[ON_VALIDATION] = on_validation
    return train_fn(spec, task, **kwargs)


def _progress_reporter(
    setup: TrialSetup, number: int, task: Any, index: int, several: bool, report: Callable[[dict[str, Any]], None]
) -> Callable[[int, dict[str, float]], None]:
    """`on_validation` for task `index` of the trial: each validation, as a result for Ray."""
    offset = index * setup.search.budget.steps  # the tasks train one after the other

    def on_validation(step: int, metrics: dict[str, float]) -> None:
        named = {(f"{task.name}/{k}" if several else k): _number(v) for k, v in metrics.items()}
        report(progress_payload(number, offset + step, named, setup.search))

    return on_validation


def execute_gpu_checks(setup: TrialSetup, overrides: Mapping[str, Any], tasks: list[Any], share: float) -> str | None:
    """On CUDA with a share of a GPU: cap this process at its share and refuse a trial
    whose memory estimate alone exceeds it; returns the reason to refuse, or None."""
    import torch

    from archspec.search.gpu_share import cap_process_memory, share_problem

    cap_process_memory(share)
    gpu_bytes = int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    needs = [training_bytes_of(setup, overrides, task) for task in tasks]
    return share_problem(needs, share, gpu_bytes)


def training_bytes_of(setup: TrialSetup, overrides: Mapping[str, Any], task: Any) -> int:
    """The memory estimate of one training step of the trial's spec on `task`."""
    from archspec.search.gpu_share import training_bytes

    return training_bytes(compose_spec(setup.run, overrides, task=task), task, setup.search.train)


def default_train() -> TrainFn:
    from archspec.search.trainer import train

    return train


def execute_trial(
    setup: TrialSetup, number: int, overrides: Mapping[str, Any], placement: Mapping[str, Any] | None = None,
    *, gpu_share: float | None = None, report: Callable[[dict[str, Any]], None] | None = None,
) -> TrialRecord:
    """Train one trial on every task and write its record; never raises for a bad trial.

    `gpu_share`: the fraction of a GPU the trial was given (on CUDA its allocations are
    capped there); `report(result)`: where validation results go while it trains (Ray)."""
    import torch

    from archspec.search.gpu_share import out_of_memory_reason, peak_bytes
    from archspec.search.worker_state import begin_trial

    run, search = setup.run, setup.search
    record = TrialRecord(number=number, status=None, overrides=dict(overrides), started_at=time.time(),
                         host=socket.gethostname(), placement=dict(placement or {}), pid=os.getpid())
    folder = run.trial_dir(number)
    try:
        record.device = device_for(setup)
        begin_trial(record.device)  # a reused worker's peak is the last trial's until reset
        if placement is not None:  # under Ray: the GPUs it assigned are the ones the trial sees
            from archspec.search.placement import placement_problem

            problem = placement_problem(record.placement.get("gpu_ids", []))
            if problem:
                raise ArchspecError(problem)
        _limit_threads(search.resources.cpu)
        run.write_trial_start(record)
        tasks = [make_task(ref) for ref in search.tasks]
        verdict = precheck(setup, overrides, tasks)
        record.metrics.update(verdict.cost)
        if verdict.status != OK:
            record.status, record.reason = verdict.status, verdict.reason
            return _finish(run, record)
        if record.device.startswith("cuda") and gpu_share is not None:
            refused = execute_gpu_checks(setup, overrides, tasks, gpu_share)
            if refused:
                record.status, record.reason = FAILED, refused
                return _finish(run, record)
        spec = compose_spec(run, overrides, name=f"{search.name}-{number:05d}")
        write_yaml_atomic(folder / TRIAL_SPEC_FILE, spec.model_dump(mode="json", exclude_none=True))
        train_fn = setup.train_fn or default_train()
        statuses: list[tuple[str, str | None]] = []
        for index, task in enumerate(tasks):
            out_dir = folder / task.name
            progress = _progress_reporter(setup, number, task, index, len(tasks) > 1, report) if report else None
            result = _call_train(train_fn, spec, task, setup, str(out_dir), record.device, progress)
            metrics = {k: _number(v) for k, v in dict(result.metrics).items()}
            if len(tasks) == 1:
                record.metrics.update(metrics)
            else:
                record.metrics.update({f"{task.name}/{k}": v for k, v in metrics.items()})
            statuses.append((result.status, result.reason))
        record.status, record.reason = _combine(statuses, [t.name for t in tasks])
        if record.status == OK:
            missing = [m for m in search.metric_names if not _finite(record.metrics.get(m))]
            if missing:
                record.status = FAILED
                record.reason = (f"{MISSING_OBJECTIVES} {', '.join(missing)}; the trial reported "
                                 f"{', '.join(sorted(k for k, v in record.metrics.items() if _finite(v)))}")
    except ArchspecError as exc:
        record.status, record.reason = FAILED, _one_line(exc)
    except torch.OutOfMemoryError as exc:  # outside the trainer's own handling (building, moving the model)
        peak = peak_bytes(record.device or "cpu")
        record.status, record.reason = FAILED, out_of_memory_reason(exc, peak)
        if peak is not None:
            record.metrics["peak_mem_bytes"] = float(peak)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "error.txt").write_text(traceback.format_exc(), encoding="utf-8")
    except Exception as exc:  # a crash in one trial must not end the search
        record.status, record.reason = FAILED, f"{type(exc).__name__}: {exc}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "error.txt").write_text(traceback.format_exc(), encoding="utf-8")
    return _finish(run, record)


def _limit_threads(cpus: float) -> None:
    """Use the CPUs the trial reserved, not every core of the node (trials share it)."""
    import torch

    torch.set_num_threads(max(1, int(cpus)))


def _finish(run: RunDir, record: TrialRecord) -> TrialRecord:
    record.finished_at = time.time()
    taken = run.occupant(record.number, record.overrides)
    if taken:  # another point's trial is there: report the failure, write nothing over it
        record.status, record.reason = FAILED, taken
        return record
    run.write_trial_result(record)
    return record


def _combine(statuses: list[tuple[str, str | None]], names: list[str]) -> tuple[str, str | None]:
    """Several tasks: the trial is as bad as its worst task (failed > diverged > ok)."""
    for worst in (FAILED, DIVERGED):
        bad = [(n, r) for n, (s, r) in zip(names, statuses) if s == worst]
        if bad:
            reasons = "; ".join(f"{n}: {r}" if len(names) > 1 else str(r) for n, r in bad)
            return worst, reasons
    unknown = [s for s, _ in statuses if s not in (OK, FAILED, DIVERGED)]
    if unknown:
        return FAILED, f"the trainer returned an unknown status {unknown[0]!r}"
    return OK, None


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def report_payload(record: TrialRecord, metric_names: list[str], *, step: int | None = None,
                   scheduler_metric: str | None = None) -> dict[str, Any]:
    """What the trial reports to Ray at its end: the objectives when it is ok, and the
    whole record.

    The record travels along (as JSON text: Ray flattens nested results) so that the
    driver can write `result.json` itself when the worker ran on a node whose files it
    cannot see. Ray insists on every objective key in every result: a trial that is not
    ok reports them as None.
    """
    payload: dict[str, Any] = {"trial_number": record.number, "status": record.status, RECORD_KEY: json.dumps(record.to_json())}
    if step is not None:
        payload[STEP_KEY] = step
    payload.update({m: record.metrics.get(m) if record.status == OK else None for m in metric_names})
    return _with_scheduler_metric(payload, record.metrics, scheduler_metric)


PROGRESS = "running"  # the status of a result reported while the trial trains


def progress_payload(number: int, step: int, metrics: Mapping[str, float | None], search: SearchSpec) -> dict[str, Any]:
    """A validation result reported while the trial trains: its metrics and the step.
    Objectives not among them are None (Ray wants every objective key in every result)."""
    payload: dict[str, Any] = {"trial_number": number, "status": PROGRESS, STEP_KEY: step, **metrics}
    payload.update({m: metrics.get(m) for m in search.metric_names})
    return _with_scheduler_metric(payload, metrics, search.scheduler.metric if search.scheduler else None)


def _with_scheduler_metric(payload: dict[str, Any], metrics: Mapping[str, Any], metric: str | None) -> dict[str, Any]:
    """The scheduler's metric in every result, NaN where this one does not have it: Ray
    wants the key in every result, and ASHA leaves NaN out of its rungs (None would break it)."""
    if metric is not None:
        value = metrics.get(metric)
        payload[metric] = float(value) if _finite(value) else float("nan")
    return payload


def record_from_result(result: Mapping[str, Any] | None) -> TrialRecord | None:
    """The trial record a reported result carries, if any."""
    text = (result or {}).get(RECORD_KEY)
    return TrialRecord.from_json(json.loads(text)) if text else None


def trainable(config: dict[str, Any], setup: TrialSetup) -> None:
    """The Ray Tune function trainable (bound with `tune.with_parameters`)."""
    import ray
    from ray import tune

    from archspec.search.placement import trial_placement
    from archspec.search.worker_state import WorkerRetired, end_trial

    context = ray.get_runtime_context()
    share = config.get(GPU_SHARE_KEY)
    placement = trial_placement(ray.get_gpu_ids(), node_id=context.get_node_id(), cluster=context.gcs_address)
    if share is not None:
        placement["gpu_share"] = share
    record = execute_trial(setup, int(config["trial_number"]), config["overrides"], placement,
                           gpu_share=share, report=tune.report)
    # Ray may hand this worker the next trial (`reuse_actors`): leave it clean before the
    # last report, since Ray waits only briefly for the function to return after it.
    broken = end_trial(record.device)
    search = setup.search
    tune.report(report_payload(record, search.metric_names, step=search.budget.steps * len(search.tasks),
                               scheduler_metric=search.scheduler.metric if search.scheduler else None))
    if broken:  # the record is reported; an error now makes Ray end this worker instead of reusing it
        raise WorkerRetired(f"trial {record.number} left this worker's CUDA context unusable ({broken}); "
                            "the worker is retired")


GPU_SHARE_KEY = "gpu_share"  # the trial's config: the fraction of a GPU it reserved

