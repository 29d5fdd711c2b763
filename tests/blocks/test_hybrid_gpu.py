"""A hybrid stack on CUDA (skipped without one): the recurrent layers on the Triton
kernel, full attention on SDPA's flash backend, the sliding window on compiled
FlexAttention. It trains under bfloat16 autocast, decodes in pieces like the whole in
float32, and FlexAttention's gradients equal SDPA's with an explicit mask.

    .venv/bin/python -m pytest -q tests/blocks/test_hybrid_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import archspec
from archspec.blocks.attention import Attention
from archspec.blocks.plan import AttentionPlan

MODELS = Path(__file__).resolve().parents[2] / "specs" / "models"
# Qwen3-Next's 3:1 layout over 8 layers, with a window on the last attention layer so
# that both attention kernels run; a Gated DeltaProduct override on layer 1.
HYBRID = [
    "model.d_model=128", "mixer.heads=2", "mixer.head_dim=32", "attention.heads=4", "attention.head_dim=32",
    "attention.kv_heads=2",
    "layout.overrides=[{layers: [7], attention: {window: 16}}, "
    "{layers: [1], mixer: {transition: {n_h: 2, beta_range: [0, 2]}}}]",
]


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    model = archspec.compile(archspec.load_spec(MODELS / "qwen3-next-hybrid.yaml", HYBRID)).to("cuda", dtype)
    model.set_backend("triton")
    return model


@pytest.fixture(autouse=True)
def exact_matmuls():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.gpu
def test_a_hybrid_trains_under_bf16_autocast_with_flash_attention():
    model = _model()
    kinds = [type(m).__name__ for m in model.sequence_mixers()]
    assert kinds.count("Attention") == 2 and model.plan.layer_plans[7].window == 16
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator(device="cuda").manual_seed(0)
    # a learnable stream: every sequence repeats a random block of 8 tokens
    block = torch.randint(0, 256, (16, 8), device="cuda", generator=generator)
    ids = block.repeat(1, 16)  # [16, 128]
    losses = []
    for _ in range(30):
        # flash only for full attention: SDPA raises here if it cannot take the flash
        # backend; the windowed layer runs FlexAttention, which the context leaves alone
        with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        assert torch.isfinite(loss)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses


@pytest.mark.gpu
def test_a_hybrid_decodes_in_pieces_like_the_whole_in_float32():
    model = _model().eval()
    ids = torch.randint(0, 256, (2, 70), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    with torch.no_grad():
        whole, whole_state = model(ids, return_state=True)
        for sizes in ([30, 1, 39], [64, 6], [1] * 70):
            state, outs, t = None, [], 0
            for size in sizes:
                logits, state = model(ids[:, t : t + size], state=state, return_state=True)
                outs.append(logits)
                t += size
            torch.testing.assert_close(torch.cat(outs, dim=1), whole, rtol=2e-4, atol=2e-4)
            torch.testing.assert_close(state[0].recurrent, whole_state[0].recurrent, rtol=2e-4, atol=2e-4)
            torch.testing.assert_close(state[7].k, whole_state[7].k, rtol=2e-4, atol=2e-4)
            assert state[7].k.shape[2] == 15 and state[3].k.shape[2] == 70


@pytest.mark.gpu
def test_compiled_flex_attention_matches_sdpa_with_a_mask_and_its_gradients():
    plan = AttentionPlan(heads=4, kv_heads=2, head_dim=32, window=24, output_gate=True)
    torch.manual_seed(0)
    flex = Attention(plan, 64).cuda()
    sdpa = Attention(plan, 64).cuda()
    sdpa.load_state_dict(flex.state_dict())
    flex.kernel, sdpa.kernel = "flex", "sdpa"
    x = torch.randn(2, 128, 64, device="cuda", requires_grad=True)
    y_flex, _ = flex(x)
    y_sdpa, _ = sdpa(x)
    torch.testing.assert_close(y_flex, y_sdpa, rtol=1e-4, atol=1e-4)
    weight = torch.randn_like(y_flex)
    g_flex = torch.autograd.grad((y_flex * weight).sum(), [x, *flex.parameters()])
    g_sdpa = torch.autograd.grad((y_sdpa * weight).sum(), [x, *sdpa.parameters()])
    for a, b in zip(g_flex, g_sdpa):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
