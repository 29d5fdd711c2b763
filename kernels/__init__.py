"""archspec.kernels: the recurrence of RECURRENCE.md and its backends.

Imports only torch (and triton, lazily, for the Triton backend): no pydantic, so this
package runs on a bare GPU machine. Beside the recurrence, the fused pieces of a training
step (`kernels/fused.py`): linear cross-entropy, gated RMSNorm (and with the read-out's
projection), short conv, SwiGLU, the gates' log decay, several projections of one input.
"""

from .api import BACKENDS, decode_step, linear_recurrence, osdn_write_keys, register_backend, resolve_backend
from .fan_out import fan_out_linear
from .linear_ce import IGNORE_INDEX, linear_cross_entropy
from .log_decay import gate_log_decay
from .norm_linear import rms_norm_linear
from .recompute import Recompute
from .naive import decode_step_naive, linear_recurrence_naive, osdn_write_keys_naive, recurrence_step
from .rms_norm import add_rms_norm, rms_norm
from .short_conv import conv_tails, short_conv
from .swiglu import swiglu_linear

__all__ = [
    "IGNORE_INDEX",
    "conv_tails",
    "fan_out_linear",
    "linear_cross_entropy",
    "gate_log_decay",
    "rms_norm",
    "add_rms_norm",
    "rms_norm_linear",
    "Recompute",
    "short_conv",
    "swiglu_linear",
    "BACKENDS",
    "linear_recurrence",
    "decode_step",
    "osdn_write_keys",
    "register_backend",
    "resolve_backend",
    "linear_recurrence_naive",
    "osdn_write_keys_naive",
    "recurrence_step",
    "decode_step_naive",
]
