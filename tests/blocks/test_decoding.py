"""Recurrent decoding: one call, several pieces and token-by-token agree (float64).

The model carries per layer the matrix state S, the short-conv tails and OSDN's d; every
piece boundary must be invisible in the logits and in the final state.
"""

from __future__ import annotations

import pytest
import torch

from archspec.blocks import build_model

from .plans import COMBINATIONS, mixer_plan, model_plan

# Every transition, gate, n_h 1..3, OSDN (APF, learned init, beta-free) and conv setting.
DECODE_CASES = [
    "deltanet-none",
    "gdn-scalar",
    "kda-channel",
    "diagonal-scalar",
    "diagonal-channel",
    "householder-nh2-b2-scalar",
    "householder-nh3-b2-none",
    "rwkv7-nh2-b2-channel",
    "rwkv7-nh3-none",
    "osdn-apf-nh2",
    "osgdn-apf-learned",
    "oskda-betafree-nh2",
    "noconv-osdn-apf",
    "conv2-rwkv7",
]


def _model(plan, backend="naive"):
    torch.manual_seed(0)
    model = build_model(model_plan(plan, layers=2)).double()
    # Learned OSDN init and biases start at trivial values: move them so they matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "d0_delta" in name or "retain_proj.bias" in name:
                p.add_(0.5 * torch.randn_like(p) - (3.0 if "retain" in name else 0.0))
    model.set_backend(backend)
    return model


def _assert_states_close(a, b):
    for la, lb in zip(a, b):
        torch.testing.assert_close(la.recurrent, lb.recurrent)
        assert la.conv.keys() == lb.conv.keys()
        for name in la.conv:
            torch.testing.assert_close(la.conv[name], lb.conv[name])
        if la.d is None:
            assert lb.d is None
        else:
            torch.testing.assert_close(la.d, lb.d)


def _decode_in_pieces(model, ids, sizes, start_state=None):
    state, outs, t = start_state, [], 0
    for size in sizes:
        logits, state = model(ids[:, t : t + size], state=state, return_state=True)
        outs.append(logits)
        t += size
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("name", DECODE_CASES)
def test_pieces_and_tokens_equal_parallel(name):
    model = _model(COMBINATIONS[name])
    ids = torch.randint(0, 13, (2, 7), generator=torch.Generator().manual_seed(3))
    full, full_state = model(ids, return_state=True)
    assert full.dtype == torch.float64 and full_state[0].recurrent.dtype == torch.float64

    pieces, piece_state = _decode_in_pieces(model, ids, [3, 1, 3])
    torch.testing.assert_close(pieces, full)
    _assert_states_close(piece_state, full_state)

    tokens, token_state = _decode_in_pieces(model, ids, [1] * 7, start_state=model.init_state(2))
    torch.testing.assert_close(tokens, full)
    _assert_states_close(token_state, full_state)

    # the state is not trivially constant: it moved away from the start
    assert full_state[0].recurrent.abs().sum() > 0
    if full_state[0].d is not None:
        assert not torch.allclose(full_state[0].d, model.init_state(2)[0].d)


def test_state_none_equals_init_state():
    model = _model(COMBINATIONS["osgdn-apf-learned"])
    ids = torch.randint(0, 13, (1, 4))
    a = model(ids)
    b = model(ids, state=model.init_state(1))
    torch.testing.assert_close(a, b)
    st = model.init_state(3)
    mixer = model.mixers()[0]
    assert st[0].recurrent.shape == (3, 2, 4, 6)
    assert st[0].conv["k"].shape == (3, 3, 8)
    torch.testing.assert_close(st[0].d[0], mixer.preconditioner.initial_d())


def test_decoding_on_the_chunked_backend():
    """The torch backend carries state the same way (its chunks cross the pieces)."""
    plan = mixer_plan("gdn", "scalar", n_h=2, beta_scale=2.0, osdn=None)
    model = _model(plan, backend="torch")
    ids = torch.randint(0, 13, (2, 9), generator=torch.Generator().manual_seed(4))
    full, full_state = model(ids, return_state=True)
    pieces, piece_state = _decode_in_pieces(model, ids, [5, 1, 3])
    torch.testing.assert_close(pieces, full)
    _assert_states_close(piece_state, full_state)
    model.set_backend("naive")
    torch.testing.assert_close(model(ids), full)


def test_a_step_on_a_state_not_made_for_decoding_is_refused():
    """`Mixer.step` shifts the streams' conv tails in one launch: a forward's state (tails
    apart) is refused with what to do, and `decode_state` makes it steppable."""
    model = _model(COMBINATIONS["osgdn-apf-learned"])
    mixer = model.mixers()[0]
    x = torch.randn(2, 1, model.plan.d_model, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"must come from decode_state, its conv tails joined"):
        mixer.step(x, mixer.init_state(2))
    from archspec.blocks.mixer import decode_state

    state = decode_state(mixer.init_state(2))
    y, residual = mixer.step(x, state)
    assert y.shape == x.shape and residual is x
    assert state.tails.shape == (2, 3, sum(t.shape[-1] for t in state.conv.values()))
