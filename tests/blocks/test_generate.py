"""Generation: a prefill through the chunk path and then decoding steps equal the forward
over the whole sequence, for every plan (float64 to 1e-10, float32 to 1e-5); greedy
generation picks the argmax of that forward at every position; prompts of different
lengths, packed for the prefill, continue as if each ran alone; sampling draws from the
truncated softmax; eos ends a row; the CUDA graph replays the eager step (GPU-marked).
"""

from __future__ import annotations

import copy

import pytest
import torch

from archspec.blocks import build_model
from archspec.blocks.attention import KVCache
from archspec.blocks.generate import Sampling, sample
from archspec.blocks.plan import AttentionPlan, ModelPlan

from .plans import COMBINATIONS, _osdn, mixer_plan, model_plan

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
VOCAB = 13


# Hybrid stacks: attention with RoPE and a window shorter than the prompts, GQA with an
# output gate, qk-norm, NoPE with one key/value head, beside recurrent layers (OSDN too).
HYBRIDS = {
    "hybrid-window": (mixer_plan("gdn", "scalar", n_h=2, beta_scale=2.0),
                      AttentionPlan(heads=4, kv_heads=2, head_dim=4, window=3, output_gate=True),
                      mixer_plan("kda", "channel"), AttentionPlan(heads=2, kv_heads=2, head_dim=4, qk_norm=True)),
    "hybrid-nope-osdn": (AttentionPlan(heads=4, kv_heads=1, head_dim=6, rope_theta=None),
                         mixer_plan("deltanet", "none", n_h=2, osdn=_osdn(apf=True))),
}


def _plan(name: str) -> ModelPlan:
    if name in HYBRIDS:
        stack = HYBRIDS[name]
        recurrent = next(p for p in stack if not isinstance(p, AttentionPlan))
        return ModelPlan(name=name, mixer=recurrent, d_model=16, layers=len(stack), mlp="swiglu", vocab_size=VOCAB,
                         stack=stack)
    return model_plan(COMBINATIONS[name], layers=2, vocab_size=VOCAB)


