"""Train one spec on one task and score it: `train(spec, task, ...) -> TrainResult`.

The training step is `archspec.training`'s (the one `archspec bench` times): AdamW (fused
on CUDA) with linear warm-up and cosine decay, gradient clipping, bfloat16 autocast over
float32 weights on CUDA, the forward, loss and backward replayed from a CUDA graph on CUDA
where the model allows it (`TrainingStep`), the loss straight from the hidden rows (no
logits), early stop
once the task's validation metric reaches its target, a rich progress bar on a
terminal, plain progress lines in a log (`search/progress.py`), silence for search
trials. Deterministic under `seed` on the CPU: the weights
come from `torch.manual_seed(seed)`, the data from a generator seeded with `seed`, the
evaluation data from the task's own fixed seed.

A NaN or infinite loss (or gradient norm) stops the run with status `diverged` and the
step in `reason`; an error while training (out of memory, a kernel failure) gives status
`failed`. Neither raises: the search records them. A spec the user got wrong still raises
`ArchspecError` before anything runs.

With `out_dir`, writes `metrics.json` atomically (`{"status", "reason", "metrics": {name:
float}, "spec", "task", "train", "curves", "history", "checkpoint", ...}`), `accuracy.png`,
`training.png` (loss and validation metrics by step), with `diagnostics=True`
`diagnostics.png` (see `search/diagnostics.py`), and the trained model:
`model.safetensors` (the best weights by the task's validation metric) with `spec.yaml`,
which `archspec.load(out_dir)` rebuilds, and while the run is unfinished `resume.pt`, from
which `resume=True` continues it exactly (`search/checkpoints.py`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from archspec.atomic import write_text_atomic
from archspec.blocks.loss import masked_labels
from archspec.errors import ArchspecError
from archspec.throughput import measure_training_throughput
from archspec.training import TrainingStep, autocast_for, make_optimizer as make_adamw

from .checkpoints import Checkpoints, TrainingState, fingerprint
from .gpu_share import out_of_memory_reason, peak_bytes
from .metrics import concat_outcomes, outcome_from_logits
from .progress import training_progress
from .tasks import Task, get_task
from .tasks.base import Batch, Curve, TrainPreset

Status = str  # "ok" | "diverged" | "failed" ("interrupted" only in a metrics.json left by Ctrl-C)
METRICS_FILE = "metrics.json"
MAX_HISTORY = 500  # loss entries kept in metrics.json
TASK_SETS = "model.vocab_size"  # the spec field every task sets to its own vocabulary


@dataclass(frozen=True)
class TrainConfig(TrainPreset):
    """The optimisation settings of one run: a task's preset, flags on top, and what no
    preset changes."""

    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    betas: tuple[float, float] = (0.9, 0.95)
    early_stop: tuple[str, float] | None = None
    eval_batch_size: int = 256


@dataclass
class TrainResult:
    status: Status
    metrics: dict[str, float]
    reason: str | None = None
    steps_done: int = 0
    out_dir: Path | None = None
    record: dict[str, Any] = field(default_factory=dict, repr=False)  # what metrics.json holds


# --------------------------------------------------------------------------- model


@dataclass
class BuiltModel:
    model: nn.Module
    plan: Any  # blocks.ModelPlan
    spec_record: dict[str, Any]  # the resolved spec, for metrics.json


def build_model_for_task(spec: Any, task: Task, overrides: Iterable[Any] = ()) -> BuiltModel:
    """Load `spec` (path, dict, `Spec` or `ModelPlan`), apply `overrides` (`"key=value"`
    strings or `(key, value)` pairs), set the vocabulary from the task, and build it."""
    from archspec.blocks import build_model

    plan, spec_record = plan_for_task(spec, task, overrides)
    return BuiltModel(build_model(plan), plan, spec_record)


def plan_for_task(spec: Any, task: Task, overrides: Iterable[Any] = ()) -> tuple[Any, dict[str, Any]]:
    """The plan `build_model_for_task` builds, and the resolved spec for metrics.json."""
    from archspec.blocks import ModelPlan

    overrides = list(overrides)
    if isinstance(spec, ModelPlan):
        if overrides:
            raise ArchspecError("overrides apply to specs, not to a ModelPlan; change the plan instead")
        plan = dataclasses.replace(spec, vocab_size=task.vocab_size)
        return plan, {"plan": plan.to_dict()}

    import archspec
    from archspec.spec.yaml_source import override_keys

    for key, where in override_keys(overrides):
        if key == TASK_SETS:  # it would be replaced below: refuse rather than ignore it
            raise ArchspecError("an override that cannot take effect", [(where, key, f"{key} is set from the task "
                                f"({task.name} has {task.vocab_size} symbols); remove this override")])
    resolved = archspec.load_spec(spec, [*overrides, (TASK_SETS, task.vocab_size)])
    return archspec.lower(resolved), resolved.model_dump(mode="json", exclude={"extends"})


def cost_metrics(plan: Any, device: Any = "cpu") -> dict[str, float]:
    """`params`, `flops_per_token` (at the reference length, of the recurrence's path on
    `device`) and `state_bytes`, analytic (the parameter count equals the module's:
    tests/blocks/test_cost.py)."""
    from archspec.cost import estimate

    return estimate(plan, device=device).metrics()


# --------------------------------------------------------------------------- schedule


def lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warm-up to 1 over `warmup_steps`, then cosine down to `min_lr_ratio`."""
    if config.warmup_steps > 0 and step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms, biases or gate scalars); fused on CUDA."""
    return make_adamw(model, lr=config.lr, weight_decay=config.weight_decay, betas=config.betas)


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(
    model: nn.Module, task: Task, splits: Mapping[str, Batch], device: torch.device, batch_size: int, with_curves: bool
) -> tuple[dict[str, float], dict[str, list[Curve]]]:
    """Task metrics (and per-position curves) of `model` on each split."""
    was_training = model.training
    model.eval()
    metrics: dict[str, float] = {}
    curves: dict[str, list[Curve]] = {}
    for split, batch in splits.items():
        parts = []
        for lo in range(0, batch.inputs.shape[0], batch_size):
            inputs, targets, mask = (t[lo : lo + batch_size] for t in batch)
            with autocast_for(device):
                logits = model(inputs.to(device))
            parts.append(outcome_from_logits(logits, targets.to(device), mask.to(device)))
        outcome = concat_outcomes(parts)
        metrics.update(task.score(outcome, split))
        if with_curves:
            curves[split] = task.curves(outcome, split)
    metrics.update(task.summarize(metrics))
    if with_curves and (across := task.summary_curves(metrics)):
        curves["by length"] = across
    model.train(was_training)
    return metrics, curves


# --------------------------------------------------------------------------- the loop


class _Diverged(Exception):
    def __init__(self, reason: str, step: int):
        super().__init__(reason)
        self.reason, self.step = reason, step


def json_safe(value: Any) -> Any:
    """NaN and infinities become null: metrics.json stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_metrics(out_dir: Path, record: dict[str, Any]) -> Path:
    path = out_dir / METRICS_FILE
    write_text_atomic(path, json.dumps(json_safe(record), indent=2, allow_nan=False) + "\n")
    return path


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ArchspecError(f"device {device}: no CUDA device is available here")
    return device


