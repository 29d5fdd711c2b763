"""The search spec's `scheduler:` as a Ray Tune scheduler, through Ray's public API.

`scheduler: {type: asha, metric: token_acc@16, mode: max, grace_steps: 200, reduction_factor: 3}`
becomes `ray.tune.schedulers.ASHAScheduler` on the training steps each result stands at
(`step`: the validation's step, counted over the trial's tasks one after the other). Its
`max_t` is one step past a trial's whole budget, so that ASHA never stops a trial at its
last validation, before it is evaluated: only a trial behind its rung is stopped, and it
is recorded `stopped` with its last validation's metrics. ASHA watches one metric;
Optuna's multi-objective search ignores the results reported while trials train and
learns only from finished trials.
"""

from __future__ import annotations

from typing import Any

from archspec.search.space import SearchSpec
from archspec.search.trial import STEP_KEY


def make_scheduler(spec: SearchSpec) -> Any:
    """Ray's scheduler for `spec.scheduler`, or None (Ray's default: trials run to their end)."""
    if spec.scheduler is None:
        return None
    from ray.tune.schedulers import ASHAScheduler

    s = spec.scheduler
    return ASHAScheduler(
        time_attr=STEP_KEY, metric=s.metric, mode=s.mode, grace_period=s.grace_steps,
        reduction_factor=s.reduction_factor, max_t=spec.budget.steps * len(spec.tasks) + 1,
    )


def scheduler_name(spec: SearchSpec) -> str:
    """How a stopped trial's reason names what stopped it."""
    return "ASHA scheduler" if spec.scheduler is not None and spec.scheduler.type == "asha" else "scheduler"
