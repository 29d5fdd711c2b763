"""Names for what selects a code path: the gate kind, the transition (the kernel's mode),
and whether Triton runs its interpreter.

The plan (`blocks.plan.RecurrencePlan`) says `gate: "none" | "scalar" | "channel"`,
`decay: "mamba2" | "rwkv7" | "gla"` and `transition: "diagonal" | "householder" | "rwkv7"`; these
enums carry the same names to
the backends, and their integer values are what the Triton kernels specialize on
(`triton/kinds.py` names them there as `tl.constexpr`s).
"""

from __future__ import annotations

from enum import IntEnum
from typing import TypeVar

import torch

Kind = TypeVar("Kind", bound=IntEnum)


def named_kind(kind: type[Kind], name: str, label: str) -> Kind:
    """The member of `kind` the plan calls `name` (its lower-case name), or a ValueError
    that lists the names `label` takes."""
    try:
        return kind[name.upper()]
    except KeyError:
        raise ValueError(f"{label} must be one of {[k.name.lower() for k in kind]}, got {name!r}") from None


class Gate(IntEnum):
    """The decay applied once per token: none, one scalar per head `[B, T, H]`, or one
    value per key channel `[B, T, H, K]`."""

    NONE = 0
    SCALAR = 1
    CHANNEL = 2

    @classmethod
    def named(cls, name: str) -> Gate:
        """`Gate.named("scalar")`: the plan's name of a gate kind."""
        return named_kind(cls, name, "gate")

    @classmethod
    def of(cls, g: torch.Tensor | None) -> Gate:
        """The kind a gate tensor's shape stands for (the public API's contract)."""
        if g is None:
            return cls.NONE
        return cls.SCALAR if g.dim() == 3 else cls.CHANNEL


class DecayForm(IntEnum):
    """How a gate's log decay is formed from its projection `z` (bias included):
    `g = -exp(A_log) * f(z)`."""

    MAMBA2 = 0  # f = softplus: unbounded below (Mamba2, Gated DeltaNet, KDA)
    RWKV7 = 1  # f = sigmoid: at most exp(A_log) nats a token (RWKV-7, A_log = -1/2)
    GLA = 2  # f(z) = softplus(-z), so g = exp(A_log) logsigmoid(z) (GLA, A_log = -ln 16)

    @classmethod
    def named(cls, name: str) -> DecayForm:
        """`DecayForm.named("rwkv7")`: the plan's name of a decay form."""
        return named_kind(cls, name, "decay form")


class Mode(IntEnum):
    """The transition, as the kernels see it: which writes and erases a sub-step has."""

    DIAGONAL = 0  # S += w v^T (no delta rule)
    HOUSEHOLDER = 1  # the delta rule: S += beta w (v - S^T k)^T
    RWKV7 = 2  # an erase vector and an untied write key

    @classmethod
    def of(cls, beta: torch.Tensor | None, erase: torch.Tensor | None) -> Mode:
        """The mode that `linear_recurrence`'s arguments select (`RECURRENCE.md`)."""
        if erase is not None:
            return cls.RWKV7
        return cls.HOUSEHOLDER if beta is not None else cls.DIAGONAL


def triton_interpreter_on() -> bool:
    """Whether Triton runs kernels under its CPU interpreter (`TRITON_INTERPRET=1`), as
    Triton's own setting says (`triton.knobs`; the project reads no environment variable
    for it). Not a launch setting: the backend check and the Triton plan ask it. False
    where Triton is not installed."""
    try:
        import triton
    except ImportError:
        return False
    return bool(triton.knobs.runtime.interpret)
