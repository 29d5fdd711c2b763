"""Hybrid stacks in the spec language: which layer is what, every refusal with its
place, overrides, lowering into per-layer plans, saved modules."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

import archspec
from archspec.blocks.plan import AttentionPlan, RecurrencePlan
from archspec.compiler import load_compiled, save_compiled
from archspec.errors import ArchspecError
from archspec.spec import load_spec
from archspec.spec.layout import layer_kinds, layer_sections

MODELS = Path(__file__).resolve().parents[2] / "specs" / "models"


def spec_file(tmp_path, body: str):
    path = tmp_path / "spec.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def refused(source, overrides=()) -> dict[str, tuple]:
    """dotted field -> (line, column, message), or (origin, message) for a --set."""
    with pytest.raises(ArchspecError) as info:
        load_spec(source, overrides)
    out = {}
    for loc, field, message in info.value.problems:
        out[field] = ((loc.origin,) if loc.origin else (loc.line, loc.column)) + (message,)
    return out


def kinds(layout: dict, layers: int) -> str:
    spec = load_spec({"name": "x", "layout": layout, "model": {"layers": layers}})
    return "".join("A" if k == "attention" else "r" for k in layer_kinds(spec.layout, layers))


def test_pattern_ratio_and_indices_say_which_layer_is_attention():
    assert kinds({}, 4) == "rrrr"
    assert kinds({"ratio": "3:1"}, 8) == "rrrArrrA"
    assert kinds({"ratio": "3:1"}, 6) == "rrrArr"  # tiled, cut at the depth
    assert kinds({"ratio": " 1 : 2 "}, 6) == "rAArAA"
    assert kinds({"ratio": "0:1"}, 3) == "AAA"
    assert kinds({"pattern": ["attention", "recurrent"]}, 5) == "ArArA"
    assert kinds({"attention_at": [0, 4]}, 5) == "ArrrA"
    assert kinds({"ratio": "3:1", "attention_at": [0]}, 8) == "ArrArrrA"
    # HF transformers' Qwen3-Next rule: full attention where (i + 1) % interval == 0
    assert kinds({"ratio": "3:1"}, 48) == "".join("A" if (i + 1) % 4 == 0 else "r" for i in range(48))
    assert load_spec({"name": "x", "layout": {"ratio": " 3 :1"}}).layout.ratio == "3:1"


def test_overrides_replace_the_fields_they_write_and_keep_the_rest():
    spec = load_spec({
        "name": "x",
        "mixer": {"backbone": "kda", "heads": 2, "head_dim": 8},
        "attention": {"heads": 4, "kv_heads": 2, "head_dim": 8},
        "layout": {"ratio": "1:1", "overrides": [
            {"layers": [2], "mixer": {"backbone": "gdn", "transition": {"n_h": 2, "beta_range": [0, 2]}}},
            {"layers": [3], "attention": {"window": 16, "kv_heads": 1}},
        ]},
        "model": {"layers": 4},
    })
    first, _, third, fourth = layer_sections(spec)
    assert (first.backbone, first.resolved_gate, first.transition.n_h) == ("kda", "channel", 1)
    # the override's backbone brings its default gate; heads and head_dim come from the base
    assert (third.backbone, third.resolved_gate, third.transition.n_h, third.transition.beta_max) == ("gdn", "scalar", 2, 2.0)
    assert (third.heads, third.head_dim) == (2, 8)
    assert (fourth.window, fourth.resolved_kv_heads, fourth.heads) == (16, 1, 4)

    plan = archspec.lower(spec)
    assert [p.kind for p in plan.layer_plans] == ["recurrent", "attention", "recurrent", "attention"]
    assert plan.layer_plans[0] == plan.mixer and plan.layer_plans[2].n_h == 2 and plan.layer_plans[2].gate == "scalar"
    assert plan.layer_plans[1] == AttentionPlan(heads=4, kv_heads=2, head_dim=8)
    assert plan.layer_plans[3] == AttentionPlan(heads=4, kv_heads=1, head_dim=8, window=16)
    assert plan.hybrid


def test_a_uniform_spec_lowers_to_an_empty_stack():
    plan = archspec.lower({"name": "x", "model": {"layers": 3}, "attention": {"heads": 2}})
    assert plan.stack == () and not plan.hybrid
    assert plan.layer_plans == (plan.mixer,) * 3 and isinstance(plan.mixer, RecurrencePlan)


def test_attention_settings_resolve():
    plan = archspec.lower({"name": "x", "layout": {"ratio": "0:1"}, "attention": {"heads": 6, "rope": False}})
    assert plan.layer_plans[0] == AttentionPlan(heads=6, kv_heads=6, head_dim=64, rope_theta=None)
    plan = archspec.lower({"name": "x", "layout": {"ratio": "0:1"}, "attention": {"rope_theta": 5e5}})
    assert plan.layer_plans[0].rope_theta == 5e5


def test_every_layout_rule_is_refused_at_its_place(tmp_path):
    got = refused(spec_file(tmp_path, """\
        name: bad
        model: {layers: 4}
        attention:
          heads: 6
          kv_heads: 4
          head_dim: 5
        layout:
          ratio: "3:1"
          pattern: [recurrent]
          attention_at: [1, 7, 1]
          overrides:
            - {layers: [3], mixer: {backbone: gdn}}
            - {layers: [0, 2], mixer: {transition: {type: diagonal}}}
            - {layers: [2, 9], attention: {heads: 2}}
            - {layers: [2], mixer: {heads: 2}}
        mixer:
          transition: {beta_range: [0, 2]}
        """))
    line, column, message = got["attention.kv_heads"]
    assert (line, column) == (5, 13)
    assert "kv_heads = 4 does not divide heads = 6" in message and "divisors of 6: 1, 2, 3, 6" in message
    assert "RoPE rotates pairs" in got["attention.head_dim"][2]
    assert got["layout.ratio"][:2] == (8, 10) and "not both" in got["layout.ratio"][2]
    assert got["layout.attention_at[1]"][:2] == (10, 21)
    assert "layer 7 is past the last layer: model.layers = 4, so layer indices run 0..3" in got["layout.attention_at[1]"][2]
    assert "listed twice" in got["layout.attention_at[2]"][2]
    # with both given the pattern [recurrent] counts, so only layer 1 (by index) is attention
    assert "layout.overrides[0].layers[0]" not in got
    assert "diagonal transition has no beta" in got["layout.overrides[1].mixer"][2]
    assert got["layout.overrides[1].mixer"][2].startswith("with this override, mixer.transition.beta_range:")
    assert "layer 2 is a recurrent layer; an override with `attention:` applies to attention layers only" in got["layout.overrides[2].layers[0]"][2]
    assert "layer 9 is past the last layer" in got["layout.overrides[2].layers[1]"][2]
    assert "kv_heads = 4 does not divide heads = 2" in got["layout.overrides[2].attention"][2]
    assert "layer 2 is already overridden by layout.overrides[1]" in got["layout.overrides[3].layers[0]"][2]


@pytest.mark.parametrize(
    "body, field, expected",
    [
        ("attention: {window: 0}", "attention.window", "window must be between 1 and 1048576 tokens, got 0"),
        ("attention: {window: 10000000}", "attention.window", "for full causal attention write window: null"),
        ("attention: {rope: false, rope_theta: 100}", "attention.rope_theta", "rope is off here"),
        ("attention: {window: true}", "attention.window", "a boolean, where a number belongs"),
        ("attention: {kv_heads: 2.5}", "attention.kv_heads", "valid integer"),
        ("attention: {rope_theta: .inf}", "attention.rope_theta", "finite number"),
        ("layout: {attention_at: [true]}", "layout.attention_at", "a boolean, where a number belongs"),
        ("layout: {ratio: '3-1'}", "layout.ratio", "ratio is written 'R:A'"),
        ("layout: {ratio: 3:1}", "layout.ratio", "YAML reads an unquoted 3:1 as a base-60 number; quote the ratio: '3:1'"),
        ("layout: {ratio: '0:0'}", "layout.ratio", "names no layer"),
        ("layout: {attention_at: [-1]}", "layout.attention_at[0]", "greater than or equal to 0"),
        ("layout: {pattern: [recurrent, atention]}", "layout.pattern[1]", "did you mean attention?"),
        ("layout: {overrides: [{layers: [0]}]}", "layout.overrides[0]", "exactly one of `mixer:`"),
        ("layout: {overrides: [{layers: [], mixer: {heads: 2}}]}", "layout.overrides[0].layers", "at least 1 item"),
        ("layout: {overrides: [{layers: [0], mixer: {haeds: 2}}]}", "layout.overrides[0].mixer.haeds", "did you mean heads?"),
    ],
)
def test_bad_layout_and_attention_values_are_refused(tmp_path, body, field, expected):
    got = refused(spec_file(tmp_path, f"name: x\n{body}\n"))
    assert field in got, got
    assert got[field][0] == 2 and expected in got[field][2]


def test_a_set_override_is_located_as_the_override(tmp_path):
    path = spec_file(tmp_path, "name: x\nmodel: {layers: 4}\n")
    got = refused(path, ["layout.attention_at=[4]"])
    assert got["layout.attention_at[0]"][0] == "--set layout.attention_at=[4]"


def test_a_spec_written_back_loads_to_the_same_layers(tmp_path):
    """Overrides keep only what they write when dumped, so the reloaded overrides do not
    replace the base section with defaults."""
    spec = load_spec(MODELS / "jet-nemotron-placement.yaml", ["layout.overrides=[{layers: [5], mixer: {transition: {n_h: 2}}}]"])
    again = load_spec(spec.model_dump(mode="json"))
    assert layer_sections(again) == layer_sections(spec)
    assert archspec.lower(again) == archspec.lower(spec)
    assert archspec.lower(again).layer_plans[5].head_dim == 48


def test_a_saved_hybrid_module_rebuilds_with_the_same_outputs(tmp_path):
    spec = load_spec(MODELS / "qwen3-next-hybrid.yaml", ["model.layers=4", "model.d_model=32", "mixer.heads=2",
                                                         "mixer.head_dim=8", "attention.head_dim=8",
                                                         "layout.overrides=[{layers: [3], attention: {window: 3}}]"])
    torch.manual_seed(0)
    model = archspec.compile(spec)
    target = tmp_path / "model.pt"
    save_compiled(model, spec, target)
    again = load_compiled(target)
    assert again.plan == model.plan and again.plan.layer_plans[3].window == 3
    ids = torch.randint(0, 256, (2, 9))
    torch.testing.assert_close(again(ids), model(ids))


@pytest.mark.parametrize("name", ["qwen3-next-hybrid", "kimi-linear-hybrid", "jet-nemotron-placement"])
def test_the_shipped_hybrids_place_their_attention_as_their_sources(name):
    plan = archspec.lower(load_spec(MODELS / f"{name}.yaml"))
    attention = {i: p for i, p in enumerate(plan.layer_plans) if isinstance(p, AttentionPlan)}
    if name == "jet-nemotron-placement":
        assert plan.layers == 28 and sorted(attention) == [14, 19, 20, 21]
        assert [attention[i].window for i in (14, 19, 20, 21)] == [None, None, 1152, 1152]
    else:
        assert plan.layers == 8 and sorted(attention) == [3, 7]
    if name == "kimi-linear-hybrid":
        assert attention[3].rope_theta is None and plan.mixer.backbone == "kda"
    if name == "qwen3-next-hybrid":
        assert attention[3].output_gate and plan.mixer.backbone == "gdn"
