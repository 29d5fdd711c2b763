"""The memory estimate against the built module: weights exactly, and activations as a
lower bound of what autograd really saves (counted with `saved_tensors_hooks`, each
storage once): on the torch backend in float32, and on the Triton path under bfloat16
autocast, the CUDA training step's functions (run here by Triton's interpreter), within a
factor of 2 of it. (The torch path keeps more: each stream before and after its conv,
the normalised rows, the logits.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import archspec
from archspec.blocks import build_model
from archspec.blocks.memory import OPTIMIZER_COPIES, estimate_memory

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "specs" / "models").glob("*.yaml"))
SMALL = ["model.d_model=64", "mixer.heads=2", "mixer.head_dim=16"]


def saved_activation_bytes(model: torch.nn.Module, batch: int, seq_len: int, *, fused_loss: bool = False) -> int:
    """Bytes of every tensor autograd keeps for the backward of one loss, parameters aside:
    the full logits' cross-entropy, or (`fused_loss`) the model's own loss without logits."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    vocab = model.plan.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if fused_loss:
            model(ids, labels=ids)
        else:
            logits = model(ids)
            F.cross_entropy(logits.float().reshape(-1, vocab), ids.reshape(-1))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for pointer, size in storages.items() if pointer not in weights)


def cuda_step_bytes_per_token(model: torch.nn.Module) -> float:
    """What the CUDA training step keeps per token: the Triton path under bfloat16 autocast,
    the slope between two lengths (autocast's bfloat16 copies of the weights do not grow
    with the tokens)."""
    model.set_backend("triton")
    short, long = 64, 128  # whole 64-token chunks
    with torch.autocast("cpu", dtype=torch.bfloat16):
        at = {n: saved_activation_bytes(model, 1, n, fused_loss=True) for n in (short, long)}
    return (at[long] - at[short]) / (long - short)


# How far above the bound the CUDA step's saved bytes may lie (module docstring).
TIGHTNESS = 2.0

# The hybrids in fewer layers (the interpreter's time grows with them): the 3:1 stacks in
# one period of four, the 28-layer Jet-Nemotron placement in 6, still with recurrent,
# full-attention and sliding-window layers, the window shorter than the tokens
SHORTER = {
    "jet-nemotron-placement": ["model.layers=6", "layout.attention_at=[2, 4, 5]",
                               "layout.overrides=[{layers: [4, 5], attention: {window: 96}}]"],
    "kimi-linear-hybrid": ["model.layers=4"],
    "qwen3-next-hybrid": ["model.layers=4"],
}

CASES = [(path.stem, SMALL + SHORTER.get(path.stem, [])) for path in SHIPPED] + [
    ("deltanet", []),
    ("deltaproduct-3", ["mixer.expand_v=2", "model.mlp=gelu", *SMALL]),
    ("rwkv7", ["mixer.short_conv=0", "model.mlp=none", "model.layers=3"]),
    ("gla", ["mixer.heads=8", "mixer.head_dim=32", "model.vocab_size=1000"]),
]


@pytest.mark.parametrize("name, overrides", CASES, ids=[f"{n}-{len(o)}" for n, o in CASES])
def test_the_estimate_is_a_close_lower_bound_of_what_training_keeps(name, overrides):
    plan = archspec.lower(archspec.load_spec(REPO / "specs" / "models" / f"{name}.yaml", overrides))
    torch.manual_seed(0)
    model = build_model(plan)
    model.set_backend("torch")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    batch, seq_len = 2, 64
    estimate = estimate_memory(plan, batch=batch, seq_len=seq_len, training=True)
    assert estimate.weights == weights and estimate.params == sum(p.numel() for p in model.parameters())
    assert (estimate.gradients, estimate.optimizer) == (weights, OPTIMIZER_COPIES * weights)
    assert estimate.total == weights + estimate.optimizer + max(weights, estimate.activations)
    assert estimate.activations <= saved_activation_bytes(model, batch, seq_len)
    per_token = estimate_memory(plan, batch=1, seq_len=1, training=True, activation_bytes=2).activations
    measured = cuda_step_bytes_per_token(model)
    assert per_token <= measured <= TIGHTNESS * per_token, (measured, per_token)


