"""Launch settings of our kernels, swept inside one process, and where the host's
time of a forward goes.

    python benchmarks/launch_sweep.py --plans gdn,gla-scalar \
        --grid "state_warps=2,4 state_stages=2,3,4 state_forward_bv=32,64" [--out DIR] [--budget-s S]
        [--backward] [--host-profile] [--fla [--rounds N]]

`benchmarks/variants.py` runs each setting in its own process (the knobs of
`kernels/triton/launch.py` are read from the environment at import), which costs a
process start and a full compile per setting. They are read again at every launch, so
here they are set on that module between calls (`recurrence._plan_of` is cleared, since
a plan carries the warps), named in lower case (`state_stages=4` sets `STATE_STAGES`), and
every combination of `--grid` is timed in one process: the forward's (or with
`--backward` the forward+backward's) wall time (`do_bench`, median) and each kernel's GPU
time (`torch.profiler`). Each setting's output, and with `--backward` every input
gradient, is compared with the defaults' (same inputs): a launch setting changes no
arithmetic beyond the order of float sums, so a relative difference above `SUSPECT`
marks a miscompile (the row's `suspect`).
That screen is not the correctness check; a setting is adopted only after
`triton_gpu_check.py` passes under it (`docs/gpu-session.md`).

`--host-profile` adds, per plan, cProfile's view of the host time of 50 forward calls
queued behind a GPU sleep (so no call waits on the GPU): which Python functions the
launches spend it in. Session 6 measured about 0.09 ms of host time per launch on the
lent machine, where Triton's launch path is reported at about 12 us on other hosts
(triton-lang/triton PR 3648; tritonbench PR 1005).

`--fla` then times flash-linear-attention's call of each plan alternately with ours
(`--rounds`), in the same process: the side-by-side ratio (`peer_rounds`), in the form of
`kernels.py --rounds` (a plan entry's `side_by_side`).

Writes `DIR/launch_sweep.json` after each plan. A setting that faults the GPU (an illegal
memory access: session 9's GLA-channel at `backward_warps=4`) leaves the process's CUDA
context unusable, so its plan's other settings are recorded as not run and the plans
left go on in a fresh process that adds to the same file (`--merge`).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import itertools
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import _bench, _forward_and_backward, autotuned_configs, fla_callable, kernel_breakdown, machine, make_inputs, plan_named, quick_tuning, run_plan, side_by_side_rounds

SHAPE = (4, 4096, 16, 128, 128)


def settings_of(grid: str) -> list[dict[str, str]]:
    """`"a=1,2 b=3; c=4"` -> [{a: 1, b: 3}, {a: 2, b: 3}, {c: 4}]: every combination of
    each `;`-separated grid, one grid after the other."""
    settings = []
    for part in grid.split(";"):
        axes = [(name, values.split(",")) for name, _, values in (item.partition("=") for item in part.split())]
        settings += [dict(zip([n for n, _ in axes], combo)) for combo in itertools.product(*(v for _, v in axes))]
    return settings


def apply(setting: dict[str, str]) -> dict:
    """Set the launch knobs (`kernels/triton/launch.py`); returns the previous values."""
    from archspec.kernels.triton import launch, recurrence

    previous = {}
    for name, value in setting.items():
        if name in ("warps", "state_warps"):
            chunk, state = launch.WARPS
            previous.setdefault("WARPS", launch.WARPS)
            launch.WARPS = (int(value), state) if name == "warps" else (chunk, int(value))
            continue
        attr = name.upper()
        if not hasattr(launch, attr):
            raise SystemExit(f"--grid: launch.py has no knob {attr} (from {name!r})")
        current = getattr(launch, attr)
        previous[attr] = current
        if isinstance(current, bool):  # bool("0") would be True
            setattr(launch, attr, value.lower() in ("1", "true"))
        else:
            setattr(launch, attr, type(current)(value) if current is not None else value)
    recurrence._plan_of.cache_clear()
    return previous


def restore(previous: dict) -> None:
    from archspec.kernels.triton import launch, recurrence

    for attr, value in previous.items():
        setattr(launch, attr, value)
    recurrence._plan_of.cache_clear()


def host_profile(fn, calls: int = 50, top: int = 25) -> str:
    """cProfile of `calls` forward calls issued while the GPU sleeps (none waits on it)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    per_call_ms = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return f"{per_call_ms:.4f} ms per call under cProfile\n" + text.getvalue()


