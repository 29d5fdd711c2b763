"""What the kernel benchmark, the GPU check and the sweep share: plans from `specs/models`
through the compiler, inputs that look like a layer's, the peer's call, timing, results.

A plan is a model spec (with optional `--set`-style overrides) lowered by `archspec.lower`:
the benchmarks time the recurrence that spec's layers run, never a second description of it.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import platform
import subprocess
import time
import multiprocessing as mp
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from archspec.blocks.gates import ChannelGate, ScalarGate
from archspec.blocks.lm import init_weights
from archspec.blocks.plan import RecurrencePlan
from archspec.errors import first_line

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs" / "models"

# Gate statistics (log-decay per token). Mild: `logsigmoid(x + 4)`, a few nats per 64-token
# chunk. Strong: `logsigmoid(x)` clamped at -5, what the channel gates of trained KDA layers
# produce, about 52 nats a chunk. Both keep a channel gate's chunks within twice
# `decay.py`'s bound (path 1: one product each). Init: the gates a whole-model benchmark
# step meets, formed by the plan's gate module as the LM initialises it
# (`initialised_log_decay`) from unit-RMS rows of the benchmark's width: Mamba2's rates and
# time steps for the mamba2 form (KDA's gate decays by about 0.2 nats a token on average,
# its fastest channels by up to about 2: path 1 in most heads, 2 in the rest), RWKV-7's
# initial speeds, GLA's bias at 0.
GATE_REGIMES = ("mild", "strong", "init")
STRONG_GATE_FLOOR = -5.0
# Steep and fast (`gpu_check.py` only, not benchmark regimes). Steep: twice the strong
# gates, about 104 nats a chunk, past path 1's limit in every chunk while every 16-token
# sub-chunk stays within path 2's bound: the sub-chunk path at realistic shapes, for every
# channel-gated plan. Fast: `-A softplus(x)`, A uniform in [1, 16] per head (a KDA gate with
# `dt_bias = 0`), about 7 nats a token: past path 2's bound in most sub-chunks, the exact
# path (3) at realistic shapes.
STEEP_GATE_FACTOR = 2.0
FAST_DECAY_RATE = (1.0, 16.0)


@dataclass(frozen=True)
class Bench:
    """One benchmarked recurrence: a row name and its plan."""

    name: str
    spec: str  # a file in specs/models, without .yaml
    overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def plan(self) -> RecurrencePlan:
        return _lowered(self.spec, self.overrides)


@functools.lru_cache(maxsize=None)
def _lowered(spec: str, overrides: tuple[tuple[str, Any], ...]) -> RecurrencePlan:
    import archspec

    return archspec.lower(archspec.load_spec(SPECS / f"{spec}.yaml", list(overrides))).mixer


# The benchmarked recurrences: the recurrence of every single-mixer spec of specs/models
# (a hybrid's recurrent layers are among them), and larger n_h and the other gate kinds
# where a spec fixes them.
PLANS = [
    Bench("deltanet", "deltanet"),
    Bench("gated-deltanet", "gated-deltanet"),
    Bench("kda", "kda"),
    Bench("rwkv7", "rwkv7"),
    Bench("gla", "gla"),
    Bench("gla-scalar", "gla", (("mixer.gate", "scalar"),)),
    Bench("deltaproduct-2", "deltaproduct-2"),
    Bench("deltaproduct-3", "deltaproduct-3"),
    Bench("deltaproduct-4", "deltaproduct-2", (("mixer.transition.n_h", 4),)),
    Bench("gated-deltaproduct-2", "gated-deltaproduct-2"),
    Bench("gated-deltaproduct-3", "gated-deltaproduct-2", (("mixer.transition.n_h", 3),)),
    Bench("gated-deltaproduct-4", "gated-deltaproduct-2", (("mixer.transition.n_h", 4),)),
    Bench("osdn", "osdn"),
    Bench("osdn-apf", "osdn-apf"),
    Bench("osgdn", "osgdn-apf", (("mixer.preconditioner.apf", False),)),
    Bench("osgdn-apf", "osgdn-apf"),
    Bench("oskda", "oskda"),
]


# The whole-model benchmark's width (`models.py`), at which `init` gates are formed.
INIT_GATE_D_MODEL = 1024


def initialised_log_decay(plan: RecurrencePlan, B: int, T: int, H: int, K: int, V: int, seed: int) -> torch.Tensor:
    """The log decay `[B, T, H]` (scalar gate) or `[B, T, H, K]` (channel gate) of the plan's
    gate module as `LanguageModel` initialises it (its own rates and biases, every linear
    weight N(0, INIT_STD)) on unit-RMS rows, as a block's pre-norm hands them; float32, on
    the CPU, the same for a seed whatever the global random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if plan.gate == "channel":  # rank V, as the mixer builds it
            gate = ChannelGate(INIT_GATE_D_MODEL, H, K, rank=V, form=plan.decay)
        else:
            gate = ScalarGate(INIT_GATE_D_MODEL, H, form=plan.decay)
        init_weights(gate, layers=1)  # a gate has no residual output: every weight N(0, INIT_STD)
        rows = torch.randn(B, T, INIT_GATE_D_MODEL)
        with torch.no_grad():
            return gate(rows).float()


