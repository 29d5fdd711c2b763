"""Checking a search spec or an experiment file before anything runs: every problem at
once, objectives against what the trials report, values no spec can take (against a
brute-force composition of every point), the size of a space (against a brute-force
enumeration), `archspec search --dry-run` and `archspec validate` on each kind of file.
No Ray, no training."""

from __future__ import annotations

import itertools
import json
import textwrap
import time
from pathlib import Path

import pytest

from archspec import load_spec
from archspec.errors import ArchspecError
from archspec.search.cli import main
from archspec.search.experiments import load_experiment
from archspec.search.space import active, dead_values, load_search_spec, space_size
from archspec.search.tasks import get_task
from archspec.search.trial import make_task, reported_metrics, trainer_metrics

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "specs" / "search" / "bases" / "tiny-deltanet.yaml"
DELTANET = REPO / "specs" / "models" / "deltanet.yaml"

HEAD = f"name: t\nbase: {TINY}\n"
TAIL = """\
task: {name: s3, options: {train_len: 8}}
objectives:
  - token_acc@16: max
  - params: min
budget: {trials: 4, steps: 10}
"""


def write(tmp_path: Path, body: str, name: str = "search.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def problems(path: Path, loader=load_search_spec) -> list[tuple[str, str | None, str]]:
    with pytest.raises(ArchspecError) as info:
        loader(path)
    return [(str(loc), field, message) for loc, field, message in info.value.problems]


def line_of(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


# --------------------------------------------------------------------------- all at once


def test_a_search_spec_reports_every_problem_at_once(tmp_path):
    """Five mistakes of three layers (a value out of range, values no spec can take, a
    misspelt objective, a misspelt task in a second file): all reported together."""
    path = write(tmp_path, HEAD + """\
space:
  mixer.transition.n_h: {int: [1, 9]}
  mixer.heads: {choices: [2, 0]}
task: {name: s3, options: {train_len: 8}}
objectives:
  - token_acc@61: max
  - params: min
budget: {trials: 0, steps: 10}
""")
    found = {field: (where, message) for where, field, message in problems(path)}
    assert set(found) == {"budget.trials", "space.mixer.transition.n_h.int", "space.mixer.heads.choices", "objectives[0]"}
    assert found["budget.trials"][0] == f"{path}:{line_of(path, 'budget')}:18"
    where, message = found["space.mixer.transition.n_h.int"]
    assert where.startswith(f"{path}:{line_of(path, 'n_h')}:") and message.startswith("9 never makes a valid spec")
    assert "less than or equal to 8" in message
    assert found["space.mixer.heads.choices"][1].startswith("0 never makes a valid spec")
    message = found["objectives[0]"][1]
    assert "no trial reports 'token_acc@61' (did you mean token_acc@16?)" in message
    for name in ("token_acc@8", "seq_acc@32", "params", "flops_per_token", "tokens_per_s"):
        assert name in message
    assert "peak_mem_bytes" not in message  # not measured on the CPU, where these trials train

    typo = write(tmp_path, (HEAD + "space:\n  mixer.heads: {choices: [2, 4]}\n" + TAIL).replace("name: s3", "name: s33"), "t.yaml")
    (where, field, message), = problems(typo)
    assert field == "task[0]" and "(did you mean s3?)" in message


def test_an_invalid_base_spec_is_reported_with_the_other_problems(tmp_path):
    base = write(tmp_path, "name: b\nmixer: {heads: 0}\n", "base.yaml")
    path = write(tmp_path, f"name: t\nbase: {base}\nspace:\n  mixer.heads: {{choices: [2]}}\n" + TAIL.replace("token_acc@16", "token_acc@17"))
    found = problems(path)
    assert [f for _, f, _ in found] == ["base", "objectives[0]"]
    assert f"the base spec does not validate: {base}:2:16: mixer.heads" in found[0][2]


def test_the_reported_metrics_are_what_the_trainer_reports():
    """Against a real (3-step) training run's metrics on the same task."""
    from archspec.search import trainer

    task = get_task("parity", min_train_len=3, max_train_len=8, eval_lengths=[8, 12], eval_size=8)
    result = trainer.train(str(DELTANET), task, steps=3, seed=0, quiet=True,
                           overrides=["model.layers=1", "model.d_model=16", "mixer.heads=2", "mixer.head_dim=8"])
    reported = trainer_metrics(task)
    assert set(result.metrics) == set(reported.names)
    assert "peak_mem_bytes" in trainer_metrics(task, cuda=True).names
    assert "tokens_per_s" not in trainer_metrics(task, throughput=False).names


def test_diagnostics_names_match_their_patterns():
    """Every name the diagnostics report matches one of the patterns a search checks
    objectives against, and each pattern is used."""
    from archspec.search.diagnostics import METRIC_PATTERNS
    from archspec.search import trainer

    task = get_task("mqar", seq_len=16, num_kv_pairs=2, vocab=16, eval_size=4)
    result = trainer.train(str(REPO / "specs" / "models" / "osdn.yaml"), task, steps=1, seed=0, quiet=True, diagnostics=True,
                           measure_throughput=False, overrides=["model.layers=2", "model.d_model=16", "mixer.heads=2", "mixer.head_dim=8"])
    reported = trainer_metrics(task, diagnostics=True, throughput=False)
    assert all(name in reported for name in result.metrics)
    used = {shown for name in result.metrics for shown, pattern in METRIC_PATTERNS.items() if pattern.fullmatch(name)}
    assert used == set(METRIC_PATTERNS)


def test_several_tasks_prefix_their_metrics(tmp_path):
    path = write(tmp_path, HEAD + """\
space:
  mixer.heads: {choices: [2, 4]}
task: [s3, a5]
objectives:
  - s3/seq_acc@64: max
  - params: min
budget: {trials: 4, steps: 10}
resources: {gpu: 1}
""")
    loaded = load_search_spec(path)
    reported = reported_metrics(loaded.spec, [make_task(r) for r in loaded.spec.tasks])
    assert "a5/token_acc@128" in reported and "s3/peak_mem_bytes" in reported and "params" in reported
    assert "token_acc@128" not in reported


def test_an_experiment_reports_every_problem_at_once(tmp_path):
    path = write(tmp_path, f"""\
name: x
task: {{name: s3, options: {{train_len: 16}}}}
train: {{lrr: 3}}
runs:
  - {{name: a, spec: {DELTANET}}}
  - {{name: b, spec: {DELTANET}, sets: []}}
  - {{name: c, spec: {DELTANET}, set: [mixer.transition.n_h=9]}}
  - {{name: d, spec: missing.yaml}}
report: [token_acc@16, seq_acc@61]
""", "exp.yaml")
    found = {(field, message.split(":")[0]) for _, field, message in problems(path, load_experiment)}
    assert found == {
        ("train.lrr", "the trainer has no option 'lrr'; it takes steps, batch_size, lr, warmup_steps, eval_every, target, "
                      "backend, measure_throughput, time_limit_s, save_weights, resume, activation_checkpointing"),
        ("runs[1].sets", "unknown key 'sets' (did you mean set?); valid keys here"),
        ("runs[2]", "the run's spec does not validate"),
        ("runs[3].spec", "no such model spec 'missing.yaml' (relative to the experiment file)"),
        ("report[1]", "no run reports 'seq_acc@61' (did you mean seq_acc@64?); the runs report"),
    }


# --------------------------------------------------------------------------- the space


def brute_force_points(space: dict, base_values: dict) -> list[dict]:
    """Every distinct point: the product of all fields' values, conditions applied in order."""
    names = list(space)
    options = [space[n].grid_values() or [space[n].float_range[0]] for n in names]
    distinct = {}
    for combo in itertools.product(*options):
        point: dict = {}
        for name, value in zip(names, combo):
            param = space[name]
            if active(param, point, base_values):
                point[name] = value
            elif param.has_otherwise:
                point[name] = param.otherwise
        distinct[json.dumps(point, sort_keys=True)] = point
    return list(distinct.values())


SPACE = HEAD + """\
space:
  mixer.transition.type: {choices: [diagonal, householder, rwkv7]}
  mixer.transition.n_h: {int: [1, 9], when: {mixer.transition.type: [householder, rwkv7]}}
  mixer.transition.beta_range:
    choices: [[0, 1], [0, 2]]
    when: {mixer.transition.type: [householder, rwkv7]}
    otherwise: null
  mixer.preconditioner.type: {choices: [none, osdn], when: {mixer.transition.type: householder}}
  mixer.preconditioner.bounds: {choices: [[0.5, 2.0], [0.5, 1.0]], when: {mixer.preconditioner.type: osdn}}
  model.d_model: {choices: [32, 64]}
""" + TAIL


def test_dead_values_against_composing_every_point(tmp_path):
    """n_h 9 never composes; every other value composes somewhere (OSDN with d_max 2
    only with beta [0, 1], which the space offers). With a constraint that only the
    smallest specs meet, d_model 64 and the large n_h are ruled out, and nothing else."""
    path = write(tmp_path, SPACE)
    (where, field, message), = problems(path)
    assert field == "space.mixer.transition.n_h.int" and message.startswith("9 never makes a valid spec")

    loaded = load_search_spec(path, ["space.mixer.transition.n_h.int=[1, 8]"])
    spec, base = loaded.spec, loaded.base
    task = make_task(spec.tasks[0])
    points = brute_force_points(spec.space, loaded.base_values)
    assert space_size(spec.space, loaded.base_values).points == len(points)

    def valid(point):
        try:
            return load_spec(base, [*point.items(), ("model.vocab_size", task.vocab_size)])
        except ArchspecError:
            return None

    from archspec.cost import estimate

    specs = [(p, valid(p)) for p in points]
    limit = sorted(estimate(s).params for _, s in specs if s is not None)[3]  # a few of the smallest pass
    constrained = load_search_spec(path, ["space.mixer.transition.n_h.int=[1, 8]", f"constraints=[params <= {limit}]"])
    found = {(d.field, json.dumps(d.value), d.kind) for d in dead_values(constrained.spec, base, [task])}
    expected = set()
    for name, param in spec.space.items():
        for value in param.grid_values():
            with_value = [(p, s) for p, s in specs if name in p and p[name] == value]
            if not any(s is not None for _, s in with_value):
                expected.add((name, json.dumps(value), "invalid"))
            elif not any(s is not None and estimate(s).params <= limit for _, s in with_value):
                expected.add((name, json.dumps(value), "constrained"))
    assert found == expected and ("model.d_model", "64", "constrained") in found


def test_space_size_against_brute_force_on_the_shipped_specs():
    for path in sorted((REPO / "specs" / "search").glob("*.yaml")):
        loaded = load_search_spec(path)
        size = space_size(loaded.spec.space, loaded.base_values)
        assert size.points == len(brute_force_points(loaded.spec.space, loaded.base_values)), path
        assert size.continuous == tuple(n for n, p in loaded.spec.space.items() if p.grid_values() is None)


# --------------------------------------------------------------------------- the commands


def test_a_misspelt_objective_is_refused_before_anything_starts(tmp_path, capsys):
    path = write(tmp_path, HEAD + "space:\n  mixer.heads: {choices: [2, 4]}\n" + TAIL.replace("token_acc@16", "token_acc@61"))
    started = time.time()
    assert main(["search", str(path), "--out", str(tmp_path / "run"), "--no-live"]) == 2
    assert time.time() - started < 30  # no Ray, no trial
    err = capsys.readouterr().err
    assert "objectives[0]: no trial reports 'token_acc@61' (did you mean token_acc@16?)" in err
    assert "token_acc@32" in err  # the list to fix it from
    assert not (tmp_path / "run").exists()


def test_dry_run_prints_the_space_its_size_and_the_objectives(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich tables fold at the console's width
    path = write(tmp_path, SPACE.replace("[1, 9]", "[1, 3]") + 'constraints: ["params <= 30000"]\n')
    assert main(["search", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    loaded = load_search_spec(path)
    size = len(brute_force_points(loaded.spec.space, loaded.base_values))
    assert f"space: 6 fields, {size} points" in out
    for field in loaded.spec.space:
        assert field in out
    assert "values every point of which breaks a constraint (params <= 30,000)" in out
    for dead in dead_values(loaded.spec, loaded.base, [make_task(loaded.spec.tasks[0])]):
        assert dead.kind == "constrained" and dead.field in out
    assert "token_acc@16" in out and "yes (trainer)" in out and "yes (cost model)" in out
    assert "the trials report: token_acc@8, seq_acc@8" in out
    assert not (tmp_path / "runs").exists()

    assert main(["search", str(path), "--dry-run", "--set", "objectives=[{bpb: min}]"]) == 2
    assert "no trial reports 'bpb'" in capsys.readouterr().err


def test_validate_recognises_each_kind_of_file(capsys):
    files = [REPO / "specs" / "models" / "osdn.yaml", REPO / "specs" / "search" / "demo.yaml",
             REPO / "specs" / "experiments" / "deltaproduct-s3.yaml"]
    assert main(["validate", *map(str, files)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"ok  {files[0]}  (model spec osdn: deltanet, householder n_h=1")
    assert lines[1].startswith(f"ok  {files[1]}  (search spec demo: 3 searched fields, 13 points; tpe sampler")
    assert lines[2].startswith(f"ok  {files[2]}  (experiment deltaproduct-s3: 4 runs x 3 seed(s) on s3")
    # Forced to the wrong kind, a file gets that kind's errors.
    assert main(["validate", "--kind", "model", str(files[1])]) == 2
    assert "unknown key 'space'" in capsys.readouterr().err
    assert main(["validate", "--kind", "recipe", str(files[1])]) == 2
    assert "unknown kind of file 'recipe'; known: model, search, experiment" in capsys.readouterr().err


@pytest.mark.parametrize("kind, folder", [("search", "search"), ("experiment", "experiments")])
def test_schemas_match_the_committed_copies_and_accept_the_shipped_files(kind, folder, capsys, tmp_path):
    import yaml

    jsonschema = pytest.importorskip("jsonschema")
    assert main(["schema", "--kind", kind]) == 0
    text = capsys.readouterr().out
    assert (REPO / "specs" / f"{kind}.schema.json").read_text() == text
    validator = jsonschema.Draft202012Validator(json.loads(text))
    files = sorted((REPO / "specs" / folder).glob("*.yaml"))
    for path in files:
        assert path.read_text().startswith(f"# yaml-language-server: $schema=../{kind}.schema.json\n"), path
        assert list(validator.iter_errors(yaml.safe_load(path.read_text()))) == [], path
    data = yaml.safe_load(files[0].read_text())
    data["budget" if kind == "search" else "seeds"] = "many"
    assert list(validator.iter_errors(data))


def test_objectives_of_a_training_function_of_ones_own_are_not_checked_at_load(tmp_path):
    path = write(tmp_path, HEAD + "space:\n  mixer.heads: {choices: [2, 4]}\n" + TAIL.replace("token_acc@16", "my_score"))
    (_, field, _), = problems(path)
    assert field == "objectives[0]"
    assert load_search_spec(path, check_objectives=False).spec.metric_names == ["my_score", "params"]
