"""archspec.kernels: the recurrence of RECURRENCE.md and its backends.

Imports only torch (and triton, lazily, for the Triton backend): no pydantic, so this
package runs on a bare GPU machine.
"""

from .api import BACKENDS, linear_recurrence, osdn_write_keys, register_backend, resolve_backend
from .naive import linear_recurrence_naive, osdn_write_keys_naive, recurrence_step

__all__ = [
    "BACKENDS",
    "linear_recurrence",
    "osdn_write_keys",
    "register_backend",
    "resolve_backend",
    "linear_recurrence_naive",
    "osdn_write_keys_naive",
    "recurrence_step",
]
