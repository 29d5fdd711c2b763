"""Arguments of the wrong type, dtype or device are refused by the public entry points
with a message that says what to pass instead (an integer tensor used to give zeros,
float offsets were truncated, a list raised AttributeError, Triton on a CPU tensor said
"0 active drivers")."""

from __future__ import annotations

import pytest
import torch

from archspec.kernels import linear_recurrence, osdn_write_keys
from archspec.kernels.naive import linear_recurrence_naive

from .cases import Case, make_inputs


def inputs(**overrides) -> dict:
    base = make_inputs(Case(gate="scalar", transition="householder", n_h=1), B=1, T=6, H=2, K=4, V=3, requires_grad=False)
    base.update(overrides)
    return base


@pytest.mark.parametrize("name", ["q", "k", "v", "beta", "g", "initial_state"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_tensors_are_refused(name, dtype):
    args = inputs(initial_state=torch.zeros(1, 2, 4, 3, dtype=torch.float64))
    args[name] = args[name].round().to(dtype)
    with pytest.raises(TypeError, match=rf"linear_recurrence: {name} must be a floating-point tensor .* got {dtype}; "
                                        rf"convert it with {name}\.float\(\)"):
        linear_recurrence(**args, backend="torch")


@pytest.mark.parametrize("name", ["q", "k", "v", "beta"])
def test_python_lists_are_refused_with_what_to_pass(name):
    args = inputs()
    args[name] = args[name].tolist()
    with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor, got list; pass torch.tensor\({name}, dtype=torch.float32\)"):
        linear_recurrence(**args, backend="torch")


@pytest.mark.parametrize("offsets, words", [
    (torch.tensor([0.0, 2.5, 6.0]), "got torch.float32 (fractional offsets would be truncated)"),
    (torch.tensor([0.0, 3.0, 6.0], dtype=torch.float64), "got torch.float64"),
    ([0, 3, 6], "got list; pass torch.tensor(offsets, dtype=torch.int32"),
    ((0, 3, 6), "got tuple"),
])
def test_cu_seqlens_must_be_an_integer_tensor(offsets, words):
    with pytest.raises(TypeError, match="cu_seqlens must") as info:
        linear_recurrence(**inputs(), cu_seqlens=offsets, backend="torch")
    assert words in str(info.value)
    with pytest.raises(TypeError, match="cu_seqlens must"):
        osdn_write_keys(inputs()["k"], inputs()["beta"], cu_seqlens=offsets, backend="torch")


def test_whole_integer_offsets_still_work_and_match_the_definition():
    args = inputs()
    offsets = torch.tensor([0, 2, 6], dtype=torch.int64)
    out, _ = linear_recurrence(**args, cu_seqlens=offsets, backend="torch")
    parts = [linear_recurrence_naive(**{k: v[:, a:b] if k in ("q", "k", "v", "beta", "g") else v for k, v in args.items()})[0]
             for a, b in ((0, 2), (2, 6))]
    torch.testing.assert_close(out, torch.cat(parts, dim=1))


def test_triton_on_cpu_tensors_says_to_use_torch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"backend='triton' runs on CUDA tensors, but the inputs are on cpu; use backend='torch'"):
        linear_recurrence(**inputs(), backend="triton")
    with pytest.raises(ValueError, match="backend='triton' runs on CUDA tensors"):
        osdn_write_keys(inputs()["k"], inputs()["beta"], backend="triton")


def test_numbers_that_are_not_numbers():
    with pytest.raises(ValueError, match="n_h must be a positive int, got True"):
        linear_recurrence(**inputs(n_h=True), backend="torch")
    with pytest.raises(ValueError, match="scale must be a finite number, got nan"):
        linear_recurrence(**inputs(scale=float("nan")), backend="torch")
    with pytest.raises(ValueError, match="eta must be a finite number, got inf"):
        osdn_write_keys(inputs()["k"], inputs()["beta"], eta=float("inf"), backend="torch")


@pytest.mark.gpu
def test_tensors_on_two_devices_are_refused():
    args = inputs()
    args["k"] = args["k"].cuda()
    with pytest.raises(ValueError, match="k is on cuda:0 but q is on cpu; pass every tensor on one device"):
        linear_recurrence(**args, backend="torch")
