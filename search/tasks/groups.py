"""Group word problems: track the running product of uniformly drawn group elements.

The inputs are element ids `x_1 .. x_T`; the target at position `t` is the id of
`x_t * x_{t-1} * ... * x_1` (the DeltaProduct paper's state-tracking task; Merrill et al.
2024, "The illusion of state in state-space models"). Groups are given by permutation
tables: an element is a permutation `p` of `0..n-1` and `(a * b)(i) = a[b[i]]`, so the
product applies `x_1` first. Train at length `L`; the one evaluation split has length
`4L`, and since the models are causal its prefixes give the metrics at `L`, `2L`, `4L`.

Names: `s3 s4 s5 ...` (symmetric), `a4 a5 ...` (alternating), `zN` (cyclic of order N),
`dN` (dihedral of order 2N, the symmetries of an N-gon).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import torch

from archspec.errors import ArchspecError

from ..metrics import TokenOutcome, per_position_accuracy, prefix_sequence_accuracy, sequence_accuracy, token_accuracy
from .base import Batch, Curve, Preset, Task, TrainPreset, ValidationMetric

Permutation = tuple[int, ...]

# A multiplication table of this many entries is the most we build (S6 has 720^2).
MAX_GROUP_ORDER = 1000


@dataclass(frozen=True)
class PermutationGroup:
    """A finite group as a list of permutations, identity first."""

    name: str
    elements: tuple[Permutation, ...]

    def __post_init__(self) -> None:
        index = {p: i for i, p in enumerate(self.elements)}
        n = len(self.elements[0])
        table = torch.empty(len(self.elements), len(self.elements), dtype=torch.long)
        for i, a in enumerate(self.elements):
            for j, b in enumerate(self.elements):
                table[i, j] = index[compose(a, b)]  # closure: KeyError if not a group
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "table", table)
        object.__setattr__(self, "degree", n)

    @property
    def order(self) -> int:
        return len(self.elements)

    def index(self, p: Permutation) -> int:
        return self._index[p]  # type: ignore[attr-defined]


def compose(a: Permutation, b: Permutation) -> Permutation:
    """`a * b`: apply `b`, then `a`."""
    return tuple(a[i] for i in b)


def _is_even(p: Permutation) -> bool:
    inversions = sum(1 for i in range(len(p)) for j in range(i + 1, len(p)) if p[i] > p[j])
    return inversions % 2 == 0


def symmetric_group(n: int) -> PermutationGroup:
    return PermutationGroup(f"s{n}", tuple(itertools.permutations(range(n))))


def alternating_group(n: int) -> PermutationGroup:
    return PermutationGroup(f"a{n}", tuple(p for p in itertools.permutations(range(n)) if _is_even(p)))


def cyclic_group(n: int) -> PermutationGroup:
    return PermutationGroup(f"z{n}", tuple(tuple((i + k) % n for i in range(n)) for k in range(n)))


def dihedral_group(n: int) -> PermutationGroup:
    """Rotations `i -> i + k` and reflections `i -> k - i` of an n-gon (order 2n)."""
    rotations = [tuple((i + k) % n for i in range(n)) for k in range(n)]
    reflections = [tuple((k - i) % n for i in range(n)) for k in range(n)]
    return PermutationGroup(f"d{n}", tuple(rotations + reflections))


_FAMILIES = {"s": symmetric_group, "a": alternating_group, "z": cyclic_group, "d": dihedral_group}
_MIN_DEGREE = {"s": 2, "a": 3, "z": 2, "d": 3}
_ORDER = {
    "s": lambda n: _factorial(n),
    "a": lambda n: _factorial(n) // 2,
    "z": lambda n: n,
    "d": lambda n: 2 * n,
}


def _factorial(n: int) -> int:
    out = 1
    for i in range(2, n + 1):
        out *= i
    return out


GROUP_NAME = re.compile(r"^([sazd])(\d+)$")


def is_group_name(name: str) -> bool:
    return GROUP_NAME.match(name) is not None


def group_by_name(name: str) -> PermutationGroup:
    """`s3`, `a5`, `z7`, `d4`, ...; a clear error for sizes that are not groups or too big."""
    m = GROUP_NAME.match(name)
    if m is None:
        raise ArchspecError(f"unknown group {name!r}: expected s<N>, a<N>, z<N> or d<N>")
    family, n = m.group(1), int(m.group(2))
    if n < _MIN_DEGREE[family]:
        raise ArchspecError(f"group {name!r}: {family}<N> needs N >= {_MIN_DEGREE[family]}")
    if _ORDER[family](n) > MAX_GROUP_ORDER:
        raise ArchspecError(f"group {name!r} has order {_ORDER[family](n)}; at most {MAX_GROUP_ORDER} is supported")
    return _FAMILIES[family](n)


def running_products(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`y_t = x_t * y_{t-1}`, `y_1 = x_1`, for element ids `x` `[N, T]`."""
    y = torch.empty_like(x)
    y[:, 0] = x[:, 0]
    for t in range(1, x.shape[1]):
        y[:, t] = table[x[:, t], y[:, t - 1]]
    return y


