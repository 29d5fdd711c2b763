"""Causal softmax attention, the other layer kind of a hybrid stack.

Per token `x_t` (`[B, T, d_model]` in, same out), as the attention layers of fla's hybrid
models and of Qwen3-Next are built:

1. `q = W_q x` (`heads` heads), `k = W_k x`, `v = W_v x` (`kv_heads` heads each; every
   key/value head serves `heads / kv_heads` query heads: grouped-query attention).
2. Optional RMSNorm over each query and key head (`qk_norm`; the fused norm of `norm.py`,
   written in the autocast dtype), then RoPE on q and k (`rope_theta`; none for NoPE), at
   the tokens' absolute positions.
3. `o = softmax(q k^T / sqrt(head_dim) + causal mask) v`; with a sliding `window`, token t
   attends to tokens `t - window + 1 .. t` only.
4. Optional output gate `o * sigmoid(W_g x)` per channel (Qwen3-Next's gated attention),
   then `o_proj`.

Kernels (no dependency beyond torch): `torch.nn.functional.scaled_dot_product_attention`
with `is_causal` for full attention, which takes the flash backend on CUDA. A sliding
window and packed documents (`cu_seqlens`: causal within each document, and within the
window if there is one) take FlexAttention with a block mask on CUDA (compiled; it skips
the blocks outside the window and those pairing two documents), and SDPA with an explicit
boolean mask elsewhere, because FlexAttention without compilation materialises every
score anyway (and the FLOP counter cannot see it). The packed documents' block mask is
built from the tokens' document ids, tile by tile, never as a T x T mask, once per
`cu_seqlens` tensor: every attention layer of a step shares it.
A continuation (a state with cached keys) also takes SDPA with an explicit mask.

Decoding state (`AttentionState`): the rotated keys and the values of the tokens a later
query can still see (all of them; the last `window - 1` with a window) and the number of
tokens seen, from which RoPE's positions continue. Calling the layer on a sequence in one
piece or in several, carrying the state, gives the same output.

Generation (`step`) keeps a `KVCache` instead: keys and values in fixed buffers of
`capacity` tokens per row, each token at its absolute position, and a count of tokens
seen per row, so rows may have prompts of different lengths and a CUDA graph can replay
the step on the same buffers. One token per row is written at its row's position and
attends, through a mask, to the positions that row has filled (within the window). With
a window the slots before the window stay unused: the buffer is indexed by position, not
a ring.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from archspec.kernels.packed import per_offsets_tensor

from .norm import RMSNorm
from .plan import AttentionPlan

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

Tensor = torch.Tensor
Kernel = Literal["auto", "sdpa", "flex"]


@dataclass
class AttentionState:
    """One attention layer's decoding state."""

    k: Tensor  # [B, kv_heads, C, head_dim]: the last C tokens' keys, RoPE applied
    v: Tensor  # [B, kv_heads, C, head_dim]
    position: int  # tokens seen so far

    @property
    def cached(self) -> int:
        return self.k.shape[2]


@dataclass
class KVCache:
    """One attention layer's state for generation (`Attention.step`), updated in place."""

    k: Tensor  # [B, kv_heads, capacity, head_dim]: token t's key (RoPE applied) at slot t
    v: Tensor  # [B, kv_heads, capacity, head_dim]
    length: Tensor  # [B] int64: tokens seen by each row, the slot its next token takes

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @classmethod
    def of(cls, state: AttentionState, capacity: int) -> KVCache:
        """The buffers of `capacity` tokens holding what `state` caches, at its positions."""
        B, Hkv, cached, D = state.k.shape
        if capacity < state.position:
            raise ValueError(f"a KV cache of {capacity} tokens cannot hold a state that has seen {state.position}")
        k = state.k.new_zeros(B, Hkv, capacity, D)
        v = state.v.new_zeros(B, Hkv, capacity, D)
        k[:, :, state.position - cached : state.position] = state.k
        v[:, :, state.position - cached : state.position] = state.v
        return cls(k, v, torch.full((B,), state.position, dtype=torch.long, device=k.device))

    def reserve(self, tokens: int) -> None:
        """Grow the buffers (doubling) so that every row can take `tokens` more; a host
        sync, for callers that do not know the length ahead (not inside a CUDA graph)."""
        need = int(self.length.max()) + tokens if self.length.numel() else tokens
        if need <= self.capacity:
            return
        grown = max(need, 2 * self.capacity)
        pad = (0, 0, 0, grown - self.capacity)
        self.k = F.pad(self.k, pad)
        self.v = F.pad(self.v, pad)

    def rows(self, index: Tensor) -> KVCache:
        return KVCache(self.k[index].contiguous(), self.v[index].contiguous(), self.length[index].contiguous())

    @staticmethod
    def cat(caches: list[KVCache]) -> KVCache:
        return KVCache(torch.cat([c.k for c in caches]), torch.cat([c.v for c in caches]),
                       torch.cat([c.length for c in caches]))


