"""GPU proof of the Triton chunk kernel: every path at realistic shapes against float64.

    python benchmarks/gpu_check.py [--plans a,b] [--dtypes bfloat16,float32] [--budget-s S] [--merge] [--smoke]

1. `path`: every plan of `CHECK_PLANS` (every mode x gate, n_h 1-8, beta in [0, 2], untied
   and OSDN write keys; channel gates mild, strong, steep and, in KDA's decay form, fast:
   `decay.py`'s paths 1, 1, 2 and mostly 3; `common.py` says what each is) at B=2 T=2048 H=16 K=V=128 in
   bfloat16, float16 and float32, with an initial and a final state: outputs, final state
   and every input gradient (random cotangents) against our `torch` backend in float64 on
   the same rounded inputs. Error = ||ours - ref|| / ||ref|| per tensor, under `TOL`; for a
   gate also its sums over tokens, `sum dg` and `sum g dg` (per channel or head: the
   gradients of a Mamba-style gate's `dt_bias` and `A_log` are of that form, and a sum
   amplifies dg's errors wherever its terms cancel).
2. `naive`: four plans at T=512 in float32 against the token loop in float64 (the
   definition; at 2048 tokens it would take minutes).
3. `packed`: packed batches (`cu_seqlens`; sequences of 1500, 0, 37, 2048 and 511 tokens)
   against float64, and each sequence run alone equal to its slice of the packed run.
4. `heads64`: the channel-gated plans of `HEADS64_PLANS` at K=V=64 in bfloat16, steep
   gates (heads that small ran wrong on the H200 where 128 ran right; docs/kernel.md).
5. `stability`: beta = 2 (every factor a reflection) over 65,536 tokens in bfloat16, for
   DeltaNet and Gated DeltaNet: finite, the final state against float64.

Every specialization is compiled first in worker processes (one per job: a kernel fault
stays in its job). Results: `benchmarks/results/gpu_check.json`; a table is printed.
`--merge` keeps an earlier file's checks that this run did not run, so the check can be
split over several calls (`--plans a,b --merge`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402  (a script beside its helpers)
    ROOT, Bench, CompileJob, compile_in_workers, first_line, machine, make_inputs, relative_error, run_ours,
)

TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}  # relative Frobenius error (docs/kernel.md, "Numerics")
# A gate's sums over tokens cancel to 2-5% of their terms in every regime, so they carry
# 20-50x dg's error. In half precision TOL already holds them (their errors are the operands'
# rounding); in float32 dg's own error is the cumulative gate's rounding, which grows with
# the gate: at the fast gates (about 7 nats a token, a chunk's sum near -470, where float32
# keeps 3e-5) dg is 1.1e-5 off float64 and `sum g dg` 1.4e-4 on the interpreter (the same
# with the kernels before the midpoint factorization), 2.2e-4 on the H200.
SUM_TOL = {**TOL, "float32": 1e-3}
GATE_SUMS = ("sum dg", "sum g dg")
BETA2 = (("mixer.transition.beta_range", (0, 2)),)
CHECK_PLANS = [
    Bench("linear-attention", "gla", (("mixer.gate", "none"), ("mixer.decay", None))),  # no gate, so no decay form
    Bench("gla-scalar", "gla", (("mixer.gate", "scalar"),)),
    Bench("gla", "gla"),
    Bench("deltanet", "deltanet"),
    Bench("gated-deltanet", "gated-deltanet"),
    Bench("deltaproduct-2", "deltaproduct-2"),
    Bench("gated-deltaproduct-3", "gated-deltaproduct-2", (("mixer.transition.n_h", 3),)),
    Bench("kda", "kda"),
    Bench("kda-2", "kda", (("mixer.transition.n_h", 2),)),
    Bench("rwkv7", "rwkv7"),
    Bench("rwkv7-scalar-2", "rwkv7", (("mixer.gate", "scalar"), ("mixer.transition.n_h", 2), *BETA2)),
    Bench("osgdn-apf", "osgdn-apf"),
    Bench("kda-4", "kda", (("mixer.transition.n_h", 4),)),
    Bench("gated-deltaproduct-8", "gated-deltaproduct-2", (("mixer.transition.n_h", 8),)),
    Bench("rwkv7-8", "rwkv7", (("mixer.transition.n_h", 8),)),
]
NAIVE_PLANS = ("deltanet", "gated-deltaproduct-3", "kda", "rwkv7")
PACKED_PLANS = ("gated-deltaproduct-3", "kda", "rwkv7", "gla", "osgdn-apf")
PACKED_LENGTHS = (1500, 0, 37, 2048, 511)  # odd lengths and an empty sequence: no chunk aligns
HEADS64_PLANS = ("kda", "rwkv7")
DIMS = {"H": 16, "K": 128}


def _with_grads(bench: Bench, x: dict, backend: str, d_o: torch.Tensor, d_s: torch.Tensor) -> dict:
    o, s = run_ours(bench.plan, x, backend, output_final_state=True)
    leaves = {k: v for k, v in x.items() if isinstance(v, torch.Tensor) and v.requires_grad}
    grads = torch.autograd.grad((o.double() * d_o).sum() + (s.double() * d_s).sum(), list(leaves.values()), allow_unused=True)
    out = {"o": o.detach(), "final_state": s.detach()}
    out.update({"d_" + k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(leaves.items(), grads)})
    return out


def _errors(got: dict, want: dict) -> dict[str, float]:
    return {name: relative_error(got[name], w) for name, w in want.items()}


def _gate_sums(x: dict, grads: dict) -> dict[str, torch.Tensor]:
    """The gate gradient's sums over tokens: per channel (`sum dg`, as `dt_bias`'s gradient)
    and per head (`sum g dg`, as `A_log`'s)."""
    g, dg = x["g"].detach().double(), grads["d_g"].double()
    sums = (dg.sum((0, 1)), (g * dg).sum((0, 1)).reshape(g.shape[2], -1).sum(1))
    return dict(zip(GATE_SUMS, sums))


def _float64(x: dict) -> dict:
    return {k: v.detach().double().requires_grad_() if v.is_floating_point() else v for k, v in x.items()}


def _sequence(x: dict, n: int, start: int, end: int, n_h: int) -> dict:
    """Sequence `n` (tokens `start:end`) of a packed batch's inputs, results or gradients."""
    out = {}
    for name, val in x.items():
        base = name.removeprefix("d_")
        if base == "cu_seqlens":
            continue
        part = (val[n:n + 1] if base in ("initial_state", "final_state") else
                val[:, start:end] if base in ("q", "g", "retain", "o") else val[:, start * n_h:end * n_h])
        out[name] = part.detach().clone().requires_grad_(val.requires_grad)
    return out


def check(kind: str, bench: Bench, gates: str, dtype: str, B: int, T: int, lengths: tuple | None, device: str,
          K: int) -> dict:
    x = make_inputs(bench.plan, B, T, DIMS["H"], K, K, getattr(torch, dtype), device, gates=gates,
                    seed=zlib.crc32(bench.name.encode()) % 1000, states=True, lengths=None if lengths is None else list(lengths))
    gen = torch.Generator().manual_seed(5)
    rows = x["initial_state"].shape[0]
    d_o = torch.randn(B, T, DIMS["H"], K, generator=gen, dtype=torch.float64).to(device)
    d_s = torch.randn(rows, DIMS["H"], K, K, generator=gen, dtype=torch.float64).to(device)
    got = _with_grads(bench, x, "triton", d_o, d_s)
    reference = "naive" if kind == "naive" else "torch"
    if reference == "torch" and bench.plan.gate == "channel" and B > 1:  # per row: float64 channel decays are large
        parts = [_with_grads(bench, {k: v[b:b + 1] for k, v in _float64(x).items()}, "torch", d_o[b:b + 1], d_s[b:b + 1])
                 for b in range(B)]
        want = {k: torch.cat([p[k] for p in parts], 0) for k in parts[0]}
    else:
        want = _with_grads(bench, _float64(x), reference, d_o, d_s)
    errors = _errors(got, want)
    if "d_g" in want and lengths is None:
        errors.update(_errors(_gate_sums(x, got), _gate_sums(x, want)))
    if lengths is not None:  # each sequence alone equals its slice of the packed run
        offsets = x["cu_seqlens"].tolist()
        for n, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
            if end > start:
                alone = _with_grads(bench, _sequence(x, n, start, end, bench.plan.n_h), "triton", d_o[:, start:end], d_s[n:n + 1])
                for name, err in _errors(alone, _sequence(got, n, start, end, bench.plan.n_h)).items():
                    errors[f"alone {name}"] = max(errors.get(f"alone {name}", 0.0), err)
    passed = all(err < (SUM_TOL if name in GATE_SUMS else TOL)[dtype] for name, err in errors.items())
    return {"errors": errors, "worst": max(errors.values()), "pass": passed}


def stability(gated: bool, T: int, device: str) -> dict:
    """beta = 2: every factor I - 2 k k^T is a reflection; the state must stay bounded."""
    bench = Bench("gated-deltanet-beta2" if gated else "deltanet-beta2", "gated-deltanet" if gated else "deltanet", BETA2)
    x = make_inputs(bench.plan, 1, T, DIMS["H"], DIMS["K"], DIMS["K"], torch.bfloat16, device, seed=3)
    x["beta"] = torch.full_like(x["beta"], 2.0).requires_grad_()
    o, s = run_ours(bench.plan, x, "triton", output_final_state=True)
    grads = torch.autograd.grad(o.float().square().mean() + s.square().mean(), list(x.values()))
    with torch.no_grad():
        ref_o, ref_s = run_ours(bench.plan, _float64(x), "torch", output_final_state=True)
    return {"plan": bench.name, "T": T, "finite": all(bool(torch.isfinite(t).all()) for t in (o, s, *grads)),
            "final_state_vs_float64": ((s.double() - ref_s).norm() / ref_s.norm()).item(),
            "output_vs_float64": ((o.double() - ref_o).norm() / ref_o.norm()).item()}


def _merge(results: dict, earlier: dict) -> None:
    """Keep the earlier run's checks that this one did not run (passed, failed or cut by
    the budget), and its stability results when this run reached none."""
    ran = {c["check"] for c in results["checks"]}
    results["checks"] = [c for c in earlier.get("checks", []) if c["check"] not in ran] + results["checks"]
    done = {c["check"] for c in results["checks"]}
    results["not_run"] = [n for n in dict.fromkeys(earlier.get("not_run", []) + results["not_run"]) if n not in done]
    if not results["stability"]:
        results["stability"] = earlier.get("stability", [])
    results["earlier_machines"] = [earlier.get("machine"), *earlier.get("earlier_machines", [])]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default="", help="comma-separated names of CHECK_PLANS (default: all)")
    parser.add_argument("--dtypes", default="bfloat16,float16,float32")
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no check after this many seconds (compiling excluded)")
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--merge", action="store_true", help="keep an earlier file's checks that are not run now")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes under the CPU interpreter: the script runs")
    args = parser.parse_args(argv)
    start = time.monotonic()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = set(args.plans.split(",")) if args.plans else {b.name for b in CHECK_PLANS}
    dtypes = args.dtypes.split(",")
    (B, T), T_naive, lengths, T_long = ((2, 2048), 512, PACKED_LENGTHS, 65536)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        DIMS.update(H=1, K=16)
        (B, T), T_naive, lengths, T_long = ((1, 40), 24, (20, 0, 3, 17), 128)
    checks = []  # (kind, bench, gates, dtype, B, T, lengths, K)
    for bench in CHECK_PLANS:
        if bench.name not in names:
            continue
        # channel gates: path 1 (mild, strong), path 2 (steep) and, for a mamba2-form gate
        # (KDA's), path 3 in most heads (fast: rates 1 to 16 a head, dt_bias 0)
        regimes = ("mild", "strong", "steep") if bench.plan.gate == "channel" else ("mild",)
        if bench.plan.gate == "channel" and bench.plan.decay == "mamba2":
            regimes += ("fast",)
        K = DIMS["K"]
        checks += [("path", bench, g, d, B, T, None, K) for g in regimes for d in dtypes]
        if bench.name in NAIVE_PLANS:
            checks.append(("naive", bench, "mild", "float32", 1, T_naive, None, K))
        if bench.name in PACKED_PLANS:
            checks += [("packed", bench, "mild", d, 1, sum(lengths), lengths, K) for d in dtypes if d != "float16"]
        if bench.name in HEADS64_PLANS and "bfloat16" in dtypes:
            checks.append(("heads64", bench, "steep", "bfloat16", B, T, None, min(K, 64)))
    faults: dict[int, str] = {}
    if device == "cuda" and args.workers > 0:  # compile every specialization first, a process per job
        jobs = [CompileJob(c[1], "ours", c[2], c[3], (c[4], c[5], DIMS["H"], c[7], c[7]), True, c[6]) for c in checks]
        statuses = compile_in_workers(jobs, args.workers, fresh_process=True)
        faults = {i: s for i, s in enumerate(statuses) if "CUDA" in s or "AcceleratorError" in s}  # would poison this process
        print(f"[{time.monotonic() - start:6.1f}s] compiled {len(jobs)} specializations, {len(faults)} faulted", flush=True)
    start = time.monotonic()  # the budget is the checks' own
    results: dict = {"machine": machine(), "dims": dict(DIMS), "tolerance": TOL, "gate_sum_tolerance": SUM_TOL, "checks": [], "not_run": [], "stability": []}
    for i, (kind, bench, gates, dtype, b, t, lens, k) in enumerate(checks):
        label = f"{kind}:{bench.name}/{gates}/{dtype}"
        if time.monotonic() - start > args.budget_s:
            results["not_run"].append(label)
            continue
        try:
            r = {"error": faults[i], "worst": float("inf"), "pass": False} if i in faults else \
                check(kind, bench, gates, dtype, b, t, lens, device, k)
        except Exception as err:  # noqa: BLE001  (a failed check is a result)
            r = {"error": first_line(err), "worst": float("inf"), "pass": False}
        results["checks"].append({"check": label, **r})
        print(f"[{time.monotonic() - start:6.1f}s] {label:48s} worst {r['worst']:.2e} {'ok' if r['pass'] else 'FAIL'} "
              f"{r.get('error', '')}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    for gated in (False, True):
        if time.monotonic() - start <= args.budget_s:
            try:
                results["stability"].append(stability(gated, T_long, device))
            except Exception as err:  # noqa: BLE001
                results["stability"].append({"gated": gated, "error": first_line(err)})
    from archspec.atomic import write_text_atomic

    if args.merge and (args.out / "gpu_check.json").exists():
        _merge(results, json.loads((args.out / "gpu_check.json").read_text()))
    write_text_atomic(args.out / "gpu_check.json", json.dumps(results, indent=1))
    failed = [c["check"] for c in results["checks"] if not c["pass"]]
    print(f"\n{len(results['checks'])} checks, {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}; "
          f"not run (budget): {len(results['not_run'])}")
    for s in results["stability"]:
        print("stability", json.dumps(s))
    return results


if __name__ == "__main__":
    main()
