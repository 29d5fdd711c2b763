"""bfloat16 products on the CPU interpreter: `decay.EMULATED_BF16_PRODUCTS` switched on
for the length of a `with` block, so that `mm` and `mm_fine` round their operands as the
GPU's tensor cores take them (the stored intermediates stay float32 there)."""

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
