"""Quality metrics computed from a model's next-token predictions.

Every task reduces its logits to a `TokenOutcome` (right or wrong, and the negative
log-likelihood, at each scored position) so that evaluation never has to hold the logits
of a whole evaluation set at once; the metrics below are functions of outcomes only.

Conventions (docs/tasks.md):
- `token_acc@n`: accuracy over the scored positions among the first `n` positions.
- `seq_acc@n`: the fraction of sequences whose scored predictions among the first `n`
  positions are all right (the curves of the DeltaProduct paper's group experiments).
- `scaled_acc`: `(acc - 1/C) / (1 - 1/C)` for a `C`-way answer, so 0 is chance and 1 is
  perfect (Deletang et al. 2023).
- `bpb`: bits per byte, the mean negative log-likelihood in nats divided by ln 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class TokenOutcome:
    """Per-position results of one evaluation batch, all `[N, T]` on the CPU.

    `correct`: the argmax prediction equals the target; `nll`: the negative
    log-likelihood of the target in nats (float64); `mask`: the position is scored.
    Unscored positions hold `correct=False` and `nll=0`.
    """

    correct: Tensor
    nll: Tensor
    mask: Tensor

    @property
    def num_sequences(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])


def outcome_from_logits(logits: Tensor, targets: Tensor, mask: Tensor) -> TokenOutcome:
    """Reduce logits `[N, T, C]` with targets and mask `[N, T]` to a `TokenOutcome`."""
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(targets.shape) or targets.shape != mask.shape:
        raise ValueError(
            f"outcome_from_logits: need logits [N, T, C] and targets, mask [N, T]; got "
            f"{tuple(logits.shape)}, {tuple(targets.shape)}, {tuple(mask.shape)}"
        )
    logits = logits.detach().float()
    mask = mask.bool()
    safe_targets = torch.where(mask, targets, torch.zeros_like(targets))
    log_probs = torch.log_softmax(logits, dim=-1)
    nll = -log_probs.gather(-1, safe_targets[..., None]).squeeze(-1)
    correct = (logits.argmax(-1) == targets) & mask
    nll = torch.where(mask, nll, torch.zeros_like(nll))
    return TokenOutcome(correct=correct.cpu(), nll=nll.double().cpu(), mask=mask.cpu())


def concat_outcomes(parts: list[TokenOutcome]) -> TokenOutcome:
    """Stack the outcomes of several batches of the same length along the batch axis."""
    if not parts:
        raise ValueError("concat_outcomes: nothing to concatenate")
    return TokenOutcome(
        correct=torch.cat([p.correct for p in parts]),
        nll=torch.cat([p.nll for p in parts]),
        mask=torch.cat([p.mask for p in parts]),
    )


def _prefix(outcome: TokenOutcome, upto: int | None) -> TokenOutcome:
    if upto is None:
        return outcome
    if not 1 <= upto <= outcome.length:
        raise ValueError(f"prefix length {upto} outside 1..{outcome.length}")
    return TokenOutcome(outcome.correct[:, :upto], outcome.nll[:, :upto], outcome.mask[:, :upto])


def token_accuracy(outcome: TokenOutcome, upto: int | None = None) -> float:
    """Accuracy over the scored positions among the first `upto` positions (all if None)."""
    o = _prefix(outcome, upto)
    scored = int(o.mask.sum())
    if scored == 0:
        return float("nan")
    return int(o.correct.sum()) / scored


def sequence_accuracy(outcome: TokenOutcome, upto: int | None = None) -> float:
    """Fraction of sequences whose scored predictions among the first `upto` are all right.

    A sequence with no scored position in the prefix does not count (it says nothing).
    """
    o = _prefix(outcome, upto)
    has_scored = o.mask.any(dim=1)
    if not bool(has_scored.any()):
        return float("nan")
    all_right = (o.correct | ~o.mask).all(dim=1)
    return float((all_right & has_scored).sum()) / float(has_scored.sum())


def per_position_accuracy(outcome: TokenOutcome) -> Tensor:
    """`[T]` accuracy at each position over the sequences scored there (NaN if none)."""
    counts = outcome.mask.sum(0).double()
    right = outcome.correct.sum(0).double()
    return torch.where(counts > 0, right / counts.clamp(min=1), torch.full_like(counts, float("nan")))


def prefix_sequence_accuracy(outcome: TokenOutcome) -> Tensor:
    """`[T]`: at `t`, the fraction of sequences whose first `t+1` positions are all right.

    Unscored positions count as right, so for tasks scored everywhere this is exactly
    "the first t predictions are all right"; for sparse tasks it follows the scored ones.
    """
    all_right_so_far = torch.cumprod((outcome.correct | ~outcome.mask).double(), dim=1)
    return all_right_so_far.mean(0)


def per_position_bits(outcome: TokenOutcome) -> Tensor:
    """`[T]` mean negative log-likelihood in bits at each position (NaN if unscored)."""
    counts = outcome.mask.sum(0).double()
    total = outcome.nll.sum(0)
    bits = total / counts.clamp(min=1) / math.log(2)
    return torch.where(counts > 0, bits, torch.full_like(bits, float("nan")))


def bits_per_token(outcome: TokenOutcome) -> float:
    """Mean negative log-likelihood over the scored positions, in bits (bits per byte
    when the tokens are bytes)."""
    scored = int(outcome.mask.sum())
    if scored == 0:
        return float("nan")
    return float(outcome.nll.sum()) / scored / math.log(2)


def scaled_accuracy(accuracy: float, num_classes: int) -> float:
    """`(acc - 1/C) / (1 - 1/C)`: 0 at chance, 1 when perfect, negative below chance."""
    if num_classes < 2:
        raise ValueError(f"scaled_accuracy needs at least 2 classes, got {num_classes}")
    chance = 1.0 / num_classes
    return (accuracy - chance) / (1.0 - chance)


def geometric_mean(values: Tensor, floor: float = 1e-12) -> float:
    """`exp(mean(log x))` over the finite entries; entries below `floor` count as `floor`
    so that one exact zero does not make the whole mean zero."""
    v = values.double().flatten()
    v = v[torch.isfinite(v)]
    if v.numel() == 0:
        return float("nan")
    return float(torch.exp(torch.log(v.clamp(min=floor)).mean()))
