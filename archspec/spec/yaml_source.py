"""Line-aware, safe YAML loading: every value keeps where it was written.

A `LocatedDocument` is plain data (dicts, lists, scalars) plus two maps from a path
(`("mixer", "transition", "n_h")`, list items as ints) to a `Location`: where the value
is written and where its mapping key is written. `extends:` merging and `--set`
overrides carry these maps along, so a pydantic `ValidationError` raised on the final
data can be turned into an `ArchspecError` that names file:line:column (or the `--set`
that introduced the value) and the dotted field.

Nothing here knows the model spec: search specs use the same functions.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from archspec.errors import ArchspecError, Location

PathKey = tuple[str | int, ...]
Problem = tuple[Location | None, str | None, str]

# Tags a spec may carry: the YAML core schema. Anything else (`!!python/object`,
# custom `!tags`) is refused before any constructor runs.
_STANDARD_TAG_PREFIX = "tag:yaml.org,2002:"
_COLLECTION_TAGS = {_STANDARD_TAG_PREFIX + "map", _STANDARD_TAG_PREFIX + "seq"}
_MERGE_TAG = _STANDARD_TAG_PREFIX + "merge"
_SCALAR_TAGS = {_STANDARD_TAG_PREFIX + t for t in ("null", "bool", "int", "float", "str", "timestamp")}


@dataclass
class LocatedDocument:
    """Plain YAML data and where each piece of it came from."""

    data: Any
    values: dict[PathKey, Location] = field(default_factory=dict)
    keys: dict[PathKey, Location] = field(default_factory=dict)
    source: str | None = None  # the file the top level was read from, if any

    def locate(self, path: Sequence[str | int], *, key: bool = False) -> Location | None:
        """Where `path` is written; falls back to its nearest located ancestor."""
        path = tuple(path)
        for end in range(len(path), -1, -1):
            prefix = path[:end]
            # The key's position suits "unknown key"; the value's suits a bad value.
            # A missing field has neither, so its parent's key is the best pointer.
            first, second = (self.keys, self.values) if (key or end < len(path)) else (self.values, self.keys)
            for table in (first, second):
                if prefix in table:
                    return table[prefix]
        return Location(file=self.source) if self.source else None


def dotted(path: Iterable[str | int]) -> str:
    """`("model", "layers")` -> `model.layers`; list items as `[i]`."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


# --------------------------------------------------------------------------- reading


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as `1e-4` as numbers.

    PyYAML follows YAML 1.1, where a float needs a dot (`1.0e-4`); users write `3e-3`
    and `1e6` all the time, and a string there would only fail later, confusingly.
    """


_Loader.add_implicit_resolver(
    _STANDARD_TAG_PREFIX + "float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _mark_location(mark: yaml.Mark | None, file: str | None) -> Location:
    if mark is None:
        return Location(file=file)
    return Location(file=file, line=mark.line + 1, column=mark.column + 1)


def _yaml_error(exc: yaml.YAMLError, file: str | None, origin: str | None) -> ArchspecError:
    """A YAML syntax or constructor error as one located problem."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = Location(origin=origin) if origin else _mark_location(mark, file)
        detail = exc.problem or exc.context or "syntax error"
        if exc.context and exc.problem:
            # e.g. an unclosed `[` is noticed at the end of the file; say where it opened
            context = exc.context
            if exc.context_mark is not None and exc.context_mark is not exc.problem_mark:
                context += f" at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1}"
            detail += f" ({context})"
    else:
        where = Location(origin=origin) if origin else Location(file=file)
        detail = str(exc)
    return ArchspecError(f"{origin or file or 'input'}: invalid YAML", [(where, None, f"invalid YAML: {detail}")])


def _short_tag(tag: str) -> str:
    return "!!" + tag[len(_STANDARD_TAG_PREFIX):] if tag.startswith(_STANDARD_TAG_PREFIX) else tag


