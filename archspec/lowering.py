"""Lowering: a validated `Spec` -> the frozen `ModelPlan` IR that `blocks` builds.

Every decision the spec leaves implicit is made here and written into the plan: the
gate (from the backbone unless given), beta's scale (from beta_range), the write key
(tied, preconditioned by OSDN, or untied for rwkv7), the erase vector, and whether the
transitions are provably non-expansive, with the reason in plain words when not.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from archspec.blocks.plan import AttentionPlan, LayerPlan, ModelPlan, PreconditionerPlan, RecurrencePlan
from archspec.spec.layout import layer_sections
from archspec.spec.loader import load_spec
from archspec.spec.models import AttentionSpec, MixerSpec, Spec


def _preconditioner(mixer: MixerSpec) -> PreconditionerPlan | None:
    pre = mixer.preconditioner
    if not pre.enabled:
        return None
    d_min, d_max = pre.setting("bounds")
    return PreconditionerPlan(
        eta=float(pre.setting("eta")),
        d_min=float(d_min),
        d_max=float(d_max),
        beta_aware=bool(pre.setting("beta_aware")),
        apf=bool(pre.setting("apf")),
        init=pre.setting("init"),
    )


def _write_key(mixer: MixerSpec) -> str:
    if mixer.transition.type == "rwkv7":
        return "untied"
    if mixer.preconditioner.enabled:
        return "preconditioned"
    return "tied"


def _stability(mixer: MixerSpec, beta_scale: float | None, pre: PreconditionerPlan | None) -> tuple[bool, tuple[str, ...]]:
    """Whether every per-token transition factor provably has spectral norm <= 1, and why not.

    The gate exp(g) with g <= 0 is a diagonal with entries in (0, 1]: never the issue.
    """
    kind = mixer.transition.type
    if kind == "diagonal":
        return True, ()
    if kind == "householder" and pre is None:
        # I - beta k k^T with unit k is symmetric with eigenvalues 1 and 1 - beta in [-1, 1].
        return True, ()
    if kind == "householder":
        assert pre is not None and beta_scale is not None
        low = 1 - beta_scale * pre.d_max
        return False, (
            f"OSDN's write key w = d * k makes each factor I - beta (d * k) k^T non-normal: its "
            f"eigenvalue along the key, 1 - beta <d, k*k>, stays in [{low:g}, 1] because beta_max * "
            f"d_max = {beta_scale * pre.d_max:g} <= 2, but its spectral norm can exceed 1 "
            "(about 1.19 seen for beta <= 1, d in [0.5, 2], K = 8), so the |A| <= 1 guarantee of the "
            "tied delta rule does not hold.",
        )
    assert kind == "rwkv7" and beta_scale is not None
    return False, (
        f"rwkv7's factor I - (a * k) k^T (erase a in [0, {beta_scale:g}]^K, unit key k) has "
        f"eigenvalues 1 - <a, k*k> in [{1 - beta_scale:g}, 1] and 1, but it is non-normal whenever a "
        "differs across channels, so its spectral norm can exceed 1 and the state is not provably "
        "bounded by the transitions.",
    )


def lower_mixer(mixer: MixerSpec) -> RecurrencePlan:
    """One mixer section -> its `RecurrencePlan`."""
    beta_scale = mixer.transition.beta_max  # 1.0 or 2.0; None for diagonal
    pre = _preconditioner(mixer)
    stable, caveats = _stability(mixer, beta_scale, pre)
    return RecurrencePlan(
        backbone=mixer.backbone,
        gate=mixer.resolved_gate,
        transition=mixer.transition.type,
        n_h=mixer.transition.n_h,
        beta_scale=beta_scale,
        write_key=_write_key(mixer),
        erase=mixer.transition.type == "rwkv7",
        preconditioner=pre,
        heads=mixer.heads,
        head_dim=mixer.head_dim,
        value_dim=int(mixer.value_dim),
        short_conv=mixer.short_conv,
        stable=stable,
        caveats=caveats,
        decay=mixer.resolved_decay,
    )


def lower_attention(attention: AttentionSpec) -> AttentionPlan:
    """One attention section -> its `AttentionPlan` (kv_heads and rope_theta resolved)."""
    return AttentionPlan(
        heads=attention.heads,
        kv_heads=attention.resolved_kv_heads,
        head_dim=attention.head_dim,
        rope_theta=attention.resolved_rope_theta,
        window=attention.window,
        output_gate=attention.output_gate,
        qk_norm=attention.qk_norm,
    )


def lower_stack(spec: Spec, mixer: RecurrencePlan) -> tuple[LayerPlan, ...]:
    """Each layer's plan; empty when every layer is the spec's mixer."""
    plans = tuple(
        lower_mixer(section) if isinstance(section, MixerSpec) else lower_attention(section)
        for section in layer_sections(spec)
    )
    return () if all(p == mixer for p in plans) else plans


def lower(spec: Spec | Mapping[str, Any] | str | os.PathLike[str]) -> ModelPlan:
    """A spec (or anything `load_spec` takes) -> the `ModelPlan` that `blocks.build_model` builds."""
    spec = load_spec(spec)
    model = spec.model
    mixer = lower_mixer(spec.mixer)
    return ModelPlan(
        name=spec.name,
        mixer=mixer,
        stack=lower_stack(spec, mixer),
        d_model=model.d_model,
        layers=model.layers,
        mlp=model.mlp,
        vocab_size=model.vocab_size,
        mlp_ratio=model.mlp_ratio,
        norm_eps=model.norm_eps,
        tie_embeddings=model.tie_embeddings,
    )