# CPU: about a minute for a small one-layer model on one core. GPU: the DeltaProduct
# paper's lengths (train 128, test to 512; its Appendix C.1).
PRESETS: dict[str, Preset] = {
    "cpu": Preset(
        {"train_len": 32, "eval_size": 512},
        TrainPreset(steps=1500, batch_size=32, lr=3e-3, warmup_steps=100, eval_every=100),
    ),
    "gpu": Preset(
        {"train_len": 128, "eval_size": 2048},
        TrainPreset(steps=20000, batch_size=256, lr=1e-3, warmup_steps=1000, eval_every=500),
    ),
}


@dataclass
class GroupWordProblem(Task):
    """Running products in `group`; options: `train_len`, `eval_factors`, `eval_size`."""

    group_name: str = "s3"
    train_len: int = 32
    eval_factors: tuple[int, ...] = (1, 2, 4)
    eval_size: int = 512
    target: float = 0.99  # early stop once seq_acc@train_len reaches this (0: never)
    eval_seed: int = 0
    group: PermutationGroup = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.group = group_by_name(self.group_name)
        self.name = self.group_name
        self.vocab_size = self.group.order
        if self.train_len < 1:
            raise ArchspecError(f"task {self.name}: train_len must be >= 1, got {self.train_len}")
        self.eval_factors = tuple(sorted(set(int(f) for f in self.eval_factors)))
        if not self.eval_factors or self.eval_factors[0] < 1:
            raise ArchspecError(f"task {self.name}: eval_factors must be positive integers, got {self.eval_factors}")

    @property
    def validation_metric(self) -> ValidationMetric:
        return ValidationMetric(f"seq_acc@{self.train_len}")

    @property
    def early_stop(self) -> tuple[str, float] | None:
        return (self.validation_metric.name, self.target) if self.target else None

    def describe(self) -> dict:
        d = super().describe()
        d.pop("group", None)
        return d

    def _sample(self, n: int, length: int, generator: torch.Generator) -> Batch:
        x = torch.randint(self.group.order, (n, length), generator=generator)
        y = running_products(self.group.table, x)
        return Batch(x, y, torch.ones_like(x, dtype=torch.bool))

    def train_batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        return self._sample(batch_size, self.train_len, generator)

    @property
    def eval_lengths(self) -> list[int]:
        return [f * self.train_len for f in self.eval_factors]

    def _make_eval_sets(self, generator: torch.Generator) -> dict[str, Batch]:
        return {"test": self._sample(self.eval_size, max(self.eval_lengths), generator)}

    def _make_validation_sets(self, generator: torch.Generator) -> dict[str, Batch]:
        return {"val": self._sample(min(256, self.eval_size), self.train_len, generator)}

    def score(self, outcome: TokenOutcome, split: str) -> dict[str, float]:
        lengths = [n for n in self.eval_lengths if n <= outcome.length] or [outcome.length]
        out: dict[str, float] = {}
        for n in lengths:
            out[f"token_acc@{n}"] = token_accuracy(outcome, n)
            out[f"seq_acc@{n}"] = sequence_accuracy(outcome, n)
        return out

    def curves(self, outcome: TokenOutcome, split: str) -> list[Curve]:
        return [
            Curve("token accuracy at position t", per_position_accuracy(outcome).tolist()),
            Curve("sequences right up to t", prefix_sequence_accuracy(outcome).tolist()),
        ]
