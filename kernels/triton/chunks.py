"""Chunk geometry: which tokens a kernel program owns, for dense and packed batches.

Chunks hold whole tokens: `TC = BT // NH` tokens, i.e. `TC * NH <= BT` sub-steps (for
`NH = 3`, 21 tokens and 63 of the 64 sub-step rows). Every sequence is cut into its own
chunks, so a chunk never straddles two packed sequences.

Dense batch `[B, T]`: sequence `n = b`, its first token row is `n * T` in the flattened
`[B * T]` rows, and chunk `c` of it has the global index `n * NT + c`. Packed batch
(`cu_seqlens`, B = 1): `chunk_table` lists `(n, c)` for every chunk of every sequence,
and `chunk_offsets[n]` is the global index of sequence `n`'s first chunk. Per-chunk
buffers (states, inverses) are indexed by that global chunk index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..packed import host_offsets, per_offsets_tensor


@per_offsets_tensor
def chunk_tables(cu_seqlens: torch.Tensor, tokens_per_chunk: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`(chunk_table [NCH, 2] int32, chunk_offsets [N + 1] int32, NCH)` for a packed batch,
    formed once per `cu_seqlens` tensor and chunk length (every layer shares them)."""
    bounds = host_offsets(cu_seqlens)
    table, offsets = [], [0]
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        count = -(-(end - start) // tokens_per_chunk)
        table.extend((n, c) for c in range(count))
        offsets.append(offsets[-1] + count)
    device = cu_seqlens.device
    table_t = torch.tensor(table if table else [(0, 0)], dtype=torch.int32, device=device).reshape(-1, 2)
    return table_t, torch.tensor(offsets, dtype=torch.int32, device=device), len(table)


@triton.jit
def chunk_of_program(i_chunk, T, NT, cu_seqlens, chunk_table, IS_VARLEN: tl.constexpr):
    """`(n, bos, seq_len, c)` for the chunk-parallel program `i_chunk` (its global chunk index)."""
    if IS_VARLEN:
        n = tl.load(chunk_table + 2 * i_chunk).to(tl.int32)
        c = tl.load(chunk_table + 2 * i_chunk + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + n).to(tl.int32)
        seq_len = tl.load(cu_seqlens + n + 1).to(tl.int32) - bos
    else:
        n = i_chunk // NT
        c = i_chunk % NT
        bos = n * T
        seq_len = T
    return n, bos, seq_len, c


@triton.jit
def sequence_of_program(n, T, NT, cu_seqlens, chunk_offsets, IS_VARLEN: tl.constexpr):
    """`(bos, seq_len, first global chunk, number of chunks)` of sequence `n`."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + n).to(tl.int32)
        seq_len = tl.load(cu_seqlens + n + 1).to(tl.int32) - bos
        first = tl.load(chunk_offsets + n).to(tl.int32)
        count = tl.load(chunk_offsets + n + 1).to(tl.int32) - first
    else:
        bos = n * T
        seq_len = T
        first = n * NT
        count = NT
    return bos, seq_len, first, count
