"""The Task protocol: what the trainer needs from a quality task.

A task generates its own data (seeded `torch.Generator`, nothing downloaded), scores a
model's predictions, and says how it is trained by default (`TrainPreset`). The seam
with the rest of the project is `docs/interfaces.md` ("search"):

- `vocab_size`; `train_batch(batch_size, generator) -> Batch(inputs, targets, mask)`;
- `eval_sets() -> {split: Batch}` (fixed, seeded by `eval_seed`, cached);
- `metrics(logits, targets, mask, split) -> {name: float}`.

Targets are aligned with inputs: the prediction at position `t` (the logits the causal
model produces after reading `inputs[:, :t+1]`) is scored against `targets[:, t]` where
`mask[:, t]` is true.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, NamedTuple

import torch

from ..metrics import TokenOutcome, outcome_from_logits

Tensor = torch.Tensor

# Evaluation data are drawn from a generator seeded far from any training seed, so that
# `--seed 0..N` never reproduces an evaluation batch.
EVAL_SEED_OFFSET = 1 << 40


class Batch(NamedTuple):
    """`inputs` and `targets` `[N, T]` (int64), `mask` `[N, T]` (bool)."""

    inputs: Tensor
    targets: Tensor
    mask: Tensor


@dataclass(frozen=True)
class TrainPreset:
    """How a task is trained unless flags say otherwise."""

    steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    eval_every: int
    weight_decay: float = 0.01
    grad_clip: float = 1.0


class ValidationMetric(NamedTuple):
    """The validation metric that ranks checkpoints of a run: its name in the validation
    splits' metrics and which way is better."""

    name: str
    higher_is_better: bool = True

    def keeps(self, value: float, best: float | None) -> bool:
        """Whether a checkpoint scoring `value` replaces the best so far (None: nothing
        yet): when it is at least as good, since on a tie it has trained longer. NaN never."""
        if value != value:
            return False
        if best is None:
            return True
        return value >= best if self.higher_is_better else value <= best


@dataclass(frozen=True)
class Preset:
    """A named size of a task: its data options and its training settings."""

    task_options: dict[str, Any]
    train: TrainPreset


@dataclass(frozen=True)
class Curve:
    """A curve for the accuracy plot: `values[i]` at `positions[i]`, or at position `i + 1`
    when `positions` is None (per-position curves)."""

    label: str
    values: list[float]
    ylabel: str = "accuracy"
    positions: list[int] | None = None


class Task(ABC):
    """Base class of every task; subclasses are dataclasses of their options (each with
    an `eval_seed: int = 0` field) and set the identity attributes in `__post_init__`."""

    name: str
    vocab_size: int
    train_len: int  # longest training sequence, the length throughput is measured at
    eval_seed: int
    # Set by `get_task` from the chosen preset; None when the task was built directly.
    preset: TrainPreset | None = None

    @property
    def validation_metric(self) -> ValidationMetric | None:
        """The metric that picks a run's best checkpoint (None: the last one is kept)."""
        return None

    @property
    def early_stop(self) -> tuple[str, float] | None:
        """Stop training once this validation metric reaches the threshold (None: never)."""
        return None

    # -- data -------------------------------------------------------------------------
    @abstractmethod
    def train_batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        """A fresh training batch drawn with `generator` (CPU tensors)."""

    @abstractmethod
    def _make_eval_sets(self, generator: torch.Generator) -> dict[str, Batch]:
        """The evaluation splits, drawn from the fixed evaluation generator."""

    def _make_validation_sets(self, generator: torch.Generator) -> dict[str, Batch]:
        """Smaller in-distribution splits checked during training (early stop).
        By default the evaluation sets themselves."""
        return self._make_eval_sets(generator)

    def eval_sets(self) -> dict[str, Batch]:
        if not hasattr(self, "_eval_cache"):
            self._eval_cache = self._make_eval_sets(self._generator(1))
        return self._eval_cache

    def validation_sets(self) -> dict[str, Batch]:
        if not hasattr(self, "_validation_cache"):
            self._validation_cache = self._make_validation_sets(self._generator(2))
        return self._validation_cache

    def _generator(self, stream: int) -> torch.Generator:
        return torch.Generator().manual_seed(EVAL_SEED_OFFSET + 1000 * self.eval_seed + stream)

    # -- scoring ----------------------------------------------------------------------
    def metrics(self, logits: Tensor, targets: Tensor, mask: Tensor, split: str) -> dict[str, float]:
        """Metrics of one evaluation split from the model's logits `[N, T, vocab]`."""
        return self.score(outcome_from_logits(logits, targets, mask), split)

    @abstractmethod
    def score(self, outcome: TokenOutcome, split: str) -> dict[str, float]:
        """Metrics of one split from its outcomes (see `search.metrics`)."""

    def metric_names(self) -> list[str]:
        """The names the trainer's evaluation reports for this task, before any training.

        Found by scoring one sequence of each evaluation split with uniform predictions
        through the same `score` and `summarize` the trainer calls, so that the list
        cannot drift from what a run reports (a search checks its objectives against it).
        """
        return self._names_scored(self.eval_sets())

    def validation_metric_names(self) -> list[str]:
        """The names each validation during training reports (what a Ray scheduler such as
        ASHA can watch), found as `metric_names` finds the evaluation's."""
        return self._names_scored(self.validation_sets())

    def _names_scored(self, splits: dict[str, Batch]) -> list[str]:
        metrics: dict[str, float] = {}
        for split, batch in splits.items():
            inputs, targets, mask = (t[:1] for t in batch)
            uniform = torch.zeros(*targets.shape, self.vocab_size)
            metrics.update(self.score(outcome_from_logits(uniform, targets, mask), split))
        metrics.update(self.summarize(metrics))
        return list(metrics)

    def curves(self, outcome: TokenOutcome, split: str) -> list[Curve]:
        """Per-position curves for the accuracy plot (none by default)."""
        return []

    def summarize(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics that combine several splits (e.g. a mean over test lengths)."""
        return {}

    def summary_curves(self, metrics: dict[str, float]) -> list[Curve]:
        """Curves across splits (e.g. accuracy against test length); none by default."""
        return []

    @property
    def plot_train_len(self) -> int:
        """Where the plots mark the training length (in the curves' position units)."""
        return self.train_len

    def diagnostic_batch(self, max_sequences: int = 16) -> Batch:
        """A few evaluation sequences to replay for diagnostics: the longest split."""
        splits = self.eval_sets()
        longest = max(splits.values(), key=lambda b: b.inputs.shape[1])
        return Batch(*(t[:max_sequences] for t in longest))

    def describe(self) -> dict[str, Any]:
        """The task's name and options, for metrics.json."""
        options = {f.name: getattr(self, f.name) for f in fields(self)} if is_dataclass(self) else {}
        return {"name": self.name, **options}
