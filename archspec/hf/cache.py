"""`ArchspecCache`: the decoding state of an archspec model as a transformers `Cache`.

One cache layer per model layer, each holding that layer's own decoding state as the
compiled module keeps it (a recurrent layer's `MixerState`: the matrix state S, the conv
tails and OSDN's d), so that the wrapper hands the model exactly what `LanguageModel.step`
and `forward(state=...)` take and no state is converted per token. transformers sees
recurrent layers as its linear-attention layers (`is_linear`): no keys and values per
token, nothing to crop. Beam search and `num_return_sequences` reorder, repeat and select
rows of every state tensor.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin

Tensor = torch.Tensor

NOT_TRANSFORMERS_STATE = ("archspec layers keep their own decoding state (ArchspecCache.store); transformers' "
                          "conv/recurrent state API is not used")


def _map_state(state, fn):
    """A layer state with `fn` applied to each of its tensors (S, conv tails, d)."""
    from archspec.blocks import MixerState

    return MixerState(fn(state.recurrent), {name: fn(t) for name, t in state.conv.items()},
                      None if state.d is None else fn(state.d))


class RecurrentLayerCache(LinearAttentionCacheLayerMixin):
    """One recurrent layer's `MixerState` (None before the prefill)."""

    def __init__(self) -> None:
        super().__init__(number_of_states=1)
        self.state = None

    def lazy_initialization(self, *args, **kwargs) -> None:
        raise NotImplementedError(NOT_TRANSFORMERS_STATE)

    def update_conv_state(self, *args, **kwargs) -> Tensor:
        raise NotImplementedError(NOT_TRANSFORMERS_STATE)

    def update_recurrent_state(self, *args, **kwargs) -> Tensor:
        raise NotImplementedError(NOT_TRANSFORMERS_STATE)

    def store(self, state) -> None:
        self.state = state
        self.has_previous_state[0] = state is not None

    @property
    def is_compileable(self) -> bool:
        return False  # the state is replaced after a prefill: no fixed addresses for torch.compile

    @property
    def batch_size(self) -> int:
        return -1 if self.state is None else self.state.recurrent.shape[0]

    def reset(self) -> None:
        self.store(None)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = _map_state(self.state, lambda t: t.index_select(0, beam_idx.to(t.device)).contiguous())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state = _map_state(self.state, lambda t: t.repeat_interleave(repeats, dim=0).contiguous())

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.state is not None:
            self.state = _map_state(self.state, lambda t: t[indices].contiguous())

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a recurrent layer's state cannot be cropped: it keeps no per-token history")

    @property
    def is_croppable(self) -> bool:
        return False


class ArchspecCache(Cache):
    """Per layer the compiled model's decoding state, and the tokens seen so far."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[RecurrentLayerCache() for _ in range(num_layers)])
        self.seen = 0

    def states(self) -> list | None:
        """The per-layer states the model continues from, or None before the prefill."""
        if any(layer.state is None for layer in self.layers):
            return None
        return [layer.state for layer in self.layers]

    def store(self, states: list, new_tokens: int) -> None:
        """Keep the states after `new_tokens` more tokens (each a tensor of its own, which
        the decoding step may update in place)."""
        for layer, state in zip(self.layers, states):
            layer.store(state)
        self.seen += new_tokens

    def advance(self, new_tokens: int) -> None:
        """The states were updated in place by `new_tokens` more tokens."""
        self.seen += new_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reset(self) -> None:
        super().reset()
        self.seen = 0
