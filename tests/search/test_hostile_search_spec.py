"""Search specs that would run a broken search: conditions on numeric ranges that can
never hold, NaN and infinite bounds, booleans where numbers belong, a searched field the
tasks overwrite. Each is refused at load time, located. No Ray here."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import optuna
import pytest

from archspec.errors import ArchspecError
from archspec.search.space import Param, load_search_spec

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "specs" / "search" / "bases" / "tiny-deltanet.yaml"

SPACE = """\
name: t
base: {base}
space:
  mixer.transition.type: {{choices: [householder, rwkv7]}}
  {first}
  mixer.transition.beta_range: {{choices: [[0, 1], [0, 2]], when: {{{field}: {values}}}}}
task: {{name: s3, options: {{train_len: 8}}}}
objectives:
  - token_acc@16: max
  - params: min
budget: {{trials: 4, steps: 10}}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "search.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def problems(path: Path, overrides=()) -> list[tuple[str, str | None, str]]:
    with pytest.raises(ArchspecError) as info:
        load_search_spec(path, overrides)
    return [(str(loc), field, message) for loc, field, message in info.value.problems]


FIRSTS = {
    "int": ("mixer.transition.n_h", "{int: [1, 3]}"),
    "int step": ("mixer.transition.n_h", "{int: [1, 7], step: 3}"),
    "int log": ("mixer.transition.n_h", "{int: [1, 8], log: true}"),
    "float step": ("model.mlp_ratio", "{float: [1.0, 4.0], step: 0.5}"),
}


def sampled_values(first: str) -> set[float]:
    """What Optuna actually draws for the first field: an independent reference (100 trials)."""
    field, text = FIRSTS[first]
    import yaml

    param = Param.model_validate(yaml.safe_load(text))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    return {param.suggest(study.ask(), field) for _ in range(200)}


@pytest.mark.parametrize("first, values", [
    ("int", [2]), ("int", [4]), ("int", [2.5]), ("int", [0, 1]), ("int", ["two"]),
    ("int step", [4]), ("int step", [3]), ("int step", [7]),
    ("int log", [5]), ("int log", [9]),
    ("float step", [2.5]), ("float step", [2.25]), ("float step", [4.5]),
])
def test_conditions_on_numeric_ranges_hold_exactly_when_sampling_can_produce_the_value(tmp_path, first, values):
    field, text = FIRSTS[first]
    path = write(tmp_path, SPACE.format(base=TINY, first=f"{field}: {text}", field=field, values=values))
    reachable = sampled_values(first)
    never = [v for v in values if not any(isinstance(v, (int, float)) and v == r for r in reachable)]
    if never:
        found = problems(path)
        assert [f for _, f, _ in found] == [f"space.mixer.transition.beta_range.when.{field}"] * len(never)
        where, _, message = found[0]
        assert where.startswith(f"{path}:6:") and f"{never[0]!r} is never sampled for {field!r}" in message
        assert "would never be searched" in message
    else:
        assert load_search_spec(path).spec.space[field].can_take(values[0])


def test_a_condition_on_a_continuous_float_range_is_refused_with_the_way_out(tmp_path):
    path = write(tmp_path, SPACE.format(base=TINY, first="model.mlp_ratio: {float: [1.0, 4.0]}",
                                        field="model.mlp_ratio", values=[2.0]))
    ((_, _, message),) = problems(path)
    assert "continuous float range [1, 4]" in message and "probability 0" in message and "`step:`" in message


def test_a_condition_may_name_the_value_a_conditional_field_falls_back_to(tmp_path):
    """n_h is sampled only for rwkv7; otherwise it is 1 (its `otherwise`), so a condition on
    n_h == 1 can hold though 1 is outside the sampled range."""
    text = SPACE.format(base=TINY, first="mixer.transition.n_h: {int: [2, 3], when: {mixer.transition.type: rwkv7}, otherwise: 1}",
                        field="mixer.transition.n_h", values=[1])
    assert load_search_spec(write(tmp_path, text)).spec.space["mixer.transition.n_h"].otherwise == 1
    text = text.replace("otherwise: 1", "otherwise: 2").replace("mixer.transition.n_h: [1]", "mixer.transition.n_h: [5]")
    ((_, _, message),) = problems(write(tmp_path, text))
    assert "5 is never sampled" in message


