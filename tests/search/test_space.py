"""The search spec: located validation errors, conditions that never produce an invalid
spec, define-by-run sampling, grid enumeration against brute force. No Ray here."""

from __future__ import annotations

import itertools
import json
import textwrap
from pathlib import Path

import optuna
import pytest

from archspec import load_spec
from archspec.errors import ArchspecError
from archspec.search.space import (
    Constraint,
    active,
    grid_points,
    load_search_spec,
    optuna_params,
    suggest_overrides,
)

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "specs" / "search").glob("*.yaml"))
TINY = REPO / "specs" / "search" / "bases" / "tiny-deltanet.yaml"

optuna.logging.set_verbosity(optuna.logging.WARNING)

GOOD = f"""\
name: t
base: {TINY}
space:
  mixer.transition.type: {{choices: [diagonal, householder, rwkv7]}}
  mixer.transition.n_h: {{int: [1, 3], when: {{mixer.transition.type: [householder, rwkv7]}}}}
  mixer.transition.beta_range:
    choices: [[0, 1], [0, 2]]
    when: {{mixer.transition.type: [householder, rwkv7]}}
    otherwise: null
task: {{name: s3, options: {{train_len: 8}}}}
objectives:
  - token_acc@16: max
  - params: min
budget: {{trials: 4, steps: 10}}
"""


