"""Search specs and experiment files as kinds of file `archspec validate` and `archspec
schema` know (`archspec.spec.kinds`); the `archspec` command imports this module.

A search spec is recognised by the keys only it has (`base`, `space`, `objectives`, ...),
an experiment file by `runs` and `report`; anything else is read as a model spec.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from archspec.spec.kinds import FileKind, register_kind

SEARCH_KEYS = frozenset({"base", "space", "objectives", "constraints", "budget", "sampler", "resources"})
EXPERIMENT_KEYS = frozenset({"runs", "report", "seeds", "set", "description", "diagnostics"})


def _check_search(path: str, overrides: Iterable[str]) -> str:
    from archspec.search.space import describe_size, load_search_spec

    loaded = load_search_spec(path, list(overrides))
    spec = loaded.spec
    objectives = ", ".join(f"{o.metric} {'max' if o.maximise else 'min'}" for o in spec.objectives)
    tasks = ", ".join(t.name for t in spec.tasks)
    return (f"search spec {spec.name}: {len(spec.space)} searched fields, {describe_size(loaded)}; "
            f"{spec.sampler} sampler, tasks {tasks}; objectives {objectives}")


def _search_schema() -> dict[str, Any]:
    from archspec.search.space import search_spec_json_schema

    return search_spec_json_schema()


def _check_experiment(path: str, overrides: Iterable[str]) -> str:
    from archspec.search.experiments import load_experiment

    exp, _ = load_experiment(path, list(overrides))
    return (f"experiment {exp.name}: {len(exp.runs)} runs x {len(exp.seeds)} seed(s) on {exp.task.name} "
            f"(preset {exp.task.preset}); reports {', '.join(exp.report)}")


def _experiment_schema() -> dict[str, Any]:
    from archspec.search.experiments import experiment_json_schema

    return experiment_json_schema()


register_kind(FileKind(
    name="search", title="search spec", keys=SEARCH_KEYS,
    check=_check_search, schema=_search_schema, schema_file="search.schema.json",
))
register_kind(FileKind(
    name="experiment", title="experiment", keys=EXPERIMENT_KEYS,
    check=_check_experiment, schema=_experiment_schema, schema_file="experiment.schema.json",
))
