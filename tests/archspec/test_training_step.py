"""The trainer's step (`archspec.training.TrainingStep`): a CUDA graph's replay where the
model allows it, the eager step elsewhere, with the same loss and gradients either way.

On the CPU: the padding a replay uses for shorter batches leaves the loss and every
gradient as they were (float64, against the unpadded batch), and the step says why it is
eager. On CUDA: graphed against eager over batches of drawn lengths with AdamW between,
and a model that reads on the host falls back to the eager step."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import archspec
from archspec.blocks import build_model
from archspec.blocks.loss import IGNORE_INDEX
from archspec.graphed_step import CaptureRefused
from archspec.training import TrainingStep, make_optimizer, padded_to, training_loss
from tests.blocks.plans import COMBINATIONS, model_plan

HYBRID = Path(__file__).resolve().parents[2] / "specs" / "models" / "kimi-linear-hybrid.yaml"
HYBRID_TINY = ["model.layers=2", "layout.ratio='1:1'", "model.d_model=32", "mixer.heads=2", "mixer.head_dim=16",
               "attention.head_dim=16", "model.vocab_size=1000"]
VOCAB = 1000


def _model(name: str) -> torch.nn.Module:
    if name == "hybrid":  # a recurrent layer and an attention layer
        return archspec.compile(archspec.load_spec(HYBRID, HYBRID_TINY))
    return build_model(model_plan(COMBINATIONS[name], layers=2, d_model=32, vocab_size=VOCAB))


def _batch(B: int, T: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = IGNORE_INDEX
    labels[seed % B, : seed % T + 1] = IGNORE_INDEX  # a different count of scored labels each batch
    return ids.to(device), labels.to(device)


@pytest.mark.parametrize("name", ["gdn-scalar", "kda-channel", "rwkv7-nh2-b2-channel", "osdn-apf-nh2", "hybrid"])
def test_padding_at_the_end_changes_no_loss_and_no_gradient(name):
    """A causal model on a batch padded at its end with token 0 and unscored labels: the
    same loss and every gradient as on the batch itself (float64; only the order of sums
    over tokens can differ)."""
    torch.manual_seed(0)
    model = _model(name).double()
    ids, labels = _batch(2, 21, seed=5)
    grads = []
    for x, y in (padded_to(21, ids, labels), padded_to(40, ids, labels)):
        model.zero_grad(set_to_none=True)
        loss = training_loss(model, x, y, device="cpu")
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss, plain), (padded_loss, padded) = grads
    torch.testing.assert_close(padded_loss, loss, rtol=1e-12, atol=0)
    for n, g in plain.items():
        torch.testing.assert_close(padded[n], g, rtol=1e-10, atol=1e-14, msg=lambda e, n=n: f"{n}: {e}")
    with pytest.raises(ValueError, match="cannot pad a batch of 21 tokens to 20"):
        padded_to(20, ids, labels)


def test_the_cpu_step_is_eager_and_says_why():
    torch.manual_seed(0)
    model = _model("gdn-scalar")
    reference = copy.deepcopy(model)
    ids, labels = _batch(2, 16, seed=1)
    step = TrainingStep(model, device="cpu")
    loss = step(ids, labels, scale=0.5)
    assert not step.graphed and step.eager_reason == "CUDA graphs need a CUDA device, this step runs on cpu"
    expected = training_loss(reference, ids, labels, device="cpu")
    (expected * 0.5).backward()
    torch.testing.assert_close(loss, expected.detach() * 0.5)
    for (n, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda e, n=n: f"{n}: {e}")
    assert TrainingStep(model, device="cpu", graphed=False).eager_reason == "the eager step was asked for"
    with pytest.raises(ValueError, match="cannot capture the training step as a CUDA graph: CUDA graphs need a CUDA"):
        TrainingStep(model, device="cpu", graphed=True)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdn-scalar", "kda-channel", "hybrid"])
def test_gpu_graphed_training_step_equals_the_eager_one_over_drawn_lengths(name):
    """Two copies of one model, AdamW after each step, on batches of drawn lengths (as the
    formal-language tasks draw them): one replays its graph (padding shorter batches to
    the captured length, capturing again at a longer one), the other runs eagerly on the
    same padded batch. They run the same kernels on the same shapes, so loss and every
    gradient agree to 1e-5; a stale input, a count baked into the graph or weights read
    from before an update would be off by 1e-2 or more. The eager step on the batch itself
    differs from the padded one only by the kernels' bfloat16 rounding at another length
    (the float64 test above shows the padding exact): within 1e-1 of each gradient's norm
    (kda-channel's q projection measured 5.4e-2 at T=40 padded to 96, on an H100), where
    scoring the padded tail would be off by O(1)."""
    torch.manual_seed(3)
    eager = _model(name).cuda().train()
    graphed = copy.deepcopy(eager)
    opt_eager, opt_graphed = make_optimizer(eager, lr=1e-2), make_optimizer(graphed, lr=1e-2)
    step_eager = TrainingStep(eager, device="cuda", graphed=False)
    step_graphed = TrainingStep(graphed, device="cuda")
    for i, T in enumerate([96, 64, 96, 40, 128, 72]):
        ids, labels = _batch(2, T, seed=i, device="cuda")
        got = step_graphed(ids, labels).clone()
        assert step_graphed.graphed, step_graphed.eager_reason
        length = step_graphed.graph.shape[1]
        alone = step_eager(ids, labels)
        unpadded = _grads(eager)
        eager.zero_grad(set_to_none=True)
        want = step_eager(*padded_to(length, ids, labels))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(want, alone, rtol=1e-2, atol=1e-4)
        for (n, p), q in zip(eager.named_parameters(), graphed.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=lambda e, n=n: f"{n}: {e}")
            assert _relative(p.grad, unpadded[n]) < 1e-1, (n, T, length)
        for opt in (opt_eager, opt_graphed):
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert step_graphed.graph.shape == (2, 128)  # captured again at the longest batch
    step_graphed(ids, labels, scale=0.5)
    assert not step_graphed.graphed and step_graphed.eager_reason == "a scaled loss (a data-parallel rank's share) runs eagerly"
    ids, labels = _batch(3, 64, seed=9, device="cuda")
    step_graphed(ids, labels)
    assert not step_graphed.graphed and "captured for batches of 2 rows, this one has 3" in step_graphed.eager_reason


@pytest.mark.gpu
def test_gpu_a_step_that_reads_on_the_host_runs_eagerly():
    """A module that reads a device value on the host cannot be replayed: the warm-up under
    `set_sync_debug_mode("error")` finds it before capture, the step runs eagerly from then
    on and says why; asked for a graph, it is an error."""
    torch.manual_seed(4)
    model = _model("gdn-scalar").cuda().train()
    reference = copy.deepcopy(model)
    for m in (model, reference):  # a host read in the step (each copy's own forward)
        mlp = m.blocks[0].mlp
        mlp.forward = lambda x, forward=mlp.forward: forward(x) * (1.0 + 0.0 * x.abs().max().item())
    ids, labels = _batch(2, 64, seed=2, device="cuda")
    step = TrainingStep(model, device="cuda")
    loss = step(ids, labels)
    assert not step.graphed and "reads a device value on the host" in step.eager_reason
    want = training_loss(reference, ids, labels, device="cuda")
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    for (n, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda e, n=n: f"{n}: {e}")
    model.zero_grad(set_to_none=True)
    with pytest.raises(CaptureRefused, match="reads a device value on the host"):
        TrainingStep(model, device="cuda", graphed=True)(ids, labels)
