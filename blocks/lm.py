"""The language model: embedding, N pre-norm blocks (mixer + MLP), final norm, head.

`x = x + mixer(RMSNorm(x))`, then `x = x + mlp(RMSNorm(x))` (no MLP sub-block when the
plan says `mlp: none`), as in nanoGPT and fla's models. Each block's sequence mixer is
its layer plan's: a recurrent `Mixer` or an `Attention` layer (a hybrid stack). The
decoding state is one state per layer (`MixerState` or `AttentionState`);
`forward(ids, state)` continues the sequences that `state` describes, so prefill and
token-by-token generation are the same call.

Generation: `generate(...)` (`generate.py`) prefills through `forward` and then decodes
with `step`, one token for every row in place on the state (`Mixer.step`: one decoding
launch per recurrent layer; `Attention.step`: a fixed-size `KVCache`), captured in a CUDA
graph on CUDA.

Training: `forward(ids, labels=labels)` returns the mean next-token loss without making
the logits (`loss.py`); `cu_seqlens` packs documents in one row (B = 1) so that none sees
another, each as if it ran alone. Activation checkpointing (`set_activation_checkpointing`,
or transformers' `activation_checkpointing_enable()` on the HF wrapper, which sets the same
flag on each block) keeps only a checkpointed block's inputs (the float32 residual stream
and the output not yet added to it) and runs its forward again in the backward: one more
forward of the block for a step that holds one block's activations at a time.

Initialisation (nanoGPT / fla): every linear and embedding weight ~ N(0, 0.02); the
projections that write into the residual stream (`o_proj`, `down_proj`) are scaled by
1/sqrt(2 * layers) so the residual's variance does not grow with depth. Biases and the
gates' own parameters (A_log, dt_bias, RWKV-7's w0 with its depth-dependent speeds, the
APF bias, d_0) keep the values their modules set; the short convs keep PyTorch's default.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.utils.checkpoint

from archspec.kernels.packed import check_offsets
from archspec.kernels.row_linear import row_linear

from .attention import Attention, AttentionState, KVCache
from .joined import JoinedWeights
from .loss import checked_scored_labels, next_token_loss
from .mixer import Mixer, MixerState, decode_state
from .mlp import MLP
from .norm import RMSNorm
from .plan import AttentionPlan, LayerPlan, ModelPlan

Tensor = torch.Tensor
LayerState = MixerState | AttentionState
DecodeState = MixerState | KVCache  # what `step` advances in place, per layer

INIT_STD = 0.02
RESIDUAL_OUTPUTS = ("o_proj", "down_proj")
# How a checkpointed block runs: torch's non-reentrant checkpoint (the saved tensors
# dropped in the forward and formed again, through the same autograd functions, in the
# backward). transformers sets its own through `_gradient_checkpointing_func`.
CHECKPOINT = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def init_weights(root: nn.Module, layers: int) -> None:
    """The LM's initialisation (module docstring) of every linear and embedding weight in
    `root`, a stack of `layers` blocks: N(0, INIT_STD), the residual outputs scaled down."""
    residual_std = INIT_STD / math.sqrt(2 * layers)
    for name, module in root.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = residual_std if name.rsplit(".", 1)[-1] in RESIDUAL_OUTPUTS else INIT_STD
            nn.init.normal_(module.weight, mean=0.0, std=std)


def sequence_mixer(layer: LayerPlan, d_model: int, norm_eps: float, depth: float = 0.5) -> Mixer | Attention:
    """The module of one layer plan; `depth` its place in the stack (0 first, 1 last)."""
    if isinstance(layer, AttentionPlan):
        return Attention(layer, d_model, norm_eps=norm_eps)
    return Mixer(layer, d_model, norm_eps=norm_eps, depth=depth)


class Block(nn.Module):
    def __init__(self, plan: ModelPlan, layer: LayerPlan | None = None, depth: float = 0.5):
        super().__init__()
        self.mixer_norm = RMSNorm(plan.d_model, eps=plan.norm_eps)
        # `mixer` is the block's sequence mixer, recurrent or attention (one name, so
        # that state-dict keys do not depend on the layer kind's spelling)
        self.mixer = sequence_mixer(plan.mixer if layer is None else layer, plan.d_model, plan.norm_eps, depth)
        self.mlp_norm = RMSNorm(plan.d_model, eps=plan.norm_eps) if plan.mlp != "none" else None
        self.mlp = MLP(plan.mlp, plan.d_model, plan.mlp_ratio) if plan.mlp != "none" else None
        # Activation checkpointing of this block in training (the names transformers sets).
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func = CHECKPOINT

    def forward(self, x: Tensor, state: LayerState | None, return_state: bool, cu_seqlens: Tensor | None = None,
                pending: Tensor | None = None) -> tuple[Tensor, Tensor, LayerState | None]:
        """(residual stream, this block's last output, layer state). `pending` is the block
        before's last output, not yet added to the stream `x`: every addition to the stream
        is fused into the norm that reads the sum (`RMSNorm.add`), as fla's models do, so
        the caller adds the returned output with its next norm."""
        y, x = self.mixer_norm.add(x, pending)
        h, state = self.mixer(y, state, return_state, cu_seqlens=cu_seqlens)
        if self.mlp is None:
            return x, h, state
        y, x = self.mlp_norm.add(x, h)
        return x, self.mlp(y), state

    def step(self, x: Tensor, state: DecodeState, pending: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One token `[B, 1, d_model]`, the layer's state updated in place: `forward`'s
        (residual stream, this block's last output) of a one-token piece. Each norm and the
        addition before it run in front of the first product that reads them
        (`kernels.row_linear`); an attention layer takes its normalised row."""
        if isinstance(self.mixer, Mixer):
            h, x = self.mixer.step(x, state, pre_norm=self.mixer_norm.pending(pending))
        else:
            y, x = self.mixer_norm.add(x, pending)
            h = self.mixer.step(y, state)
        if self.mlp is None:
            return x, h
        y, x = self.mlp.step(x, pre_norm=self.mlp_norm.pending(h))
        return x, y


class LanguageModel(nn.Module):
    def __init__(self, plan: ModelPlan):
        super().__init__()
        self.plan = plan
        self.embed = nn.Embedding(plan.vocab_size, plan.d_model)
        last = max(plan.layers - 1, 1)
        self.blocks = nn.ModuleList(Block(plan, layer, depth=i / last) for i, layer in enumerate(plan.layer_plans))
        self.norm = RMSNorm(plan.d_model, eps=plan.norm_eps)
        self.head = nn.Linear(plan.d_model, plan.vocab_size, bias=False)
        self.fused_backend = "auto"  # the loss's path; `set_backend` changes it
        self._init_weights()
        if plan.tie_embeddings:
            self.head.weight = self.embed.weight

    def _init_weights(self) -> None:
        init_weights(self, self.plan.layers)

    def sequence_mixers(self) -> list[Mixer | Attention]:
        """Each layer's sequence mixer, bottom first: a `Mixer` or an `Attention`."""
        return [block.mixer for block in self.blocks]

    def mixers(self) -> list[Mixer]:
        """The recurrent layers' mixers, bottom first (attention layers left out)."""
        return [m for m in self.sequence_mixers() if isinstance(m, Mixer)]

    def recurrent_layers(self) -> list[int]:
        """The indices of the recurrent layers, in the order of `mixers()`."""
        return [i for i, m in enumerate(self.sequence_mixers()) if isinstance(m, Mixer)]

    def set_backend(self, name: str) -> None:
        """Run every mixer's recurrence on `name` (`naive`, `torch`, `triton`, `auto`), and
        the fused norms, convs and loss on its torch or Triton path (`naive`: torch)."""
        for mixer in self.mixers():
            mixer.backend = name
        fused = {"naive": "torch"}.get(name, name)
        for module in self.modules():
            if hasattr(module, "fused_backend"):
                module.fused_backend = fused
        self.fused_backend = fused

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> list[LayerState]:
        return [mixer.init_state(batch_size, device) for mixer in self.sequence_mixers()]

    def forward(
        self,
        input_ids: Tensor,
        state: list[LayerState] | None = None,
        return_state: bool = False,
        *,
        labels: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        scored_labels: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, list[LayerState]]:
        """Logits `[B, T, vocab]`, or with `labels` the mean next-token loss (a scalar; the
        logits are never made); and the state after the last token if `return_state`.

        `labels` `[B, T]`: what each position should predict (already shifted), or
        `IGNORE_INDEX` (-100) where nothing is scored. `cu_seqlens` (`[N+1]` token offsets,
        B = 1) packs N documents in the row: each starts from its own state (`state` with N
        rows) or from zeros, and the returned state has one row per document (recurrent
        layers only: an attention layer takes packed documents without a state).

        `scored_labels`: how many labels are scored, a 0-dim integer tensor on the model's
        device, from a caller that has checked the ids and labels itself
        (`checked_scored_labels`), so that the step reads nothing on the host at all (a
        captured CUDA graph, `archspec.graphed_step`, may not).
        """
        # Checked before the first kernel is queued (`blocks/loss.py`): the loss then reads nothing on the host.
        if scored_labels is not None and labels is None:
            raise ValueError("scored_labels counts the scored labels: pass labels with it")
        scored = scored_labels if scored_labels is not None or labels is None else checked_scored_labels(
            input_ids, labels, self.plan.vocab_size)
        x, new_state = self.hidden_states(input_ids, state, return_state, cu_seqlens=cu_seqlens)
        if labels is None:
            out = self.head(x)
        else:
            out = next_token_loss(x, self.head.weight, labels, backend=self.fused_backend, scored_rows=scored)
        return (out, new_state) if return_state else out

    def hidden_states(
        self, input_ids: Tensor, state: list[LayerState] | None = None, return_state: bool = False, *,
        cu_seqlens: Tensor | None = None,
    ) -> tuple[Tensor, list[LayerState]]:
        """`forward` up to the final norm: the rows the head reads `[B, T, d_model]`, and the
        per-layer states (None each unless `return_state`). Generation reads the head at a
        prompt's last token only."""
        if cu_seqlens is not None:
            _check_packed(input_ids, cu_seqlens)
        x, pending = self.embed(input_ids), None
        new_state = []
        recording = self.training and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            inputs = (x, None if state is None else state[i], return_state, cu_seqlens, pending)
            if recording and block.gradient_checkpointing:
                x, pending, layer_state = block._gradient_checkpointing_func(block.__call__, *inputs)
            else:
                x, pending, layer_state = block(*inputs)
            new_state.append(layer_state)
        return self.norm.add(x, pending)[0], new_state

    def set_activation_checkpointing(self, every_n_layers: int = 1) -> None:
        """Checkpoint every `every_n_layers`-th block in training (the first, then every
        n-th after it; 1: every block, 0: none): its activations are formed again in the
        backward instead of kept (module docstring)."""
        if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 0:
            raise ValueError(f"every_n_layers must be an integer >= 0 (0: no checkpointing), got {every_n_layers!r}")
        for i, block in enumerate(self.blocks):
            block.gradient_checkpointing = every_n_layers > 0 and i % every_n_layers == 0
            block._gradient_checkpointing_func = CHECKPOINT

    def decode_state(self, state: list, capacity: int | None = None) -> list[DecodeState]:
        """A copy of `state` that `step` updates in place (tensors of its own, contiguous):
        a recurrent layer's `MixerState` as it is, an attention layer's as a `KVCache` of
        `capacity` tokens per row (needed when the stack has attention layers)."""
        return [mixer.decode_state(layer, capacity) if isinstance(mixer, Attention) else decode_state(layer)
                for mixer, layer in zip(self.sequence_mixers(), state)]

    def refresh_step_weights(self) -> None:
        """Bring the decoding step's joined weight copies (`joined.py`) up to the
        parameters now; a captured step graph reads them without Python running."""
        for module in self.modules():
            for value in vars(module).values():
                if isinstance(value, JoinedWeights):
                    value.current()

    @torch.no_grad()
    def step(self, tokens: Tensor, state: list[DecodeState]) -> Tensor:
        """Decode one token for every row: `tokens` `[B]` -> next-token logits `[B, vocab]`,
        `state` (from `decode_state`) advanced in place. Equal to `forward` of the one-token
        piece; on fixed buffers, so that a CUDA graph can capture it."""
        x, pending = self.embed(tokens[:, None]), None
        for block, layer_state in zip(self.blocks, state):
            x, pending = block.step(x, layer_state, pending)
        logits, _ = row_linear(x, self.head.weight, before=self.norm.pending(pending), backend=self.fused_backend)
        return logits[:, 0]

    def generate(self, input_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos: int | list[int] | None = None, **options):
        """Sample continuations of prompts; see `blocks.generate.generate` (`input_ids` a
        `[B, T]` tensor, or a list of prompts of different lengths, packed for the prefill)."""
        from .generate import generate

        return generate(self, input_ids, max_new_tokens, temperature, top_k, top_p, eos, **options)


def _check_packed(input_ids: Tensor, cu_seqlens: Tensor) -> None:
    B, T = input_ids.shape
    if B != 1:
        raise ValueError(f"cu_seqlens packs documents in one row: input_ids must be [1, T], got {tuple(input_ids.shape)}")
    check_offsets(cu_seqlens, T, "LanguageModel")  # reads the offsets once for every layer