def test_activations_scale_with_the_tokens_and_vanish_without_training():
    plan = archspec.lower(archspec.load_spec(REPO / "specs" / "models" / "deltanet.yaml", SMALL))
    one = estimate_memory(plan, batch=1, seq_len=64, training=True)
    assert estimate_memory(plan, batch=4, seq_len=128, training=True).activations == 8 * one.activations
    assert estimate_memory(plan, batch=1, seq_len=64, training=True, activation_bytes=2).activations * 2 == one.activations
    built_only = estimate_memory(plan)
    assert built_only.total == built_only.weights == one.weights


def test_checkpointed_blocks_keep_their_inputs_and_one_block_at_a_time():
    """With every n-th block checkpointed, each of those keeps only its two inputs (2 d_model
    a token), and the most any of them holds comes back once, while its backward runs."""
    plan = archspec.lower(archspec.load_spec(REPO / "specs" / "models" / "qwen3-next-hybrid.yaml", SMALL))
    d = plan.d_model
    plain = estimate_memory(plan, batch=2, seq_len=64, training=True)
    assert estimate_memory(plan, batch=2, seq_len=64, training=True, checkpoint_every=0) == plain
    per_token = {n: estimate_memory(plan, batch=1, seq_len=1, training=True, checkpoint_every=n).activations // 4
                 for n in (0, 1, 2, 3)}
    assert per_token[1] < per_token[2] < per_token[0] and per_token[3] < per_token[0]
    # every block checkpointed: the inputs of each and the final norm's output, and one
    # block's activations on top (more than none of them, less than all of them)
    inputs = plan.layers * 2 * d + d
    assert inputs < per_token[1] < inputs + (per_token[0] - d)


def test_huge_specs_are_priced_without_building_anything():
    plan = archspec.lower(archspec.load_spec(REPO / "specs" / "models" / "deltanet.yaml", ["mixer.heads=1e9"]))
    estimate = estimate_memory(plan, batch=8, seq_len=512, training=True)
    assert estimate.weights > 10**14 and estimate.total > estimate.weights


@pytest.mark.gpu
@pytest.mark.parametrize("name, checkpoint_every", [
    *((name, 0) for name in ("deltanet", "kda", "rwkv7", "deltaproduct-3", "osdn-apf", "qwen3-next-hybrid")),
    ("deltanet", 1), ("qwen3-next-hybrid", 1),  # every block checkpointed
])
def test_the_estimate_stays_below_a_real_training_step_on_cuda(name, checkpoint_every):
    """What `check_fits` compares on CUDA (bfloat16 activations) against the peak of an
    AdamW step on the Triton backend, as the trainer takes it (checkpointed or not): the
    second step, when AdamW's moments exist through the backward (the first step's peak
    lacks them) and the gradients were set to None after the first."""
    plan = archspec.lower(archspec.load_spec(REPO / "specs" / "models" / f"{name}.yaml"))
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    model = build_model(plan).to(device)
    model.set_activation_checkpointing(checkpoint_every)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch, seq_len = 8, 512
    ids = torch.randint(0, plan.vocab_size, (batch, seq_len), device=device)
    for _ in range(2):
        torch.cuda.reset_peak_memory_stats(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids)
        F.cross_entropy(logits.float().reshape(-1, plan.vocab_size), ids.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device) - start
    estimate = estimate_memory(plan, batch=batch, seq_len=seq_len, training=True, activation_bytes=2,
                               checkpoint_every=checkpoint_every)
    assert estimate.total <= peak <= 20 * estimate.total, (estimate, peak)  # a lower bound, not a loose one
