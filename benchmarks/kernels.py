"""Kernel benchmark: every plan family on the Triton chunk kernel, against
flash-linear-attention (when installed) and our `torch` backend, beside its floors.

    python benchmarks/kernels.py [--out DIR] [--plans a,b] [--no-torch] [--smoke]

For each plan (B=4, T=4096, H=16, K=V=128, bfloat16 unless changed) it times forward and
forward+backward with `triton.testing.do_bench` (median, ms) and prints, before any
timing, the two floors of the plan: the fewest bytes the pass must move (every input read
once, every output written once) over 4.27 TB/s, and the FLOPs the chunk algorithm
performs over 692 TFLOP/s (both measured on the lent H200, `../shared/ENVIRONMENT.md`).
Results go to `DIR/kernels.json` and `DIR/kernels.md` with the machine, versions and date.

flash-linear-attention is optional: each peer is tried and its error recorded if it
refuses (its gated backward does on Hopper with Triton < 3.7.1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import traceback
from dataclasses import asdict, dataclass, field
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
    fla: str = ""  # the flash-linear-attention peer, if it has this recurrence
    baseline: str = ""  # the plan this one is compared with in the targets


PLANS = [
    PlanSpec("gla-scalar", "diagonal", "scalar", fla="simple_gla"),
    PlanSpec("gla-channel", "diagonal", "channel", fla="gla"),
    PlanSpec("deltanet", fla="delta_rule"),
    PlanSpec("gdn", gate="scalar", fla="gated_delta_rule"),
    PlanSpec("deltaproduct-2", n_h=2, fla="gated_delta_product", baseline="deltanet"),
    PlanSpec("deltaproduct-3", n_h=3, fla="gated_delta_product", baseline="deltanet"),
    PlanSpec("deltaproduct-4", n_h=4, fla="gated_delta_product", baseline="deltanet"),
    PlanSpec("gated-deltaproduct-2", gate="scalar", n_h=2, fla="gated_delta_product", baseline="gdn"),
    PlanSpec("gated-deltaproduct-3", gate="scalar", n_h=3, fla="gated_delta_product", baseline="gdn"),
    PlanSpec("gated-deltaproduct-4", gate="scalar", n_h=4, fla="gated_delta_product", baseline="gdn"),
    PlanSpec("kda", gate="channel", fla="kda"),
    PlanSpec("rwkv7", "rwkv7", "channel", fla="rwkv7"),
    PlanSpec("osdn-deltanet", osdn="osdn", baseline="deltanet"),
    PlanSpec("osdn-apf-deltanet", osdn="apf", baseline="deltanet"),
    PlanSpec("osdn-gdn", gate="scalar", osdn="osdn", baseline="gdn"),
    PlanSpec("osdn-apf-gdn", gate="scalar", osdn="apf", baseline="gdn"),
]
# Paths that the GPU correctness check covers beyond the benchmarked families.
EXTRA_PLANS = [
    PlanSpec("linear-attention", "diagonal"),
    PlanSpec("deltaproduct-2-beta2", n_h=2, beta_scale=2.0),
    PlanSpec("rwkv7-scalar-2", "rwkv7", "scalar", n_h=2, beta_scale=2.0),
    PlanSpec("kda-2", gate="channel", n_h=2),
]
ALL_PLANS = PLANS + EXTRA_PLANS


def make_inputs(plan: PlanSpec, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device, seed: int = 0) -> dict:
    """Leaf tensors as the layers produce them: unit keys, sigmoid beta and erase,
    log-sigmoid gates; `osdn_*` entries are the preconditioner's inputs."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    TN = T * plan.n_h

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    x: dict = {"q": F.normalize(rand(B, T, H, K), dim=-1), "k": F.normalize(rand(B, TN, H, K), dim=-1), "v": rand(B, TN, H, V)}
    if plan.gate == "scalar":
        x["g"] = F.logsigmoid(rand(B, T, H) + 4.0)
    elif plan.gate == "channel":
        x["g"] = F.logsigmoid(rand(B, T, H, K) + 4.0)
    if plan.transition == "householder":
        x["beta"] = plan.beta_scale * torch.sigmoid(rand(B, TN, H))
    if plan.transition == "rwkv7":
        x["erase"] = plan.beta_scale * torch.sigmoid(rand(B, TN, H, K)) * x["k"]
        x["write_key"] = F.normalize(rand(B, TN, H, K), dim=-1)
    if plan.osdn == "apf":
        x["retain"] = torch.sigmoid(rand(B, T, H) + 4.0)
    out = {}
    for name, val in x.items():
        out[name] = val.to(dtype).requires_grad_()
    return out


