"""The Optuna sampler behind each `sampler:` name of a search spec.

All four are seeded from the search spec, so the same spec proposes the same trials.
`grid` is a `RandomSampler` fed with every distinct grid point through the study's queue
(`study.enqueue_trial`, see `runner.py`): Optuna's own `GridSampler` takes the full
product of all parameters and, with conditional parameters, repeats each point.
"""

from __future__ import annotations

import warnings

import optuna

from archspec.search.space import SearchSpec


def runs_concurrently(spec: SearchSpec) -> bool:
    """Whether trials may train at once: unless `resources.concurrent` is 1, as many run
    as the machine or cluster can place."""
    return spec.resources.concurrent is None or spec.resources.concurrent > 1


def make_sampler(spec: SearchSpec) -> optuna.samplers.BaseSampler:
    trials = spec.budget.trials
    if spec.sampler == "tpe":
        with warnings.catch_warnings():
            # multivariate/group are marked experimental; they are what makes TPE model
            # conditional spaces jointly (the groups of fields that appear together).
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(
                seed=spec.seed,
                multivariate=True,
                group=True,
                n_startup_trials=max(2, min(10, trials // 4)),
                # Trials that train at once: each proposal treats the ones still running as
                # if they had scored badly, so that concurrent proposals spread out instead
                # of landing on the same promising point (Optuna's default changed across
                # versions; say it here).
                constant_liar=runs_concurrently(spec),
            )
    if spec.sampler == "nsga2":
        # A generation as large as Optuna's default (50) would leave a small budget with
        # no evolution at all: a fifth of the budget, at least 4.
        return optuna.samplers.NSGAIISampler(seed=spec.seed, population_size=max(4, min(50, trials // 5)))
    return optuna.samplers.RandomSampler(seed=spec.seed)
