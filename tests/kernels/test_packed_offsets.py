"""The packed batch's offsets are read on the host once per `cu_seqlens` tensor
(`kernels/packed.py`): the cache returns what the tensor holds now, and a packed model's
forward and backward read the tensor once, however many layers use it."""

from __future__ import annotations

import pytest
import torch

from archspec.blocks import build_model
from archspec.blocks.loss import packed_labels
from archspec.kernels.packed import CACHED_TENSORS, check_offsets, host_offsets, per_offsets_tensor
from archspec.kernels.short_conv import packed_sequence_index
from archspec.kernels.triton.chunks import chunk_tables

from ..blocks.plans import COMBINATIONS, model_plan


def test_a_tensor_changed_in_place_is_read_again():
    cu = torch.tensor([0, 3, 7])
    assert host_offsets(cu) == (0, 3, 7)
    cu[1] = 5
    assert host_offsets(cu) == (0, 5, 7)
    assert host_offsets(torch.tensor([0, 2, 7])) == (0, 2, 7)  # equal shape, other values


def test_an_inference_tensor_is_read_every_time():
    """Tensors made under `torch.inference_mode` keep no version counter, so an in-place
    change could not be told: they are not cached."""
    with torch.inference_mode():
        cu = torch.tensor([0, 3, 7])
        assert host_offsets(cu) == (0, 3, 7)
        cu[1] = 5
        assert host_offsets(cu) == (0, 5, 7)


def test_the_cache_forms_each_result_once_and_keeps_the_last_few():
    calls = []

    @per_offsets_tensor
    def lengths(cu: torch.Tensor, scale: int) -> list[int]:
        calls.append(scale)
        return [scale * int(b - a) for a, b in zip(cu, cu[1:])]

    cu = torch.tensor([0, 2, 5])
    first = lengths(cu, 1)
    assert lengths(cu, 1) is first and lengths(cu, 2) == [4, 6] and calls == [1, 2]
    for _ in range(CACHED_TENSORS):
        lengths(torch.tensor([0, 1]), 1)
    assert lengths(cu, 1) == first and lengths(cu, 1) is not first  # evicted, formed again
    assert calls == [1, 2] + [1] * CACHED_TENSORS + [1]


def test_chunk_tables_follow_the_offsets():
    cu = torch.tensor([0, 5, 5, 70])
    table, offsets, count = chunk_tables(cu, 64)
    assert table.tolist() == [[0, 0], [2, 0], [2, 1]] and offsets.tolist() == [0, 1, 1, 3] and count == 3
    assert chunk_tables(cu, 64)[0] is table  # every layer gets the same tables


def test_the_short_convs_sequence_index_follows_the_offsets():
    """Per token, its document's first token and the document's index, in int32 as the
    kernel reads them; an empty document takes no token. Every stream and layer of a step
    gets the same tensors."""
    cu = torch.tensor([0, 3, 3, 7])
    starts, docs = packed_sequence_index(cu, 7)
    assert starts.tolist() == [0, 0, 0, 3, 3, 3, 3] and docs.tolist() == [0, 0, 0, 2, 2, 2, 2]
    assert starts.dtype == docs.dtype == torch.int32
    assert packed_sequence_index(cu, 7)[0] is starts
    cu[1] = 1  # changed in place: formed again
    assert packed_sequence_index(cu, 7)[0].tolist() == [0, 1, 1, 3, 3, 3, 3]


@pytest.mark.parametrize("offsets,message", [
    ([0, 4, 9], "must run from 0 to T = 8, got [0, 4, 9]"),
    ([0, 6, 4, 8], "must be non-decreasing, got [0, 6, 4, 8]"),
    ([[0, 8]], "1-D integer tensor"),
    ([0.0, 8.0], "1-D integer tensor"),
])
def test_bad_offsets_are_refused_with_their_values(offsets, message):
    with pytest.raises(ValueError, match="where: cu_seqlens " if "1-D" not in message else "1-D") as info:
        check_offsets(torch.tensor(offsets), 8, "where")
    assert message in str(info.value)


HOST_READS = ("tolist", "item", "__int__", "__bool__", "__float__", "__index__")


def _host_reads_of_a_packed_step(backend: str, layers: int, monkeypatch) -> list[str]:
    """Every read of a tensor's values on the host (a device sync on CUDA) during one packed
    forward and backward, named by the method."""
    torch.manual_seed(0)
    model = build_model(model_plan(COMBINATIONS["gdn-scalar"], layers=layers))
    model.set_backend(backend)
    ids = torch.randint(0, 13, (1, 12), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 5, 12])
    labels = packed_labels(ids, cu)
    reads: list[str] = []
    with monkeypatch.context() as patch:
        for name in HOST_READS:
            method = getattr(torch.Tensor, name)
            patch.setattr(torch.Tensor, name, lambda self, *a, _m=method, _n=name: (reads.append(_n), _m(self, *a))[1])
        model(ids, labels=labels, cu_seqlens=cu).backward()
    return reads


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_packed_step_reads_nothing_on_the_host_per_layer(backend, monkeypatch):
    """One layer or three, each with its convolutions and recurrence: the same host reads
    (the offsets once, the loss's target check once), none per layer."""
    one, three = (_host_reads_of_a_packed_step(backend, layers, monkeypatch) for layers in (1, 3))
    assert one == three
    assert len(one) <= 3, one


@pytest.mark.gpu
def test_a_packed_step_on_cuda_syncs_the_same_at_any_depth():
    """On CUDA, with torch's sync debugging: one packed forward and backward on the Triton
    path syncs as often at three layers as at one (the offsets' read, the chunk tables'
    copies and the loss's target check, once each)."""
    import warnings

    def syncs(layers: int) -> int:
        torch.manual_seed(0)
        model = build_model(model_plan(COMBINATIONS["kda-channel"], layers=layers)).cuda()
        ids = torch.randint(0, 13, (1, 300), device="cuda")
        cu = torch.tensor([0, 100, 101, 300], device="cuda")
        labels = packed_labels(ids, cu)
        model(ids, labels=labels, cu_seqlens=cu).backward()  # compiled before counting
        cu = cu.clone()  # a new tensor: its offsets are read again, as in a new step
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model(ids, labels=labels, cu_seqlens=cu).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    one, three = syncs(1), syncs(3)
    assert one == three and one <= 5, (one, three)
