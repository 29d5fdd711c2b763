"""A hybrid stack on CUDA (skipped without one): the recurrent layers on the Triton
kernel, full attention on SDPA's flash backend, the sliding window and packed documents
on compiled FlexAttention. It trains under bfloat16 autocast, decodes in pieces like the
whole in float32, and FlexAttention's gradients equal SDPA's with an explicit mask; packed
documents on FlexAttention equal each document alone (float32 and bfloat16), without
recompiling when the documents change.

    .venv/bin/python -m pytest -q tests/blocks/test_hybrid_gpu.py
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import archspec
from archspec.blocks import attention
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


# Documents of mixed lengths (64 .. 2048 tokens) like the packed benchmark's, 4096 in all,
# none a multiple of FlexAttention's 128-token tiles but the first
PACKED_LENGTHS = [2048, 64, 1000, 300, 100, 584]
PACKED_PLAN = AttentionPlan(heads=8, kv_heads=2, head_dim=64, output_gate=True, qk_norm=True)


def _packed_layer(window: int | None) -> tuple[Attention, torch.Tensor, torch.Tensor]:
    """A layer on 'auto' (FlexAttention for packed documents on CUDA), a packed row and its
    cu_seqlens."""
    torch.manual_seed(0)
    layer = Attention(dataclasses.replace(PACKED_PLAN, window=window), 256).cuda()
    cu_seqlens = torch.tensor([0, *itertools.accumulate(PACKED_LENGTHS)], device="cuda")
    x = torch.randn(1, sum(PACKED_LENGTHS), 256, device="cuda", requires_grad=True)
    return layer, x, cu_seqlens


def _each_alone(layer: Attention, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each document through the layer on its own, on SDPA (flash or efficient for full
    attention, the window's mask otherwise)."""
    kernel, layer.kernel = layer.kernel, "sdpa"
    try:
        bounds = cu_seqlens.tolist()
        return torch.cat([layer(x[:, lo:hi])[0] for lo, hi in zip(bounds[:-1], bounds[1:])], dim=1)
    finally:
        layer.kernel = kernel


def _output_and_gradients(layer: Attention, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    return (y, *torch.autograd.grad((y.float() * weight).sum(), [x, *layer.parameters()]))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 256])
def test_packed_documents_on_compiled_flex_attention_equal_each_alone(window, monkeypatch):
    """float32, the tolerances of the window's FlexAttention-against-SDPA test."""
    layer, x, cu_seqlens = _packed_layer(window)
    masks = []  # 'auto' must take FlexAttention here, not SDPA with the block-diagonal mask
    build = attention._document_block_mask
    monkeypatch.setattr(attention, "_document_block_mask", lambda *args: masks.append(args) or build(*args))
    y, _ = layer(x, cu_seqlens=cu_seqlens)
    assert len(masks) == 1
    weight = torch.randn_like(y)
    packed = _output_and_gradients(layer, y, x, weight)
    alone = _output_and_gradients(layer, _each_alone(layer, x, cu_seqlens), x, weight)
    names = ["output", "x", *(n for n, _ in layer.named_parameters())]
    torch.testing.assert_close(packed[0], alone[0], rtol=1e-4, atol=1e-4)
    for name, got, want in zip(names[1:], packed[1:], alone[1:]):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 256])
def test_packed_documents_on_compiled_flex_attention_in_bfloat16_err_like_each_alone(window):
    """Under bfloat16 autocast (as the benchmark trains), against each document alone in
    float32: packed FlexAttention's relative Frobenius error, of the output and of every
    gradient, at most twice that of each document alone under the same autocast (SDPA),
    plus 1e-2 (tests/blocks/test_fused_model.py's rule: two bfloat16 computations differ
    by their own roundings; a wrong mask is off by O(1))."""
    layer, x, cu_seqlens = _packed_layer(window)
    weight = torch.randn(1, x.shape[1], 256, device="cuda")
    reference = _output_and_gradients(layer, _each_alone(layer, x, cu_seqlens), x, weight)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        packed_y, _ = layer(x, cu_seqlens=cu_seqlens)
        alone_y = _each_alone(layer, x, cu_seqlens)
    packed = _output_and_gradients(layer, packed_y, x, weight)
    alone = _output_and_gradients(layer, alone_y, x, weight)

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-12)).item()

    names = ["output", "x", *(n for n, _ in layer.named_parameters())]
    for name, got, base, want in zip(names, packed, alone, reference):
        flex, sdpa = error(got, want), error(base, want)
        assert flex <= 2 * sdpa + 1e-2, f"{name}: packed FlexAttention {flex:.2e} off float32, SDPA alone's {sdpa:.2e}"


@pytest.mark.gpu
def test_packed_flex_attention_does_not_recompile_when_documents_change():
    """The block mask (its tensors and its mask_mod's document ids) is data to the compiled
    FlexAttention: a batch of other documents, as many tokens, reuses the compiled kernels."""
    layer, x, _ = _packed_layer(256)
    for lengths in (PACKED_LENGTHS, [64] * 8 + [3584], [4096], [1, 4095]):
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda")
        with torch._dynamo.config.patch(error_on_recompile=lengths is not PACKED_LENGTHS):
            y, _ = layer(x, cu_seqlens=cu_seqlens)
            y.sum().backward()
