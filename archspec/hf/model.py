"""`ArchspecForCausalLM`: a compiled archspec model as a transformers causal LM.

The wrapper holds the compiled `LanguageModel` as `model` (state-dict keys `model.*`) and
adds what the ecosystem expects: a `forward(input_ids, attention_mask, cache, use_cache,
labels, logits_to_keep)` that returns `CausalLMOutputWithPast`, `generate()` through
`GenerationMixin`, `save_pretrained` / `from_pretrained` (safetensors, the spec in
`config.json`).

- Prefill (no state yet): the chunk kernel over the prompt. A left- or right-padded batch
  (`attention_mask` with zeros) runs without its padding, so each row's state is that of
  its own tokens only, as a recurrent model needs (packed with `cu_seqlens`; a stack with
  attention layers whose state is kept runs the rows of each length together); the
  padded positions' logits are those of zero rows and mean nothing.
- Decoding (a state in `cache`): one token through `LanguageModel.step` (the decoding
  step, in place on the cache's state; attention layers' KV caches grow as needed);
  several through the chunk kernel from the state, or token by token with attention
  layers.
- `labels` (aligned with `input_ids`, -100 unscored): the mean next-token cross-entropy,
  shifted inside as transformers' causal LMs do. In training mode, on a sequence without
  a state or padding, the loss is archspec's linear cross-entropy straight from the rows
  before the head and no logits are made (`logits` is None, as flash-linear-attention's
  models with a fused linear cross-entropy return it): a `[B, T, vocab]` float32 tensor,
  its softmax and its gradient are never held. In evaluation the logits come back too.
  `num_items_in_batch` (transformers' loss keyword, which its `Trainer` passes because
  `accepts_loss_kwargs`): the loss is the sum over the scored positions divided by it, the
  count over every micro-batch of an accumulated step, so that accumulated gradients are
  those of the whole batch's mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache import ArchspecCache
from .config import ArchspecConfig

Tensor = torch.Tensor
IGNORE_INDEX = -100
# KV caches made by a prefill hold this many tokens beyond the prompt before they grow
KV_HEADROOM = 256


class ArchspecForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = ArchspecConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    # `activation_checkpointing_enable()` (`gradient_checkpointing_enable()`) sets each
    # `Block`'s flag (`blocks/lm.py`); the blocks are not transformers' layer class, so its
    # `every_n_layers` does not thin them: `model.set_activation_checkpointing(n)` does.
    supports_gradient_checkpointing = True
    # `forward` divides the summed loss by `num_items_in_batch` when given: transformers'
    # Trainer then neither divides by the accumulation steps again nor averages twice
    accepts_loss_kwargs = True
    _tied_weights_keys = {"model.head.weight": "model.embed.weight"}

    def __init__(self, config: ArchspecConfig):
        super().__init__(config)
        from archspec.blocks import build_model

        self.model = build_model(config.plan())
        self.post_init()

    @property
    def layer_kinds(self) -> list[str]:
        from archspec.blocks.attention import Attention

        return ["attention" if isinstance(m, Attention) else "recurrent" for m in self.model.sequence_mixers()]

    @classmethod
    def from_archspec(cls, model, spec) -> ArchspecForCausalLM:
        """Wrap a compiled `LanguageModel` (its weights copied) with the resolved `spec` it
        was built from (a `Spec` or its document)."""
        from archspec.weights import spec_document

        wrapped = cls(ArchspecConfig(spec=spec_document(spec)))
        wrapped.model.load_state_dict(model.state_dict())
        return wrapped.to(next(model.parameters()).device)

    # archspec's constructor initialises every weight as its training does, and
    # from_pretrained overwrites them all; nothing for transformers to initialise
    def _init_weights(self, module) -> None:
        return None

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward makes its own ArchspecCache

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value) -> None:
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.head

    def set_output_embeddings(self, value) -> None:
        self.model.head = value

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: ArchspecCache | None = None,
        use_cache: bool | None = None,
        labels: Tensor | None = None,
        logits_to_keep: int = 0,
        inputs_embeds: Tensor | None = None,
        return_dict: bool | None = None,
        past_key_values: ArchspecCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("ArchspecForCausalLM takes input_ids (not inputs_embeds)")
        num_items = _items(kwargs.pop("num_items_in_batch", None))
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, ArchspecCache):
            raise ValueError(f"ArchspecForCausalLM keeps its state in an ArchspecCache, got {type(cache).__name__}")
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        kinds = self.layer_kinds
        if use_cache and cache is None:
            cache = ArchspecCache(kinds)
        state = None if cache is None else cache.states()
        B, T = input_ids.shape
        mask = None if attention_mask is None else attention_mask[:, -T:].bool()
        padded = mask is not None and not bool(mask.all())
        attention = "attention" in kinds

        if state is not None and padded:
            raise ValueError("a continuation's new tokens must all be real (attention_mask 1): padding belongs to the prompt")
        if labels is not None and self.training and state is None and not padded and not use_cache and not logits_to_keep:
            loss = self._training_loss(input_ids, labels, num_items)
            output = CausalLMOutputWithPast(loss=loss, logits=None)
            return output if return_dict is not False else output.to_tuple()
        if state is not None and (T == 1 or attention):
            cache.reserve(T)
            logits = torch.stack([self.model.step(input_ids[:, t], state) for t in range(T)], dim=1)
            cache.advance(T)
        elif use_cache and padded and attention:
            hidden, new_state = self._prefill_rows(input_ids, mask, T + KV_HEADROOM)
            cache.store(new_state, T)
            logits = self.model.head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        else:
            hidden, new_state = self._hidden(input_ids, mask if padded else None, state, use_cache)
            if use_cache:
                cache.store(self.model.decode_state(new_state, capacity=T + KV_HEADROOM), T)
            if logits_to_keep:
                hidden = hidden[:, -logits_to_keep:]
            logits = self.model.head(hidden)

        loss = None
        if labels is not None:
            if logits.shape[1] != T:
                raise ValueError("labels need the logits of every position: leave logits_to_keep at 0")
            scores = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least
            pairs = (scores.flatten(0, 1), labels[:, 1:].flatten())
            if num_items is None:
                loss = F.cross_entropy(*pairs, ignore_index=IGNORE_INDEX)
            else:
                loss = F.cross_entropy(*pairs, ignore_index=IGNORE_INDEX, reduction="sum") / max(num_items, 1)
        output = CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)
        return output if return_dict is not False else output.to_tuple()

    def _training_loss(self, input_ids: Tensor, labels: Tensor, num_items: int | None = None) -> Tensor:
        """The mean next-token loss without logits (`blocks/loss.py`): position t predicts
        `labels[:, t + 1]`; the ids and the shifted labels are checked and counted in one
        host read before the first layer, as `LanguageModel.forward` does. With `num_items`
        the summed loss is divided by it instead of by this batch's count."""
        from archspec.blocks.loss import checked_scored_labels, next_token_loss

        if labels.shape != input_ids.shape:
            raise ValueError(f"labels must be input_ids' shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
        scored = checked_scored_labels(input_ids, shifted, self.model.plan.vocab_size)
        hidden, _ = self.model.hidden_states(input_ids)
        return next_token_loss(hidden, self.model.head.weight, shifted, backend=self.model.fused_backend,
                               scored_rows=scored if num_items is None else num_items)

    def _prefill_rows(self, input_ids: Tensor, mask: Tensor, capacity: int) -> tuple[Tensor, list]:
        """A padded batch through `blocks.generate.prefill`: each row's real tokens as a
        prompt of its own, the rows before the head scattered back to their positions."""
        from archspec.blocks.generate import prefill

        if not bool(mask.any(1).all()):
            raise ValueError("attention_mask: every row needs at least one real token")
        rows, state = prefill(self.model, [ids[keep] for ids, keep in zip(input_ids, mask)], capacity)
        hidden = rows[0].new_zeros(*input_ids.shape, rows[0].shape[-1])
        hidden[mask] = torch.cat(rows)
        return hidden, state

    def _hidden(self, input_ids: Tensor, mask: Tensor | None, state, use_cache: bool) -> tuple[Tensor, list]:
        """The rows before the head `[B, T, d]` and the state after each row's last real token."""
        if mask is None:
            return self.model.hidden_states(input_ids, state, return_state=use_cache)
        # Pack each row's real tokens as one document: the recurrence never reads a pad.
        lengths = mask.sum(1)
        if bool((lengths == 0).any()):
            raise ValueError("attention_mask: every row needs at least one real token")
        offsets = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        hidden, new_state = self.model.hidden_states(input_ids[mask][None], None, return_state=use_cache,
                                                     cu_seqlens=offsets)
        out = hidden.new_zeros(*input_ids.shape, hidden.shape[-1])
        out[mask] = hidden[0]
        return out, new_state


def _items(num_items_in_batch) -> int | None:
    """transformers' `num_items_in_batch` (an int or a one-element tensor) as an int."""
    if num_items_in_batch is None:
        return None
    count = int(num_items_in_batch)
    if count < 0:
        raise ValueError(f"num_items_in_batch must be >= 0, got {count}")
    return count
