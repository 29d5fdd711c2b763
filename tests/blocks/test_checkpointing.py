"""Activation checkpointing of the LM's blocks: a checkpointed step's loss and every
gradient equal the plain step's (the same autograd functions run again in the backward,
recipes and packed documents included), the checkpointed blocks run their forward twice
and keep nothing else, and evaluation never recomputes."""

from __future__ import annotations

import pytest
import torch

from archspec.blocks import build_model
from archspec.blocks.lm import Block
from archspec.blocks.loss import packed_labels
from archspec.kernels import IGNORE_INDEX

from .plans import COMBINATIONS, model_plan
from .test_attention import _hybrid_plan


def _step(model, ids, labels, cu=None) -> list[torch.Tensor]:
    loss = model(ids, labels=labels, cu_seqlens=cu)
    return [loss.detach(), *torch.autograd.grad(loss, list(model.parameters()))]


def _batch(packed: bool):
    gen = torch.Generator().manual_seed(3)
    if packed:
        ids = torch.randint(0, 13, (1, 21), generator=gen)
        cu = torch.tensor([0, 5, 16, 21])
        return ids, packed_labels(ids, cu), cu
    ids = torch.randint(0, 13, (2, 11), generator=gen)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = IGNORE_INDEX
    return ids, labels, None


@pytest.mark.parametrize("backend,dtype,packed", [("torch", torch.float64, False), ("torch", torch.float64, True),
                                                  ("triton", torch.float32, True)])
@pytest.mark.parametrize("name", ["gdn-scalar", "kda-channel", "hybrid"])
def test_checkpointed_step_equals_the_plain_step(name, backend, dtype, packed):
    torch.manual_seed(0)
    plan = _hybrid_plan() if name == "hybrid" else model_plan(COMBINATIONS[name], layers=2)
    model = build_model(plan).to(dtype).train()
    model.set_backend(backend)
    ids, labels, cu = _batch(packed)
    plain = _step(model, ids, labels, cu)
    model.set_activation_checkpointing(1)
    assert all(block.gradient_checkpointing for block in model.blocks)
    checkpointed = _step(model, ids, labels, cu)
    names = ["loss", *(n for n, _ in model.named_parameters())]
    for pname, a, b in zip(names, checkpointed, plain):
        torch.testing.assert_close(a, b, rtol=1e-12 if dtype == torch.float64 else 1e-5, atol=1e-12 if dtype == torch.float64 else 1e-6,
                                   msg=lambda e, p=pname: f"{p}: {e}")


def _forward_calls(model, monkeypatch, run) -> int:
    calls = []
    original = Block.forward

    def counted(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Block, "forward", counted)
    run()
    monkeypatch.setattr(Block, "forward", original)
    return len(calls)


def test_checkpointed_blocks_run_twice_and_keep_only_their_inputs(monkeypatch):
    torch.manual_seed(0)
    model = build_model(model_plan(COMBINATIONS["gdn-scalar"], layers=4)).double().train()
    model.set_backend("torch")
    ids, labels, _ = _batch(False)

    def saved_bytes() -> int:
        # The tensors the step keeps for its backward outside checkpointed blocks (a
        # checkpoint keeps its block's inputs and drops what the block itself saves).
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, labels=labels)
        loss.backward()
        return sum(n for ptr, n in seen.items() if ptr not in weights)

    def step():
        model(ids, labels=labels).backward()

    kept = {}
    for every, runs in ((0, 4), (1, 8), (2, 6)):
        model.set_activation_checkpointing(every)
        assert [b.gradient_checkpointing for b in model.blocks] == [every > 0 and i % every == 0 for i in range(4)]
        assert _forward_calls(model, monkeypatch, step) == runs  # a checkpointed block: forward, then again
        kept[every] = saved_bytes()
    assert kept[2] < kept[0] and kept[1] < kept[0] / 3

    model.eval()
    model.set_activation_checkpointing(1)
    assert _forward_calls(model, monkeypatch, lambda: model(ids, labels=labels).backward()) == 4  # evaluation
    model.train()
    with torch.no_grad():
        assert _forward_calls(model, monkeypatch, lambda: model(ids, labels=labels)) == 4  # no graph: no recompute


@pytest.mark.parametrize("every", [-1, 1.5, True, "2"])
def test_activation_checkpointing_refuses_a_bad_stride(every):
    model = build_model(model_plan(COMBINATIONS["gdn-scalar"]))
    with pytest.raises(ValueError, match="every_n_layers must be an integer >= 0"):
        model.set_activation_checkpointing(every)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdn-scalar", "kda-channel", "hybrid"])
def test_gpu_checkpointed_step_equals_the_plain_step(name):
    """On CUDA, bf16 autocast with float32 weights and every fused Triton piece (recipes,
    the recurrence's own backward, FlexAttention on packed documents): the checkpointed
    step runs the same kernels on the same inputs again, so its loss and gradients are the
    plain step's up to the order of atomic additions in the backward."""
    torch.manual_seed(0)
    plan = _hybrid_plan() if name == "hybrid" else model_plan(COMBINATIONS[name], layers=3, d_model=128,
                                                                vocab_size=500)
    model = build_model(plan).cuda().train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, plan.vocab_size, (1, 700), generator=gen).cuda()
    cu = torch.tensor([0, 100, 450, 700], device="cuda", dtype=torch.int32)
    labels = packed_labels(ids, cu)
    runs = []
    for every in (0, 1):
        model.set_activation_checkpointing(every)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=labels, cu_seqlens=cu)
        runs.append([loss.detach(), *torch.autograd.grad(loss, list(model.parameters()))])
    names = ["loss", *(n for n, _ in model.named_parameters())]
    for pname, a, b in zip(names, *runs):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5, msg=lambda e, p=pname: f"{p}: {e}")


def test_a_checkpointed_block_keeps_no_recipe_tensor_alive(monkeypatch):
    """The recurrence keeps its recipes' tensors as saved tensors only (what its node keeps of
    a recipe holds none), so a checkpoint frees them after the forward like every other
    saved tensor; without checkpointing they live until the backward."""
    import gc
    import weakref

    from archspec.kernels.recompute import Recompute

    recorded: list[weakref.ref] = []
    original = Recompute.__init__

    def recording(self, fn, args=(), kwargs=None, shape=None):
        original(self, fn, args, {} if kwargs is None else kwargs, shape)
        recorded.extend(weakref.ref(t) for t in self.tensors() if not isinstance(t, torch.nn.Parameter))

    monkeypatch.setattr(Recompute, "__init__", recording)
    torch.manual_seed(0)
    model = build_model(model_plan(COMBINATIONS["kda-channel"], layers=2)).train()
    model.set_backend("triton")
    ids, labels, _ = _batch(False)
    alive = {}
    for every in (0, 1):
        model.set_activation_checkpointing(every)
        recorded.clear()
        loss = model(ids, labels=labels)
        gc.collect()
        alive[every] = sum(ref() is not None for ref in recorded)
        assert recorded, "the Triton path made no recipes"
        loss.backward()
    assert alive[0] > 0 and alive[1] == 0, alive