def make_inputs(plan: RecurrencePlan, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device: Any,
                gates: str = "mild", seed: int = 0, states: bool = False, lengths: list[int] | None = None) -> dict:
    """Leaf tensors as the plan's layer produces them: unit keys, sigmoid beta and erase,
    log-sigmoid gates (`GATE_REGIMES`, float32 or wider), the OSDN-APF retain gate. `states` adds an initial
    state (float32); `lengths` packs sequences of these token counts into one row (`B = 1`,
    `T = sum(lengths)`) and adds `cu_seqlens`."""
    if lengths is not None:
        assert B == 1 and sum(lengths) == T, "a packed batch is one row of sum(lengths) tokens"
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n = plan.n_h

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    def log_gate(*shape):
        x = rand(*shape)
        if gates == "mild":
            return F.logsigmoid(x + 4.0)
        if gates == "strong":
            return F.logsigmoid(x).clamp_min(STRONG_GATE_FLOOR)
        if gates == "steep":
            return STEEP_GATE_FACTOR * F.logsigmoid(x).clamp_min(STRONG_GATE_FLOOR)
        if gates == "fast":
            rate = torch.empty(shape[2], dtype=torch.float64).uniform_(*FAST_DECAY_RATE, generator=gen)
            return -rate.to(x).view(shape[2], *[1] * (len(shape) - 3)) * F.softplus(x)  # one rate per head
        return initialised_log_decay(plan, *shape[:3], K, V, seed).to(x)

    x: dict = {"q": F.normalize(rand(B, T, H, K), dim=-1), "k": F.normalize(rand(B, T * n, H, K), dim=-1),
               "v": rand(B, T * n, H, V)}
    if plan.gate == "scalar":
        x["g"] = log_gate(B, T, H)
    elif plan.gate == "channel":
        x["g"] = log_gate(B, T, H, K)
    if plan.transition == "householder":
        x["beta"] = plan.beta_scale * torch.sigmoid(rand(B, T * n, H))
    if plan.transition == "rwkv7":
        x["erase"] = plan.beta_scale * torch.sigmoid(rand(B, T * n, H, K)) * x["k"]
        x["write_key"] = F.normalize(rand(B, T * n, H, K), dim=-1)
    if plan.preconditioner is not None and plan.preconditioner.apf:
        x["retain"] = torch.sigmoid(rand(B, T, H) + 4.0)
    # A model forms its log gate in float32 (`kernels/log_decay.py`), fla's layers too: the
    # gate stays there while the operands take `dtype` (a bfloat16 gate ran kernels the
    # models never run: GLA-channel's backward faulted on the H200 with the float32 one only).
    gate_dtype = torch.promote_types(dtype, torch.float32)
    out = {name: val.to(gate_dtype if name == "g" else dtype).requires_grad_() for name, val in x.items()}
    if states:
        rows = B if lengths is None else len(lengths)
        out["initial_state"] = (0.1 * rand(rows, H, K, V)).requires_grad_()
    if lengths is not None:
        out["cu_seqlens"] = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    return out


