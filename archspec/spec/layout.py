"""Which layer of the stack is what: the layout section resolved over the depth.

A layer is recurrent (the spec's `mixer`) unless the repeating pattern (`layout.pattern`
or `layout.ratio`, tiled over `model.layers` and cut at the depth, as HF's Qwen3-Next
`layer_types` are built from `full_attention_interval`) or an explicit index
(`layout.attention_at`) makes it attention. An override replaces some fields of its
layers' section: the fields it writes win, the others come from the section it
overrides (so an override `{backbone: gdn}` on a KDA mixer keeps KDA's heads and
transition but takes Gated DeltaNet's default gate, unless the base wrote a gate).
These functions assume a spec whose fields are valid; `rules.py` reports the problems.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from archspec.spec.models import AttentionSpec, LayerKind, LayoutSpec, MixerSpec, Spec


def layer_kinds(layout: LayoutSpec, depth: int) -> list[LayerKind]:
    """The kind of each of the `depth` layers."""
    period = layout.period()
    kinds: list[LayerKind] = [period[i % len(period)] for i in range(depth)] if period else ["recurrent"] * depth
    for index in layout.attention_at:
        if 0 <= index < depth:
            kinds[index] = "attention"
    return kinds


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; anything else in `top` replaces `base`'s."""
    out = dict(base)
    for key, value in top.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def overridden(section: MixerSpec | AttentionSpec, override: MixerSpec | AttentionSpec) -> Any:
    """`section` with the fields `override` writes replacing its own, validated again."""
    merged = deep_merge(section.model_dump(exclude_unset=True), override.model_dump(exclude_unset=True))
    return type(section).model_validate(merged)


def override_index(layout: LayoutSpec, depth: int) -> dict[int, int]:
    """Layer -> the index of the override that applies to it (the first, if several do)."""
    found: dict[int, int] = {}
    for position, override in enumerate(layout.overrides):
        for layer in override.layers:
            if 0 <= layer < depth:
                found.setdefault(layer, position)
    return found


def layer_sections(spec: Spec) -> list[MixerSpec | AttentionSpec]:
    """Each layer's resolved section: the mixer or the attention, with its override."""
    depth = spec.model.layers
    owners = override_index(spec.layout, depth)
    sections: list[MixerSpec | AttentionSpec] = []
    for layer, kind in enumerate(layer_kinds(spec.layout, depth)):
        section: MixerSpec | AttentionSpec = spec.mixer if kind == "recurrent" else spec.attention
        if layer in owners:
            override = spec.layout.overrides[owners[layer]]
            written = override.mixer if kind == "recurrent" else override.attention
            if written is not None:
                section = overridden(section, written)
        sections.append(section)
    return sections


def written_paths(section: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every dotted path (as a tuple) an override section writes, sections included."""
    paths: set[tuple[str, ...]] = set()
    for key, value in section.model_dump(exclude_unset=True).items() if hasattr(section, "model_dump") else section.items():
        path = prefix + (key,)
        paths.add(path)
        if isinstance(value, dict):
            paths |= written_paths(value, path)
    return paths
