"""Generation: a prefill through the chunk kernel, then one decoding step per token.

`generate(model, input_ids, max_new_tokens, temperature, top_k, top_p, eos)`:

1. Prefill: the prompts run through `LanguageModel.hidden_states` with the state returned
   (the chunk kernel); prompts of different lengths are packed in one row (`cu_seqlens`),
   so each starts from zeros and none sees another, and the state has one row per prompt.
   A stack with attention layers runs the prompts of each length together instead
   (attention keeps no state for packed documents) and their attention states become
   `KVCache`s of one capacity, rows of different lengths side by side. The head reads
   each prompt's last token only.
2. Decode: `LanguageModel.step` advances every row by one token in place on the state
   (`Mixer.step`: one product for the token's projections with the pre-norm in front,
   the streams' conv in one launch, one `kernels.decode_step`, `o_proj` with the output
   norm in front; `Attention.step`: the token's key and value written at the row's
   position). On CUDA the whole step is captured once in a CUDA graph and replayed per
   token: a step is about 50 small launches, and launching them one by one from Python
   would cost more than running them. The graph reads the joined weight copies
   (`joined.py`), brought up to date before every call.
3. Sampling between steps, outside the graph: greedy at `temperature = 0`, else softmax
   of `logits / temperature` over the `top_k` most likely tokens and the smallest set
   whose probability reaches `top_p` (nucleus), drawn with `generator`. A row that
   produced an `eos` token is finished: it keeps emitting its first `eos` id, and the
   loop ends once every row has finished.

Every decoded token equals what `forward` over the prompt and the tokens so far gives
(tests/blocks/test_generate.py): the step and the chunk kernel compute one recurrence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

# Steps run on a scratch state before capture: the kernels compile and the allocator
# settles outside the graph.
WARMUP_STEPS = 2
# Captured decode steps kept per model (one per batch size, device and KV-cache size),
# oldest dropped.
MAX_CAPTURED = 4
# KV caches hold a multiple of this many tokens, so that a graph captured for one call
# serves the next calls of similar lengths.
CAPACITY_STEP = 256


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits."""

    temperature: float = 1.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None

    def check(self, vocab_size: int) -> None:
        problems = []
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            problems.append(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1):
            problems.append(f"top_k must be a positive int or None, got {self.top_k!r}")
        if self.top_p is not None and not (0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1] or None, got {self.top_p}")
        if problems:
            raise ValueError("generate: " + "; ".join(problems))


