"""Ray Tune's `OptunaSearch`, made to reject proposals before training and to record failures.

Two things the stock searcher does not do, and a search of architectures needs:

- **Reject before training.** Each proposal is checked in the driver (spec valid, cost
  constraints hold, not a repeat of a trial trained or training). A rejected proposal
  is told to the study (failed; a repeat as pruned), a refused one is recorded in the
  run directory, and the searcher asks for another, so a rejected spec costs neither
  a Ray worker nor the trial budget.
- **A misspelt objective** makes the first trial fail with the metric names it did
  report; the searcher then stops instead of failing every trial of the budget.
- **Failed trials.** With several objectives, the stock `on_trial_complete` tells the
  study a list of `None`s for a trial that reported no values; Optuna refuses that and
  the trial stays RUNNING forever. Here a trial without finite objective values is told
  as FAIL, with its status and reason as user attributes (visible in optuna-dashboard).

It reaches into `OptunaSearch`'s `_ot_trials`, `_ot_study` and `_completed_trials`
(Ray 2.60); `tests/search/test_runner.py` breaks if they change.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch

from archspec.search.rundir import OK
from archspec.search.trial import MISSING_OBJECTIVES, record_from_result

# Proposals rejected in a row before the search gives up: the space is then (almost)
# entirely outside the constraints, and the user should hear so instead of waiting.
MAX_REJECTIONS_IN_A_ROW = 500
DUPLICATE = "duplicate"  # the status of a proposal that repeats a trial trained or training


@dataclass(frozen=True)
class Rejection:
    """Why a proposal is not trained: `status` is `skipped`, `invalid` or `duplicate`."""

    status: str
    reason: str


class ArchspecOptunaSearch(OptunaSearch):
    """`OptunaSearch` in define-by-run, multi-objective mode, with a driver-side precheck.

    `define_by_run(trial) -> {"trial_number": n, "overrides": {...}}` samples a proposal;
    `reject(number, overrides) -> Rejection | None` decides whether it may train (and
    records a refused spec or a broken constraint in the run directory).

    Repeats: a model-based sampler that is sure of its best points proposes them again
    and again (TPE in a small discrete space did so hundreds of times in a row). A repeat
    is told to the study as PRUNED (samplers leave it out of their model, it never ran)
    and the next proposal of the same round is drawn at random, which finds the points
    not tried yet; when even those draws only repeat, the space is exhausted.
    """

    def __init__(
        self,
        *,
        define_by_run: Callable[[optuna.Trial], dict[str, Any]],
        reject: Callable[[int, dict[str, Any]], Rejection | None],
        metric: list[str],
        mode: list[str],
        sampler: optuna.samplers.BaseSampler,
        storage: optuna.storages.BaseStorage,
        study_name: str,
        seed: int = 0,
    ):
        super().__init__(space=define_by_run, metric=metric, mode=mode, sampler=sampler, storage=storage, study_name=study_name)
        self._reject = reject
        self._explorer = optuna.samplers.RandomSampler(seed=seed)
        self.stopped_because: str | None = None
        self.exhausted = False  # stopped because every proposal repeated a known trial

    def suggest(self, trial_id: str) -> dict | str | None:
        if self.stopped_because:
            return Searcher.FINISHED
        repeats = 0
        explore = False
        for _ in range(MAX_REJECTIONS_IN_A_ROW):
            config = self._propose(trial_id, explore)
            ot_trial = self._ot_trials[trial_id]
            ot_trial.set_user_attr("overrides", config["overrides"])
            rejection = self._reject(config["trial_number"], config["overrides"])
            if rejection is None:
                return config
            ot_trial.set_user_attr("status", rejection.status)
            ot_trial.set_user_attr("reason", rejection.reason)
            explore = rejection.status == DUPLICATE
            repeats += explore
            self._ot_study.tell(ot_trial, state=TrialState.PRUNED if explore else TrialState.FAIL)
            del self._ot_trials[trial_id]  # the next round asks the study for a new trial
        self.exhausted = repeats == MAX_REJECTIONS_IN_A_ROW
        self.stopped_because = (
            f"the last {MAX_REJECTIONS_IN_A_ROW} proposals (most drawn at random) all repeated trials "
            "already trained or training: the space looks exhausted" if self.exhausted else
            f"{MAX_REJECTIONS_IN_A_ROW} proposals in a row were refused, broke a constraint or repeated a trial; "
            "loosen the constraints or widen the space (see the `skipped`/`invalid` trials)"
        )
        return Searcher.FINISHED

    def _propose(self, trial_id: str, explore: bool) -> dict:
        """One proposal from the study's sampler, or (`explore`) from the random one."""
        if not explore:
            return super().suggest(trial_id)
        sampler, self._ot_study.sampler = self._ot_study.sampler, self._explorer
        try:
            return super().suggest(trial_id)
        finally:
            self._ot_study.sampler = sampler

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id in self._completed_trials or trial_id not in self._ot_trials:
            return
        ot_trial = self._ot_trials[trial_id]
        values = [result.get(m) for m in self.metric] if result else []
        usable = bool(result) and result.get("status") == OK and all(
            isinstance(v, (int, float)) and math.isfinite(v) for v in values
        )
        if usable:
            ot_trial.set_user_attr("status", OK)
            self._ot_study.tell(ot_trial, values, state=TrialState.COMPLETE)
        else:
            record = record_from_result(result)
            ot_trial.set_user_attr("status", (result or {}).get("status") or "failed")
            ot_trial.set_user_attr("reason", (record and record.reason) or ("the trial's worker failed" if error else "no result"))
            self._ot_study.tell(ot_trial, state=TrialState.FAIL)
            if record and record.reason and record.reason.startswith(MISSING_OBJECTIVES):
                # Every architecture reports the same metric names on a task: do not spend
                # the budget on a misspelt objective.
                self.stopped_because = f"{record.reason}; fix `objectives:` in the search spec"
        self._completed_trials.add(trial_id)

    def save(self, checkpoint_path: str) -> None:
        """Nothing to save: the study (SQLite) and the run directory are the state, and
        `--resume` rebuilds the searcher from them rather than from a Ray checkpoint."""

    def restore(self, checkpoint_path: str) -> None:
        raise NotImplementedError("resume with `archspec search --resume`, which rebuilds the searcher from the study")
