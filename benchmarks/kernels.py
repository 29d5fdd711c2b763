"""Kernel benchmark: every plan family on the Triton chunk kernel, against
flash-linear-attention (when installed) and our `torch` backend, beside its floors.

    python benchmarks/kernels.py [--out DIR] [--plans a,b] [--no-torch] [--no-fla]
                                 [--budget-s S] [--resume FILE] [--smoke]

For each plan (B=4, T=4096, H=16, K=V=128, bfloat16 unless changed) it times forward and
forward+backward with `triton.testing.do_bench` (median, ms) beside the two floors of the
plan: the fewest bytes the pass must move (every input read once, every output written
once) over 4.27 TB/s, and the FLOPs the chunk algorithm performs over 692 TFLOP/s (both
measured on the lent H200, `../shared/ENVIRONMENT.md`). Results go to `DIR/kernels.json`
and `DIR/kernels.md` with the machine, versions and date.

Made for a time-boxed GPU call (`docs/gpu-session.md`): plans are timed one at a time, in
the order of `PLANS` (the issue's targets first), and written out after each, so a call
cut short keeps every plan it finished. Compilation dominates a cold machine: our kernels
take 5-35 s of one core per plan, and flash-linear-attention autotunes 50-300 configs per
op, compiled one after the other inside a process. So worker processes compile into
Triton's disk cache first: every plan's jobs are queued at the start, in plan order (one
job for our kernels, `--fla-shards` jobs that each compile every n-th config of each of
fla's autotuned kernels), and the measuring process waits only for the current plan's,
then loads binaries and benchmarks fla's configs itself (`--tune-rep-ms` each) with the
workers stopped. A peer whose warm-up overruns `--compile-limit-s` is skipped for that
plan, with the reason in the results; no plan starts that the budget (`--budget-s`)
cannot hold, and a step that runs over is interrupted (SIGALRM) and recorded as such.

flash-linear-attention is optional: each peer is tried and its error recorded if it
refuses (its gated backward does on Hopper with Triton < 3.7.1). Where both ran, ours and
fla's call are then timed alternately (`--rounds`, `side_by_side_rounds`), and a target
takes that side-by-side ratio: a call of a few short kernels waits on the host's launches,
and the lent machine's host speed drifts between runs and over minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import hashlib
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import subprocess
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

COPY_BYTES_PER_S = 4.27e12  # measured device-to-device copy, H200
MATMUL_FLOPS_PER_S = 692e12  # measured bf16 8192^3 matmul, H200
CHUNK = 64


@dataclass(frozen=True)
class PlanSpec:
    """One plan family, as the layers would call `linear_recurrence`."""

    name: str
    transition: str = "householder"  # diagonal | householder | rwkv7
    gate: str = "none"  # none | scalar | channel
    n_h: int = 1
    osdn: str = ""  # "" | "osdn" | "apf": OSDN write keys (phase 1 included in the timing)
    beta_scale: float = 1.0  # 2.0: beta (or the rwkv7 erase rate) in [0, 2]
    gate_scale: float = 1.0  # the log-gates times this: 40 decays a 64-token chunk by ~e^-90 (decay.py's slower paths)
    fla: str = ""  # the flash-linear-attention peer, if it has this recurrence
    baseline: str = ""  # the plan this one is compared with in the targets


# In the order a time-boxed run measures them: the fla comparisons first, then the
# ratios to our own baselines (DeltaProduct, OSDN), then the larger n_h.
PLANS = [
    PlanSpec("deltanet", fla="delta_rule"),
    PlanSpec("gdn", gate="scalar", fla="gated_delta_rule"),
    PlanSpec("kda", gate="channel", fla="kda"),
    PlanSpec("rwkv7", "rwkv7", "channel", fla="rwkv7"),
    PlanSpec("gla-channel", "diagonal", "channel", fla="gla"),
    PlanSpec("gla-scalar", "diagonal", "scalar", fla="simple_gla"),
    PlanSpec("deltaproduct-2", n_h=2, fla="gated_delta_product", baseline="deltanet"),
    PlanSpec("gated-deltaproduct-2", gate="scalar", n_h=2, fla="gated_delta_product", baseline="gdn"),
    PlanSpec("osdn-deltanet", osdn="osdn", baseline="deltanet"),
    PlanSpec("osdn-apf-deltanet", osdn="apf", baseline="deltanet"),
    PlanSpec("osdn-gdn", gate="scalar", osdn="osdn", baseline="gdn"),
    PlanSpec("osdn-apf-gdn", gate="scalar", osdn="apf", baseline="gdn"),
    PlanSpec("gated-deltaproduct-3", gate="scalar", n_h=3, fla="gated_delta_product", baseline="gdn"),
    PlanSpec("deltaproduct-3", n_h=3, fla="gated_delta_product", baseline="deltanet"),
    PlanSpec("deltaproduct-4", n_h=4, fla="gated_delta_product", baseline="deltanet"),
    PlanSpec("gated-deltaproduct-4", gate="scalar", n_h=4, fla="gated_delta_product", baseline="gdn"),
]
# Paths that the GPU correctness check covers beyond the benchmarked families.
EXTRA_PLANS = [
    PlanSpec("linear-attention", "diagonal"),
    PlanSpec("deltaproduct-2-beta2", n_h=2, beta_scale=2.0),
    PlanSpec("rwkv7-scalar-2", "rwkv7", "scalar", n_h=2, beta_scale=2.0),
    PlanSpec("kda-2", gate="channel", n_h=2),
    PlanSpec("kda-4", gate="channel", n_h=4),
    PlanSpec("gated-deltaproduct-8-beta2", gate="scalar", n_h=8, beta_scale=2.0),
    PlanSpec("rwkv7-8", "rwkv7", "channel", n_h=8),
    # channel gates of about -1.4 per token (outliers -12): chunks decay by more than
    # decay.py's bound (per sub-chunk, or even per sub-chunk, exact loop), where the
    # mild gates above take its one-product path everywhere
    PlanSpec("kda-fast-decay", gate="channel", gate_scale=40.0),
    PlanSpec("rwkv7-fast-decay", "rwkv7", "channel", gate_scale=40.0),
]
ALL_PLANS = PLANS + EXTRA_PLANS


def plan_named(name: str) -> PlanSpec:
    return next(p for p in ALL_PLANS if p.name == name)


def make_inputs(plan: PlanSpec, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device, seed: int = 0,
                states: bool = False, lengths: list[int] | None = None) -> dict:
    """Leaf tensors as the layers produce them: unit keys, sigmoid beta and erase,
    log-sigmoid gates; `retain` is the OSDN-APF preconditioner's input. `states` adds an
    initial state (float32); `lengths` packs sequences of these token counts into one
    row (`B = 1`, `T = sum(lengths)`) and adds `cu_seqlens`."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    TN = T * plan.n_h

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    x: dict = {"q": F.normalize(rand(B, T, H, K), dim=-1), "k": F.normalize(rand(B, TN, H, K), dim=-1), "v": rand(B, TN, H, V)}
    if plan.gate == "scalar":
        x["g"] = plan.gate_scale * F.logsigmoid(rand(B, T, H) + 4.0)
    elif plan.gate == "channel":
        x["g"] = plan.gate_scale * F.logsigmoid(rand(B, T, H, K) + 4.0)
    if plan.transition == "householder":
        x["beta"] = plan.beta_scale * torch.sigmoid(rand(B, TN, H))
    if plan.transition == "rwkv7":
        x["erase"] = plan.beta_scale * torch.sigmoid(rand(B, TN, H, K)) * x["k"]
        x["write_key"] = F.normalize(rand(B, TN, H, K), dim=-1)
    if plan.osdn == "apf":
        x["retain"] = torch.sigmoid(rand(B, T, H) + 4.0)
    out = {name: val.to(dtype).requires_grad_() for name, val in x.items()}
    if states:
        rows = B if lengths is None else len(lengths)
        out["initial_state"] = (0.1 * rand(rows, H, K, V)).requires_grad_()
    if lengths is not None:
        assert B == 1 and sum(lengths) == T, "a packed batch is one row of sum(lengths) tokens"
        out["cu_seqlens"] = torch.tensor([0] + list(lengths), device=device).cumsum(0).to(torch.int32)
    return out


