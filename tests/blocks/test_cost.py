"""The analytic cost model against the built modules and torch's FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from archspec.blocks import build_model, count_params, flops_per_token, state_bytes
from archspec.blocks.attention import AttentionState
from archspec.blocks.cost import ATTENTION_TERMS, NOT_SEEN_BY_FLOP_COUNTER, causal_pairs, flops_breakdown
from archspec.blocks.plan import AttentionPlan, ModelPlan

from .plans import COMBINATIONS, model_plan


@pytest.mark.parametrize("mlp", ["swiglu", "gelu", "none"])
@pytest.mark.parametrize("tie", [False, True])
def test_param_count_is_exact_for_every_plan(mlp, tie):
    for name, mixer in COMBINATIONS.items():
        plan = model_plan(mixer, mlp=mlp, tie=tie, layers=2)
        built = sum(p.numel() for p in build_model(plan).parameters())
        assert count_params(plan) == built, name


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_state_bytes_equals_the_decoding_state(name):
    plan = model_plan(COMBINATIONS[name], layers=2)
    state = build_model(plan).init_state(batch_size=1)
    tensors = [t for layer in state for t in (layer.recurrent, layer.d, *layer.conv.values()) if t is not None]
    assert state_bytes(plan) == sum(t.numel() * t.element_size() for t in tensors)


# FlopCounterMode intercepts aten ops and counts 2 x multiply-adds for matmuls (mm, addmm,
# bmm, baddbmm, which einsum and `@` lower to) and convolutions. It does not see
# `torch.linalg.solve_triangular` (no registered formula) nor contractions written as
# elementwise products and sums (the channel gate's score matrices in kernels/chunked.py),
# and it counts nothing elementwise (norms, activations, gates, the OSDN scan), which the
# analytic model leaves out by definition. So the counter must equal the analytic total
# minus the terms in NOT_SEEN_BY_FLOP_COUNTER; both are exact integer counts, so the
# stated tolerance is only float rounding (relative 1e-9).
FLOP_CASES = [
    "deltanet-none",
    "gdn-scalar",
    "kda-channel",
    "diagonal-none",
    "diagonal-channel",
    "householder-nh3-b2-none",
    "rwkv7-nh2-b2-channel",
    "rwkv7-nh1-channel",
    "osgdn-apf-learned",
    "noconv-gdn",
]


@pytest.mark.parametrize("name", FLOP_CASES)
@pytest.mark.parametrize("seq_len", [64, 100])  # 100: the last chunk is padded
def test_flops_match_the_flop_counter_on_the_torch_backend(name, seq_len):
    plan = model_plan(COMBINATIONS[name], layers=2, d_model=32)
    model = build_model(plan)
    model.set_backend("torch")
    batch = 2
    ids = torch.randint(0, plan.vocab_size, (batch, seq_len))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids)
    counted = counter.get_total_flops() / (batch * seq_len)

    terms = flops_breakdown(plan, seq_len)
    visible = sum(v for k, v in terms.items() if k not in NOT_SEEN_BY_FLOP_COUNTER)
    assert counted == pytest.approx(visible, rel=1e-9)
    assert flops_per_token(plan, seq_len) == pytest.approx(sum(terms.values()))
    assert terms["recurrence_matmul"] > 0
    if "channel" in name:
        assert terms["recurrence_channel_leaves"] > 0
    if name.startswith("diagonal"):
        assert terms["recurrence_solve"] == 0


def test_flops_grow_with_sub_steps_and_shrink_without_projections():
    base = model_plan(COMBINATIONS["householder-nh2-b2-scalar"])
    one = model_plan(COMBINATIONS["gdn-scalar"])
    assert flops_per_token(base, 256) > flops_per_token(one, 256)
    assert flops_breakdown(base, 256)["head"] == 2 * base.vocab_size * base.d_model


# ------------------------------------------------------------------- hybrid stacks

HYBRID_ATTENTION = {
    "mha": AttentionPlan(heads=2, kv_heads=2, head_dim=8),
    "gqa-gate-qknorm": AttentionPlan(heads=4, kv_heads=2, head_dim=4, output_gate=True, qk_norm=True),
    "window": AttentionPlan(heads=2, kv_heads=1, head_dim=6, window=5),
}


def hybrid_plan(attention: AttentionPlan, *, mlp: str = "swiglu", tie: bool = False) -> ModelPlan:
    """Recurrent, attention, a different recurrent mixer, attention."""
    first, other = COMBINATIONS["gdn-scalar"], COMBINATIONS["rwkv7-nh2-b2-channel"]
    stack = (first, attention, other, attention)
    return ModelPlan(name="hybrid", mixer=first, d_model=32, layers=4, mlp=mlp, vocab_size=13, tie_embeddings=tie, stack=stack)


@pytest.mark.parametrize("name", sorted(HYBRID_ATTENTION))
@pytest.mark.parametrize("mlp", ["swiglu", "none"])
def test_param_count_is_exact_for_hybrid_stacks(name, mlp):
    plan = hybrid_plan(HYBRID_ATTENTION[name], mlp=mlp, tie=mlp == "none")
    assert count_params(plan) == sum(p.numel() for p in build_model(plan).parameters())


@pytest.mark.parametrize("name", sorted(HYBRID_ATTENTION))
@pytest.mark.parametrize("context", [3, 9])  # shorter and longer than the window
def test_state_bytes_equal_the_decoding_state_after_a_context(name, context):
    plan = hybrid_plan(HYBRID_ATTENTION[name])
    model = build_model(plan)
    model.set_backend("torch")
    with torch.no_grad():
        _, state = model(torch.randint(0, 13, (1, context)), return_state=True)
    size = 0
    for layer in state:
        tensors = (layer.k, layer.v) if isinstance(layer, AttentionState) else (layer.recurrent, layer.d, *layer.conv.values())
        size += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    assert state_bytes(plan, context) == size
    with pytest.raises(ValueError, match="context length"):
        state_bytes(plan)


def test_causal_pairs_count_what_each_query_sees():
    for seq_len in (1, 5, 12):
        for window in (None, 1, 4, 12, 30):
            seen = sum(1 for t in range(seq_len) for s in range(seq_len) if s <= t and (window is None or t - s < window))
            assert causal_pairs(seq_len, window) == seen


@pytest.mark.parametrize("name", sorted(HYBRID_ATTENTION))
@pytest.mark.parametrize("seq_len", [16, 40])
def test_hybrid_flops_match_the_flop_counter(name, seq_len):
    """SDPA runs its math path here (the counter has no formula for the CPU flash
    kernel), a dense T x T product masked afterwards: the counted attention is the
    analytic one (causal pairs) scaled by T^2 / pairs. Everything else the counter sees
    as for recurrent stacks."""
    plan = hybrid_plan(HYBRID_ATTENTION[name])
    model = build_model(plan)
    model.set_backend("torch")
    batch = 2
    ids = torch.randint(0, plan.vocab_size, (batch, seq_len))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids)
    counted = counter.get_total_flops() / (batch * seq_len)

    terms = flops_breakdown(plan, seq_len)
    dense = seq_len * seq_len / causal_pairs(seq_len, HYBRID_ATTENTION[name].window)
    expected = sum(
        v * dense if k in ATTENTION_TERMS else v for k, v in terms.items() if k not in NOT_SEEN_BY_FLOP_COUNTER
    )
    assert counted == pytest.approx(expected, rel=1e-9)
    assert terms["attention_scores"] > 0 and terms["recurrence_matmul"] > 0


def test_attention_cost_grows_with_the_context_unless_windowed():
    full = hybrid_plan(HYBRID_ATTENTION["mha"])
    windowed = hybrid_plan(HYBRID_ATTENTION["window"])
    recurrent = model_plan(COMBINATIONS["gdn-scalar"], layers=4, d_model=32)
    short, long = 2048, 32768
    assert flops_breakdown(full, long)["attention_scores"] == pytest.approx(16 * flops_breakdown(full, short)["attention_scores"], rel=1e-3)
    assert flops_breakdown(windowed, long)["attention_scores"] == pytest.approx(flops_breakdown(windowed, short)["attention_scores"], rel=1e-3)
    # KV cache: 2 layers x (k and v) x kv_heads x head_dim x tokens x 4 bytes
    kv = 2 * 2 * 2 * 8 * 4
    assert state_bytes(full, long) - state_bytes(full, short) == kv * (long - short)
    assert state_bytes(windowed, long) == state_bytes(windowed, short)
    assert state_bytes(recurrent, long) == state_bytes(recurrent, short) == state_bytes(recurrent)
