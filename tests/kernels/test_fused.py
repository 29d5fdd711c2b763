"""The fused pieces of the training step against independent definitions: values and every
gradient.

- Linear cross-entropy: against `F.cross_entropy` on the full float64 logits.
- RMSNorm (plain, SiLU- and sigmoid-gated): against the formula written out in float64;
  with the residual stream's addition fused in, against the sum and the formula; what the
  ungated norm keeps for its backward (its output), and its gradients where a weight is
  zero.
- Short conv + SiLU (+ per-head L2 norm): against a loop over each sequence on its own,
  with carried tails and packed documents; under bfloat16 autocast, its output and input
  gradient against float64 within one rounding to bfloat16 (also on CUDA).
- SwiGLU's down projection: against `(g * sigmoid(g) * u) @ W^T` written out in float64.
- The read-out (output norm, then `o_proj`): against the formula and the product in float64.

Both paths are compared in float64 (the Triton kernels accumulate in float64 for float64
inputs, as the chunk kernels do; the interpreter runs them on the CPU at small shapes),
and the Triton path once more in float32. `gpu` tests repeat the Triton checks on CUDA
in float32 and bfloat16 at training shapes, against the torch path.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from archspec.kernels import (
    Recompute,
    add_rms_norm,
    linear_cross_entropy,
    gate_log_decay,
    rms_norm,
    rms_norm_linear,
    short_conv,
    swiglu_linear,
)
from archspec.kernels.fused import linear_as
from archspec.kernels.linear_ce import IGNORE_INDEX, LOGITS_CHUNK_BYTES, MIN_CHUNK_ROWS, chunk_rows_for, softmax_ce_grad_
from archspec.kernels.short_conv import conv_tails

from .half_rounding import bf16_products

BACKENDS = ["torch", "triton"]
# (backend, dtype) pairs of the CPU tests: the float32 one checks the kernels' casts.
PATHS = [("torch", torch.float64), ("triton", torch.float64), ("triton", torch.float32)]


def _tol(backend: str, dtype: torch.dtype = torch.float64) -> dict:
    if dtype == torch.bfloat16:
        return dict(atol=3e-2, rtol=3e-2)
    return dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-4)


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], dy: torch.Tensor | None = None) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, inputs, dy))


# --------------------------------------------------------------------------- cross-entropy


@pytest.mark.parametrize("backend,dtype", PATHS)
@pytest.mark.parametrize("chunk_rows", [None, 7])
def test_linear_cross_entropy_equals_full_logits(backend, dtype, chunk_rows):
    gen = torch.Generator().manual_seed(0)
    N, d, V = 45, 16, 70
    hidden = torch.randn(3, 15, d, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, d, generator=gen, dtype=dtype, requires_grad=True)
    targets = torch.randint(V, (3, 15), generator=gen)
    targets[0, ::4] = IGNORE_INDEX
    targets[2, :] = IGNORE_INDEX

    loss = linear_cross_entropy(hidden, weight, targets, chunk_rows=chunk_rows, backend=backend)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = F.cross_entropy((h64 @ w64.T).reshape(N, V), targets.reshape(N))
    # A weight on the loss checks that the backward scales by the incoming gradient.
    got = _grads(2.5 * loss, [hidden, weight])
    want = _grads(2.5 * ref, [h64, w64])
    torch.testing.assert_close(loss.double(), ref, **_tol(backend, dtype))
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, **_tol(backend, dtype))


@pytest.mark.parametrize("n_rows, d, vocab, element_bytes", [
    (16384, 1024, 32000, 2),  # the benchmark's model: 4,096 rows, 250 MiB of bfloat16 logits
    (16384, 1024, 151936, 2),  # a large vocabulary: the budget allows 883 rows, so 512
    (16384, 8192, 32000, 2),  # a wide model: the hidden rows are larger than the budget
    (16384, 1024, 32000, 4),  # float32 logits (CPU): half the rows
    (16384, 64, 256, 2),  # bytes: every row in one chunk
    (100, 16, 13, 4),  # fewer rows than any rule asks: all of them
])
def test_chunk_rows_keep_the_logits_within_the_budget_or_the_input(n_rows, d, vocab, element_bytes):
    rows = chunk_rows_for(n_rows, d, vocab, element_bytes)
    assert rows == n_rows or rows & (rows - 1) == 0  # a power of two unless it is every row
    logits_bytes = rows * vocab * element_bytes
    within = max(LOGITS_CHUNK_BYTES, 2 * n_rows * d * element_bytes)  # the budget, or (rounded up) the input's size
    assert logits_bytes <= within or rows == min(n_rows, MIN_CHUNK_ROWS)
    # as many rows as those bounds allow: twice as many would break both
    assert rows == n_rows or 2 * rows * vocab * element_bytes > max(LOGITS_CHUNK_BYTES, n_rows * d * element_bytes)
    assert rows >= min(n_rows, MIN_CHUNK_ROWS)


def test_linear_cross_entropy_with_nothing_scored_is_zero():
    hidden = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.full((4,), IGNORE_INDEX), backend="torch")
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def test_linear_cross_entropy_refuses_bad_targets():
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match=r"targets: 1 outside \[0, 10\) .* the first, at \[2\], is 10"):
        linear_cross_entropy(hidden, weight, torch.tensor([0, 3, 10, 2]), backend="torch")
    with pytest.raises(ValueError, match=r"targets: 2 outside .* at \[1\], is -7"):
        linear_cross_entropy(hidden, weight, torch.tensor([0, -7, 10, 2]), backend="torch")
    with pytest.raises(ValueError, match="targets' shape"):
        linear_cross_entropy(hidden, weight, torch.tensor([0, 3]), backend="torch")
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(hidden, torch.randn(10, 7), torch.tensor([0, 3, 1, 2]), backend="torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_cross_entropy_with_the_callers_count(backend, monkeypatch):
    """With `scored_rows` (the caller counted and checked the targets) nothing is checked or
    read here: the same loss and gradients as counting here; a target outside the vocabulary
    makes the loss and its row's gradient NaN instead of reading past the row."""
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(300, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(300, (12,), generator=gen)
    targets[[2, 7]] = IGNORE_INDEX
    counted = linear_cross_entropy(hidden, weight, targets, chunk_rows=5, backend=backend)
    want = _grads(counted, [hidden, weight])

    def no_host_read(*args, **kwargs):
        raise AssertionError("the targets were checked again")

    monkeypatch.setattr("archspec.kernels.linear_ce.checked_scored_targets", no_host_read)
    given = linear_cross_entropy(hidden, weight, targets, chunk_rows=5, backend=backend, scored_rows=10)
    torch.testing.assert_close(given, counted, rtol=0, atol=0)
    for g, w in zip(_grads(given, [hidden, weight]), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for bad in (300, -3):  # past the vocabulary, and negative but not ignore_index
        targets_bad = targets.clone()
        targets_bad[4] = bad
        loss = linear_cross_entropy(hidden, weight, targets_bad, chunk_rows=5, backend=backend, scored_rows=10)
        grad_h, _ = _grads(loss, [hidden, weight])
        assert loss.isnan() and grad_h[4].isnan().all()
        assert torch.isfinite(grad_h[[0, 1, 2, 3, 5]]).all()  # the row's own gradient only
    with pytest.raises(ValueError, match="scored_rows must be >= 0"):
        linear_cross_entropy(hidden, weight, targets, backend=backend, scored_rows=-1)
    # the count as a 0-dim device tensor (what a replayed CUDA graph reads): the same step
    as_tensor = linear_cross_entropy(hidden, weight, targets, chunk_rows=5, backend=backend, scored_rows=torch.tensor(10))
    torch.testing.assert_close(as_tensor, counted, rtol=0, atol=0)
    for g, w in zip(_grads(as_tensor, [hidden, weight]), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    empty = linear_cross_entropy(hidden, weight, torch.full_like(targets, IGNORE_INDEX), backend=backend,
                                 scored_rows=torch.tensor(0))
    assert empty.item() == 0 and all((g == 0).all() for g in _grads(empty, [hidden, weight]))
    for bad in (torch.tensor([10]), torch.tensor(10.0)):
        with pytest.raises(ValueError, match="a scored_rows tensor must be a 0-dim integer on cpu"):
            linear_cross_entropy(hidden, weight, targets, backend=backend, scored_rows=bad)


def test_softmax_step_kernel_equals_torch_step():
    """The Triton in-place step against the torch one, with a vocabulary that is not a
    multiple of the kernel's block."""
    from archspec.kernels.triton.cross_entropy import softmax_ce_grad_triton
    from archspec.kernels.triton.launch import CrossEntropyLaunch

    gen = torch.Generator().manual_seed(1)
    logits = 4 * torch.randn(9, 300, generator=gen)
    targets = torch.randint(300, (9,), generator=gen)
    targets[3] = IGNORE_INDEX
    targets[[5, 6]] = torch.tensor([300, -2])  # outside the vocabulary: NaN rows, no read past the row
    a, b = logits.clone(), logits.clone()
    loss_t = softmax_ce_grad_(a, targets, scale=0.25)
    loss_k = softmax_ce_grad_triton(b, targets, ignore_index=IGNORE_INDEX, scale=0.25, launch=CrossEntropyLaunch(block_v=128))
    torch.testing.assert_close(loss_k, loss_t, equal_nan=True)
    torch.testing.assert_close(b, a, equal_nan=True)
    assert b[3].abs().max() == 0
    assert loss_k[[5, 6]].isnan().all() and b[[5, 6]].isnan().all() and torch.isfinite(b[[0, 1, 2, 4, 7, 8]]).all()


# --------------------------------------------------------------------------- RMSNorm


def _rms_norm_definition(x, w, gate, activation, eps):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
    if activation == "silu":
        y = y * gate / (1 + torch.exp(-gate))
    elif activation == "sigmoid":
        y = y / (1 + torch.exp(-gate))
    return y


@pytest.mark.parametrize("backend,dtype", PATHS)
@pytest.mark.parametrize("activation", ["none", "silu", "sigmoid"])
@pytest.mark.parametrize("D", [8, 12])
def test_rms_norm_equals_definition(backend, dtype, activation, D):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, D, generator=gen, dtype=dtype, requires_grad=True)
    w = (1 + 0.3 * torch.randn(D, generator=gen, dtype=dtype)).requires_grad_()
    gate = None if activation == "none" else torch.randn(3, 7, D, generator=gen, dtype=dtype, requires_grad=True)
    inputs = [x, w] + ([gate] if gate is not None else [])
    y = rms_norm(x, w, gate, eps=1e-5, activation=activation, backend=backend)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref = _rms_norm_definition(ref_inputs[0], ref_inputs[1], ref_inputs[2] if gate is not None else None, activation, 1e-5)
    dy = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(y.double(), ref, **_tol(backend, dtype))
    for g, r in zip(_grads(y, inputs, dy.to(dtype)), _grads(ref, ref_inputs, dy)):
        torch.testing.assert_close(g.double(), r, **_tol(backend, dtype))


@pytest.mark.parametrize("backend,dtype", PATHS)
@pytest.mark.parametrize("residual_used", [True, False])  # the last block's sum feeds only the final norm
def test_add_rms_norm_equals_the_sum_and_the_definition(backend, dtype, residual_used):
    gen = torch.Generator().manual_seed(3)
    x, h = (torch.randn(3, 7, 12, generator=gen, dtype=dtype, requires_grad=True) for _ in range(2))
    w = (1 + 0.3 * torch.randn(12, generator=gen, dtype=dtype)).requires_grad_()
    y, r = add_rms_norm(x, h, w, eps=1e-5, backend=backend)
    ref_inputs = [t.detach().double().requires_grad_() for t in (x, h, w)]
    ref_r = ref_inputs[0] + ref_inputs[1]
    ref_y = _rms_norm_definition(ref_r, ref_inputs[2], None, "none", 1e-5)
    dy = torch.randn(ref_y.shape, generator=gen, dtype=torch.float64)
    dr = torch.randn(ref_r.shape, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(y.double(), ref_y, **_tol(backend, dtype))
    torch.testing.assert_close(r.double(), ref_r, **_tol(backend, dtype))
    outs, ref_outs = ([y, r], [ref_y, ref_r]) if residual_used else ([y], [ref_y])
    loss = sum((o * d.to(dtype)).sum() for o, d in zip(outs, [dy, dr]))
    ref_loss = sum((o * d).sum() for o, d in zip(ref_outs, [dy, dr]))
    for g, want in zip(_grads(loss, [x, h, w]), _grads(ref_loss, ref_inputs)):
        torch.testing.assert_close(g.double(), want, **_tol(backend, dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_add_rms_norm_keeps_a_float32_stream_beside_a_bfloat16_output(backend):
    """Under autocast the stream is float32, the sub-block's output and the normalised rows
    bfloat16: the sum is float32 and each gradient comes back in its input's dtype."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 16, generator=gen, requires_grad=True)
    h = torch.randn(2, 5, 16, generator=gen).bfloat16().requires_grad_()
    w = torch.ones(16, requires_grad=True)
    y, r = add_rms_norm(x, h, w, out_dtype=torch.bfloat16, backend=backend)
    assert (y.dtype, r.dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(r, x.detach() + h.detach().float(), atol=0, rtol=0)
    grads = _grads(y.float().sum() + r.sum(), [x, h, w])
    assert [g.dtype for g in grads] == [torch.float32, torch.bfloat16, torch.float32]
    ref = [x.detach().double().requires_grad_(), h.detach().double().requires_grad_(), w.detach().double().requires_grad_()]
    ref_r = ref[0] + ref[1]
    for g, want in zip(grads, _grads(_rms_norm_definition(ref_r, ref[2], None, "none", 1e-6).sum() + ref_r.sum(), ref)):
        torch.testing.assert_close(g.double(), want, atol=3e-2, rtol=3e-2)
    assert add_rms_norm(x, None, w, backend=backend)[1] is x  # nothing to add: the stream as it is


def _saved_storages(run) -> tuple[dict[int, torch.Tensor], object]:
    """The tensors `run()` keeps for its backward, one per storage, and what it returned."""
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return saved, out


@pytest.mark.parametrize("with_sum", [True, False])
def test_an_ungated_norm_keeps_its_bfloat16_output_not_its_float32_rows(with_sum):
    """A pre-norm under autocast: the float32 stream in, bfloat16 rows out. The Triton path
    keeps the output (which the projection after it keeps too) and one float a row, never
    the stream."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 6, 16, generator=gen, requires_grad=True)
    h = torch.randn(4, 6, 16, generator=gen).bfloat16().requires_grad_() if with_sum else None
    w = torch.ones(16, requires_grad=True)
    saved, (y, _) = _saved_storages(lambda: add_rms_norm(x, h, w, out_dtype=torch.bfloat16, backend="triton"))
    kept = {(tuple(t.shape), t.dtype) for ptr, t in saved.items() if ptr != w.untyped_storage().data_ptr()}
    assert y.untyped_storage().data_ptr() in saved
    assert kept == {((24, 16), torch.bfloat16), ((24,), torch.float32)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("with_sum", [True, False])
def test_a_norm_keeping_its_output_gives_the_exact_gradients_of_zero_and_tiny_weights(dtype, with_sum):
    """`y / w` gives the rows back only where `w` is not zero: the floored weight keeps a
    zero (or a subnormal) weight's rows in the output, so its gradient is still the
    definition's `sum(dy * x * rstd)`, and the input's too."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 5, 8, generator=gen, dtype=dtype, requires_grad=True)
    h = torch.randn(3, 5, 8, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.tensor([0.0, 1e-30, -1e-20, -0.0, 0.7, -1.3, 1e-3, 2.0], dtype=dtype, requires_grad=True)
    inputs = [x, h, w] if with_sum else [x, w]
    y, _ = add_rms_norm(x, h if with_sum else None, w, eps=1e-5, backend="triton")
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    rows = ref_inputs[0] + ref_inputs[1] if with_sum else ref_inputs[0]
    ref = _rms_norm_definition(rows, ref_inputs[-1], None, "none", 1e-5)
    dy = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(y.double(), ref, **_tol("triton", dtype))
    grads = _grads(y, inputs, dy.to(dtype))
    for g, r in zip(grads, _grads(ref, ref_inputs, dy)):
        torch.testing.assert_close(g.double(), r, **_tol("triton", dtype))
    assert grads[-1][:4].abs().min() > 0  # the zero weights learn


def test_a_norm_that_is_not_a_pre_norm_keeps_its_input():
    """Attention's q/k norms: the op after them keeps no copy of their output, so keeping it
    would save nothing and read back rounded rows; `rms_norm` keeps its input unless asked."""
    x = torch.randn(4, 6, 16).bfloat16().requires_grad_()
    w = torch.ones(16, requires_grad=True)
    saved, y = _saved_storages(lambda: rms_norm(x, w, backend="triton"))
    assert x.untyped_storage().data_ptr() in saved and y.untyped_storage().data_ptr() not in saved


def test_a_float16_norm_keeps_its_input():
    """float16's smallest normal (6e-5) would flush small rows out of the output, so a
    float16 output keeps the norm's input and gives the definition's gradients."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 6, 16, generator=gen, requires_grad=True)
    w = (1 + 0.3 * torch.randn(16, generator=gen)).requires_grad_()
    saved, y = _saved_storages(lambda: rms_norm(x, w, out_dtype=torch.float16, backend="triton", keep_output=True))
    assert x.untyped_storage().data_ptr() in saved and y.untyped_storage().data_ptr() not in saved
    ref_inputs = [x.detach().double().requires_grad_(), w.detach().double().requires_grad_()]
    ref = _rms_norm_definition(*ref_inputs, None, "none", 1e-6)
    dy = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(y.double(), ref, atol=2e-3, rtol=2e-3)
    for g, r in zip(_grads(y, [x, w], dy.half()), _grads(ref, ref_inputs, dy)):
        torch.testing.assert_close(g.double(), r, atol=2e-2, rtol=2e-2)


def test_rms_norm_writes_the_requested_dtype_and_refuses_bad_gates():
    x, w = torch.randn(2, 8), torch.ones(8)
    assert rms_norm(x, w, out_dtype=torch.bfloat16, backend="triton").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="needs a gate"):
        rms_norm(x, w, activation="silu")
    with pytest.raises(ValueError, match="activation must be"):
        rms_norm(x, w, torch.randn(2, 8), activation="gelu")
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(7))


# --------------------------------------------------------------------------- short conv


def _conv_definition(x, w, tail, cu_seqlens, activation, head_dim, eps=1e-6):
    """Each sequence alone: prepend its tail (or zeros), slide the window, token by token."""
    B, T, C = x.shape
    W = w.shape[1]
    if cu_seqlens is None:
        sequences = [(b, 0, T, b) for b in range(B)]
    else:
        sequences = [(0, int(cu_seqlens[n]), int(cu_seqlens[n + 1]), n) for n in range(len(cu_seqlens) - 1)]
    y = x.new_zeros(x.shape)
    for b, start, end, n in sequences:
        pad = torch.zeros(W - 1, C, dtype=x.dtype) if tail is None else tail[n]
        padded = torch.cat([pad, x[b, start:end]])
        for t in range(end - start):
            z = (padded[t : t + W] * w.T).sum(0)
            u = z * torch.sigmoid(z) if activation else z
            if head_dim:
                u = (u.view(-1, head_dim) / u.view(-1, head_dim).norm(dim=-1, keepdim=True).clamp_min(eps)).flatten()
            y[b, start + t] = u
    return y


CONV_CASES = [
    # (packed, tail, head_dim, activation)
    (False, False, 0, True),
    (False, True, 8, True),
    (False, True, 0, False),
    (True, False, 8, True),
    (True, True, 0, True),
    (True, True, 8, False),
]


@pytest.mark.parametrize("backend,dtype", PATHS)
@pytest.mark.parametrize("packed,with_tail,head_dim,activation", CONV_CASES)
def test_short_conv_equals_each_sequence_alone(backend, dtype, packed, with_tail, head_dim, activation):
    gen = torch.Generator().manual_seed(3)
    W, C = 4, 16
    if packed:
        B, T, cu = 1, 45, torch.tensor([0, 2, 19, 20, 45])  # one document shorter than the window
    else:
        B, T, cu = 2, 37, None
    rows = B if cu is None else len(cu) - 1
    x = torch.randn(B, T, C, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(C, W, generator=gen, dtype=dtype, requires_grad=True)
    tail = torch.randn(rows, W - 1, C, generator=gen, dtype=dtype, requires_grad=True) if with_tail else None
    inputs = [x, w] + ([tail] if tail is not None else [])
    y = short_conv(x, w, tail=tail, cu_seqlens=cu, activation=activation, head_dim=head_dim, backend=backend)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref = _conv_definition(ref_inputs[0], ref_inputs[1], ref_inputs[2] if tail is not None else None, cu, activation, head_dim)
    dy = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(y.double(), ref, **_tol(backend, dtype))
    for g, r in zip(_grads(y, inputs, dy.to(dtype)), _grads(ref, ref_inputs, dy)):
        torch.testing.assert_close(g.double(), r, **_tol(backend, dtype))


@pytest.mark.parametrize("packed", [False, True])
def test_conv_tails_are_the_last_inputs_of_each_sequence(packed):
    gen = torch.Generator().manual_seed(4)
    W, C = 4, 3
    x = torch.randn(1 if packed else 2, 9, C, generator=gen)
    cu = torch.tensor([0, 1, 7, 9]) if packed else None
    rows = 3 if packed else 2
    tail = torch.randn(rows, W - 1, C, generator=gen)
    got = conv_tails(x, tail, cu, W)
    bounds = [(0, int(cu[n]), int(cu[n + 1])) for n in range(rows)] if packed else [(b, 0, 9) for b in range(2)]
    for n, (b, start, end) in enumerate(bounds):
        torch.testing.assert_close(got[n], torch.cat([tail[n], x[b, start:end]])[-(W - 1):])


def test_short_conv_refuses_bad_shapes():
    x, w = torch.randn(2, 5, 8), torch.randn(8, 4)
    with pytest.raises(ValueError, match="tail must be"):
        short_conv(x, w, tail=torch.randn(2, 2, 8))
    with pytest.raises(ValueError, match="batch must be 1"):
        short_conv(x, w, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="head_dim 3"):
        short_conv(x, w, head_dim=3)


# --------------------------------------------------------------------------- on CUDA


# --------------------------------------------------------------------------- SwiGLU


def _swiglu_definition(gate, up, weight):
    return (gate / (1 + torch.exp(-gate)) * up) @ weight.T


def _swiglu_inputs(shape, out, dtype, device="cpu", seed=4):
    gen = torch.Generator(device=device).manual_seed(seed)
    gate = (2 * torch.randn(*shape, generator=gen, device=device)).to(dtype).requires_grad_()
    up = torch.randn(*shape, generator=gen, device=device).to(dtype).requires_grad_()
    weight = (shape[-1] ** -0.5 * torch.randn(out, shape[-1], generator=gen, device=device)).to(dtype).requires_grad_()
    return [gate, up, weight]


@pytest.mark.parametrize("backend,dtype", PATHS)
def test_swiglu_linear_equals_definition(backend, dtype):
    inputs = _swiglu_inputs((3, 7, 1100), 5, dtype)  # 1100: more than one block, the last one partial
    y = swiglu_linear(*inputs, backend=backend)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref = _swiglu_definition(*ref_inputs)
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), ref, **_tol(backend, dtype))
    for g, r in zip(_grads(y, inputs, dy.to(dtype)), _grads(ref, ref_inputs, dy)):
        torch.testing.assert_close(g.double(), r, **_tol(backend, dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_swiglu_linear_under_autocast_multiplies_in_bfloat16_and_keeps_the_gradients_dtypes(backend):
    """Under CPU autocast the product and the matmuls are bfloat16 (what autocast's own
    linear would give), the gradients come back in each input's dtype. (The interpreter
    rounds float32 to bfloat16 differently from torch: the Triton path is compared within
    bfloat16's error, the torch path exactly.)"""
    gate, up, weight = _swiglu_inputs((2, 5, 64), 8, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = swiglu_linear(gate, up, weight, backend=backend)
    assert y.dtype == torch.bfloat16
    product = (F.silu(gate.detach()) * up.detach()).bfloat16()
    want = F.linear(product, weight.detach().bfloat16())
    if backend == "torch":
        torch.testing.assert_close(y, want, atol=0, rtol=0)
    assert ((y.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    grads = _grads(y.float().sum(), [gate, up, weight])
    assert [g.dtype for g in grads] == [torch.float32] * 3
    ref = [t.detach().double().requires_grad_() for t in (gate, up, weight)]
    for g, r in zip(grads, _grads(_swiglu_definition(*ref).sum(), ref)):
        torch.testing.assert_close(g.double(), r, atol=3e-2 * r.abs().max().item(), rtol=3e-2)


# --------------------------------------------------------------------------- gates' log decay

LOG_DECAY_SHAPES = {  # (A_log, proj, dt_bias): a channel gate (KDA), a scalar gate (Gated DeltaNet)
    "channel": ((3, 1), (2, 70, 3, 5), (3, 5)),
    "scalar": ((3,), (2, 70, 3), (3,)),
}


def _log_decay_inputs(shapes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a_shape, p_shape, b_shape = shapes
    A_log = torch.randn(a_shape, generator=gen, dtype=torch.float64).requires_grad_()
    proj = (4 * torch.randn(p_shape, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()  # softplus's both tails
    dt_bias = torch.randn(b_shape, generator=gen, dtype=torch.float64).requires_grad_()
    return A_log, proj, dt_bias


# Each form written out from its source, in float64: Mamba2's softplus, RWKV-7's
# `w = exp(-exp(-softplus(-z) - 1/2))` (its reference code's decay, whose log is -e^{-1/2} sigmoid(z)
# when A_log = -1/2), GLA's `logsigmoid(z) / 16` (the rate exp(A_log) = 1/16 in place of 1/16).
DECAY_FORMULAS = {
    "mamba2": lambda A_log, z: -torch.exp(A_log) * torch.log1p(torch.exp(z)),
    "rwkv7": lambda A_log, z: -torch.exp(A_log) * torch.exp(-torch.log1p(torch.exp(-z))),
    "gla": lambda A_log, z: torch.exp(A_log) * F.logsigmoid(z),
}


@pytest.mark.parametrize("backend,dtype", [*PATHS, ("triton", torch.bfloat16)])
@pytest.mark.parametrize("gate", LOG_DECAY_SHAPES)
@pytest.mark.parametrize("form", DECAY_FORMULAS)
def test_log_decay_equals_the_formula(backend, dtype, gate, form):
    """Against `-exp(A_log) * f(proj + dt_bias)` in float64 on the same (rounded) inputs,
    `f` softplus or sigmoid: the decay and the gradients of all three inputs, with a random
    cotangent."""
    A_log, proj, dt_bias = _log_decay_inputs(LOG_DECAY_SHAPES[gate], dtype)
    g = gate_log_decay(A_log, proj, dt_bias, form=form, backend=backend)
    assert g.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and g.shape == proj.shape
    refs = [t.detach().double().requires_grad_() for t in (A_log, proj, dt_bias)]
    want = DECAY_FORMULAS[form](refs[0], refs[1] + refs[2])
    dg = torch.randn(g.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tol = _tol(backend, torch.float32 if dtype == torch.bfloat16 else dtype)  # float32 arithmetic on bf16 inputs
    torch.testing.assert_close(g.double(), want, **tol)
    got = _grads(g, [A_log, proj, dt_bias], dg.to(g.dtype))
    for name, a, b in zip(("A_log", "proj", "dt_bias"), got, _grads(want, refs, dg)):
        assert a.dtype == {"proj": dtype}.get(name, torch.float64)
        b = b.to(dtype).double() if name == "proj" else b  # d proj is stored in proj's dtype
        torch.testing.assert_close(a.double(), b, **(_tol(backend, dtype) if name == "proj" else tol), msg=lambda m, n=name: f"{n}: {m}")


def test_log_decay_refuses_mismatched_shapes_and_unknown_forms():
    with pytest.raises(ValueError, match=r"must end in bias's shape \(3, 5\)"):
        gate_log_decay(torch.zeros(3, 1), torch.zeros(2, 4, 3, 6), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="A_log"):
        gate_log_decay(torch.zeros(4), torch.zeros(2, 4, 3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"decay form must be one of \['mamba2', 'rwkv7', 'gla'\], got 'mamba'"):
        gate_log_decay(torch.zeros(3), torch.zeros(2, 4, 3), torch.zeros(3), form="mamba")


@pytest.mark.parametrize("backend", BACKENDS)
def test_rwkv7_decay_is_bounded_by_its_rate(backend):
    """RWKV-7's form never decays a token by more than exp(A_log) = e^{-1/2} nats, however
    large the logits; the chunk kernel's fastest path counts on it (64 tokens, <= 39 nats)."""
    proj = torch.tensor([[-1e4, -30.0, 0.0, 30.0, 1e4]], dtype=torch.float32)
    g = gate_log_decay(torch.full((5,), -0.5), proj, torch.zeros(5), form="rwkv7", backend=backend)
    bound = math.exp(-0.5)
    assert bool(((g <= 0) & (g >= -bound)).all())
    torch.testing.assert_close(g[0, -1], torch.tensor(-bound), atol=1e-7, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["f64", "f32", "bf16"])
def test_swiglu_joined_reads_both_halves_of_a_row(backend, dtype):
    """The decoding step's SwiGLU on one joined `[gate | up]` output, 3 rows of 1100 each
    (more than one block, rows straddling blocks), against the definition."""
    from archspec.kernels.swiglu import swiglu_joined, swiglu_ref

    gate_up = torch.randn(3, 1, 2 * 1100, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(dtype)
    got = swiglu_joined(gate_up, backend=backend)
    want = swiglu_ref(gate_up[..., :1100], gate_up[..., 1100:], dtype)
    assert got.shape == (3, 1, 1100) and got.dtype == dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_swiglu_linear_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="gate .* and up .* must match"):
        swiglu_linear(torch.randn(2, 4), torch.randn(2, 5), torch.randn(3, 4))
    with pytest.raises(ValueError, match="weight's 4 columns"):
        swiglu_linear(torch.randn(2, 5), torch.randn(2, 5), torch.randn(3, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 50000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_linear_cross_entropy_kernel_equals_torch(dtype, vocab):
    """The vocabulary of the benchmark's models, and a wider one that is not a multiple of
    the step's block either."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(4096, 256, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    weight = (0.05 * torch.randn(vocab, 256, device="cuda", generator=gen)).requires_grad_()
    targets = torch.randint(vocab, (4096,), device="cuda", generator=gen)
    targets[::7] = IGNORE_INDEX
    results = []
    for backend in BACKENDS:
        loss = linear_cross_entropy(hidden, weight.to(dtype), targets, backend=backend)
        results.append([loss, *_grads(loss, [hidden, weight])])
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), **_tol("triton", dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("form", DECAY_FORMULAS)
def test_gpu_log_decay_kernel_equals_torch(form):
    """A KDA layer's channel gate at the whole-model benchmark's size, bfloat16 logits."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    A_log = torch.log(torch.empty(8, 1, device="cuda").uniform_(1, 16, generator=gen)).requires_grad_()
    proj = torch.randn(8, 2048, 8, 128, device="cuda", generator=gen).bfloat16().requires_grad_()
    dt_bias = torch.randn(8, 128, device="cuda", generator=gen).requires_grad_()
    dg = torch.randn(proj.shape, device="cuda", generator=gen)
    results = []
    for backend in BACKENDS:
        g = gate_log_decay(A_log, proj, dt_bias, form=form, backend=backend)
        results.append([g, *_grads(g, [A_log, proj, dt_bias], dg)])
    for name, a, b in zip(("g", "A_log", "proj", "dt_bias"), *results):  # d proj: bf16, one rounding apart
        tol = _tol("triton", torch.bfloat16) if name == "proj" else dict(atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
def test_gpu_linear_cross_entropy_weight_gradient_over_many_chunks():
    """bfloat16 on CUDA, 64 row chunks each added into the float32 weight gradient by the
    matmul itself: the gradients against float64 on the same rounded inputs."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(2048, 128, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (0.1 * torch.randn(5000, 128, device="cuda", generator=gen)).bfloat16().requires_grad_()
    targets = torch.randint(5000, (2048,), device="cuda", generator=gen)
    loss = linear_cross_entropy(hidden, weight, targets, chunk_rows=32, backend="triton")
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = F.cross_entropy(h64 @ w64.T, targets)
    for got, want in zip(_grads(loss, [hidden, weight]), _grads(ref, [h64, w64])):
        error = ((got.double() - want).norm() / want.norm()).item()
        assert error < 1e-2, f"relative error {error:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["none", "silu", "sigmoid"])
def test_gpu_rms_norm_kernel_equals_torch(dtype, activation):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 2048, 8, 128, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    w = (1 + 0.1 * torch.randn(128, device="cuda", generator=gen)).requires_grad_()
    gate = None if activation == "none" else torch.randn(x.shape, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    inputs = [x, w] + ([gate] if gate is not None else [])
    dy = torch.randn(x.shape, device="cuda", dtype=dtype, generator=gen)
    results = []
    for backend in BACKENDS:
        y = rms_norm(x, w, gate, activation=activation, backend=backend)
        results.append([y, *_grads(y, inputs, dy)])
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), **_tol("triton", dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed,with_tail,head_dim,activation", CONV_CASES)
def test_gpu_short_conv_kernel_equals_torch(dtype, packed, with_tail, head_dim, activation):
    gen = torch.Generator(device="cuda").manual_seed(0)
    head_dim = 128 if head_dim else 0
    C, W = 1024, 4
    B, T = (1, 8192) if packed else (4, 2048)
    cu = torch.tensor([0, 3, 1000, 1001, 5000, 8192], device="cuda") if packed else None
    rows = B if cu is None else len(cu) - 1
    x = torch.randn(B, T, C, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    w = (0.5 * torch.randn(C, W, device="cuda", generator=gen)).requires_grad_()
    tail = torch.randn(rows, W - 1, C, device="cuda", dtype=dtype, generator=gen).requires_grad_() if with_tail else None
    inputs = [x, w] + ([tail] if tail is not None else [])
    dy = torch.randn(x.shape, device="cuda", dtype=dtype, generator=gen)
    results = []
    for backend in BACKENDS:
        y = short_conv(x, w, tail=tail, cu_seqlens=cu, activation=activation, head_dim=head_dim, backend=backend)
        results.append([y, *_grads(y, inputs, dy)])
    for a, b in zip(*results):
        # The weight's gradient sums over B*T tokens: compare relative to its size.
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2 * max(1.0, b.float().abs().max().item() / 10), rtol=3e-2)


def _short_conv_rounds_once(device: str, B: int, T: int, C: int, head_dim: int, activation: bool) -> None:
    """The fused short conv under bfloat16 autocast, as a model runs it (bfloat16 `x` and
    `dy`, the float32 weight), against float64 on those very inputs: its output and `dx`
    are the exact values rounded once to bfloat16 (relative error within 5% of that
    rounding's own), its weight gradient exact to float32 accumulation (1e-5)."""
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(B, T, C, device=device, generator=gen).bfloat16().requires_grad_()
    w = (0.5 * torch.randn(C, 4, device=device, generator=gen)).requires_grad_()
    dy = torch.randn(B, T, C, device=device, generator=gen).bfloat16()
    with torch.autocast(device, dtype=torch.bfloat16):
        y = short_conv(x, w, activation=activation, head_dim=head_dim, backend="triton")
    got = [y, *_grads(y, [x, w], dy)]
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = short_conv(x64, w64, activation=activation, head_dim=head_dim, backend="torch")
    exact = [y64, *_grads(y64, [x64, w64], dy.double())]

    def error(a: torch.Tensor, ref: torch.Tensor) -> float:
        return ((a.double() - ref).norm() / ref.norm()).item()

    for name, a, ref in zip(("y", "dx"), got[:2], exact[:2]):
        assert a.dtype == torch.bfloat16
        once = error(ref.bfloat16(), ref)  # the exact value rounded to bfloat16
        assert error(a, ref) <= 1.05 * once, f"{name}: {error(a, ref):.3e} off float64, one rounding is {once:.3e}"
    assert got[2].dtype == torch.float32 and error(got[2], exact[2]) < 1e-5


@pytest.mark.parametrize("head_dim,activation", [(0, True), (16, True), (0, False)])
def test_short_conv_in_autocast_rounds_once(head_dim, activation):
    """On the interpreter, with its float32 -> bfloat16 casts rounded to nearest as the
    GPU's are (`half_rounding`; the interpreter's own truncate)."""
    with bf16_products():
        _short_conv_rounds_once("cpu", 2, 48, 64, head_dim, activation)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,activation", [(0, True), (128, True), (32, True), (0, False)])
def test_gpu_short_conv_in_autocast_rounds_once(head_dim, activation):
    _short_conv_rounds_once("cuda", 4, 2048, 1024, head_dim, activation)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_swiglu_kernel_equals_torch(dtype):
    inputs = _swiglu_inputs((8, 2048, 2730), 1024, dtype, device="cuda")  # the MLP: 16,384 tokens
    dy = torch.randn(8, 2048, 1024, device="cuda", dtype=dtype, generator=torch.Generator(device="cuda").manual_seed(1))
    results = []
    for backend in BACKENDS:
        y = swiglu_linear(*inputs, backend=backend)
        results.append([y, *_grads(y, inputs, dy)])
    for a, b in zip(*results):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-5), rel


@pytest.mark.gpu
def test_gpu_add_rms_norm_kernel_equals_torch():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 2048, 1024, device="cuda", generator=gen).requires_grad_()
    h = torch.randn(8, 2048, 1024, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(1024, device="cuda", generator=gen)).requires_grad_()
    dy = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    dr = torch.randn(x.shape, device="cuda", generator=gen)
    results = []
    for backend in BACKENDS:
        y, r = add_rms_norm(x, h, w, out_dtype=torch.bfloat16, backend=backend)
        results.append([y, r, *_grads((y.float() * dy).sum() + (r * dr).sum(), [x, h, w])])
    for a, b in zip(*results):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 1e-2, rel


def test_linear_cross_entropy_without_grad_gives_the_loss_alone():
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(11, (6,), generator=gen)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, backend="torch")
    assert not loss.requires_grad
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.T, targets).detach())


# --------------------------------------------------------------------------- output norm + o_proj


def _norm_linear_inputs(activation, dtype, heads=3, D=12, out=5, seed=6):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 7, heads, D, generator=gen, dtype=dtype, requires_grad=True)
    w = (1 + 0.3 * torch.randn(D, generator=gen, dtype=dtype)).requires_grad_()
    W = (torch.randn(out, heads * D, generator=gen, dtype=dtype) / (heads * D) ** 0.5).requires_grad_()
    gate = None if activation == "none" else torch.randn(x.shape, generator=gen, dtype=dtype, requires_grad=True)
    return [x, w, W] + ([gate] if gate is not None else [])


@pytest.mark.parametrize("backend,dtype", PATHS)
@pytest.mark.parametrize("activation", ["none", "silu", "sigmoid"])
def test_rms_norm_linear_equals_the_norm_then_the_projection(backend, dtype, activation):
    """The read-out against the definition written out in float64: values and the
    gradients of the rows, the gate, the norm's weight and the projection's."""
    inputs = _norm_linear_inputs(activation, dtype)
    x, w, W, *gate = inputs
    y = rms_norm_linear(x, w, W, gate[0] if gate else None, eps=1e-5, activation=activation, backend=backend)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    rx, rw, rW, *rgate = ref_inputs
    normed = _rms_norm_definition(rx, rw, rgate[0] if rgate else None, activation, 1e-5)
    ref = normed.flatten(-2) @ rW.t()
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert y.shape == (2, 7, 5) and y.dtype == dtype
    torch.testing.assert_close(y.double(), ref, **_tol(backend, dtype))
    for g, r in zip(_grads(y, inputs, dy.to(dtype)), _grads(ref, ref_inputs, dy)):
        torch.testing.assert_close(g.double(), r, **_tol(backend, dtype))


@pytest.mark.parametrize("activation", ["none", "silu"])
def test_rms_norm_linear_keeps_the_norms_inputs_not_its_output(activation):
    """Fused, autograd keeps the rows, the gate, the per-row scale and the weights: no
    `[tokens, H D]` tensor of normalised rows, which the two calls apart keep."""
    x, w, W, *gate = _norm_linear_inputs(activation, torch.float32)
    kept: dict[str, list[tuple[int, ...]]] = {}
    for backend in BACKENDS:
        shapes = kept.setdefault(backend, [])
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            rms_norm_linear(x, w, W, gate[0] if gate else None, activation=activation, backend=backend)
    rows = (2 * 7, 3 * 12)  # normalised rows as the projection reads them
    assert rows not in kept["triton"] and (2, 7, 36) not in kept["triton"]
    assert (2, 7, 36) in kept["torch"] or rows in kept["torch"]


def test_rms_norm_linear_under_autocast_projects_in_bfloat16_and_keeps_the_gradients_dtypes():
    """Under CPU autocast the fused read-out writes bfloat16, as the two calls apart do,
    and each gradient returns in its input's dtype."""
    inputs = _norm_linear_inputs("sigmoid", torch.float32)
    x, w, W, gate = inputs
    outs = []
    for backend in BACKENDS:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = rms_norm_linear(x, w, W, gate, activation="sigmoid", backend=backend)
        assert y.dtype == torch.bfloat16
        grads = _grads(y.float().sum(), inputs)
        assert [g.dtype for g in grads] == [torch.float32] * 4
        outs.append([y, *grads])
    for fused, apart in zip(*outs):
        error = ((fused.float() - apart.float()).norm() / apart.float().norm()).item()
        assert error < 1e-2, f"relative error {error:.2e}"


def _projected_gate(dtype: torch.dtype, bias: bool, seed: int = 8):
    """A gate that is a projection `F.linear(h, Wg, b)` of leaves (under autocast where it is
    on), shaped like the read-out's rows `[2, 7, 3, 12]`, with its recipe, `linear_as` in
    the gate's dtype: as a mixer's output gate comes."""
    gen = torch.Generator().manual_seed(seed)
    leaf = torch.float64 if dtype == torch.float64 else torch.float32  # autocast's leaves are float32
    h = torch.randn(2, 7, 10, generator=gen, dtype=leaf, requires_grad=True)
    Wg = (torch.randn(36, 10, generator=gen, dtype=leaf) / 10**0.5).requires_grad_()
    b = (0.1 * torch.randn(36, generator=gen, dtype=leaf)).requires_grad_() if bias else None
    leaves = [h, Wg] + ([b] if bias else [])
    gate = F.linear(h, Wg, b).reshape(2, 7, 3, 12)
    assert gate.dtype == dtype
    return leaves, gate, Recompute(linear_as, (h, Wg, b), dict(dtype=dtype), (2, 7, 3, 12))


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("bias", [False, True])
def test_rms_norm_linear_forms_a_recipes_gate_again_instead_of_keeping_it(autocast, bias):
    """With the gate's recipe the fused read-out keeps the projection's inputs, not the
    gate, and gives the output and every gradient (rows, norm weight, projection, and the
    gate's own leaves) of keeping it, bit for bit; under bfloat16 autocast too, which
    checks that `linear_as` forms the projection as autocast did."""
    x, w, W = _norm_linear_inputs("none", torch.float32)
    results, saved = [], []
    for with_recipe in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            leaves, gate, recipe = _projected_gate(torch.bfloat16 if autocast else torch.float32, bias)
            storages: set[int] = set()
            with torch.autograd.graph.saved_tensors_hooks(lambda t: storages.add(t.untyped_storage().data_ptr()) or t,
                                                          lambda t: t):
                y = rms_norm_linear(x, w, W, gate, activation="silu", backend="triton",
                                    gate_recompute=recipe if with_recipe else None)
        saved.append(gate.untyped_storage().data_ptr() in storages)
        assert torch.equal(recipe.run(), gate)  # outside autocast, as a backward runs it
        inputs = [x, w, W, *leaves]
        results.append([y, *_grads(y.float().sum(), inputs)])
    assert saved == [True, False]
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_rms_norm_linear_refuses_a_recipe_that_forms_something_else():
    x, w, W = _norm_linear_inputs("none", torch.float32)
    leaves, gate, _ = _projected_gate(torch.float32, bias=False)
    wrong_size = Recompute(linear_as, (leaves[0][:, :5], leaves[1]), dict(dtype=torch.float32))
    y = rms_norm_linear(x, w, W, gate, activation="silu", backend="triton", gate_recompute=wrong_size)
    with pytest.raises(RuntimeError, match=r"the recompute of the gate gave \(2, 5, 36\) torch.float32, the gate was 504"):
        y.sum().backward()
    wrong_dtype = Recompute(linear_as, tuple(leaves), dict(dtype=torch.float64))
    y = rms_norm_linear(x, w, W, gate, activation="silu", backend="triton", gate_recompute=wrong_dtype)
    with pytest.raises(RuntimeError, match="the recompute of the gate gave .* torch.float64, the gate was 504 elements of torch.float32"):
        y.sum().backward()
    with pytest.raises(ValueError, match="gate_recompute must be a kernels.Recompute, got function"):
        rms_norm_linear(x, w, W, gate, activation="silu", gate_recompute=lambda: gate)
    with pytest.raises(ValueError, match="gate_recompute forms a gate again, but no gate was passed"):
        rms_norm_linear(x, w, W, gate_recompute=Recompute(linear_as, tuple(leaves), dict(dtype=torch.float32)))


def test_rms_norm_linear_on_torch_ignores_the_gates_recipe():
    x, w, W = _norm_linear_inputs("none", torch.float64)
    _, gate, recipe = _projected_gate(torch.float64, bias=True)
    want = rms_norm_linear(x, w, W, gate, activation="sigmoid", backend="torch")
    assert torch.equal(rms_norm_linear(x, w, W, gate, activation="sigmoid", backend="torch", gate_recompute=recipe), want)


def test_rms_norm_linear_refuses_bad_shapes():
    x, w, W = _norm_linear_inputs("none", torch.float32)
    with pytest.raises(ValueError, match=r"linear_weight must be \[out, 36\]"):
        rms_norm_linear(x, w, W[:, :30])
    with pytest.raises(ValueError, match="needs a gate"):
        rms_norm_linear(x, w, W, activation="silu")
    with pytest.raises(ValueError, match="norm_weight"):
        rms_norm_linear(x, w[:5], W)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_gpu_rms_norm_linear_equals_the_two_calls(dtype, activation):
    """The fused read-out on CUDA at a training shape (Gated DeltaNet's: 8 heads of 256)
    against the norm kernel and `F.linear` apart, values and every gradient."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 1024, 8, 256, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    w = (1 + 0.1 * torch.randn(256, device="cuda", generator=gen)).requires_grad_()
    W = (torch.randn(1024, 8 * 256, device="cuda", generator=gen) / 2048 ** 0.5).requires_grad_()
    gate = None if activation == "none" else torch.randn(x.shape, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    inputs = [x, w, W] + ([gate] if gate is not None else [])
    dy = torch.randn(4, 1024, 1024, device="cuda", dtype=dtype, generator=gen)
    results = []
    for backend in BACKENDS:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = rms_norm_linear(x, w, W, gate, activation=activation, backend=backend)
        results.append([y, *_grads(y, inputs, dy.to(y.dtype))])
    for a, b in zip(*results):
        error = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert error < (2e-2 if dtype == torch.bfloat16 else 1e-4), f"relative error {error:.2e}"
