"""What building and training a plan needs in memory, from the plan alone (nothing built).

A lower bound, on purpose: it serves to refuse a spec that surely cannot fit before
anything is allocated (`archspec.memory`), and must never refuse one that would. It
counts

- the weights (`count_params` x bytes per weight), and when training, AdamW's two
  moments and the larger of the gradients and the activations below: the backward forms
  the gradients while it frees the activations (the trainer sets the gradients to None
  between steps), so the two need not be held at once;
- when training, one step's activations that autograd must keep for the backward, per
  token and layer: the mixer's normalised input (`d_model`; on CUDA the pre-norm keeps
  its output, which the projections keep anyway, instead of the residual stream), the
  projected streams (the stream widths once: the Triton path keeps them before their
  conv and forms the conv's output again in the recurrence's backward; twice without a
  conv, before and after the SiLU), the recurrence's output (`H V`: the output norm's
  input), RWKV-7's erase vectors and their gate (`2 n_h H K`), the decay (`H`, or `H K`
  per channel), what the recurrence keeps of each chunk (the torch backend: the state at
  its boundary, `H K V`; the Triton kernel: the inverse of its triangular system,
  `H BT x BT` for `BT` sub-steps, none for a diagonal transition; the smaller of the
  two), and the MLP's input and hidden activations (`d_model + 2 hidden`: SwiGLU's gate
  and up, whose product the fused path forms again; GELU's input and output); plus the
  final norm's output, the loss's input.
  An attention layer of a hybrid stack keeps, besides its normalised input, its queries,
  keys and values after RoPE, its output before `o_proj` and, with an output gate, the
  gate's pre-activation (`2 heads D + 2 kv_heads D`, `+ heads D`); its scores are left
  out (a flash kernel does not keep them).

With activation checkpointing every n-th block (`checkpoint_every`; `LanguageModel.
set_activation_checkpointing`), a checkpointed block keeps only its inputs (the residual
stream and the output not yet added to it, `2 d_model`), and its activations exist one
block at a time, while its backward runs: the most of them is added once.

It leaves out what a backend may avoid holding (the logits, with a fused loss; the
chunks' score matrices), the optimizer's and allocator's temporaries, and evaluation.
`tests/blocks/test_memory.py` checks the bound against the tensors autograd really saves
for every shipped design: at or below them on the torch backend (float32), and on the
Triton path under bfloat16 autocast (the CUDA training step's functions) at or below
them and within a factor of 2 of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from archspec.kernels.chunking import TRITON_CHUNK_SIZE, torch_tokens_per_chunk, triton_tokens_per_chunk

from .cost import count_params
from .mixer import stream_widths
from .mlp import mlp_hidden_size
from .plan import AttentionPlan, ModelPlan, RecurrencePlan

WEIGHT_BYTES = 4  # the modules are built in float32
OPTIMIZER_COPIES = 2  # AdamW's exp_avg and exp_avg_sq, each the weights' size


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a module needs at least; gradients, optimizer and activations are 0 when not
    training."""

    params: int  # parameter count
    weights: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        # the gradients grow in the backward as the activations are freed (module docstring)
        return self.weights + self.optimizer + max(self.gradients, self.activations)


def _recurrent_elements(m: RecurrencePlan, d: int) -> int:
    """Per token, what one recurrent layer's mixer keeps (with its normalised input)."""
    # Per chunk, the torch backend keeps the state at its boundary; the Triton kernel forms
    # the states again in its backward and keeps the inverse of each chunk's triangular
    # system (`TRITON_CHUNK_SIZE` sub-steps square), which a diagonal transition has not. A
    # lower bound must hold for either.
    delta = m.transition != "diagonal"
    torch_states = -(-m.heads * m.head_dim * m.value_dim // torch_tokens_per_chunk(m.n_h, delta=delta))
    triton_inverses = -(-m.heads * TRITON_CHUNK_SIZE**2 // triton_tokens_per_chunk(m.n_h)) if delta else 0
    per_chunk = min(torch_states, triton_inverses)
    # the streams once (the torch path keeps them after their conv too; the Triton path
    # forms the conv's output again, `kernels.Recompute`), the output norm's input; its
    # normalised rows are kept by the torch path only (the fused read-out forms them again
    # in the backward, `kernels.rms_norm_linear`)
    kept_streams = 1 if m.short_conv else 2  # without a conv, SiLU's input and output are both kept
    mixer = d + kept_streams * sum(stream_widths(m).values()) + m.heads * m.value_dim
    # what the kernel keeps besides the streams: RWKV-7's erase vectors (and the gate
    # values they are made of), the decay per head (scalar) or per key channel
    mixer += 2 * m.n_h * m.heads * m.head_dim if m.erase else 0
    mixer += {"none": 0, "scalar": m.heads, "channel": m.heads * m.head_dim}[m.gate]
    return mixer + per_chunk


def _attention_elements(a: AttentionPlan, d: int) -> int:
    """Per token, what one attention layer keeps (with its normalised input)."""
    q_and_output = 2 * a.heads * a.head_dim
    keys_and_values = 2 * a.kv_heads * a.head_dim
    gate = a.heads * a.head_dim if a.output_gate else 0
    return d + q_and_output + keys_and_values + gate


def activation_elements_per_token(plan: ModelPlan, checkpoint_every: int = 0) -> int:
    """Elements autograd must keep per token of a training step (see the module docstring),
    with every `checkpoint_every`-th block checkpointed (0: none)."""
    d = plan.d_model
    if plan.mlp == "none":
        mlp = 0
    else:
        hidden = mlp_hidden_size(plan.mlp, d, plan.mlp_ratio)
        # SwiGLU's gate and up (their product is kept by the torch path only), GELU's two
        mlp = d + 2 * hidden
    blocks = [(_attention_elements(layer, d) if isinstance(layer, AttentionPlan) else _recurrent_elements(layer, d)) + mlp
              for layer in plan.layer_plans]
    checkpointed = [checkpoint_every > 0 and i % checkpoint_every == 0 for i in range(len(blocks))]
    kept = sum(2 * d if c else block for block, c in zip(blocks, checkpointed))
    recomputed = max((block for block, c in zip(blocks, checkpointed) if c), default=0)  # one block's at a time
    return kept + recomputed + d


def estimate_memory(
    plan: ModelPlan, *, batch: int = 0, seq_len: int = 0, training: bool = False, activation_bytes: int = 4,
    checkpoint_every: int = 0,
) -> MemoryEstimate:
    """The memory a module of `plan` needs at least: its weights, or a training step on
    `[batch, seq_len]` tokens with activations of `activation_bytes` each (4 for float32,
    2 under bfloat16 autocast), every `checkpoint_every`-th block checkpointed (0: none)."""
    params = count_params(plan)
    weights = params * WEIGHT_BYTES
    if not training:
        return MemoryEstimate(params, weights, 0, 0, 0)
    activations = batch * seq_len * activation_elements_per_token(plan, checkpoint_every) * activation_bytes
    return MemoryEstimate(params, weights, weights, OPTIMIZER_COPIES * weights, activations)
