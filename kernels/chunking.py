"""Chunk geometry of the two chunked backends: how many sub-steps and tokens a chunk holds.

Defined once, here: the backends cut sequences this way and the cost model
(`blocks/cost.py`) counts the FLOPs of the path that runs. Chunks hold whole tokens (a
token's `n_h` sub-steps never straddle two chunks).

- Triton (`backend="triton"`, the GPU path): 64 sub-steps per chunk, `64 // n_h` tokens
  (`docs/kernel.md`, "Chunk size").
- PyTorch (`backend="torch"`, the CPU path, `chunked.py`): 16 sub-steps with a delta rule
  and 32 without, rounded down to a power-of-two number of tokens (the dyadic channel-gate
  scores need it); `chunked.py`'s docstring says why these sizes.
"""

from __future__ import annotations

TRITON_CHUNK_SIZE = 64  # sub-steps per chunk of the Triton kernel
TORCH_CHUNK_SIZE = 32  # sub-steps per chunk of the torch backend without a delta rule
TORCH_DELTA_CHUNK_SIZE = 16  # with a delta rule (householder, rwkv7)


def torch_tokens_per_chunk(n_h: int, chunk_size: int | None = None, *, delta: bool) -> int:
    """Tokens per chunk of the torch backend: the largest power of two with
    `tokens * n_h <= chunk_size`, by default `TORCH_DELTA_CHUNK_SIZE` with a delta rule
    (`delta`: beta or erase given) and `TORCH_CHUNK_SIZE` without."""
    if chunk_size is None:
        chunk_size = TORCH_DELTA_CHUNK_SIZE if delta else TORCH_CHUNK_SIZE
    budget = max(1, chunk_size // n_h)
    return 1 << (budget.bit_length() - 1)


def triton_tokens_per_chunk(n_h: int, chunk_size: int | None = None) -> int:
    """Tokens per chunk of the Triton kernel: `chunk_size // n_h` (64 sub-steps by default)."""
    return (chunk_size or TRITON_CHUNK_SIZE) // n_h