SUSPECT = 1e-2  # a launch setting changes only the order of float sums; more than this is a miscompile


def screened(forward, inputs: dict, backward: bool) -> list[torch.Tensor]:
    """The output, and with `backward` every input gradient of a fixed loss (the same for
    every setting, unlike a random `dO`): session 7's miscompiles (`launch.chunk_stages`)
    showed in gradients only."""
    o, s = forward()
    if not backward:
        return [o.detach().clone()]
    leaves = [t for t in inputs.values() if t.requires_grad]
    loss = o.float().square().sum() * 1e-3 + (0 if s is None else s.float().square().sum() * 1e-3)
    return [o.detach().clone()] + [g for g in torch.autograd.grad(loss, leaves, allow_unused=True) if g is not None]


def relative_difference(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    """The largest max-abs difference of any tensor, relative to that tensor's max."""
    return max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
               for a, b in zip(outs, refs, strict=True))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default="gdn,gla-scalar")
    parser.add_argument("--grid", default="state_warps=2,4 state_stages=2,3,4 state_forward_bv=32,64")
    parser.add_argument("--out", default="/tmp/launch-sweep")
    parser.add_argument("--budget-s", type=float, default=300)
    parser.add_argument("--host-profile", action="store_true")
    parser.add_argument("--backward", action="store_true", help="time forward+backward (the kernels of both)")
    parser.add_argument("--fla", action="store_true", help="then flash-linear-attention's call of the plan, in rounds with ours")
    parser.add_argument("--rounds", type=int, default=5, help="with --fla: ours and fla's timed alternately this many times")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes: checks that the script runs")
    parser.add_argument("--merge", action="store_true", help="add to DIR/launch_sweep.json (the continuation after a fault)")
    args = parser.parse_args(argv)
    shape, device, bench, breakdown = SHAPE, "cuda", _bench, kernel_breakdown
    if args.smoke:  # no timer and no profiler on the CPU: each call runs once
        os.environ.setdefault("TRITON_INTERPRET", "1")
        shape, device, args.fla, args.host_profile = (1, 32, 1, 16, 16), "cpu", False, False
        bench, breakdown = (lambda fn: (fn(), 0.0)[1]), (lambda fn: [])
    start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine(), "shape": shape, "grid": args.grid, "plans": {}}
    if args.merge and (out / "launch_sweep.json").exists():
        results["plans"] = json.loads((out / "launch_sweep.json").read_text())["plans"]
    settings = [{}] + (settings_of(args.grid) if args.grid.strip() else [])  # the defaults first: the reference output
    if args.fla:
        quick_tuning(20)
    names = args.plans.split(",")
    for index, name in enumerate(names):
        plan = plan_named(name)
        inputs = make_inputs(plan, *shape, torch.bfloat16, device)
        forward = functools.partial(run_plan, plan, inputs, "triton")
        fn = _forward_and_backward(forward, inputs) if args.backward else forward
        entry: dict = {"settings": []}
        results["plans"][name] = entry
        reference = screened(forward, inputs, args.backward)
        if args.host_profile:
            entry["host_profile"] = host_profile(forward)
            print(f"== {name}: host profile\n{entry['host_profile']}", flush=True)
        faulted = False
        for setting in settings:
            if time.monotonic() - start > args.budget_s:
                entry["settings"].append({"setting": setting, "error": "out of budget"})
                continue
            if faulted:
                entry["settings"].append({"setting": setting, "error": "not run: an earlier setting faulted the GPU"})
                continue
            previous = apply(setting)
            row: dict = {"setting": setting}
            try:
                t0 = time.monotonic()
                outs = screened(forward, inputs, args.backward)
                if device == "cuda":
                    torch.cuda.synchronize()
                row["first_call_s"] = round(time.monotonic() - t0, 2)
                row["rel_diff"] = relative_difference(outs, reference)
                row["suspect"] = row["rel_diff"] > SUSPECT
                row["fwdbwd_ms" if args.backward else "fwd_ms"] = round(bench(fn), 4)
                row["kernels"] = breakdown(fn)
            except Exception as err:  # noqa: BLE001 - a setting that fails to compile (shared memory) is a result
                row["error"] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
                faulted = gpu_fault(err)
            finally:
                restore(previous)
            entry["settings"].append(row)
            kern = ", ".join(f"{k} {t:.4f}" for k, t in row.get("kernels", [])[:6])
            print(f"[{time.monotonic() - start:6.1f}s] {name} {setting or 'defaults'}: ms {row.get('fwd_ms', row.get('fwdbwd_ms'))} "
                  f"diff {row.get('rel_diff', 0):.1e}{' SUSPECT' if row.get('suspect') else ''} {row.get('error', '')} | {kern}", flush=True)
            (out / "launch_sweep.json").write_text(json.dumps(results, indent=1))
        if faulted:
            rest = names[index + 1:]
            if rest:
                entry["continued_in_fresh_process"] = rest
                (out / "launch_sweep.json").write_text(json.dumps(results, indent=1))
                continue_in_fresh_process(argv if argv is not None else sys.argv[1:], rest,
                                          args.budget_s - (time.monotonic() - start))
                return json.loads((out / "launch_sweep.json").read_text())
            continue
        if args.fla and time.monotonic() - start < args.budget_s:
            entry["side_by_side"] = peer_rounds(plan, inputs, args)
            print(f"[{time.monotonic() - start:6.1f}s] {name} side by side: {entry['side_by_side']}", flush=True)
            (out / "launch_sweep.json").write_text(json.dumps(results, indent=1))
    return results


