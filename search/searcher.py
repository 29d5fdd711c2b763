"""The search's Ray Tune `Searcher`: Optuna's ask-and-tell, with proposals checked before
they train and failures recorded.

Ray Tune asks a `Searcher` for a configuration per trial (`suggest`) and tells it how the
trial ended (`on_trial_complete`); Optuna's `Study.ask` gives a trial to sample a
proposal into (define-by-run) and `Study.tell` records its values or its failure. This
class joins the two through their public interfaces only, and adds what a search of
architectures needs:

- **Reject before training.** Each proposal is checked in the driver (spec valid, cost
  constraints hold, not a repeat of a trial trained or training). A rejected proposal
  is told to the study (failed; a repeat as pruned), a refused one is recorded in the
  run directory, and the searcher asks for another, so a rejected spec costs neither
  a Ray worker nor the trial budget.
- **Repeats.** A model-based sampler that is sure of its best points proposes them again
  and again (TPE in a small discrete space did so hundreds of times in a row). A repeat
  is told as PRUNED (samplers leave it out of their model, it never ran) and the next
  proposal of the same round is asked from a second handle on the same study whose
  sampler is random, which finds the points not tried yet; when even those draws only
  repeat, the space is exhausted.
- **Failed trials.** A trial without finite values for every objective is told as FAIL,
  with its status and reason as user attributes (visible in optuna-dashboard).
- **Stopped trials.** A trial a scheduler (ASHA) stopped early ends on a result reported
  while it trained: it is told as PRUNED, Optuna's state for a trial ended early, with
  the status `stopped`.
- **A misspelt objective** is refused when the search spec loads, for the stock trainer;
  with a training function of one's own, the first trial that reports none of an
  objective stops the search instead of failing every trial of the budget.

The study, and the run directory beside it, are the state: `save` writes nothing and
`--resume` rebuilds the searcher from them (see `runner.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState
from ray.tune.search import Searcher

from archspec.search.rundir import OK, STOPPED
from archspec.search.trial import MISSING_OBJECTIVES, PROGRESS, record_from_result

# Proposals rejected in a row before the search gives up: the space is then (almost)
# entirely outside the constraints, and the user should hear so instead of waiting.
MAX_REJECTIONS_IN_A_ROW = 500
DUPLICATE = "duplicate"  # the status of a proposal that repeats a trial trained or training


@dataclass(frozen=True)
class Rejection:
    """Why a proposal is not trained: `status` is `skipped`, `invalid` or `duplicate`."""

    status: str
    reason: str


class ArchspecSearcher(Searcher):
    """Ray Tune's `Searcher` over an Optuna study, multi-objective, with a driver-side check.

    `study` is the search's study and `storage` the storage it was opened on (a second
    handle on it explores). `define_by_run(trial) -> {"trial_number": n, "overrides": {...}}` samples a proposal
    into an `optuna.Trial`; `reject(number, overrides) -> Rejection | None` decides
    whether it may train (and records a refused spec or a broken constraint in the run
    directory). `metric` and `mode` (`max`/`min`) name the objectives in the study's order.
    `place(config) -> {...}`, when given, adds what the trial's placement needs to an
    accepted proposal's config (its share of a GPU).
    """

    def __init__(
        self,
        *,
        study: optuna.Study,
        storage: optuna.storages.BaseStorage,
        define_by_run: Callable[[optuna.Trial], dict[str, Any]],
        reject: Callable[[int, dict[str, Any]], Rejection | None],
        metric: list[str],
        mode: list[str],
        seed: int = 0,
        place: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ):
        super().__init__(metric=metric, mode=mode)
        self.study = study
        # The same study (storage and name) seen through a random sampler: where a repeat
        # sends the next proposal.
        self.explorer = optuna.load_study(
            study_name=study.study_name, storage=storage, sampler=optuna.samplers.RandomSampler(seed=seed)
        )
        self._define_by_run = define_by_run
        self._reject = reject
        self._place = place
        self._running: dict[str, optuna.Trial] = {}  # Ray's trial id -> the Optuna trial it trains
        self.stopped_because: str | None = None
        self.exhausted = False  # stopped because every proposal repeated a known trial

    def suggest(self, trial_id: str) -> dict | str | None:
        if self.stopped_because:
            return Searcher.FINISHED
        repeats = 0
        explore = False
        for _ in range(MAX_REJECTIONS_IN_A_ROW):
            trial = (self.explorer if explore else self.study).ask()
            config = self._define_by_run(trial)
            trial.set_user_attr("overrides", config["overrides"])
            rejection = self._reject(config["trial_number"], config["overrides"])
            if rejection is None:
                self._running[trial_id] = trial
                return {**config, **self._place(config)} if self._place else config
            trial.set_user_attr("status", rejection.status)
            trial.set_user_attr("reason", rejection.reason)
            explore = rejection.status == DUPLICATE
            repeats += explore
            self.study.tell(trial.number, state=TrialState.PRUNED if explore else TrialState.FAIL)
        self.exhausted = repeats == MAX_REJECTIONS_IN_A_ROW
        self.stopped_because = (
            f"the last {MAX_REJECTIONS_IN_A_ROW} proposals (most drawn at random) all repeated trials "
            "already trained or training: the space looks exhausted" if self.exhausted else
            f"{MAX_REJECTIONS_IN_A_ROW} proposals in a row were refused, broke a constraint or repeated a trial; "
            "loosen the constraints or widen the space (see the `skipped`/`invalid` trials)"
        )
        return Searcher.FINISHED

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        trial = self._running.pop(trial_id, None)
        if trial is None:  # not one of ours, or already told
            return
        values = [result.get(m) for m in self.metric] if result else []
        usable = bool(result) and result.get("status") == OK and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
        )
        if usable:
            trial.set_user_attr("status", OK)
            self.study.tell(trial.number, values, state=TrialState.COMPLETE)
            return
        if result and result.get("status") == PROGRESS and not error:
            # Ended on a result reported while it trained: a scheduler stopped it.
            trial.set_user_attr("status", STOPPED)
            self.study.tell(trial.number, state=TrialState.PRUNED)
            return
        record = record_from_result(result)
        trial.set_user_attr("status", (result or {}).get("status") or "failed")
        trial.set_user_attr("reason", (record and record.reason) or ("the trial's worker failed" if error else "no result"))
        self.study.tell(trial.number, state=TrialState.FAIL)
        if record and record.reason and record.reason.startswith(MISSING_OBJECTIVES):
            # Every architecture reports the same metric names on a task: do not spend
            # the budget on an objective the training function never reports.
            self.stopped_because = f"{record.reason}; fix `objectives:` in the search spec"

    def save(self, checkpoint_path: str) -> None:
        """Nothing to save: the study (SQLite) and the run directory are the state, and
        `--resume` rebuilds the searcher from them rather than from a Ray checkpoint."""

    def restore(self, checkpoint_path: str) -> None:
        raise NotImplementedError("resume with `archspec search --resume`, which rebuilds the searcher from the study")