def train(
    spec: Any,
    task: Task | str,
    *,
    steps: int | None = None,
    seed: int = 0,
    device: str | torch.device | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    overrides: Iterable[Any] = (),
    diagnostics: bool = False,
    quiet: bool = False,
    preset: str = "cpu",
    task_options: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    warmup_steps: int | None = None,
    eval_every: int | None = None,
    target: float | None = None,
    backend: str | None = None,
    measure_throughput: bool = True,
    time_limit_s: float | None = None,
    spec_label: str | None = None,
    save_weights: bool = True,
    resume: bool = False,
    progress_label: str | None = None,
    on_validation: Callable[[int, dict[str, float]], None] | None = None,
    data_parallel: Any = None,
    activation_checkpointing: int = 0,
) -> TrainResult:
    """Train `spec` on `task` (a `Task` or a name for `get_task(name, preset, **task_options)`).

    `steps`, `batch_size`, `lr`, `warmup_steps`, `eval_every` override the task preset;
    `target` overrides the early-stop threshold (0 disables early stopping); `backend`
    forces a kernel backend (`torch`, `naive`, `triton`). `activation_checkpointing` n
    checkpoints every n-th block (`LanguageModel.set_activation_checkpointing`; 0: none):
    the same gradients for less memory and a forward more of those blocks, so the memory
    check and the measured `peak_mem_bytes` and `tokens_per_s` are those of that training,
    and a resume may change it. `time_limit_s` ends the
    optimisation early (then evaluates as usual; `train.time_limited` in metrics.json).
    On CUDA the step is replayed from a CUDA graph where the model allows it
    (`archspec.training.TrainingStep`); `train.cuda_graph` in metrics.json says whether the
    last step was, `train.eager_step` why not.
    With `out_dir`, the weights are saved unless `save_weights=False`; `resume=True`
    continues the unfinished run in `out_dir` from its last validation (the same
    settings are required: the error names any that differ). `progress_label` names the
    progress bar (or the plain progress lines when the output is not a terminal); by
    default `<spec name> on <task>`. `on_validation(step, metrics)` is called after each
    validation during training (a search reports them to Ray, whose scheduler may stop
    the trial there). `data_parallel` (a `search.distributed.DataParallel`, given by the
    launcher of a data-parallel trial to each of its processes) trains this process's rows
    of every global batch in DistributedDataParallel.
    Returns a `TrainResult`; never raises for a diverging or failing run (see the module
    docstring).
    """
    if isinstance(task, str):
        task = get_task(task, preset, **dict(task_options or {}))
    elif task_options:
        raise ArchspecError("task_options apply when the task is given by name")
    device = resolve_device(device)
    config = _config(task, steps, batch_size, lr, warmup_steps, eval_every, target)
    if isinstance(activation_checkpointing, bool) or not isinstance(activation_checkpointing, int) \
            or activation_checkpointing < 0:
        raise ArchspecError(f"bad training settings: activation_checkpointing must be an integer >= 0 (every n-th "
                            f"block; 0: none), got {activation_checkpointing!r}")
    if data_parallel is not None:
        data_parallel.rows(config.batch_size)  # refuses a global batch too small to split
    overrides = list(overrides)  # read twice: for the memory check, then to build

    _check_fits(spec, task, overrides, config, device, activation_checkpointing)
    torch.manual_seed(seed)
    built = build_model_for_task(spec, task, overrides)
    model = built.model.to(device)
    if backend is not None:
        model.set_backend(backend)
    if activation_checkpointing:
        model.set_activation_checkpointing(activation_checkpointing)
    # What the loop steps: the model, or the model in DDP (whose backward averages the
    # ranks' gradients); evaluation, checkpoints and weights use the model itself.
    stepper = model if data_parallel is None else data_parallel.wrap(model)

    out = Path(out_dir) if out_dir is not None else None
    if resume and (out is None or not save_weights):
        raise ArchspecError("resume needs the run's output directory and its saved state (out_dir, save_weights)")
    settings = fingerprint(spec=built.spec_record, task=task.describe(), train=dataclasses.asdict(config), seed=seed)
    from_plan = set(built.spec_record) == {"plan"}  # a bare ModelPlan has no spec to write
    checkpoints = Checkpoints(out if save_weights else None, None if from_plan else built.spec_record,
                              task.validation_metric, settings)
    resumed = checkpoints.load_resume() if resume else None

    record: dict[str, Any] = {
        "status": "running",
        "reason": None,
        "metrics": {},
        "spec": built.spec_record,
        "spec_source": spec_label if spec_label is not None else (str(spec) if isinstance(spec, (str, os.PathLike)) else None),
        "task": task.describe(),
        "train": {**dataclasses.asdict(config), "seed": seed, "device": str(device), "preset": preset,
                  "data_parallel": 1 if data_parallel is None else data_parallel.world_size,
                  "activation_checkpointing": activation_checkpointing},
    }
    metrics: dict[str, float] = cost_metrics(built.plan, device)

    status, reason, steps_done = "ok", None, 0
    curves: dict[str, list[Curve]] = {}
    history: list[dict[str, float]] = []
    evals: list[dict[str, Any]] = []
    started = time.perf_counter()
    # One step for the throughput measurement and the loop: on CUDA one graph, captured once
    # at the task's longest training sequence (drawn lengths are padded to it).
    train_step = TrainingStep(stepper, device=device, pad_to=task.train_len)
    try:
        if measure_throughput:
            rows = config.batch_size
            if data_parallel is not None:  # each rank times its rows; the trial's rate is their sum
                share = data_parallel.rows(config.batch_size)
                rows = share.stop - share.start
            report = measure_training_throughput(
                stepper, batch=rows, seq_len=task.train_len, device=device, vocab_size=task.vocab_size, step=train_step
            )
            metrics["tokens_per_s"] = (report.tokens_per_s if data_parallel is None
                                       else data_parallel.total(report.tokens_per_s))
            if report.peak_mem_bytes is not None:
                metrics["peak_mem_bytes"] = float(report.peak_mem_bytes)
            else:
                record["not_measured"] = {"peak_mem_bytes": report.peak_mem_note}
        deadline = None if time_limit_s is None else started + time_limit_s
        checkpoints.start()
        label = progress_label or f"{built.spec_record.get('name', 'model')} on {task.name}"
        steps_done, stop = _loop(model, task, config, seed, device, quiet, history, evals, deadline, checkpoints, resumed,
                                 label, train_step, data_parallel, on_validation)
        record["train"]["cuda_graph"] = train_step.graphed  # the last step's: replayed, or eager for eager_step
        record["train"]["eager_step"] = train_step.eager_reason
        record["train"]["early_stopped"] = stop == "target"
        record["train"]["time_limited"] = stop == "time"
        checkpoints.restore_best(model)  # the scores below are of the weights that are kept
        quality, curves = evaluate(model, task, task.eval_sets(), device, config.eval_batch_size, with_curves=True)
        metrics.update(quality)
        if diagnostics:
            from .diagnostics import collect

            report_d = collect(model, task.diagnostic_batch().inputs)
            metrics.update(report_d.metrics)
            record["diagnostics"] = {
                "erank": report_d.erank,
                "residual_ratio": report_d.residual_ratio,
                "layers": report_d.layers,
                "notes": {str(layer): note for layer, note in report_d.notes.items()},
            }
        checkpoints.finish(model, steps_done, weights_ok=True)
    except _Diverged as exc:
        status, reason, steps_done = "diverged", exc.reason, exc.step
        checkpoints.finish(model, steps_done, weights_ok=False)
    except torch.OutOfMemoryError as exc:  # the reason says so, with the peak it reached
        peak = peak_bytes(str(device))
        status, reason = "failed", out_of_memory_reason(exc, peak)
        if peak is not None:
            metrics["peak_mem_bytes"] = float(peak)
        record["traceback"] = traceback.format_exc()
    except RuntimeError as exc:  # a kernel failure: record it, do not crash
        status, reason = "failed", f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
    except KeyboardInterrupt:
        # Keep what the run measured, then let the interrupt end the program.
        record.update(status="interrupted", reason="interrupted by the user", metrics=metrics, history=history, evals=evals,
                      checkpoint=checkpoints.record())
        if out is not None:
            write_metrics(out, record)
        raise

    record["status"], record["reason"] = status, reason
    record["metrics"] = metrics
    record["train"].update(steps_done=steps_done, seconds=time.perf_counter() - started)
    record["history"] = history
    record["evals"] = evals
    record["checkpoint"] = checkpoints.record()
    record["curves"] = {
        split: [dataclasses.asdict(c) for c in split_curves] for split, split_curves in curves.items()
    }
    result = TrainResult(status, metrics, reason, steps_done, out, record)
    if out is not None:
        _write_outputs(out, record, curves, task, diagnostics)
    return result


