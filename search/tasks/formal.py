"""Formal-language tasks after the Chomsky-hierarchy suite (Deletang et al. 2023).

Each sequence is a string of `length` symbols followed by a query token `=`; the model's
prediction at the query is scored against the answer (one of `C` classes). As in the
suite, every training batch has one length drawn uniformly from `3..40`, and the test
lengths lie beyond it (here 40..256). Scores are scaled accuracies
`(acc - 1/C) / (1 - 1/C)`, per test length (`scaled_acc@<len>`) and their mean over the
test lengths (`scaled_acc`), the suite's headline number.

- `parity`: a bit string; the answer is the number of ones mod 2 (C = 2).
- `mod_arith`: `d op d op ... d` with digits 0..4 and `+ - *`, evaluated with the usual
  precedence (`*` first) mod 5 (C = 5); lengths are odd (an even length drops one).
- `mod_arith_brackets`: the suite's bracketed grammar of exact length (terminals `d`,
  `-d`, `(d)`, `(-d)`; otherwise `(left op right)`), mod 5; `+ -` and, with
  `mult=True`, `*`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from archspec.errors import ArchspecError

from ..metrics import TokenOutcome, scaled_accuracy, token_accuracy
from .base import Batch, Curve, Preset, Task, TrainPreset, ValidationMetric

MODULUS = 5

# Token ids: digits 0..4 are themselves, so an answer digit is its own token.
PLUS, MINUS, TIMES, OPEN, CLOSE, QUERY = 5, 6, 7, 8, 9, 10
SYMBOLS = {PLUS: "+", MINUS: "-", TIMES: "*", OPEN: "(", CLOSE: ")"}
PARITY_QUERY = 2

PRESETS: dict[str, Preset] = {
    "cpu": Preset(
        {"min_train_len": 3, "max_train_len": 40, "eval_lengths": (40, 64, 128, 256), "eval_size": 128},
        TrainPreset(steps=1500, batch_size=32, lr=3e-3, warmup_steps=100, eval_every=100),
    ),
    "gpu": Preset(
        {"min_train_len": 3, "max_train_len": 40, "eval_lengths": (40, 64, 96, 128, 160, 192, 224, 256), "eval_size": 512},
        TrainPreset(steps=20000, batch_size=128, lr=1e-3, warmup_steps=1000, eval_every=500),
    ),
}


def to_text(tokens: list[int]) -> str:
    """The expression as a string (digits and operators), for reading and for tests."""
    return "".join(str(t) if t < MODULUS else SYMBOLS[t] for t in tokens)


def mod_arith_value(tokens: list[int]) -> int:
    """Evaluate `d op d op ... d` with `*` before `+ -`, mod 5."""
    terms: list[int] = []
    sign, product = 1, tokens[0]
    for op, digit in zip(tokens[1::2], tokens[2::2]):
        if op == TIMES:
            product = product * digit % MODULUS
        else:
            terms.append(sign * product)
            sign, product = (1 if op == PLUS else -1), digit
    terms.append(sign * product)
    return sum(terms) % MODULUS


def bracket_expression(length: int, rng: random.Random, mult: bool) -> tuple[list[int], int]:
    """A bracketed expression of exactly `length` tokens and its value mod 5 (the suite's
    grammar: short lengths are `d`, `-d`, `(d)`, `(-d)`; longer ones `(left op right)`)."""
    if length < 1:
        raise ValueError(f"no expression of length {length}")
    if length <= 4:
        d = rng.randrange(MODULUS)
        forms = {1: ([d], d), 2: ([MINUS, d], -d), 3: ([OPEN, d, CLOSE], d), 4: ([OPEN, MINUS, d, CLOSE], -d)}
        tokens, value = forms[length]
        return tokens, value % MODULUS
    left_len = rng.randrange(1, length - 3)
    left, lv = bracket_expression(left_len, rng, mult)
    right, rv = bracket_expression(length - left_len - 3, rng, mult)
    op = rng.choice((PLUS, MINUS, TIMES) if mult else (PLUS, MINUS))
    value = lv + rv if op == PLUS else lv - rv if op == MINUS else lv * rv
    return [OPEN, *left, op, *right, CLOSE], value % MODULUS


@dataclass
class _FormalTask(Task):
    """Shared length protocol and scoring; subclasses draw the strings."""

    min_train_len: int = 3
    max_train_len: int = 40
    eval_lengths: tuple[int, ...] = (40, 64, 128, 256)
    eval_size: int = 128
    target: float = 0.99  # early stop once scaled_acc@max_train_len reaches this (0: never)
    eval_seed: int = 0

    num_classes = 2
    query_token = QUERY

    def __post_init__(self) -> None:
        self.eval_lengths = tuple(sorted(set(int(n) for n in self.eval_lengths)))
        if not 1 <= self.min_train_len <= self.max_train_len:
            raise ArchspecError(
                f"task {self.name}: need 1 <= min_train_len <= max_train_len, got {self.min_train_len}, {self.max_train_len}"
            )
        if not self.eval_lengths or self.eval_lengths[0] < 1:
            raise ArchspecError(f"task {self.name}: eval_lengths must be positive, got {self.eval_lengths}")
        self.train_len = self.max_train_len + 1  # the query token

    @property
    def validation_metric(self) -> ValidationMetric:
        return ValidationMetric(f"scaled_acc@{self.max_train_len}")

    @property
    def early_stop(self) -> tuple[str, float] | None:
        return (self.validation_metric.name, self.target) if self.target else None

    def _strings(self, n: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`n` strings of `length` symbols `[n, length]` and their answers `[n]`."""
        raise NotImplementedError

    def _sample(self, n: int, length: int, generator: torch.Generator) -> Batch:
        strings, answers = self._strings(n, length, generator)
        query = torch.full((n, 1), self.query_token, dtype=torch.long)
        inputs = torch.cat([strings, query], dim=1)
        targets = torch.zeros_like(inputs)
        targets[:, -1] = answers
        mask = torch.zeros_like(inputs, dtype=torch.bool)
        mask[:, -1] = True
        return Batch(inputs, targets, mask)

    def train_batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        length = int(torch.randint(self.min_train_len, self.max_train_len + 1, (1,), generator=generator))
        return self._sample(batch_size, length, generator)

    def _make_eval_sets(self, generator: torch.Generator) -> dict[str, Batch]:
        return {f"len{n}": self._sample(self.eval_size, n, generator) for n in self.eval_lengths}

    def _make_validation_sets(self, generator: torch.Generator) -> dict[str, Batch]:
        return {f"len{self.max_train_len}": self._sample(min(self.eval_size, 128), self.max_train_len, generator)}

    def score(self, outcome: TokenOutcome, split: str) -> dict[str, float]:
        n = int(split.removeprefix("len"))
        acc = token_accuracy(outcome)
        return {f"token_acc@{n}": acc, f"scaled_acc@{n}": scaled_accuracy(acc, self.num_classes)}

    def summarize(self, metrics: dict[str, float]) -> dict[str, float]:
        tests = [metrics[f"scaled_acc@{n}"] for n in self.eval_lengths if f"scaled_acc@{n}" in metrics]
        return {"scaled_acc": sum(tests) / len(tests)} if tests else {}

    def summary_curves(self, metrics: dict[str, float]) -> list[Curve]:
        lengths = [n for n in self.eval_lengths if f"scaled_acc@{n}" in metrics]
        if not lengths:
            return []
        return [
            Curve("accuracy at the query", [metrics[f"token_acc@{n}"] for n in lengths], positions=lengths),
            Curve("scaled accuracy", [metrics[f"scaled_acc@{n}"] for n in lengths], positions=lengths),
        ]

    @property
    def plot_train_len(self) -> int:
        return self.max_train_len  # curves are against the string length, without the query