def run_plan(plan: PlanSpec, inputs: dict, backend: str, **options):
    """`(o, final_state)` of the plan (OSDN phase 1 included) on `backend`."""
    from archspec.kernels import linear_recurrence, osdn_write_keys

    args = {k: v for k, v in inputs.items() if k != "retain"}
    if plan.osdn:
        args["write_key"], _ = osdn_write_keys(inputs["k"], inputs["beta"], retain=inputs.get("retain"),
                                               cu_seqlens=inputs.get("cu_seqlens"), backend=backend)
    return linear_recurrence(**args, n_h=plan.n_h, backend=backend, **options)


# ---------------------------------------------------------------------------------------
# The two floors


def floor_bytes(plan: PlanSpec, inputs: dict, backward: bool) -> int:
    """Every input read once and the output written once (plus, with the backward, `dO`
    read and every input gradient written once). Intermediates are not counted."""
    read = sum(t.numel() * t.element_size() for t in inputs.values())
    q, v = inputs["q"], inputs["v"]
    out = q.shape[0] * q.shape[1] * q.shape[2] * v.shape[-1] * v.element_size()
    fwd = read + out
    if plan.osdn:  # the write keys go to memory and come back once
        fwd += 2 * inputs["k"].numel() * inputs["k"].element_size()
    return fwd + (out + read if backward else 0)


