"""The general, line-aware YAML layer: positions, safety, extends, overrides, error mapping."""

from __future__ import annotations

from typing import Annotated, Literal, Union

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from archspec.errors import ArchspecError, Location
from archspec.spec.yaml_source import (
    apply_overrides,
    load_yaml_with_locations,
    merge_extends,
    parse_yaml_text,
    validation_error_to_archspec_error,
)


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def only_problem(exc: ArchspecError):
    assert len(exc.problems) == 1, exc.problems
    return exc.problems[0]


# ---------------------------------------------------------------- positions and safety


def test_positions_of_values_and_keys_are_one_based():
    doc = parse_yaml_text("a: 1\nb:\n  c: [x, {d: 2}]\n", file="f.yaml")
    assert doc.data == {"a": 1, "b": {"c": ["x", {"d": 2}]}}
    assert doc.values[("a",)] == Location("f.yaml", 1, 4)
    assert doc.keys[("b", "c")] == Location("f.yaml", 3, 3)
    assert doc.values[("b", "c", 1, "d")] == Location("f.yaml", 3, 14)
    # a path that is not in the data falls back to its nearest located ancestor
    assert doc.locate(("b", "c", 1, "zz")) == Location("f.yaml", 3, 10)
    assert doc.locate(("b", "nothing")) == Location("f.yaml", 2, 1)


def test_duplicate_key_is_refused_with_both_lines():
    with pytest.raises(ArchspecError) as info:
        parse_yaml_text("mixer:\n  heads: 2\n  heads: 4\n", file="f.yaml")
    loc, field, message = only_problem(info.value)
    assert (loc.line, loc.column, field) == (3, 3, "mixer.heads")
    assert "duplicate key 'heads'" in message and "line 2" in message


@pytest.mark.parametrize(
    "text, tag",
    [
        ("x: !!python/object:os.system {}\n", "!!python/object:os.system"),
        ("x: !!python/name:os.system ''\n", "!!python/name:os.system"),
        ("x: !!python/object/apply:os.system [echo hi]\n", "!!python/object/apply:os.system"),
        ("x: !custom 3\n", "!custom"),
    ],
)
def test_object_constructing_tags_are_refused(text, tag):
    with pytest.raises(ArchspecError) as info:
        parse_yaml_text(text, file="f.yaml")
    loc, field, message = only_problem(info.value)
    assert (loc.line, loc.column, field) == (1, 4, "x")
    assert tag in message and "not allowed" in message


def test_merge_keys_and_anchors_are_plain_data():
    doc = parse_yaml_text("base: &b {heads: 2, head_dim: 8}\nother:\n  <<: *b\n  heads: 4\n")
    assert doc.data["other"] == {"heads": 4, "head_dim": 8}


@pytest.mark.parametrize(
    "text, line, column, words",
    [
        ("a: [1, 2\nb: 3\n", 2, 2, "expected ',' or ']', but got ':' (while parsing a flow sequence at line 1, column 4)"),
        ("a: b: c\n", 1, 5, "mapping values are not allowed"),
        ("a:\n\t- 1\n", 2, 1, "cannot start any token"),
    ],
)
def test_syntax_errors_are_located(tmp_path, text, line, column, words):
    path = write(tmp_path / "bad.yaml", text)
    with pytest.raises(ArchspecError) as info:
        load_yaml_with_locations(path)
    loc, _, message = only_problem(info.value)
    assert (loc.file, loc.line, loc.column) == (str(path), line, column)
    assert words in message


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"])
def test_empty_file(tmp_path, text):
    path = write(tmp_path / "empty.yaml", text)
    with pytest.raises(ArchspecError) as info:
        load_yaml_with_locations(path)
    assert "empty" in str(info.value) and "mapping" in str(info.value)


def test_top_level_list_and_scalar(tmp_path):
    with pytest.raises(ArchspecError) as info:
        load_yaml_with_locations(write(tmp_path / "list.yaml", "- name: x\n"))
    assert "found a list" in str(info.value) and "top level must be a mapping" in str(info.value)
    with pytest.raises(ArchspecError) as info:
        load_yaml_with_locations(write(tmp_path / "scalar.yaml", "hello\n"))
    assert "found a single str value" in str(info.value)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ArchspecError, match="no such file"):
        load_yaml_with_locations(tmp_path / "nope.yaml")
    with pytest.raises(ArchspecError, match="is a directory"):
        load_yaml_with_locations(tmp_path)
    (tmp_path / "bin.yaml").write_bytes(b"a: \xff\xfe\n")
    with pytest.raises(ArchspecError, match="not UTF-8"):
        load_yaml_with_locations(tmp_path / "bin.yaml")


# ---------------------------------------------------------------- extends


