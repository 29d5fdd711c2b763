"""`archspec validate | compile | schema` through the real entry point: exit codes,
output, located errors, and never a traceback on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from archspec.blocks import count_params
from archspec.lowering import lower
from archspec.search.cli import main
from archspec.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "specs" / "models"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_validate_all_shipped_specs(capsys):
    paths = sorted(str(p) for p in MODELS.glob("*.yaml"))
    code, out, err = run(capsys, "validate", *paths)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == len(paths)
    assert all(line.startswith(f"ok  {p}  (") for line, p in zip(lines, paths))


def test_validate_reports_bad_files_and_keeps_going(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nmixer:\n  haeds: 4\n")
    good = MODELS / "kda.yaml"
    code, out, err = run(capsys, "validate", str(bad), str(good))
    assert code == 2
    assert out.splitlines() == [out.splitlines()[0]] and out.startswith(f"ok  {good}")
    assert f"{bad}:3:3: mixer.haeds: unknown key 'haeds' (did you mean heads?)" in err


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", "the file is empty"),
        ("- a\n- b\n", "found a list"),
        ("name: [x\n", ":2:1: invalid YAML: expected ',' or ']', but got '<stream end>' (while parsing a flow "
                        "sequence at line 1, column 7)"),
        ("name: !!python/object/apply:os.system [ls]\n", "!!python/object/apply:os.system is not allowed"),
        ("name: x\nextends: missing.yaml\n", ":2:10: extends: no such file"),
    ],
)
def test_validate_bad_input_exits_2_with_a_located_message(capsys, tmp_path, text, expected):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    code, _, err = run(capsys, "validate", str(path))
    assert code == 2 and err.startswith("error: ") and expected in err


def test_validate_missing_file(capsys, tmp_path):
    code, _, err = run(capsys, "validate", str(tmp_path / "nope.yaml"))
    assert code == 2 and "no such file" in err


def test_validate_with_overrides(capsys):
    code, out, _ = run(capsys, "validate", str(MODELS / "deltanet.yaml"), "--set", "mixer.transition.n_h=3")
    assert code == 0 and "n_h=3" in out
    code, _, err = run(capsys, "validate", str(MODELS / "gla.yaml"), "--set", "mixer.transition.n_h=2")
    assert code == 2 and "mixer.transition.n_h" in err and "householder or rwkv7" in err


def test_compile_prints_plan_cost_and_caveats(capsys):
    path = MODELS / "osdn-apf.yaml"
    code, out, err = run(capsys, "compile", str(path), "--set", "model.layers=1")
    assert code == 0 and err == ""
    plan = lower(load_spec(path, ["model.layers=1"]))
    assert f"{count_params(plan):,}" in out
    for words in ("osdn-apf: plan", "preconditioned", "FLOPs/token", "state bytes", "stability caveats", "non-normal"):
        assert words in out, words


def test_compile_of_a_stable_spec_says_so(capsys):
    code, out, _ = run(capsys, "compile", str(MODELS / "gated-deltaproduct-2.yaml"), "--seq-len", "256")
    assert code == 0 and "spectral norm <= 1" in out and "T=256" in out


def test_compile_save_writes_the_module_and_spec(capsys, tmp_path):
    target = tmp_path / "deep" / "m.pt"
    code, out, _ = run(capsys, "compile", str(MODELS / "kda.yaml"), "--set", "mixer.heads=2", "--save", str(target))
    assert code == 0 and f"saved {target}" in out
    payload = torch.load(target, weights_only=True)
    assert payload["spec"]["name"] == "kda" and payload["spec"]["mixer"]["heads"] == 2
    assert "extends" not in payload["spec"]  # resolved: the file stands alone
    assert sum(t.numel() for t in payload["state_dict"].values()) > 0


def test_compile_bad_input(capsys, tmp_path):
    code, _, err = run(capsys, "compile", str(MODELS / "osdn.yaml"), "--set", "mixer.transition.beta_range=[0, 2]")
    assert code == 2 and "osdn.yaml:12:13: mixer.preconditioner.bounds: unstable" in err  # osdn.yaml sets bounds
    code, _, err = run(capsys, "compile", str(MODELS / "osdn.yaml"), "--set", "mixer.heads")
    assert code == 2 and "dotted.key=value" in err
    code, _, err = run(capsys, "compile", str(MODELS / "osdn.yaml"), "--seq-len", "0")
    assert code == 2 and "--seq-len" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run(capsys, "compile", str(MODELS / "osdn.yaml"), "--save", str(blocker / "m.pt"))
    assert code == 2 and "cannot write" in err


def test_schema_is_valid_json_and_matches_the_committed_copy(capsys, tmp_path):
    target = tmp_path / "schema.json"
    code, out, _ = run(capsys, "schema", "-o", str(target))
    assert code == 0 and f"wrote {target}" in out
    schema = json.loads(target.read_text())
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert schema["required"] == ["name"]
    assert set(schema["$defs"]["MixerSpec"]["properties"]) >= {"backbone", "transition", "gate", "preconditioner", "heads",
                                                               "head_dim", "expand_v", "short_conv"}
    code, out, _ = run(capsys, "schema")
    assert code == 0 and out == target.read_text()
    # the copy the shipped specs' modelines point at is up to date
    assert (ROOT / "specs" / "spec.schema.json").read_text() == out


def test_schema_accepts_shipped_specs_and_rejects_unknown_keys():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "specs" / "spec.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for path in MODELS.glob("*.yaml"):
        assert list(validator.iter_errors(yaml.safe_load(path.read_text()))) == [], path
    errors = list(validator.iter_errors({"name": "x", "mixer": {"haeds": 4, "backbone": "gnd"}}))
    assert len(errors) == 2


def test_compile_of_a_hybrid_prints_its_layers_and_the_long_context(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps table cells at the terminal's width
    path = MODELS / "jet-nemotron-placement.yaml"
    sets = ["--set", "model.d_model=64", "--set", "mixer.heads=2"]
    code, out, err = run(capsys, "compile", str(path), *sets, "--seq-len", "1024", "--long-context", "4096")
    assert code == 0 and err == ""
    text = " ".join(out.split())
    assert "28 layers: 24 recurrent, 4 attention (14, 19, 20, 21)" in text and "window 1152" in text
    plan = lower(load_spec(path, ["model.d_model=64", "mixer.heads=2"]))
    from archspec.cost import estimate

    cost = estimate(plan, seq_len=1024, long_context=4096)
    for words in ("state @ 4096", "T=1024", "T=4096", f"{cost.state_bytes:,}", f"{cost.state_bytes_long:,}",
                  f"{cost.flops_per_token_long:,.0f}", f"{count_params(plan):,}"):
        assert words in text, words
    code, out, _ = run(capsys, "validate", str(path))
    assert code == 0 and "24 recurrent + 4 attention layers, 1 override(s)" in out
    code, _, err = run(capsys, "compile", str(path), "--long-context", "0")
    assert code == 2 and "--long-context must be >= 1" in err


def test_validate_reports_every_problem_of_a_spec_at_once(capsys, tmp_path):
    """A value out of range beside an unstable OSDN setting in the same section, and a
    third mistake elsewhere: the rule is not hidden behind the range errors."""
    path = tmp_path / "three.yaml"
    path.write_text(
        "name: bad\n"
        "mixer:\n"
        "  transition: {type: householder, n_h: 9, beta_range: [0, 2]}\n"
        "  preconditioner: {type: osdn, bounds: [0.5, 2.0]}\n"
        "  heads: 0\n"
    )
    code, _, err = run(capsys, "validate", str(path))
    assert code == 2 and "(3 problems)" in err
    assert f"{path}:3:40: mixer.transition.n_h: got 9" in err
    assert f"{path}:4:40: mixer.preconditioner.bounds: unstable: with beta in [0, 2] and d_max = 2" in err
    assert f"{path}:5:10: mixer.heads: got 0" in err


def test_schema_of_each_kind(capsys):
    code, out, _ = run(capsys, "schema", "--kind", "model")
    assert code == 0 and out == (ROOT / "specs" / "spec.schema.json").read_text()
    code, _, err = run(capsys, "schema", "--kind", "recipe")
    assert code == 2 and "unknown kind of file 'recipe'" in err