def _check_fits(spec: Any, task: Task, overrides: Iterable[Any], config: TrainConfig, device: torch.device,
                checkpoint_every: int = 0) -> None:
    """Refuse a model that surely cannot be built or trained here, before building it."""
    from archspec.memory import check_fits

    plan, _ = plan_for_task(spec, task, overrides)
    what = f"spec {plan.name!r}"
    check_fits(plan, "cpu", what=what)  # built on the CPU, then moved
    check_fits(plan, device, batch=config.batch_size, seq_len=task.train_len, training=True, what=what,
               checkpoint_every=checkpoint_every)


def _config(
    task: Task,
    steps: int | None,
    batch_size: int | None,
    lr: float | None,
    warmup_steps: int | None,
    eval_every: int | None,
    target: float | None,
) -> TrainConfig:
    preset = task.preset
    if preset is None:
        raise ArchspecError(f"task {task.name!r} has no preset; build it with get_task")
    early = task.early_stop
    if target is not None:
        early = (early[0], target) if (early and target > 0) else None
    flags = {"steps": steps, "batch_size": batch_size, "lr": lr, "warmup_steps": warmup_steps, "eval_every": eval_every}
    config = TrainConfig(
        **{**dataclasses.asdict(preset), **{k: v for k, v in flags.items() if v is not None}},
        early_stop=early,
    )
    problems = []
    if config.steps < 0:
        problems.append(f"steps must be >= 0, got {config.steps}")
    if config.batch_size < 1:
        problems.append(f"batch size must be >= 1, got {config.batch_size}")
    if not (config.lr > 0 and math.isfinite(config.lr)):
        problems.append(f"learning rate must be a positive number, got {config.lr}")
    if config.warmup_steps < 0 or config.eval_every < 1:
        problems.append(f"need warmup_steps >= 0 and eval_every >= 1, got {config.warmup_steps}, {config.eval_every}")
    if problems:
        raise ArchspecError("bad training settings: " + "; ".join(problems))
    return config


