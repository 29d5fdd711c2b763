"""Adopt our rows of a variants run (`benchmarks/variants.py`) into the committed results.

    python benchmarks/adopt_variant_rows.py VARIANTS_JSON VARIANT PLANS --setting TEXT [--results DIR]

Why: a device call that times several settings may end before a plain `kernels.py` run
of the adopted defaults (30 minutes of H200 time a session). When a variant's setting
became the default, its rows are the measurement of the default code, and this puts them
into `DIR/kernels.json` (and rewrites `kernels.md`) with `TEXT` recorded on each row as
`setting` (where the number comes from and why it stands for the defaults), beside the
run's `machine` (whose `kernels_sha1` fingerprints the kernel sources it ran) and `env`
(the variant's settings). fla and torch rows, and every plan not named, stay as they were.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as bench  # noqa: E402


def adopt(results: dict, variants: list[dict], variant: str, plans: list[str], setting: str) -> dict:
    """`results` with the triton rows of `plans` taken from `variant`'s run."""
    run = next((v for v in variants if v["variant"] == variant), None)
    if run is None:
        raise SystemExit(f"no variant {variant!r} in the file; it has: {', '.join(v['variant'] for v in variants)}")
    for plan in plans:
        row = run.get("plans", {}).get(plan)
        if not row or row.get("fwd_ms") is None:
            raise SystemExit(f"variant {variant!r} has no timing of {plan!r}")
        if plan not in results["plans"]:
            raise SystemExit(f"{plan!r} is not in the results (its floors come from a kernels.py run)")
        rows = results["plans"][plan]["rows"]
        # the run's machine (its `kernels_sha1` names the kernel sources) and launch environment
        rows[:] = [r for r in rows if r["impl"] != "triton"] + [dict(row, setting=setting, machine=run.get("machine"),
                                                                     env=run.get("env"))]
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants_json")
    parser.add_argument("variant", help="the variant's name as written in the file, e.g. '8,4:output_warps=4@deltanet,gdn'")
    parser.add_argument("plans", help="comma-separated plans whose triton rows to adopt")
    parser.add_argument("--setting", required=True, help="where the rows come from and why they stand for the defaults")
    parser.add_argument("--results", default="benchmarks/results")
    parser.add_argument("--note", default=None, help="replace the results' note (the line under the table's title)")
    args = parser.parse_args(argv)
    out = Path(args.results)
    results = json.loads((out / "kernels.json").read_text())
    adopt(results, json.loads(Path(args.variants_json).read_text()), args.variant, args.plans.split(","), args.setting)
    if args.note is not None:
        results["note"] = args.note
    bench._write(results, out)


if __name__ == "__main__":
    main()