def check_plan(plan: AttentionPlan) -> None:
    """Refuse plans the layer cannot build; the spec validator should never produce one."""
    problems = []
    if min(plan.heads, plan.kv_heads, plan.head_dim) < 1:
        problems.append("heads, kv_heads and head_dim must be positive")
    elif plan.heads % plan.kv_heads:
        problems.append(f"kv_heads = {plan.kv_heads} must divide heads = {plan.heads}")
    if plan.rope_theta is not None and (plan.head_dim % 2 or plan.rope_theta <= 0):
        problems.append("RoPE needs an even head_dim and rope_theta > 0")
    if plan.window is not None and plan.window < 1:
        problems.append("window must be >= 1 (or None)")
    if problems:
        raise ValueError("invalid AttentionPlan: " + "; ".join(problems))


def rope_angles(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin `[T, head_dim / 2]` of RoPE at `positions` (frequencies `theta^(-2i/D)`).

    Angles are formed in float64 when the model is float64 and in float32 otherwise, then
    cast to the activations' dtype, as is usual for RoPE under autocast.
    """
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=work) / head_dim)
    angles = positions.to(work)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair (x_i, x_{i + D/2}) of `x` `[B, heads, T, D]` by its angle (the
    rotate-half pairing of GPT-NeoX and LLaMA)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def visible(query_positions: Tensor, key_positions: Tensor, window: int | None) -> Tensor:
    """Boolean `[T, S]`: which key each query may attend to (causal, within the window)."""
    distance = query_positions[:, None] - key_positions[None, :]
    allowed = distance >= 0
    if window is not None:
        allowed = allowed & (distance < window)
    return allowed


# FlexAttention picks its decoding kernel for queries shorter than 128 tokens; Inductor
# (torch 2.11 on an H200) finds no valid configuration of that kernel for a windowed block
# mask with grouped heads and raises NoValidChoicesError. Every call here attends a fresh
# sequence (prefill or training), the main kernel's case: it is forced.
FLEX_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}


# Inductor's FlexAttention lowering (torch 2.11) refuses smaller heads: "NYI: embedding
# dimension of the query, key, and value must be at least 16" (seen on the H200).
FLEX_MIN_HEAD_DIM = 16


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.cache  # never evicted: a captured training step (graphed_step) reads its mask by address
def _window_block_mask(length: int, window: int, device: str):
    """FlexAttention's block mask of a sliding window over one fresh sequence (a few small
    tensors per length seen)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return create_block_mask(mask_mod, None, None, length, length, device=device)


# FlexAttention's sparse block (create_block_mask's default): a block mask says, per tile
# of FLEX_BLOCK queries x FLEX_BLOCK keys, whether the tile is skipped, fully visible or
# partly visible (mask_mod applied inside).
FLEX_BLOCK = 128


MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _document_mask_mod(document: Tensor, window: int | None) -> MaskMod:
    """FlexAttention's mask_mod of packed documents: causal, within one document, within
    the window. Within one document the distance of two tokens is that of their indices in
    the row, so the row's indices serve for causality and the window."""
    if window is None:
        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (kv_idx <= q_idx) & (document[q_idx] == document[kv_idx])
    else:
        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (kv_idx <= q_idx) & (q_idx - kv_idx < window) & (document[q_idx] == document[kv_idx])
    return mask_mod


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """A `[n, n]` boolean tile layout as BlockMask takes it: per query tile, the number of
    marked key tiles, and the key tiles' indices with the marked ones first, in order
    (create_block_mask's ordering)."""
    marked = tiles.to(torch.int32)
    count = marked.sum(-1, dtype=torch.int32)
    indices = torch.argsort(marked, dim=-1, descending=True, stable=True).to(torch.int32)
    return count[None, None], indices[None, None]


