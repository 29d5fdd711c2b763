"""The analytic cost model: parameters, forward FLOPs per token, decoding state bytes.

Everything here is computed from the plan alone (no module is built), so a search can
price a spec before training it. Each count mirrors the modules in this package term by
term, summed layer by layer (a hybrid stack's layers differ); `tests/blocks/test_cost.py`
checks them against the built modules and against
`torch.utils.flop_counter.FlopCounterMode` on the `torch` backend.

FLOPs are `2 x` multiply-adds of matmul-type work (contractions): projections, short
convs, the MLP, the head, the recurrence as the backend that runs it computes it (the
Triton chunk kernel on a GPU, `backend="triton"`, 64 sub-steps per chunk; the chunked
PyTorch path elsewhere, `backend="torch"`, 16 or 32; each at its own chunk size,
`archspec.kernels.chunking`), and attention's `q k^T` and `p v` over the causal pairs
(query t sees `min(t + 1, window)` keys: the work a causal kernel that skips masked blocks
does, so a token of a long sequence costs more than one of a short one). Elementwise work
(norms, activations, RoPE, softmax, gate and beta formulas, decay factors, the OSDN scan,
which is O(K) per sub-step) is not counted, as is usual for FLOP counts of language
models.

The decoding state of a sequence grows with its length only in attention layers (their
KV cache: every token's key and value, or the window's last `window - 1`); a recurrent
layer's is its fixed matrix state, conv tails and OSDN's `d`.
"""

from __future__ import annotations

import math

from archspec.kernels.chunking import torch_tokens_per_chunk, triton_tokens_per_chunk

from .mixer import stream_widths
from .mlp import mlp_hidden_size
from .plan import AttentionPlan, LayerPlan, ModelPlan, RecurrencePlan

# Terms of `flops_breakdown` that FlopCounterMode does not see: it counts aten matmuls
# and convolutions, but `torch.linalg.solve_triangular` has no flop formula there, and
# the channel-gate scores' within-token leaves are elementwise products summed over K.
NOT_SEEN_BY_FLOP_COUNTER = ("recurrence_solve", "recurrence_channel_leaves")
# Terms FlopCounterMode sees as a dense T x T product: on the CPU, scaled_dot_product_attention
# runs its math path, which computes every score and masks the ones a query may not see.
# The analytic terms count the causal pairs only (`causal_pairs`).
ATTENTION_TERMS = ("attention_scores", "attention_values")

STATE_BYTES_PER_ELEMENT = 4  # the matrix state and OSDN's d are kept in float32


def _mixer_matrices(plan: RecurrencePlan, d_model: int) -> list[tuple[int, int]]:
    """`(d_in, d_out)` of every matrix weight of one `Mixer`, as its `__init__` creates
    them (a low-rank map is two matrices). Each is used once per token."""
    H, K, V, n = plan.heads, plan.head_dim, plan.value_dim, plan.n_h
    mats = [(d_model, w) for w in stream_widths(plan).values()]
    if plan.transition == "householder":
        mats.append((d_model, n * H))  # beta
    if plan.transition == "rwkv7":
        mats += [(d_model, K), (K, n * H * K)]  # erase strength a, low rank K
    if plan.gate == "scalar":
        mats.append((d_model, H))
    elif plan.gate == "channel":
        mats += [(d_model, V), (V, H * K)]  # low rank V
    if plan.preconditioner is not None and plan.preconditioner.apf:
        mats.append((d_model, H))  # retain gate
    if plan.backbone == "gdn":
        mats.append((d_model, H * V))  # output gate
    elif plan.backbone == "kda":
        mats += [(d_model, V), (V, H * V)]  # low-rank output gate
    mats.append((H * V, d_model))  # o_proj
    return mats


