"""The search on one GPU through Ray Tune: trials per hour when several trials share it,
GPU utilization, Ray's overhead per trial, and a `kill -9` of the driver mid-search.

    python benchmarks/search_gpu.py [--budget-s S] [--levels 1,2,4,8] [--parts levels,oom,kill]
                                    [--no-warm] [--merge] [--out DIR] [--smoke]

Each level runs `specs/search/gpu-small.yaml` (eight grid points, a fixed number of steps
each) as `archspec search` in its own process, with `resources.gpu = 1/c` and
`resources.concurrent = c`, into a fresh run directory under `runs/bench-search/`. A
search has many more trials than run at once, so each worker trains several: level `c`
asks for `TRIALS_PER_WORKER * c` trials (at least the eight), the grid repeated as often
as that needs with another `model.norm_eps` per copy (a field that changes no cost).
Per level it reports:

- trials per hour: trials trained / (last trial's end - first trial's placement), and the
  speed-up over one at a time (level 1);
- GPU utilization: `nvidia-smi` sampled every second while the search runs (mean, max);
- Ray's overhead per trial: the trial's span as the driver sees it (Ray took it ->
  Ray heard it ended: `trial_times.json`) minus its worker's own span (`result.json`:
  building, training, evaluating), as a fraction of the former; and, beside it, the
  worker's time outside training (its span minus the trainer's `train.seconds`);
- Ray's seconds per trial split by worker: a trial whose worker is new pays the process
  start (imports, CUDA context); one that reuses its worker (`reuse_actors`) does not.
  The overhead is given as the mean over a level's trials (the start paid once per
  worker, spread over its trials) and the median (a reused worker's).

Before the levels, an unmeasured warm-up runs every grid point for a few steps, so that
Triton compiles their kernels into the shared cache (`.triton-cache/`) and the first
level (one at a time) is not charged for compiling. The part `oom` runs four trials at
once on a sixteenth of the GPU each, one of them too large for its share: it must be
recorded failed (`out of memory`, with its peak) while the other three train. The part
`kill`: the eight grid points, four at once, are killed with SIGKILL once two trials
have finished while others run (and others wait), resumed with `archspec search
--resume`, and every trial recorded before the kill must still be there, unchanged, when
the resumed search has trained all eight.

A level that does not finish within the budget left is stopped and reported from what it
finished (a rate stays a rate). `--merge` keeps an earlier JSON's levels and parts not
run now, so the benchmark can be split over several calls (`--levels 1,2 --parts
levels`, then `--levels 4,8 --parts levels,oom --merge`, then `--parts kill --merge`).
Results: `DIR/search_gpu.json` (machine, torch / triton / ray versions, commit, levels,
the out-of-memory trials, the kill test) and `DIR/search_gpu.md`, written atomically
after every part. `--smoke` runs a tiny CPU version (levels 1 and 2, two trials of a few
steps on S3, and the kill; the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from common import ROOT, machine, write_results

SPEC = ROOT / "specs" / "search" / "gpu-small.yaml"
RUNS = ROOT / "runs" / "bench-search"
NAME = "search_gpu"
WARM_STEPS = 10  # steps of each grid point in the unmeasured warm-up: enough to compile every kernel
OOM_STEPS = 200
KILL_SHARES = 2  # the kill part's time against one level's: a search and its resume
TRIALS_PER_WORKER = 4  # a level's trials per worker, as in a search of many more trials than run at once
# One norm_eps per copy of the grid: distinct points (a search trains no point twice) of equal work.
COPY_NORM_EPS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-7, 1e-8, 1e-9, 1e-10)
# The smoke: S3 at CPU size, a few steps, on the CPU (Ray still places and runs every trial).
SMOKE = {"task": {"name": "s3", "preset": "cpu", "options": {"train_len": 8, "eval_size": 64}},
         "objectives": [{"token_acc@16": "max"}, {"state_bytes": "min"}],
         "budget": {"trials": 2, "steps": 4}, "train": {"batch_size": 8, "eval_every": 2, "target": 0, "save_weights": False,
                                                        "measure_throughput": False}}


# ----------------------------------------------------------------------------- the searches


def level_spec(c: int, *, smoke: bool, trials: int | None, folder: Path, name: str | None = None,
               edit: dict[str, Any] | None = None) -> Path:
    """gpu-small.yaml with `c` trials at once on a share of 1/c of the GPU (CPU in the smoke);
    `edit` replaces top-level sections after that."""
    data = yaml.safe_load(SPEC.read_text())
    data["base"] = str((SPEC.parent / data["base"]).resolve())
    if smoke:
        data.update(SMOKE)
        data["space"] = {"mixer.transition.n_h": {"choices": [1, 2, 3]}}
        data["resources"] = {"cpu": 1, "gpu": 0.0, "concurrent": c}
    else:
        data["resources"] = {"cpu": 1, "gpu": round(1 / c, 4), "concurrent": c}
    if trials is not None:
        data["budget"] = {**data["budget"], "trials": trials}
    data.update(edit or {})
    path = folder / f"{name or f'gpu-small-c{c}'}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def search_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "archspec.search.cli", "search", *args, "--no-live"]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TRITON_CACHE_DIR", str(ROOT / ".triton-cache"))  # compiled kernels reused across trials and runs
    return env


class GpuSampler:
    """`nvidia-smi` every second in a thread: GPU utilization (%) and memory used (MiB)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self.note: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=5, check=True).stdout
                util, mem = (float(x) for x in out.strip().split(",")[:2])
                self.samples.append((util, mem))
            except (OSError, subprocess.SubprocessError, ValueError) as exc:
                self.note = f"not measured: nvidia-smi {type(exc).__name__}"
                return
            self._stop.wait(1.0)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {"note": self.note or "not measured"}
        util = [u for u, _ in self.samples]
        return {"util_mean_pct": statistics.fmean(util), "util_max_pct": max(util),
                "mem_max_mib": max(m for _, m in self.samples), "samples": len(util)}


