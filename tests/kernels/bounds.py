"""A bounds-checked Triton interpreter: every masked-in address a kernel loads or stores
must fall inside one of the tensors it was launched with.

On the GPU an address outside them is an illegal memory access that poisons the CUDA
context (every later test fails with it); under the plain interpreter it reads whatever
host memory is there. `bounds_checked()` turns it into an `OutOfBounds` error naming the
kernel, its program and the first offending addresses. It wraps two internals of Triton's
interpreter (`GridExecutor._init_args_hst`, `InterpreterBuilder.create_masked_load/store`,
Triton 3.7), so callers skip when they are missing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


class OutOfBounds(AssertionError):
    """A kernel touched memory outside every tensor it was given."""


def available() -> bool:
    """Whether this Triton's interpreter has the seams `bounds_checked` wraps."""
    try:
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    return all(hasattr(interp, name) for name in ("GridExecutor", "InterpreterBuilder", "interpreter_builder", "_get_np_dtype")) \
        and hasattr(interp.GridExecutor, "_init_args_hst") and hasattr(interp.InterpreterBuilder, "create_masked_load")


@contextlib.contextmanager
def bounds_checked() -> Iterator[None]:
    """Within the block, every interpreted launch checks its loads and stores."""
    import triton.runtime.interpreter as interp

    ranges: list[tuple[int, int]] = []  # [start, end) of each tensor argument's storage, bytes
    kernel = [""]
    init_args, load, store = (interp.GridExecutor._init_args_hst, interp.InterpreterBuilder.create_masked_load,
                              interp.InterpreterBuilder.create_masked_store)

    def record_args(self, args_dev, kwargs):
        args, kw = init_args(self, args_dev, kwargs)
        ranges.clear()
        for value in (*args, *kw.values()):
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()  # a view may legally reach anywhere in its storage
                ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        kernel[0] = getattr(self.fn, "__name__", "kernel")
        return args, kw

    def check(ptrs, mask, what: str) -> None:
        addresses = ptrs.data.astype(np.uint64)
        # The interpreter may hold a mask as 0/1 integers (`(offs < n) & (S < n)` with a scalar
        # side comes out int32): read as a mask, not as indices.
        active = np.broadcast_to(mask.data.astype(bool), addresses.shape) if mask is not None else np.ones(addresses.shape, bool)
        addresses = addresses[active]
        if addresses.size == 0:
            return
        size = np.uint64(np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize)
        inside = np.zeros(addresses.shape, bool)
        for start, end in ranges:
            inside |= (addresses >= np.uint64(start)) & (addresses + size <= np.uint64(end))
        if not inside.all():
            outside = addresses[~inside]
            raise OutOfBounds(f"{kernel[0]}: a {what} of {outside.size} element(s) outside its tensors at program "
                              f"{interp.interpreter_builder.grid_idx}, first address {int(outside[0]):#x}; the tensors span "
                              + ", ".join(f"{start:#x}+{end - start}" for start, end in ranges))

    def checked_load(self, ptrs, mask, other, *rest):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, other, *rest)

    def checked_store(self, ptrs, value, mask, *rest):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *rest)

    interp.GridExecutor._init_args_hst = record_args
    interp.InterpreterBuilder.create_masked_load = checked_load
    interp.InterpreterBuilder.create_masked_store = checked_store
    try:
        yield
    finally:
        interp.GridExecutor._init_args_hst = init_args
        interp.InterpreterBuilder.create_masked_load = load
        interp.InterpreterBuilder.create_masked_store = store
