"""Pareto analysis: non-dominated sets against brute force, hypervolume and IGD+ against
hand-computed 2-D values, `archspec pareto --json` and `--plot` on run directories
(finished or still running). No Ray here: run directories are written by hand."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from archspec.search.cli import main
from archspec.search.pareto import compare_fronts, front_of, nondominated_mask, read_run
from archspec.search.rundir import RunDir, TrialRecord, write_yaml_atomic
from archspec.search.space import Objective


def dominated_brute_force(values: np.ndarray, maximise: list[bool]) -> np.ndarray:
    """Row i is dominated if some row is at least as good everywhere and better somewhere."""
    signs = np.where(maximise, -1.0, 1.0)
    v = values * signs  # as minimisation
    out = np.zeros(len(v), dtype=bool)
    for i, j in itertools.product(range(len(v)), repeat=2):
        if i != j and np.all(v[j] <= v[i]) and np.any(v[j] < v[i]):
            out[i] = True
    return out


@pytest.mark.parametrize("dims", [2, 3, 4])
def test_nondominated_matches_brute_force(dims):
    rng = np.random.default_rng(dims)
    for trial in range(20):
        # Few distinct values so that ties and duplicate points are common.
        values = rng.integers(0, 5, size=(25, dims)).astype(float)
        maximise = list(rng.integers(0, 2, size=dims).astype(bool))
        expected = ~dominated_brute_force(values, maximise)
        assert np.array_equal(nondominated_mask(values, maximise), expected), (trial, values, maximise)


def test_duplicates_of_a_front_point_are_all_kept():
    values = np.array([[1.0, 2.0], [1.0, 2.0], [2.0, 1.0], [2.0, 3.0]])
    assert nondominated_mask(values, [False, False]).tolist() == [True, True, True, False]


def test_hypervolume_and_igd_plus_by_hand_in_2d():
    # Objective 1 minimised, objective 2 maximised. Over the union, objective 1 spans
    # [0, 10] and objective 2 [0, 1], so normalised (0 best): A = (0, 1), (1, 0); B = (0.5, 0.5).
    fronts = {"A": np.array([[0.0, 0.0], [10.0, 1.0]]), "B": np.array([[5.0, 0.5]])}
    cmp = compare_fronts(fronts, [False, True])
    # Reference point 1.1 (normalised): boxes 1.1 x 0.1 twice minus their 0.1 x 0.1 overlap.
    assert cmp.hypervolume["A"] == pytest.approx(0.11 + 0.11 - 0.01)
    assert cmp.hypervolume["B"] == pytest.approx(0.6 * 0.6)
    # Reference front: all three points. IGD+ of A: distances 0, 0 and 0.5 (to (0.5, 0.5)).
    assert cmp.igd_plus["A"] == pytest.approx(0.5 / 3)
    # IGD+ of B: 0.5 to each of A's points (only the worse coordinate counts), 0 to itself.
    assert cmp.igd_plus["B"] == pytest.approx(1.0 / 3)
    assert cmp.reference_front_size == 3
    # In raw units the reference point is the worst value plus a tenth of the range.
    assert cmp.reference_point == pytest.approx([11.0, -0.1])


def test_a_front_that_dominates_gets_zero_igd_plus_and_more_volume():
    better = np.array([[1.0, 1.0]])
    worse = np.array([[2.0, 2.0], [3.0, 1.5]])
    cmp = compare_fronts({"better": better, "worse": worse}, [False, False])
    assert cmp.igd_plus["better"] == 0.0
    assert cmp.hypervolume["better"] > cmp.hypervolume["worse"]
    # worse, normalised: (0.5, 1) and (1, 0.5) vs the reference front {(0, 0)}: d+ = 1.118, 1.118.
    assert cmp.igd_plus["worse"] == pytest.approx(math.hypot(0.5, 1.0))


# --------------------------------------------------------------------------- run directories

OBJECTIVES = [{"acc": "max"}, {"params": "min"}]


def make_run(tmp_path, name, trials, objectives=OBJECTIVES):
    run = RunDir(tmp_path / name)
    write_yaml_atomic(run.search_file, {"name": name, "objectives": objectives})
    for number, status, metrics, overrides in trials:
        record = TrialRecord(number=number, status=status, metrics=metrics, overrides=overrides, started_at=0.0)
        if status is None:
            run.write_trial_start(record)
        else:
            record.finished_at = 1.0
            run.write_trial_result(record)
    return run


TRIALS_A = [
    (0, "ok", {"acc": 0.9, "params": 300.0}, {"mixer.transition.n_h": 3}),
    (1, "ok", {"acc": 0.6, "params": 100.0}, {"mixer.transition.n_h": 1}),
    (2, "ok", {"acc": 0.5, "params": 200.0}, {"mixer.transition.n_h": 2}),  # dominated by 1
    (3, "failed", {"acc": 1.0, "params": 1.0}, {}),  # would dominate all: must stay off the front
    (4, "diverged", {"acc": None, "params": 50.0}, {}),
    (5, "skipped", {"params": 5e6}, {"mixer.heads": 16}),
    (6, None, {}, {"mixer.transition.n_h": 2}),  # still running
]
TRIALS_B = [
    (0, "ok", {"acc": 0.8, "params": 150.0}, {"mixer.gate": "scalar"}),
    (1, "ok", {"acc": 0.95, "params": 400.0}, {"mixer.gate": "channel"}),
]


def test_front_keeps_failed_and_unfinished_trials_off(tmp_path):
    run = read_run(make_run(tmp_path, "a", TRIALS_A).path)
    assert [r.number for r in run.front] == [0, 1]
    objectives = [Objective(metric="acc", direction="max"), Objective(metric="params", direction="min")]
    assert [r.number for r in front_of(run.records, objectives)] == [0, 1]


def test_pareto_json_one_run(tmp_path, capsys):
    run = make_run(tmp_path, "a", TRIALS_A)
    assert main(["pareto", str(run.path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [t["trial"] for t in data["front"]] == [0, 1]
    assert data["front"][0] == {"trial": 0, "overrides": {"mixer.transition.n_h": 3}, "metrics": {"acc": 0.9, "params": 300.0}}
    assert data["trials_completed"] == 5  # ok, ok, ok, failed, diverged
    assert data["trials_running"] == 1
    assert data["status_counts"]["skipped"] == 1
    assert data["objectives"] == [{"metric": "acc", "direction": "max"}, {"metric": "params", "direction": "min"}]
    # One run: its front normalised to itself, (0, 1) and (1, 0) -> 0.21 as by hand above.
    assert data["hypervolume"] == pytest.approx(0.21)


def test_pareto_json_two_runs_and_plot(tmp_path, capsys):
    a, b = make_run(tmp_path, "a", TRIALS_A), make_run(tmp_path, "b", TRIALS_B)
    plot = tmp_path / "fronts.png"
    assert main(["pareto", str(a.path), str(b.path), "--json", "--plot", str(plot)]) == 0
    data = json.loads(capsys.readouterr().out)
    runs = {r["run"]: r for r in data["runs"]}
    # Union of fronts: acc 0.6..0.95, params 100..400; all four front points are non-dominated.
    fronts = {
        "a": np.array([[0.9, 300.0], [0.6, 100.0]]),
        "b": np.array([[0.8, 150.0], [0.95, 400.0]]),
    }
    expected = compare_fronts(fronts, [True, False])
    assert runs[str(a.path)]["hypervolume"] == pytest.approx(expected.hypervolume["a"])
    assert runs[str(b.path)]["igd_plus"] == pytest.approx(expected.igd_plus["b"])
    assert data["reference_front_size"] == 4
    assert data["reference_point"] == pytest.approx([0.6 - 0.1 * 0.35, 400 + 0.1 * 300])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_has_a_panel_per_pair_of_objectives(tmp_path):
    import matplotlib.image

    from archspec.search.pareto import plot_fronts

    three = [{"acc": "max"}, {"params": "min"}, {"state_bytes": "min"}]
    trials = [(i, "ok", {"acc": a, "params": p, "state_bytes": s}, {}) for i, (a, p, s) in
              enumerate([(0.9, 300.0, 10.0), (0.6, 100.0, 30.0), (0.7, 200.0, 5.0)])]
    run = read_run(make_run(tmp_path, "three", trials, three).path)
    two = read_run(make_run(tmp_path, "two", TRIALS_A).path)
    path3 = plot_fronts([run], tmp_path / "three.png")
    path2 = plot_fronts([two], tmp_path / "two.png")
    h3, w3 = matplotlib.image.imread(path3).shape[:2]
    h2, w2 = matplotlib.image.imread(path2).shape[:2]
    assert w3 == pytest.approx(3 * w2, rel=0.02) and h3 == h2  # three pairs side by side


def test_pareto_on_a_run_being_written(tmp_path, capsys):
    """A running search: trials without results, a temporary file mid-write, no front yet."""
    run = make_run(tmp_path, "busy", [(0, None, {}, {"mixer.heads": 2}), (1, "failed", {}, {})])
    (run.trial_dir(1) / ".result.json.abc.tmp").write_text('{"number": 1, "sta')
    assert main(["pareto", str(run.path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["front"] == [] and data["trials_completed"] == 1 and data["trials_running"] == 1
    assert data["hypervolume"] is None
    assert main(["pareto", str(run.path)]) == 0  # the table, with an empty front
    assert "front of 0" in capsys.readouterr().out


def test_pareto_refuses_what_it_cannot_compare(tmp_path, capsys):
    a = make_run(tmp_path, "a", TRIALS_A)
    c = make_run(tmp_path, "c", [], objectives=[{"acc": "max"}, {"flops_per_token": "min"}])
    assert main(["pareto", str(a.path), str(c.path)]) == 2
    err = capsys.readouterr().err
    assert "different objectives" in err and "flops_per_token (min)" in err
    assert main(["pareto", str(tmp_path / "nothing-here")]) == 2
    assert "not a search run directory" in capsys.readouterr().err


def test_plot_labels_front_points_and_keeps_identical_fronts_apart(tmp_path, monkeypatch):
    """Each front point carries its trial and overrides by the tables' short names, once
    where runs share it; a second run with the same front is drawn hollow and larger
    around the first and says so in the legend."""
    import matplotlib.pyplot as plt

    from archspec.search import pareto

    seen = {}
    original = pareto.write_atomic

    def capture(path, write):
        fig = plt.gcf()
        seen["texts"] = [t.get_text() for ax in fig.axes for t in ax.texts]
        seen["legend"] = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        fronts = [c for c in fig.axes[0].collections if c.get_label() and not c.get_label().startswith("_")]
        seen["sizes"] = [float(c.get_sizes()[0]) for c in fronts]
        seen["hollow"] = [len(c.get_facecolors()) == 0 or float(c.get_facecolors()[0][3]) == 0.0 for c in fronts]
        return original(path, write)

    monkeypatch.setattr(pareto, "write_atomic", capture)
    a, b = make_run(tmp_path, "a", TRIALS_A), make_run(tmp_path, "b", TRIALS_A)
    pareto.plot_fronts([read_run(a.path), read_run(b.path)], tmp_path / "same.png")
    assert sorted(seen["texts"]) == ["#0 n_h=3", "#1 n_h=1"]  # run b's identical points are not labelled twice
    assert seen["legend"] == ["a (2)", "b (2), the same front as a"]
    assert seen["sizes"][1] > seen["sizes"][0] and seen["hollow"] == [False, True]
    plt.close("all")
