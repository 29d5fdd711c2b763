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
import errno
import math
import os
import re
import stat
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
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

# Limits of what the reader accepts. A spec is a few kilobytes of a few levels; these are
# far above any real one and far below what would exhaust memory or Python's stack
# (docs/spec-language.md, "Limits"). Each is refused with its own message.
MAX_FILE_BYTES = 1 << 20  # a file is read only up to this size (1 MiB)
MAX_DEPTH = 64  # nesting of mappings and lists (PyYAML composes nodes recursively)
MAX_ALIAS_VALUES = 10_000  # values that aliases and `<<` merge keys may copy, in all
MAX_EXTENDS_CHAIN = 32  # files in one chain of `extends:`, each extending the next
MAX_EXTENDS_FILES = 256  # base files one spec may reach through `extends:`, in all

# What YAML allows in a stream (PyYAML's reader refuses the rest with a raw ReaderError):
# tab, line feed, carriage return and the printable characters.
_NOT_IN_YAML = re.compile("[^\x09\x0A\x0D\x20-\x7E\x85\xA0-\uD7FF\uE000-\uFFFD\U00010000-\U0010FFFF]")
# Control characters inside a string value (written as escapes, "\x07", "\0"): none is
# meaningful in a spec, and a NUL byte in a path makes the operating system refuse it.
_CONTROL_IN_STRING = re.compile("[\x00-\x08\x0B\x0C\x0E-\x1F\x7F-\x9F]")


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
    """SafeLoader that also reads YAML 1.2 floats such as `1e-4` as numbers, and refuses
    nesting deeper than `MAX_DEPTH` before Python's stack runs out.

    PyYAML follows YAML 1.1, where a float needs a dot (`1.0e-4`); users write `3e-3`
    and `1e6` all the time, and a string there would only fail later, confusingly.
    """

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _OverLimit(f"the data is nested more than {MAX_DEPTH} levels deep", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_Loader.add_implicit_resolver(
    _STANDARD_TAG_PREFIX + "float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


class _OverLimit(Exception):
    """Input beyond one of the reader's limits (depth, alias expansion), with where."""

    def __init__(self, message: str, mark: yaml.Mark | None):
        super().__init__(message)
        self.mark = mark


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


def _over_limit_error(exc: _OverLimit, file: str | None, origin: str | None) -> ArchspecError:
    where = Location(origin=origin) if origin else _mark_location(exc.mark, file)
    return ArchspecError(f"{origin or file or 'input'}: refused by the reader's limits", [(where, None, str(exc))])


def _short_tag(tag: str) -> str:
    return "!!" + tag[len(_STANDARD_TAG_PREFIX):] if tag.startswith(_STANDARD_TAG_PREFIX) else tag


def _character_name(char: str) -> str:
    names = {"\0": "NUL", "\x07": "BEL", "\x08": "backspace", "\x1b": "ESC", "\x7f": "DEL"}
    code = f"U+{ord(char):04X}"
    return f"{code} ({names[char]})" if char in names else code


def _text_problems(text: str, file: str | None, origin: str | None) -> list[Problem]:
    """Characters YAML does not allow in a stream, located (PyYAML would say only
    "position 7" of "<unicode string>"). At most a few are listed, with a count."""
    shown, found = 3, list(_NOT_IN_YAML.finditer(text))
    problems: list[Problem] = []
    for match in found[:shown]:
        if origin is not None:
            where = Location(origin=origin)
        else:
            line = text.count("\n", 0, match.start()) + 1
            where = Location(file=file, line=line, column=match.start() - text.rfind("\n", 0, match.start()))
        problems.append((where, None, f"the control character {_character_name(match.group())} is not allowed in YAML "
                         "(only tab, line feed and carriage return are); remove it"))
    if len(found) > shown:
        problems.append((Location(origin=origin) if origin else Location(file=file), None,
                         f"... and {len(found) - shown} more such characters"))
    return problems


class _Builder:
    """Turns a composed node tree into plain data, recording every position.

    PyYAML shares the node of an anchor among its aliases; plain data copies it once per
    alias, so a few lines of nested aliases can stand for billions of values. Every node
    built a second time, and every pair a `<<` merge key copies, counts against
    `MAX_ALIAS_VALUES`.
    """

    def __init__(self, loader: _Loader, file: str | None, origin: str | None):
        self.loader = loader
        self.file = file
        self.origin = origin
        self.values: dict[PathKey, Location] = {}
        self.keys: dict[PathKey, Location] = {}
        self.problems: list[Problem] = []
        self._built: set[int] = set()
        self._copies = 0
        self._merged: dict[int, list[tuple[yaml.Node, yaml.Node]]] = {}  # mapping -> its pairs after `<<`

    def where(self, node: yaml.Node) -> Location:
        if self.origin is not None:
            return Location(origin=self.origin)
        return _mark_location(node.start_mark, self.file)

    def _count_copies(self, count: int, node: yaml.Node) -> None:
        self._copies += count
        if self._copies > MAX_ALIAS_VALUES:
            raise _OverLimit(
                f"aliases (`*name`) and merge keys (`<<`) expand to more than {MAX_ALIAS_VALUES:,} values (counted "
                "up to the anchor written here); nested aliases multiply, which is how a small file fills memory",
                node.start_mark,
            )

    def build(self, node: yaml.Node, path: PathKey, active: tuple[int, ...] = ()) -> Any:
        self.values[path] = self.where(node)
        if id(node) in active:  # an alias that contains itself
            self.problems.append((self.where(node), dotted(path) or None, "a YAML alias refers to itself (recursive data is not allowed)"))
            return None
        if id(node) in self._built:
            self._count_copies(1, node)
        self._built.add(id(node))
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
            value = self.loader.construct_object(node, deep=True)
        except yaml.YAMLError as exc:  # e.g. `!!int abc`
            self.problems.append((self.where(node), dotted(path) or None, str(getattr(exc, "problem", exc))))
            return None
        problem = _scalar_problem(value, node.value)
        if problem:
            self.problems.append((self.where(node), dotted(path) or None, problem))
            return None
        return value

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
        pairs = self._pairs(node, path, active, depth=0)
        if pairs is None:
            return {}
        result: dict[Any, Any] = {}
        for key_node, value_node in pairs:
            key = self._key(key_node, path, report=False)
            if key is None:
                continue
            self.keys[path + (key,)] = self.where(key_node)
            result[key] = self.build(value_node, path + (key,), active)
        return result

    def _pairs(
        self, node: yaml.MappingNode, path: PathKey, active: tuple[int, ...], depth: int
    ) -> list[tuple[yaml.Node, yaml.Node]] | None:
        """The mapping's key/value nodes with `<<` merge keys resolved, one pair per key.

        As the merge-key type says: the mapping's own keys win, then the merged mappings
        in the order listed. Each mapping is resolved once (a chain of merges through
        aliases reuses what was resolved when its anchor was read).
        """
        if id(node) in self._merged:
            return self._merged[id(node)]
        if depth > MAX_DEPTH:
            raise _OverLimit(f"merge keys (`<<`) are chained more than {MAX_DEPTH} levels deep", node.start_mark)
        chosen: dict[Any, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self._key(key_node, path, report=False)
            if key is not None:
                chosen.setdefault(key, (key_node, value_node))
        for key_node, value_node in node.value:
            if key_node.tag != _MERGE_TAG:
                continue
            if isinstance(value_node, yaml.MappingNode):
                sources = [value_node]
            elif isinstance(value_node, yaml.SequenceNode) and all(isinstance(s, yaml.MappingNode) for s in value_node.value):
                sources = list(value_node.value)
            else:
                self.problems.append((self.where(value_node), dotted(path) or None,
                                      "a merge key `<<` takes a mapping or a list of mappings, e.g. `<<: *base`"))
                return None
            for source in sources:
                if id(source) in active or source is node:
                    self.problems.append((self.where(source), dotted(path) or None,
                                          "a merge key `<<` merges a mapping into itself (recursive data is not allowed)"))
                    return None
                if source.tag not in _COLLECTION_TAGS:
                    self._bad_tag(source, path)
                    return None
                inner = self._pairs(source, path, active + (id(source),), depth + 1)
                if inner is None:
                    return None
                self._count_copies(len(inner), source)
                for pair in inner:
                    key = self._key(pair[0], path, report=False)
                    if key is not None:
                        chosen.setdefault(key, pair)
        pairs = list(chosen.values())
        self._merged[id(node)] = pairs
        return pairs

    def _key(self, node: yaml.Node, path: PathKey, report: bool = True) -> Any:
        if not isinstance(node, yaml.ScalarNode) or node.tag not in _SCALAR_TAGS:
            if report:
                self.problems.append((self.where(node), dotted(path) or None, "a mapping key must be a plain scalar such as `heads`"))
            return None
        try:
            key = self.loader.construct_object(node)
        except yaml.YAMLError as exc:
            if report:
                self.problems.append((self.where(node), dotted(path) or None, str(getattr(exc, "problem", exc))))
            return None
        problem = "a mapping key cannot be null (`~`, `null` or nothing before the colon): what it holds would be lost" \
            if key is None else _scalar_problem(key, node.value)
        if problem:
            if report:
                self.problems.append((self.where(node), dotted(path) or None, problem))
            return None
        return key if isinstance(key, (str, int, float, bool)) else str(key)


def _scalar_problem(value: Any, written: str) -> str | None:
    """Why a scalar is refused: a number that is not finite, a control character in a string."""
    if isinstance(value, float) and not math.isfinite(value):
        if written.strip().lstrip("+-").lower() in (".inf", ".nan"):
            return f"{written} is not a finite number: infinities and NaN are not accepted (they pass range checks and fail later)"
        return f"{written} is too large for a number (beyond about 1.8e308 it reads as infinity)"
    if isinstance(value, str) and (match := _CONTROL_IN_STRING.search(value)):
        return f"the string holds the control character {_character_name(match.group())}; strings in a spec cannot hold control characters"
    return None


def parse_yaml_text(text: str, *, file: str | None = None, origin: str | None = None) -> LocatedDocument:
    """Parse one YAML document safely. `origin` (e.g. "--set a=1") replaces positions."""
    problems = _text_problems(text, file, origin)
    if problems:
        raise ArchspecError(f"cannot read {origin or file or 'YAML'}", problems)
    loader = _Loader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.YAMLError as exc:
            raise _yaml_error(exc, file, origin) from None
        except _OverLimit as exc:
            raise _over_limit_error(exc, file, origin) from None
        if node is None:
            return LocatedDocument(data=None, source=file)
        builder = _Builder(loader, file, origin)
        try:
            data = builder.build(node, ())
        except _OverLimit as exc:
            raise _over_limit_error(exc, file, origin) from None
    finally:
        loader.dispose()
    if builder.problems:
        raise ArchspecError(f"cannot read {file or origin or 'YAML'}", builder.problems)
    return LocatedDocument(data=data, values=builder.values, keys=builder.keys, source=file)


_FILE_KINDS = {
    stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFSOCK: "a socket",
}


def unreadable_reason(path: str | os.PathLike[str], *, what: str = "spec") -> str | None:
    """Why `path` cannot be read as a `what` file (missing, a directory, a device, a
    symlink loop, too large, a NUL byte in its name), or None if it is a regular file
    of an acceptable size."""
    name = os.fspath(path)
    if "\0" in name:
        return "a path cannot hold a NUL byte"
    try:
        info = os.stat(name)  # follows symlinks: a loop is ELOOP
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a loop of symbolic links: the path never reaches a file"
        if exc.errno == errno.ENOTDIR:
            return "no such file (a part of the path is a file, not a directory)"
        return f"cannot read: {exc.strerror or exc}"
    if stat.S_ISDIR(info.st_mode):
        return f"is a directory, not a {what} file"
    if not stat.S_ISREG(info.st_mode):
        kind = _FILE_KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
        return f"is {kind}; a {what} is read only from a regular file"
    if info.st_size > MAX_FILE_BYTES:
        return _too_large(info.st_size, what)
    return None


def _too_large(size: int | None, what: str) -> str:
    actual = f" ({size:,} bytes)" if size is not None else ""
    return f"the file is larger than {MAX_FILE_BYTES:,} bytes{actual}, the most a {what} may be"


class _Unreadable(Exception):
    """A file that is not read, and why (callers locate it where the path was written)."""


def _read_text(path: str | os.PathLike[str], what: str) -> str:
    reason = unreadable_reason(path, what=what)
    if reason:
        raise _Unreadable(reason)
    try:
        # O_NONBLOCK: should the path have become a FIFO since the check, open does not hang.
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _Unreadable(f"cannot read: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _Unreadable(f"is not a regular file; a {what} is read only from a regular file")
        data = handle.read(MAX_FILE_BYTES + 1)  # a file that grows while read is still bounded
    if len(data) > MAX_FILE_BYTES:
        raise _Unreadable(_too_large(None, what))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Unreadable(f"not UTF-8 text (byte {exc.start})") from None


def load_yaml_with_locations(path: str | os.PathLike[str], *, what: str = "spec") -> LocatedDocument:
    """Read a YAML file whose top level must be a mapping, keeping every position.

    Only regular files up to `MAX_FILE_BYTES` are read; nesting and alias expansion are
    bounded too (`MAX_DEPTH`, `MAX_ALIAS_VALUES`), each refused with a located message.
    """
    file = os.fspath(path)
    try:
        text = _read_text(path, what)
    except _Unreadable as exc:
        raise ArchspecError(f"{file}: {exc}") from None
    return _mapping_document(parse_yaml_text(text, file=file), file, what)


def _mapping_document(doc: LocatedDocument, file: str, what: str) -> LocatedDocument:
    """`doc`, if its top level is a mapping; else a located error."""
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
    doc: LocatedDocument, *, key: str = "extends", what: str = "spec", _chain: tuple[Path, ...] = (),
    _files_read: list[int] | None = None,
) -> LocatedDocument:
    """Resolve `extends:` (a path or a list of paths, relative to the file that names it).

    Bases are merged in order, then the document itself on top; the `extends` key is
    dropped from the result. Missing or unreadable files, cycles, chains deeper than
    `MAX_EXTENDS_CHAIN` and more than `MAX_EXTENDS_FILES` bases in all are located at the
    `extends` value.
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
    files_read = _files_read if _files_read is not None else [0]
    base_dir = here.parent if here else Path.cwd()
    relative_to = "the directory of " + doc.source if doc.source else "the current directory"
    merged: LocatedDocument | None = None
    for path_key, target in targets:
        loc = doc.values.get(path_key, where)

        def refuse(title: str, message: str) -> ArchspecError:
            return ArchspecError(title, [(loc, dotted(path_key), message)])  # noqa: B023 (used at once)

        if "\0" in target:
            raise refuse("invalid extends", f"{target!r}: a path cannot hold a NUL byte")
        try:
            resolved = (base_dir / target).resolve()
        except (OSError, RuntimeError, ValueError):  # Python 3.11 raises RuntimeError for a symlink loop
            raise refuse("invalid extends", f"{target!r} is a loop of symbolic links: the path never reaches a file") from None
        if resolved in chain:
            cycle = " -> ".join(str(p) for p in chain[chain.index(resolved):] + (resolved,))
            raise refuse("extends cycle", f"`{key}` forms a cycle: {cycle}")
        if len(chain) > MAX_EXTENDS_CHAIN:
            raise refuse("extends chain too long", f"`{key}` chains more than {MAX_EXTENDS_CHAIN} files, each extending the next")
        files_read[0] += 1
        if files_read[0] > MAX_EXTENDS_FILES:
            raise refuse("too many extends", f"`{key}` reaches more than {MAX_EXTENDS_FILES} base files in all")
        reason = unreadable_reason(resolved, what=what)
        if reason == "no such file":
            raise refuse("extends: file not found",
                         f"no such file {str(resolved)!r} ({target!r} is resolved relative to {relative_to})")
        try:
            text = _read_text(resolved, what)
        except _Unreadable as exc:
            raise refuse("extends: cannot read the base", f"{str(resolved)!r}: {exc}") from None
        base = _mapping_document(parse_yaml_text(text, file=str(resolved)), str(resolved), what)
        base = merge_extends(base, key=key, what=what, _chain=chain + (resolved,), _files_read=files_read)
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
    origin = f"--set {_NOT_IN_YAML.sub(lambda m: repr(m.group())[1:-1], item)}"  # control characters shown escaped
    if "=" not in item:
        raise ArchspecError(
            "bad override", [(Location(origin=origin), None, "an override is `dotted.key=value`, e.g. `--set mixer.heads=8`")]
        )
    key, text = item.split("=", 1)
    return key.strip(), text, origin, True


def _parse_override_value(text: str, key: str, origin: str) -> Any:
    """An override's YAML value; its problems name the field from the top (`a.b[1]`)."""
    try:
        return parse_yaml_text(text, origin=origin).data
    except ArchspecError as exc:
        exc.problems = [(where, key + ("" if not field else field if field.startswith("[") else "." + field), message)
                        for where, field, message in exc.problems]
        raise


def override_keys(overrides: Iterable[Override]) -> list[tuple[str, Location]]:
    """The dotted key of each override, with where it was given (for refusing an
    override that cannot take effect before anything is applied)."""
    keys = []
    for item in overrides:
        key, _, origin, _ = _split_override(item)
        keys.append((key, Location(origin=origin)))
    return keys


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
        value = _parse_override_value(raw, key, origin) if is_text else copy.deepcopy(raw)
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


Semantic = Callable[[Any, LocatedDocument], list[tuple[PathKey, str]]]


def load_validated(
    path: str | os.PathLike[str],
    model: type[ModelT],
    *,
    what: str,
    overrides: Iterable[Override] = (),
    semantic: Semantic | None = None,
    placeholders: Mapping[str, Any] | None = None,
) -> tuple[ModelT, LocatedDocument]:
    """Read a YAML file, apply `--set` overrides and validate it against `model`.

    The one path for files without `extends:` (search specs, experiments). `semantic(value,
    doc) -> [(data path, message)]` adds the checks pydantic cannot make (files that must
    exist, names that must match). Every problem, of either kind, is raised at once as an
    `ArchspecError` at file:line:column (or the `--set`) and the dotted field: when
    pydantic refuses part of the file, the semantic checks still run on the rest
    (`salvage`). Returns the model and the located document.
    """
    doc = apply_overrides(load_yaml_with_locations(path, what=what), list(overrides))
    title = f"invalid {what} {doc.source}"
    problems: list[Problem] = []
    try:
        value = model.model_validate(doc.data)
        remap: Callable[[PathKey], PathKey] = lambda p: p  # noqa: E731
    except ValidationError as exc:
        problems = validation_problems(exc, doc, model=model)
        salvaged = salvage(doc.data, exc, model, placeholders or {})
        if salvaged is None or semantic is None:
            raise error_from_problems(title, problems) from None
        value, remap = salvaged
    if semantic is not None:
        found = [(remap(path), message) for path, message in semantic(value, doc)]
        problems += locate_problems(doc, found)
    if problems:
        raise error_from_problems(title, problems)
    return value, doc


def _unwrap_optional(annotation: Any) -> Any:
    """`X | None` -> X (the annotation a present value has)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def salvage(
    data: Any, error: ValidationError, model: type[ModelT], placeholders: Mapping[str, Any]
) -> tuple[ModelT, Callable[[PathKey], PathKey]] | None:
    """The parts of `data` that validate, as a `model`, so that checks of the other parts
    can run while the refused parts are reported; None when too little is left.

    A refused entry of a mapping (a search space's field) or item of a list (a task, a
    run, an objective) is left out; a refused optional section takes its default; a
    refused required section takes `placeholders[key]` (a value its own checks ignore) or,
    without one, nothing is salvaged. Returns the model and a function that maps a path in
    the salvaged data back to the path in `data` (list items left out shift the indices).
    """
    if not isinstance(data, dict):
        return None
    fields = {(info.alias or name): info for name, info in model.model_fields.items()}
    kept = copy.deepcopy(data)
    dropped_items: dict[str, set[int]] = {}
    for err in error.errors(include_url=False):
        path, _ = _resolve_loc(err["loc"], data, model, err["type"])
        if not path:
            return None
        key = path[0]
        if key not in fields:  # an unknown top-level key: leave it out
            kept.pop(key, None)
            continue
        section = data.get(key)
        container = typing.get_origin(_unwrap_optional(fields[key].annotation))
        if len(path) > 1 and container in (dict, Mapping) and isinstance(section, dict) and path[1] in section:
            kept[key].pop(path[1], None)
        elif len(path) > 1 and container in (list, Sequence) and isinstance(section, list) and isinstance(path[1], int):
            dropped_items.setdefault(key, set()).add(path[1])
        elif not fields[key].is_required():
            kept.pop(key, None)
        elif key in placeholders:
            kept[key] = copy.deepcopy(placeholders[key])
        else:
            return None
    index_maps: dict[str, list[int]] = {}
    for key, dropped in dropped_items.items():
        if not isinstance(kept.get(key), list):
            continue
        index_maps[key] = [i for i in range(len(data[key])) if i not in dropped]
        kept[key] = [data[key][i] for i in index_maps[key]]
    try:
        value = model.model_validate(kept)
    except ValidationError:
        return None

    def remap(path: PathKey) -> PathKey:
        if len(path) > 1 and path[0] in index_maps and isinstance(path[1], int) and path[1] < len(index_maps[path[0]]):
            return (path[0], index_maps[path[0]][path[1]], *path[2:])
        return path

    return value, remap
