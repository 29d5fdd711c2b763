"""A training run's artifacts: the best weights, and the state to resume from.

The trainer's output directory (`archspec train --out DIR`, and every search trial's
`trials/NNNNN/<task>/`) holds, beside `metrics.json`:

```
DIR/
  model.safetensors   the best weights by the task's validation metric (the last ones
                      when the task has none); its metadata says the step, metric, value
  spec.yaml           the fully resolved spec: `archspec.load(DIR)` rebuilds the model
  resume.pt           while the run is unfinished: everything `--resume` needs
```

The run's final evaluation (the scores in `metrics.json`) is of the best weights, so the
scores and the saved model agree; the loop keeps them in memory whether or not a
directory is written.

`resume.pt` is written at every validation (`eval_every` steps) and removed when the run
ends (finished, early-stopped, time-limited or diverged); a run that was interrupted or
failed keeps it. It holds the weights, the optimizer's state, the learning-rate
schedule's position, the random states (the data generator's, which is the data
position, and torch's), the loss history and validations so far, the best value so
far, and a fingerprint of the run's settings (spec, task, training settings, seed): a
resume with other settings is refused and the differing fields named, because it would
not continue the same run. Resuming from step s gives the same weights and losses as the
run that never stopped (on the CPU exactly; tests/search/test_checkpoints.py).

Every file is written atomically (`archspec/atomic.py`); the weights format and
`archspec.load` are `archspec/weights.py`'s.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from archspec import weights
from archspec.atomic import write_atomic
from archspec.errors import ArchspecError

from .tasks import ValidationMetric

RESUME_FILE = "resume.pt"
RESUME_FORMAT = "archspec-resume/1"
# The weights file's metadata keys for the checkpoint it holds.
STEP_KEY, METRIC_KEY, VALUE_KEY = "step", "metric", "value"


@dataclass
class TrainingState:
    """What the optimisation loop holds that a resume must restore."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data_generator: torch.Generator
    history: list[dict[str, float]]
    evals: list[dict[str, Any]]


@dataclass
class Best:
    """The checkpoint in `model.safetensors`."""

    step: int
    value: float | None  # None: the last weights of a task without a validation metric


def fingerprint(**settings: Any) -> str:
    """The run's settings as canonical JSON (what must match for a resume)."""
    return json.dumps(settings, sort_keys=True, default=str)