def _loop(
    model: nn.Module,
    task: Task,
    config: TrainConfig,
    seed: int,
    device: torch.device,
    quiet: bool,
    history: list[dict[str, float]],
    evals: list[dict[str, Any]],
    deadline: float | None,
    checkpoints: Checkpoints,
    resumed: dict[str, Any] | None = None,
    label: str = "",
    train_step: TrainingStep | None = None,
    data_parallel: Any = None,
    on_validation: Callable[[int, dict[str, float]], None] | None = None,
) -> tuple[int, str | None]:
    """The optimisation loop; returns (steps done, why it stopped early: "target", "time"
    or None). Raises `_Diverged`. After each validation `checkpoints` keeps the best
    weights and the resume state; `resumed` (a loaded resume state) continues from it.
    `train_step` is the forward + loss + backward (`TrainingStep` of `model`, or of `model`
    in DDP for a data-parallel rank: a CUDA graph's replay where it can be);
    with `data_parallel` each rank trains on its rows of the global batch, records the
    global loss, and every rank stops when one would (`search/distributed.py`)."""
    train_step = TrainingStep(model, device=device) if train_step is None else train_step
    agreed = (lambda flag: flag) if data_parallel is None else data_parallel.any
    optimizer = make_optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    generator = torch.Generator().manual_seed(seed)
    state = TrainingState(model, optimizer, scheduler, generator, history, evals)
    done = 0 if resumed is None else checkpoints.restore(resumed, state)
    record_every = max(1, config.steps // MAX_HISTORY)
    watched = config.early_stop[0] if config.early_stop is not None else None
    model.train()
    step = done
    with training_progress(label or task.name, config.steps, quiet=quiet) as progress:
        for step in range(done + 1, config.steps + 1):
            inputs, targets, mask = task.train_batch(config.batch_size, generator)
            labels = masked_labels(targets, mask)
            weight = None
            if data_parallel is not None:  # this rank's rows, and their share of the global loss
                inputs, labels, weight = data_parallel.shard(inputs, labels)
            optimizer.zero_grad(set_to_none=True)
            loss = train_step(inputs.to(device), labels.to(device), scale=weight)  # forward, loss, backward
            shown = loss if data_parallel is None else data_parallel.average(loss)  # the global batch's loss
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            # One host read for both, after the backward is queued: a read between the forward
            # and the backward would leave the device idle while the host queues the backward.
            # A non-finite loss still stops the step before the optimizer touches the weights.
            loss_value, norm_value = torch.stack([shown.detach().double(), grad_norm.double()]).tolist()
            if not math.isfinite(loss_value):
                raise _Diverged(f"loss became {loss_value} at step {step}", step)
            if not math.isfinite(norm_value):
                raise _Diverged(f"gradient norm became {norm_value} at step {step}", step)
            optimizer.step()
            scheduler.step()

            if step % record_every == 0 or step == 1:
                history.append({"step": step, "loss": loss_value, "lr": optimizer.param_groups[0]["lr"]})
            progress.stepped(step, loss_value)
            if step % config.eval_every == 0 or step == config.steps:
                val, _ = evaluate(model, task, task.validation_sets(), device, config.eval_batch_size, with_curves=False)
                evals.append({"step": step, **val})
                checkpoints.validated(step, val, state)
                progress.validated(step, loss_value, val, watched)
                if on_validation is not None:
                    on_validation(step, dict(val))
                if config.early_stop is not None:
                    name, threshold = config.early_stop
                    value = val.get(name, float("nan"))
                    if agreed(value >= threshold):
                        return step, "target"
            if deadline is not None and agreed(time.perf_counter() > deadline):
                return step, "time"
    return step, None


def _write_outputs(out: Path, record: dict[str, Any], curves: dict[str, list[Curve]], task: Task, diagnostics: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    try:
        from . import plots
    except ImportError as exc:  # a bare GPU machine may lack matplotlib: the numbers still count
        files["plots_skipped"] = f"cannot import matplotlib ({exc})"
        plots = None
    if plots is not None:
        from .diagnostics import DiagnosticsReport

        spec_name = record["spec"].get("name", "") if isinstance(record["spec"], dict) else ""
        title = f"{spec_name} on {task.name}".strip()
        if curves:
            png = plots.plot_accuracy(curves, task.plot_train_len, out / "accuracy.png", title=title)
            if png is not None:
                files["accuracy_plot"] = png.name
        early_stop = record["train"].get("early_stop")
        png = plots.plot_training(record.get("history", []), record.get("evals", []), out / "training.png",
                                  title=title, watched=early_stop[0] if early_stop else None)
        if png is not None:
            files["training_plot"] = png.name
        if diagnostics and "diagnostics" in record:
            diag = record["diagnostics"]
            report = DiagnosticsReport(record["metrics"], diag["erank"], diag["residual_ratio"], diag.get("layers"),
                                       {int(k): v for k, v in diag.get("notes", {}).items()})
            png = plots.plot_diagnostics(report, task.train_len, out / "diagnostics.png", title=title)
            if png is not None:
                files["diagnostics_plot"] = png.name
    record["files"] = files
    write_metrics(out, record)
