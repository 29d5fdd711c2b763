"""GPU proof of the Triton chunk kernel: every path at realistic shapes against a float64
reference, stability over 65,536 tokens, and the gated backward where
flash-linear-attention refuses.

    python benchmarks/triton_gpu_check.py [--out DIR] [--plans a,b] [--gaps] [--dtypes D,D] [--budget-s S] [--smoke]

Default (the full proof):
1. Plans of `benchmarks/kernels.py` (every MODE x GATE, n_h 1-3, beta in [0, 2], untied and
   OSDN write keys), B=4, T=4096, H=16, K=V=128, in bfloat16 and float32, with an initial
   state and the final state: outputs, final state and every input gradient (random
   cotangents) against the reference, our `torch` chunked backend in float64 on the GPU
   (run per batch row where its channel-decay tensors are large) on the same rounded
   inputs. Error = ||ours - ref|| / ||ref|| per tensor.
2. Some paths at T=512, B=1 in float32 against the naive token loop in float64 (the
   definition), which at 4096 tokens would take minutes per path.
3. Stability: DeltaNet and gated DeltaNet with beta = 2 (every factor a reflection) over
   65,536 tokens in bfloat16: finite outputs and gradients, the state norm at every 4,096
   tokens (chained through initial_state) and the final state against float64.
4. flash-linear-attention's gated DeltaNet backward on this machine: its refusal (or
   result) is recorded next to ours.

`--gaps`: what the first GPU runs did not cover, in one call of about two minutes:
packed batches (`cu_seqlens`: 4,096 tokens in sequences of 1500, 0, 37, 2048 and 511,
against float64 on the packed batch, and each sequence run alone equal to its slice of
the packed run), float16 inputs, and n_h = 4 and 8 (B=2, T=2048).

Writes `DIR/triton_gpu_check.json` (`triton_gpu_check_gaps.json` with `--gaps`) after every
check (machine, versions, every error) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as bench  # noqa: E402  (benchmarks/kernels.py: plans, inputs, warm-up, clock)

TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}  # relative Frobenius error; see docs/kernel.md
DIMS = {"H": 16, "K": 128}  # heads and head dim (K = V); --smoke shrinks them
# Every MODE x GATE combination, n_h = 1, 2, 3, beta in [0, 2], untied and OSDN write keys.
CHECK_PLANS = ["linear-attention", "gla-scalar", "gla-channel", "deltanet", "gdn", "deltaproduct-2-beta2",
               "gated-deltaproduct-3", "kda", "kda-2", "rwkv7", "rwkv7-scalar-2", "osdn-apf-gdn",
               "kda-fast-decay", "rwkv7-fast-decay"]
NAIVE_PLANS = ["deltanet", "gated-deltaproduct-3", "kda", "rwkv7"]  # also against the token loop at T=512
# --gaps: packed batches on every gate and transition kind (and OSDN's packed scan) ...
PACKED_PLANS = ["gated-deltaproduct-2", "kda", "rwkv7", "gla-channel", "osdn-apf-gdn"]
PACKED_LENGTHS = (1500, 0, 37, 2048, 511)  # odd lengths and an empty sequence: no chunk aligns
# ... float16 on each kind ...
FP16_PLANS = ["deltanet", "gdn", "kda", "rwkv7", "gla-channel", "gla-scalar", "gated-deltaproduct-3", "osdn-apf-gdn"]
# ... and n_h > 3 (n_h = 8: 8 tokens per 64-row chunk; beta in [0, 2]; channel gates).
NH_PLANS = ["deltaproduct-4", "gated-deltaproduct-4", "kda-4", "gated-deltaproduct-8-beta2", "rwkv7-8"]


@dataclass(frozen=True)
class Check:
    kind: str  # path (vs our torch backend in float64) | naive (vs the token loop) | packed
    plan: str
    dtype: str
    B: int
    T: int
    lengths: tuple | None = None

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.plan}/{self.dtype}"


def _leaves(x: dict) -> dict:
    return {k: v for k, v in x.items() if isinstance(v, torch.Tensor) and v.requires_grad}


def _run_with_grads(plan, inputs: dict, backend: str, d_o: torch.Tensor, d_s: torch.Tensor) -> dict:
    o, s = bench.run_plan(plan, inputs, backend, output_final_state=True)  # initial_state is among inputs
    leaves = _leaves(inputs)
    grads = torch.autograd.grad((o.float() * d_o).sum() + (s.float() * d_s).sum(), list(leaves.values()), allow_unused=True)
    out = {"o": o.detach(), "final_state": s.detach()}
    out.update({"d_" + k: (torch.zeros_like(v) if g is None else g) for (k, v), g in zip(leaves.items(), grads)})
    return out


def _errors(got: dict, want: dict) -> dict:
    errs = {}
    for name, w in want.items():
        g = got[name].double()
        if not torch.isfinite(g).all():
            errs[name] = float("inf")
            continue
        errs[name] = ((g - w.double()).norm() / w.double().norm().clamp_min(1e-30)).item()
    return errs


def _upcast(x: dict) -> dict:
    return {k: (v.detach().double().requires_grad_() if v.is_floating_point() else v) for k, v in x.items()}


def _row_slice(x: dict, b: int) -> dict:
    return {k: v.detach()[b : b + 1].clone().requires_grad_() for k, v in x.items()}


def _seq_slice(x: dict, n: int, start: int, end: int, n_h: int) -> dict:
    """Sequence `n` (tokens `start:end`) of a packed batch: inputs, results or gradients
    (`d_<name>` lies along the axis of `<name>`), as leaves for a run of its own."""
    out = {}
    for name, val in x.items():
        base = name.removeprefix("d_")
        if base == "cu_seqlens":
            continue
        if base in ("initial_state", "final_state"):
            part = val[n : n + 1]
        elif base in ("q", "g", "retain", "o"):
            part = val[:, start:end]
        else:  # per sub-step: k, v, beta, erase, write_key
            part = val[:, start * n_h : end * n_h]
        out[name] = part.detach().clone().requires_grad_(val.requires_grad)
    return out


def _cotangents(B: int, T: int, states: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    H, K = DIMS["H"], DIMS["K"]
    return torch.randn(B, T, H, K, generator=gen).to(device), torch.randn(states, H, K, K, generator=gen).to(device)


def run_check(c: Check, device) -> dict:
    plan = bench.plan_named(c.plan)
    H, K = DIMS["H"], DIMS["K"]
    x = bench.make_inputs(plan, c.B, c.T, H, K, K, getattr(torch, c.dtype), device, seed=zlib.crc32(plan.name.encode()) % 1000,
                          states=True, lengths=c.lengths)
    d_o, d_s = _cotangents(c.B, c.T, x["initial_state"].shape[0], device)
    t0 = time.monotonic()
    got = _run_with_grads(plan, x, "triton", d_o, d_s)
    if device == "cuda":
        torch.cuda.synchronize()
    t1 = time.monotonic()
    ref64 = _upcast(x)
    reference = "naive" if c.kind == "naive" else "torch"
    if reference == "torch" and plan.gate == "channel" and c.B > 1:  # per batch row: float64 [L, L, K] decay tensors are large
        parts = [_run_with_grads(plan, _row_slice(ref64, b), "torch", d_o[b : b + 1].double(), d_s[b : b + 1].double()) for b in range(c.B)]
        want = {k: torch.cat([p[k] for p in parts], 0) for k in parts[0]}
    else:
        want = _run_with_grads(plan, ref64, reference, d_o.double(), d_s.double())
    errs = _errors(got, want)
    r = {"errors": errs, "worst": max(errs.values()), "triton_s": round(t1 - t0, 3), "reference_s": round(time.monotonic() - t1, 3),
         "reference": reference, "shape": dict(B=c.B, T=c.T, H=H, K=K)}
    if c.lengths is not None:  # each sequence alone must equal its slice of the packed run
        r["lengths"], alone = list(c.lengths), {}
        offsets = x["cu_seqlens"].tolist()
        for n, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
            if end > start:
                part = _seq_slice(x, n, start, end, plan.n_h)
                mine = _run_with_grads(plan, part, "triton", d_o[:, start:end], d_s[n : n + 1])
                for name, err in _errors(mine, _seq_slice(got, n, start, end, plan.n_h)).items():
                    alone[name] = max(alone.get(name, 0.0), err)
        r["alone_vs_packed"] = alone
        r["worst"] = max(r["worst"], *alone.values())
    return r


def stability(device, T: int, gated: bool) -> dict:
    """beta = 2: every factor I - 2 k k^T is a reflection; the state must stay bounded."""
    plan = bench.PlanSpec("gdn-beta2" if gated else "deltanet-beta2", gate="scalar" if gated else "none", beta_scale=2.0)
    H, K = DIMS["H"], DIMS["K"]
    x = bench.make_inputs(plan, 1, T, H, K, K, torch.bfloat16, device, seed=3)
    x["beta"] = torch.full_like(x["beta"], 2.0).requires_grad_()
    o, s = bench.run_plan(plan, x, "triton", output_final_state=True)
    grads = torch.autograd.grad(o.float().square().mean() + s.square().mean(), list(x.values()))
    finite = bool(torch.isfinite(o).all()) and bool(torch.isfinite(s).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
    # state norms along the sequence, chaining segments of 4096 tokens through initial_state
    norms, state = [], None
    seg = min(4096, T // 4)
    with torch.no_grad():
        for start in range(0, T, seg):
            part = {k: v[:, start : start + seg] for k, v in x.items()}
            _, state = bench.run_plan(plan, part, "triton", initial_state=state, output_final_state=True)
            norms.append(state.norm(dim=(-2, -1)).max().item())
        chained_vs_whole = ((state - s.detach()).norm() / s.detach().norm()).item()
        ref_o, ref_s = bench.run_plan(plan, {k: v.detach().double() for k, v in x.items()}, "torch", output_final_state=True)
    return {
        "T": T, "gated": gated, "finite": finite,
        "state_norm_max_per_4096": norms, "state_norm_max": max(norms),
        "value_norm": x["v"].float().norm(dim=-1).mean().item(),
        "final_state_vs_float64": ((s.double() - ref_s).norm() / ref_s.norm()).item(),
        "output_vs_float64": ((o.double() - ref_o).norm() / ref_o.norm()).item(),
        "chained_vs_whole": chained_vs_whole,
        "random_walk_scale": 2 * x["v"].float().norm(dim=-1).mean().item() * T**0.5,  # |S| of 2 k v^T steps summed at random
    }


def fla_gated_backward(device) -> dict:
    """What flash-linear-attention 0.6.0 does with a gated DeltaNet backward here."""
    plan = bench.plan_named("gdn")
    x = bench.make_inputs(plan, 1, 1024, 16, 128, 128, torch.bfloat16, device, seed=9)
    try:
        peer = bench.fla_callable(plan, x)
    except ImportError as err:
        return {"status": f"not installed: {err}"}
    try:
        o, _ = peer()
        torch.autograd.grad(o.float().sum(), [x["q"]])
        return {"status": "ran"}
    except Exception as err:
        return {"status": "refused", "error": f"{type(err).__name__}: {str(err).strip()[:400]}"}


def run_check_within(c: Check, device: str, seconds: float) -> dict:
    try:
        with bench.deadline(seconds):
            return run_check(c, device)
    except Exception as err:  # OutOfTime included: the check is recorded as failed
        traceback.print_exc()
        return {"error": f"{type(err).__name__}: {err}"[:300], "worst": float("inf")}


def checks_for(args) -> list[Check]:
    if args.gaps:
        (B, T), total = ((1, 48), 48) if args.smoke else ((2, 2048), 4096)
        lengths = (20, 0, 3, 25) if args.smoke else PACKED_LENGTHS
        assert sum(lengths) == total
        out = [Check("packed", p, d, 1, total, lengths) for p in PACKED_PLANS for d in ("bfloat16", "float32")]
        out += [Check("path", p, "float16", B, T) for p in FP16_PLANS]
        out += [Check("path", p, d, B, T) for p in NH_PLANS for d in ("bfloat16", "float32")]
    else:
        B, T, T_naive = (1, 64, 32) if args.smoke else (*args.batch_tokens, 512)
        names = args.plans.split(",") if args.plans else CHECK_PLANS
        out = []
        for p in names:
            out += [Check("path", p, d, B, T) for d in ("bfloat16", "float32")]
            if p in NAIVE_PLANS or args.smoke:
                out.append(Check("naive", p, "float32", 1, T_naive))
    if args.gaps and args.plans:  # --plans narrows either suite
        out = [c for c in out if c.plan in args.plans.split(",")]
    if args.dtypes:  # and --dtypes too: a launch change confined to half precision is checked there
        out = [c for c in out if c.dtype in args.dtypes.split(",")]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--plans", default="")
    parser.add_argument("--batch-tokens", type=lambda x: tuple(int(v) for v in x.split(",")), default=(4, 4096),
                        help="B,T of the default suite's path checks (the benchmark's shape; smaller for a quick recheck)")
    parser.add_argument("--gaps", action="store_true", help="packed batches, float16, n_h 4 and 8 (see above)")
    parser.add_argument("--dtypes", default="", help="only the checks in these dtypes, e.g. bfloat16,float16 (default: all)")
    parser.add_argument("--budget-s", type=float, default=1e9, help="wall-clock budget; checks that do not fit are listed as not run")
    parser.add_argument("--check-limit-s", type=float, default=120, help="most seconds one check may take")
    parser.add_argument("--compile-limit-s", type=float, default=150, help="most seconds the parallel warm-up may take")
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)), help="warm-up processes (GPU); 0: none")
    parser.add_argument("--smoke", action="store_true", help="tiny run under the CPU interpreter (script check only)")
    args = parser.parse_args(argv)
    clock = bench.Clock(args.budget_s)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        DIMS.update(H=1, K=16)
    checks = checks_for(args)
    name = "triton_gpu_check_gaps.json" if args.gaps else "triton_gpu_check.json"
    out = Path(args.out)
    results = {"machine": bench.machine(), "dims": dict(DIMS), "tolerance": TOL, "checks": {}, "not_run": [],
               "stability": [], "fla_gated_backward": None}

    def write() -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(results, indent=1))

    clock.log(f"{len(checks)} checks, budget {args.budget_s:.0f}s")
    faulted: dict[str, str] = {}  # check key -> the CUDA fault its warm-up met
    if device == "cuda" and args.workers > 0:  # compile every specialization in parallel first
        H, K = DIMS["H"], DIMS["K"]
        jobs: dict = {}  # job -> the checks it warms
        for c in checks:
            mine = []
            if c.kind != "naive":
                mine.append(bench.WarmJob(c.plan, "triton", c.dtype, (c.B, c.T, H, K, K), states=True, lengths=c.lengths))
            # each packed sequence alone is a dense run; Triton specializes on T % 16 == 0
            for t in {n % 16 == 0: n for n in (c.lengths or ()) if n}.values():
                mine.append(bench.WarmJob(c.plan, "triton", c.dtype, (1, t, H, K, K), states=True))
            for j in mine:
                jobs.setdefault(j, []).append(c.key)
        pool = bench.WarmPool(args.workers, fresh_process_per_job=True)
        done = pool.wait(pool.submit(list(jobs)), min(args.compile_limit_s, clock.left() - 30))
        pool.close()
        results["warmup"] = {f"{j.plan}/{j.dtype}/{'x'.join(map(str, j.shape))}" + (f"/packed{list(j.lengths)}" if j.lengths else ""):
                             {"status": status, "s": round(s, 1)} for j, status, s in done}
        for j, status, _ in done:
            if "CUDA error" in status or "AcceleratorError" in status:  # a fault: running it here would poison this process
                for key in jobs[j]:
                    faulted.setdefault(key, f"warm-up {j.plan} {j.shape} {j.lengths or ''}: {status}")
        slow = [f"{j.plan}/{j.dtype}: {status[:100]}" for j, status, _ in done if status != "ok"]
        clock.log(f"warm-up of {len(jobs)} specializations: longest {max(s for _, _, s in done):.0f}s"
                  + ("; not ok:\n  " + "\n  ".join(slow) if slow else ""))
    for c in checks:
        left = clock.left() - 15
        if left < 5:
            results["not_run"].append(c.key)
            continue
        if c.key in faulted:
            r = {"error": faulted[c.key][:400], "worst": float("inf")}
        else:
            r = run_check_within(c, device, min(args.check_limit_s, left))
        r["pass"] = r["worst"] < TOL[c.dtype]
        results["checks"][c.key] = r
        write()
        worst = max(r.get("errors", {"-": 0}).items(), key=lambda kv: kv[1])[0]
        clock.log(f"{c.key:42s} worst {r['worst']:.2e} ({worst}) {'ok' if r['pass'] else 'FAIL'}")
        if device == "cuda":
            torch.cuda.empty_cache()
    if not args.gaps:
        T_long = 256 if args.smoke else 65536
        for gated in (False, True):
            try:
                with bench.deadline(max(1.0, clock.left() - 15)):
                    results["stability"].append(stability(device, T_long, gated))
            except Exception as err:
                traceback.print_exc()
                results["stability"].append({"gated": gated, "error": f"{type(err).__name__}: {err}"[:300]})
        results["fla_gated_backward"] = fla_gated_backward(device) if device == "cuda" else {"status": "no GPU"}
    write()

    failed = [k for k, r in results["checks"].items() if not r["pass"]]
    print(f"\n{len(results['checks'])} checks, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else "")
          + (f"; not run (budget): {', '.join(results['not_run'])}" if results["not_run"] else ""))
    for s in results["stability"]:
        print("stability", json.dumps({k: v for k, v in s.items() if k != "state_norm_max_per_4096"}))
    if results["fla_gated_backward"]:
        print("fla gated backward:", results["fla_gated_backward"])
    return results


if __name__ == "__main__":
    main()