def _differences(saved: Any, now: Any, prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two JSON documents."""
    if isinstance(saved, dict) and isinstance(now, dict):
        names = []
        for key in sorted(set(saved) | set(now)):
            names += _differences(saved.get(key), now.get(key), f"{prefix}{key}.")
        return names
    return [] if saved == now else [f"{prefix[:-1]} ({saved!r} then, {now!r} now)"]


def _copy_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@dataclass
class Checkpoints:
    """The best weights of one run, and with `out_dir` its files (see the module docstring)."""

    out_dir: Path | None  # None: the best weights are kept in memory only
    spec: Any  # the resolved spec document, or None when trained from a bare ModelPlan
    metric: ValidationMetric | None
    settings: str  # `fingerprint(...)` of the run
    best: Best | None = None
    resumed_from: int | None = None
    _best_value: float | None = field(default=None, repr=False)
    _best_state: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def resume_path(self) -> Path:
        if self.out_dir is None:
            raise ArchspecError("resuming needs the run's output directory")
        return self.out_dir / RESUME_FILE

    @property
    def weights_path(self) -> Path | None:
        return None if self.out_dir is None else self.out_dir / weights.WEIGHTS_FILE

    def start(self) -> None:
        """Write the resolved spec (once: it does not change while training)."""
        if self.spec is not None and self.out_dir is not None:
            weights.write_spec(self.out_dir, self.spec)

    # -- during training ---------------------------------------------------------------
    def validated(self, step: int, metrics: dict[str, float], state: TrainingState) -> None:
        """After a validation: keep the weights if they are the best so far, then write
        the resume state (which records the best so far too)."""
        if self.metric is not None:
            value = float(metrics.get(self.metric.name, float("nan")))
            if self.metric.keeps(value, self._best_value):
                self._best_value = value
                self._best_state = _copy_state(state.model)
                self._save_weights(state.model, step, value)
        if self.out_dir is not None:
            self._save_resume(step, state)

    def _save_weights(self, model: nn.Module, step: int, value: float | None) -> None:
        self.best = Best(step, value)
        if self.out_dir is None:
            return
        metadata = {STEP_KEY: str(step)}
        if self.metric is not None and value is not None:
            metadata.update({METRIC_KEY: self.metric.name, VALUE_KEY: repr(value)})
        weights.save_state(self.weights_path, model, metadata)

    def restore_best(self, model: nn.Module) -> None:
        """Load the best weights into `model` (for the final evaluation); without a
        validation metric, or before any validation, the model keeps its last weights."""
        if self._best_state is not None:
            model.load_state_dict(self._best_state)

    def _save_resume(self, step: int, state: TrainingState) -> None:
        payload = {
            "format": RESUME_FORMAT,
            "settings": self.settings,
            "step": step,
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "data_rng": state.data_generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "history": state.history,
            "evals": state.evals,
            "best": None if self.best is None else {"step": self.best.step, "value": self.best.value},
            "best_model": self._best_state,
        }
        write_atomic(self.resume_path, lambda handle: torch.save(payload, handle))

    def finish(self, model: nn.Module, step: int, *, weights_ok: bool) -> None:
        """The run ended and will not be resumed: make sure `model.safetensors` exists
        (the last weights when no validation picked any, unless they are not `weights_ok`,
        as after a divergence) and remove the resume state."""
        if self.best is None and weights_ok:
            self._save_weights(model, step, None)
        if self.out_dir is not None:
            self.resume_path.unlink(missing_ok=True)

    def record(self) -> dict[str, Any] | None:
        """What metrics.json says about the saved weights."""
        if self.best is None or self.out_dir is None:
            return None
        entry: dict[str, Any] = {"weights": weights.WEIGHTS_FILE, "step": self.best.step}
        if self.best.value is not None and self.metric is not None:
            entry.update(metric=self.metric.name, value=self.best.value,
                         higher_is_better=self.metric.higher_is_better)
        if self.spec is not None:
            entry["spec"] = weights.SPEC_FILE
        if self.resumed_from is not None:
            entry["resumed_from_step"] = self.resumed_from
        return entry

    # -- resuming ----------------------------------------------------------------------
    def load_resume(self) -> dict[str, Any]:
        """The saved resume state, checked against this run's settings."""
        path = self.resume_path
        if not path.is_file():
            raise ArchspecError(f"{self.out_dir}: no {RESUME_FILE} to resume from (a run keeps one while it is "
                                "unfinished; a finished run removes it)")
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several types for a file it cannot read
            raise ArchspecError(f"{path}: not a readable resume state ({exc.__class__.__name__}: {exc})") from None
        if not isinstance(payload, dict) or payload.get("format") != RESUME_FORMAT:
            raise ArchspecError(f"{path}: not an archspec resume state (expected format {RESUME_FORMAT})")
        if payload["settings"] != self.settings:
            changed = _differences(json.loads(payload["settings"]), json.loads(self.settings))
            raise ArchspecError(f"{path}: the run was started with other settings, so resuming would not continue "
                                f"it: {'; '.join(changed)}")
        return payload

    def restore(self, payload: dict[str, Any], state: TrainingState) -> int:
        """Put the loop back where `payload` left it; returns the last step done."""
        state.model.load_state_dict(payload["model"])
        state.optimizer.load_state_dict(payload["optimizer"])
        state.scheduler.load_state_dict(payload["scheduler"])
        state.data_generator.set_state(payload["data_rng"])
        torch.set_rng_state(payload["torch_rng"])
        if payload["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(payload["cuda_rng"])
        state.history[:] = payload["history"]
        state.evals[:] = payload["evals"]
        best = payload["best"]
        if best is not None:
            self.best = Best(int(best["step"]), best["value"])
            self._best_value = best["value"]
        self._best_state = payload["best_model"]
        self.resumed_from = int(payload["step"])
        return self.resumed_from


def unfinished_step(out_dir: str | os.PathLike[str]) -> int | None:
    """The step of an unfinished run's resume state in `out_dir`, or None."""
    path = Path(out_dir) / RESUME_FILE
    if not path.is_file():
        return None
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True)["step"])
    except Exception:  # unreadable: still an unfinished run's file; the resume names the problem
        return -1