def _document_block_mask(document: Tensor, window: int | None) -> BlockMask:
    """FlexAttention's block mask of one packed row whose token t belongs to document
    `document[t]` (non-decreasing): what `create_block_mask` gives for `_document_mask_mod`,
    from each tile's first and last token. `create_block_mask` evaluates the mask_mod on
    every pair (T x T booleans and larger temporaries: gigabytes at 16k tokens) unless it
    is compiled; this is a few `[T / FLEX_BLOCK]^2` ops on the device, no host sync and
    nothing to compile, cheap enough to build per batch.

    Documents are contiguous, so a tile holds the documents from its first token's to its
    last token's. A key tile before a query tile can share only one document with it, the
    one holding the key tile's last and the query tile's first token: the pair of tiles is
    visible iff their document ranges meet, the key tile is not after the query tile, and
    those two tokens are within the window. It is fully visible iff both tiles lie in one
    document, every key precedes every query, and the farthest pair is within the window;
    a tile cut short by the end of the row is never full (create_block_mask counts its
    missing pairs as masked).
    """
    from torch.nn.attention.flex_attention import BlockMask

    T = document.shape[0]
    first = torch.arange(0, T, FLEX_BLOCK, device=document.device)
    last = (first + FLEX_BLOCK - 1).clamp(max=T - 1)
    q_first, q_last, k_first, k_last = first[:, None], last[:, None], first[None, :], last[None, :]
    d_first, d_last = document[first], document[last]
    meet = (d_first[None, :] <= d_last[:, None]) & (d_first[:, None] <= d_last[None, :])
    some = meet & (k_first <= q_last)
    whole = (d_first == d_last) & (last - first + 1 == FLEX_BLOCK)  # a complete tile of one document
    full = whole[:, None] & whole[None, :] & (d_first[:, None] == d_first[None, :]) & (k_last <= q_first)
    if window is not None:
        some &= q_first - k_last < window
        full &= q_last - k_first < window
    return BlockMask.from_kv_blocks(*_ordered(some & ~full), *_ordered(full), BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=_document_mask_mod(document, window), seq_lengths=(T, T))


@per_offsets_tensor
def _packed_layout(cu_seqlens: Tensor, T: int) -> tuple[Tensor, Tensor]:
    """Per token of a packed row of `T` tokens: its document and its position in it. Formed
    once per `cu_seqlens` tensor (`kernels/packed.py`), as the recurrence's chunk tables
    are: every attention layer of a step shares them."""
    positions = torch.arange(T, device=cu_seqlens.device)
    document = torch.searchsorted(cu_seqlens[1:], positions, right=True)
    return document, positions - cu_seqlens[document]


@per_offsets_tensor
def _packed_block_mask(cu_seqlens: Tensor, T: int, window: int | None) -> BlockMask:
    """`_document_block_mask` of a packed row, formed once per `cu_seqlens` tensor and window."""
    return _document_block_mask(_packed_layout(cu_seqlens, T)[0], window)


