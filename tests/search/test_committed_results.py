"""The experiment results committed under specs/experiments/results/ (which README.md and
docs/tasks.md quote) against the code as it is: their cost columns must be what the cost
model and the built module give now. When the cost model changes, this fails until
`scripts/regenerate-results.sh --costs` is run (seconds, no training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import archspec
from archspec.cost import estimate
from archspec.search.experiments import COST_COLUMNS, Experiment
from archspec.search.tasks import get_task

REPO = Path(__file__).resolve().parents[2]
RESULTS = sorted((REPO / "specs" / "experiments" / "results").glob("*.json"))


def test_every_results_file_has_its_experiment_and_table():
    assert {p.stem for p in RESULTS} >= {"deltaproduct-s3", "osdn-mqar-twice", "osdn-mqar-twice-128"}
    for path in RESULTS:
        name = json.loads(path.read_text())["experiment"]["name"]
        assert (REPO / "specs" / "experiments" / f"{name}.yaml").is_file(), path
        assert path.with_suffix(".md").is_file(), path


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_cost_columns_match_the_code(path):
    payload = json.loads(path.read_text())
    exp = Experiment.model_validate(payload["experiment"])
    task = get_task(exp.task.name, exp.task.preset, **exp.task.options)
    for run in exp.runs:
        spec = archspec.load_spec(REPO / "specs" / "experiments" / run.spec,
                                  [*exp.set, *run.set, ("model.vocab_size", task.vocab_size)])
        plan = archspec.lower(spec)
        # Independent of the cost model for the parameters: count the built module's.
        params = sum(p.numel() for p in archspec.compile(spec).parameters())
        for seed, summary in payload["results"].get(run.name, {}).items():
            expected = estimate(plan, device=summary["device"]).metrics()  # the FLOPs of the path the run took
            assert set(expected) == set(COST_COLUMNS) and expected["params"] == params
            recorded = {name: summary["metrics"].get(name) for name in COST_COLUMNS}
            assert recorded == pytest.approx(expected), (
                f"{path.name}, {run.name}, seed {seed}: committed {recorded}, the code gives {expected}; "
                "run scripts/regenerate-results.sh --costs"
            )


def test_refreshing_the_costs_touches_only_the_cost_columns(tmp_path, capsys):
    from archspec.search.cli import main

    source = REPO / "specs" / "experiments" / "results" / "deltaproduct-s3.json"
    copy = tmp_path / "deltaproduct-s3.json"
    payload = json.loads(source.read_text())
    run = next(iter(payload["results"]))
    payload["results"][run]["0"]["metrics"]["flops_per_token"] = 1.0  # as if the cost model had changed
    copy.write_text(json.dumps(payload, indent=2) + "\n")
    (tmp_path / "deltaproduct-s3.md").write_text("stale\n")
    experiment = REPO / "specs" / "experiments" / "deltaproduct-s3.yaml"
    assert main(["experiment", str(experiment), "--costs-of", str(copy)]) == 0
    assert f"{copy}: 1 cost value(s) changed\n  {run}, seed 0: flops_per_token 1.0 -> " in capsys.readouterr().out
    assert json.loads(copy.read_text()) == json.loads(source.read_text())  # all else as it was
    assert (tmp_path / "deltaproduct-s3.md").read_text() == source.with_suffix(".md").read_text()