class _Builder:
    """Turns a composed node tree into plain data, recording every position."""

    def __init__(self, loader: _Loader, file: str | None, origin: str | None):
        self.loader = loader
        self.file = file
        self.origin = origin
        self.values: dict[PathKey, Location] = {}
        self.keys: dict[PathKey, Location] = {}
        self.problems: list[Problem] = []

    def where(self, node: yaml.Node) -> Location:
        if self.origin is not None:
            return Location(origin=self.origin)
        return _mark_location(node.start_mark, self.file)

    def build(self, node: yaml.Node, path: PathKey, active: tuple[int, ...] = ()) -> Any:
        self.values[path] = self.where(node)
        if id(node) in active:  # an alias that contains itself
            self.problems.append((self.where(node), dotted(path) or None, "a YAML alias refers to itself (recursive data is not allowed)"))
            return None
        active = active + (id(node),)
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path, active)
        if isinstance(node, yaml.SequenceNode):
            if node.tag not in _COLLECTION_TAGS:
                return self._bad_tag(node, path)
            return [self.build(item, path + (index,), active) for index, item in enumerate(node.value)]
        return self._scalar(node, path)

    def _bad_tag(self, node: yaml.Node, path: PathKey) -> None:
        self.problems.append(
            (self.where(node), dotted(path) or None,
             f"the YAML tag {_short_tag(node.tag)} is not allowed: specs are plain data (tags that build "
             "Python objects or run code are refused)")
        )
        return None

    def _scalar(self, node: yaml.Node, path: PathKey) -> Any:
        if node.tag not in _SCALAR_TAGS:  # e.g. `!!python/name:os.system`, `!!binary`
            return self._bad_tag(node, path)
        try:
            return self.loader.construct_object(node, deep=True)
        except yaml.YAMLError as exc:  # e.g. `!!int abc`
            self.problems.append((self.where(node), dotted(path) or None, str(getattr(exc, "problem", exc))))
            return None

    def _mapping(self, node: yaml.MappingNode, path: PathKey, active: tuple[int, ...]) -> Any:
        if node.tag not in _COLLECTION_TAGS:
            return self._bad_tag(node, path)
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self._key(key_node, path)
            if key is None:
                continue
            if key in seen:
                first = seen[key].start_mark.line + 1
                self.problems.append(
                    (self.where(key_node), dotted(path + (key,)),
                     f"duplicate key {key!r} (first written on line {first}); a later value would silently win")
                )
            seen[key] = key_node
        try:
            self.loader.flatten_mapping(node)  # resolve `<<: *anchor` merge keys
        except yaml.YAMLError as exc:
            self.problems.append((self.where(node), dotted(path) or None, str(getattr(exc, "problem", exc))))
            return {}
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = self._key(key_node, path, report=False)
            if key is None:
                continue
            self.keys[path + (key,)] = self.where(key_node)
            result[key] = self.build(value_node, path + (key,), active)
        return result

    def _key(self, node: yaml.Node, path: PathKey, report: bool = True) -> Any:
        if not isinstance(node, yaml.ScalarNode) or node.tag not in _SCALAR_TAGS:
            if report:
                self.problems.append((self.where(node), dotted(path) or None, "a mapping key must be a plain scalar such as `heads`"))
            return None
        key = self.loader.construct_object(node)
        return key if isinstance(key, (str, int, float, bool)) or key is None else str(key)


def parse_yaml_text(text: str, *, file: str | None = None, origin: str | None = None) -> LocatedDocument:
    """Parse one YAML document safely. `origin` (e.g. "--set a=1") replaces positions."""
    loader = _Loader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.YAMLError as exc:
            raise _yaml_error(exc, file, origin) from None
        if node is None:
            return LocatedDocument(data=None, source=file)
        builder = _Builder(loader, file, origin)
        data = builder.build(node, ())
    finally:
        loader.dispose()
    if builder.problems:
        raise ArchspecError(f"cannot read {file or origin or 'YAML'}", builder.problems)
    return LocatedDocument(data=data, values=builder.values, keys=builder.keys, source=file)