def write(tmp_path: Path, text: str, name: str = "search.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def problems_of(path: Path, overrides=()) -> list[tuple[str, str | None, str]]:
    with pytest.raises(ArchspecError) as info:
        load_search_spec(path, overrides)
    return [(str(loc), field, message) for loc, field, message in info.value.problems]


def line_of(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


# --------------------------------------------------------------------------- validation


def test_shipped_search_specs_load():
    assert {p.name for p in SHIPPED} >= {"demo.yaml", "deltaproduct.yaml", "osdn.yaml", "full-gpu.yaml"}
    for path in SHIPPED:
        loaded = load_search_spec(path)
        assert loaded.spec.space and loaded.spec.objectives


def test_good_spec_and_its_stored_form_load_equal(tmp_path):
    loaded = load_search_spec(write(tmp_path, GOOD))
    spec = loaded.spec
    assert list(spec.space) == ["mixer.transition.type", "mixer.transition.n_h", "mixer.transition.beta_range"]
    assert spec.space["mixer.transition.beta_range"].has_otherwise
    assert [(o.metric, o.direction) for o in spec.objectives] == [("token_acc@16", "max"), ("params", "min")]
    # What the run directory stores loads back to the same spec.
    import yaml

    data = spec.to_yaml_data()
    again = write(tmp_path, yaml.safe_dump(data, sort_keys=False), "again.yaml")
    assert load_search_spec(again).spec == spec


def test_set_overrides_apply_and_bad_ones_are_located(tmp_path):
    path = write(tmp_path, GOOD)
    assert load_search_spec(path, ["budget.trials=7", "sampler=random"]).spec.budget.trials == 7
    (where, field, message), = problems_of(path, ["budget.trials=0"])
    assert where == "--set budget.trials=0" and field == "budget.trials" and "greater than 0" in message
    # a search-space entry is keyed by a dotted field: --set reaches it, and a bad value is located there
    narrowed = load_search_spec(path, ["space.mixer.transition.n_h.int=[1, 2]"]).spec.space["mixer.transition.n_h"]
    assert (narrowed.int_range, narrowed.when) == ((1, 2), {"mixer.transition.type": ["householder", "rwkv7"]})
    (where, field, message), = problems_of(path, ["space.mixer.transition.n_h.int=[1, x]"])
    assert where == "--set space.mixer.transition.n_h.int=[1, x]" and field.startswith("space.mixer.transition.n_h.int")


@pytest.mark.parametrize(
    "old, new, needle, field, words",
    [
        ("budget:", "sampeler: tpe\nbudget:", "sampeler", "sampeler", ["unknown key", "did you mean sampler"]),
        ("{int: [1, 3],", "{int: [1, 3], choices: [1, 2],", "mixer.transition.n_h:", "space.mixer.transition.n_h", ["exactly one of", "choices, int"]),
        ("{int: [1, 3],", "{int: [3, 1],", "mixer.transition.n_h:", "space.mixer.transition.n_h", ["is empty"]),
        ("- params: min", "- params: smallest", "params: smallest", "objectives[1].direction", ["'max' or 'min'"]),
        ("budget:", "constraints: ['token_acc@16 >= 0.5']\nbudget:", "constraints:", "constraints[0]", ["cost model", "params, flops_per_token, state_bytes"]),
        ("budget:", "constraints: ['params << 2e6']\nbudget:", "constraints:", "constraints[0]", ["metric <= number"]),
        ("mixer.transition.n_h:", "mixer.transiton.n_h:", "mixer.transiton.n_h", "space.mixer.transiton.n_h", ["no field 'transiton'", "did you mean transition"]),
        ("{mixer.transition.type: [householder, rwkv7]}}", "{mixer.transition.type: [householdr]}}", "mixer.transition.n_h:",
         "space.mixer.transition.n_h.when.mixer.transition.type", ["'householdr' is never sampled"]),
        ("{mixer.transition.type: [householder, rwkv7]}}", "{mixer.transition.beta_range: [[0, 2]]}}", "mixer.transition.n_h:",
         "space.mixer.transition.n_h.when.mixer.transition.beta_range", ["sampled at or after", "listed before"]),
        ("{mixer.transition.type: [householder, rwkv7]}}", "{mixer.preconditioner.type: osdn}}", "mixer.transition.n_h:",
         "space.mixer.transition.n_h.when.mixer.preconditioner.type", ["'none' in the base spec", "never be searched"]),
        ("options: {train_len: 8}", "options: {train_lenght: 8}", "task:", "task[0]", ["unknown option(s) train_lenght", "train_len"]),
        ("budget:", "train: {lr: 0.01, steps: 5}\nbudget:", "train:", "train.steps", ["set by the search itself"]),
        ("budget:", "train: {learning_rate: 0.01}\nbudget:", "train:", "train.learning_rate", ["no option 'learning_rate'", "lr"]),
        (f"base: {TINY}", "base: nowhere.yaml", "base:", "base", ["no such model spec"]),
    ],
)
def test_errors_name_file_line_and_field(tmp_path, old, new, needle, field, words):
    text = GOOD.replace(old, new, 1)
    assert text != GOOD
    path = write(tmp_path, text)
    problems = problems_of(path)
    matching = [p for p in problems if p[1] == field]
    assert matching, problems
    where, _, message = matching[0]
    assert where.startswith(f"{path}:{line_of(path, needle)}:"), (where, problems)
    for word in words:
        assert word in message, message


def test_grid_needs_discrete_values_and_several_tasks_need_named_objectives(tmp_path):
    text = GOOD.replace("budget:", "sampler: grid\nbudget:").replace(
        "  mixer.transition.type:", "  model.norm_eps: {float: [1.0e-6, 1.0e-5]}\n  mixer.transition.type:")
    path = write(tmp_path, text)
    (where, field, message), = problems_of(path)
    assert field == "space.model.norm_eps" and "give `step:`" in message
    assert where.startswith(f"{path}:{line_of(path, 'model.norm_eps')}:")
    two = GOOD.replace("task: {name: s3, options: {train_len: 8}}", "task: [s3, a5]")
    path = write(tmp_path, two, "two.yaml")
    (where, field, message), = problems_of(path)
    assert field == "objectives[0]" and "s3/token_acc@16" in message  # params needs no task


def test_constraint_parsing_and_bounds():
    c = Constraint.model_validate("params <= 2e6")
    assert (c.metric, c.op, c.bound) == ("params", "<=", 2e6)
    assert c.holds(2e6) and not c.holds(2e6 + 1)
    assert Constraint.model_validate("state_bytes>1024").holds(1025)
    assert not Constraint.model_validate("flops_per_token < 10").holds(10)


# --------------------------------------------------------------------------- sampling


def sample(loaded, n: int, seed: int = 0) -> list[dict]:
    """Define-by-run sampling with Optuna's random sampler, as the searcher does it."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    out = []
    for _ in range(n):
        trial = study.ask()
        out.append(suggest_overrides(trial, loaded.spec.space, loaded.base_values))
        study.tell(trial, 0.0)
    return out


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_conditions_never_produce_invalid_specs(path):
    loaded = load_search_spec(path)
    for overrides in sample(loaded, 60):
        load_spec(loaded.base_file, list(overrides.items()))  # raises if invalid
        kind = overrides.get("mixer.transition.type", loaded.base_values["mixer.transition.type"])
        if "mixer.transition.n_h" in overrides and overrides["mixer.transition.n_h"] > 1:
            assert kind in ("householder", "rwkv7")
        osdn = overrides.get("mixer.preconditioner.type", loaded.base_values["mixer.preconditioner.type"]) == "osdn"
        for name in ("apf", "eta", "bounds"):
            if f"mixer.preconditioner.{name}" in overrides:
                assert osdn, overrides


def test_inactive_fields_are_not_sampled_and_otherwise_applies(tmp_path):
    loaded = load_search_spec(write(tmp_path, GOOD))
    draws = sample(loaded, 40, seed=3)
    kinds = {d["mixer.transition.type"] for d in draws}
    assert kinds == {"diagonal", "householder", "rwkv7"}
    for d in draws:
        if d["mixer.transition.type"] == "diagonal":
            assert "mixer.transition.n_h" not in d and d["mixer.transition.beta_range"] is None
        else:
            assert 1 <= d["mixer.transition.n_h"] <= 3 and d["mixer.transition.beta_range"] in ([0, 1], [0, 2])


def brute_force_grid(space: dict[str, list], rules) -> list[dict]:
    """Every combination, inactive fields dropped (or set to `otherwise`), duplicates removed."""
    seen, out = set(), []
    for combo in itertools.product(*space.values()):
        point = rules(dict(zip(space, combo)))
        key = json.dumps(point, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(point)
    return out


def test_grid_points_match_brute_force(tmp_path):
    loaded = load_search_spec(write(tmp_path, GOOD.replace("budget:", "sampler: grid\nbudget:")))

    def rules(p):
        if p["mixer.transition.type"] == "diagonal":
            return {"mixer.transition.type": "diagonal", "mixer.transition.beta_range": None}
        return p

    expected = brute_force_grid({
        "mixer.transition.type": ["diagonal", "householder", "rwkv7"],
        "mixer.transition.n_h": [1, 2, 3],
        "mixer.transition.beta_range": [[0, 1], [0, 2]],
    }, rules)
    points = grid_points(loaded.spec.space, loaded.base_values)
    key = lambda p: json.dumps(p, sort_keys=True)  # noqa: E731
    assert sorted(map(key, points)) == sorted(map(key, expected))
    assert len(points) == 1 + 2 * 3 * 2
    # Enqueued as Optuna params, each point samples back to itself.
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for point in points:
        study.enqueue_trial(optuna_params(loaded.spec.space, point, loaded.base_values))
    for point in points:
        trial = study.ask()
        assert suggest_overrides(trial, loaded.spec.space, loaded.base_values) == point
        study.tell(trial, 0.0)


def test_active_looks_at_sampled_values_then_the_base(tmp_path):
    loaded = load_search_spec(write(tmp_path, GOOD))
    n_h = loaded.spec.space["mixer.transition.n_h"]
    assert active(n_h, {}, loaded.base_values)  # the base is householder
    assert not active(n_h, {"mixer.transition.type": "diagonal"}, loaded.base_values)


@pytest.mark.parametrize("name, kind", [("tpe", optuna.samplers.TPESampler), ("nsga2", optuna.samplers.NSGAIISampler),
                                        ("random", optuna.samplers.RandomSampler), ("grid", optuna.samplers.RandomSampler)])
def test_samplers_are_seeded_and_reproducible(tmp_path, name, kind):
    """The same search spec proposes the same trials; another seed proposes others."""
    from archspec.search.samplers import make_sampler

    def proposals(seed: int) -> list[dict]:
        loaded = load_search_spec(write(tmp_path, GOOD), [f"sampler={name}", f"seed={seed}", "budget.trials=40"])
        sampler = make_sampler(loaded.spec)
        assert isinstance(sampler, kind)
        study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
        out = []
        for _ in range(14):  # past TPE's and NSGA-II's random start-up
            trial = study.ask()
            overrides = suggest_overrides(trial, loaded.spec.space, loaded.base_values)
            study.tell(trial, [overrides.get("mixer.transition.n_h", 0) / 3, len(json.dumps(overrides))])
            out.append(overrides)
        return out

    first = proposals(0)
    assert proposals(0) == first
    assert proposals(1) != first


# --------------------------------------------------------------------------- hybrid placement

PLACEMENT = f"""\
name: placement
base: {TINY}
space:
  model.layers: {{choices: [2, 4]}}
  layout.ratio: {{choices: ['1:0', '3:1', '1:1', '0:1']}}
  layout.attention_at:
    choices: [[], [0], [1]]
    when: {{layout.ratio: '1:0'}}
  attention.window:
    choices: [null, 4, 16]
    when: {{layout.ratio: ['3:1', '1:1', '0:1']}}
  attention.kv_heads:
    choices: [1, 2]
    when: {{layout.ratio: ['3:1', '1:1', '0:1']}}
task: {{name: s3, options: {{train_len: 8}}}}
objectives:
  - token_acc@16: max
  - state_bytes@32768: min
constraints: ["state_bytes@32768 <= 1e7"]
budget: {{trials: 4, steps: 10}}
sampler: grid
"""


def test_attention_placement_is_searchable_with_conditions(tmp_path):
    """Pattern, indices, window and kv_heads are dotted fields; every point of the grid is
    a valid spec whose layers are what the point says."""
    from archspec.spec.layout import layer_kinds

    loaded = load_search_spec(write(tmp_path, PLACEMENT))
    points = grid_points(loaded.spec.space, loaded.base_values)
    # 2 depths x (1:0 with 3 index choices + 3 ratios with 3 windows x 2 kv_heads)
    assert len(points) == 2 * (3 + 3 * 3 * 2)
    for point in points:
        spec = load_spec(loaded.base_file, list(point.items()))
        kinds = layer_kinds(spec.layout, spec.model.layers)
        if point["layout.ratio"] == "1:0":
            assert "attention.window" not in point
            assert [i for i, k in enumerate(kinds) if k == "attention"] == point["layout.attention_at"]
        else:
            assert "layout.attention_at" not in point and spec.attention.window == point["attention.window"]
            assert kinds.count("attention") == {"3:1": spec.model.layers // 4, "1:1": spec.model.layers // 2, "0:1": spec.model.layers}[point["layout.ratio"]]


def test_an_index_past_a_searched_depth_is_refused_with_its_field(tmp_path):
    bad = PLACEMENT.replace("choices: [[], [0], [1]]", "choices: [[], [0], [3]]")
    loaded = load_search_spec(write(tmp_path, bad))
    point = {"model.layers": 2, "layout.ratio": "1:0", "layout.attention_at": [3]}
    with pytest.raises(ArchspecError) as info:
        load_spec(loaded.base_file, list(point.items()))
    assert "layer 3 is past the last layer: model.layers = 2" in str(info.value)


def test_the_cost_metrics_a_constraint_may_use_are_the_cost_models():
    from archspec.cost import cost_metric_names, estimate
    from archspec.search.space import COST_METRICS

    assert COST_METRICS == cost_metric_names()
    assert tuple(estimate(load_spec(TINY)).metrics()) == COST_METRICS
    assert Constraint.model_validate("state_bytes@32768 <= 1e6").metric == "state_bytes@32768"