def gpu_fault(err: Exception) -> bool:
    """Whether `err` left the CUDA context unusable: after an illegal address or a launch
    failure every later call in the process fails too (session 9: the plan after the
    faulting one died making its inputs)."""
    text = f"{type(err).__name__}: {err}"
    return any(s in text for s in ("illegal memory access", "unspecified launch failure", "misaligned address",
                                   "illegal instruction", "AcceleratorError"))


def continue_in_fresh_process(argv: list[str], plans: list[str], budget_s: float) -> None:
    """Run this script again for `plans` with what is left of the budget, adding to the same
    file (`--merge`); the rest of `argv` (grid, out, flags) as given."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--plans", "--budget-s"):
            skip = True
        elif not arg.startswith(("--plans=", "--budget-s=")):
            rest.append(arg)
    cmd = [sys.executable, str(Path(__file__).resolve()), *rest, "--plans", ",".join(plans),
           "--budget-s", str(max(0.0, round(budget_s, 1)))] + ([] if "--merge" in rest else ["--merge"])
    print(f"GPU fault: {', '.join(plans)} go on in a fresh process", flush=True)
    subprocess.run(cmd, check=False)


def peer_rounds(plan, inputs: dict, args) -> dict:
    """`kernels.side_by_side_rounds` for the pass swept, with fla's kernels and autotuned
    picks: a forward of a few short kernels waits on the host's launches, and the host's
    speed drifts between processes and over minutes (session 7: Gated DeltaNet's forward
    0.46-0.71 ms for the same 0.43 ms of kernels), so a ratio is fair only between
    timings taken side by side. The result goes into `kernels.json`'s plan entries as
    `side_by_side` as it is."""
    key = "fwdbwd_ms" if args.backward else "fwd_ms"
    pairs = side_by_side_rounds(plan, inputs, args.rounds, args.budget_s, passes=(key,))
    if key in pairs:
        peer = fla_callable(plan, inputs)
        fla = _forward_and_backward(peer, inputs) if args.backward else peer
        pairs[key]["fla_kernels"] = kernel_breakdown(fla)
        pairs[key]["fla_kernels_ms"] = dict(pairs[key]["fla_kernels"]).get("(sum of all kernels)")
        pairs[key]["fla_autotuned"] = autotuned_configs() or None
    return pairs


if __name__ == "__main__":
    main()
