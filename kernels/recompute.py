"""A tensor the backward forms again instead of keeping: `Recompute`.

A kernel's autograd function keeps its inputs for the backward. When an input is the
cheap output of another function whose own inputs are kept anyway (the short conv's
output, from the projection the conv's backward keeps), keeping both holds the same
information twice. `Recompute(fn, args, kwargs, shape)` says how to form the input again:
`fn(*args, **kwargs)`, reshaped to `shape`, run without autograd, must equal the input it
stands for. The tensors among `args` and `kwargs` are saved through the function's
`save_for_backward` (so their lifetime, version checks and saved-tensor hooks are
autograd's own, and a tensor another node keeps costs nothing more); the rest is kept as
it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Recompute:
    fn: Callable[..., Tensor]
    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    shape: tuple[int, ...] | None = None  # the result reshaped to this (a view where it can be)

    def tensors(self) -> list[Tensor]:
        """The tensors among the arguments, in order: what the backward needs kept."""
        return [a for a in (*self.args, *self.kwargs.values()) if isinstance(a, Tensor)]

    def run(self, tensors: list[Tensor] | None = None) -> Tensor:
        """`fn` on the arguments (the tensors among them replaced by `tensors`, as the
        backward gets them back), without autograd, reshaped."""
        given = iter(self.tensors() if tensors is None else tensors)
        args = tuple(next(given) if isinstance(a, Tensor) else a for a in self.args)
        kwargs = {k: next(given) if isinstance(v, Tensor) else v for k, v in self.kwargs.items()}
        with torch.no_grad():
            out = self.fn(*args, **kwargs)
        return out if self.shape is None else out.reshape(self.shape)


def pack(recompute: Mapping[str, Recompute]) -> tuple[list[Tensor], list[tuple[str, Recompute, int]]]:
    """(every tensor to save, and per entry its name, recipe and how many of them are its)."""
    tensors, layout = [], []
    for name, recipe in recompute.items():
        own = recipe.tensors()
        tensors += own
        layout.append((name, recipe, len(own)))
    return tensors, layout


def unpack(layout: list[tuple[str, Recompute, int]], tensors: tuple[Tensor, ...]) -> dict[str, Tensor]:
    """Each entry's tensor formed again from the saved `tensors` (in `pack`'s order)."""
    out, at = {}, 0
    for name, recipe, count in layout:
        out[name] = recipe.run(list(tensors[at:at + count]))
        at += count
    return out