def run_plan(plan: PlanSpec, inputs: dict, backend: str, **options):
    """`(o, final_state)` of the plan (OSDN phase 1 included) on `backend`."""
    from archspec.kernels import linear_recurrence, osdn_write_keys

    args = {k: v for k, v in inputs.items() if k != "retain"}
    if plan.osdn:
        args["write_key"], _ = osdn_write_keys(inputs["k"], inputs["beta"], retain=inputs.get("retain"), backend=backend)
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


# ---------------------------------------------------------------------------------------
# Timing


def _bench(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _forward_and_backward(fn, inputs: dict):
    leaves = [t for t in inputs.values() if t.requires_grad]

    def step():
        o, _ = fn()
        torch.autograd.grad(o.float().square().sum() * 1e-3, leaves, allow_unused=True)

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


@dataclass
class Row:
    plan: str
    impl: str
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    error: str = ""
    extra: dict = field(default_factory=dict)


def measure(plan: PlanSpec, shape: dict, dtype: torch.dtype, with_torch: bool, device, with_fla: bool = True) -> tuple[list[Row], dict]:
    B, T, H, K, V = (shape[n] for n in "BTHKV")
    inputs = make_inputs(plan, B, T, H, K, V, dtype, device)
    fb, fl = floor_bytes(plan, inputs, False), chunk_flops(plan, B, T, H, K, V)
    bb = floor_bytes(plan, inputs, True)
    floors = {
        "bytes_fwd": fb, "bytes_fwdbwd": bb, "flops_fwd": fl[0], "flops_fwdbwd": fl[0] + fl[1],
        "floor_fwd_ms": 1e3 * max(fb / COPY_BYTES_PER_S, fl[0] / MATMUL_FLOPS_PER_S),
        "floor_fwdbwd_ms": 1e3 * max(bb / COPY_BYTES_PER_S, (fl[0] + fl[1]) / MATMUL_FLOPS_PER_S),
    }
    impls = [("triton", lambda: run_plan(plan, inputs, "triton"))]
    if with_torch:
        impls.append(("torch", lambda: run_plan(plan, inputs, "torch")))
    try:
        peer = fla_callable(plan, inputs) if with_fla else None
    except ImportError as err:
        peer = None
        rows_extra = Row(plan.name, "fla", error=f"not installed: {err}")
    else:
        rows_extra = None
    if peer is not None:
        impls.append(("fla", peer))
    rows = [] if rows_extra is None else ([rows_extra] if plan.fla else [])
    for impl, fn in impls:
        row = Row(plan.name, impl)
        try:
            row.fwd_ms = _bench(lambda: fn())
        except Exception as err:  # a peer that refuses is a result, not a crash
            row.error = f"forward: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        if row.fwd_ms is not None:
            try:
                row.fwdbwd_ms = _bench(_forward_and_backward(fn, inputs))
            except Exception as err:
                row.error = f"backward: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        rows.append(row)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows, floors


def _warm_one(job: tuple) -> str:
    """Compile one plan's kernels (forward and backward) in a worker process; Triton's
    disk cache then serves the measuring process. Returns a line for the log."""
    plan_name, dtype_name, shape, with_fla, states = job
    plan = next(p for p in ALL_PLANS if p.name == plan_name)
    dtype = getattr(torch, dtype_name)
    inputs = make_inputs(plan, 1, shape["T"], shape["H"], shape["K"], shape["V"], dtype, "cuda")
    options = {}
    if states:  # the specialization with initial and final state (the GPU check's)
        inputs["initial_state"] = torch.zeros(1, shape["H"], shape["K"], shape["V"], device="cuda", requires_grad=True)
        options["output_final_state"] = True
    status = []
    fns = [("triton", lambda: run_plan(plan, inputs, "triton", **options))]
    if with_fla:
        try:
            peer = fla_callable(plan, inputs)
            if peer is not None:
                fns.append(("fla", peer))
        except ImportError:
            pass
    for impl, fn in fns:
        try:
            o, s = fn()
            loss = o.float().square().sum() + (s.square().sum() if s is not None else 0)
            torch.autograd.grad(loss, [t for t in inputs.values() if t.requires_grad], allow_unused=True)
            status.append(f"{impl} ok")
        except Exception as err:
            status.append(f"{impl} {type(err).__name__}")
    torch.cuda.synchronize()
    return f"{plan_name}/{dtype_name}: " + ", ".join(status)


def warm_up(jobs: list[tuple], workers: int) -> None:
    """Compile in parallel (compilation is CPU-bound and serial inside one process)."""
    import multiprocessing as mp

    if not jobs:
        return
    with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        for line in pool.imap_unordered(_warm_one, jobs):
            print("warm-up", line, flush=True)


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "date": datetime.date.today().isoformat()}
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


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"Kernel timings on {m.get('device', 'cpu')} (torch {m['torch']}, triton {m.get('triton')}, fla {m.get('fla')}, {m['date']}); "
        f"B={results['shape']['B']} T={results['shape']['T']} H={results['shape']['H']} K={results['shape']['K']} V={results['shape']['V']} {results['dtype']}, median ms.",
        "",
        "| plan | floor fwd | ours fwd | fla fwd | ours/fla | floor f+b | ours f+b | fla f+b | ours/fla | torch f+b |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
    ratio = lambda a, b: "—" if a is None or b is None else f"{a / b:.2f}"  # noqa: E731
    for name, entry in results["plans"].items():
        r = {row["impl"]: row for row in entry["rows"]}
        ours, peer, tor = r.get("triton", {}), r.get("fla", {}), r.get("torch", {})
        fl = entry["floors"]
        lines.append(
            f"| {name} | {fl['floor_fwd_ms']:.3f} | {fmt(ours.get('fwd_ms'))} | {fmt(peer.get('fwd_ms'))} | {ratio(ours.get('fwd_ms'), peer.get('fwd_ms'))} "
            f"| {fl['floor_fwdbwd_ms']:.3f} | {fmt(ours.get('fwdbwd_ms'))} | {fmt(peer.get('fwdbwd_ms'))} | {ratio(ours.get('fwdbwd_ms'), peer.get('fwdbwd_ms'))} "
            f"| {fmt(tor.get('fwdbwd_ms'))} |"
        )
    notes = [f"- {name} / {row['impl']}: {row['error']}" for name, e in results["plans"].items() for row in e["rows"] if row["error"]]
    if notes:
        lines += ["", "Refusals and errors:", *notes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--plans", default="", help="comma-separated plan names (default: all)")
    parser.add_argument("--no-torch", action="store_true", help="skip our torch backend")
    parser.add_argument("--no-fla", action="store_true", help="skip flash-linear-attention")
    parser.add_argument("--shape", default="4,4096,16,128,128", help="B,T,H,K,V")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter: checks that the script runs")
    parser.add_argument("--workers", type=int, default=12, help="parallel compile processes before timing (GPU)")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.shape, args.no_torch = "1,32,1,16,16", True
    B, T, H, K, V = (int(x) for x in args.shape.split(","))
    shape = dict(B=B, T=T, H=H, K=K, V=V)
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = [p for p in PLANS if not args.plans or p.name in args.plans.split(",")]
    if args.smoke:  # the interpreter has no do_bench timer: run each path once instead
        global _bench
        _bench = lambda fn, **_: (fn(), 0.0)[1]  # noqa: E731

    if torch.cuda.is_available() and args.workers > 0:
        warm_shape = dict(shape, T=1024)
        warm_up([(p.name, args.dtype, warm_shape, not args.no_fla, False) for p in chosen], args.workers)
    print(f"{'plan':22s} {'MB fwd':>8s} {'GFLOP fwd':>9s} {'floor fwd':>9s} {'MB f+b':>8s} {'GFLOP f+b':>9s} {'floor f+b':>9s}")
    results = {"machine": machine(), "shape": shape, "dtype": args.dtype, "plans": {}}
    for plan in chosen:
        try:
            rows, floors = measure(plan, shape, dtype, not args.no_torch, device, not args.no_fla)
        except Exception:
            traceback.print_exc()
            continue
        print(f"{plan.name:22s} {floors['bytes_fwd'] / 1e6:8.0f} {floors['flops_fwd'] / 1e9:9.1f} {floors['floor_fwd_ms']:9.3f} "
              f"{floors['bytes_fwdbwd'] / 1e6:8.0f} {floors['flops_fwdbwd'] / 1e9:9.1f} {floors['floor_fwdbwd_ms']:9.3f}", flush=True)
        results["plans"][plan.name] = {"spec": asdict(plan), "floors": floors, "rows": [asdict(r) for r in rows]}
        _write(results, Path(args.out))  # after every plan: a run cut short keeps what it measured
    print(_write(results, Path(args.out)))


def _write(results: dict, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (out / "kernels.md").write_text(table)
    return table


if __name__ == "__main__":
    main()
