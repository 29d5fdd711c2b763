"""A tensor the backward forms again instead of keeping: `Recompute`.

A kernel's autograd function keeps its inputs for the backward. When an input is the
cheap output of another function whose own inputs are kept anyway (the short conv's
output, from the projection the conv's backward keeps), keeping both holds the same
information twice. `Recompute(fn, args, kwargs, shape)` says how to form the input again:
`fn(*args, **kwargs)`, reshaped to `shape`, run without autograd, must equal the input it
stands for. The tensors among `args` and `kwargs` are saved through the function's
`save_for_backward` (so their lifetime, version checks and saved-tensor hooks are
autograd's own, and a tensor another node keeps costs nothing more); the rest is kept as
it is. What the node keeps of the recipe itself holds no tensor (`without_tensors`): a
reference there would keep the tensor alive past an activation checkpoint that drops the
node's saved tensors, and out of reach of hooks that move them (offloading).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

Tensor = torch.Tensor


class _Slot:
    """Where a saved tensor goes back into a recipe's arguments (`without_tensors`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<saved tensor>"


SLOT = _Slot()


@dataclass(frozen=True)
class Recompute:
    fn: Callable[..., Tensor]
    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    shape: tuple[int, ...] | None = None  # the result reshaped to this (a view where it can be)

    def tensors(self) -> list[Tensor]:
        """The tensors among the arguments, in order: what the backward needs kept."""
        return [a for a in (*self.args, *self.kwargs.values()) if isinstance(a, Tensor)]

    def without_tensors(self) -> Recompute:
        """The same recipe with a `SLOT` where each tensor was (what a node keeps; `run`
        takes the tensors back in the same order)."""
        slot = lambda a: SLOT if isinstance(a, Tensor) else a  # noqa: E731
        return Recompute(self.fn, tuple(slot(a) for a in self.args), {k: slot(v) for k, v in self.kwargs.items()},
                         self.shape)

    def run(self, tensors: list[Tensor] | None = None) -> Tensor:
        """`fn` on the arguments (the tensors among them, or the slots where they were,
        replaced by `tensors`, as the backward gets them back), without autograd, reshaped."""
        given = iter(self.tensors() if tensors is None else tensors)
        fill = lambda a: next(given) if isinstance(a, (Tensor, _Slot)) else a  # noqa: E731
        args = tuple(fill(a) for a in self.args)
        kwargs = {k: fill(v) for k, v in self.kwargs.items()}
        with torch.no_grad():
            out = self.fn(*args, **kwargs)
        return out if self.shape is None else out.reshape(self.shape)


def pack(recompute: Mapping[str, Recompute]) -> tuple[list[Tensor], list[tuple[str, Recompute, int]]]:
    """(every tensor to save, and per entry its name, its recipe without its tensors and how
    many of them are its)."""
    tensors, layout = [], []
    for name, recipe in recompute.items():
        own = recipe.tensors()
        tensors += own
        layout.append((name, recipe.without_tensors(), len(own)))
    return tensors, layout


def unpack(layout: list[tuple[str, Recompute, int]], tensors: tuple[Tensor, ...]) -> dict[str, Tensor]:
    """Each entry's tensor formed again from the saved `tensors` (in `pack`'s order)."""
    out, at = {}, 0
    for name, recipe, count in layout:
        out[name] = recipe.run(list(tensors[at:at + count]))
        at += count
    return out
