"""Whether a module's own forward may be bypassed.

A fused path that uses a module's weights alone (the read-out's `o_proj`), or a recipe that
forms a module's output again in a backward (`kernels.Recompute`: the short convs', the
gates'), must give what the module's forward gives. A forward or pre-forward hook on the
module may change that (an adapter, a probe that edits activations), so a hooked module
keeps its own forward and its output is kept, not formed again.
"""

from __future__ import annotations

import torch.nn as nn


def has_forward_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def fusable(linear: nn.Module) -> bool:
    """Whether a fused path may bypass `linear`'s forward and use its weight alone (the
    read-out's `kernels.rms_norm_linear`, the projections' `kernels.fan_out_linear`): a
    plain bias-free `nn.Linear` without hooks. A module replaced or wrapped (a LoRA
    adapter, a quantised layer) or hooked keeps its own forward."""
    return type(linear) is nn.Linear and linear.bias is None and not has_forward_hooks(linear)
