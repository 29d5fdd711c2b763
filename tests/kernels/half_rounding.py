"""bfloat16 on the CPU interpreter as on the GPU, for the length of a `with` block:

- `decay.EMULATED_BF16_PRODUCTS` is switched on, so that `mm` and `mm_fine` round their
  operands as the tensor cores take them, and a bfloat16 call stores its intermediates
  (P, X, Y, the chunk states) in bfloat16 (`decay.stored`);
- every float32 -> bfloat16 cast in any kernel rounds to nearest even, as the GPU's
  `cvt.rn.bf16.f32` does. The interpreter's own conversion truncates (a mean relative bias
  of -2.8e-3 against torch's -6e-5), which alone made a fused model's gate gradients look
  five times worse than plain torch's on the CPU. This patches the interpreter's private
  `_convert_float`; where a Triton release lacks it, the casts keep truncating.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import torch


def _nearest_bf16(convert: Callable) -> Callable:
    """The interpreter's float conversion, float32 -> bfloat16 rounded to nearest even."""
    import triton.language as tl

    def converted(data: np.ndarray, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode is None:
            values = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return values.bfloat16().view(torch.int16).numpy().view(np.uint16).reshape(data.shape)
        return convert(data, input_dtype, output_dtype, rounding_mode)

    return converted


@contextlib.contextmanager
def bf16_products() -> Iterator[None]:
    import triton.language as tl
    from triton.runtime import interpreter

    from archspec.kernels.triton import decay

    before = decay.EMULATED_BF16_PRODUCTS
    convert = getattr(interpreter, "_convert_float", None)
    decay.EMULATED_BF16_PRODUCTS = tl.constexpr(True)
    if convert is not None:
        interpreter._convert_float = _nearest_bf16(convert)
    try:
        yield
    finally:
        decay.EMULATED_BF16_PRODUCTS = before
        if convert is not None:
            interpreter._convert_float = convert