def _model(name: str, dtype: torch.dtype = torch.float64, backend: str = "torch", device: str = "cpu", seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(_plan(name)).to(device, dtype)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "d0_delta" in pname or "retain_proj.bias" in pname:  # move the trivial initial values
                p.add_(0.5 * torch.randn_like(p) - (3.0 if "retain" in pname else 0.0))
            elif p.dim() >= 2:
                p.mul_(10.0)  # weights far from the 0.02 init, so that logits and states are not tiny
    model.set_backend(backend)
    return model.eval()


def _prefill_then_steps(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits at every position: the prompt's from the prefill's hidden rows, then one step
    per further token (teacher-forced)."""
    with torch.no_grad():
        hidden, state = model.hidden_states(ids[:, :prefill], return_state=True)
        logits = [model.head(hidden)]
        state = model.decode_state(state, capacity=ids.shape[1])
        for t in range(prefill, ids.shape[1]):
            logits.append(model.step(ids[:, t], state)[:, None])
    return torch.cat(logits, dim=1)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max error {err:.2e} at scale {scale:.2f}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", [*COMBINATIONS, *HYBRIDS])
def test_prefill_and_steps_equal_the_forward(name, dtype):
    model = _model(name, dtype)
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
    _close(_prefill_then_steps(model, ids, 6), want, dtype)


def test_the_step_on_triton_equals_the_forward():
    """The Triton decoding step (the interpreter on the CPU) inside the model."""
    pytest.importorskip("triton")
    model = _model("osgdn-apf-learned", torch.float64, backend="triton", device="cuda" if CUDA else "cpu")
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2)).to(model.embed.weight.device)
    with torch.no_grad():
        want = model(ids)
    _close(_prefill_then_steps(model, ids, 5), want, torch.float64)


@pytest.mark.parametrize("name", ["kda-channel", "osgdn-apf-learned", "rwkv7-nh2-b2-channel"])
def test_the_step_follows_weights_changed_after_it_ran(name):
    """The step reads its projections from joined copies (`blocks/joined.py`); after it ran,
    an optimizer step and then `load_state_dict` change every weight in place, and the
    steps still equal the forward of the weights now."""
    model = _model(name)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _close(_prefill_then_steps(model, ids, 5), model(ids), torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(ids, labels=ids).backward()
    optimizer.step()
    with torch.no_grad():
        _close(_prefill_then_steps(model, ids, 5), model(ids), torch.float64)
    model.load_state_dict(_model(name, seed=7).state_dict())
    with torch.no_grad():
        _close(_prefill_then_steps(model, ids, 5), model(ids), torch.float64)


def test_refresh_brings_every_joined_copy_up_to_date():
    """What a captured graph relies on: `refresh_step_weights` copies changed weights into
    the joined buffers in place (the graph keeps reading the same memory)."""
    from archspec.blocks.joined import JoinedWeights

    model = _model("oskda-betafree-nh2")
    model.refresh_step_weights()
    joined = [v for m in model.modules() for v in vars(m).values() if isinstance(v, JoinedWeights)]
    assert len(joined) == 2 * 2 + 2  # per layer: the mixer's inputs and conv, the MLP's gate-up
    buffers = [w._weight.data_ptr() for w in joined]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.refresh_step_weights()
    for w, ptr in zip(joined, buffers):
        want = torch.cat([m.weight.reshape(m.weight.shape[0], -1) for m in w.modules])
        assert w._weight.data_ptr() == ptr and torch.equal(w._weight, want)


@pytest.mark.parametrize("name", ["gdn-scalar", "rwkv7-nh2-b2-channel", "osdn-apf-nh2"])
def test_greedy_generation_is_the_argmax_of_the_forward(name):
    model = _model(name)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    out = model.generate(prompt, 6, temperature=0)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)
    with torch.no_grad():
        logits = model(out)
    assert torch.equal(out[:, 5:], logits[:, 4:-1].argmax(-1))
    assert model.training is False


@pytest.mark.parametrize("name", ["oskda-betafree-nh2", *HYBRIDS])
def test_prompts_of_different_lengths_continue_as_if_alone(name):
    model = _model(name)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (3, 7, 1, 5)]
    together = model.generate(prompts, 5, temperature=0)
    assert isinstance(together, list) and len(together) == 4
    for prompt, row in zip(prompts, together):
        alone = model.generate(prompt[None], 5, temperature=0)[0]
        assert torch.equal(row, alone)
        with torch.no_grad():
            logits = model(row[None])[0]
        assert torch.equal(row[len(prompt):], logits[len(prompt) - 1 : -1].argmax(-1))


def test_eos_ends_a_row():
    model = _model("gdn-scalar")
    prompt = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(5))
    free = model.generate(prompt, 6, temperature=0)
    eos = int(free[0, 6])  # the third token row 0 generates
    first_in = [int((row[4:] == eos).nonzero()[0]) if (row[4:] == eos).any() else None for row in free]
    out = model.generate(prompt, 6, temperature=0, eos=eos)
    for row, free_row, hit in zip(out, free, first_in):
        stop = 4 + hit + 1 if hit is not None else free.shape[1]
        assert torch.equal(row[:stop], free_row[:stop])
        assert (row[stop:] == eos).all()
    if all(h is not None for h in first_in):
        assert out.shape[1] == 4 + max(first_in) + 1  # the loop ended when every row had
    listed = model.generate(list(prompt), 6, temperature=0, eos=eos)
    assert torch.equal(listed[0], free[0, : 4 + first_in[0] + 1])


def test_sampling_draws_from_the_truncated_softmax():
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]])).repeat(20000, 1)
    gen = torch.Generator().manual_seed(6)

    def frequencies(s: Sampling) -> torch.Tensor:
        return torch.bincount(sample(logits, s, gen), minlength=5).double() / logits.shape[0]

    def expect(keep: list[int], temperature: float = 1.0) -> torch.Tensor:
        p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15], dtype=torch.float64) ** (1 / temperature)
        mask = torch.zeros(5, dtype=torch.bool)
        mask[keep] = True
        p = p * mask
        return p / p.sum()

    tol = 0.015
    assert (frequencies(Sampling()) - expect([0, 1, 2, 3, 4])).abs().max() < tol
    assert (frequencies(Sampling(top_k=2)) - expect([1, 3])).abs().max() < tol
    # top_p 0.75: 0.4 + 0.3 = 0.7 < 0.75, so 0.15 joins; the rest are dropped
    assert (frequencies(Sampling(top_p=0.75)) - expect([1, 3, 4])).abs().max() < tol
    assert (frequencies(Sampling(temperature=0.5, top_k=3)) - expect([1, 3, 4], 0.5)).abs().max() < tol
    assert torch.equal(sample(logits[:3], Sampling(temperature=0)), torch.tensor([1, 1, 1]))
    assert torch.equal(sample(logits[:3], Sampling(top_k=1), gen), torch.tensor([1, 1, 1]))


def test_sampled_generation_is_reproducible_under_a_generator():
    model = _model("kda-channel")
    prompt = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(7))
    a = model.generate(prompt, 8, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(8))
    b = model.generate(prompt, 8, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)


def test_bad_generation_arguments_are_named():
    model = _model("deltanet-none")
    prompt = torch.zeros(1, 3, dtype=torch.long)
    cases = [
        (dict(input_ids=prompt, max_new_tokens=-1), "max_new_tokens must be an int >= 0"),
        (dict(input_ids=prompt, max_new_tokens=2, temperature=-1.0), "temperature must be >= 0"),
        (dict(input_ids=prompt, max_new_tokens=2, top_k=0), "top_k must be a positive int"),
        (dict(input_ids=prompt, max_new_tokens=2, top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(input_ids=prompt, max_new_tokens=2, eos=VOCAB), r"eos must be a token id .* in \[0, 13\)"),
        (dict(input_ids=prompt + VOCAB, max_new_tokens=2), r"token ids must lie in \[0, 13\)"),
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2), r"\[B, T\] integer tensor with T >= 1"),
        (dict(input_ids=[[1, 2], []], max_new_tokens=2), "prompt 1 must be a non-empty 1-D sequence"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model.generate(**kwargs)
    if not CUDA:
        with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device"):
            model.generate(prompt, 2, cuda_graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [*COMBINATIONS, *HYBRIDS])
def test_prefill_and_triton_steps_equal_the_forward_on_cuda(name):
    """float32 on CUDA, 40 tokens. Both sides are measured against the float64 model on the
    CPU: the steps may be off it by the float32 tolerance plus the forward's own float32
    error. At 40 tokens that error is not negligible for the worst-conditioned plans: on the
    CPU, householder-nh3-b2-none's float32 forward is 2.2e-5 off float64 at logits of 1.95
    (the weights are scaled up tenfold, and beta reaches 2)."""
    model = _model(name, torch.float32, backend="auto", device="cuda")
    ids = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact = _model(name, torch.float64)(ids)
        want = model(ids.cuda()).cpu().double()
    got = _prefill_then_steps(model, ids.cuda(), 33).cpu().double()
    scale = max(1.0, exact.abs().max().item())
    forward_error, steps_error = ((x - exact).abs().max().item() for x in (want, got))
    assert steps_error <= TOL[torch.float32] * scale + forward_error, \
        f"steps {steps_error:.2e} off float64, the forward {forward_error:.2e}, at scale {scale:.2f}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdn-scalar", "oskda-betafree-nh2", "rwkv7-nh2-b2-channel", *HYBRIDS])
def test_the_cuda_graph_replays_the_eager_step(name):
    model = _model(name, torch.float32, backend="auto", device="cuda")
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).cuda() for n in (9, 3, 17)]
    eager = model.generate(prompts, 12, temperature=0, cuda_graph=False)
    graphed = model.generate(prompts, 12, temperature=0, cuda_graph=True)
    again = model.generate(prompts, 12, temperature=0, cuda_graph=True)  # the kept graph, loaded afresh
    for a, b, c in zip(eager, graphed, again):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert len(model._captured_steps) == 1
    with torch.no_grad():
        logits = model(graphed[0][None])[0]
    assert torch.equal(graphed[0][9:], logits[8:-1].argmax(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdn-scalar", "kda-channel", "osgdn-apf-learned", "rwkv7-nh2-b2-channel"])
def test_a_bfloat16_model_decodes_like_its_forward_on_cuda(name):
    """bfloat16 weights (how the decoding benchmark runs), float32 state: the steps are
    no further from the same weights in float64 than twice the bfloat16 forward is, plus
    1e-2 (relative Frobenius error), and generate runs from the graph. Two bfloat16
    computations differ by their own roundings, which says nothing about which is off:
    RWKV-7's steps were 3.0e-2 from its bfloat16 forward on the H200."""
    model = _model(name, torch.float32, backend="auto", device="cuda").to(torch.bfloat16)
    exact_model = copy.deepcopy(model).to(torch.float64)
    exact_model.set_backend("torch")
    ids = torch.randint(0, VOCAB, (4, 40), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        exact = exact_model(ids)
        forward = model(ids).double()
    steps = _prefill_then_steps(model, ids, 33).double()

    def error(x: torch.Tensor) -> float:
        return ((x - exact).norm() / exact.norm()).item()

    assert error(steps) <= 2 * error(forward) + 1e-2, \
        f"steps {error(steps):.3g} off float64, the bfloat16 forward {error(forward):.3g}"
    out = model.generate(ids[:, :8], 16, temperature=0)
    assert out.shape == (4, 24) and model.init_state(1)[0].recurrent.dtype == torch.float32


def test_a_kv_cache_grows_and_keeps_its_rows():
    """`reserve` doubles the buffers when a row would run past them; the steps after it
    still give the forward's logits (the HuggingFace path, which does not know the length
    ahead, relies on it)."""
    model = _model("hybrid-window")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model(ids)
        hidden, state = model.hidden_states(ids[:, :5], return_state=True)
        state = model.decode_state(state, capacity=6)
        caches = [layer for layer in state if isinstance(layer, KVCache)]
        assert [c.capacity for c in caches] == [6, 6] and caches[0].length.tolist() == [5, 5]
        logits = [model.head(hidden)]
        for t in range(5, 12):
            for cache in caches:
                cache.reserve(1)
            logits.append(model.step(ids[:, t], state)[:, None])
    assert [c.capacity for c in caches] == [12, 12]
    _close(torch.cat(logits, dim=1), want, torch.float64)
    with pytest.raises(ValueError, match="give its capacity"):
        model.decode_state(model.hidden_states(ids[:, :2], return_state=True)[1])