class Attention(nn.Module):
    def __init__(self, plan: AttentionPlan, d_model: int, norm_eps: float = 1e-6):
        super().__init__()
        check_plan(plan)
        self.plan = plan
        H, Hkv, D = plan.heads, plan.kv_heads, plan.head_dim
        # auto: SDPA, or FlexAttention for a sliding window or packed documents on CUDA;
        # tests force either
        self.kernel: Kernel = "auto"
        self.q_proj = nn.Linear(d_model, H * D, bias=False)
        self.k_proj = nn.Linear(d_model, Hkv * D, bias=False)
        self.v_proj = nn.Linear(d_model, Hkv * D, bias=False)
        self.g_proj = nn.Linear(d_model, H * D, bias=False) if plan.output_gate else None
        # the fused norm (`nn.RMSNorm`'s parameter and state-dict key): under autocast
        # `nn.RMSNorm` meets bfloat16 rows and a float32 weight and falls back to its
        # unfused form, in float32
        self.q_norm = RMSNorm(D, eps=norm_eps) if plan.qk_norm else None
        self.k_norm = RMSNorm(D, eps=norm_eps) if plan.qk_norm else None
        self.o_proj = nn.Linear(H * D, d_model, bias=False)

    @property
    def scale(self) -> float:
        return self.plan.head_dim**-0.5

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> AttentionState:
        """The state of a sequence that has not started (what `state=None` means)."""
        p = self.o_proj.weight
        device = p.device if device is None else torch.device(device)
        empty = torch.zeros(batch_size, self.plan.kv_heads, 0, self.plan.head_dim, device=device, dtype=p.dtype)
        return AttentionState(empty, empty.clone(), 0)

    def _heads(self, proj: nn.Linear, x: Tensor, heads: int, norm: nn.Module | None) -> Tensor:
        B, T, _ = x.shape
        h = proj(x).reshape(B, T, heads, self.plan.head_dim)
        if norm is not None:
            h = norm(h)
        return h.transpose(1, 2)  # [B, heads, T, D]

    def forward(
        self, x: Tensor, state: AttentionState | None = None, return_state: bool = False, *,
        cu_seqlens: Tensor | None = None,
    ) -> tuple[Tensor, AttentionState | None]:
        """`x` `[B, T, d_model]` -> `[B, T, d_model]`, and the state after the last token.

        `cu_seqlens` (token offsets `[N+1]`, B = 1) packs N documents in one row: each
        attends only within itself, from position 0, as if it ran alone. Packed documents
        take no state and return none (their caches would differ in length).
        """
        plan = self.plan
        B, T, _ = x.shape
        if cu_seqlens is not None and (state is not None or return_state):
            raise ValueError(
                "an attention layer keeps no state for packed documents (cu_seqlens): their KV caches "
                "would differ in length; decode documents as separate rows"
            )
        start = 0 if state is None else state.position
        q = self._heads(self.q_proj, x, plan.heads, self.q_norm)
        k = self._heads(self.k_proj, x, plan.kv_heads, self.k_norm)
        v = self._heads(self.v_proj, x, plan.kv_heads, None)
        document = None
        if cu_seqlens is None:
            positions = torch.arange(start, start + T, device=x.device)
        else:  # each document from position 0 (packed rows keep no state: start is 0)
            document, positions = _packed_layout(cu_seqlens, T)
        if plan.rope_theta is not None:
            cos, sin = rope_angles(positions, plan.head_dim, plan.rope_theta, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # the kernels (FlexAttention in particular) take one dtype; a replaced q/k norm
        # (`nn.RMSNorm` under autocast) may return float32 where v is bfloat16
        q, k = q.to(v.dtype), k.to(v.dtype)

        cached = 0 if state is None else state.cached
        if cached:
            k = torch.cat((state.k.to(k.dtype), k), dim=2)
            v = torch.cat((state.v.to(v.dtype), v), dim=2)
        o = (self._attend(q, k, v, start, cached) if document is None
             else self._attend_packed(q, k, v, positions, document, cu_seqlens))

        o = o.transpose(1, 2).reshape(B, T, plan.heads * plan.head_dim)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        y = self.o_proj(o)
        if not return_state:
            return y, None
        keep = k.shape[2] if plan.window is None else min(k.shape[2], plan.window - 1)
        first = k.shape[2] - keep
        return y, AttentionState(k[:, :, first:], v[:, :, first:], start + T)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, start: int, cached: int) -> Tensor:
        """Softmax attention of q `[B, H, T, D]` (positions `start ..`) over k, v
        `[B, Hkv, cached + T, D]`: the `cached` earlier tokens, then the queries' own."""
        window, T = self.plan.window, q.shape[2]
        gqa = self.plan.kv_heads != self.plan.heads
        if cached == 0 and (window is None or window >= T):  # plain causal attention
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        if cached == 0 and self._flex(q):
            block_mask = _window_block_mask(T, window, str(q.device))
            attend = _compiled_flex() if q.is_cuda else _eager_flex()
            return attend(q, k, v, block_mask=block_mask, scale=self.scale, enable_gqa=gqa, kernel_options=FLEX_OPTIONS)
        if T == 1:  # one new token sees every cached one (the cache keeps only the window)
            return F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=gqa)
        positions = torch.arange(start, start + T, device=q.device)
        mask = visible(positions, torch.arange(start - cached, start + T, device=q.device), window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)

    def decode_state(self, state: AttentionState | KVCache, capacity: int | None) -> KVCache:
        """A `KVCache` of `capacity` tokens per row holding `state` (a copy that `step`
        updates in place)."""
        if isinstance(state, KVCache):
            return KVCache(state.k.clone(), state.v.clone(), state.length.clone())
        if capacity is None:
            raise ValueError("an attention layer decodes from a KV cache of a fixed size: give its capacity "
                             "(the prompt's tokens and the new ones)")
        return KVCache.of(state, capacity)

    def step(self, x: Tensor, cache: KVCache) -> Tensor:
        """One token `x` `[B, 1, d_model]` -> `[B, 1, d_model]` for every row, at the row's
        own position, its key and value written into `cache` (which must have room: see
        `KVCache.reserve`): what `forward` gives for a one-token piece."""
        plan = self.plan
        B = x.shape[0]
        position = cache.length
        q = self._heads(self.q_proj, x, plan.heads, self.q_norm)
        k = self._heads(self.k_proj, x, plan.kv_heads, self.k_norm)
        v = self._heads(self.v_proj, x, plan.kv_heads, None)
        if plan.rope_theta is not None:
            cos, sin = rope_angles(position, plan.head_dim, plan.rope_theta, q.dtype)
            cos, sin = cos[:, None, None], sin[:, None, None]  # per row: [B, 1, 1, D/2]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k = q.to(v.dtype), k.to(v.dtype)
        slot = position.view(B, 1, 1, 1).expand(B, plan.kv_heads, 1, plan.head_dim)
        cache.k.scatter_(2, slot, k.to(cache.k.dtype))
        cache.v.scatter_(2, slot, v.to(cache.v.dtype))
        keys = torch.arange(cache.capacity, device=x.device)
        mask = visible(position, keys, plan.window)[:, None, None, :]  # [B, 1, 1, capacity]
        o = F.scaled_dot_product_attention(q, cache.k.to(v.dtype), cache.v.to(v.dtype), attn_mask=mask,
                                           scale=self.scale, enable_gqa=plan.kv_heads != plan.heads)
        cache.length.add_(1)
        o = o.transpose(1, 2).reshape(B, 1, plan.heads * plan.head_dim)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def _attend_packed(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, document: Tensor,
                       cu_seqlens: Tensor) -> Tensor:
        """Attention within each packed document (causal, within the window): FlexAttention
        with the documents' block mask, which visits only the tiles within documents, or
        SDPA with the block-diagonal mask, built from each token's document and its
        position in it."""
        window = self.plan.window
        gqa = self.plan.kv_heads != self.plan.heads
        if self._flex(q):
            block_mask = _packed_block_mask(cu_seqlens, q.shape[2], window)
            attend = _compiled_flex() if q.is_cuda else _eager_flex()
            return attend(q, k, v, block_mask=block_mask, scale=self.scale, enable_gqa=gqa, kernel_options=FLEX_OPTIONS)
        mask = visible(positions, positions, window) & (document[:, None] == document[None, :])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)

    def _flex(self, q: Tensor) -> bool:
        """Whether a fresh sequence with a sparse mask (a sliding window, packed documents)
        takes FlexAttention (on CUDA, for heads Inductor's lowering takes; SDPA with an
        explicit mask otherwise)."""
        if self.kernel == "auto":
            return q.is_cuda and q.shape[-1] >= FLEX_MIN_HEAD_DIM
        if self.kernel == "flex" and q.is_cuda and q.shape[-1] < FLEX_MIN_HEAD_DIM:
            raise ValueError(f"FlexAttention on CUDA takes heads of at least {FLEX_MIN_HEAD_DIM} dimensions, "
                             f"this layer's have {q.shape[-1]}: leave the kernel at 'auto' (SDPA with a mask)")
        return self.kernel == "flex"


def _eager_flex():
    """FlexAttention without compilation (what `kernel = "flex"` runs off CUDA: tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention
