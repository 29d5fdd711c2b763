"""The model spec: every refusal rule with its reason and place, defaults, overrides."""

from __future__ import annotations

import textwrap

import pytest
from pydantic import ValidationError

from archspec.errors import ArchspecError
from archspec.spec import Spec, load_spec


def spec_file(tmp_path, body: str, name: str = "spec.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def problems(exc: ArchspecError) -> dict[str, tuple]:
    """dotted field -> (line, column, message); origin instead of line for overrides."""
    out = {}
    for loc, field, message in exc.problems:
        where = (loc.origin,) if loc.origin else (loc.line, loc.column)
        out[field] = (*where, message)
    return out


def refused(path, overrides=()) -> dict[str, tuple]:
    with pytest.raises(ArchspecError) as info:
        load_spec(path, overrides)
    return problems(info.value)


def test_defaults_resolve_from_the_backbone(tmp_path):
    spec = load_spec(spec_file(tmp_path, "name: x\nmixer: {backbone: kda}\n"))
    assert spec.mixer.resolved_gate == "channel"
    assert spec.mixer.transition.beta_max == 1.0
    assert (spec.mixer.heads, spec.model.d_model, spec.model.layers) == (4, 256, 2)
    assert load_spec({"name": "x", "mixer": {"backbone": "gdn"}}).mixer.resolved_gate == "scalar"
    assert load_spec({"name": "x", "mixer": {"backbone": "gdn", "gate": "none"}}).mixer.resolved_gate == "none"


def test_decay_form_defaults_to_mamba2_and_needs_a_gate(tmp_path):
    assert load_spec({"name": "x", "mixer": {"backbone": "kda"}}).mixer.resolved_decay == "mamba2"
    spec = load_spec(spec_file(tmp_path, "name: x\nmixer: {backbone: kda, transition: {type: rwkv7}, decay: rwkv7}\n"))
    assert spec.mixer.resolved_decay == "rwkv7"
    got = refused(spec_file(tmp_path, "name: x\nmixer:\n  backbone: deltanet\n  decay: rwkv7\n"))
    line, column, message = got["mixer.decay"]
    assert (line, column) == (4, 10)
    assert "no gate" in message and "gate: scalar or channel" in message
    got = refused(spec_file(tmp_path, "name: x\nmixer:\n  backbone: kda\n  decay: rwkv\n"))
    assert "did you mean rwkv7?" in got["mixer.decay"][2]


def test_unknown_key_suggests_the_nearest_valid_one(tmp_path):
    got = refused(spec_file(tmp_path, """\
        name: x
        mixer:
          haeds: 4
          transition: {typ: householder}
        modle: {}
        """))
    line, column, message = got["mixer.haeds"]
    assert (line, column) == (3, 3)
    assert "unknown key 'haeds'" in message and "did you mean heads?" in message
    assert "did you mean type?" in got["mixer.transition.typ"][2]
    assert got["mixer.transition.typ"][:2] == (4, 16)
    assert "did you mean model?" in got["modle"][2]


def test_bad_choice_suggests_the_nearest_choice(tmp_path):
    got = refused(spec_file(tmp_path, "name: x\nmixer:\n  backbone: gnd\n  gate: chanel\n"))
    assert got["mixer.backbone"][:2] == (3, 13) and "did you mean gdn?" in got["mixer.backbone"][2]
    assert "did you mean channel?" in got["mixer.gate"][2]


def test_several_problems_are_all_reported_in_file_order(tmp_path):
    path = spec_file(tmp_path, """\
        name: x
        mixer:
          heads: 0
          transition: {type: diagonal, n_h: 2}
          preconditioner: {type: osdn}
        model:
          layers: -1
          mlp: relu
        """)
    with pytest.raises(ArchspecError) as info:
        load_spec(path)
    got = problems(info.value)
    # structural problems and the mixer's rules together, though `model` is also broken
    assert set(got) == {"mixer.heads", "mixer.transition.n_h", "mixer.preconditioner.type", "model.layers", "model.mlp"}
    lines = [loc.line for loc, _, _ in info.value.problems]
    assert lines == sorted(lines)
    assert "(5 problems)" in str(info.value).splitlines()[0]
    assert f"{path}:3:10: mixer.heads:" in str(info.value)


def test_n_h_above_one_only_for_householder_and_rwkv7(tmp_path):
    got = refused(spec_file(tmp_path, "name: x\nmixer:\n  transition:\n    type: diagonal\n    n_h: 2\n"))
    line, column, message = got["mixer.transition.n_h"]
    assert (line, column) == (5, 10)
    assert "householder or rwkv7" in message and "collapse into one" in message
    for kind in ("householder", "rwkv7"):
        assert load_spec({"name": "x", "mixer": {"transition": {"type": kind, "n_h": 8}}}).mixer.transition.n_h == 8
    assert "less than or equal to 8" in refused(spec_file(tmp_path, "name: x\nmixer: {transition: {n_h: 9}}\n"))[
        "mixer.transition.n_h"][2]


def test_diagonal_has_no_beta_range(tmp_path):
    got = refused(spec_file(tmp_path, "name: x\nmixer:\n  transition: {type: diagonal, beta_range: [0, 1]}\n"))
    assert "has no beta" in got["mixer.transition.beta_range"][2]


def test_beta_range_is_one_of_two(tmp_path):
    got = refused(spec_file(tmp_path, "name: x\nmixer:\n  transition: {beta_range: [0, 3]}\n"))
    line, column, message = got["mixer.transition.beta_range"]
    assert (line, column) == (3, 28)
    assert "[0, 1] or [0, 2]" in message and "reflections" in message


@pytest.mark.parametrize("kind", ["diagonal", "rwkv7"])
def test_preconditioner_only_with_householder(tmp_path, kind):
    got = refused(spec_file(tmp_path, f"name: x\nmixer:\n  transition: {{type: {kind}}}\n  preconditioner:\n    type: osdn\n"))
    line, column, message = got["mixer.preconditioner.type"]
    assert (line, column) == (5, 11)
    assert "write key" in message and "householder" in message and repr(kind) in message


def test_osdn_stability_rule_explains_the_eigenvalue(tmp_path):
    path = spec_file(tmp_path, """\
        name: x
        mixer:
          transition: {beta_range: [0, 2]}
          preconditioner:
            type: osdn
            bounds: [0.5, 2]
        """)
    line, column, message = refused(path)["mixer.preconditioner.bounds"]
    assert (line, column) == (6, 13)
    assert "1 - beta <d, k*k>" in message and "= -3 < -1" in message and "beta_max * d_max <= 2" in message
    # with the bounds left at their default the problem is placed at beta_range
    got = refused(spec_file(tmp_path, "name: x\nmixer:\n  transition: {beta_range: [0, 2]}\n  preconditioner: {type: osdn}\n"))
    assert got["mixer.transition.beta_range"][:2] == (3, 28)
    # exactly at the limit is allowed
    ok = load_spec(path, ["mixer.preconditioner.bounds=[0.5, 1.0]"])
    assert ok.mixer.preconditioner.bounds == (0.5, 1.0)


@pytest.mark.parametrize("bounds", ["[0, 2]", "[-0.5, 2]", "[1.2, 2]", "[0.5, 0.9]"])
def test_bounds_must_bracket_one(tmp_path, bounds):
    got = refused(spec_file(tmp_path, f"name: x\nmixer:\n  preconditioner: {{type: osdn, bounds: {bounds}}}\n"))
    message = got["mixer.preconditioner.bounds"][2]
    assert "0 < d_min <= 1 <= d_max" in message and "starts at 1" in message


@pytest.mark.parametrize("eta", ["0", "-0.01"])
def test_eta_must_be_positive(tmp_path, eta):
    got = refused(spec_file(tmp_path, f"name: x\nmixer:\n  preconditioner: {{type: osdn, eta: {eta}}}\n"))
    assert "eta must be > 0" in got["mixer.preconditioner.eta"][2] and "step size" in got["mixer.preconditioner.eta"][2]


def test_osdn_settings_without_osdn_are_refused(tmp_path):
    got = refused(spec_file(tmp_path, "name: x\nmixer:\n  preconditioner:\n    apf: true\n    eta: 0.01\n"))
    assert set(got) == {"mixer.preconditioner.apf", "mixer.preconditioner.eta"}
    assert "preconditioner.type: osdn" in got["mixer.preconditioner.apf"][2]
    assert got["mixer.preconditioner.apf"][:2] == (4, 10)


@pytest.mark.parametrize(
    "override, field",
    [
        ("mixer.heads=0", "mixer.heads"),
        ("mixer.head_dim=-8", "mixer.head_dim"),
        ("mixer.short_conv=-1", "mixer.short_conv"),
        ("model.d_model=0", "model.d_model"),
        ("model.layers=0", "model.layers"),
        ("model.vocab_size=0", "model.vocab_size"),
        ("mixer.expand_v=0", "mixer.expand_v"),
    ],
)
def test_sizes_must_be_positive(tmp_path, override, field):
    got = refused(spec_file(tmp_path, "name: x\n"), [override])
    origin, message = got[field]
    assert origin == f"--set {override}"
    assert "greater than" in message


def test_value_dim_must_be_whole(tmp_path):
    got = refused(spec_file(tmp_path, "name: x\nmixer: {head_dim: 64, expand_v: 0.3}\n"))
    assert "64 * 0.3 = 19.2" in got["mixer.expand_v"][2]
    assert load_spec({"name": "x", "mixer": {"head_dim": 64, "expand_v": 0.5}}).mixer.value_dim == 32


def test_name_is_required(tmp_path):
    got = refused(spec_file(tmp_path, "mixer: {heads: 2}\n"))
    assert got["name"][2] == "this key is required"


def test_overrides_apply_after_extends_and_are_located(tmp_path):
    spec_file(tmp_path, "mixer: {heads: 2, transition: {n_h: 2}}\nmodel: {layers: 1}\n", "base.yaml")
    path = spec_file(tmp_path, "name: child\nextends: base.yaml\nmixer: {heads: 3}\n")
    spec = load_spec(path, ["mixer.transition.beta_range=[0, 2]", "model.layers=4"])
    assert (spec.mixer.heads, spec.mixer.transition.n_h, spec.model.layers) == (3, 2, 4)
    assert spec.mixer.transition.beta_range == (0, 2)
    assert spec.extends is None  # resolved away
    got = refused(path, ["mixer.transition.type=diagonal"])
    assert got["mixer.transition.n_h"][:2] == (1, 37)  # where base.yaml sets it
    got = refused(path, ["mixer.haeds=4"])
    assert got["mixer.haeds"][0] == "--set mixer.haeds=4" and "did you mean heads?" in got["mixer.haeds"][1]


def test_a_spec_object_is_always_valid():
    with pytest.raises(ValidationError, match="n_h"):
        Spec(name="x", mixer={"transition": {"type": "diagonal", "n_h": 2}})
    spec = Spec(name="x", mixer={"transition": {"n_h": 2}})
    assert load_spec(spec) is spec
    assert load_spec(spec, ["mixer.heads=2"]).mixer.heads == 2


def test_load_spec_rejects_other_inputs():
    with pytest.raises(ArchspecError, match="cannot load a spec from a int"):
        load_spec(3)
