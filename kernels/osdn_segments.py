"""OSDN's write keys and the recurrence they feed, in segments of the sequence that overlap.

OSDN phase 1 (`osdn_write_keys`) is a sequential scan: one program of one warp per
sequence and head, latency-bound, 0.79 ms at B=4 T=4096 H=16 K=128 on the H200 while the
rest of the GPU idles; the chunk kernels after it (0.46 ms for DeltaNet) need its write
keys. Cut the sequence into segments: the scan of segment `s + 1` (from segment `s`'s
final `d`) needs nothing of the chunk kernels of segment `s` (from the state segment
`s - 1` left), so on a GPU the scans run on a side stream while the chunk kernels of the
segments already scanned run on the current one. The forward then takes about the scan's
time plus one segment's chunk kernels, instead of the sum; autograd runs each backward
on its forward's stream, so the backward's OSDN scans overlap the chunk backward of the
segment before in the same way.

The result is the unsegmented one: segments hold whole chunks of the Triton kernel
(`CHUNK_SIZE` sub-steps), and `d` and the state pass from one to the next in float32, as
they do inside the kernels. Without CUDA the segments run one after the other.

Measured on the H200 (session 9, `docs/kernel.md`, "in segments"): right, and slower.
OSDN-DeltaNet's forward took 3.4 ms at 4 segments and 10.8 at 8, against 1.26 whole.
Each segment costs about 1 ms of host time (two API calls, about ten launches), more
than the overlap can save. Kept opt-in, for a step whose launches are off the host (a
CUDA graph).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os

import torch

from .api import linear_recurrence, osdn_write_keys

Tensor = torch.Tensor
CHUNK_SUBSTEPS = 64  # the Triton kernel's chunk (`kernels/triton/recurrence.py`, CHUNK_SIZE)


def osdn_segments() -> int:
    """`ARCHSPEC_TRITON_OSDN_SEGMENTS` (default 1: the unsegmented path, the faster one on
    the H200; see the module's docstring): how many segments the benchmarks and the OSDN
    mixer cut a sequence into. Read at each call, as the launch settings of
    `kernels/triton/launch.py` are."""
    return int(os.environ.get("ARCHSPEC_TRITON_OSDN_SEGMENTS", "1"))


def segment_bounds(T: int, n_h: int, segments: int) -> list[tuple[int, int]]:
    """Token ranges of about `T / segments` tokens each, cut at whole chunks (a chunk holds
    `CHUNK_SUBSTEPS // n_h` tokens), none empty."""
    per_chunk = max(1, CHUNK_SUBSTEPS // n_h)
    chunks = math.ceil(T / per_chunk)
    segments = max(1, min(segments, chunks))
    cuts = [i * chunks // segments * per_chunk for i in range(segments)] + [T]
    return [(a, min(b, T)) for a, b in itertools.pairwise(cuts) if a < min(b, T)]


def osdn_recurrence_in_segments(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor | None,
    *,
    segments: int,
    g: Tensor | None = None,
    n_h: int = 1,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    retain: Tensor | None = None,
    d0: Tensor | None = None,
    eta: float = 0.003,
    d_min: float = 0.5,
    d_max: float = 2.0,
    beta_aware: bool = True,
    eps: float = 1e-6,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None, Tensor]:
    """`(o, final_state, d_final)`: `linear_recurrence(q, k, v, g=g, beta=beta,
    write_key=osdn_write_keys(k, beta, ...)[0], ...)` computed in `segments` segments (no
    packed batches: `cu_seqlens` sequences would cross the cuts). `final_state` is
    returned when `output_final_state`; `d_final` always."""
    T = q.shape[1]
    bounds = segment_bounds(T, n_h, segments)
    side = torch.cuda.Stream(device=q.device, priority=-1) if q.is_cuda and len(bounds) > 1 else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(q.device))  # the inputs are ready on the current stream
    # `split`, not slices: its backward writes each input's gradient once (a slice's
    # backward writes a whole zero tensor per slice, and autograd adds them up)
    tokens = [b - a for a, b in bounds]
    steps = [n * n_h for n in tokens]
    qs, ks, vs = q.split(tokens, 1), list(k.split(steps, 1)), v.split(steps, 1)
    betas = [None] * len(bounds) if beta is None else beta.split(steps, 1)
    gates = [None] * len(bounds) if g is None else g.split(tokens, 1)
    retains = [None] * len(bounds) if retain is None else retain.split(tokens, 1)
    keys, ready = [], []
    d = d0
    for n in range(len(bounds)):  # every scan first, queued on the side stream
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            ks[n] = ks[n].contiguous()  # one copy of the segment's keys, for the scan and the chunk kernels
            w, d = osdn_write_keys(
                ks[n], betas[n], eta=eta, d_min=d_min, d_max=d_max, retain=retains[n],
                beta_aware=beta_aware, d0=d, eps=eps, n_h=n_h, backend=backend,
            )
            keys.append(w)
            if side is not None:
                event = torch.cuda.Event()
                event.record(side)
                ready.append(event)
    outputs, state = [], initial_state
    for n in range(len(bounds)):
        if side is not None:
            torch.cuda.current_stream(q.device).wait_event(ready[n])
            for made_there in (keys[n], ks[n]):  # made on the side stream, read here
                made_there.record_stream(torch.cuda.current_stream(q.device))
        last = n == len(bounds) - 1
        o, state = linear_recurrence(
            qs[n], ks[n], vs[n], g=gates[n], beta=betas[n], write_key=keys[n], n_h=n_h,
            scale=q.shape[-1] ** -0.5 if scale is None else scale, initial_state=state,
            output_final_state=output_final_state or not last, backend=backend,
        )
        outputs.append(o)
    if side is not None:
        d.record_stream(torch.cuda.current_stream(q.device))
        torch.cuda.current_stream(q.device).wait_stream(side)
    o = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    return o, (state if output_final_state else None), d