def sample(logits: Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> Tensor:
    """The next token of each row of `logits` `[B, vocab]`: `[B]` (long)."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    scores = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # drop a token when the more likely ones before it already reach top_p (the most
        # likely token always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= sampling.top_p
        scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _prompts(input_ids: Tensor | Sequence, vocab_size: int, device: torch.device) -> tuple[list[Tensor], bool]:
    """The prompts as 1-D long tensors on `device`, and whether they came as one `[B, T]` tensor."""
    if isinstance(input_ids, Tensor):
        if input_ids.dim() != 2 or input_ids.shape[1] == 0 or input_ids.dtype.is_floating_point:
            raise ValueError(f"generate: input_ids must be a [B, T] integer tensor with T >= 1, got "
                             f"{tuple(input_ids.shape)} {input_ids.dtype}")
        prompts, as_tensor = list(input_ids.to(device)), True
    else:
        prompts, as_tensor = [torch.as_tensor(p, device=device) for p in input_ids], False
        if not prompts:
            raise ValueError("generate: no prompts given")
        for i, p in enumerate(prompts):
            if p.dim() != 1 or p.numel() == 0 or p.dtype.is_floating_point:
                raise ValueError(f"generate: prompt {i} must be a non-empty 1-D sequence of token ids, got "
                                 f"shape {tuple(p.shape)} {p.dtype}")
    prompts = [p.long() for p in prompts]
    lowest, highest = min(int(p.min()) for p in prompts), max(int(p.max()) for p in prompts)
    if lowest < 0 or highest >= vocab_size:
        raise ValueError(f"generate: token ids must lie in [0, {vocab_size}), got {lowest} .. {highest}")
    return prompts, as_tensor


def has_attention(model) -> bool:
    from .attention import Attention

    return any(isinstance(m, Attention) for m in model.sequence_mixers())


def kv_capacity(tokens: int) -> int:
    """The KV-cache size for `tokens` tokens per row: the next multiple of `CAPACITY_STEP`."""
    return -(-tokens // CAPACITY_STEP) * CAPACITY_STEP


def prefill(model, prompts: list[Tensor], capacity: int | None = None) -> tuple[list[Tensor], list]:
    """Run the prompts through the chunk kernel: each prompt's rows before the head
    (`[L_i, d_model]`) and the decoding state, one row per prompt in order (attention
    layers' as `KVCache`s of `capacity` tokens)."""
    lengths = [p.numel() for p in prompts]
    if not has_attention(model):
        if len(set(lengths)) == 1:
            hidden, state = model.hidden_states(torch.stack(prompts), return_state=True)
            return list(hidden), model.decode_state(state)
        offsets = torch.tensor([0, *lengths], device=prompts[0].device).cumsum(0)
        hidden, state = model.hidden_states(torch.cat(prompts)[None], return_state=True, cu_seqlens=offsets)
        return list(hidden[0].split(lengths)), model.decode_state(state)
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    rows: list[Tensor] = [prompts[0]] * len(prompts)
    parts, order = [], []
    for members in groups.values():
        hidden, state = model.hidden_states(torch.stack([prompts[i] for i in members]), return_state=True)
        parts.append(model.decode_state(state, capacity))
        for j, i in enumerate(members):
            rows[i] = hidden[j]
        order += members
    state = concat_rows(parts)
    if order != sorted(order):
        state = select_rows(state, torch.tensor(order, device=prompts[0].device).argsort())
    return rows, state


def map_layer(layer, fn):
    """A decoding state of one layer with `fn` applied to each of its tensors."""
    from .attention import KVCache
    from .mixer import MixerState, join_tails

    if isinstance(layer, KVCache):
        return KVCache(fn(layer.k), fn(layer.v), fn(layer.length))
    mapped = MixerState(fn(layer.recurrent), {n: fn(t) for n, t in layer.conv.items()},
                        None if layer.d is None else fn(layer.d))
    return join_tails(mapped)  # `fn` made new tensors: only the conv tails are joined again


def layer_tensors(layer) -> list[Tensor]:
    """A layer's decoding-state tensors, in the order `map_layer` visits them."""
    from .attention import KVCache

    if isinstance(layer, KVCache):
        return [layer.k, layer.v, layer.length]
    return [layer.recurrent, *layer.conv.values(), *([] if layer.d is None else [layer.d])]


def select_rows(state: list, index: Tensor) -> list:
    """The decoding state of the rows `index` (contiguous copies)."""
    return [map_layer(layer, lambda t: t[index].contiguous()) for layer in state]


def concat_rows(parts: list[list]) -> list:
    """The decoding states of several batches as one, rows one after another."""
    if len(parts) == 1:
        return parts[0]
    merged = []
    for layers in zip(*parts):
        pieces = [layer_tensors(layer) for layer in layers]
        joined = iter([torch.cat(ts) for ts in zip(*pieces)])
        merged.append(map_layer(layers[0], lambda t: next(joined)))
    return merged


class CapturedStep:
    """`model.step` captured in a CUDA graph on buffers of its own: `__call__(tokens)`
    copies the tokens in, replays the graph and returns the logits buffer. The state it
    advances is `self.state`; `load(state)` copies a prefill's state into it."""

    def __init__(self, model, state: list):
        self.state = state
        first = layer_tensors(state[0])[0]
        batch, device = first.shape[0], first.device
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        scratch = model.decode_state(state)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_STEPS):
                model.step(self.tokens, scratch)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model.step(self.tokens, self.state)

    def load(self, state: list) -> None:
        for mine, theirs in zip(self.state, state):
            for buffer, value in zip(layer_tensors(mine), layer_tensors(theirs)):
                buffer.copy_(value)

    def __call__(self, tokens: Tensor) -> Tensor:
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits


def _captured_step(model, state: list) -> CapturedStep:
    """The model's captured step for this batch, made on first use and kept: the key holds
    the parameters' storage, so a model moved or cast since is captured afresh."""
    buffers = [t for layer in state for t in layer_tensors(layer)]
    key = (str(buffers[0].device), tuple(p.data_ptr() for p in model.parameters()),
           tuple((tuple(t.shape), t.dtype) for t in buffers))
    cache: dict = model.__dict__.setdefault("_captured_steps", {})
    if key not in cache:
        while len(cache) >= MAX_CAPTURED:
            cache.pop(next(iter(cache)))
        cache[key] = CapturedStep(model, model.decode_state(state))
    captured = cache[key]
    model.refresh_step_weights()  # the joined weights the graph reads, if a weight changed since
    captured.load(state)
    return captured


def _eos_ids(eos: int | Sequence[int] | None, vocab_size: int, device: torch.device) -> Tensor | None:
    if eos is None:
        return None
    ids = [eos] if isinstance(eos, int) else list(eos)
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size for i in ids):
        raise ValueError(f"generate: eos must be a token id or a list of them in [0, {vocab_size}), got {eos!r}")
    return torch.tensor(ids, device=device)


