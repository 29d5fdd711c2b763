"""A cheap stand-in for the trainer: same signature, deterministic metrics in milliseconds.

Quality is a known function of the spec (more Householder factors and a [0, 2] beta
range help, as on state tracking), so tests can predict fronts. Behaviours for failure
tests are switched by the spec itself: `short_conv: 3` (or a `channel` gate) diverges,
`short_conv: 2` raises, `short_conv: 5` kills the worker process. `CHEAP_SLEEP` (seconds) slows every trial down and `CHEAP_LOG`
(a file) gets one line per call, for the kill-and-resume test. `CHEAP_MEET` makes calls
wait for each other (`_meet`), for the tests of trials that share a GPU.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class CheapResult:
    status: str
    metrics: dict = field(default_factory=dict)
    reason: str | None = None


def quality(spec) -> float:
    t = spec.mixer.transition
    beta_max = (t.beta_range or (0, 1))[1] if t.type != "diagonal" else 0
    return round(0.3 + 0.15 * t.n_h + 0.1 * beta_max + (0.05 if t.type == "householder" else 0.0), 6)


def _hold(log: Path) -> None:
    """`CHEAP_HOLD` (a file) and `CHEAP_HOLD_AFTER` (n): every call after the first n
    (by the lines in `CHEAP_LOG`) waits while that file exists, so a test can stop a search
    with exactly n trials finished, however slow the machine."""
    hold, after = os.environ.get("CHEAP_HOLD"), int(os.environ.get("CHEAP_HOLD_AFTER", "0"))
    if hold and len(log.read_text().split()) > after:
        while Path(hold).exists():
            time.sleep(0.1)


# How long a call waits at `CHEAP_MEET` for the others: far longer than Ray takes to start
# a trial on a loaded machine, so only trials that Ray does not run at once time out.
MEET_TIMEOUT_S = 120.0


def meet(folder: Path, name: str, expected: int, wait_s: float) -> int:
    """A rendezvous of trials: leave the file `name` in `folder` and wait until `expected`
    files are there, at most `wait_s`; returns how many were met (fewer: Ray did not run
    the trials together)."""
    folder.mkdir(exist_ok=True)
    (folder / name).touch()
    deadline = time.monotonic() + wait_s
    while (met := len(list(folder.iterdir()))) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return met


def _meet() -> None:
    """`CHEAP_MEET` (a folder) and `CHEAP_MEET_COUNT` (n): no call ends before n calls are
    running at once, however slow the machine; RuntimeError after `MEET_TIMEOUT_S`."""
    folder, expected = Path(os.environ["CHEAP_MEET"]), int(os.environ["CHEAP_MEET_COUNT"])
    if meet(folder, f"{os.getpid()}-{time.monotonic_ns()}", expected, MEET_TIMEOUT_S) < expected:
        raise RuntimeError(f"cheap_train: the other calls never came to {folder}")


def cheap_train(spec, task, *, steps, seed, device, out_dir=None, **options):
    from archspec.cost import estimate

    if os.environ.get("CHEAP_MEET"):
        _meet()
    if os.environ.get("CHEAP_LOG"):
        with open(os.environ["CHEAP_LOG"], "a") as log:
            log.write(f"{out_dir}\n")
        _hold(Path(os.environ["CHEAP_LOG"]))
    time.sleep(float(os.environ.get("CHEAP_SLEEP", "0")))
    if out_dir is not None:  # leave a trace, as the trainer does
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "calls.json").write_text(json.dumps({"steps": steps, "seed": seed, "device": device, "options": options}))
    if spec.mixer.short_conv == 2:
        raise RuntimeError("cheap_train was told to crash (short_conv: 2)")
    if spec.mixer.short_conv == 5:  # the whole worker process dies, as on a segfault or OOM kill
        os._exit(3)
    params = float(estimate(spec).params)
    if spec.mixer.resolved_gate == "channel" or spec.mixer.short_conv == 3:
        return CheapResult("diverged", {"token_acc@16": float("nan"), "params": params}, "loss became nan at step 3")
    return CheapResult("ok", {"token_acc@16": quality(spec), "params": params, "steps": float(steps)})


def cheap_train_reporting(spec, task, *, steps, seed, device, out_dir=None, on_validation=None, **options):
    """`cheap_train` that also reports a validation after every step (`token_acc@8`, the
    spec's quality), as the trainer does through `on_validation`; `short_conv: 6` runs
    out of GPU memory (torch.cuda.OutOfMemoryError) before the first step."""
    import torch

    if spec.mixer.short_conv == 6:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.8 GiB")
    for step in range(1, steps + 1):
        if on_validation is not None:
            on_validation(step, {"token_acc@8": quality(spec), "seq_acc@8": quality(spec) / 2})
    return cheap_train(spec, task, steps=steps, seed=seed, device=device, out_dir=out_dir, **options)
