"""Small plans for the blocks tests, built directly (no spec language: blocks stands alone).

`mixer_plan(...)` fills in what lowering would decide (write key, erase, beta scale) from
the transition, gate and preconditioner; `COMBINATIONS` covers every backbone, gate,
transition, n_h 1..3, beta range, decay form, OSDN variant (APF, learned init, beta-free)
and short conv setting at least once.
"""

from __future__ import annotations

from archspec.blocks import ModelPlan, PreconditionerPlan, RecurrencePlan


def mixer_plan(
    backbone: str = "deltanet",
    gate: str = "none",
    transition: str = "householder",
    n_h: int = 1,
    beta_scale: float = 1.0,
    osdn: PreconditionerPlan | None = None,
    heads: int = 2,
    head_dim: int = 4,
    value_dim: int = 6,
    short_conv: int = 4,
    decay: str = "mamba2",
) -> RecurrencePlan:
    write_key = {"diagonal": "tied", "householder": "preconditioned" if osdn else "tied", "rwkv7": "untied"}[transition]
    return RecurrencePlan(
        backbone=backbone,
        gate=gate,
        transition=transition,
        n_h=n_h,
        beta_scale=None if transition == "diagonal" else beta_scale,
        write_key=write_key,
        erase=transition == "rwkv7",
        preconditioner=osdn,
        heads=heads,
        head_dim=head_dim,
        value_dim=value_dim,
        short_conv=short_conv,
        stable=False,
        decay=decay,
    )


def model_plan(mixer: RecurrencePlan, *, d_model: int = 16, layers: int = 2, mlp: str = "swiglu", vocab_size: int = 13, tie: bool = False) -> ModelPlan:
    return ModelPlan(name="test", mixer=mixer, d_model=d_model, layers=layers, mlp=mlp, vocab_size=vocab_size, tie_embeddings=tie)


def _osdn(**kw) -> PreconditionerPlan:
    # A large eta makes d move visibly in a few tokens, so decoding tests see it change.
    return PreconditionerPlan(eta=0.5, **kw)


COMBINATIONS: dict[str, RecurrencePlan] = {
    # every backbone with every gate (householder, n_h = 1)
    **{f"{b}-{g}": mixer_plan(b, g) for b in ("deltanet", "gdn", "kda") for g in ("none", "scalar", "channel")},
    # diagonal (GLA-like) with each gate
    **{f"diagonal-{g}": mixer_plan("gdn", g, "diagonal") for g in ("none", "scalar", "channel")},
    # DeltaProduct: n_h 2, 3 and beta in [0, 2]
    "householder-nh2-b2-scalar": mixer_plan("gdn", "scalar", n_h=2, beta_scale=2.0),
    "householder-nh3-b2-none": mixer_plan("deltanet", "none", n_h=3, beta_scale=2.0),
    "householder-nh2-channel": mixer_plan("kda", "channel", n_h=2),
    # RWKV-7 transition
    "rwkv7-nh1-scalar": mixer_plan("gdn", "scalar", "rwkv7"),
    "rwkv7-nh1-channel": mixer_plan("kda", "channel", "rwkv7"),  # RWKV-7 itself (its own no-grad chain in chunked.py)
    "rwkv7-nh2-b2-channel": mixer_plan("kda", "channel", "rwkv7", n_h=2, beta_scale=2.0),
    "rwkv7-nh3-none": mixer_plan("deltanet", "none", "rwkv7", n_h=3),
    # RWKV-7's own decay form (bounded sigmoid, tanh LoRA), per channel and per head; GLA's
    "rwkv7-decay-channel": mixer_plan("kda", "channel", "rwkv7", decay="rwkv7"),
    "rwkv7-decay-scalar-gdn": mixer_plan("gdn", "scalar", decay="rwkv7"),
    "gla-decay-diagonal": mixer_plan("kda", "channel", "diagonal", decay="gla"),
    # OSDN variants
    "osdn": mixer_plan("deltanet", "none", osdn=_osdn()),
    "osdn-apf-nh2": mixer_plan("deltanet", "none", n_h=2, osdn=_osdn(apf=True)),
    "osgdn-apf-learned": mixer_plan("gdn", "scalar", osdn=_osdn(apf=True, init="learned")),
    "oskda-betafree-nh2": mixer_plan("kda", "channel", n_h=2, osdn=_osdn(beta_aware=False, init="learned")),
    # short conv off and kernel size 2
    "noconv-gdn": mixer_plan("gdn", "scalar", short_conv=0),
    "noconv-osdn-apf": mixer_plan("deltanet", "none", osdn=_osdn(apf=True), short_conv=0),
    "conv2-rwkv7": mixer_plan("gdn", "none", "rwkv7", n_h=2, short_conv=2),
}