def load_yaml_with_locations(path: str | os.PathLike[str], *, what: str = "spec") -> LocatedDocument:
    """Read a YAML file whose top level must be a mapping, keeping every position."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ArchspecError(f"{file}: no such file") from None
    except IsADirectoryError:
        raise ArchspecError(f"{file}: is a directory, not a {what} file") from None
    except UnicodeDecodeError as exc:
        raise ArchspecError(f"{file}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ArchspecError(f"{file}: cannot read: {exc.strerror or exc}") from None
    doc = parse_yaml_text(text, file=file)
    if doc.data is None:
        raise ArchspecError(
            f"{file}: the file is empty",
            [(Location(file=file, line=1, column=1), None, f"a {what} is a YAML mapping of keys (`key: value` lines); this file has none")],
        )
    if not isinstance(doc.data, dict):
        kind = "a list" if isinstance(doc.data, list) else f"a single {type(doc.data).__name__} value"
        raise ArchspecError(
            f"{file}: the top level must be a mapping",
            [(doc.values.get((), Location(file=file)), None, f"found {kind}; a {what} is a YAML mapping of keys (`key: value` lines)")],
        )
    return doc


# --------------------------------------------------------------------------- merging


def deep_merge(base: LocatedDocument, top: LocatedDocument) -> LocatedDocument:
    """`top` over `base`: mappings merge key by key, anything else is replaced whole."""

    def merge(a: Any, b: Any) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            out = dict(a)
            for key, value in b.items():
                out[key] = merge(a[key], value) if key in a else value
            return out
        return b

    # Base positions inside a value that `top` replaced (rather than merged into) are stale.
    replaced = [
        p for p in top.values
        if not (isinstance(_get(top.data, p), dict) and isinstance(_get(base.data, p), dict))
    ]

    def fresh(q: PathKey) -> bool:
        return not any(q[: len(p)] == p for p in replaced)

    values = {q: loc for q, loc in base.values.items() if fresh(q)}
    keys = {q: loc for q, loc in base.keys.items() if fresh(q)}
    values.update(top.values)
    keys.update(top.keys)
    return LocatedDocument(data=merge(base.data, top.data), values=values, keys=keys, source=top.source)


def _get(data: Any, path: PathKey, default: Any = None) -> Any:
    for part in path:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        else:
            return default
    return data


def merge_extends(
    doc: LocatedDocument, *, key: str = "extends", what: str = "spec", _chain: tuple[Path, ...] = ()
) -> LocatedDocument:
    """Resolve `extends:` (a path or a list of paths, relative to the file that names it).

    Bases are merged in order, then the document itself on top; the `extends` key is
    dropped from the result. Missing files and cycles are located at the `extends` value.
    """
    if not isinstance(doc.data, dict) or key not in doc.data:
        return doc
    raw = doc.data[key]
    where = doc.values.get((key,))
    if raw is None:
        targets = []
    elif isinstance(raw, str):
        targets = [((key,), raw)]
    elif isinstance(raw, list) and all(isinstance(t, str) for t in raw):
        targets = [((key, i), t) for i, t in enumerate(raw)]
    else:
        raise ArchspecError(
            "invalid extends", [(where, key, f"`{key}` takes a file path or a list of file paths, got {raw!r}")]
        )
    here = Path(doc.source).resolve() if doc.source else None
    chain = _chain or ((here,) if here else ())
    base_dir = here.parent if here else Path.cwd()
    merged: LocatedDocument | None = None
    for path_key, target in targets:
        loc = doc.values.get(path_key, where)
        resolved = (base_dir / target).resolve()
        if resolved in chain:
            cycle = " -> ".join(str(p) for p in chain[chain.index(resolved):] + (resolved,))
            raise ArchspecError("extends cycle", [(loc, dotted(path_key), f"`{key}` forms a cycle: {cycle}")])
        if not resolved.is_file():
            raise ArchspecError(
                "extends: file not found",
                [(loc, dotted(path_key), f"no such file {str(resolved)!r} ({target!r} is resolved relative to "
                  f"{'the directory of ' + doc.source if doc.source else 'the current directory'})")],
            )
        base = load_yaml_with_locations(resolved, what=what)
        base = merge_extends(base, key=key, what=what, _chain=chain + (resolved,))
        merged = base if merged is None else deep_merge(merged, base)
    own = LocatedDocument(
        data={k: v for k, v in doc.data.items() if k != key},
        values={p: l for p, l in doc.values.items() if not p or p[0] != key},
        keys={p: l for p, l in doc.keys.items() if p[0] != key},
        source=doc.source,
    )
    return own if merged is None else deep_merge(merged, own)


# --------------------------------------------------------------------------- overrides

Override = str | tuple[str, Any]


def _split_override(item: Override) -> tuple[str, Any, str, bool]:
    """-> (dotted key, value or YAML text, origin text, value_is_text)."""
    if isinstance(item, tuple):
        key, value = item
        return key, value, f"override {key}={value!r}", False
    origin = f"--set {item}"
    if "=" not in item:
        raise ArchspecError(
            "bad override", [(Location(origin=origin), None, "an override is `dotted.key=value`, e.g. `--set mixer.heads=8`")]
        )
    key, text = item.split("=", 1)
    return key.strip(), text, origin, True


def apply_overrides(doc: LocatedDocument, overrides: Iterable[Override]) -> LocatedDocument:
    """Apply `dotted.key=value` overrides (value parsed as YAML) or `(key, value)` pairs.

    Missing intermediate mappings are created; a digit segment indexes a list. A mapping
    whose keys themselves hold dots (a search spec's `space:` entries, `mixer.n_h`) is
    entered by its longest existing key that the next segments spell, so that
    `space.mixer.n_h.choices=[1,2]` reaches that entry. Values set here are located at the
    override itself ("--set mixer.heads=4").
    """
    data = copy.deepcopy(doc.data) if doc.data is not None else {}
    values, keys = dict(doc.values), dict(doc.keys)
    for item in overrides:
        key, raw, origin, is_text = _split_override(item)
        where = Location(origin=origin)
        parts = key.split(".")
        if not key or any(not p for p in parts):
            raise ArchspecError("bad override", [(where, None, f"{key!r} is not a dotted key such as `mixer.heads`")])
        value = parse_yaml_text(raw, origin=origin).data if is_text else copy.deepcopy(raw)
        node, path = data, ()
        index = 0
        while index < len(parts):
            part = parts[index]
            if isinstance(node, dict):  # a dotted key that exists wins over its first segment
                for end in range(len(parts), index + 1, -1):
                    if ".".join(parts[index:end]) in node:
                        part, index = ".".join(parts[index:end]), end - 1
                        break
            if isinstance(node, list):
                if not (part.isdigit() and int(part) < len(node)):
                    raise ArchspecError(
                        "bad override",
                        [(where, dotted(path), f"{dotted(path)} is a list of {len(node)} items; {part!r} is not an index into it")],
                    )
                step: str | int = int(part)
            elif isinstance(node, dict):
                step = part
            else:
                raise ArchspecError(
                    "bad override", [(where, dotted(path), f"cannot set {key}: {dotted(path)} is {node!r}, not a mapping")]
                )
            sub = path + (step,)
            index += 1
            if index < len(parts):
                if isinstance(node, dict) and node.get(step) is None:
                    node[step] = {}  # create the missing intermediate mapping
                    values[sub] = keys[sub] = where
                node, path = node[step], sub
                continue
            node[step] = value
            for table in (values, keys):
                for stale in [p for p in table if p[: len(sub)] == sub]:
                    table.pop(stale)
            for p in _all_paths(value, sub):
                values[p] = keys[p] = where
    return LocatedDocument(data=data, values=values, keys=keys, source=doc.source)


def _all_paths(value: Any, prefix: PathKey) -> list[PathKey]:
    paths = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            paths += _all_paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            paths += _all_paths(v, prefix + (i,))
    return paths


def overrides_from_kwargs(kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Python keyword overrides: `mixer__heads=4` or `**{"mixer.heads": 4}`."""
    return [(name.replace("__", "."), value) for name, value in kwargs.items()]


# --------------------------------------------------------------------------- errors


def _model_fields(model: Any) -> dict[str, Any] | None:
    if isinstance(model, type) and issubclass(model, BaseModel):
        return {(info.alias or name): info.annotation for name, info in model.model_fields.items()}
    return None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, unions, Annotated)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _container_item(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _container_item(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            item = _container_item(arg)
            if item is not None:
                return item
        return None
    if origin in (list, tuple, set, frozenset, Sequence):
        args = typing.get_args(annotation)
        return args[0] if args else None
    if origin in (dict, Mapping):
        args = typing.get_args(annotation)
        return args[1] if len(args) == 2 else None
    return None


def _resolve_loc(loc: Sequence[str | int], data: Any, root: type[BaseModel] | None, error_type: str):
    """Pydantic's loc -> (data path, the model that owns the last step or None).

    Pydantic puts union members and validator tags (`'list[str]'`, `'function-after[...]'`)
    into `loc`; steps that are neither present in the data nor a field of the current
    model are such tags and are skipped.
    """
    path: list[str | int] = []
    models: list[type[BaseModel]] = [root] if root else []
    annotation: Any = None
    owner: type[BaseModel] | None = None
    for index, part in enumerate(loc):
        last = index == len(loc) - 1
        fields = {}
        for m in models:
            fields.update(_model_fields(m) or {})
        in_data = (isinstance(data, dict) and part in data) or (
            isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data)
        )
        is_field = isinstance(part, str) and part in fields
        container_step = isinstance(part, int) or (annotation is not None and _container_item(annotation) is not None and in_data)
        if not (in_data or is_field or container_step or (last and error_type in ("missing", "extra_forbidden"))):
            # a union member or validator tag: if it names one of the candidate models
            # (class name, or discriminator value), the rest of `loc` is inside that one
            named = [m for m in models if _names_model(m, part)]
            models = named or models
            continue
        owner = models[0] if models and (is_field or not in_data or error_type == "extra_forbidden") else owner
        path.append(part)
        if is_field:
            annotation = fields[part]
            models = _models_in(annotation)
        elif annotation is not None and _container_item(annotation) is not None:
            annotation = _container_item(annotation)
            models = _models_in(annotation)
        else:
            annotation, models = None, []
        data = data[part] if in_data else None
    return tuple(path), owner


def _names_model(model: type[BaseModel], tag: Any) -> bool:
    if tag == model.__name__:
        return True
    for info in model.model_fields.values():
        if typing.get_origin(info.annotation) is typing.Literal and tag in typing.get_args(info.annotation):
            return True
    return False


def _suggestion(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML terms, short."""
    if value is None:
        return "null"
    if isinstance(value, (str, bool, int, float, list, dict, tuple)):
        text = repr(value)
    else:  # dates and the like: their YAML spelling
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _message(err: Mapping[str, Any], path: PathKey, owner: type[BaseModel] | None, value: Any) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        valid = sorted((_model_fields(owner) or {}).keys())
        hint = _suggestion(path[-1], valid) if path else ""
        listing = f"; valid keys here: {', '.join(valid)}" if valid else ""
        return f"unknown key {path[-1]!r}{hint}{listing}"
    if kind == "missing":
        return "this key is required"
    msg = err["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]  # our own validators' messages say it all
    msg = msg[0].lower() + msg[1:]
    hint = ""
    if kind in ("literal_error", "enum") and isinstance(value, str):
        hint = _suggestion(value, re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", ""))))
    return f"got {_show(value)}: {msg}{hint}"


def locate_problems(doc: LocatedDocument, problems: Iterable[tuple[PathKey, str]]) -> list[Problem]:
    """Problems given as (data path, message) -> located problems."""
    return [(doc.locate(path), dotted(path) or None, message) for path, message in problems]


def validation_problems(
    error: ValidationError, doc: LocatedDocument, *, model: type[BaseModel] | None = None
) -> list[Problem]:
    """Every problem of a pydantic `ValidationError`, located in `doc`.

    `model` is the root model that was validated (for "did you mean" on unknown keys).
    """
    problems: list[Problem] = []
    for err in error.errors(include_url=False):
        path, owner = _resolve_loc(err["loc"], doc.data, model, err["type"])
        value = err.get("input")
        location = doc.locate(path, key=err["type"] == "extra_forbidden")
        problems.append((location, dotted(path) or None, _message(err, path, owner, value)))
    return problems


def error_from_problems(title: str, problems: list[Problem]) -> ArchspecError:
    """One error for all problems, in file order, with a count in the headline."""

    def order(problem: Problem):
        loc = problem[0]
        if loc is None or loc.origin is not None:
            return (1, 0, 0)
        return (0, loc.line or 0, loc.column or 0)

    count = len(problems)
    return ArchspecError(f"{title} ({count} problem{'s' if count != 1 else ''})", sorted(problems, key=order))


def validation_error_to_archspec_error(
    error: ValidationError, doc: LocatedDocument, *, model: type[BaseModel] | None = None, title: str | None = None
) -> ArchspecError:
    """Map a pydantic `ValidationError` onto file:line:column and dotted fields."""
    return error_from_problems(title or f"invalid {doc.source or 'input'}", validation_problems(error, doc, model=model))


ModelT = typing.TypeVar("ModelT", bound=BaseModel)


def load_validated(
    path: str | os.PathLike[str],
    model: type[ModelT],
    *,
    what: str,
    overrides: Iterable[Override] = (),
) -> tuple[ModelT, LocatedDocument]:
    """Read a YAML file, apply `--set` overrides and validate it against `model`.

    The one path for files without `extends:` (search specs, experiments): every problem
    is raised at once as an `ArchspecError` at file:line:column (or the `--set`) and the
    dotted field. Returns the model and the located document, for checks of its own.
    """
    doc = apply_overrides(load_yaml_with_locations(path, what=what), list(overrides))
    try:
        return model.model_validate(doc.data), doc
    except ValidationError as exc:
        raise validation_error_to_archspec_error(exc, doc, model=model, title=f"invalid {what} {doc.source}") from None