def run_search(args: list[str], timeout_s: float) -> tuple[float, str]:
    """Run `archspec search ...` to its end or for `timeout_s`; returns (wall s, how it ended)."""
    started = time.time()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(search_command(*args), cwd=ROOT, env=environment(), stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=max(1.0, timeout_s))
            ended = "finished" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # the search stops its trials and Ray on Ctrl-C
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            ended = "cut by the budget"
        if ended.startswith("exit"):
            log.seek(0)
            ended += ": " + log.read().decode(errors="replace")[-600:]
    return time.time() - started, ended


def measure(run_dir: Path) -> dict[str, Any]:
    """Trials per hour and Ray's overhead per trial, from the run directory."""
    from archspec.search.rundir import TRAINED_STATUSES, RunDir
    from archspec.search.timing import read_trial_times

    run = RunDir(run_dir)
    records = [r for r in run.read_trials() if r.status in TRAINED_STATUSES]
    times = read_trial_times(run.ray_dir)
    out: dict[str, Any] = {"trials": len(records), "statuses": sorted({r.status for r in records})}
    if not records:
        return out
    begin = min(times.get(r.number, {}).get("added_at", r.started_at) for r in records)
    end = max(times.get(r.number, {}).get("finished_at", r.finished_at) for r in records)
    out["window_s"] = end - begin
    out["trials_per_hour"] = len(records) / out["window_s"] * 3600 if out["window_s"] > 0 else None
    overhead, outside, spans, trains = [], [], [], []
    for record in records:
        t = times.get(record.number, {})
        if "added_at" in t and "finished_at" in t and record.duration_s is not None:
            span = t["finished_at"] - t["added_at"]
            spans.append(span)
            overhead.append((span - record.duration_s) / span)
        seconds = sum(_train_seconds(run.trial_dir(record.number) / task) for task in _task_dirs(run.trial_dir(record.number)))
        if record.duration_s and seconds:
            trains.append(seconds)
            outside.append((record.duration_s - seconds) / record.duration_s)
    out.update(worker_costs(records, times))
    if overhead:
        out["ray_overhead_fraction"] = {"mean": statistics.fmean(overhead), "median": statistics.median(overhead),
                                        "max": max(overhead)}
        out["trial_span_s_median"] = statistics.median(spans)
    if outside:
        out["worker_outside_training_fraction"] = {"median": statistics.median(outside), "max": max(outside)}
        out["train_s_median"] = statistics.median(trains)
    return out


