"""Several layers' weights read as one matrix by the decoding step.

One decoding step at batch 1 is bound by the number of kernels it launches (a few
microseconds each), not by the bytes it moves. A mixer's q, k, v, beta and gate
projections all read the same token, and so do SwiGLU's gate and up projections: the
step reads each group as one matrix, one GEMV, from a copy joined along the output rows.

The copy follows its parameters. `current()` compares each source's storage and version
counter, which every in-place update bumps (an optimizer step, `load_state_dict`,
`p.mul_()`), and copies again into the same buffer when one changed, so a captured CUDA
graph keeps reading a buffer that holds today's weights. An update through `p.data`
bypasses the version counter and is not seen. The copy is neither a parameter nor saved;
it costs the joined weights' bytes once more while the model decodes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

Tensor = torch.Tensor


class JoinedWeights:
    """The weights (and biases, zeros where a source has none) of `modules`, stacked along
    their output rows: `current()` -> `(weight [sum rows, in], bias [sum rows] or None)`.
    A source is any module with a `weight` whose first dimension is its outputs (a
    `Linear`; a depthwise `Conv1d`'s `[C, 1, W]` reads as `[C, W]`)."""

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules
        self.widths = [m.weight.shape[0] for m in modules]
        self._key: tuple | None = None
        self._weight: Tensor | None = None
        self._bias: Tensor | None = None

    def _sources(self) -> list[Tensor]:
        return [t for m in self.modules for t in (m.weight, getattr(m, "bias", None)) if t is not None]

    def current(self) -> tuple[Tensor, Tensor | None]:
        sources = self._sources()
        key = tuple((id(t), t.data_ptr(), t._version, t.dtype, t.device) for t in sources)
        if key != self._key:
            self._join()
            self._key = key
        return self._weight, self._bias

    @torch.no_grad()
    def _join(self) -> None:
        weights = [m.weight.reshape(m.weight.shape[0], -1) for m in self.modules]
        first = weights[0]
        shape = (sum(self.widths), first.shape[1])
        if self._weight is None or self._weight.shape != shape or self._weight.dtype != first.dtype or \
                self._weight.device != first.device:
            self._weight = torch.empty(shape, dtype=first.dtype, device=first.device)
            has_bias = any(getattr(m, "bias", None) is not None for m in self.modules)
            self._bias = torch.zeros(shape[0], dtype=first.dtype, device=first.device) if has_bias else None
        torch.cat(weights, out=self._weight)
        if self._bias is not None:
            row = 0
            for m, width in zip(self.modules, self.widths):
                bias = getattr(m, "bias", None)
                if bias is not None:
                    self._bias[row : row + width].copy_(bias)
                row += width
