"""No kernel reads or writes outside the tensors it is given: the chunk kernel (forward and
backward, every mode and gate, head dimensions below and between Triton's block sizes,
packed sequences) and the fused pieces, under the bounds-checked interpreter (`bounds.py`).

On the GPU such an access is an illegal memory access; here it is an `OutOfBounds` error
with the kernel and program that made it. CPU only (the interpreter)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.errors import InterpreterError

from archspec.kernels import linear_recurrence
from archspec.kernels.linear_ce import linear_cross_entropy
from archspec.kernels.rms_norm import rms_norm
from archspec.kernels.short_conv import short_conv

from .bounds import OutOfBounds, available, bounds_checked
from .cases import Case, make_inputs

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the bounds check wraps the CPU interpreter"),
    pytest.mark.skipif(not available(), reason="this Triton's interpreter lacks the seams the bounds check wraps"),
]

CASES = [
    Case(gate="none", transition="householder"),  # DeltaNet
    Case(gate="scalar", transition="householder", n_h=2, beta_scale=2.0, initial_state=True),
    Case(gate="channel", transition="householder"),  # KDA
    Case(gate="none", transition="rwkv7", write_key="untied"),
    Case(gate="scalar", transition="rwkv7", write_key="untied"),
    Case(gate="channel", transition="diagonal", write_key="untied", initial_state=True),  # GLA
    Case(gate="scalar", transition="householder", write_key="preconditioned"),
]


@triton.jit
def _reads_past_its_end(x, y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y + offs, tl.load(x + offs))  # x holds N // 2 elements


def test_the_check_catches_a_read_past_the_end():
    x, y = torch.zeros(8), torch.zeros(16)
    # the interpreter re-raises a kernel's error as an InterpreterError holding its repr
    with bounds_checked(), pytest.raises((OutOfBounds, InterpreterError), match="_reads_past_its_end: a load of 8 element"):
        _reads_past_its_end[(1,)](x, y, N=16)


@triton.jit
def _reads_rows_of_a_mask(x, y, n, N: tl.constexpr, ROWS: tl.constexpr):
    # Row r's load is masked in while r < n: an `&` with a scalar side, which the
    # interpreter holds as 0/1 integers rather than booleans.
    offs = tl.arange(0, N)
    for r in tl.static_range(0, ROWS):
        row = tl.load(x + r * N + offs, mask=(offs < N) & (r < n), other=0.0)
        tl.store(y + r * N + offs, row, mask=(offs < N) & (r < n))


def test_an_integer_mask_is_read_as_a_mask():
    x, y = torch.ones(2, 8), torch.zeros(4, 8)  # x holds two of the four rows
    with bounds_checked():
        _reads_rows_of_a_mask[(1,)](x, y, 2, N=8, ROWS=4)  # rows 2 and 3 masked out: no error
    assert y[:2].eq(1).all() and y[2:].eq(0).all()
    with bounds_checked(), pytest.raises((OutOfBounds, InterpreterError), match="_reads_rows_of_a_mask: a load of 8 element"):
        _reads_rows_of_a_mask[(1,)](x, y, 3, N=8, ROWS=4)  # row 2 masked in, past x's end


STRONG_CHANNEL_CASES = [Case(gate="channel", transition=t, write_key="tied" if t == "householder" else "untied")
                        for t in ("householder", "diagonal", "rwkv7")]


@pytest.mark.parametrize("case", STRONG_CHANNEL_CASES, ids=lambda c: c.id)
def test_strong_channel_decay_in_a_partial_chunk_stays_within_its_tensors(case: Case):
    # A last chunk of 40 tokens (about 3 nats each: past twice the bound, each 16-token
    # sub-chunk within it) takes the sub-chunk path (decay.py), whose references to the
    # later, empty sub-chunk must stay masked.
    inputs = make_inputs(case, B=2, T=104, H=2, K=8, V=8, dtype=torch.float32, seed=1, gate_strength=8.0)
    with bounds_checked():
        o, final = linear_recurrence(**inputs, output_final_state=True, backend="triton")
        (o.square().sum() + final.square().sum()).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in inputs.values() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("head_dim", [8, 24], ids=lambda d: f"K{d}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_chunk_kernel_stays_within_its_tensors(case: Case, head_dim: int):
    inputs = make_inputs(case, B=2, T=37, H=2, K=head_dim, V=head_dim, dtype=torch.float32)
    with bounds_checked():
        o, final = linear_recurrence(**inputs, output_final_state=True, backend="triton")
        (o.square().sum() + final.square().sum()).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in inputs.values() if isinstance(t, torch.Tensor))


def test_packed_sequences_stay_within_their_tensors():
    case = Case(gate="channel", transition="householder", n_h=2)
    inputs = make_inputs(case, B=1, T=45, H=2, K=8, V=8, dtype=torch.float32)
    cu_seqlens = torch.tensor([0, 7, 7, 40, 45], dtype=torch.int32)  # an empty document and odd lengths
    with bounds_checked():
        o, final = linear_recurrence(**inputs, output_final_state=True, cu_seqlens=cu_seqlens, backend="triton")
        (o.square().sum() + final.square().sum()).backward()
    assert final.shape == (4, 2, 8, 8)


def test_the_fused_pieces_stay_within_their_tensors():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 19, 24, generator=gen, requires_grad=True)
    gate = torch.randn(2, 19, 24, generator=gen, requires_grad=True)
    weight = torch.randn(24, generator=gen, requires_grad=True)
    conv = torch.randn(24, 4, generator=gen, requires_grad=True)
    head = torch.randn(30, 24, generator=gen, requires_grad=True)
    targets = torch.randint(0, 30, (2, 19), generator=gen)
    targets[0, :3] = -100  # ignored rows
    with bounds_checked():
        y = rms_norm(x, weight, gate, activation="silu", backend="triton")
        y = short_conv(y, conv, head_dim=8, backend="triton")
        loss = linear_cross_entropy(y, head, targets, backend="triton")
        loss.backward()
    assert all(torch.isfinite(t.grad).all() for t in (x, gate, weight, conv, head))
