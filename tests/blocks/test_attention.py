"""The attention layer against a plain reference attention, in float64.

The reference is written here from the definition, one query at a time: RoPE as a
complex rotation of the pairs (x_i, x_{i + D/2}) (the module rotates halves with cos and
sin), grouped heads by index (query head h reads key/value head h // (heads / kv_heads)),
the causal and window mask as a Python condition, softmax(q k^T / sqrt(D)) v by hand.
Outputs, every gradient, the decoding state and pieces-against-whole are compared.
Packed documents (`cu_seqlens`) are compared with each document run alone, on SDPA and on
FlexAttention, and the documents' block mask with the one create_block_mask gives.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from archspec.blocks import build_model
from archspec.blocks.attention import Attention
from archspec.blocks.plan import AttentionPlan, ModelPlan

from .plans import mixer_plan

CASES = {
    "mha": AttentionPlan(heads=2, kv_heads=2, head_dim=4),
    "gqa-window": AttentionPlan(heads=4, kv_heads=2, head_dim=4, window=3),
    "mqa-gate-qknorm": AttentionPlan(heads=4, kv_heads=1, head_dim=6, rope_theta=500.0, output_gate=True, qk_norm=True),
    "nope-window1": AttentionPlan(heads=2, kv_heads=1, head_dim=3, rope_theta=None, window=1),
    "window-gate": AttentionPlan(heads=2, kv_heads=2, head_dim=4, window=4, output_gate=True),
}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _rope_complex(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """x `[D]` with its pairs (x_i, x_{i+D/2}) rotated by position * theta^(-2i/D)."""
    half = x.shape[-1] // 2
    pairs = torch.complex(x[..., :half], x[..., half:])
    angle = position * theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    turned = pairs * torch.polar(torch.ones_like(angle), angle)
    return torch.cat((turned.real, turned.imag), dim=-1)


def reference_attention(layer: Attention, x: torch.Tensor, start: int = 0) -> torch.Tensor:
    """The layer's output for `x` `[B, T, d_model]` at positions start.., from its weights,
    by the definition (no SDPA, no masks as tensors). Differentiable."""
    plan = layer.plan
    B, T, _ = x.shape
    H, Hkv, D = plan.heads, plan.kv_heads, plan.head_dim
    group = H // Hkv
    q = (x @ layer.q_proj.weight.T).reshape(B, T, H, D)
    k = (x @ layer.k_proj.weight.T).reshape(B, T, Hkv, D)
    v = (x @ layer.v_proj.weight.T).reshape(B, T, Hkv, D)
    if plan.qk_norm:
        q = _rms(q, layer.q_norm.weight, layer.q_norm.eps)
        k = _rms(k, layer.k_norm.weight, layer.k_norm.eps)
    if plan.rope_theta is not None:
        q = torch.stack([_rope_complex(q[:, t], start + t, plan.rope_theta) for t in range(T)], dim=1)
        k = torch.stack([_rope_complex(k[:, t], start + t, plan.rope_theta) for t in range(T)], dim=1)
    rows = []
    for b in range(B):
        per_token = []
        for t in range(T):
            heads = []
            for h in range(H):
                kv = h // group
                seen = [s for s in range(T) if s <= t and (plan.window is None or t - s < plan.window)]
                scores = torch.stack([q[b, t, h] @ k[b, s, kv] for s in seen]) / math.sqrt(D)
                weights = torch.exp(scores - scores.max())
                weights = weights / weights.sum()
                heads.append(sum(w * v[b, s, kv] for w, s in zip(weights, seen)))
            per_token.append(torch.cat(heads))
        rows.append(torch.stack(per_token))
    o = torch.stack(rows)
    if plan.output_gate:
        o = o * torch.sigmoid(x @ layer.g_proj.weight.T)
    return o @ layer.o_proj.weight.T


def _layer(plan: AttentionPlan, d_model: int = 8, kernel: str = "auto") -> Attention:
    torch.manual_seed(0)
    layer = Attention(plan, d_model).double()
    with torch.no_grad():  # RMSNorm weights start at one: move them so they matter
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    layer.kernel = kernel
    return layer


def _run(layer, x, **kw):
    with warnings.catch_warnings():  # eager FlexAttention warns that it is not compiled
        warnings.simplefilter("ignore", UserWarning)
        return layer(x, **kw)


@pytest.mark.parametrize("name", sorted(CASES))
def test_output_and_every_gradient_match_the_reference(name):
    layer = _layer(CASES[name], kernel="sdpa")
    x = torch.randn(2, 7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y, _ = _run(layer, x)
    expected = reference_attention(layer, x)
    torch.testing.assert_close(y, expected)

    weight = torch.randn_like(y)
    got = torch.autograd.grad((y * weight).sum(), [x, *layer.parameters()])
    want = torch.autograd.grad((expected * weight).sum(), [x, *layer.parameters()])
    for (pname, _), g, w in zip([("x", None), *layer.named_parameters()], got, want):
        torch.testing.assert_close(g, w, msg=lambda m: f"gradient of {pname}: {m}")


@pytest.mark.parametrize("name", [n for n in sorted(CASES) if CASES[n].window is not None])
def test_flex_attention_matches_the_reference(name):
    """The sliding window's FlexAttention path, eager (it has no backward on the CPU;
    tests/blocks/test_hybrid_gpu.py compares its gradients on CUDA)."""
    layer = _layer(CASES[name], kernel="flex")
    x = torch.randn(2, 7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y, _ = _run(layer, x)
        torch.testing.assert_close(y, reference_attention(layer, x))


def _pieces(layer, x, sizes, state=None):
    outs, t = [], 0
    for size in sizes:
        y, state = _run(layer, x[:, t : t + size], state=state, return_state=True)
        outs.append(y)
        t += size
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("name", sorted(CASES))
def test_pieces_with_the_kv_cache_equal_the_whole(name):
    plan = CASES[name]
    layer = _layer(plan)
    x = torch.randn(2, 9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    whole, whole_state = _run(layer, x, return_state=True)
    torch.testing.assert_close(whole, reference_attention(layer, x))
    for sizes in ([4, 1, 4], [1] * 9, [2, 7]):
        got, state = _pieces(layer, x, sizes, state=layer.init_state(2) if sizes[0] == 1 else None)
        torch.testing.assert_close(got, whole)
        assert state.position == whole_state.position == 9
        torch.testing.assert_close(state.k, whole_state.k)
        torch.testing.assert_close(state.v, whole_state.v)
    # the cache keeps what a later query can see: every token, or the window's last w - 1
    kept = 9 if plan.window is None else min(9, plan.window - 1)
    assert whole_state.k.shape == (2, plan.kv_heads, kept, plan.head_dim)


def test_a_continuation_sees_the_window_across_the_piece_boundary():
    """Pieces shorter and longer than the window, so that queries of the second piece
    attend partly into the cache and partly into their own piece."""
    plan = AttentionPlan(heads=2, kv_heads=1, head_dim=4, window=5)
    layer = _layer(plan)
    x = torch.randn(1, 12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    whole, _ = _run(layer, x, return_state=True)
    for sizes in ([3, 6, 3], [7, 5], [2, 2, 8]):
        torch.testing.assert_close(_pieces(layer, x, sizes)[0], whole)


def _hybrid_plan() -> ModelPlan:
    recurrent = mixer_plan("gdn", "scalar", n_h=2, beta_scale=2.0)
    other = mixer_plan("kda", "channel")
    stack = (
        recurrent,
        AttentionPlan(heads=4, kv_heads=2, head_dim=4, window=3, output_gate=True),
        other,
        AttentionPlan(heads=2, kv_heads=2, head_dim=4, qk_norm=True),
    )
    return ModelPlan(name="hybrid", mixer=recurrent, d_model=16, layers=4, mlp="swiglu", vocab_size=13, stack=stack)


def test_a_hybrid_stack_decodes_in_pieces_exactly_like_the_whole():
    torch.manual_seed(0)
    model = build_model(_hybrid_plan()).double()
    model.set_backend("naive")
    kinds = [type(m).__name__ for m in model.sequence_mixers()]
    assert kinds == ["Mixer", "Attention", "Mixer", "Attention"]
    assert model.recurrent_layers() == [0, 2] and len(model.mixers()) == 2
    ids = torch.randint(0, 13, (2, 8), generator=torch.Generator().manual_seed(3))
    whole, whole_state = model(ids, return_state=True)
    for sizes, start in (([3, 1, 4], None), ([1] * 8, model.init_state(2))):
        state, outs, t = start, [], 0
        for size in sizes:
            logits, state = model(ids[:, t : t + size], state=state, return_state=True)
            outs.append(logits)
            t += size
        torch.testing.assert_close(torch.cat(outs, dim=1), whole)
        torch.testing.assert_close(state[0].recurrent, whole_state[0].recurrent)
        torch.testing.assert_close(state[1].k, whole_state[1].k)
        torch.testing.assert_close(state[3].v, whole_state[3].v)


def test_refuses_plans_it_cannot_build():
    with pytest.raises(ValueError, match="must divide heads"):
        Attention(AttentionPlan(heads=3, kv_heads=2, head_dim=4), 8)
    with pytest.raises(ValueError, match="even head_dim"):
        Attention(AttentionPlan(heads=2, kv_heads=2, head_dim=3), 8)
    with pytest.raises(ValueError, match="stack has 1 layer plans for 2 layers"):
        ModelPlan(name="x", mixer=mixer_plan(), d_model=8, layers=2, mlp="none", vocab_size=5, stack=(mixer_plan(),))


@pytest.mark.parametrize("name", ["gqa-window", "mqa-gate-qknorm"])
def test_packed_documents_attend_as_if_each_ran_alone(name):
    """`cu_seqlens`: each document's output equals the reference run on it alone (from
    position 0, no token of another document seen); a state is refused with packing."""
    layer = _layer(CASES[name])
    lengths = [3, 5, 1, 6]
    x = torch.randn(1, sum(lengths), 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    cu_seqlens = torch.tensor([0, 3, 8, 9, 15])
    y, state = layer(x, cu_seqlens=cu_seqlens)
    assert state is None
    for lo, hi in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        torch.testing.assert_close(y[:, lo:hi], reference_attention(layer, x[:, lo:hi]))
    with pytest.raises(ValueError, match="no state for packed documents"):
        layer(x, return_state=True, cu_seqlens=cu_seqlens)


# Documents across FlexAttention's tiles (FLEX_BLOCK = 128 tokens): lengths that divide no
# tile, one token alone, and one long enough to hold whole tiles (which the block mask
# marks fully visible without a window); 703 tokens, six tiles, the last one cut short.
PACKED_LENGTHS = [1, 7, 130, 520, 45]
PACKED_CASES = {
    "gqa": AttentionPlan(heads=4, kv_heads=2, head_dim=4),
    "gqa-window": AttentionPlan(heads=4, kv_heads=2, head_dim=4, window=50),
    "gqa-window-over-two-tiles": AttentionPlan(heads=4, kv_heads=2, head_dim=4, window=300),
    "mqa-gate-qknorm": AttentionPlan(heads=4, kv_heads=1, head_dim=6, rope_theta=500.0, output_gate=True,
                                     qk_norm=True),
}


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _documents(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    return list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))


def _each_alone(layer: Attention, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each document through the layer on its own, on SDPA (plain causal, or the window's
    mask): not the packed path's kernel nor its mask."""
    kernel, layer.kernel = layer.kernel, "sdpa"
    try:
        return torch.cat([layer(x[:, lo:hi])[0] for lo, hi in _documents(cu_seqlens)], dim=1)
    finally:
        layer.kernel = kernel


