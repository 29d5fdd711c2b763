"""bfloat16 on the CPU interpreter as on the GPU: `decay.EMULATED_BF16_PRODUCTS` switched
on for the length of a `with` block, so that `mm` and `mm_fine` round their operands as the
tensor cores take them, and a bfloat16 call stores its intermediates (P, X, Y, the chunk
states) in bfloat16, rounded to nearest (`decay.stored`; the interpreter's own conversion
truncates). The fused pieces around the recurrence (RMSNorm, convolution, ...) are not
covered: their bfloat16 stores still truncate there."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def bf16_products() -> Iterator[None]:
    import triton.language as tl

    from archspec.kernels.triton import decay

    before = decay.EMULATED_BF16_PRODUCTS
    decay.EMULATED_BF16_PRODUCTS = tl.constexpr(True)
    try:
        yield
    finally:
        decay.EMULATED_BF16_PRODUCTS = before
