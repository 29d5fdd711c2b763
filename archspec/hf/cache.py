"""`ArchspecCache`: the decoding state of an archspec model as a transformers `Cache`.

One cache layer per model layer, each holding that layer's decoding state as the compiled
module keeps it for `LanguageModel.step`: a recurrent layer's `MixerState` (the matrix
state S, the conv tails, OSDN's d) and an attention layer's `KVCache` (keys and values at
their positions, a length per row). The wrapper hands the model exactly what it takes, and
no state is converted per token. transformers sees recurrent layers as its
linear-attention layers (`is_linear`: no keys and values per token, nothing to crop).
Beam search and `num_return_sequences` reorder, repeat and select the rows of every state
tensor.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

from archspec.blocks.attention import KVCache
from archspec.blocks.generate import map_layer

Tensor = torch.Tensor

NOT_TRANSFORMERS_STATE = ("archspec layers keep their own decoding state (ArchspecCache.store); transformers' "
                          "key/value and conv/recurrent state API is not used")


class _LayerState:
    """What both kinds of layer do with the state they hold (`state`, None before the prefill)."""

    state = None

    def store(self, state) -> None:
        self.state = state

    def lazy_initialization(self, *args, **kwargs) -> None:
        raise NotImplementedError(NOT_TRANSFORMERS_STATE)

    @property
    def is_compileable(self) -> bool:
        return False  # the state is replaced after a prefill: no fixed addresses for torch.compile

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        if self.state is None:
            return -1
        return (self.state.k if isinstance(self.state, KVCache) else self.state.recurrent).shape[0]

    def reset(self) -> None:
        self.store(None)

    def _rows(self, fn) -> None:
        if self.state is not None:
            self.state = map_layer(self.state, lambda t: fn(t).contiguous())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._rows(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an archspec model's decoding state cannot be cropped (assisted decoding rolls back)")


class RecurrentLayerCache(_LayerState, LinearAttentionCacheLayerMixin):
    """One recurrent layer's `MixerState`."""

    def __init__(self) -> None:
        LinearAttentionCacheLayerMixin.__init__(self, number_of_states=1)
        self.state = None

    def store(self, state) -> None:
        self.state = state
        self.has_previous_state[0] = state is not None

    def update_conv_state(self, *args, **kwargs) -> Tensor:
        raise NotImplementedError(NOT_TRANSFORMERS_STATE)

    def update_recurrent_state(self, *args, **kwargs) -> Tensor:
        raise NotImplementedError(NOT_TRANSFORMERS_STATE)


class AttentionLayerCache(_LayerState, CacheLayerMixin):
    """One attention layer's `KVCache`."""

    supports_early_init = False

    def __init__(self) -> None:
        CacheLayerMixin.__init__(self)
        self.state = None

    def update(self, *args, **kwargs):
        raise NotImplementedError(NOT_TRANSFORMERS_STATE)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("an archspec attention layer builds its own masks")

    def get_seq_length(self) -> int:
        return 0 if self.state is None else int(self.state.length.max())

    def get_max_length(self) -> int:
        return -1  # the buffers grow (KVCache.reserve)


class ArchspecCache(Cache):
    """Per layer the compiled model's decoding state (`kinds`: "recurrent" or "attention"
    per layer, bottom first), and the tokens seen so far."""

    def __init__(self, kinds: list[str]) -> None:
        layers = [AttentionLayerCache() if kind == "attention" else RecurrentLayerCache() for kind in kinds]
        super().__init__(layers=layers)
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

    def reserve(self, tokens: int) -> None:
        """Room in every KV cache for `tokens` more tokens per row."""
        for layer in self.layers:
            if isinstance(layer.state, KVCache):
                layer.state.reserve(tokens)

    def advance(self, new_tokens: int) -> None:
        """The states were updated in place by `new_tokens` more tokens."""
        self.seen += new_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reset(self) -> None:
        super().reset()
        self.seen = 0