@dataclass
class Parity(_FormalTask):
    num_classes = 2
    query_token = PARITY_QUERY

    def __post_init__(self) -> None:
        self.name, self.vocab_size = "parity", 3
        super().__post_init__()

    def _strings(self, n: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        bits = torch.randint(2, (n, length), generator=generator)
        return bits, bits.sum(1) % 2


@dataclass
class ModArith(_FormalTask):
    num_classes = MODULUS

    def __post_init__(self) -> None:
        self.name, self.vocab_size = "mod_arith", QUERY + 1
        super().__post_init__()

    def _strings(self, n: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        length = length if length % 2 == 1 else length - 1  # digit (op digit)*
        strings = torch.empty(n, length, dtype=torch.long)
        strings[:, 0::2] = torch.randint(MODULUS, (n, (length + 1) // 2), generator=generator)
        ops = torch.tensor([PLUS, MINUS, TIMES])
        strings[:, 1::2] = ops[torch.randint(3, (n, length // 2), generator=generator)]
        answers = torch.tensor([mod_arith_value(row) for row in strings.tolist()], dtype=torch.long)
        return strings, answers


@dataclass
class ModArithBrackets(_FormalTask):
    mult: bool = False  # the suite's default: `+ -` only

    num_classes = MODULUS

    def __post_init__(self) -> None:
        self.name, self.vocab_size = "mod_arith_brackets", QUERY + 1
        super().__post_init__()

    def _strings(self, n: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        # The grammar is recursive: draw it in Python from a seed taken from `generator`.
        rng = random.Random(int(torch.randint(2**62, (1,), generator=generator)))
        rows = [bracket_expression(length, rng, self.mult) for _ in range(n)]
        return torch.tensor([r[0] for r in rows], dtype=torch.long), torch.tensor([r[1] for r in rows], dtype=torch.long)