def _mixer_vectors(plan: RecurrencePlan) -> int:
    """Parameters of one `Mixer` that are not matrices: biases, A_log, dt_bias or w0, d_0,
    the output norm's weight. They take no multiply-adds."""
    H, K, V, n = plan.heads, plan.head_dim, plan.value_dim, plan.n_h
    total = V  # output RMSNorm weight
    total += n * H * K if plan.transition == "rwkv7" else 0  # erase bias
    # the gate's bias (dt_bias or w0) per head or key channel, and mamba2's learned rate A_log
    # (rwkv7's rate is a constant)
    total += {"none": 0, "scalar": H, "channel": H * K}[plan.gate]
    total += H if plan.gate != "none" and plan.decay == "mamba2" else 0
    if plan.preconditioner is not None:
        total += H if plan.preconditioner.apf else 0  # retain bias
        total += H * K if plan.preconditioner.init == "learned" else 0  # d_0
    total += H * V if plan.backbone == "kda" else 0  # output gate bias
    return total


def _conv_weights(plan: RecurrencePlan) -> int:
    """Depthwise short-conv weights (no bias): kernel size x channels of every stream."""
    return plan.short_conv * sum(stream_widths(plan).values())


def mixer_params(plan: RecurrencePlan, d_model: int) -> int:
    """Parameters of one `Mixer`."""
    matrices = sum(i * o for i, o in _mixer_matrices(plan, d_model))
    return matrices + _mixer_vectors(plan) + _conv_weights(plan)


def _mlp_matrices(plan: ModelPlan) -> int:
    """Weights of one block's MLP (every one of them is a d_model x hidden matrix)."""
    if plan.mlp == "none":
        return 0
    hidden = mlp_hidden_size(plan.mlp, plan.d_model, plan.mlp_ratio)
    return (3 if plan.mlp == "swiglu" else 2) * plan.d_model * hidden


def _attention_matrices(plan: AttentionPlan, d_model: int) -> list[tuple[int, int]]:
    """`(d_in, d_out)` of every matrix weight of one `Attention` layer, each used once per token."""
    H, Hkv, D = plan.heads, plan.kv_heads, plan.head_dim
    mats = [(d_model, H * D), (d_model, Hkv * D), (d_model, Hkv * D)]  # q, k, v
    if plan.output_gate:
        mats.append((d_model, H * D))
    return mats + [(H * D, d_model)]  # o_proj


def attention_params(plan: AttentionPlan, d_model: int) -> int:
    """Parameters of one `Attention` layer: its matrices and the q/k norms' weights."""
    norms = 2 * plan.head_dim if plan.qk_norm else 0
    return sum(i * o for i, o in _attention_matrices(plan, d_model)) + norms


def layer_params(layer: LayerPlan, d_model: int) -> int:
    """Parameters of one layer's sequence mixer (recurrent or attention)."""
    if isinstance(layer, AttentionPlan):
        return attention_params(layer, d_model)
    return mixer_params(layer, d_model)


def count_params(plan: ModelPlan) -> int:
    """Exactly `sum(p.numel() for p in build_model(plan).parameters())`."""
    d = plan.d_model
    norms = d * (2 if plan.mlp != "none" else 1)
    blocks = sum(norms + layer_params(layer, d) + _mlp_matrices(plan) for layer in plan.layer_plans)
    embed = plan.vocab_size * d
    head = 0 if plan.tie_embeddings else plan.vocab_size * d
    return embed + blocks + d + head


def _score_macs(rows_per_token: int, ct: int, n_h: int, K: int, channel: bool) -> tuple[int, int]:
    """(matmul, elementwise) multiply-adds of one decayed score matrix of
    `archspec.kernels.decay_scores`: rows are a chunk's sub-steps (`rows_per_token = n_h`)
    or its read-outs (1), columns its `L = ct * n_h` sub-steps.

    No or scalar gate: one dense `[rows, K] @ [K, L]` matmul. Channel gate: dyadic
    splitting, one matmul per level m = 1, 2, .., ct/2 over ct/(2m) blocks of
    `[m rows_per_token, K] @ [K, m n_h]` (together ct (ct - 1) / 2 token pairs), plus the
    within-token leaves, an elementwise product summed over K.
    """
    pair = rows_per_token * n_h * K  # multiply-adds per (row token, column token) pair
    if not channel:
        return ct * ct * pair, 0
    return ct * (ct - 1) // 2 * pair, ct * pair


