"""The common Triton chunk kernel: `backend="triton"` of `archspec.kernels`.

Importing this module registers the backend (`kernels.api` imports it lazily, so that a
machine without Triton still runs the other backends).
"""

from ..api import register_backend
from .recurrence import linear_recurrence_triton

register_backend("triton", recurrence=linear_recurrence_triton)

__all__ = ["linear_recurrence_triton"]
