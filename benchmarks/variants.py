"""Time our Triton kernels under several launch settings, one process per setting.

    python benchmarks/variants.py [--plans deltanet,kda,...] [--variants "8,4 8,8 16,8"] [--out DIR] [--budget-s S]

The launch knobs of `kernels/triton/launch.py` (`ARCHSPEC_TRITON_WARPS`: warps of the
chunk-parallel kernels and of the state passes; `ARCHSPEC_TRITON_STAGES`;
`ARCHSPEC_TRITON_STATE_BV`) are read once at import, so each setting runs
`benchmarks/kernels.py --no-fla --no-torch` in its own process. Why: the offline sm_90
compile (`python -m archspec.kernels.triton.compile_report`) shows register spills that
move with the warp count (the state pass: 456 B of stack with 4 warps, 16 B with 8; the
channel-gate backward: 4.9 KB with 8 warps, 2.9 KB with 16), and only the GPU can say
which setting is faster; `--check PLANS` runs the GPU correctness check of those plans
under each setting first (half its time, at least 90 s; only the plans the setting times,
and none for the defaults `8,4`), since a setting is adopted only if it is right too. Writes `DIR/variants.json` and `DIR/variants.md`: forward and
forward+backward ms per plan and setting, and each setting's per-kernel times.
A variant is written as `WARPS[/STAGES[/STATE_BV]][:name=value...]`, e.g. `8,8`, `8,4/2` or
`8,4:solve=doubling:osdn_ahead=1`, and `@plan,plan` after it times that setting on those
plans only (a name sets `ARCHSPEC_TRITON_<NAME>`: `solve` the UT
inverse of `solve.py`, `osdn_ahead` and `osdn_warps` the OSDN scan of `osdn.py`,
`backward_warps` the last backward kernel's warps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_PLANS = "deltanet,kda,gla-channel,deltaproduct-2,osdn-deltanet"
DEFAULT_VARIANTS = "8,4 8,8 16,8 4,4 8,8:backward_warps=16 8,4:solve=doubling:osdn_ahead=1:osdn_warps=1 8,8:solve=doubling:osdn_ahead=1:osdn_warps=1"


def variant_env(variant: str) -> dict[str, str]:
    positional, *named = variant.split(":")
    warps, *rest = positional.split("/")
    env = {"ARCHSPEC_TRITON_WARPS": warps}
    for item in named:  # e.g. "solve=doubling" -> ARCHSPEC_TRITON_SOLVE=doubling
        name, _, value = item.partition("=")
        env[f"ARCHSPEC_TRITON_{name.upper()}"] = value
    if rest:
        env["ARCHSPEC_TRITON_STAGES"] = rest[0]
    if len(rest) > 1:
        env["ARCHSPEC_TRITON_STATE_BV"] = rest[1]
    return env


def run_variant(variant: str, plans: str, work: Path, seconds: float, smoke: bool = False, check: str = "") -> dict:
    """Time `plans` under the variant's environment; with `check`, first run the GPU
    correctness check of those plans under the same environment (a setting that is faster
    but wrong must not be adopted), with a third of the time."""
    folder = work / ("v-" + variant.replace(",", "_").replace("/", "-").replace(":", "-").replace("=", "-"))
    env = {**os.environ, **variant_env(variant)}
    result = {"variant": variant, "env": variant_env(variant)}
    t0 = time.monotonic()
    if check:
        check_s = max(seconds / 2, 90.0)  # a cold machine compiles every plan first (59 s was not enough)
        cmd = [sys.executable, str(HERE / "triton_gpu_check.py"), "--plans", check, "--out", str(folder),
               "--budget-s", str(int(check_s))] + (["--smoke"] if smoke else [])
        try:  # the check stops itself at its budget; a hung compile must not end the whole run
            subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=check_s + 30, check=False)
        except subprocess.TimeoutExpired:
            pass  # reported below: no triton_gpu_check.json
        try:
            checked = json.loads((folder / "triton_gpu_check.json").read_text())["checks"]
            # a failed check keeps its error's first line: a fault under a variant is its
            # finding, and the check's own file stays on the device (session 9 spent a
            # call to read "illegal memory access" back)
            result["check"] = {key: {"worst": r["worst"], "pass": r["pass"],
                                     **({"error": r["error"].splitlines()[0][:200]} if r.get("error") else {})}
                               for key, r in checked.items()}
        except (OSError, ValueError, KeyError) as err:
            result["check"] = {"error": f"{type(err).__name__}: {err}"}
        seconds -= time.monotonic() - t0
    cmd = [sys.executable, str(HERE / "kernels.py"), "--plans", plans, "--no-fla", "--no-torch",
           "--out", str(folder), "--budget-s", str(int(seconds)), "--workers", str(len(plans.split(","))),
           "--min-plan-s", "12"]  # its share is sized to its plans (main): time every one
    cmd += ["--smoke"] if smoke else []
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds + 30, check=False)
    result.update(seconds=round(time.monotonic() - t0, 1), rc=proc.returncode)
    try:
        data = json.loads((folder / "kernels.json").read_text())
    except (OSError, ValueError):
        result["error"] = (proc.stderr or proc.stdout)[-800:]
        return result
    result["machine"] = data["machine"]
    result["plans"] = {name: next((r for r in e["rows"] if r["impl"] == "triton"), {}) for name, e in data["plans"].items()}
    untimed = [p for p in plans.split(",") if not result["plans"].get(p, {}).get("fwd_ms")]
    if untimed:  # a plan that crashed leaves no row, only its traceback on stderr
        result["error"] = f"not timed: {', '.join(untimed)}\n" + (proc.stderr or proc.stdout)[-800:]
    return result


def plans_to_check(setting: str, only: str, check: str) -> str:
    """The plans of `check` to check under a variant: none for the defaults (`8,4` alone,
    checked by the calls that time them), else those the variant times (all of `check`
    when it names none)."""
    if setting == "8,4" or not check:
        return ""
    if not only:
        return check
    return ",".join(p for p in check.split(",") if p in only.split(","))


def markdown(results: list[dict], plans: list[str]) -> str:
    ms = lambda x: "—" if x is None else f"{x:.3f}"
    lines = ["| plan | " + " | ".join(f"{r['variant']} fwd | {r['variant']} f+b" for r in results) + " |",
             "|---|" + "---|---|" * len(results)]
    for p in plans:
        cells = [f"{ms(r.get('plans', {}).get(p, {}).get('fwd_ms'))} | {ms(r.get('plans', {}).get(p, {}).get('fwdbwd_ms'))}" for r in results]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    checked = [r for r in results if r.get("check")]
    if checked:
        lines += ["", "Correctness under each variant (worst relative error against float64; pass/fail):", ""]
        for r in checked:
            cells = ", ".join(f"{k} {v['worst']:.1e} {'ok' if v['pass'] else 'FAIL'}"
                              + (f" ({v['error']})" if v.get("error") else "") if "worst" in v else f"{k}: {v}"
                              for k, v in r["check"].items()) if "error" not in r["check"] else r["check"]["error"]
            lines.append(f"- {r['variant']}: {cells}")
    for r in results:
        if "error" in r:  # its first line (what was not timed) and the traceback's end
            first, _, rest = r["error"].partition("\n")
            lines.append(f"\n{r['variant']}: {first}" + (f" ... {rest[-300:]}" if rest else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default=DEFAULT_PLANS)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="space-separated WARPS[/STAGES[/STATE_BV]]")
    parser.add_argument("--out", default="benchmarks/results/variants")
    parser.add_argument("--work", default="/tmp/archspec-variants", help="each variant's own kernels.json (kept out of --out)")
    parser.add_argument("--budget-s", type=float, default=400, help="for all variants together")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes: checks that the script runs")
    parser.add_argument("--check", default="", help="plans to check for correctness under each variant first (triton_gpu_check.py)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = args.variants.split()
    # the table's rows: every plan some variant times (`@plans`, else --plans), in first-seen order
    plans = list(dict.fromkeys(p for v in variants for p in (v.partition("@")[2] or args.plans).split(",")))
    start, results = time.monotonic(), []
    n_plans = [len((v.partition("@")[2] or args.plans).split(",")) for v in variants]
    for i, variant in enumerate(variants):
        # the time left, split in proportion to the plans each remaining variant times
        share = (args.budget_s - (time.monotonic() - start)) * n_plans[i] / sum(n_plans[i:])
        if share < 30:
            results.append({"variant": variant, "error": "out of budget"})
            continue
        setting, _, only = variant.partition("@")  # "8,4:osdn_stats=1@osdn-deltanet": that setting on those plans
        results.append(run_variant(setting, only or args.plans, Path(args.work), share - 10, args.smoke,
                                   plans_to_check(setting, only, args.check)))
        results[-1]["variant"] = variant
        print(f"[{time.monotonic() - start:6.1f}s] {variant}: " + ", ".join(
            f"{p} {r.get('fwd_ms')}/{r.get('fwdbwd_ms')}" for p, r in results[-1].get("plans", {}).items()), flush=True)
        (out / "variants.json").write_text(json.dumps(results, indent=1))
        (out / "variants.md").write_text(markdown(results, plans))
    print(markdown(results, plans))
    return results


if __name__ == "__main__":
    main()
