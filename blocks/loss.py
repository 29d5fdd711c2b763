"""The language model's training loss: next-token cross-entropy straight from the hidden
rows, without the logits.

`next_token_loss` runs `archspec.kernels.linear_cross_entropy` (chunks of tokens, logits in
the compute dtype, gradients formed in the forward: Triton on CUDA, torch elsewhere), so a
training step never holds `tokens x vocab` float32 numbers. Labels are aligned with the
positions (`labels[b, t]` is what position t should predict: the caller shifts) and
`IGNORE_INDEX` marks positions that are not scored; the loss is the mean over the scored ones.

`checked_scored_labels` checks a step's token ids and labels and counts the scored labels
in one host read, at the start of the step where the device has nothing queued to wait for,
so the loss in the middle of the step reads nothing on the host (`kernels/linear_ce.py`).
"""

from __future__ import annotations

import torch

from archspec.kernels import IGNORE_INDEX, linear_cross_entropy
from archspec.kernels.linear_ce import outside_vocabulary

Tensor = torch.Tensor


def next_token_loss(hidden: Tensor, head_weight: Tensor, labels: Tensor, *, backend: str = "auto",
                    scored_rows: int | Tensor | None = None) -> Tensor:
    """Mean cross-entropy of `hidden @ head_weight^T` (`hidden` `[B, T, d]`) against `labels` `[B, T]`;
    `scored_rows` from `checked_scored_labels` (else the labels are checked here)."""
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels must be [B, T] = {tuple(hidden.shape[:-1])}, got {tuple(labels.shape)}")
    return linear_cross_entropy(hidden, head_weight, labels, ignore_index=IGNORE_INDEX, backend=backend,
                                scored_rows=scored_rows)


def checked_scored_labels(input_ids: Tensor, labels: Tensor, vocab_size: int) -> int:
    """How many `labels` are scored, after checking that every token id and every scored
    label is a row of the vocabulary: one host read (a `ValueError` says which is bad and where)."""
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels must be [B, T] = {tuple(input_ids.shape)} (input_ids'), got {tuple(labels.shape)}")
    bad_ids = (input_ids < 0) | (input_ids >= vocab_size)
    scored = labels != IGNORE_INDEX
    bad_labels = scored & ((labels < 0) | (labels >= vocab_size))
    n_bad_ids, n_bad_labels, n_scored = torch.stack([bad_ids.sum(), bad_labels.sum(), scored.sum()]).tolist()
    if n_bad_ids:
        raise outside_vocabulary("input_ids", input_ids, bad_ids, vocab_size)
    if n_bad_labels:
        raise outside_vocabulary("labels", labels, bad_labels, vocab_size, f" that are not {IGNORE_INDEX}")
    return n_scored


def masked_labels(targets: Tensor, mask: Tensor) -> Tensor:
    """`targets` where `mask`, `IGNORE_INDEX` elsewhere (a task's batch as labels)."""
    return torch.where(mask.bool(), targets, torch.full_like(targets, IGNORE_INDEX))


def packed_labels(input_ids: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Next-token labels of documents packed in one row (`input_ids` `[1, T]`): each token
    predicts the next one of its own document; a document's last token predicts nothing."""
    labels = torch.roll(input_ids, -1, dims=1)
    last = cu_seqlens[1:].long() - 1
    labels[0, last[last >= 0]] = IGNORE_INDEX
    return labels
