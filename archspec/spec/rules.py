"""Cross-field rules of the model spec, each with the reason it exists.

A rule returns `(path, message)` pairs, the path relative to the spec's top level, so
that the loader can point at the exact line and every broken rule is reported at once.
The math behind the messages is `RECURRENCE.md`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from archspec.spec.models import MixerSpec, Spec

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

    value_dim = mixer.value_dim
    if value_dim != int(value_dim) or value_dim < 1:
        problems.append((
            ("expand_v",),
            f"head_dim * expand_v = {mixer.head_dim} * {_number(mixer.expand_v)} = {_number(value_dim)} "
            "must be a whole number >= 1: it is the value dimension V of each head's K x V state",
        ))
    return problems


def spec_problems(spec: Spec) -> list[tuple[RulePath, str]]:
    """Rule problems of a whole spec, paths from the top level."""
    return [(("mixer",) + path, message) for path, message in mixer_problems(spec.mixer)]
