"""The training step captured as a CUDA graph (`archspec.graphed_step`) against the eager
step: the same losses and gradients over several steps with AdamW between them, and the
inputs it cannot replay refused with a message that says why."""

from __future__ import annotations

import copy

import pytest
import torch

from archspec.blocks import build_model
from archspec.blocks.loss import IGNORE_INDEX
from archspec.graphed_step import GraphedStep
from archspec.training import make_optimizer, training_loss
from tests.blocks.plans import COMBINATIONS, model_plan


def test_graphed_step_refuses_what_it_cannot_capture():
    model = build_model(model_plan(COMBINATIONS["gdn-scalar"]))
    with pytest.raises(ValueError, match="needs the model on a CUDA device"):
        GraphedStep(model, 2, 8)
    with pytest.raises(TypeError, match="takes an archspec LanguageModel, got Linear"):
        GraphedStep(torch.nn.Linear(2, 2), 2, 8)


def _batches(steps: int, B: int, T: int, vocab: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for i in range(steps):
        ids = torch.randint(0, vocab, (B, T), generator=gen)
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = IGNORE_INDEX
        labels[i % B, : i + 1] = IGNORE_INDEX  # a different count of scored labels each step
        out.append((ids.to(device), labels.to(device)))
    return out


OUTSIDE_POOL_SLACK_BYTES = 4 * 2**21  # four small-allocation segments of the caching allocator


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdn-scalar", "kda-channel", "rwkv7-nh2-b2-channel"])
def test_gpu_graphed_step_equals_the_eager_step(name):
    """Two copies of one model, one trained by the eager step (`training_loss` + backward),
    one by replays of its captured step, AdamW after each: every step's loss and every
    gradient agree. The same kernels run in the same order, so they agree to the last bit
    unless a library picks another algorithm under capture; 1e-5 relative leaves room for
    that and none for a stale input, a count baked into the graph or weights read from
    before an update (each of those is off by O(1e-2) or more here)."""
    torch.manual_seed(3)
    B, T, vocab = 2, 128, 1000
    eager = build_model(model_plan(COMBINATIONS[name], layers=2, d_model=64, vocab_size=vocab)).cuda().train()
    graphed = copy.deepcopy(eager)
    opt_eager = make_optimizer(eager, lr=1e-2, device="cuda")
    opt_graphed = make_optimizer(graphed, lr=1e-2, device="cuda")
    step = GraphedStep(graphed, B, T)
    for ids, labels in _batches(6, B, T, vocab, "cuda"):
        loss = training_loss(eager, ids, labels, device="cuda")
        loss.backward()
        got = step(ids, labels).clone()
        torch.testing.assert_close(got, loss.detach(), rtol=1e-5, atol=1e-6)
        for (pname, p), q in zip(eager.named_parameters(), graphed.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=lambda e, n=pname: f"{n}: {e}")
        opt_eager.step()
        opt_graphed.step()
        opt_eager.zero_grad(set_to_none=True)
        opt_graphed.zero_grad(set_to_none=True)
    # the memory the capture added, against the allocator's own account of the graph's pool:
    # at least the pool's segments, and at most a few small segments more (a workspace or
    # small block the capture allocated outside its pool; 2 MiB each, as measured on an H100)
    pool = tuple(step.graph.pool())
    in_pool = sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == pool)
    assert 0 < in_pool <= step.pool_bytes[0] <= in_pool + OUTSIDE_POOL_SLACK_BYTES
    ids, labels = _batches(1, B, T, vocab, "cuda")[0]
    with pytest.raises(ValueError, match=r"made for batches of \[2, 128\], got ids \[2, 64\]"):
        step(ids[:, :64], labels[:, :64])
    with pytest.raises(ValueError, match="packed documents"):
        step(ids, labels, cu_seqlens=torch.tensor([0, 128, 256], device="cuda"))
    bad = labels.clone()
    bad[1, 5] = vocab
    with pytest.raises(ValueError, match=r"labels: 1 outside \[0, 1000\)"):
        step(ids, bad)
    graphed.double()
    with pytest.raises(ValueError, match="parameters were moved, cast or replaced"):
        step(ids, labels)