RECURRENCE_BACKENDS = ("torch", "triton")


def _recurrence_flops(plan: RecurrencePlan, seq_len: int, backend: str = "torch") -> dict[str, float]:
    """Forward FLOPs per token of the recurrence on `backend`, summed over heads."""
    if backend == "triton":
        return _triton_recurrence_flops(plan, seq_len)
    if backend != "torch":
        raise ValueError(f"backend must be one of {RECURRENCE_BACKENDS}, got {backend!r}")
    return _torch_recurrence_flops(plan, seq_len)


def _torch_recurrence_flops(plan: RecurrencePlan, seq_len: int) -> dict[str, float]:
    """FLOPs per token of `archspec.kernels.chunked`, summed over heads.

    Per chunk of `ct` tokens and `L = ct * n_h` sub-steps, per head, as listed in the
    module docstring of `archspec.kernels.chunked` (the matmul and the line that does it
    are named below). A sequence is zero-padded to whole chunks, and the padding is paid
    for, as the backend does.
    """
    K, V, n = plan.head_dim, plan.value_dim, plan.n_h
    channel = plan.gate == "channel"
    ct = torch_tokens_per_chunk(n, delta=plan.transition != "diagonal")
    L = ct * n
    query_scores = _score_macs(1, ct, n, K, channel)
    substep_scores = _score_macs(n, ct, n, K, channel)

    scores = [query_scores]  # M_qw = q w^T
    matmul = ct * K * V  # read-out of the start state, (q Gamma_q) S_0
    solve = 0
    if plan.transition == "diagonal":
        matmul += K * L * V + ct * L * V  # Z'_end^T N', M_qz' N'
    else:
        scores.append(substep_scores)  # A_kw = k w^T
        # (I + A)^{-1}: a unit lower-triangular solve against the L x L identity (LAPACK's
        # trsm does not skip the identity's zeros: L columns of L (L - 1) / 2 each)
        solve = L * L * (L - 1) // 2
        matmul += L * L * K + L * L * V  # P = T (k Gamma) ; N = T U (householder) or (T A_kw) U
        matmul += L * K * V + K * L * V  # state chain: P S_0 ; Z_end^T nu
        matmul += ct * L * V  # read-out M_qz nu
        if plan.transition == "rwkv7":
            scores += [substep_scores, query_scores]  # A_ka = k a^T, M_qa = q a^T
            matmul += K * L * V + ct * L * V  # independent writes: Z'_end^T N', M_qz' N'
            if channel and n == 1:
                # `_rwkv7_chain_without_grad` (the forward without autograd, which is what
                # is priced): neither P = T (k Gamma) nor T A_kw is formed; the chain
                # applies T to r = k S_0 + A_kw U instead ([L,L]@[L,V]; `[q; k] S_0` and
                # `[M_qw; A_kw] U` are the read-out, `P S_0`, `M_qz' N'` and `A_kw U` stacked)
                matmul += L * L * V - L * L * K
            else:
                matmul += L * L * L  # T A_kw
    matmul += sum(mm for mm, _ in scores)
    to_per_token = 2 * plan.heads * math.ceil(seq_len / ct) / seq_len
    return {
        "recurrence_matmul": to_per_token * matmul,
        "recurrence_channel_leaves": to_per_token * sum(ew for _, ew in scores),
        "recurrence_solve": to_per_token * solve,
    }


# The Triton kernel's block-substitution inverse (`kernels/triton/solve.py`): 16-row blocks.
TRITON_SOLVE_BLOCK = 16


