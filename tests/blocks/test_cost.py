"""The analytic cost model against the built modules and torch's FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from archspec.blocks import build_model, count_params, flops_per_token, state_bytes
from archspec.blocks.cost import NOT_SEEN_BY_FLOP_COUNTER, flops_breakdown

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
