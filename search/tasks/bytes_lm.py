"""Byte-level language modelling on Shakespeare's plays (`search/tasks/corpus.py`).

Inputs are windows of `seq_len` bytes, targets the same windows shifted by one byte;
every position is scored. Training windows start anywhere in the training plays; the
evaluation split is `eval_windows` windows spread evenly over the held-out plays
(Twelfth Night, Macbeth, The Tempest), so `bpb` is measured on text never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from archspec.errors import ArchspecError

from ..metrics import TokenOutcome, bits_per_token, per_position_bits, token_accuracy
from .base import Batch, Curve, Preset, Task, TrainPreset, ValidationMetric
from .corpus import load_split

PRESETS: dict[str, Preset] = {
    "cpu": Preset(
        {"seq_len": 128, "eval_windows": 128},
        TrainPreset(steps=1500, batch_size=16, lr=3e-3, warmup_steps=100, eval_every=250),
    ),
    "gpu": Preset(
        {"seq_len": 1024, "eval_windows": 256},
        TrainPreset(steps=20000, batch_size=64, lr=1e-3, warmup_steps=1000, eval_every=1000),
    ),
}


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def windows(text: torch.Tensor, starts: torch.Tensor, seq_len: int) -> Batch:
    """Inputs `text[s : s+L]` and targets `text[s+1 : s+L+1]` for each start `s`."""
    offsets = starts[:, None] + torch.arange(seq_len + 1)
    chunk = text[offsets]
    inputs, targets = chunk[:, :-1], chunk[:, 1:]
    return Batch(inputs, targets, torch.ones_like(inputs, dtype=torch.bool))


@dataclass
class BytesLM(Task):
    """Options: `seq_len`, `eval_windows`."""

    seq_len: int = 128
    eval_windows: int = 128
    eval_seed: int = 0

    def __post_init__(self) -> None:
        self.name = "bytes_lm"
        self.vocab_size = 256
        self.train_len = self.seq_len
        self._train_text = _as_tensor(load_split("train"))
        self._heldout_text = _as_tensor(load_split("heldout"))
        room = self._heldout_text.numel() - self.seq_len - 1
        if self.seq_len < 1 or room < self.eval_windows:
            raise ArchspecError(
                f"task bytes_lm: seq_len={self.seq_len} with eval_windows={self.eval_windows} does not fit the "
                f"{self._heldout_text.numel()}-byte held-out split"
            )

    def train_batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        last_start = self._train_text.numel() - self.seq_len - 1
        starts = torch.randint(last_start + 1, (batch_size,), generator=generator)
        return windows(self._train_text, starts, self.seq_len)

    def _make_eval_sets(self, generator: torch.Generator) -> dict[str, Batch]:
        last_start = self._heldout_text.numel() - self.seq_len - 1
        starts = torch.linspace(0, last_start, self.eval_windows).long()
        return {"heldout": windows(self._heldout_text, starts, self.seq_len)}

    def _make_validation_sets(self, generator: torch.Generator) -> dict[str, Batch]:
        full = self.eval_sets()["heldout"]
        return {"heldout": Batch(*(t[::4] for t in full))}

    @property
    def validation_metric(self) -> ValidationMetric:
        return ValidationMetric("bpb", higher_is_better=False)

    def score(self, outcome: TokenOutcome, split: str) -> dict[str, float]:
        return {"bpb": bits_per_token(outcome), f"token_acc@{outcome.length}": token_accuracy(outcome)}

    def curves(self, outcome: TokenOutcome, split: str) -> list[Curve]:
        return [Curve("bits per byte at position t", per_position_bits(outcome).tolist(), ylabel="bits per byte")]