def run_ours(plan: RecurrencePlan, inputs: dict, backend: str, **options) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(o, final_state)` of the plan on `backend`, OSDN's write keys included, as the
    plan's mixer calls the kernels."""
    from archspec.kernels import linear_recurrence, osdn_write_keys

    args = {k: v for k, v in inputs.items() if k != "retain"}
    if plan.preconditioner is not None:
        pre = plan.preconditioner
        args["write_key"], _ = osdn_write_keys(
            inputs["k"], inputs["beta"], eta=pre.eta, d_min=pre.d_min, d_max=pre.d_max, retain=inputs.get("retain"),
            beta_aware=pre.beta_aware, cu_seqlens=inputs.get("cu_seqlens"), n_h=plan.n_h, backend=backend)
    return linear_recurrence(**args, gate=plan.gate, n_h=plan.n_h, backend=backend, **options)


def fla_op(plan: RecurrencePlan) -> str | None:
    """The `fla.ops` function of the same recurrence, or None where flash-linear-attention
    has none (OSDN; RWKV-7 with a scalar gate; sub-steps with a channel gate)."""
    if plan.preconditioner is not None:
        return None
    if plan.transition == "householder" and plan.n_h > 1:
        return None if plan.gate == "channel" else "gated_delta_product"
    if plan.n_h > 1:
        return None
    return {("householder", "none"): "delta_rule", ("householder", "scalar"): "gated_delta_rule",
            ("householder", "channel"): "kda", ("diagonal", "channel"): "gla", ("diagonal", "scalar"): "simple_gla",
            ("rwkv7", "channel"): "rwkv7"}.get((plan.transition, plan.gate))


def fla_call(plan: RecurrencePlan, x: dict) -> Callable[[], Any] | None:
    """flash-linear-attention's call of the plan's recurrence on the inputs `x`, or None
    (`fla_op`); raises ImportError without fla."""
    op = fla_op(plan)
    if op is None:
        return None
    import importlib

    fn = getattr(importlib.import_module(f"fla.ops.{op}"), f"chunk_{op}")
    g = None if x.get("g") is None else x["g"].float()
    if op == "gated_delta_product":
        return lambda: fn(x["q"], x["k"], x["v"], g, x["beta"], num_householder=plan.n_h)
    if op == "delta_rule":
        return lambda: fn(x["q"], x["k"], x["v"], x["beta"])
    if op in ("gated_delta_rule", "kda"):
        return lambda: fn(x["q"], x["k"], x["v"], g, x["beta"])
    if op in ("gla", "simple_gla"):
        return lambda: fn(x["q"], x["k"], x["v"], g)
    # RWKV-7's DPLR form: S <- S (D + a b^T) + k v^T with a = -(erase direction), b = key
    return lambda: fn(x["q"], x["g"], x["write_key"], x["v"], -x["k"], x["erase"])


def kernels_before(path: Path) -> Any:
    """An earlier copy of `kernels/` (`git archive REV kernels | tar -x -C PATH`) imported as
    a package of its own, to time beside the current kernels (`--against`)."""
    import importlib.util
    import sys

    if "kernels_before" in sys.modules:
        return sys.modules["kernels_before"]
    init = path / "kernels" / "__init__.py"
    spec = importlib.util.spec_from_file_location("kernels_before", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels_before"] = module
    spec.loader.exec_module(module)
    return module


def run_before(module, plan, inputs: dict, **options):
    """`run_ours` on the earlier kernels (whose API may not take `gate`: the shape says it)."""
    args = {k: v for k, v in inputs.items() if k != "retain"}
    if plan.preconditioner is not None:
        pre = plan.preconditioner
        args["write_key"], _ = module.osdn_write_keys(
            inputs["k"], inputs["beta"], eta=pre.eta, d_min=pre.d_min, d_max=pre.d_max, retain=inputs.get("retain"),
            beta_aware=pre.beta_aware, n_h=plan.n_h, backend="triton")
    return module.linear_recurrence(**args, n_h=plan.n_h, backend="triton", **options)


def forward_and_backward(fn: Callable[[], Any], inputs: dict) -> Callable[[], None]:
    """One forward and backward of `fn` from fixed output gradients (as fla's benchmarks
    do: a loss inside the step would add its own kernels to every row alike)."""
    leaves = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    o, s = fn()
    with_state = s is not None and s.requires_grad  # a peer may hand back a detached state
    grads = [1e-3 * torch.randn_like(o)] + ([1e-3 * torch.randn_like(s)] if with_state else [])
    del o, s

    def step() -> None:
        o, s = fn()
        torch.autograd.grad([o] + ([s] if with_state else []), leaves, grads, allow_unused=True)

    return step


def median_ms(fn: Callable[[], Any]) -> float:
    """The median time of `fn`, ms (`triton.testing.do_bench`: CUDA events around each call)."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """`|got - want| / |want|` (Frobenius, float64); infinite where `got` is not finite, as
    a miscompiled kernel's output may be."""
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def machine() -> dict:
    """The machine, versions, date and commit a result was measured at; `kernels_sha1`
    fingerprints the kernel sources (a copied tree's .git can be stale)."""
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "date": datetime.date.today().isoformat()}
    try:
        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT, check=False).stdout.strip()  # noqa: E731
        info["commit"] = git("rev-parse", "--short", "HEAD") or None
        if info["commit"] and git("status", "--porcelain", "--untracked-files=no"):
            info["commit"] += "+uncommitted"  # the measured tree is not that commit: kernels_sha1 tells which
    except OSError:
        info["commit"] = None
    sources = sorted((ROOT / "kernels").rglob("*.py"))
    info["kernels_sha1"] = hashlib.sha1(b"".join(f.read_bytes() for f in sources)).hexdigest()[:12]
    for package in ("triton", "fla"):
        try:
            info[package] = __import__(package).__version__
        except (ImportError, AttributeError):
            info[package] = None
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return info


def write_results(out: Path, name: str, results: dict, table: str) -> None:
    """`out/name.json` and `out/name.md`, each written whole or not at all."""
    from archspec.atomic import write_text_atomic

    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / f"{name}.json", json.dumps(results, indent=1))
    write_text_atomic(out / f"{name}.md", table)


def launch_with(table: Any, text: str) -> Any:
    """`block_t=128,num_warps=8` -> the launch-settings dataclass `table` (one of
    `kernels/triton/launch.py`'s) with those fields changed; a ValueError names the fields."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(table)}
    changes = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in fields or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--launch takes positive integers for {sorted(fields)}, got {item!r}")
        changes[key] = int(value)
    return dataclasses.replace(table, **changes)


def peer_arguments(parser: Any, what: str, launch_example: str) -> None:
    """The options of a benchmark of one fused piece against fla's and an earlier `kernels/`
    (`short_conv.py`, `loss.py`): rounds, the peers, `--launch` settings of `what`, where the
    results go, and the interpreter's smoke run."""
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of each implementation")
    parser.add_argument("--no-fla", action="store_true", help="ours only")
    parser.add_argument("--against", type=Path, default=None,
                        help="a folder holding an earlier copy of kernels/, timed beside the current ones")
    parser.add_argument("--launch", action="append", default=[],
                        help=f"{what} also at these settings, e.g. {launch_example} (repeatable)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, ours only: the script runs")


def parse_peer_arguments(parser: Any, argv: list[str] | None, parse_launch: Callable[[str], Any]
                         ) -> tuple[Any, Callable[[Callable[[], Any]], float], str, Any | None]:
    """`peer_arguments`' options parsed: (the arguments, the timer, the device, the earlier
    `kernels/` or None). `--smoke` runs the interpreter on the CPU, once, ours only; each
    `--launch` must parse (`parse_launch`) before anything is timed."""
    args = parser.parse_args(argv)
    time_fn, device = median_ms, "cuda"
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
        args.rounds, args.no_fla, device = 1, True, "cpu"
        time_fn = lambda fn: (fn(), 0.0)[1]  # noqa: E731  (the interpreter has no timer: run each call once)
    for text in args.launch:
        try:
            parse_launch(text)
        except ValueError as exc:
            parser.error(str(exc))
    return args, time_fn, device, None if args.against is None else kernels_before(args.against)


def run_notes(record: dict) -> list[str]:
    """The markdown lines under a per-design table: the designs with no form at the
    benchmark's size, those the budget left out and those that failed, each with its
    problem or error (a traceback's last line)."""
    lines: list[str] = []
    if record.get("unfit"):
        lines += ["", "No form at this size: " + "; ".join(f"{k} ({v})" for k, v in record["unfit"].items()) + "."]
    if record.get("skipped"):
        lines += ["", "Not run (budget): " + ", ".join(record["skipped"]) + "."]
    if record.get("failed"):
        lines += ["", "Failed: " + "; ".join(f"{k}: {v.splitlines()[-1]}" for k, v in record["failed"].items())]
    return lines


# ----------------------------------------------------------------------------- compile first


@dataclass(frozen=True)
class CompileJob:
    """Run one implementation of a plan forward and backward once, as the timing or the
    check will, so that its kernels are compiled into Triton's disk cache."""

    bench: Bench
    impl: str  # "ours" | "fla"
    gates: str
    dtype: str
    shape: tuple[int, int, int, int, int]  # B, T, H, K, V
    states: bool = False
    lengths: tuple[int, ...] | None = None
    shard: tuple[int, int] | None = None  # fla's autotuners compile configs[j::n] only
    against: str | None = None  # impl "before": the folder of the earlier kernels/ (`kernels_before`)


def _compile_only(kernel_call, quantiles=None):
    """An autotuner's benchmarker, replaced: launch once (compiling), time nothing.
    `Autotuner.do_bench` is a property that returns the benchmarker, which the autotuner
    then calls as `do_bench(kernel_call, quantiles=...)`: no `self`."""
    kernel_call()
    return [0.0, 0.0, 0.0]


_SHARD: tuple[int, int] | None = None


def _worker_init(pinned: dict | None = None) -> None:
    """Autotuners in a compile worker compile (and launch once) only this job's share of
    their configs; the measuring process times them all itself, alone on the GPU. With
    `pinned` (an earlier run's picks, `picks.py`) a recorded key compiles its pick alone."""
    os.environ["FLA_CACHE_RESULTS"] = "0"  # a share's pick (every timing 0) must not reach fla's disk cache
    from triton.runtime.autotuner import Autotuner

    prune, run = Autotuner.prune_configs, Autotuner.run

    def shard_prune(self, kwargs):
        configs = prune(self, kwargs)
        j, n = _SHARD or (0, 1)
        return configs[j::n] or configs[j % len(configs):][:1]

    def fresh_run(self, *args, **kwargs):  # tune again for each job: a reused worker compiles its share
        self.cache.clear()
        return run(self, *args, **kwargs)

    # with picks the cache must keep them: a reused worker's unrecorded keys keep the first job's share
    Autotuner.prune_configs, Autotuner.run = shard_prune, run if pinned else fresh_run
    Autotuner.do_bench = property(lambda self: _compile_only)
    if pinned:
        import picks

        picks.pin(pinned)


def _compile(job: CompileJob) -> str:
    global _SHARD
    _SHARD = job.shard
    try:
        x = make_inputs(job.bench.plan, *job.shape, getattr(torch, job.dtype), "cuda", gates=job.gates,
                        states=job.states, lengths=None if job.lengths is None else list(job.lengths))
        if job.impl == "fla":
            fn = fla_call(job.bench.plan, x)
        elif job.impl == "before":
            module = kernels_before(Path(job.against))
            fn = lambda: run_before(module, job.bench.plan, x, output_final_state=job.states)  # noqa: E731
        else:
            fn = lambda: run_ours(job.bench.plan, x, "triton", output_final_state=job.states)  # noqa: E731
        if fn is not None:
            fn()
            forward_and_backward(fn, x)()
        torch.cuda.synchronize()
        return "ok"
    except Exception as err:  # noqa: BLE001  (a refusal or a fault is reported by the timing or the check)
        return first_line(err)
    finally:
        torch.cuda.empty_cache()  # an idle worker must not hold its peak while the others compile


def _indexed(task: tuple[Callable[[Any], str], int, Any]) -> tuple[int, str]:
    fn, index, item = task
    return index, fn(item)


def map_in_workers(fn: Callable[[Any], str], items: list, workers: int, *, fresh_process: bool, label: Callable[[Any], str],
                   log: Callable[[str], None] = print, pinned: dict | None = None) -> list[str]:
    """`fn` (a module-level function returning a status) over `items` in `workers` spawned
    processes set up by `_worker_init`; `fresh_process`: one process per item, so that a
    kernel fault in one cannot poison the CUDA context of the next. Each item is logged as
    it finishes, so a run cut off while compiling shows how far it got. The statuses, in
    the items' order."""
    statuses = [""] * len(items)
    began = time.perf_counter()
    with mp.get_context("spawn").Pool(workers, initializer=_worker_init, initargs=(pinned,),
                                      maxtasksperchild=1 if fresh_process else None) as pool:
        tasks = [(fn, i, item) for i, item in enumerate(items)]
        for done, (i, status) in enumerate(pool.imap_unordered(_indexed, tasks), start=1):
            statuses[i] = status
            log(f"[{time.perf_counter() - began:6.1f}s] {done}/{len(items)} {label(items[i])}: {status}")
    return statuses


def compile_in_workers(jobs: list[CompileJob], workers: int, fla_shards: int = 1, fresh_process: bool = False,
                       pinned: dict | None = None) -> list[str]:
    """Compile every job's kernels in `workers` spawned processes (fla's jobs split into
    `fla_shards` shares of their autotune configs; one share with `pinned` picks). The
    statuses."""
    from dataclasses import replace

    fla_shards = 1 if pinned else fla_shards
    expanded = [replace(job, shard=(j, fla_shards)) if job.impl == "fla" else job
                for job in jobs for j in range(fla_shards if job.impl == "fla" else 1)]
    return map_in_workers(_compile, expanded, workers, fresh_process=fresh_process, pinned=pinned,
                          label=lambda job: f"compiled {job.bench.name}/{job.impl}/{job.gates}/{job.dtype}")