def test_extends_is_relative_to_the_file_and_deep_merges(tmp_path):
    write(tmp_path / "base" / "root.yaml", "a: {x: 1, y: [1, 2, 3], z: {p: 1}}\nb: root\n")
    write(tmp_path / "base" / "mid.yaml", "extends: root.yaml\na: {y: [9]}\nc: mid\n")
    child = write(tmp_path / "models" / "child.yaml", "extends: ../base/mid.yaml\na:\n  z: {q: 2}\nb: child\n")
    doc = merge_extends(load_yaml_with_locations(child))
    assert doc.data == {"a": {"x": 1, "y": [9], "z": {"p": 1, "q": 2}}, "b": "child", "c": "mid"}
    # every value is located in the file that wrote it
    assert doc.values[("a", "x")].file.endswith("root.yaml")
    assert doc.values[("a", "y")].file.endswith("mid.yaml")
    assert doc.values[("a", "z", "q")] == Location(str(child), 3, 10)
    assert doc.values[("b",)] == Location(str(child), 4, 4)
    # positions inside a replaced list are the new list's, none stale from the base
    assert ("a", "y", 2) not in doc.values


def test_extends_list_merges_in_order(tmp_path):
    write(tmp_path / "one.yaml", "a: 1\nb: 1\n")
    write(tmp_path / "two.yaml", "b: 2\nc: 2\n")
    child = write(tmp_path / "child.yaml", "extends: [one.yaml, two.yaml]\nc: 3\n")
    assert merge_extends(load_yaml_with_locations(child)).data == {"a": 1, "b": 2, "c": 3}


def test_extends_missing_file_is_located(tmp_path):
    child = write(tmp_path / "child.yaml", "name: x\nextends: ../nowhere/base.yaml\n")
    with pytest.raises(ArchspecError) as info:
        merge_extends(load_yaml_with_locations(child))
    loc, field, message = only_problem(info.value)
    assert (loc.line, loc.column, field) == (2, 10, "extends")
    assert "no such file" in message and "nowhere" in message and "relative to" in message


def test_extends_cycle_is_reported_with_the_chain(tmp_path):
    write(tmp_path / "a.yaml", "extends: b.yaml\n")
    write(tmp_path / "b.yaml", "extends: c.yaml\n")
    write(tmp_path / "c.yaml", "extends: a.yaml\n")
    with pytest.raises(ArchspecError) as info:
        merge_extends(load_yaml_with_locations(tmp_path / "a.yaml"))
    loc, _, message = only_problem(info.value)
    assert "cycle" in message
    assert message.index("a.yaml") < message.index("b.yaml") < message.index("c.yaml")
    assert loc.file.endswith("c.yaml")
    write(tmp_path / "self.yaml", "extends: self.yaml\n")
    with pytest.raises(ArchspecError, match="cycle"):
        merge_extends(load_yaml_with_locations(tmp_path / "self.yaml"))


def test_extends_must_be_a_path(tmp_path):
    child = write(tmp_path / "child.yaml", "extends: {file: a.yaml}\n")
    with pytest.raises(ArchspecError, match="file path"):
        merge_extends(load_yaml_with_locations(child))


# ---------------------------------------------------------------- overrides


def test_overrides_nested_new_keys_and_yaml_values():
    doc = parse_yaml_text("mixer: {heads: 2, transition: {n_h: 1}}\nlist: [1, 2]\n", file="f.yaml")
    out = apply_overrides(
        doc,
        ["mixer.heads=8", "mixer.transition.beta_range=[0, 2]", "model.layers=3", "flag=true",
         "mixer.transition={type: diagonal}", "list.1=x", "empty="],
    )
    assert out.data == {
        "mixer": {"heads": 8, "transition": {"type": "diagonal"}},
        "list": [1, "x"],
        "model": {"layers": 3},
        "flag": True,
        "empty": None,
    }
    assert doc.data["mixer"]["heads"] == 2  # the input document is not changed
    assert out.values[("mixer", "heads")] == Location(origin="--set mixer.heads=8")
    assert out.values[("mixer", "transition", "type")].origin == "--set mixer.transition={type: diagonal}"
    assert ("mixer", "transition", "n_h") not in out.values  # replaced subtree: no stale position
    # Python pairs keep their types
    assert apply_overrides(doc, [("mixer.heads", 5)]).data["mixer"]["heads"] == 5


def test_overrides_reach_keys_that_hold_dots():
    """A search spec's `space:` is keyed by dotted field names: `--set` enters such a
    mapping by its longest existing key, and still creates plain nested keys elsewhere."""
    doc = parse_yaml_text("space:\n  mixer.transition.n_h: {int: [1, 4]}\n  mixer.gate: {choices: [none]}\n", file="s.yaml")
    out = apply_overrides(doc, ["space.mixer.transition.n_h.int=[1, 2]", "space.mixer.gate.choices=[none, scalar]",
                                "budget.trials=4"])
    assert out.data["space"] == {"mixer.transition.n_h": {"int": [1, 2]}, "mixer.gate": {"choices": ["none", "scalar"]}}
    assert out.data["budget"] == {"trials": 4}
    assert out.values[("space", "mixer.transition.n_h", "int")].origin == "--set space.mixer.transition.n_h.int=[1, 2]"
    assert ("space", "mixer.transition.n_h", "int", 1) in out.values


