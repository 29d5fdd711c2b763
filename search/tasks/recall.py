"""Multi-query associative recall (MQAR), after Zoology (Arora et al. 2023).

A sequence of `seq_len` tokens starts with `num_kv_pairs` key-value pairs
`k_1 v_1 k_2 v_2 ...` (distinct keys from `1 .. vocab/2 - 1`, distinct values from
`vocab/2 .. vocab - 1`). Each key is then asked once: the query region has
`(seq_len - context) / 2` even slots, and the slot of each query is drawn without
replacement with Zoology's power law `p(gap) ~ a * gap^(a - 1)` (`power_a = 0.01` puts
most queries near the context). The target at a query position is the key's value; the
other query-region tokens are random (Zoology's `random_non_queries`), and only query
positions are scored.

`mqar_twice` shows the key-value context twice before the queries (`passes = 2`): the
synthetic analogue of the JRT "twice" prompts on which OSDN reports its residual ratio
(Arora et al. 2024, "Just read twice"; OSDN Table 8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from archspec.errors import ArchspecError

from ..metrics import TokenOutcome, per_position_accuracy, sequence_accuracy, token_accuracy
from .base import Batch, Curve, Preset, Task, TrainPreset, ValidationMetric

PRESETS: dict[str, Preset] = {
    "cpu": Preset(
        {"seq_len": 64, "num_kv_pairs": 8, "vocab": 128, "eval_size": 512},
        TrainPreset(steps=1500, batch_size=32, lr=3e-3, warmup_steps=100, eval_every=100),
    ),
    # Zoology's Figure 2 regime: longer sequences, more pairs, a larger vocabulary.
    "gpu": Preset(
        {"seq_len": 256, "num_kv_pairs": 32, "vocab": 8192, "eval_size": 2048},
        TrainPreset(steps=20000, batch_size=128, lr=1e-3, warmup_steps=1000, eval_every=500),
    ),
}


def power_law_weights(space: int, power_a: float) -> torch.Tensor:
    """Zoology's query-gap distribution over `1..space`: `a * gap^(a - 1)`, normalized."""
    gaps = torch.arange(1, space + 1, dtype=torch.float64)
    p = power_a * gaps ** (power_a - 1)
    return p / p.sum()


@dataclass
class MultiQueryRecall(Task):
    """Options: `seq_len`, `num_kv_pairs`, `vocab`, `passes`, `power_a`, `eval_size`."""

    seq_len: int = 64
    num_kv_pairs: int = 8
    vocab: int = 128
    passes: int = 1
    power_a: float = 0.01
    eval_size: int = 512
    target: float = 0.99  # early stop once token_acc@seq_len reaches this (0: never)
    eval_seed: int = 0

    def __post_init__(self) -> None:
        self.name = "mqar" if self.passes == 1 else "mqar_twice" if self.passes == 2 else f"mqar_x{self.passes}"
        self.vocab_size = self.vocab
        self.train_len = self.seq_len
        problems = []
        if self.passes < 1:
            problems.append(f"passes must be >= 1, got {self.passes}")
        if self.num_kv_pairs < 1:
            problems.append(f"num_kv_pairs must be >= 1, got {self.num_kv_pairs}")
        if self.vocab // 2 - 1 < self.num_kv_pairs:
            problems.append(f"vocab {self.vocab} has {self.vocab // 2 - 1} keys, fewer than num_kv_pairs={self.num_kv_pairs}")
        if self.query_slots < self.num_kv_pairs:
            problems.append(
                f"seq_len {self.seq_len} leaves {self.query_slots} query slots after a context of "
                f"{self.context_len} tokens; need at least num_kv_pairs={self.num_kv_pairs} "
                f"(seq_len >= {self.context_len + 2 * self.num_kv_pairs})"
            )
        if not 0 < self.power_a <= 1:
            problems.append(f"power_a must be in (0, 1], got {self.power_a}")
        if problems:
            raise ArchspecError(f"task {self.name}: " + "; ".join(problems))

    @property
    def context_len(self) -> int:
        return 2 * self.num_kv_pairs * self.passes

    @property
    def query_slots(self) -> int:
        return (self.seq_len - self.context_len) // 2

    @property
    def validation_metric(self) -> ValidationMetric:
        return ValidationMetric(f"token_acc@{self.seq_len}")

    @property
    def early_stop(self) -> tuple[str, float] | None:
        return (self.validation_metric.name, self.target) if self.target else None

    def _sample(self, n: int, generator: torch.Generator) -> Batch:
        kv, L = self.num_kv_pairs, self.seq_len
        half = self.vocab // 2
        # Distinct keys and values per sequence: the first kv of a random permutation.
        keys = torch.rand(n, half - 1, generator=generator).argsort(dim=1)[:, :kv] + 1
        values = torch.rand(n, self.vocab - half, generator=generator).argsort(dim=1)[:, :kv] + half
        pairs = torch.stack([keys, values], dim=2).reshape(n, 2 * kv)
        context = pairs.repeat(1, self.passes)

        # Everything after the context starts as noise; queries overwrite some slots.
        inputs = torch.randint(self.vocab, (n, L), generator=generator)
        inputs[:, : self.context_len] = context
        weights = power_law_weights(self.query_slots, self.power_a).expand(n, -1)
        gaps = torch.multinomial(weights, kv, replacement=False, generator=generator)  # [n, kv]
        positions = self.context_len + 2 * gaps
        inputs.scatter_(1, positions, keys)
        targets = torch.zeros_like(inputs)
        targets.scatter_(1, positions, values)
        mask = torch.zeros_like(inputs, dtype=torch.bool)
        mask.scatter_(1, positions, True)
        return Batch(inputs, targets, mask)

    def train_batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        return self._sample(batch_size, generator)

    def _make_eval_sets(self, generator: torch.Generator) -> dict[str, Batch]:
        return {"test": self._sample(self.eval_size, generator)}

    def _make_validation_sets(self, generator: torch.Generator) -> dict[str, Batch]:
        return {"val": self._sample(min(256, self.eval_size), generator)}

    def score(self, outcome: TokenOutcome, split: str) -> dict[str, float]:
        n = outcome.length
        return {f"token_acc@{n}": token_accuracy(outcome), f"seq_acc@{n}": sequence_accuracy(outcome)}

    def curves(self, outcome: TokenOutcome, split: str) -> list[Curve]:
        return [Curve("recall accuracy at query position t", per_position_accuracy(outcome).tolist())]