@torch.no_grad()
def generate(
    model,
    input_ids: Tensor | Sequence,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos: int | Sequence[int] | None = None,
    *,
    generator: torch.Generator | None = None,
    cuda_graph: bool | None = None,
) -> Tensor | list[Tensor]:
    """Continue each prompt by up to `max_new_tokens` sampled tokens.

    `input_ids`: a `[B, T]` tensor (returns `[B, T + n]`, `n` the steps taken; a row that
    finished early is filled with its first `eos` id), or a list of prompts of different
    lengths (1-D tensors or lists of ids; returns a list of 1-D tensors, each its prompt
    and continuation up to and including its `eos`). `cuda_graph` (default: on CUDA)
    replays the decoding step from a CUDA graph. The model runs in eval mode.
    """
    plan = model.plan
    device = model.embed.weight.device
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    sampling = Sampling(temperature, top_k, top_p)
    sampling.check(plan.vocab_size)
    eos_ids = _eos_ids(eos, plan.vocab_size, device)
    prompts, as_tensor = _prompts(input_ids, plan.vocab_size, device)
    if cuda_graph is None:
        cuda_graph = device.type == "cuda"
    if cuda_graph and device.type != "cuda":
        raise ValueError("generate: cuda_graph=True needs the model on a CUDA device")

    was_training = model.training
    model.eval()
    try:
        capacity = kv_capacity(max(p.numel() for p in prompts) + max_new_tokens)
        hidden, state = prefill(model, prompts, capacity)
        logits = model.head(torch.stack([h[-1] for h in hidden]))
        rows = len(prompts)
        new = torch.empty(rows, max_new_tokens, dtype=torch.long, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        step = None
        steps = 0
        for i in range(max_new_tokens):
            token = sample(logits, sampling, generator)
            if eos_ids is not None:
                token = torch.where(finished, eos_ids[0], token)
                finished |= torch.isin(token, eos_ids)
            new[:, i] = token
            steps = i + 1
            if i + 1 == max_new_tokens or (eos_ids is not None and bool(finished.all())):
                break
            if step is None:  # after the first token: a prompt of one sampled token needs no step
                step = _captured_step(model, state) if cuda_graph else _eager_step(model, state)
            logits = step(token)
    finally:
        model.train(was_training)

    new = new[:, :steps]
    if as_tensor:
        return torch.cat([torch.stack(prompts), new], dim=1)
    out = []
    for prompt, row in zip(prompts, new):
        if eos_ids is not None:
            hits = torch.isin(row, eos_ids).nonzero()
            if hits.numel():
                row = row[: int(hits[0]) + 1]
        out.append(torch.cat([prompt, row]))
    return out


def _eager_step(model, state: list):
    def step(tokens: Tensor) -> Tensor:
        return model.step(tokens, state)

    return step