def worker_costs(records: list[Any], times: dict[int, dict[str, float]]) -> dict[str, Any]:
    """Ray's seconds per trial, split by whether the trial's worker was new (Ray started a
    process, which imported torch and archspec) or had trained a trial before (reused):
    placing and starting it, the worker's way into the trial function, and carrying the
    result back. The first trial of each worker pays the start; a search of many trials
    per worker pays it once per worker."""
    seen: set[int | None] = set()
    fresh: list[float] = []
    reused: list[float] = []
    for record in sorted(records, key=lambda r: r.started_at or 0.0):
        t = times.get(record.number, {})
        if record.started_at is None or record.finished_at is None or not {"added_at", "started_at", "finished_at"} <= t.keys():
            continue
        seconds = (t["started_at"] - t["added_at"]) + (record.started_at - t["started_at"]) + (t["finished_at"] - record.finished_at)
        (reused if record.pid in seen else fresh).append(seconds)
        seen.add(record.pid)
    out: dict[str, Any] = {}
    if fresh:
        out["ray_s_new_worker"] = {"median": statistics.median(fresh), "trials": len(fresh)}
    if reused:
        out["ray_s_reused_worker"] = {"median": statistics.median(reused), "trials": len(reused)}
    return out


def _task_dirs(trial_dir: Path) -> list[str]:
    return [p.name for p in trial_dir.iterdir() if p.is_dir()] if trial_dir.is_dir() else []