@pytest.mark.parametrize("window", [None, 1, 50, 127, 128, 300, 1000])
@pytest.mark.parametrize("lengths", [PACKED_LENGTHS, [128, 256, 1, 255], [703]])
def test_the_packed_block_mask_is_create_block_masks(lengths, window):
    """The documents' block mask, built from tile ends, tile for tile what create_block_mask
    gives by evaluating the mask_mod on every pair (partial and full tiles both ways)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from archspec.blocks.attention import _document_block_mask, _document_mask_mod

    cu_seqlens = _cu_seqlens(lengths)
    T = int(cu_seqlens[-1])
    document = torch.searchsorted(cu_seqlens[1:], torch.arange(T), right=True)
    ours = _document_block_mask(document, window)
    want = create_block_mask(_document_mask_mod(document, window), None, None, T, T, device="cpu")
    assert ours.seq_lengths == want.seq_lengths and ours.BLOCK_SIZE == want.BLOCK_SIZE
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(ours, name), getattr(want, name)), name
    if lengths == PACKED_LENGTHS and window is None:
        assert ours.full_kv_num_blocks.sum() > 0  # the layout has whole tiles to skip the mask on


@pytest.mark.parametrize("name", sorted(PACKED_CASES))
def test_packed_documents_on_flex_attention_equal_each_alone(name):
    """`kernel = "flex"` on packed documents (eager FlexAttention: forward only, it has no
    backward on the CPU; tests/blocks/test_hybrid_gpu.py compares gradients on CUDA)."""
    layer = _layer(PACKED_CASES[name], kernel="flex")
    cu_seqlens = _cu_seqlens(PACKED_LENGTHS)
    x = torch.randn(1, int(cu_seqlens[-1]), 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        y, _ = _run(layer, x, cu_seqlens=cu_seqlens)
        torch.testing.assert_close(y, _each_alone(layer, x, cu_seqlens))


@pytest.mark.parametrize("name", sorted(PACKED_CASES))
def test_packed_documents_and_every_gradient_equal_each_alone(name):
    """The packed path off CUDA ('auto': SDPA with the block-diagonal mask): outputs and
    the gradients of the input and of every weight."""
    layer = _layer(PACKED_CASES[name])
    cu_seqlens = _cu_seqlens(PACKED_LENGTHS)
    x = torch.randn(1, int(cu_seqlens[-1]), 8, dtype=torch.float64, generator=torch.Generator().manual_seed(8),
                    requires_grad=True)
    y, _ = layer(x, cu_seqlens=cu_seqlens)
    alone = _each_alone(layer, x, cu_seqlens)
    torch.testing.assert_close(y, alone)
    weight = torch.randn_like(y)
    got = torch.autograd.grad((y * weight).sum(), [x, *layer.parameters()])
    want = torch.autograd.grad((alone * weight).sum(), [x, *layer.parameters()])
    for (pname, _), g, w in zip([("x", None), *layer.named_parameters()], got, want):
        torch.testing.assert_close(g, w, msg=lambda m, pname=pname: f"gradient of {pname}: {m}")


@pytest.mark.parametrize("kernel", ["auto", "flex"])
@pytest.mark.parametrize("name", ["gqa", "gqa-window-over-two-tiles"])
def test_a_packed_document_sees_no_token_of_another(name, kernel):
    """Rewriting one document's tokens leaves every other document's output as it was, and
    (on SDPA, which has a backward here) no other document's output has a gradient with
    respect to its tokens."""
    layer = _layer(PACKED_CASES[name], kernel=kernel)
    cu_seqlens = _cu_seqlens(PACKED_LENGTHS)
    lo, hi = _documents(cu_seqlens)[3]  # the long one, tokens 138 .. 657, in five tiles
    x = torch.randn(1, int(cu_seqlens[-1]), 8, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    changed = x.clone()
    changed[:, lo:hi] += 10 * torch.randn(1, hi - lo, 8, dtype=torch.float64,  # far from the original
                                          generator=torch.Generator().manual_seed(10))
    others = torch.ones(x.shape[1], dtype=torch.bool)
    others[lo:hi] = False
    with torch.no_grad():
        before, _ = _run(layer, x, cu_seqlens=cu_seqlens)
        after, _ = _run(layer, changed, cu_seqlens=cu_seqlens)
    assert not torch.allclose(before[:, lo:hi], after[:, lo:hi])
    torch.testing.assert_close(after[:, others], before[:, others], rtol=0, atol=1e-12)
    if kernel == "auto":
        x.requires_grad_(True)
        y, _ = layer(x, cu_seqlens=cu_seqlens)
        (grad,) = torch.autograd.grad(y[:, others].sum(), [x])
        assert torch.equal(grad[:, lo:hi], torch.zeros_like(grad[:, lo:hi]))


def test_a_packed_hybrid_stack_runs_each_document_alone():
    torch.manual_seed(0)
    model = build_model(_hybrid_plan()).double()
    model.set_backend("naive")
    ids = torch.randint(0, 13, (1, 11), generator=torch.Generator().manual_seed(6))
    cu_seqlens = torch.tensor([0, 4, 11])
    packed = model(ids, cu_seqlens=cu_seqlens)
    torch.testing.assert_close(packed[:, :4], model(ids[:, :4]))
    torch.testing.assert_close(packed[:, 4:], model(ids[:, 4:]))


class _CudaQueries:
    """Stands for a CUDA query tensor of head dim `D` (all `_flex` reads of it)."""

    is_cuda = True

    def __init__(self, head_dim: int) -> None:
        self.shape = (1, 2, 5, head_dim)


def test_flex_attention_on_cuda_takes_heads_of_16_or_more():
    """Inductor's FlexAttention lowering refuses heads below 16 (seen on the H200): on CUDA
    'auto' sends them to SDPA with the window's mask, and an explicit 'flex' says why."""
    from archspec.blocks.attention import FLEX_MIN_HEAD_DIM

    layer = _layer(AttentionPlan(heads=2, kv_heads=2, head_dim=4, window=3))
    assert FLEX_MIN_HEAD_DIM == 16
    assert layer._flex(_CudaQueries(16)) and layer._flex(_CudaQueries(128))
    assert not layer._flex(_CudaQueries(8))
    assert not layer._flex(torch.zeros(1, 2, 5, 16))  # off CUDA: SDPA
    layer.kernel = "flex"
    with pytest.raises(ValueError, match="at least 16 dimensions, this layer's have 8"):
        layer._flex(_CudaQueries(8))
