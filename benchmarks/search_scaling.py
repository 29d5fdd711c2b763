"""How one search scales with the GPUs of a host: trials per hour at 1, 2, 4, 8 GPUs, and
a data-parallel trial's training throughput at 1..N GPUs against one GPU.

    python benchmarks/search_scaling.py [--gpus 1,2,4,8] [--rounds 3] [--steps 300] [--address HOST:PORT]
                                        [--ddp-batch-per-gpu 64] [--budget-s S] [--out DIR] [--smoke]

**Trials per hour.** For each GPU count k a Ray head is started that declares k GPUs
(`ray start --head --num-gpus k`, with `CUDA_VISIBLE_DEVICES` the first k GPUs: Ray's
GPUs are limited each time, as the README's commands do), and one search joins it with
`--address`: trials of one GPU each, `rounds x k` of them, so that every GPU trains
`rounds` trials one after another. The trials are alike on purpose (the search samples
only `model.norm_eps`, which costs nothing, with the random sampler), so that the
counts compare the same work: trials per hour = trials trained / (last trial's end -
first trial's start); Ray's start is reported apart (`search_s`). Efficiency = (trials
per hour at k) / (k x trials per hour at 1); the issue's target is >= 0.85. With
`--address HOST:PORT` the searches join that running cluster instead (several nodes:
the script cannot start their heads) and count k runs k trials at once
(`resources.concurrent`), i.e. keeps k of its GPUs busy.

**A data-parallel trial.** The trainer's `tokens_per_s` (the training step after
warm-up, each rank on its rows, summed) of one model (`DDP_MODEL`, on S5 at length 256)
trained by k processes over NCCL (`search/distributed.py`, as a `resources.gpu: k`
trial does), at `--ddp-batch-per-gpu` rows per GPU (the global batch grows with k: weak
scaling), against the plain trainer on one GPU. Efficiency = tokens/s at k / (k x one
GPU); the target is >= 0.9.

Kernels are compiled once before anything is timed (one warm-up trial per search
model), so that no count pays Triton's first compiles. `--budget-s` starts no count
whose estimated time (the last count's, scaled by the GPUs) would pass it. Results:
`DIR/search_scaling.json` (machine, versions, every count) and `DIR/search_scaling.md`,
written atomically after every count. The table is printed last.

`--smoke` runs a tiny version on the CPU (the test suite runs it): the Ray heads declare
GPUs that do not exist (trials then train on the CPU), the data-parallel ranks run over
gloo, the model is tiny and trains a few steps.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

from common import first_line, machine

ROOT = Path(__file__).resolve().parents[1]
RESULTS_NAME = "search_scaling"
TARGET_SEARCH, TARGET_DDP = 0.85, 0.9

# The model of the searches' trials and of the data-parallel trial on the GPUs: a gated
# DeltaNet of 8 layers at width 1024 (~100M parameters with the MLPs), what a search of
# this project trains; and a one-layer width-64 DeltaNet for --smoke.
SEARCH_MODEL = {"base": "specs/models/gated-deltanet.yaml", "model.d_model": 512, "model.layers": 4,
                "mixer.heads": 4, "mixer.head_dim": 128}
DDP_MODEL = {"base": "specs/models/gated-deltanet.yaml", "model.d_model": 1024, "model.layers": 8,
             "mixer.heads": 8, "mixer.head_dim": 128}
SMOKE_MODEL = {"base": "specs/search/bases/tiny-deltanet.yaml"}


def search_yaml(base: Path, trials: int, steps: int, gpu: float, cpu: float, smoke: bool) -> str:
    """A search of `trials` alike trials (only `model.norm_eps` is sampled) from `base`."""
    task = "{name: s3, options: {train_len: 8, eval_size: 32}}" if smoke else "{name: s5, preset: gpu, options: {eval_size: 256}}"
    objective = "token_acc@16" if smoke else "token_acc@256"
    return f"""\
# written by benchmarks/search_scaling.py
name: scaling
base: {base}
space:
  model.norm_eps: {{float: [1.0e-7, 1.0e-5], log: true}}
task: {task}
objectives: [{{{objective}: max}}]
budget: {{trials: {trials}, steps: {steps}}}
sampler: random
resources: {{cpu: {cpu:g}, gpu: {gpu:g}}}
train: {{target: 0, eval_every: {steps}}}
seed: 0
"""


# --------------------------------------------------------------------------- a Ray head


@contextlib.contextmanager
def ray_head(gpus: int, cpus: int, real_gpus: bool) -> Iterator[str]:
    """`ray start --head --num-gpus GPUS` on loopback (the first GPUS devices visible to it
    when they are real); yields its address; stops it."""
    from archspec.search.ray_head import local_ray_head

    with local_ray_head(cpus=cpus, gpus=gpus, pythonpath=ROOT, visible_gpus=real_gpus) as address:
        yield address


# --------------------------------------------------------------------------- trials per hour


def search_at(gpus: int, args: argparse.Namespace, folder: Path, log) -> dict[str, Any]:
    """One search on a head of `gpus` GPUs; its trials per hour."""
    from archspec.search.rundir import RunDir
    from archspec.search.runner import run_search
    from archspec.search.space import load_search_spec

    folder.mkdir(parents=True, exist_ok=True)
    base = folder / "base.yaml"  # the model at its size, resolved: the searches' base spec
    base.write_text(yaml.safe_dump(sized_spec(SMOKE_MODEL if args.smoke else SEARCH_MODEL)
                                   .model_dump(mode="json", exclude_none=True), sort_keys=False))
    path = folder / f"search-{gpus}.yaml"
    path.write_text(search_yaml(base, args.rounds * gpus, args.steps, 1, args.cpus_per_trial, args.smoke))
    loaded = load_search_spec(path)
    started = time.perf_counter()
    if args.address:  # a running cluster: k GPUs busy at most, as k trials of one GPU at once
        loaded = load_search_spec(path, [f"resources.concurrent={gpus}"])
        outcome = run_search(loaded, folder / f"run-{gpus}", address=args.address, live=False)
    else:
        with ray_head(gpus, max(1, int(gpus * args.cpus_per_trial)), real_gpus=not args.smoke) as address:
            outcome = run_search(loaded, folder / f"run-{gpus}", address=address, live=False)
    wall = time.perf_counter() - started
    records = [r for r in RunDir(folder / f"run-{gpus}").read_trials() if r.status in ("ok", "failed", "diverged")]
    window = max(r.finished_at for r in records) - min(r.started_at for r in records) if records else float("nan")
    row = {"gpus": gpus, "trials": len(records), "ok": sum(r.status == "ok" for r in records), "window_s": window,
           "search_s": wall, "trials_per_hour": len(records) * 3600 / window if records else 0.0,
           "mean_trial_s": sum(r.duration_s for r in records) / len(records) if records else float("nan"),
           "gpu_ids": sorted({g for r in records for g in r.placement.get("gpu_ids", [])}, key=int),
           "complete": outcome.complete}
    failed = [r.reason for r in records if r.status != "ok"]
    if failed:
        row["failures"] = failed[:3]
    log(f"{gpus} GPU(s): {row['trials']} trials in {window:.1f} s -> {row['trials_per_hour']:.0f} trials/h "
        f"(mean trial {row['mean_trial_s']:.1f} s; GPUs used {','.join(row['gpu_ids'])})")
    return row


# --------------------------------------------------------------------------- a data-parallel trial


def ddp_at(processes: int, args: argparse.Namespace, folder: Path, log) -> dict[str, Any]:
    """The trainer's tokens/s of one model trained by `processes` ranks (1: the plain
    trainer), each a fresh process."""
    from archspec.search.distributed import train_data_parallel
    from archspec.search.tasks import get_task
    from archspec.search.trainer import train

    model = SMOKE_MODEL if args.smoke else DDP_MODEL
    spec = sized_spec(model)
    task = get_task("s3", train_len=8, eval_size=32) if args.smoke else get_task("s5", "gpu", train_len=256, eval_size=64)
    batch = args.ddp_batch_per_gpu * processes
    kwargs = dict(steps=args.ddp_steps, seed=0, quiet=True, batch_size=batch, eval_every=args.ddp_steps, target=0,
                  save_weights=False)
    cuda = not args.smoke
    started = time.perf_counter()
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cuda:  # the ranks see the first `processes` GPUs, as a trial Ray gave them would
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(processes))
    try:  # one process: the plain trainer, in a fresh process as the ranks are
        result = train_data_parallel(train, spec, task, dict(kwargs, out_dir=None), processes, cuda=cuda, threads=1)
    finally:
        if previous is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous
    if result.status != "ok":
        raise RuntimeError(f"the data-parallel trial of {processes} ended {result.status}: {result.reason}")
    row = {"processes": processes, "global_batch": batch, "seq_len": task.train_len,
           "tokens_per_s": result.metrics["tokens_per_s"], "seconds": time.perf_counter() - started,
           "backend": "nccl" if cuda and processes > 1 else ("gloo" if processes > 1 else "-")}
    log(f"data-parallel x{processes}: {row['tokens_per_s']:,.0f} tokens/s at a global batch of {batch}")
    return row


def sized_spec(model: dict[str, Any]) -> Any:
    import archspec

    return archspec.load_spec(ROOT / model["base"], [(k, v) for k, v in model.items() if k != "base"])


# --------------------------------------------------------------------------- results


def efficiencies(rows: list[dict[str, Any]], count: str, rate: str) -> None:
    """Add `speedup` (against the row of count 1) and `efficiency` (speed-up / count)."""
    one = next((r[rate] for r in rows if r[count] == 1), None)
    for r in rows:
        r["speedup"] = r[rate] / one if one else None
        r["efficiency"] = r["speedup"] / r[count] if one else None


def markdown(record: dict[str, Any]) -> str:
    m = record["machine"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [
        "# One search across the GPUs of a host",
        "",
        f"{m.get('device', 'CPU (smoke: declared GPUs, gloo)')} x{m.get('gpus', 0)}, torch {m['torch']}, "
        f"Ray {m.get('ray')}, commit {m.get('commit') or '?'}, {m['date']}.",
        "",
        f"Trials per hour: {record['rounds']} alike trials per GPU (target: efficiency >= {TARGET_SEARCH}).",
        "",
        "| GPUs | trials | window s | trials/h | speed-up | efficiency | mean trial s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in record["search"]:
        lines.append(f"| {r['gpus']} | {r['trials']} | {r['window_s']:.1f} | {r['trials_per_hour']:.0f} | "
                     f"{fmt(r['speedup'], '.2f')} | {fmt(r['efficiency'], '.2f')} | {r['mean_trial_s']:.1f} |")
    lines += ["", f"A data-parallel trial: {record['ddp_batch_per_gpu']} rows per GPU "
              f"(target: efficiency >= {TARGET_DDP}).", "",
              "| processes | global batch | tokens/s | x one | efficiency |", "|---|---|---|---|---|"]
    for r in record["ddp"]:
        lines.append(f"| {r['processes']} | {r['global_batch']} | {r['tokens_per_s']:,.0f} | "
                     f"{fmt(r['speedup'], '.2f')} | {fmt(r['efficiency'], '.2f')} |")
    for name in ("skipped", "failed"):
        if record.get(name):
            lines += ["", f"{name.capitalize()}: " + "; ".join(map(str, record[name]))]
    return "\n".join(lines) + "\n"


def write(out: Path, record: dict[str, Any]) -> None:
    import common

    efficiencies(record["search"], "gpus", "trials_per_hour")
    efficiencies(record["ddp"], "processes", "tokens_per_s")
    out.mkdir(parents=True, exist_ok=True)
    common.write_results(out, RESULTS_NAME, record, markdown(record))


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default=None, help="GPU counts, comma-separated (default 1,2,4,8 up to the GPUs here; smoke 1,2)")
    ap.add_argument("--rounds", type=int, default=None, help="trials per GPU in each search (default 3; smoke 1)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per search trial (default 300; smoke 2)")
    ap.add_argument("--cpus-per-trial", type=float, default=None, help="CPUs each trial reserves (default 4; smoke 1)")
    ap.add_argument("--ddp-batch-per-gpu", type=int, default=None, help="rows per GPU of the data-parallel trial (default 64; smoke 2)")
    ap.add_argument("--ddp-steps", type=int, default=None, help="steps the data-parallel trial trains after timing (default 2)")
    ap.add_argument("--address", default=None,
                    help="a running Ray cluster (HOST:PORT) to measure on, each count as that many trials at once, "
                         "instead of a head of that many GPUs started per count (a cluster of several nodes)")
    ap.add_argument("--skip", choices=["search", "ddp"], default=None, help="measure only the other part")
    ap.add_argument("--budget-s", type=float, default=None, help="start no count whose estimated time would pass this")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    ap.add_argument("--smoke", action="store_true", help="tiny, on the CPU: declared GPUs, gloo")
    args = ap.parse_args(argv)
    defaults = dict(rounds=(1, 3), steps=(2, 300), cpus_per_trial=(1, 4), ddp_batch_per_gpu=(2, 64), ddp_steps=(1, 2))
    for name, (smoke, gpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else gpu)

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not args.smoke and available == 0:
        print("no CUDA device: run with --smoke on the CPU", file=sys.stderr)
        return 2
    try:
        counts = [int(c) for c in (args.gpus or ("1,2" if args.smoke else "1,2,4,8")).split(",")]
    except ValueError:
        print(f"--gpus {args.gpus}: give whole numbers, e.g. 1,2,4,8", file=sys.stderr)
        return 2
    if not args.smoke and not args.address:
        if args.gpus and max(counts) > available:
            print(f"--gpus {args.gpus}: this host has {available} GPU(s)", file=sys.stderr)
            return 2
        counts = [c for c in counts if c <= available]
    if any(c < 1 for c in counts):
        print("--gpus: counts must be >= 1", file=sys.stderr)
        return 2

    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {msg}", flush=True)

    try:
        import ray
    except ImportError:  # the data-parallel part needs no Ray
        if args.skip != "search":
            print("Ray is not installed: install it, or measure only the data-parallel trial (--skip search)", file=sys.stderr)
            return 2
        ray = None
    info = machine()
    info.update(gpus=available, ray=ray.__version__ if ray else None,
                nccl=".".join(map(str, torch.cuda.nccl.version())) if available else None)
    record: dict[str, Any] = {"machine": info, "smoke": args.smoke,
                              "limited_by": "concurrent trials on --address" if args.address else "a Ray head per count", "rounds": args.rounds, "steps": args.steps,
                              "cpus_per_trial": args.cpus_per_trial, "ddp_batch_per_gpu": args.ddp_batch_per_gpu,
                              "search_model": SMOKE_MODEL if args.smoke else SEARCH_MODEL,
                              "ddp_model": SMOKE_MODEL if args.smoke else DDP_MODEL,
                              "search": [], "ddp": [], "skipped": [], "failed": []}
    out = Path(args.out)
    parts = [("search", search_at, "search"), ("ddp", ddp_at, "ddp")]
    with tempfile.TemporaryDirectory(prefix="search-scaling-") as tmp:
        folder = Path(tmp)
        if not args.smoke and args.skip != "search":
            warm_up(args, folder, log)
        for name, measure, key in parts:
            if args.skip == name:
                continue
            last: tuple[int, float] | None = None
            # the data-parallel trial is always compared with one GPU: that count comes first
            for count in sorted({1, *counts}) if name == "ddp" else counts:
                spent = time.perf_counter() - started
                if args.budget_s is not None and last is not None and spent + last[1] * count / last[0] > args.budget_s:
                    record["skipped"].append(f"{name} at {count}")
                    log(f"budget: {spent:.0f} s spent, skipping {name} at {count}")
                    continue
                began = time.perf_counter()
                try:
                    record[key].append(measure(count, args, folder, log))
                except Exception as exc:  # one count failing (out of memory, a lost node) must not lose the rest
                    record["failed"].append(f"{name} at {count}: {first_line(exc)}")
                    log(f"{name} at {count} failed: {first_line(exc)}\n{traceback.format_exc()}")
                last = (count, time.perf_counter() - began)
                write(out, record)
    write(out, record)
    print(markdown(record))
    log(f"wrote {out / (RESULTS_NAME + '.json')} and {out / (RESULTS_NAME + '.md')}")
    return 1 if record["failed"] else 0


def warm_up(args: argparse.Namespace, folder: Path, log) -> None:
    """Compile the models' kernels into Triton's disk cache before anything is timed."""
    saved = (args.rounds, args.steps)
    args.rounds, args.steps = 1, 2
    try:
        search_at(1, args, folder / "warm-up", lambda msg: log(f"warm-up: {msg}"))
        ddp_at(1, args, folder, lambda msg: log(f"warm-up: {msg}"))
    finally:
        args.rounds, args.steps = saved


if __name__ == "__main__":
    sys.exit(main())