def triton_chunk_flops(plan: RecurrencePlan) -> tuple[float, float, float]:
    """`(forward matmul, forward solve, backward)` FLOPs of one chunk and head of the Triton
    kernel (`docs/kernel.md`, "Algorithm"): `C` query tokens and `L` sub-steps per chunk.
    A channel gate's products are counted as the one factorized product each forms when
    the chunk's decay is within `decay.py`'s bound (stronger decays add sub-chunk work)."""
    K, V, n = plan.head_dim, plan.value_dim, plan.n_h
    C = triton_tokens_per_chunk(n)
    L = C * n
    mm = lambda m, k, o: 2.0 * m * k * o  # noqa: E731  (an [m, k] @ [k, o] product)
    delta = plan.transition != "diagonal"
    plain = plan.transition != "householder"  # independent writes W~^T U
    fwd = mm(C, K, V)  # Q~ S_0
    bwd = 2 * mm(C, K, V)  # dO S_0^T, Q~^T dO
    solve = 0.0
    if delta:
        fwd += mm(L, K, L) + mm(L, L, K) + mm(L, L, V)  # A, P = Tinv K~, X = Tinv Z
        fwd += 2 * mm(L, K, V)  # Y = X - P S_0, E~^T Y
        fwd += mm(C, K, L) + mm(C, L, V)  # M_E, M_E Y
        nb = L // TRITON_SOLVE_BLOCK
        solve = nb * (nb - 1) * (nb + 4) / 6 * mm(TRITON_SOLVE_BLOCK, TRITON_SOLVE_BLOCK, TRITON_SOLVE_BLOCK)
        bwd += mm(C, K, L) + mm(L, C, V)  # the scores again, M_E^T dO
        bwd += 2 * mm(L, K, V)  # E_end dS, P^T dY
        bwd += mm(C, L, V) + 2 * mm(L, K, V) + 2 * mm(L, L, V)  # dO Y^T, Y dS^T, dY S_0^T, Tinv^T dY, dY Z^T
        bwd += 3 * mm(L, K, L) + 2 * mm(L, L, L)  # A again, the dT terms, dA
        bwd += 2 * mm(L, L, K) + 2 * mm(C, L, K)  # the applies of dA and dM_E
    if plain:
        fwd += mm(L, K, V) + mm(C, K, L) + mm(C, L, V)  # W~^T U, M_W, M_W U
        bwd += mm(C, K, L) + mm(L, C, V) + mm(L, K, V)  # M_W again, M_W^T dO, W_end dS
        bwd += mm(C, L, V) + mm(L, K, V) + 2 * mm(C, L, K)  # dO U^T, U dS^T, the applies of dM_W
    if delta and plain:  # rwkv7: the write keys enter the UT transform too
        fwd += mm(L, K, L) + mm(L, L, L)
        bwd += 3 * mm(L, K, L) + 2 * mm(L, L, V)
    # the backward forms P, X, Y and the chunk states again (it keeps only Tinv): prepare
    # (P, X; RWKV-7's Z from its write keys) and the state pass (Y = X - P S_0, E~^T Y, W~^T U)
    if delta:
        bwd += mm(L, L, K) + mm(L, L, V) + 2 * mm(L, K, V)
    if delta and plain:
        bwd += mm(L, K, L) + mm(L, L, L)
    if plain:
        bwd += mm(L, K, V)
    return fwd, solve, bwd


def _triton_recurrence_flops(plan: RecurrencePlan, seq_len: int) -> dict[str, float]:
    """FLOPs per token of the Triton chunk kernel's forward, summed over heads; a sequence
    is cut into whole chunks, the last one partial (its padding rows are masked but computed)."""
    fwd, solve, _ = triton_chunk_flops(plan)
    per_token = plan.heads * math.ceil(seq_len / triton_tokens_per_chunk(plan.n_h)) / seq_len
    return {"recurrence_matmul": per_token * fwd, "recurrence_channel_leaves": 0.0, "recurrence_solve": per_token * solve}