def _train_seconds(task_dir: Path) -> float:
    try:
        return float(json.loads((task_dir / "metrics.json").read_text())["train"]["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def level_search(c: int, *, smoke: bool, folder: Path) -> Path:
    """The search of level `c`: the grid, repeated (one `model.norm_eps` per copy) until it
    holds `TRIALS_PER_WORKER` trials for each of the `c` workers; the smoke stays at its two."""
    base = yaml.safe_load(level_spec(c, smoke=smoke, trials=None, folder=folder).read_text())
    points = base["budget"]["trials"]  # the grid's points
    copies = 1 if smoke else min(-(-TRIALS_PER_WORKER * c // points), len(COPY_NORM_EPS))
    edit = {"space": {**base["space"], "model.norm_eps": {"choices": list(COPY_NORM_EPS[:copies])}}} if copies > 1 else None
    return level_spec(c, smoke=smoke, trials=points * copies, folder=folder, edit=edit)


def run_level(c: int, *, smoke: bool, timeout_s: float, folder: Path) -> dict[str, Any]:
    out = RUNS / f"c{c}"
    shutil.rmtree(out, ignore_errors=True)
    spec = level_search(c, smoke=smoke, folder=folder)
    with GpuSampler() as gpu:
        wall, ended = run_search([str(spec), "--out", str(out)], timeout_s)
    return {"concurrent": c, "gpu_share": 1 / c if not smoke else 0.0, "wall_s": wall, "ended": ended,
            "gpu": gpu.summary(), **measure(out)}


def warm_up(c: int, *, smoke: bool, timeout_s: float, folder: Path) -> dict[str, Any]:
    """Every grid point for a few steps, `c` at once, unmeasured: Triton compiles each
    point's kernels into the shared cache here, so that no measured level (the first, one
    at a time, above all) pays for compiling."""
    base = yaml.safe_load(level_spec(c, smoke=smoke, trials=None, folder=folder).read_text())
    edit = {"budget": {**base["budget"], "steps": WARM_STEPS},
            "train": {**base["train"], "eval_every": WARM_STEPS}}
    spec = level_spec(c, smoke=smoke, trials=None, folder=folder, name="warm", edit=edit)
    out = RUNS / "warm"
    shutil.rmtree(out, ignore_errors=True)
    wall, ended = run_search([str(spec), "--out", str(out)], timeout_s)
    return {"concurrent": c, "steps": WARM_STEPS, "wall_s": wall, "ended": ended.splitlines()[0][:200]}


def out_of_memory(*, smoke: bool, timeout_s: float, folder: Path) -> dict[str, Any]:
    """Four trials at once on a sixteenth of the GPU each, one of them (d_model 4096, four
    layers: about 0.6 B parameters, some 10 GB of weights, gradients and AdamW state) too
    large for its share: it must be recorded failed, `out of memory` with its peak, and the
    other three must train. The smoke (no GPU share to outgrow) only runs the four."""
    from archspec.search.rundir import RunDir

    widths = [64, 128] if smoke else [256, 4096]
    edit: dict[str, Any] = {"space": {"model.d_model": {"choices": widths}, "model.layers": {"choices": [1, 4]}},
                            "budget": {"trials": 4, "steps": 4 if smoke else OOM_STEPS, "time_per_trial": 300}}
    if not smoke:
        edit["resources"] = {"cpu": 1, "gpu": 1 / 16, "concurrent": 4}
    spec = level_spec(4, smoke=smoke, trials=None, folder=folder, name="oom", edit=edit)
    out = RUNS / "oom"
    shutil.rmtree(out, ignore_errors=True)
    wall, ended = run_search([str(spec), "--out", str(out)], timeout_s)
    trials = [{"overrides": r.overrides, "status": r.status, "reason": (r.reason or "")[:300]}
              for r in sorted(RunDir(out).read_trials(), key=lambda r: r.number)]
    return {"wall_s": wall, "ended": ended.splitlines()[0][:200], "trials": trials}


# ----------------------------------------------------------------------------- kill -9


def kill_and_resume(c: int, *, smoke: bool, timeout_s: float, folder: Path, finished_before_kill: int = 2) -> dict[str, Any]:
    """SIGKILL the driver once `finished_before_kill` trials ended while another runs,
    resume, compare."""
    from archspec.search.rundir import TRAINED_STATUSES, RunDir

    out = RUNS / "kill"
    shutil.rmtree(out, ignore_errors=True)
    base_trials = yaml.safe_load(level_spec(c, smoke=smoke, trials=None, folder=folder).read_text())["budget"]["trials"]
    # The grid holds `base_trials` points: a search of more would end when they run out.
    trials = min(base_trials + 1, 3) if smoke else base_trials
    spec = level_spec(c, smoke=smoke, trials=trials, folder=folder)
    run = RunDir(out)
    started = time.time()
    proc = subprocess.Popen(search_command(str(spec), "--out", str(out)), cwd=ROOT, env=environment(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    before: dict[int, Any] = {}
    running: list[int] = []
    while time.time() - started < timeout_s / 2 and proc.poll() is None:
        with_records = run.read_trials() if run.trials_dir.is_dir() else []
        done = [r for r in with_records if r.status in TRAINED_STATUSES]
        running = sorted(r.number for r in with_records if r.status is None)
        if len(done) >= finished_before_kill and running:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            # A trial running at the kill may still record its end before its worker goes:
            # what was running is this snapshot's, what is kept is what the disk holds now.
            before = {r.number: r for r in run.read_trials() if r.status is not None}
            break
        time.sleep(0.2)
    result: dict[str, Any] = {"concurrent": c, "trials": trials}
    if not before:
        proc.kill()
        proc.wait()
        result["note"] = (f"the search ended or ran out of time before {finished_before_kill} trial(s) finished while "
                          "another ran; nothing was killed")
        return result
    result["finished_at_kill"] = sorted(before)
    result["running_at_kill"] = running
    wall, ended = run_search(["--resume", "--out", str(out)], timeout_s - (time.time() - started))
    after = {r.number: r for r in run.read_trials()}
    lost = [n for n, r in before.items() if n not in after or after[n].status != r.status or after[n].metrics != r.metrics]
    trained = sum(r.status in TRAINED_STATUSES for r in after.values())
    result.update(resume_wall_s=wall, resume_ended=ended, lost=lost, trained_after_resume=trained,
                  interrupted=sorted(n for n, r in after.items() if r.status == "interrupted"),
                  ok=not lost and trained >= trials)
    return result


# ----------------------------------------------------------------------------- report


def _seconds(cost: dict[str, Any] | None) -> str:
    return "-" if not cost else f"{cost['median']:.2f} s ({cost['trials']} trials)"


def table(results: dict[str, Any]) -> str:
    lines = [f"# search on one GPU ({results['machine'].get('device', 'CPU')}, ray {results['machine'].get('ray')})", "",
             "| at once | trials | trials/h | speed-up | GPU util % (mean/max) | Ray overhead (mean / median) | worker outside training | ended |",
             "|---|---|---|---|---|---|---|---|"]
    levels = sorted(results["levels"].values(), key=lambda r: r["concurrent"])
    one = next((r.get("trials_per_hour") for r in levels if r["concurrent"] == 1), None)
    for r in levels:
        rate = r.get("trials_per_hour")
        speed = f"{rate / one:.2f}x" if rate and one else "-"
        gpu = r.get("gpu", {})
        util = f"{gpu['util_mean_pct']:.0f} / {gpu['util_max_pct']:.0f}" if "util_mean_pct" in gpu else gpu.get("note", "-")
        fraction = r.get("ray_overhead_fraction", {})
        over = (f"{fraction['mean']:.1%} / {fraction['median']:.1%}" if "mean" in fraction
                else f"{fraction['median']:.1%} (median)" if "median" in fraction else "-")
        outside = r.get("worker_outside_training_fraction", {}).get("median")
        lines.append(f"| {r['concurrent']} | {r.get('trials', 0)} | {rate:.0f} | {speed} | {util} | "
                     f"{over} | {'-' if outside is None else f'{outside:.1%}'} | "
                     f"{r['ended'].splitlines()[0][:60]} |" if rate else
                     f"| {r['concurrent']} | {r.get('trials', 0)} | - | - | {util} | - | - | {r['ended'].splitlines()[0][:60]} |")
    split = [(r["concurrent"], r.get("ray_s_new_worker"), r.get("ray_s_reused_worker")) for r in levels]
    if any(new or reused for _, new, reused in split):
        lines += ["", "Ray's seconds per trial (placing, starting and reaching the worker, carrying the result back), median:", ""]
        lines += [f"- {c} at once: new worker {_seconds(new)}, reused worker {_seconds(reused)}" for c, new, reused in split]
    warm = results.get("warm")
    if warm:
        lines += ["", f"warm-up (unmeasured, {warm['steps']} steps per grid point, {warm['concurrent']} at once): "
                      f"{warm['wall_s']:.0f} s, {warm['ended']}"]
    oom = results.get("oom")
    if oom:
        lines += ["", "one trial too large for its sixteenth of the GPU, four at once:", ""]
        lines += [f"- {t['overrides']}: {t['status']}{': ' + t['reason'] if t['reason'] else ''}" for t in oom["trials"]]
        if not oom["trials"]:
            lines.append(f"- no trial recorded ({oom['ended']})")
    kill = results.get("kill")
    if kill:
        lines += ["", "kill -9 of the driver: " + (
            kill.get("note") or f"{len(kill['finished_at_kill'])} trials finished and {len(kill['running_at_kill'])} running at the "
            f"kill; after --resume {kill['trained_after_resume']}/{kill['trials']} trained, lost {kill['lost'] or 'none'} "
            f"({'ok' if kill['ok'] else 'FAILED'})")]
    return "\n".join(lines) + "\n"


PARTS = ("levels", "oom", "kill")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole run")
    ap.add_argument("--levels", default=None, help="trials at once, comma-separated (default 1,2,4,8; smoke 1,2)")
    ap.add_argument("--parts", default=None,
                    help=f"what to run, comma-separated, of {','.join(PARTS)} (default all; smoke levels,kill)")
    ap.add_argument("--no-warm", action="store_true", help="leave out the unmeasured warm-up before the levels")
    ap.add_argument("--merge", action="store_true", help="keep an earlier JSON's levels and parts that are not run now")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--smoke", action="store_true", help="tiny, on the CPU")
    args = ap.parse_args(argv)
    deadline = time.time() + args.budget_s
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke on the CPU", file=sys.stderr)
        return 2
    parts = [p for p in (args.parts or ("levels,kill" if args.smoke else ",".join(PARTS))).split(",") if p]
    if not parts or any(p not in PARTS for p in parts):
        print(f"--parts takes some of {','.join(PARTS)} separated by commas, got {args.parts!r}", file=sys.stderr)
        return 2
    try:
        levels = [int(x) for x in (args.levels or ("1,2" if args.smoke else "1,2,4,8")).split(",")] if "levels" in parts else []
        if any(c < 1 for c in levels):
            raise ValueError
    except ValueError:
        print(f"--levels takes whole numbers >= 1 separated by commas, got {args.levels!r}", file=sys.stderr)
        return 2
    import ray

    info = machine()

    def stamp(part: dict[str, Any]) -> dict[str, Any]:
        """A part's result with the commit it ran at (--merge keeps parts of earlier runs)."""
        return {**part, "commit": info.get("commit")}

    info["ray"] = ray.__version__
    results: dict[str, Any] = {"machine": info, "spec": str(SPEC.relative_to(ROOT)), "smoke": args.smoke, "levels": {}}
    previous = args.out / f"{NAME}.json"
    if args.merge and previous.is_file():
        old = json.loads(previous.read_text())
        results["levels"] = {k: v for k, v in old.get("levels", {}).items() if int(k) not in levels}
        # The warm-up belongs to the levels it preceded: kept only when no level runs now.
        kept = [part for part in ("oom", "kill") if part not in parts] + ([] if "levels" in parts else ["warm"])
        results.update({part: old[part] for part in kept if part in old})
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        # Nothing compiles on the CPU (the interpreter runs kernels as Python): no warm-up there.
        if levels and not args.no_warm and not args.smoke:
            results["warm"] = stamp(warm_up(max(levels), smoke=args.smoke, timeout_s=(deadline - time.time()) / 4, folder=Path(folder)))
            print(f"warm-up: {results['warm']['wall_s']:.0f} s, {results['warm']['ended']}", flush=True)
        for index, c in enumerate(levels):
            left = deadline - time.time()
            if left < 30:
                print(f"budget spent: level {c} not run", file=sys.stderr)
                break
            # Each level needs a few trial lengths whatever its concurrency (a trial shares the
            # GPU, so more at once train no faster each): an equal share per level still to run,
            # the kill twice that (a search and its resume), the out-of-memory trials one.
            later = len(levels) - index + KILL_SHARES * ("kill" in parts) + ("oom" in parts)
            share = left / later
            results["levels"][str(c)] = stamp(run_level(c, smoke=args.smoke, timeout_s=share, folder=Path(folder)))
            write_results(args.out, NAME, results, table(results))
            print(next(line for line in table(results).splitlines() if line.startswith(f"| {c} |")), flush=True)
        if "oom" in parts and deadline - time.time() > 30:
            left = deadline - time.time()
            results["oom"] = stamp(out_of_memory(smoke=args.smoke, timeout_s=left / (1 + KILL_SHARES * ("kill" in parts)), folder=Path(folder)))
            write_results(args.out, NAME, results, table(results))
        if "kill" in parts and deadline - time.time() > 30:
            # Half the grid at once: at the kill some trials have finished, some run, some wait.
            c = 2 if args.smoke else 4
            results["kill"] = stamp(kill_and_resume(c, smoke=args.smoke, timeout_s=deadline - time.time(), folder=Path(folder),
                                                    finished_before_kill=1 if args.smoke else 2))
    write_results(args.out, NAME, results, table(results))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
