"""Launch-setting sweep: one setting of `kernels/triton/launch.py` at a time, screened for
correctness and timed, in one process.

    python benchmarks/sweep.py --plans deltanet,kda --set backward_warps=4,8 --set state_forward_stages=2,4

For each plan and each value of each `--set` (the others at the table's), through
`launch.overridden`: the outputs and every input gradient against the table's own run on
the same inputs (a miscompile shows as an error far above bfloat16's rounding: the H200
gave gradients 7e-2 off at settings it miscompiled, where a right one differs by 1e-3),
then the forward and forward+backward times (medians). A setting that faults ends the
sweep: a CUDA fault poisons the process, so run the next one in a fresh process. A faster
setting that screens right goes into the table, and then through `benchmarks/gpu_check.py`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402  (a script beside its helpers)
    GATE_REGIMES, PLANS, ROOT, first_line, forward_and_backward, machine, make_inputs, median_ms, relative_error,
    run_ours,
)

SUSPECT = 1e-2  # relative error against the table's run above which a setting is flagged


def _outputs_and_grads(plan, x: dict) -> list[torch.Tensor]:
    o, s = run_ours(plan, x, "triton", output_final_state=True)
    leaves = [v for v in x.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    gen = torch.Generator().manual_seed(1)
    d_o = torch.randn(o.shape, generator=gen).to(o.device)
    grads = torch.autograd.grad((o.float() * d_o).sum() + s.sum(), leaves, allow_unused=True)
    return [o.detach().float(), s.detach()] + [g.float() for g in grads if g is not None]


def _worst(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(relative_error(g, w) for g, w in zip(got, want))


def parse_settings(items: list[str]) -> list[tuple[str, int]]:
    """`["backward_warps=4,8"]` -> `[("backward_warps", 4), ("backward_warps", 8)]`."""
    from archspec.kernels.triton.launch import FIELDS

    out = []
    for item in items:
        name, _, values = item.partition("=")
        if name not in FIELDS or not values:
            raise SystemExit(f"--set {item!r}: expected NAME=V1,V2 with NAME one of {sorted(FIELDS)}")
        out += [(name, int(v)) for v in values.split(",")]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", required=True, help=f"comma-separated, of {[b.name for b in PLANS]}")
    parser.add_argument("--set", action="append", default=[], dest="settings", help="NAME=V1,V2 (repeatable)")
    parser.add_argument("--gates", default="mild", choices=list(GATE_REGIMES))
    parser.add_argument("--shape", default="4,4096,16,128,128", help="B,T,H,K,V")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sweep.json")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shape, no timing: the script runs")
    args = parser.parse_args(argv)
    from archspec.kernels.triton import launch

    settings = parse_settings(args.settings)
    time_fn = median_ms
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.shape, time_fn = "1,32,1,16,16", lambda fn: (fn(), 0.0)[1]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, T, H, K, V = (int(x) for x in args.shape.split(","))
    benches = [b for b in PLANS if b.name in args.plans.split(",")]
    results: dict = {"machine": machine(), "shape": args.shape, "gates": args.gates, "rows": []}
    for bench in benches:
        x = make_inputs(bench.plan, B, T, H, K, V, torch.bfloat16, device, gates=args.gates)
        reference = _outputs_and_grads(bench.plan, x)
        for name, value in [("table", 0)] + settings:
            row: dict = {"plan": bench.name, "setting": "table" if name == "table" else f"{name}={value}"}
            try:
                with launch.overridden(**({} if name == "table" else {name: value})):
                    row["worst_vs_table"] = _worst(_outputs_and_grads(bench.plan, x), reference)
                    ours = functools.partial(run_ours, bench.plan, x, "triton")
                    row["forward_ms"] = time_fn(ours)
                    row["forward+backward_ms"] = time_fn(forward_and_backward(ours, x))
                row["suspect"] = row["worst_vs_table"] > SUSPECT
            except Exception as err:  # noqa: BLE001  (a refused or faulting setting is a result)
                row["error"] = first_line(err)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            if "CUDA" in row.get("error", ""):
                results["stopped"] = f"a CUDA fault at {bench.name} {row['setting']}: run the rest in a fresh process"
                break
        if results.get("stopped"):
            break
    from archspec.atomic import write_text_atomic

    write_text_atomic(args.out, json.dumps(results, indent=1))
    print(f"{'plan':24s} {'setting':28s} {'fwd ms':>8s} {'f+b ms':>8s} {'vs table':>9s}")
    for r in results["rows"]:
        print(f"{r['plan']:24s} {r['setting']:28s} {r.get('forward_ms', float('nan')):8.3f} "
              f"{r.get('forward+backward_ms', float('nan')):8.3f} {r.get('worst_vs_table', float('nan')):9.1e}"
              f"{'  SUSPECT' if r.get('suspect') else ''} {r.get('error', '')}")
    return results


if __name__ == "__main__":
    main()
