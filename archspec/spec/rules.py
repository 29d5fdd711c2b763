"""Cross-field rules of the model spec, each with the reason it exists.

A rule returns `(path, message)` pairs, the path relative to the spec's top level, so
that the loader can point at the exact line and every broken rule is reported at once.
The math behind the messages is `RECURRENCE.md`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from archspec.spec.models import AttentionSpec, MixerSpec, Spec

RulePath = tuple[str, ...]


def _number(x: float) -> str:
    return f"{x:g}"


def mixer_problems(mixer: MixerSpec) -> list[tuple[RulePath, str]]:
    """Rule problems of one mixer section, paths relative to the mixer."""
    problems: list[tuple[RulePath, str]] = []
    transition, pre = mixer.transition, mixer.preconditioner

    if transition.type == "diagonal":
        if transition.n_h > 1:
            problems.append((
                ("transition", "n_h"),
                f"n_h = {transition.n_h} needs a transition that changes the state at each sub-step "
                "(householder or rwkv7); diagonal sub-steps would only add writes S += w v^T, which "
                "commute and collapse into one, so diagonal takes n_h = 1",
            ))
        if transition.beta_range is not None:
            problems.append((
                ("transition", "beta_range"),
                "a diagonal transition has no beta (it writes S += w v^T without the delta rule's "
                "step size); remove beta_range or use transition householder or rwkv7",
            ))

    if pre.enabled:
        if transition.type != "householder":
            problems.append((
                ("preconditioner", "type"),
                "the OSDN preconditioner rescales the delta rule's write key (w = d * k in "
                f"S += beta w (v - S^T k)^T); transition {transition.type!r} has no such write, so "
                "OSDN needs transition.type: householder",
            ))
        else:
            beta_max = transition.beta_max or 1.0
            d_max = pre.setting("bounds")[1]
            if beta_max * d_max > 2:
                where = ("preconditioner", "bounds") if pre.bounds is not None else ("transition", "beta_range")
                problems.append((
                    where,
                    f"unstable: with beta in [0, {_number(beta_max)}] and d_max = {_number(d_max)}, each "
                    "factor's eigenvalue along the write key, 1 - beta <d, k*k>, reaches "
                    f"1 - {_number(beta_max)} * {_number(d_max)} = {_number(1 - beta_max * d_max)} < -1 "
                    "(<d, k*k> reaches d_max for a unit key), so the state can blow up; OSDN needs "
                    f"beta_max * d_max <= 2 (use beta_range [0, 1], or bounds with d_max <= {_number(2 / beta_max)})",
                ))
    else:
        for name in pre.settings_written():
            problems.append((
                ("preconditioner", name),
                f"{name} only applies to the OSDN preconditioner, which is off here; set "
                f"preconditioner.type: osdn or remove {name}",
            ))

    if mixer.decay is not None and mixer.resolved_gate == "none":
        problems.append((
            ("decay",),
            f"decay sets how a gate forms its log decay, and this mixer has no gate (backbone "
            f"{mixer.backbone!r} defaults to none); set gate: scalar or channel, or remove decay",
        ))

    value_dim = mixer.value_dim
    if value_dim != int(value_dim) or value_dim < 1:
        problems.append((
            ("expand_v",),
            f"head_dim * expand_v = {mixer.head_dim} * {_number(mixer.expand_v)} = {_number(value_dim)} "
            "must be a whole number >= 1: it is the value dimension V of each head's K x V state",
        ))
    return problems


def attention_problems(attention: AttentionSpec) -> list[tuple[RulePath, str]]:
    """Rule problems of one attention section, paths relative to it."""
    problems: list[tuple[RulePath, str]] = []
    heads, kv_heads = attention.heads, attention.resolved_kv_heads
    if heads % kv_heads:
        problems.append((
            ("kv_heads",),
            f"kv_heads = {kv_heads} does not divide heads = {heads}: grouped-query attention shares each "
            "key/value head among heads / kv_heads query heads, so heads must be a multiple of kv_heads "
            f"(divisors of {heads}: {', '.join(str(d) for d in range(1, heads + 1) if heads % d == 0)})",
        ))
    if attention.rope and attention.head_dim % 2:
        problems.append((
            ("head_dim",),
            f"head_dim = {attention.head_dim} is odd: RoPE rotates pairs of channels, so it needs an even "
            "head_dim (or rope: false)",
        ))
    if not attention.rope and attention.rope_theta is not None:
        problems.append((
            ("rope_theta",),
            "rope_theta is RoPE's base frequency and rope is off here; set rope: true or remove rope_theta",
        ))
    return problems


def _index_problems(indices: list[int], depth: int, where: RulePath) -> list[tuple[RulePath, str]]:
    """Indices past the depth, and indices listed twice."""
    problems: list[tuple[RulePath, str]] = []
    seen: set[int] = set()
    for position, index in enumerate(indices):
        if index >= depth:
            problems.append((
                where + (position,),
                f"layer {index} is past the last layer: model.layers = {depth}, so layer indices run 0..{depth - 1}",
            ))
        elif index in seen:
            problems.append((where + (position,), f"layer {index} is listed twice"))
        seen.add(index)
    return problems


def _section_problems(section, kind: str):
    return mixer_problems(section) if kind == "recurrent" else attention_problems(section)


def layout_problems(spec: Spec) -> list[tuple[RulePath, str]]:
    """Rule problems of the layout: indices against the depth, overrides against the
    kinds of the layers they name, and the sections the overrides produce."""
    from archspec.spec.layout import layer_kinds, overridden, written_paths

    layout, depth = spec.layout, spec.model.layers
    problems: list[tuple[RulePath, str]] = []
    if layout.pattern is not None and layout.ratio is not None:
        problems.append((
            ("layout", "ratio"),
            "give the repeating pattern once: `pattern` (a list of layer kinds) or `ratio` ('R:A'), not both",
        ))
    problems += _index_problems(layout.attention_at, depth, ("layout", "attention_at"))
    kinds = layer_kinds(layout, depth)
    owner: dict[int, int] = {}
    for position, override in enumerate(layout.overrides):
        where: RulePath = ("layout", "overrides", position)
        problems += _index_problems(override.layers, depth, where + ("layers",))
        section_name = "mixer" if override.kind == "recurrent" else "attention"
        for j, layer in enumerate(override.layers):
            if layer >= depth:
                continue
            if kinds[layer] != override.kind:
                problems.append((
                    where + ("layers", j),
                    f"layer {layer} is {'an attention' if kinds[layer] == 'attention' else 'a recurrent'} layer; "
                    f"an override with `{section_name}:` applies to {override.kind} layers only",
                ))
            elif layer in owner and owner[layer] != position:
                problems.append((
                    where + ("layers", j),
                    f"layer {layer} is already overridden by layout.overrides[{owner[layer]}]; a layer takes at "
                    "most one override (merge the two)",
                ))
            else:
                owner.setdefault(layer, position)
        base = spec.mixer if override.kind == "recurrent" else spec.attention
        written = override.mixer if override.kind == "recurrent" else override.attention
        own = set(_section_problems(base, override.kind))
        wrote = written_paths(written)
        for path, message in _section_problems(overridden(base, written), override.kind):
            if (path, message) in own:
                continue  # the base section's own problem, reported there
            if path in wrote:
                problems.append((where + (section_name,) + path, message))
            else:
                problems.append((
                    where + (section_name,),
                    f"with this override, {section_name}.{'.'.join(path)}: {message}",
                ))
    return problems


def spec_problems(spec: Spec) -> list[tuple[RulePath, str]]:
    """Rule problems of a whole spec, paths from the top level."""
    problems = [(("mixer",) + path, message) for path, message in mixer_problems(spec.mixer)]
    problems += [(("attention",) + path, message) for path, message in attention_problems(spec.attention)]
    return problems + layout_problems(spec)