@pytest.mark.parametrize(
    "override, words",
    [
        ("mixer.heads", "dotted.key=value"),
        ("=3", "not a dotted key"),
        ("mixer..heads=3", "not a dotted key"),
        ("mixer.heads.x=3", "is 2, not a mapping"),
        ("list.5=3", "not an index"),
        ("a=[1, 2", "invalid YAML"),
        ("a=!!python/object:os.system {}", "not allowed"),
    ],
)
def test_bad_overrides_are_located_at_the_override(override, words):
    doc = parse_yaml_text("mixer: {heads: 2}\nlist: [1, 2]\n")
    with pytest.raises(ArchspecError) as info:
        apply_overrides(doc, [override])
    loc, _, message = only_problem(info.value)
    assert loc.origin == f"--set {override}"
    assert words in message


# ---------------------------------------------------------------- pydantic errors -> positions


class Leaf(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["alpha", "beta"]
    size: int = 1


class Root(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str | list[str]
    leaves: list[Leaf] = []
    named: dict[str, Leaf] = {}


def test_validation_errors_map_to_positions_fields_and_suggestions():
    text = (
        "title: {a: 1}\n"
        "leaves:\n"
        "  - kind: alpah\n"
        "    size: big\n"
        "  - kind: beta\n"
        "    sise: 2\n"
        "named:\n"
        "  one: {kind: alpha, size: -x}\n"
    )
    doc = parse_yaml_text(text, file="s.yaml")
    with pytest.raises(ValidationError) as info:
        Root.model_validate(doc.data)
    err = validation_error_to_archspec_error(info.value, doc, model=Root, title="invalid s.yaml")
    got = {(field, loc.line, loc.column) for loc, field, _ in err.problems}
    # the union `str | list[str]` reports twice (once per member), both at title's value
    assert {("title", 1, 8), ("leaves[0].kind", 3, 11), ("leaves[0].size", 4, 11),
            ("leaves[1].sise", 6, 5), ("named.one.size", 8, 28)} <= got
    messages = {field: message for _, field, message in err.problems}
    assert "did you mean alpha?" in messages["leaves[0].kind"]
    assert "unknown key 'sise'" in messages["leaves[1].sise"] and "did you mean size?" in messages["leaves[1].sise"]
    assert str(err).startswith("invalid s.yaml (")
    lines = [loc.line for loc, _, _ in err.problems]
    assert lines == sorted(lines)  # reported in file order


def test_missing_required_field_points_at_its_parent():
    doc = parse_yaml_text("leaves:\n  - size: 2\n", file="s.yaml")
    with pytest.raises(ValidationError) as info:
        Root.model_validate(doc.data)
    err = validation_error_to_archspec_error(info.value, doc, model=Root)
    problems = {field: (loc, message) for loc, field, message in err.problems}
    assert problems["title"][1] == "this key is required"
    loc, message = problems["leaves[0].kind"]
    assert message == "this key is required" and loc.line == 2


class Choice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["choice"]
    values: list[int]


class Span(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["range"]
    low: float
    high: float


class Space(BaseModel):
    """The shape search specs use: a dict of dotted fields to a discriminated union."""

    model_config = ConfigDict(extra="forbid")
    space: dict[str, Annotated[Union[Choice, Span], Field(discriminator="type")]]


def test_discriminated_unions_in_dicts_are_located_and_suggest_from_the_right_member():
    text = "space:\n  mixer.heads: {type: choice, values: [1, x]}\n  model.layers: {type: range, low: 1, hihg: 2}\n"
    doc = parse_yaml_text(text, file="s.yaml")
    with pytest.raises(ValidationError) as info:
        Space.model_validate(doc.data)
    err = validation_error_to_archspec_error(info.value, doc, model=Space)
    got = {field: (loc.line, loc.column, message) for loc, field, message in err.problems}
    assert got["space.mixer.heads.values[1]"][:2] == (2, 43)
    line, column, message = got["space.model.layers.hihg"]
    assert (line, column) == (3, 39)
    assert "did you mean high?" in message and "valid keys here: high, low, type" in message


def test_exponent_floats_without_a_dot_are_numbers():
    doc = parse_yaml_text("a: 3e-3\nb: 1E6\nc: '1e-4'\nd: -2.5e1\ne: 12\nf: e5\n")
    assert doc.data == {"a": 0.003, "b": 1e6, "c": "1e-4", "d": -25.0, "e": 12, "f": "e5"}
    assert isinstance(doc.data["e"], int)
