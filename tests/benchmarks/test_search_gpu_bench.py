"""`benchmarks/search_gpu.py --smoke`: the GPU search benchmark end to end on the CPU (Ray
places every trial; a driver is killed with SIGKILL and resumed). About a minute: Ray
starts three times."""

from __future__ import annotations

import json

import pytest

from .test_gpu_scripts import benchmark_module

pytestmark = pytest.mark.ray  # starts Ray: runs on one xdist worker (tests/conftest.py)


@pytest.mark.slow
def test_smoke_measures_a_level_and_survives_a_kill(tmp_path):
    pytest.importorskip("ray")
    import ray

    from archspec.search.rundir import RunDir

    with benchmark_module("search_gpu") as bench:
        # The level's share of the budget is a third of it (the kill takes two): 200 s, which
        # a level of two trials needs only on a machine loaded to twice its cores.
        assert bench.main(["--smoke", "--levels", "2", "--out", str(tmp_path), "--budget-s", "600"]) == 0
        runs = bench.RUNS
    result = json.loads((tmp_path / "search_gpu.json").read_text())
    assert result["machine"]["ray"] == ray.__version__ and result["smoke"] is True
    level = result["levels"]["2"]
    assert level["ended"] == "finished" and level["trials"] == 2
    # The rate, again from the trial records alone (the driver's times only widen the window).
    records = RunDir(runs / "c2").read_trials()
    window = max(r.finished_at for r in records) - min(r.started_at for r in records)
    assert 0 < level["window_s"] and level["trials_per_hour"] <= 2 / window * 3600 * 1.0001
    assert 0 < level["ray_overhead_fraction"]["median"] < 1  # Ray's span holds the worker's
    assert 0 < level["worker_outside_training_fraction"]["median"] < 1
    kill = result["kill"]
    assert kill["ok"] and kill["lost"] == [] and kill["finished_at_kill"] and kill["running_at_kill"]
    assert kill["trained_after_resume"] == kill["trials"] == 3
    assert "| 2 | 2 |" in (tmp_path / "search_gpu.md").read_text()


def test_ray_seconds_are_split_between_new_and_reused_workers():
    """Two workers, three trials: the first trial of each worker paid its start (Ray's
    times to the worker's and back), the third ran in the first trial's worker."""
    from archspec.search.rundir import TrialRecord

    def record(number: int, pid: int, start: float, end: float) -> TrialRecord:
        return TrialRecord(number=number, status="ok", overrides={}, started_at=start, finished_at=end, pid=pid)

    records = [record(2, 11, 31.0, 50.0), record(0, 11, 7.0, 30.0), record(1, 12, 8.0, 29.0)]
    times = {0: {"added_at": 0.0, "started_at": 4.0, "finished_at": 30.5},   # 4 + 3 + 0.5 = 7.5
             1: {"added_at": 0.0, "started_at": 5.0, "finished_at": 29.5},   # 5 + 3 + 0.5 = 8.5
             2: {"added_at": 30.5, "started_at": 30.6, "finished_at": 50.2}}  # 0.1 + 0.4 + 0.2 = 0.7
    with benchmark_module("search_gpu") as bench:
        costs = bench.worker_costs(records, times)
    assert costs["ray_s_new_worker"] == {"median": pytest.approx(8.0), "trials": 2}
    assert costs["ray_s_reused_worker"] == {"median": pytest.approx(0.7), "trials": 1}


@pytest.mark.parametrize("concurrent,trials", [(1, 8), (2, 8), (4, 16), (8, 32)])
def test_each_level_gives_its_workers_several_trials_of_equal_work(tmp_path, concurrent, trials):
    """Level c asks for TRIALS_PER_WORKER * c trials (at least the eight grid points): the
    grid repeated with one norm_eps per copy, every point distinct (a search trains no
    point twice) and each copy of a point the same model at the same cost."""
    import archspec
    from archspec.cost import estimate
    from archspec.search.space import grid_points, load_search_spec

    with benchmark_module("search_gpu") as bench:
        path = bench.level_search(concurrent, smoke=False, folder=tmp_path)
        per_worker = bench.TRIALS_PER_WORKER
    loaded = load_search_spec(path)
    assert loaded.spec.budget.trials == trials >= per_worker * concurrent
    points = grid_points(loaded.spec.space, loaded.base_values)
    assert len(points) == trials and len({tuple(sorted(map(str, p.items()))) for p in points}) == trials
    costs: dict[tuple, set] = {}
    for point in points:
        spec = archspec.load_spec(loaded.base_file, [*point.items(), ("model.vocab_size", 24)])
        cost = estimate(spec, device="cuda")  # the FLOPs of the GPU's path
        architecture = tuple(sorted((k, str(v)) for k, v in point.items() if k != "model.norm_eps"))
        costs.setdefault(architecture, set()).add((cost.params, cost.flops_per_token, cost.state_bytes))
    assert len(costs) == 8 and all(len(c) == 1 for c in costs.values())