def causal_pairs(seq_len: int, window: int | None) -> int:
    """(query, key) pairs of causal attention over `seq_len` tokens: query t sees
    `min(t + 1, window)` keys."""
    if window is None or window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    return window * (window + 1) // 2 + (seq_len - window) * window


def _attention_flops(plan: AttentionPlan, seq_len: int) -> dict[str, float]:
    """FLOPs per token of `q k^T` and of the probabilities times `v`, over the causal
    pairs of a `seq_len`-token sequence, every query head."""
    per_pair = 2.0 * plan.heads * plan.head_dim
    pairs_per_token = causal_pairs(seq_len, plan.window) / seq_len
    return {"attention_scores": per_pair * pairs_per_token, "attention_values": per_pair * pairs_per_token}


def _add(terms: dict[str, float], more: dict[str, float]) -> None:
    for name, value in more.items():
        terms[name] = terms.get(name, 0.0) + value


def flops_breakdown(plan: ModelPlan, seq_len: int, backend: str = "torch") -> dict[str, float]:
    """Forward FLOPs per token by kind, for sequences of `seq_len` tokens, with the
    recurrence as `backend` (`"torch"`: the CPU path, `"triton"`: the GPU kernel) runs it,
    summed over the layers (a term a stack does not have is absent)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    d = plan.d_model
    terms = {"projections": 0.0}
    for layer in plan.layer_plans:
        if isinstance(layer, AttentionPlan):
            terms["projections"] += 2.0 * sum(i * o for i, o in _attention_matrices(layer, d))
            _add(terms, _attention_flops(layer, seq_len))
            continue
        terms["projections"] += 2.0 * sum(i * o for i, o in _mixer_matrices(layer, d))
        _add(terms, {"short_conv": 2.0 * _conv_weights(layer)})
        _add(terms, _recurrence_flops(layer, seq_len, backend))
    terms["mlp"] = 2.0 * plan.layers * _mlp_matrices(plan)
    terms["head"] = 2.0 * plan.vocab_size * d
    return terms


def flops_per_token(plan: ModelPlan, seq_len: int, backend: str = "torch") -> float:
    """Analytic forward FLOPs per token (see the module docstring for what counts)."""
    return float(sum(flops_breakdown(plan, seq_len, backend).values()))


def cached_tokens(plan: AttentionPlan, context_len: int) -> int:
    """Tokens an attention layer keeps after `context_len` tokens: all, or the window's last `window - 1`."""
    return context_len if plan.window is None else min(context_len, plan.window - 1)


def layer_state_bytes(layer: LayerPlan, context_len: int | None = None, activation_bytes: int = 4) -> int:
    """One layer's decoding state of one sequence. Recurrent: the matrix state S
    (float32), the short convs' tails (`W - 1` inputs per stream, in the activations'
    dtype of `activation_bytes`) and OSDN's `d` (float32). Attention: the keys and
    values of the cached tokens after `context_len` tokens, in the activations' dtype."""
    if isinstance(layer, AttentionPlan):
        if context_len is None or context_len < 0:
            raise ValueError(f"an attention layer's state (its KV cache) needs a context length >= 0, got {context_len}")
        return 2 * layer.kv_heads * layer.head_dim * cached_tokens(layer, context_len) * activation_bytes
    matrix = layer.heads * layer.head_dim * layer.value_dim * STATE_BYTES_PER_ELEMENT
    tails = max(layer.short_conv - 1, 0) * sum(stream_widths(layer).values()) * activation_bytes
    osdn = layer.heads * layer.head_dim * STATE_BYTES_PER_ELEMENT if layer.preconditioner is not None else 0
    return matrix + tails + osdn


def state_bytes(plan: ModelPlan, context_len: int | None = None, activation_bytes: int = 4) -> int:
    """Decoding state of one sequence after `context_len` tokens, all layers (see
    `layer_state_bytes`). A stack without attention needs no context length."""
    return sum(layer_state_bytes(layer, context_len, activation_bytes) for layer in plan.layer_plans)
