"""The language model's training loss: next-token cross-entropy straight from the hidden
rows, without the logits.

`next_token_loss` runs `archspec.kernels.linear_cross_entropy` (chunks of tokens, logits in
the compute dtype, gradients formed in the forward: Triton on CUDA, torch elsewhere), so a
training step never holds `tokens x vocab` float32 numbers. Labels are aligned with the
positions (`labels[b, t]` is what position t should predict: the caller shifts) and
`IGNORE_INDEX` marks positions that are not scored; the loss is the mean over the scored ones.
"""

from __future__ import annotations

import torch

from archspec.kernels import IGNORE_INDEX, linear_cross_entropy

Tensor = torch.Tensor


def next_token_loss(hidden: Tensor, head_weight: Tensor, labels: Tensor, *, backend: str = "auto") -> Tensor:
    """Mean cross-entropy of `hidden @ head_weight^T` (`hidden` `[B, T, d]`) against `labels` `[B, T]`."""
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels must be [B, T] = {tuple(hidden.shape[:-1])}, got {tuple(labels.shape)}")
    return linear_cross_entropy(hidden, head_weight, labels, ignore_index=IGNORE_INDEX, backend=backend)


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