def chunk_flops(plan: PlanSpec, B: int, T: int, H: int, K: int, V: int) -> tuple[float, float]:
    """`(forward, backward)` FLOPs of the matmul-type work of the chunk algorithm as the
    Triton kernel performs it (`docs/kernel.md`, "Cost"), for `L` sub-steps and `C`
    query tokens per chunk; element-wise work (decays, the triangular solve by
    substitution) is left out of this floor."""
    L = (CHUNK // plan.n_h) * plan.n_h
    C = CHUNK // plan.n_h
    chunks = B * H * math.ceil(T / C)
    mm = lambda m, n, k: 2.0 * m * n * k  # noqa: E731
    delta = plan.transition != "diagonal"
    plain = plan.transition != "householder"
    fwd = mm(C, K, V)  # Q~ S_0
    bwd = 2 * mm(C, K, V)  # dO S_0^T, Q~^T dO
    if delta:
        fwd += mm(L, L, K) + mm(L, L, K) + mm(L, L, V)  # A, P = Tinv K~, X = Tinv Z
        fwd += mm(L, K, V) * 2  # Y = X - P S_0, E~^T Y
        fwd += mm(C, L, K) + mm(C, L, V)  # M_E, M_E Y
        bwd += mm(C, L, K) + mm(L, C, V)  # scores again, M_E^T dO
        bwd += mm(L, K, V) * 2  # E_end dS, P^T dY
        bwd += mm(C, L, V) + mm(L, K, V) * 2 + mm(L, L, V) * 2  # dO Y^T, Y dS^T, dY S_0^T, Tinv^T dY, dY Z^T
        bwd += mm(L, L, K) * 3 + mm(L, L, L) * 2  # A again, dT terms, dA
        bwd += mm(L, L, K) * 2 + mm(C, L, K) * 2  # applies of dA and dM_E
    if plain:
        fwd += mm(L, K, V) + mm(C, L, K) + mm(C, L, V)  # W~^T U, M_W, M_W U
        bwd += mm(C, L, K) + mm(L, C, V) + mm(L, K, V)  # M_W again, M_W^T dO, W_end dS
        bwd += mm(C, L, V) + mm(L, K, V) + mm(C, L, K) * 2  # dO U^T, U dS^T, applies of dM_W
    if delta and plain:  # rwkv7: the write keys enter the UT transform too
        fwd += mm(L, L, K) + mm(L, L, L)
        bwd += mm(L, L, K) * 3 + mm(L, L, V) * 2
    return fwd * chunks, bwd * chunks


def floors(plan: PlanSpec, inputs: dict, shape: dict) -> dict:
    fb, bb = floor_bytes(plan, inputs, False), floor_bytes(plan, inputs, True)
    ff, fbw = chunk_flops(plan, *(shape[n] for n in "BTHKV"))
    return {
        "bytes_fwd": fb, "bytes_fwdbwd": bb, "flops_fwd": ff, "flops_fwdbwd": ff + fbw,
        "floor_fwd_ms": 1e3 * max(fb / COPY_BYTES_PER_S, ff / MATMUL_FLOPS_PER_S),
        "floor_fwdbwd_ms": 1e3 * max(bb / COPY_BYTES_PER_S, (ff + fbw) / MATMUL_FLOPS_PER_S),
    }


# ---------------------------------------------------------------------------------------
# The clock: progress lines and deadlines


class OutOfTime(Exception):
    pass


class Clock:
    """Seconds since the script started, against its budget."""

    def __init__(self, budget_s: float):
        self.start, self.budget = time.monotonic(), budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget - self.elapsed()

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise `OutOfTime` in the main thread after `seconds`. SIGALRM interrupts Python
    code between bytecodes (an autotuner's loop over configs, do_bench's loop); one call
    into C++ (a single kernel compile) finishes first, a few seconds at most."""
    if seconds <= 0:
        raise OutOfTime("no time left")

    def alarm(signum, frame):
        raise OutOfTime(f"over its {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------------------------
# Timing


def _bench(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def host_ms(fn, calls: int = 20) -> float | None:
    """The host's time to issue one call, ms. The calls are queued behind a GPU sleep, so the
    GPU never waits on them and the CPU clock measures only the launches and the Python
    around them (20 forward+backward calls of ~25 launches stay inside CUDA's launch queue).
    Beside do_bench's wall time and the kernels' GPU time it says whether a short call is
    host-bound: when it exceeds the kernels' time, the GPU idles between calls."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if not torch.cuda.is_available() or sleep is None:
        return None
    fn()
    torch.cuda.synchronize()
    sleep(200_000_000)  # GPU cycles: ~0.1 s at the H200's clock, longer than the 20 calls' issue
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e3
    still_asleep = not torch.cuda.current_stream().query()  # else a call waited on the GPU: no figure
    torch.cuda.synchronize()
    return round(host, 4) if still_asleep else None


def kernel_breakdown(step, repeats: int = 3, top: int = 10) -> list[list]:
    """GPU time per kernel of one `step()` (mean over `repeats`, ms), largest first: where
    an implementation spends its time, to set beside the floors and the peer's kernels."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for ev in prof.events():
        t = getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0.0)  # microseconds
        if t and getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type):
            totals[ev.name] = totals.get(ev.name, 0.0) + t
    rows = sorted(totals.items(), key=lambda kv: -kv[1])
    return [[name[:80], round(us / repeats / 1000, 4)] for name, us in rows[:top]] + (
        [["(sum of all kernels)", round(sum(totals.values()) / repeats / 1000, 4)]] if rows else [])


BACKWARD = "fixed output gradients"  # how forward+backward is timed (`_forward_and_backward`)


def backward_of(results: dict) -> str:
    """How a results file timed forward+backward: files before session 8 formed a loss
    (`o.float().square().sum()`) inside the timed step."""
    return results.get("backward", "a loss in the step")


def _forward_and_backward(fn, inputs: dict):
    """One forward and backward of `fn`, given fixed output gradients (as fla's benchmarks
    do): a loss formed inside the step would add its own element-wise kernels (a cast, a
    square, their gradients; about 0.26 ms at the issue's shape) to every row alike."""
    leaves = [t for t in inputs.values() if t.requires_grad]
    o, s = fn()
    with_state = s is not None and s.requires_grad  # a peer may hand back a detached state
    grads = [1e-3 * torch.randn_like(o)] + ([1e-3 * torch.randn_like(s)] if with_state else [])
    del o, s

    def step():
        o, s = fn()
        torch.autograd.grad([o] + ([s] if with_state else []), leaves, grads, allow_unused=True)

    return step


def fla_callable(plan: PlanSpec, inputs: dict):
    """The flash-linear-attention call with this recurrence, or None."""
    x = inputs
    if plan.fla == "delta_rule":
        from fla.ops.delta_rule import chunk_delta_rule

        return lambda: chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"])
    if plan.fla == "gated_delta_rule":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return lambda: chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"].float(), x["beta"])
    if plan.fla == "gla":
        from fla.ops.gla import chunk_gla

        return lambda: chunk_gla(x["q"], x["k"], x["v"], x["g"].float())
    if plan.fla == "simple_gla":
        from fla.ops.simple_gla import chunk_simple_gla

        return lambda: chunk_simple_gla(x["q"], x["k"], x["v"], x["g"].float())
    if plan.fla == "kda":
        from fla.ops.kda import chunk_kda

        return lambda: chunk_kda(x["q"], x["k"], x["v"], x["g"].float(), x["beta"])
    if plan.fla == "gated_delta_product":
        from fla.ops.gated_delta_product import chunk_gated_delta_product

        g = x.get("g")
        return lambda: chunk_gated_delta_product(x["q"], x["k"], x["v"], None if g is None else g.float(), x["beta"], num_householder=plan.n_h)
    if plan.fla == "rwkv7":
        from fla.ops.rwkv7 import chunk_rwkv7

        # RWKV-7's DPLR form: S <- S (D + a b^T) + k v^T with a = -erase direction, b = key
        return lambda: chunk_rwkv7(x["q"], x["g"], x["write_key"], x["v"], -x["k"], x["erase"])
    return None


def impl_callable(plan: PlanSpec, impl: str, inputs: dict, **options):
    """`fn() -> (o, final_state)` of one implementation, or None (fla has no such op)."""
    if impl == "fla":
        return fla_callable(plan, inputs)
    return lambda: run_plan(plan, inputs, impl, **options)


def quick_tuning(rep_ms: int) -> None:
    """Autotuners benchmark each config for `rep_ms` instead of Triton's 100 ms (+25 ms
    warm-up): with 85-300 configs per fla op, that is 10-40 s less per plan, and the
    kernels (0.05-2 ms) still get 10+ samples per config to rank them."""
    import triton.testing
    from triton.runtime.autotuner import Autotuner

    bench = functools.partial(triton.testing.do_bench, warmup=max(1, rep_ms // 4), rep=rep_ms)
    Autotuner.do_bench = property(lambda self: bench)


# ---------------------------------------------------------------------------------------
# Parallel warm-up: compile into Triton's disk cache in worker processes


@dataclass(frozen=True)
class WarmJob:
    """Run `impl` of one plan forward and backward once, as the measurement (or the
    check) will, so that its kernels are compiled. `shard = (j, n)`: autotuners compile
    only configs j, j+n, j+2n, ... (n workers cover them all between them)."""

    plan: str
    impl: str
    dtype: str
    shape: tuple  # B, T, H, K, V
    shard: tuple | None = None
    states: bool = False
    lengths: tuple | None = None
    device: str = "cuda"


_SHARD: tuple | None = None


def _run_once(kernel_call, quantiles=None) -> list[float]:
    kernel_call()
    return [0.0, 0.0, 0.0]


def _worker_init() -> None:
    """In each warm-up worker, autotuners compile (and launch once) the current job's
    shard of configs instead of benchmarking them: the measuring process benchmarks every
    config itself, alone on the GPU. They tune again on every call, so that a worker
    reused across plans still compiles its shard where an earlier job met the same key."""
    os.environ["FLA_CACHE_RESULTS"] = "0"  # a shard's pick (all timings 0) must not reach the disk cache
    from triton.runtime.autotuner import Autotuner

    prune, run = Autotuner.prune_configs, Autotuner.run

    def shard_prune(self, kwargs):
        configs = prune(self, kwargs)
        if _SHARD is None:
            return configs
        j, n = _SHARD
        return configs[j::n] or [configs[j % len(configs)]]

    def fresh_run(self, *args, **kwargs):
        self.cache.clear()
        return run(self, *args, **kwargs)

    Autotuner.prune_configs, Autotuner.run = shard_prune, fresh_run
    Autotuner.do_bench = property(lambda self: _run_once)


def _warm_task(job: WarmJob) -> tuple[WarmJob, str, float]:
    global _SHARD
    _SHARD = job.shard
    t0 = time.monotonic()
    step = "forward"
    cuda = job.device == "cuda"
    try:
        plan = plan_named(job.plan)
        B, T, H, K, V = job.shape
        inputs = make_inputs(plan, B, T, H, K, V, getattr(torch, job.dtype), job.device, states=job.states, lengths=job.lengths)
        options = {"output_final_state": True} if job.states else {}
        fn = impl_callable(plan, job.impl, inputs, **options)
        if fn is not None:
            # forward and backward apart, each synchronized inside the try: a kernel that
            # faults (an illegal address) is then reported as this job's status, by pass
            fn()
            if cuda:
                torch.cuda.synchronize()
            step = "backward"
            _forward_and_backward(fn, inputs)()
            if cuda:
                torch.cuda.synchronize()
        status = "ok"
    except Exception as err:  # a refusal (fla's gated backward) is a result: the forward is compiled
        status = f"{step}: {_first_line(err)}"
    finally:
        inputs = fn = None  # noqa: F841 (release the tensors before emptying the cache)
    if cuda:
        # a worker keeps its caching allocator's peak otherwise: 14 idle workers held
        # 4-14 GiB each on the H200 and the measuring process ran out of memory
        try:
            torch.cuda.empty_cache()
        except Exception:  # a context poisoned by a fault cannot free; the process ends anyway
            pass
    return job, status, time.monotonic() - t0


class WarmPool:
    """Spawned workers that take warm-up jobs first in, first out: the jobs of every plan
    are submitted at the start, so workers that finish one plan's jobs go on to the next
    plans' while the slowest job of the current plan runs, and no core idles. While the
    measuring process times a plan, the workers are stopped (SIGSTOP), so that neither
    their compiles nor their launches disturb the timing."""

    def __init__(self, workers: int, fresh_process_per_job: bool = False):
        # A fresh process per job (correctness checks) keeps a kernel fault in one job
        # from poisoning the CUDA context of every later job of that worker.
        self.workers = workers
        self.pool = mp.get_context("spawn").Pool(workers, initializer=_worker_init,
                                                 maxtasksperchild=1 if fresh_process_per_job else None)

    def submit(self, jobs: list[WarmJob]) -> list:
        return [(job, self.pool.apply_async(_warm_task, (job,))) for job in jobs]

    def wait(self, pending: list, limit_s: float) -> list[tuple[WarmJob, str, float]]:
        """Results of `pending` within `limit_s`; a job not done by then is reported as
        such and left running (its kernels still reach the cache for later plans)."""
        end = time.monotonic() + limit_s
        done = []
        for job, result in pending:
            try:
                done.append(result.get(timeout=max(0.0, end - time.monotonic())))
            except mp.TimeoutError:
                done.append((job, f"{NOT_DONE} in {limit_s:.0f} s", limit_s))
        return done

    @contextlib.contextmanager
    def stopped(self):
        procs = list(self.pool._pool)  # the workers (a private attribute, stable since Python 3.2)
        for p in procs:
            os.kill(p.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for p in procs:
                os.kill(p.pid, signal.SIGCONT)

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


NOT_DONE = "warm-up not finished"


def warm_jobs(plan: PlanSpec, impls: list[str], dtype: str, shape: tuple, fla_shards: int) -> list[WarmJob]:
    """Our kernels in one job, fla's autotuned configs split over `fla_shards` jobs (more
    shards would compile its few-config kernels once per shard for nothing)."""
    jobs = [WarmJob(plan.name, "triton", dtype, shape)] if "triton" in impls else []
    if "fla" in impls and plan.fla:
        jobs += [WarmJob(plan.name, "fla", dtype, shape, shard=(j, fla_shards)) for j in range(fla_shards)]
    return jobs


# ---------------------------------------------------------------------------------------
# Measuring one plan


@dataclass
class Row:
    plan: str
    impl: str
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    first_call_s: float | None = None  # compile (or cache load) and autotuning
    error: str = ""
    kernels: dict | None = None  # GPU ms per kernel, forward and forward+backward (--profile)
    host_fwd_ms: float | None = None  # the host's time to issue one call (`host_ms`, --profile)
    host_fwdbwd_ms: float | None = None
    autotuned: dict | None = None  # a peer's autotuned kernels: the configuration each picked here


def autotuned_configs(package: str = "fla") -> dict:
    """`{kernel: config}` for every Triton autotuner in `package`'s loaded modules that has
    picked one (`best_config`): which launch settings the peer ran at on this machine, so
    that ours can be timed at the same ones."""
    import sys

    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        for attr, obj in list(vars(module).items()):
            best = getattr(obj, "best_config", None)
            while best is None and hasattr(obj, "fn") and obj is not getattr(obj, "fn"):
                obj = obj.fn  # a heuristics wrapper around the autotuner
                best = getattr(obj, "best_config", None)
            if best is not None:
                found[f"{name}.{attr}"] = str(best)
    return found


def cut_short(error: str) -> bool:
    # out of memory too: the warm-up workers' memory, not the plan, was the cause once
    return "out of time" in error or error.startswith("skipped") or "OutOfMemoryError" in error


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"


def measure_impl(plan: PlanSpec, impl: str, inputs: dict, seconds: float, profile: bool = False) -> Row | None:
    """One implementation's row, every step within `seconds`; None if it lacks the plan."""
    row = Row(plan.name, impl)
    step, start = "forward", time.monotonic()
    try:
        with deadline(seconds):
            fn = impl_callable(plan, impl, inputs)
            if fn is None:
                return None
            t0 = time.monotonic()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            row.first_call_s = round(time.monotonic() - t0, 2)
            row.fwd_ms = _bench(fn)
            step = "backward"
            fb = _forward_and_backward(fn, inputs)
            row.fwdbwd_ms = _bench(fb)
            if profile and torch.cuda.is_available():
                step = "profile"
                row.kernels = {"forward": kernel_breakdown(fn), "forward_backward": kernel_breakdown(fb)}
                row.host_fwd_ms, row.host_fwdbwd_ms = host_ms(fn), host_ms(fb)
            if impl == "fla":
                row.autotuned = autotuned_configs() or None
    except ImportError as err:
        row.error = f"not installed: {err}"
    except OutOfTime as err:
        row.error = f"{step}: out of time ({err})"
    except Exception as err:  # a peer that refuses is a result, not a crash
        # the alarm can land inside Triton's compiler, which wraps it in its own error
        late = time.monotonic() - start >= seconds
        row.error = f"{step}: {'out of time: ' if late else ''}{_first_line(err)}"
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def measure_plan(plan: PlanSpec, shape: dict, dtype: str, impls: list[str], device, clock: Clock, args,
                 pool: WarmPool | None, pending: list) -> dict:
    """Wait for the plan's warm-up jobs, then time each implementation with the workers
    stopped; every step ends by the plan's deadline."""
    end = min(clock.elapsed() + args.plan_limit_s, clock.budget - args.reserve_s)
    inputs = make_inputs(plan, *(shape[n] for n in "BTHKV"), getattr(torch, dtype), device)
    entry = {"spec": asdict(plan), "floors": floors(plan, inputs, shape), "rows": [], "warmup": {}, "skipped": {}}
    if pool is not None and pending:
        limit = min(args.compile_limit_s, end - clock.elapsed())
        t0 = time.monotonic()
        done = pool.wait(pending, limit)
        for impl in dict.fromkeys(job.impl for job, _, _ in done):
            mine = [(status, s) for job, status, s in done if job.impl == impl]
            late = [st for st, _ in mine if st.startswith(NOT_DONE)]
            entry["warmup"][impl] = {"jobs": len(mine), "max_s": round(max(s for _, s in mine), 1), "status": late[0] if late else mine[0][0]}
            if late and impl == "fla":  # its own first call would compile the rest one by one: minutes
                entry["skipped"]["fla"] = f"compile warm-up ({len(mine)} shards) not finished in {limit:.0f} s"
        clock.log(f"{plan.name}: waited {time.monotonic() - t0:.1f}s for its warm-up; "
                  + ", ".join(f"{k} {v['max_s']}s {v['status'][:60]}" for k, v in entry["warmup"].items()))
    with pool.stopped() if pool is not None else contextlib.nullcontext():
        for impl in impls:
            if impl in entry["skipped"]:
                entry["rows"].append(asdict(Row(plan.name, impl, error="skipped: " + entry["skipped"][impl])))
                continue
            row = measure_impl(plan, impl, inputs, end - clock.elapsed(), profile=args.profile and impl != "torch")
            if row is None:
                continue
            entry["rows"].append(asdict(row))
            ms = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            clock.log(f"{plan.name}: {impl:6s} fwd {ms(row.fwd_ms)} ms, f+b {ms(row.fwdbwd_ms)} ms, first call {row.first_call_s} s {row.error[:120]}")
            for kernel, t in (row.kernels or {}).get("forward_backward", [])[:8]:
                clock.log(f"    {t:8.4f} ms  {kernel}")
        timed = {r["impl"] for r in entry["rows"] if r.get("fwd_ms") is not None}
        if args.rounds and {"triton", "fla"} <= timed:
            entry["side_by_side"] = side_by_side_rounds(plan, inputs, args.rounds, end - clock.elapsed())
            clock.log(f"{plan.name}: side by side " + ", ".join(
                f"{key} {ratio:.3f}" for key in entry["side_by_side"] if (ratio := _ratio(side_by_side(entry, key)))))
    return entry


def side_by_side_rounds(plan: PlanSpec, inputs: dict, rounds: int, seconds: float,
                        passes: tuple[str, ...] = ("fwd_ms", "fwdbwd_ms")) -> dict:
    """Ours and fla's call timed alternately, `rounds` times each, for each of `passes`
    that fla runs (its gated backward refuses): the fair ratio where a call waits on the
    host (`side_by_side`). fla's first call (its autotuning) comes before the rounds."""
    ours, peer = impl_callable(plan, "triton", inputs), impl_callable(plan, "fla", inputs)
    out: dict = {}
    try:
        with deadline(seconds):
            for key in passes:
                a, b = (f if key == "fwd_ms" else _forward_and_backward(f, inputs) for f in (ours, peer))
                try:
                    b()  # fla's gated backward refuses on Triton < 3.7.1
                except Exception:  # noqa: BLE001, S112 - no pair for this pass
                    continue
                pair: dict = {"ours_ms": [], "fla_ms": []}
                for _ in range(rounds):
                    pair["ours_ms"].append(round(_bench(a), 4))
                    pair["fla_ms"].append(round(_bench(b), 4))
                out[key] = pair
    except OutOfTime:
        pass  # the pairs finished before the plan's deadline are kept
    return out


# ---------------------------------------------------------------------------------------
# Results


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "date": datetime.date.today().isoformat()}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        info["commit"] = None
    # The lent GPU's copy of the tree can carry a stale .git (it reported session 2's commit in
    # session 3), so the kernels' own sources are fingerprinted too: compare with
    # `cat $(ls kernels/triton/*.py | sort) | sha1sum` at a commit.
    sources = sorted((Path(__file__).resolve().parents[1] / "kernels" / "triton").glob("*.py"))
    info["kernels_sha1"] = hashlib.sha1(b"".join(f.read_bytes() for f in sources)).hexdigest()[:12]
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import fla

        info["fla"] = getattr(fla, "__version__", "?")
    except ImportError:
        info["fla"] = None
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return info


# The performance targets (issue 6): plans held to flash-linear-attention's time, in both
# passes or the forward only (where fla's backward refuses on the H200's Triton 3.6).
FLA_BOTH = ("deltanet", "gla-channel", "kda", "rwkv7")
FLA_FORWARD = ("gdn", "gated-deltaproduct-2", "gated-deltaproduct-3", "gated-deltaproduct-4", "gla-scalar")
PASSES = (("fwd_ms", "forward", "floor_fwd_ms"), ("fwdbwd_ms", "forward+backward", "floor_fwdbwd_ms"))


def targets(results: dict) -> list[dict]:
    """Each target with its measured ratio and the limit it must stay under."""
    plans = results["plans"]

    def ms(name: str, impl: str, key: str) -> float | None:
        rows = {r["impl"]: r for r in plans.get(name, {}).get("rows", [])}
        return rows.get(impl, {}).get(key)

    out = []

    def add(target: str, a: float | None, b: float | None, limit: float) -> None:
        ratio = None if a is None or not b else a / b  # no ratio without both (smoke runs time 0)
        out.append({"target": target, "ratio": ratio, "limit": limit, "met": None if ratio is None else ratio <= limit})

    for name in FLA_BOTH + FLA_FORWARD:
        for key, label, _ in PASSES[: 2 if name in FLA_BOTH else 1]:
            pair = side_by_side(results, name, key)
            if pair:  # timed alternately in one process: the fair ratio where the host sets the wall
                add(f"{name} {label}: ours / fla, side by side", *pair, 1.0)
            else:
                add(f"{name} {label}: ours / fla", ms(name, "triton", key), ms(name, "fla", key), 1.0)
    add("deltaproduct-2 / deltanet, ours, forward+backward", ms("deltaproduct-2", "triton", "fwdbwd_ms"), ms("deltanet", "triton", "fwdbwd_ms"), 1.8)
    for plan in PLANS:
        if plan.osdn:
            for key, label, _ in PASSES:
                add(f"{plan.name} / {plan.baseline}, ours, {label}", ms(plan.name, "triton", key), ms(plan.baseline, "triton", key), 1.05)
    # "no path slower than 2x its floor-scaled DeltaNet counterpart": time over floor,
    # relative to DeltaNet's time over its floor
    for plan in PLANS[1:]:
        for key, label, floor in PASSES:
            a, b = ms(plan.name, "triton", key), ms("deltanet", "triton", key)
            floors = [plans.get(n, {}).get("floors", {}).get(floor) for n in (plan.name, "deltanet")]
            if a is not None and b is not None and all(floors):
                a, b = a / floors[0], b / floors[1]
            else:
                a = None
            add(f"{plan.name} {label}: (ours / floor) / deltanet's", a, b, 2.0)
    return out


def _ratio(pair: tuple[float, float] | None) -> float | None:
    return None if not pair or not pair[1] else pair[0] / pair[1]


def side_by_side_pairs(results: dict) -> dict:
    """plan -> {pass key -> its rounds}: from the plans' own entries (`kernels.py
    --rounds`), else from the results' `side_by_side` (rounds of `launch_sweep.py --fla`)."""
    pairs = {name: dict(entry) for name, entry in results.get("side_by_side", {}).items()}
    for name, entry in results.get("plans", {}).items():
        pairs.setdefault(name, {}).update(entry.get("side_by_side", {}))
    return {name: entry for name, entry in pairs.items() if entry}


def side_by_side(results: dict, name: str, key: str | None = None) -> tuple[float, float] | None:
    """The medians of ours and fla's `key` timed alternately in one process
    (`benchmarks/launch_sweep.py --fla`), if the results carry them. A forward of a few
    short kernels waits on the host's launches, and the host's speed drifts between
    processes and over minutes (session 7, Gated DeltaNet's forward: 0.46-0.71 ms for the
    same 0.43 ms of kernels), so its ratio against a peer timed in another run says more
    about the two hosts than about the two implementations."""
    if key is None:  # `results` is one plan's entry and `name` the pass key
        pair = results.get("side_by_side", {}).get(name)
    else:
        pair = side_by_side_pairs(results).get(name, {}).get(key)
    if not pair:
        return None
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return median(pair["ours_ms"]), median(pair["fla_ms"])


HOST_WAIT = 1.1  # wall over kernel time above which a call is reported as waiting on the host


def host_waits(profiled: list[tuple[str, dict]]) -> list[tuple[str, str, str, float, float, float | None]]:
    """`(plan, impl, pass, wall ms, kernels ms, host ms)` where do_bench's wall time exceeds
    the sum of the call's kernel times (torch.profiler) by more than `HOST_WAIT`: a short
    call whose GPU idles between launches (do_bench times the events around each call);
    host ms is the time the host took to issue one call (`host_ms`; None in older runs)."""
    out = []
    for name, row in profiled:
        for key, label, _ in PASSES:
            kernels = dict(row["kernels"].get("forward" if key == "fwd_ms" else "forward_backward", []))
            gpu, wall = kernels.get("(sum of all kernels)"), row.get(key)
            if gpu and wall and wall > HOST_WAIT * gpu:
                out.append((name, row["impl"], label, wall, gpu, row.get("host_" + key)))
    return out


def peer_impls(results: dict) -> str:
    """The implementations whose rows `--peers` took from the earlier run, e.g. "torch"."""
    impls = sorted({r["impl"] for e in results["plans"].values() for r in e["rows"] if r.get("from_earlier_run")})
    return " and ".join(impls) or "no"


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"Kernel timings on {m.get('device', 'cpu')} (torch {m['torch']}, triton {m.get('triton')}, fla {m.get('fla')}, {m['date']}); "
        f"B={results['shape']['B']} T={results['shape']['T']} H={results['shape']['H']} K={results['shape']['K']} V={results['shape']['V']} {results['dtype']}, median ms.",
        *([f"{peer_impls(results)} rows from an earlier run on {results['peers_from'].get('device', 'cpu')} "
           f"(torch {results['peers_from']['torch']}, triton {results['peers_from'].get('triton')}, "
           f"fla {results['peers_from'].get('fla')}, {results['peers_from']['date']}): `--peers`"
           + ("." if backward_of(results["peers_from"]) == backward_of(results) else
              f"; their forward+backward was timed with {backward_of(results['peers_from'])} (about 0.26 ms more at this shape).")]
          if results.get("peers_from") else []),
        *([results["note"]] if results.get("note") else []),
        "",
        "| plan | floor fwd | ours fwd | fla fwd | ours/fla | floor f+b | ours f+b | fla f+b | ours/fla | torch f+b |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
    ratio = lambda a, b: "—" if a is None or b is None else f"{a / b:.2f}"  # noqa: E731

    def ratio_cell(name: str, key: str, a: float | None, b: float | None) -> str:
        pair = side_by_side(results, name, key)  # the fair ratio where the rows come from two hosts
        return f"{ratio(*pair)}†" if pair else ratio(a, b)

    order = [p.name for p in PLANS if p.name in results["plans"]] + [n for n in results["plans"] if n not in {p.name for p in PLANS}]
    for name in order:
        entry = results["plans"][name]
        r = {row["impl"]: row for row in entry["rows"]}
        ours, peer, tor = r.get("triton", {}), r.get("fla", {}), r.get("torch", {})
        fl = entry["floors"]
        lines.append(
            f"| {name} | {fl['floor_fwd_ms']:.3f} | {fmt(ours.get('fwd_ms'))} | {fmt(peer.get('fwd_ms'))} "
            f"| {ratio_cell(name, 'fwd_ms', ours.get('fwd_ms'), peer.get('fwd_ms'))} "
            f"| {fl['floor_fwdbwd_ms']:.3f} | {fmt(ours.get('fwdbwd_ms'))} | {fmt(peer.get('fwdbwd_ms'))} "
            f"| {ratio_cell(name, 'fwdbwd_ms', ours.get('fwdbwd_ms'), peer.get('fwdbwd_ms'))} "
            f"| {fmt(tor.get('fwdbwd_ms'))} |"
        )
    if side_by_side_pairs(results):
        lines += ["", "† Timed side by side (the table below the targets): the row's two wall times come from "
                  "different runs, and this call waits on the host's launches, whose speed drifts between runs."]
    notes = [f"- {name} / {row['impl']}: {row['error']}" for name, e in results["plans"].items() for row in e["rows"] if row["error"]]
    if notes:
        lines += ["", "Refusals and errors:", *notes]
    settings = [f"- {name} / {row['impl']}: {row['setting']}" for name in order for row in results["plans"][name]["rows"]
                if row.get("setting")]
    if settings:  # rows adopted from another run (benchmarks/adopt_variant_rows.py)
        lines += ["", "Rows from another run than the table's:", *settings]
    rows = targets(results)
    if any(t["ratio"] is not None for t in rows):
        met = sum(bool(t["met"]) for t in rows)
        lines += ["", f"Targets (issue 6): {met} of {sum(t['ratio'] is not None for t in rows)} met.", "",
                  "| target | measured | limit | met |", "|---|---|---|---|"]
        lines += [f"| {t['target']} | {fmt(t['ratio'])} | {t['limit']} | {'yes' if t['met'] else 'no'} |" for t in rows if t["ratio"] is not None]
    pairs = [(name, key, pair) for name, entry in side_by_side_pairs(results).items() for key, pair in entry.items()]
    if pairs:
        lines += ["", "Timed side by side (ours and fla's call alternately in one process: `kernels.py --rounds`, or `launch_sweep.py --fla`; "
                  "medians of each `do_bench` median, ms, and the GPU time of the kernels):", "",
                  "| plan | pass | ours | fla | ours/fla | ours kernels | fla kernels | rounds |", "|---|---|---|---|---|---|---|---|"]
        def kernels_ms(name: str, impl: str, key: str) -> float | None:  # the row's own profile, if any
            row = next((r for r in results["plans"].get(name, {}).get("rows", []) if r["impl"] == impl), {})
            return dict((row.get("kernels") or {}).get("forward" if key == "fwd_ms" else "forward_backward", [])).get("(sum of all kernels)")

        for name, key, pair in pairs:
            a, b = side_by_side(results, name, key)
            ours_k = pair.get("ours_kernels_ms") or kernels_ms(name, "triton", key)
            fla_k = pair.get("fla_kernels_ms") or kernels_ms(name, "fla", key)
            lines.append(f"| {name} | { {k: lab for k, lab, _ in PASSES}[key]} | {a:.3f} | {b:.3f} | {a / b:.2f} "
                         f"| {fmt(ours_k)} | {fmt(fla_k)} | {len(pair['ours_ms'])} |")
    profiled = [(name, row) for name in order for row in results["plans"][name]["rows"] if row.get("kernels")]
    waits = host_waits(profiled)
    if waits:
        lines += ["", "Calls that waited on the host (wall time over the GPU time of their kernels by more than "
                  f"{HOST_WAIT - 1:.0%}: the launches, not the kernels, set the wall time; it varies with the host):", "",
                  "| plan | pass | wall ms | kernels ms | host ms per call |", "|---|---|---|---|---|"]
        lines += [f"| {name} / {impl} | {label} | {wall:.3f} | {gpu:.3f} | {fmt(host)} |"
                  for name, impl, label, wall, gpu, host in waits]
    if profiled:
        lines += ["", "Where the time goes (forward+backward, GPU ms per kernel, torch.profiler; the largest five):", ""]
        for name, row in profiled:
            top = ", ".join(f"{k} {t:.3f}" for k, t in row["kernels"]["forward_backward"][:5])
            lines.append(f"- {name} / {row['impl']}: {top}")
    missing = [p.name for p in PLANS if p.name not in results["plans"]]
    if missing:
        lines += ["", f"Not measured: {', '.join(missing)}" + (f" ({results['stopped']})" if results.get("stopped") else "")]
    return "\n".join(lines) + "\n"


def _write(results: dict, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (out / "kernels.md").write_text(table)
    return table


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--plans", default="", help="comma-separated plan names (default: all, in PLANS order)")
    parser.add_argument("--resume", default="", help="an earlier kernels.json: keep its plans, measure the others")
    parser.add_argument("--no-torch", action="store_true", help="skip our torch backend")
    parser.add_argument("--no-fla", action="store_true", help="skip flash-linear-attention")
    parser.add_argument("--peers", default="", help="an earlier kernels.json of the same machine and shape: the rows of "
                        "the implementations skipped here (fla, torch) are taken from it, and its machine is recorded")
    parser.add_argument("--shape", default="4,4096,16,128,128", help="B,T,H,K,V")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--budget-s", type=float, default=1e9, help="wall-clock budget of the whole run (from its start)")
    parser.add_argument("--reserve-s", type=float, default=10, help="left unused at the budget's end (final write, exit)")
    parser.add_argument("--plan-limit-s", type=float, default=240, help="most seconds one plan may take, warm-up included")
    parser.add_argument("--compile-limit-s", type=float, default=150, help="most seconds one plan's parallel warm-up may take")
    parser.add_argument("--min-plan-s", type=float, default=40, help="start no plan with less budget left than this")
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)), help="warm-up processes (GPU); 0: none")
    parser.add_argument("--fla-shards", type=int, default=6, help="warm-up jobs that split fla's autotune configs of one plan")
    parser.add_argument("--tune-rep-ms", type=int, default=20, help="benchmark time per autotune config (Triton's default: 100)")
    parser.add_argument("--rounds", type=int, default=5, help="then ours and fla's call timed alternately this many times each "
                        "(0: not): the targets' ratio where a call waits on the host, whose speed drifts")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter: checks that the script runs")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the per-kernel GPU time breakdown of ours and fla's (torch.profiler, a few steps)")
    args = parser.parse_args(argv)
    clock = Clock(args.budget_s)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.shape, args.no_fla = "1,32,1,16,16", True
        global _bench  # the interpreter has no do_bench timer: run each path once instead
        _bench = lambda fn, **_: (fn(), 0.0)[1]  # noqa: E731
    B, T, H, K, V = (int(x) for x in args.shape.split(","))
    shape = dict(B=B, T=T, H=H, K=K, V=V)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    impls = ["triton"] + ([] if args.no_fla else ["fla"]) + ([] if args.no_torch else ["torch"])
    names = args.plans.split(",") if args.plans else [p.name for p in PLANS]
    unknown = set(names) - {p.name for p in ALL_PLANS}
    if unknown:
        parser.error(f"unknown plans: {', '.join(sorted(unknown))}")
    results = {"machine": machine(), "shape": shape, "dtype": args.dtype, "backward": BACKWARD, "plans": {}, "stopped": None}
    if args.resume and Path(args.resume).exists():
        earlier = json.loads(Path(args.resume).read_text())
        if (earlier["shape"], earlier["dtype"], backward_of(earlier)) != (shape, args.dtype, BACKWARD):
            clock.log(f"--resume {args.resume}: another shape, dtype or backward ({backward_of(earlier)}); measuring all again")
        else:
            # a plan cut short (out of time, fla skipped) is measured again
            whole = {n: e for n, e in earlier["plans"].items() if not any(cut_short(r["error"]) for r in e["rows"])}
            results["plans"], results["resumed_from"] = whole, earlier["machine"]
            clock.log(f"resumed: {', '.join(whole) or 'nothing'} already measured")
    peers = {}
    if args.peers:
        earlier = json.loads(Path(args.peers).read_text())
        if earlier["shape"] != shape or earlier["dtype"] != args.dtype:
            parser.error(f"--peers {args.peers}: shape {earlier['shape']} {earlier['dtype']} differs from this run's")
        peers, results["peers_from"] = earlier["plans"], {**earlier["machine"], "backward": backward_of(earlier)}
    todo = [plan_named(n) for n in names if n not in results["plans"]]
    clock.log(f"{len(todo)} plans, impls {impls}, budget {args.budget_s:.0f}s, {args.workers if cuda else 0} warm-up workers")
    if cuda:
        quick_tuning(args.tune_rep_ms)
    pool = WarmPool(args.workers) if cuda and args.workers > 0 else None
    shape_t = tuple(shape[n] for n in "BTHKV")
    pending = {p.name: pool.submit(warm_jobs(p, impls, args.dtype, shape_t, args.fla_shards)) if pool else [] for p in todo}
    try:
        for plan in todo:
            if clock.left() - args.reserve_s < args.min_plan_s:
                results["stopped"] = f"budget: {clock.left():.0f} s left of {args.budget_s:.0f} s at {plan.name}"
                clock.log("stop, " + results["stopped"])
                break
            t0 = time.monotonic()
            try:
                entry = measure_plan(plan, shape, args.dtype, impls, device, clock, args, pool, pending[plan.name])
            except Exception:  # one plan's crash (inputs, floors) must not lose the others
                traceback.print_exc()
                continue
            entry["seconds"] = round(time.monotonic() - t0, 1)
            if peers:  # fla and the torch backend do not change with our kernels: their earlier rows stand
                entry["rows"] += [dict(r, from_earlier_run=True) for r in peers.get(plan.name, {}).get("rows", [])
                                  if r["impl"] not in impls]
            results["plans"][plan.name] = entry
            fl = entry["floors"]
            clock.log(f"{plan.name}: done in {entry['seconds']}s; floors fwd {fl['floor_fwd_ms']:.3f} ms "
                      f"({fl['bytes_fwd'] / 1e6:.0f} MB, {fl['flops_fwd'] / 1e9:.1f} GFLOP), f+b {fl['floor_fwdbwd_ms']:.3f} ms")
            _write(results, Path(args.out))  # after every plan: a run cut short keeps what it measured
    finally:
        if pool is not None:
            pool.close()
    print(_write(results, Path(args.out)), flush=True)
    return results


if __name__ == "__main__":
    main()