@pytest.mark.parametrize("override, field, words", [
    ("space.mixer.transition.n_h.float=[.nan, 2]", "space.mixer.transition.n_h.float", ".nan is not a finite number"),
    ("space.mixer.transition.n_h.float=[1, .inf]", "space.mixer.transition.n_h.float", ".inf is not a finite number"),
    ("space.mixer.transition.n_h.float=[1, 1e999]", "space.mixer.transition.n_h.float", "too large for a number"),
    ("budget.time_per_trial=.inf", "budget.time_per_trial", ".inf is not a finite number"),
])
def test_nan_and_infinite_bounds_never_reach_numpy(tmp_path, override, field, words):
    body = SPACE.format(base=TINY, first="mixer.transition.n_h: {int: [1, 3]}", field="mixer.transition.n_h", values=[2])
    path = write(tmp_path, body.replace("{int: [1, 3]}", "{float: [1.0, 2.0]}"))
    found = problems(path, [override])
    assert any(w.startswith(f"--set {override}") and words in m for w, _, m in found), found


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_infinite_bounds_from_python_are_refused(value):
    with pytest.raises(ValueError, match="finite number"):
        Param.model_validate({"float": [value, 2.0]})
    with pytest.raises(ValueError, match="finite number"):
        Param.model_validate({"float": [0.5, 2.0], "step": value})
    assert not Param.model_validate({"int": [1, 3]}).can_take(value)


@pytest.mark.parametrize("override, field", [
    ("budget.trials=yes", "budget.trials"),
    ("resources.cpu=on", "resources.cpu"),
    ("space.mixer.transition.n_h.int=[yes, 3]", "space.mixer.transition.n_h.int"),
    ("seed=true", "seed"),
])
def test_booleans_where_numbers_belong_in_a_search_spec(tmp_path, override, field):
    path = write(tmp_path, SPACE.format(base=TINY, first="mixer.transition.n_h: {int: [1, 3]}", field="mixer.transition.n_h", values=[2]))
    found = problems(path, [override])
    assert any(f.startswith(field) and "a boolean, where a number belongs" in m for _, f, m in found), found


def test_a_seed_numpy_cannot_take_is_refused(tmp_path):
    path = write(tmp_path, SPACE.format(base=TINY, first="mixer.transition.n_h: {int: [1, 3]}", field="mixer.transition.n_h", values=[2]))
    ((where, field, message),) = problems(path, [f"seed={2**40}"])
    assert field == "seed" and "less than 4294967296" in message
    assert load_search_spec(path, [f"seed={2**32 - 1}"]).spec.seed == 2**32 - 1


@pytest.mark.parametrize("entry", ["model.vocab_size: {choices: [64, 128]}", "model: {choices: [{d_model: 64}]}"])
def test_a_field_every_task_overwrites_cannot_be_searched(tmp_path, entry):
    text = SPACE.format(base=TINY, first=entry, field="mixer.transition.type", values=["rwkv7"])
    found = problems(write(tmp_path, text))
    assert any("set from each task's vocabulary" in m for _, _, m in found), found


def test_reference_values_really_are_what_optuna_draws():
    """The reference above is Optuna itself, not the code under test."""
    assert sampled_values("int step") == {1, 4, 7}
    assert sampled_values("float step") == {1.0 + 0.5 * i for i in range(7)}
    assert all(not math.isnan(v) for v in sampled_values("int log"))


@pytest.mark.parametrize("options, words", [
    ("{train_len: yes}", "train_len: got true, a boolean"),
    ("{train_len: .inf}", ".inf is not a finite number"),
    ("{eval_size: 2.5}", "eval_size: got 2.5: input should be a valid integer"),
    ("{target: high}", "target: got 'high': input should be a valid number"),
    ("{eval_factors: [1, two]}", "eval_factors: got [1, 'two']"),
])
def test_task_options_of_the_wrong_type_are_refused(tmp_path, options, words):
    text = SPACE.format(base=TINY, first="mixer.transition.n_h: {int: [1, 3]}", field="mixer.transition.n_h", values=[2])
    path = write(tmp_path, text.replace("options: {train_len: 8}", f"options: {options}"))
    found = problems(path)
    assert any(words in m for _, _, m in found), found


def test_task_options_are_converted_to_their_declared_types():
    from archspec.search.tasks import get_task

    task = get_task("s3", "cpu", train_len=1e2, eval_factors=[1, 2])
    assert task.train_len == 100 and isinstance(task.train_len, int) and task.eval_factors == (1, 2)
