"""Kernel benchmark: the recurrence of each model spec on the Triton chunk kernel, beside
flash-linear-attention's kernel of the same recurrence and the plan's floors.

    python benchmarks/kernel_times.py [--plans a,b] [--gates mild,strong,init] [--rounds 5] [--budget-s S] [--smoke]

Each plan is a spec of `specs/models` (some with overrides, `PLANS`), lowered by
`archspec.lower`. At B=4 T=4096 H=16 K=V=128 bfloat16 it times the forward and the forward
+ backward (from fixed output gradients, as fla's benchmarks do) of ours and fla's call
alternately in one process, `--rounds` times each (`triton.testing.do_bench` medians; the
median of the rounds is reported): the host's speed drifts between runs and over minutes,
and a call of short kernels waits on it, so only a side-by-side ratio is fair. Gated plans
are timed with mild gates and, with a channel gate, with strong ones and with those of an
initialised model (`common.GATE_REGIMES`).

The floors: the fewest bytes a pass must move (every input read once, every output
written once) over the measured copy rate, and the FLOPs the chunk algorithm performs
(`archspec.blocks.cost.triton_chunk_flops`) over the measured bf16 matmul rate, whichever
is larger.

On a cold machine compiling dominates (fla autotunes 50-300 configs per op), so first
every plan's kernels are compiled in worker processes, fla's configs split between them,
then the timing runs alone on the GPU. Results: `benchmarks/results/kernel_times.{json,md}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anatomy  # noqa: E402  (a script beside its helpers)
import picks  # noqa: E402
from common import (  # noqa: E402  (a script beside its helpers)
    GATE_REGIMES,
    PLANS,
    ROOT,
    Bench,
    CompileJob,
    compile_in_workers,
    first_line,
    fla_call,
    kernels_before,
    run_before,
    forward_and_backward,
    machine,
    make_inputs,
    median_ms,
    run_ours,
    write_results,
)

COPY_BYTES_PER_S = 4.27e12  # device-to-device copy measured on the H200
MATMUL_FLOPS_PER_S = 692e12  # bf16 8192^3 matmul measured on the H200

PASSES = ("forward", "forward+backward")
KERNELS_SHOWN = 12  # the heaviest kernels of a profiled forward+backward, kept per implementation


def regimes(bench: Bench, asked: tuple[str, ...]) -> list[str]:
    """The gate regimes a plan is timed in: none without a gate; strong decay matters to a
    channel gate only (a scalar gate's decay is one exponential per pair whatever its size)."""
    gate = bench.plan.gate
    if gate == "none":
        return ["none"]
    return [r for r in asked if r == "mild" or gate == "channel"]


def floors(bench: Bench, inputs: dict, shape: dict) -> dict:
    from archspec.blocks.cost import triton_chunk_flops
    from archspec.kernels.chunking import triton_tokens_per_chunk

    # the spec's recurrence at the benchmark's head shape
    plan = dataclasses.replace(bench.plan, heads=shape["H"], head_dim=shape["K"], value_dim=shape["V"])
    tensors = [t for t in inputs.values() if isinstance(t, torch.Tensor)]
    read = sum(t.numel() * t.element_size() for t in tensors)
    q, v = inputs["q"], inputs["v"]
    out = q.numel() // q.shape[-1] * v.shape[-1] * v.element_size()
    if plan.preconditioner is not None:  # the write keys: written by the scan, read by the chunk kernels
        read += 2 * inputs["k"].numel() * inputs["k"].element_size()
    fwd, solve, bwd = triton_chunk_flops(plan)
    chunks = shape["B"] * shape["H"] * math.ceil(shape["T"] / triton_tokens_per_chunk(plan.n_h))
    f_fwd, f_bwd = (fwd + solve) * chunks, bwd * chunks
    bytes_fwd, bytes_all = read + out, 2 * read + 2 * out  # + every gradient written and dO read
    return {
        "bytes_fwd": bytes_fwd, "bytes_fwdbwd": bytes_all, "flops_fwd": f_fwd, "flops_fwdbwd": f_fwd + f_bwd,
        "floor_forward_ms": 1e3 * max(bytes_fwd / COPY_BYTES_PER_S, f_fwd / MATMUL_FLOPS_PER_S),
        "floor_forward+backward_ms": 1e3 * max(bytes_all / COPY_BYTES_PER_S, (f_fwd + f_bwd) / MATMUL_FLOPS_PER_S),
    }


def calls(bench: Bench, inputs: dict, with_fla: bool, before=None) -> dict:
    """`{impl: {pass: fn}}` for ours, the earlier kernels (`before`) if given, and fla's
    where it has the recurrence."""
    plan = bench.plan
    ours = functools.partial(run_ours, plan, inputs, "triton")
    out = {"ours": {"forward": ours, "forward+backward": forward_and_backward(ours, inputs)}}
    if before is not None:
        earlier = functools.partial(run_before, before, plan, inputs)
        out["before"] = {"forward": earlier, "forward+backward": forward_and_backward(earlier, inputs)}
    try:
        peer = fla_call(plan, inputs) if with_fla else None
    except ImportError as err:
        out["fla"] = {"not installed": first_line(err)}
        return out
    if peer is not None:  # its backward may refuse when timed (fla's gated backward on Hopper, Triton < 3.7.1)
        out["fla"] = {"forward": peer, "forward+backward": forward_and_backward(peer, inputs)}
    return out


def quick_tuning(rep_ms: int) -> None:
    """Autotuners time each config for `rep_ms` (Triton's default is 100 ms + 25 of warm-up):
    with 85-300 configs per fla op that is 10-40 s less per plan."""
    import triton.testing
    from triton.runtime.autotuner import Autotuner

    bench = functools.partial(triton.testing.do_bench, warmup=max(1, rep_ms // 4), rep=rep_ms)
    Autotuner.do_bench = property(lambda self: bench)


# ----------------------------------------------------------------------------- timing


def time_plan(bench: Bench, gates: str, shape: dict, rounds: int, with_fla: bool, time_fn, before=None) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = make_inputs(bench.plan, *(shape[n] for n in "BTHKV"), torch.bfloat16, device, gates=gates)
    row: dict = {"plan": bench.name, "gates": gates, "floors": floors(bench, inputs, shape), "ms": {}, "errors": {}}
    try:
        fns = calls(bench, inputs, with_fla, before)
    except Exception as err:  # noqa: BLE001  (ours failing is a result: the row says so)
        row["errors"]["ours"] = first_line(err)
        return row
    if "not installed" in fns.get("fla", {}):
        row["errors"]["fla"] = fns.pop("fla")["not installed"]
    for key in PASSES:
        impls = [impl for impl in fns if key in fns[impl]]
        samples: dict = {impl: [] for impl in impls}
        for _ in range(rounds):  # alternately: each round times ours, then fla's
            for impl in list(impls):
                try:
                    samples[impl].append(time_fn(fns[impl][key]))
                except Exception as err:  # noqa: BLE001
                    row["errors"][f"{impl} {key}"] = first_line(err)
                    impls.remove(impl)
        row["ms"][key] = {impl: sorted(s)[len(s) // 2] for impl, s in samples.items() if s}
    # Each kernel's share of one forward+backward: which kernel a ratio comes from.
    row["kernels"] = {impl: anatomy.profile(fns[impl]["forward+backward"], device)["kernels"][:KERNELS_SHOWN]
                      for impl in row["ms"].get("forward+backward", {})}
    return row


def markdown(results: dict) -> str:
    m, s = results["machine"], results["shape"]
    lines = [f"Kernel times on {m.get('device', 'CPU')} (torch {m['torch']}, triton {m.get('triton')}, fla {m.get('fla')}, "
             f"{m['date']}, commit {m.get('commit')}), B={s['B']} T={s['T']} H={s['H']} K={s['K']} V={s['V']} bfloat16, "
             f"median ms; ours and fla's call timed alternately, {results['rounds']} rounds. Gates: mild "
             "`logsigmoid(x + 4)`, strong `logsigmoid(x)` clamped at -5 (trained KDA layers' statistics), init "
             "what an initialised layer of the plan's decay form produces, which the whole-model benchmark meets: "
             "mamba2 `-A softplus(x)` with A in [1, 16] per head (KDA's), rwkv7 `-e^{-1/2} sigmoid(w0 + x)` "
             "(RWKV-7's), gla `logsigmoid(x) / 16`.", "",
             "| plan | gates | floor fwd | ours fwd | fla fwd | ours/fla | floor f+b | ours f+b | fla f+b | ours/fla |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
    for row in results["rows"]:
        cells = [row["plan"], row["gates"]]
        for key in PASSES:
            ms = row["ms"].get(key, {})
            ours, peer = ms.get("ours"), ms.get("fla")
            cells += [fmt(row["floors"][f"floor_{key}_ms"]), fmt(ours), fmt(peer),
                      f"{ours / peer:.2f}" if ours and peer else "—"]
        lines.append("| " + " | ".join(cells) + " |")
    errors = [f"- {row['plan']} ({row['gates']}), {what}: {err}" for row in results["rows"] for what, err in row["errors"].items()]
    compared = [row for row in results["rows"] if "before" in row["ms"].get("forward", {})]
    if compared:
        lines += ["", f"Against the kernels of {results.get('against')} (both timed alternately in this run):", "",
                  "| plan | gates | before fwd | ours fwd | ours/before | before f+b | ours f+b | ours/before |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in compared:
            cells = [row["plan"], row["gates"]]
            for key in PASSES:
                ms = row["ms"].get(key, {})
                cells += [fmt(ms.get("before")), fmt(ms.get("ours")),
                          f"{ms['ours'] / ms['before']:.3f}" if ms.get("ours") and ms.get("before") else "—"]
            lines.append("| " + " | ".join(cells) + " |")
    profiled = [row for row in results["rows"] if row.get("kernels")]
    if profiled:
        lines += ["", "Per kernel, one profiled forward+backward (ms, launches where more than one; the heaviest "
                  f"{KERNELS_SHOWN}):", ""]
        for row in profiled:
            for impl, kernels in row["kernels"].items():
                listed = ", ".join(f"`{name[:60]}` {ms:.3f}" + (f" ({n}x)" if n > 1 else "") for name, n, ms in kernels)
                lines.append(f"- {row['plan']} ({row['gates']}), {impl}: {listed}")
    if errors:
        lines += ["", "Refusals and errors:", *errors]
    if results.get("stopped"):
        lines += ["", f"Stopped early: {results['stopped']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default="", help="comma-separated plan names (default: all of PLANS)")
    parser.add_argument("--gates", default=",".join(GATE_REGIMES), help="gate regimes of the gated plans")
    parser.add_argument("--shape", default="4,4096,16,128,128", help="B,T,H,K,V")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of ours and fla's call")
    parser.add_argument("--fla", default="all", help="the plans timed beside fla's kernel: all (those it has), none, or a,b")
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no plan after this many seconds")
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)), help="compile processes")
    parser.add_argument("--fla-shards", type=int, default=6, help="compile jobs that share one fla plan's configs")
    parser.add_argument("--retune", action="store_true",
                        help="let fla autotune afresh, not from the picks an earlier run left in --out (fla_autotune.json)")
    parser.add_argument("--against", type=Path, default=None,
                        help="a folder holding an earlier copy of kernels/ (git archive REV kernels | tar -x -C DIR): "
                        "timed beside the current kernels, alternately")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shape, ours only: the script runs")
    args = parser.parse_args(argv)
    start = time.monotonic()
    benches = [b for b in PLANS if not args.plans or b.name in args.plans.split(",")]
    unknown = set(filter(None, args.plans.split(","))) - {b.name for b in benches}
    if unknown:
        parser.error(f"unknown plans {sorted(unknown)}; known: {[b.name for b in PLANS]}")
    asked = tuple(args.gates.split(","))
    if not set(asked) <= set(GATE_REGIMES):
        parser.error(f"--gates takes {GATE_REGIMES}, got {asked}")
    time_fn = median_ms
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.shape, args.fla, args.rounds = "1,32,1,16,16", "none", 1
        time_fn = lambda fn: (fn(), 0.0)[1]  # noqa: E731  (the interpreter has no timer: run each path once)
    B, T, H, K, V = (int(x) for x in args.shape.split(","))
    shape = dict(B=B, T=T, H=H, K=K, V=V)
    work = [(b, gates) for b in benches for gates in regimes(b, asked)]
    with_fla = {b.name for b in benches} if args.fla == "all" else set() if args.fla == "none" else set(args.fla.split(","))
    keep_picks = torch.cuda.is_available() and bool(with_fla)
    pinned = picks.pin_from(args.out) if keep_picks and not args.retune else None
    if torch.cuda.is_available() and args.workers > 0:
        impls = ("ours", "fla") + (("before",) if args.against else ())
        jobs = [CompileJob(b, impl, g, "bfloat16", (B, T, H, K, V), against=None if args.against is None else str(args.against))
                for b, g in work for impl in impls if impl != "fla" or b.name in with_fla]
        statuses = compile_in_workers(jobs, args.workers, args.fla_shards, pinned=pinned)
        print(f"[{time.monotonic() - start:6.1f}s] compiled: {sum(s == 'ok' for s in statuses)} of {len(statuses)} jobs ok",
              flush=True)
        quick_tuning(20)
    results = {"machine": machine(), "shape": shape, "rounds": args.rounds, "rows": [], "stopped": None,
               "against": None if args.against is None else str(args.against)}
    before = None if args.against is None else kernels_before(args.against)
    for bench, gates in work:
        if time.monotonic() - start > args.budget_s:
            results["stopped"] = f"budget of {args.budget_s:.0f} s spent before {bench.name} ({gates})"
            break
        row = time_plan(bench, gates, shape, args.rounds, bench.name in with_fla, time_fn, before)
        results["rows"].append(row)
        print(f"[{time.monotonic() - start:6.1f}s] {bench.name} ({gates}): {row['ms']} {row['errors'] or ''}", flush=True)
        write_results(args.out, "kernel_times", results, markdown(results))  # after every plan: a cut-short run keeps them
        if keep_picks:
            picks.keep(args.out)
    table = markdown(results)
    write_results(args.out, "kernel_times", results, table)
    print(table, flush=True)
    return results


if __name__ == "__main__":
    main()
