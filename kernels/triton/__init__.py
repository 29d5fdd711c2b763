"""The common Triton chunk kernel: `backend="triton"` of `archspec.kernels`.

Importing this module registers the backend (`kernels.api` imports it lazily, so that a
machine without Triton still runs the other backends).
"""

from ..api import register_backend
from .osdn import osdn_write_keys_triton
from .recurrence import linear_recurrence_triton

register_backend("triton", recurrence=linear_recurrence_triton, osdn=osdn_write_keys_triton)

__all__ = ["linear_recurrence_triton", "osdn_write_keys_triton"]
