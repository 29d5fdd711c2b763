"""The decoding step's linear maps (`kernels.row_linear`) against plain torch: every
prologue (none, the pre-norm with and without the pending addition, the per-head output
norm with each gate, SwiGLU), with a bias, on rows that are column slices of a wider
output; the Triton kernel (the interpreter on the CPU) and the unfused path, float64,
float32 and bfloat16. The residual the pre-norm hands on is checked exactly (to bfloat16's
rounding in bfloat16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from archspec.kernels.row_linear import SWIGLU, HeadNorm, PreNorm, row_linear

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}
EPS = 1e-5


def _randn(*shape, gen, dtype, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(DEVICE, dtype)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def _case(prologue: str, rows: int, dtype: torch.dtype, seed: int = 0):
    """(x, weight, bias, before, the product's input in float64, the residual or None)."""
    gen = torch.Generator().manual_seed(seed)
    K, N, V = 96, 40, 16
    width = 2 * K if prologue == "swiglu" else K
    x = _randn(rows, 1, width + 7, gen=gen, dtype=dtype)[..., :width]  # a column slice of a wider row
    weight = _randn(N, K, gen=gen, dtype=dtype, scale=K**-0.5)
    bias = _randn(N, gen=gen, dtype=dtype)
    before, residual = None, None
    if prologue == "none":
        y = x.double()
    elif prologue in ("norm", "norm-first"):
        w = _randn(K, gen=gen, dtype=dtype, scale=0.5) + 1
        pending = None if prologue == "norm-first" else _randn(rows, 1, K, gen=gen, dtype=dtype)
        residual = x if pending is None else x + pending  # in the stream's dtype, as the unfused path rounds it
        before = PreNorm(w, EPS, pending)
        y = _rms(residual, w)
    elif prologue.startswith("head"):
        activation = prologue.split("-")[1]
        w = _randn(V, gen=gen, dtype=dtype, scale=0.5) + 1
        gate = None if activation == "none" else _randn(rows, 1, K + 3, gen=gen, dtype=dtype)[..., 3:]
        before = HeadNorm(w, EPS, gate, activation)
        y = _rms(x.unflatten(-1, (-1, V)), w).flatten(-2)
        if activation == "silu":
            y = y * F.silu(gate.double())
        elif activation == "sigmoid":
            y = y * torch.sigmoid(gate.double())
    else:
        gate, up = x.double().chunk(2, dim=-1)
        before, y = SWIGLU, F.silu(gate) * up
    return x, weight, bias, before, y, residual


PROLOGUES = ["none", "norm", "norm-first", "head-none", "head-silu", "head-sigmoid", "swiglu"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["f64", "f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_row_linear_equals_the_norm_then_the_product(prologue, rows, dtype, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    x, weight, bias, before, y, residual = _case(prologue, rows, dtype)
    # the unfused path hands the product its input rounded to the activations' dtype
    want = F.linear(y.to(dtype).double(), weight.double(), bias.double())
    got, got_residual = row_linear(x, weight, bias, before=before, backend=backend)
    assert got.shape == (rows, 1, weight.shape[0]) and got.dtype == dtype
    scale = max(1.0, want.abs().max().item())
    assert (got.double() - want).abs().max().item() <= TOL[dtype] * scale
    if residual is None:
        assert got_residual is None
    elif dtype == torch.bfloat16:  # one rounding of the float32 sum (the interpreter rounds toward zero)
        torch.testing.assert_close(got_residual, residual, rtol=2**-7, atol=0)
    else:
        assert torch.equal(got_residual, residual)


def test_more_rows_than_the_kernel_takes_run_the_unfused_path():
    """Past `max_rows` (a large decoding batch) cuBLAS takes the product: same numbers."""
    pytest.importorskip("triton")
    from archspec.kernels.triton.launch import ROW_LINEAR_MAX_ROWS

    x, weight, bias, before, y, residual = _case("norm", ROW_LINEAR_MAX_ROWS + 2, torch.float64)
    got, got_residual = row_linear(x, weight, bias, before=before, backend="triton")
    torch.testing.assert_close(got.double(), F.linear(y, weight.double(), bias.double()), rtol=1e-10, atol=1e-10)
    assert torch.equal(got_residual, residual)


def test_bad_row_linear_arguments_are_named():
    x, weight = torch.zeros(2, 1, 8), torch.zeros(5, 8)
    with pytest.raises(ValueError, match=r"x must be \[B, 1, K\]"):
        row_linear(torch.zeros(2, 8), weight)
    with pytest.raises(ValueError, match=r"weight must be \[N, 4\]"):
        row_linear(x, weight, before=SWIGLU)
    with pytest.raises(ValueError, match=r"PreNorm's pending must have x's shape"):
        row_linear(x, weight, before=PreNorm(torch.ones(8), EPS, torch.zeros(2, 1, 4)))
    with pytest.raises(ValueError, match=r"HeadNorm's weight must be \[V\] with V dividing 8"):
        row_linear(x, weight, before=HeadNorm(torch.ones(3), EPS))
    with pytest.raises(ValueError, match="'none' exactly without a gate"):
        row_linear(x, weight, before=HeadNorm(torch.ones(4), EPS, torch.zeros(2, 1, 8), "none"))


@pytest.mark.gpu
@pytest.mark.parametrize("prologue,K,N", [("norm", 1024, 3080), ("norm-first", 1024, 32000), ("head-sigmoid", 1024, 1024),
                                          ("head-none", 1024, 1024), ("swiglu", 2736, 1024), ("none", 128, 1024)])
def test_row_linear_at_the_models_shapes_on_cuda(prologue, K, N):
    """The 166M LM's decoding products (the launch table's block sizes, heads of 128) in
    bfloat16 against float64, at batch 1 and at the most rows the kernel takes."""
    from archspec.kernels.triton.launch import ROW_LINEAR_MAX_ROWS

    gen = torch.Generator().manual_seed(11)
    for rows in (1, ROW_LINEAR_MAX_ROWS):
        width = 2 * K if prologue == "swiglu" else K
        x = torch.randn(rows, 1, width, generator=gen, dtype=torch.float64)
        weight = K**-0.5 * torch.randn(N, K, generator=gen, dtype=torch.float64)
        before, y = None, x
        if prologue.startswith("norm"):
            w = 1 + 0.5 * torch.randn(K, generator=gen, dtype=torch.float64)
            pending = None if prologue == "norm-first" else torch.randn(rows, 1, K, generator=gen, dtype=torch.float64)
            r = x if pending is None else x + pending
            before, y = (w, pending), _rms(r, w)
        elif prologue.startswith("head"):
            w = 1 + 0.5 * torch.randn(128, generator=gen, dtype=torch.float64)
            gate = torch.randn(rows, 1, K, generator=gen, dtype=torch.float64) if prologue == "head-sigmoid" else None
            y = _rms(x.unflatten(-1, (-1, 128)), w).flatten(-2) * (1 if gate is None else torch.sigmoid(gate))
            before = (w, gate)
        elif prologue == "swiglu":
            gate_half, up = x.chunk(2, dim=-1)
            y = F.silu(gate_half) * up
        want = F.linear(y, weight)
        cuda = lambda t: None if t is None else t.to("cuda", torch.bfloat16)
        if prologue.startswith("norm"):
            before = PreNorm(cuda(before[0]), EPS, cuda(before[1]))
        elif prologue.startswith("head"):
            before = HeadNorm(cuda(before[0]), EPS, cuda(before[1]), "none" if before[1] is None else "sigmoid")
        elif prologue == "swiglu":
            before = SWIGLU
        got, _ = row_linear(cuda(x), cuda(weight), before=before)
        error = ((got.double().cpu() - want).norm() / want.norm()).item()
        assert error < 1e-2, f"{prologue} rows={rows}: relative error {error:.2e}"


def test_a_weight_copied_just_now_is_not_read_ahead_of_the_wait(monkeypatch):
    """Launched overlapped, the kernel reads its first weight tile before the kernel before
    it has finished. A non-contiguous weight is copied right before the launch (that copy is
    the kernel before), so that launch must not overlap; a model's contiguous weight may.
    The result is the product either way."""
    pytest.importorskip("triton")
    from archspec.kernels.triton import row_linear as triton_row_linear

    seen: list[bool] = []
    launch = triton_row_linear.row_linear_triton

    def recorded(*args, weight_settled: bool = True, **kwargs):
        seen.append(weight_settled)
        return launch(*args, weight_settled=weight_settled, **kwargs)

    monkeypatch.setattr(triton_row_linear, "row_linear_triton", recorded)
    x, weight, bias, _, y, _ = _case("none", 1, torch.float64)
    transposed = weight.t().contiguous().t()  # the same values, column-major
    for w in (weight, transposed):
        got, _ = row_linear(x, w, bias, backend="triton")
        torch.testing.assert_close(got.double(), y @ weight.double().t() + bias.double(), atol=1e-10, rtol=1e-10)
    assert seen == [True, False]
