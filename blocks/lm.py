"""The language model: embedding, N pre-norm blocks (mixer + MLP), final norm, head.

`x = x + mixer(RMSNorm(x))`, then `x = x + mlp(RMSNorm(x))` (no MLP sub-block when the
plan says `mlp: none`), as in nanoGPT and fla's models. The decoding state is one
`MixerState` per layer; `forward(ids, state)` continues the sequences that `state`
describes, so prefill and token-by-token generation are the same call.

Initialisation (nanoGPT / fla): every linear and embedding weight ~ N(0, 0.02); the
projections that write into the residual stream (`o_proj`, `down_proj`) are scaled by
1/sqrt(2 * layers) so the residual's variance does not grow with depth. Biases and the
gates' own parameters (A_log, dt_bias, the APF bias, d_0) keep the values their modules
set; the short convs keep PyTorch's default.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .mixer import Mixer, MixerState
from .mlp import MLP
from .plan import ModelPlan

Tensor = torch.Tensor

INIT_STD = 0.02
RESIDUAL_OUTPUTS = ("o_proj", "down_proj")


class Block(nn.Module):
    def __init__(self, plan: ModelPlan):
        super().__init__()
        self.mixer_norm = nn.RMSNorm(plan.d_model, eps=plan.norm_eps)
        self.mixer = Mixer(plan.mixer, plan.d_model, norm_eps=plan.norm_eps)
        self.mlp_norm = nn.RMSNorm(plan.d_model, eps=plan.norm_eps) if plan.mlp != "none" else None
        self.mlp = MLP(plan.mlp, plan.d_model, plan.mlp_ratio) if plan.mlp != "none" else None

    def forward(self, x: Tensor, state: MixerState | None, return_state: bool) -> tuple[Tensor, MixerState | None]:
        h, state = self.mixer(self.mixer_norm(x), state, return_state)
        x = x + h
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x))
        return x, state


class LanguageModel(nn.Module):
    def __init__(self, plan: ModelPlan):
        super().__init__()
        self.plan = plan
        self.embed = nn.Embedding(plan.vocab_size, plan.d_model)
        self.blocks = nn.ModuleList(Block(plan) for _ in range(plan.layers))
        self.norm = nn.RMSNorm(plan.d_model, eps=plan.norm_eps)
        self.head = nn.Linear(plan.d_model, plan.vocab_size, bias=False)
        self._init_weights()
        if plan.tie_embeddings:
            self.head.weight = self.embed.weight

    def _init_weights(self) -> None:
        residual_std = INIT_STD / math.sqrt(2 * self.plan.layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.rsplit(".", 1)[-1] in RESIDUAL_OUTPUTS else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)

    def mixers(self) -> list[Mixer]:
        return [block.mixer for block in self.blocks]

    def set_backend(self, name: str) -> None:
        """Run every mixer's recurrence on `name` (`naive`, `torch`, `triton`, `auto`)."""
        for mixer in self.mixers():
            mixer.backend = name

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> list[MixerState]:
        return [mixer.init_state(batch_size, device) for mixer in self.mixers()]

    def forward(
        self, input_ids: Tensor, state: list[MixerState] | None = None, return_state: bool = False
    ) -> Tensor | tuple[Tensor, list[MixerState]]:
        """Logits `[B, T, vocab]`, and the state after the last token if `return_state`."""
        x = self.embed(input_ids)
        new_state = []
        for i, block in enumerate(self.blocks):
            x, layer_state = block(x, None if state is None else state[i], return_state)
            new_state.append(layer_state)
        logits = self.head(self.norm(x))
        return (logits, new_state) if return_state else logits
