"""Packed documents (`cu_seqlens`) against each document run alone, in float64.

A packed row must give every document exactly what it gets on its own: logits, the state
it ends in (matrix state, conv tails, OSDN's d), every parameter gradient, and the mean
next-token loss; continuing packed documents from a packed state must equal continuing
each alone. One document is shorter than the conv's window and one has a single token.
"""

from __future__ import annotations

import re

import pytest
import torch

from archspec.blocks import build_model
from archspec.blocks.loss import packed_labels

from .plans import COMBINATIONS, model_plan

PACKED_CASES = ["gdn-scalar", "kda-channel", "diagonal-channel", "householder-nh2-b2-scalar", "rwkv7-nh2-b2-channel",
                "osdn-apf-nh2", "osgdn-apf-learned", "conv2-rwkv7"]
LENGTHS = [5, 1, 9, 2]


def _model(name: str, backend: str):
    torch.manual_seed(0)
    model = build_model(model_plan(COMBINATIONS[name], layers=2)).double()
    with torch.no_grad():  # move the trivially initialised OSDN parameters so that they matter
        for pname, p in model.named_parameters():
            if "d0_delta" in pname or "retain_proj.bias" in pname:
                p.add_(0.5 * torch.randn_like(p) - (3.0 if "retain" in pname else 0.0))
    model.set_backend(backend)
    return model


def _docs(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 13, (1, n), generator=gen) for n in lengths]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _assert_state_rows(packed, alone, row):
    for lp, la in zip(packed, alone):
        torch.testing.assert_close(lp.recurrent[row], la.recurrent[0])
        for name in la.conv:
            torch.testing.assert_close(lp.conv[name][row], la.conv[name][0])
        if la.d is not None:
            torch.testing.assert_close(lp.d[row], la.d[0])


@pytest.mark.parametrize("backend", ["naive", "torch"])
@pytest.mark.parametrize("name", PACKED_CASES)
def test_packed_documents_equal_each_alone(name, backend):
    model = _model(name, backend)
    docs = _docs(LENGTHS)
    ids, cu = torch.cat(docs, dim=1), _cu(LENGTHS)
    weights = torch.randn(1, ids.shape[1], 13, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    logits, state = model(ids, return_state=True, cu_seqlens=cu)
    packed_grads = torch.autograd.grad((logits * weights).sum(), list(model.parameters()), allow_unused=True)

    total = 0.0
    for n, doc in enumerate(docs):
        lo, hi = int(cu[n]), int(cu[n + 1])
        alone, alone_state = model(doc, return_state=True)
        torch.testing.assert_close(logits[:, lo:hi], alone, msg=lambda e, n=n: f"document {n}: {e}")
        _assert_state_rows(state, alone_state, n)
        total = total + (alone * weights[:, lo:hi]).sum()
    alone_grads = torch.autograd.grad(total, list(model.parameters()), allow_unused=True)
    for (pname, _), g, r in zip(model.named_parameters(), packed_grads, alone_grads):
        if r is None:
            assert g is None or g.abs().max() == 0
        else:
            torch.testing.assert_close(g, r, msg=lambda e, p=pname: f"grad of {p}: {e}")


@pytest.mark.parametrize("name", ["osgdn-apf-learned", "rwkv7-nh2-b2-channel"])
def test_packed_continuation_from_a_packed_state(name):
    """Prefill packed, then continue packed from the returned state: each document as if
    it ran its two pieces alone (the state rows, the tails and d carried per document)."""
    model = _model(name, "naive")
    first, second = _docs(LENGTHS, seed=2), _docs([3, 2, 1, 4], seed=3)
    _, state = model(torch.cat(first, 1), return_state=True, cu_seqlens=_cu(LENGTHS))
    logits, state = model(torch.cat(second, 1), state, return_state=True, cu_seqlens=_cu([3, 2, 1, 4]))
    cu = _cu([3, 2, 1, 4])
    for n in range(len(LENGTHS)):
        _, s = model(first[n], return_state=True)
        alone, s = model(second[n], s, return_state=True)
        torch.testing.assert_close(logits[:, int(cu[n]) : int(cu[n + 1])], alone)
        _assert_state_rows(state, s, n)


def test_packed_loss_is_the_mean_over_every_documents_tokens():
    model = _model("kda-channel", "torch")
    docs = _docs(LENGTHS, seed=4)
    ids, cu = torch.cat(docs, 1), _cu(LENGTHS)
    loss = model(ids, labels=packed_labels(ids, cu), cu_seqlens=cu)
    total, count = 0.0, 0
    for doc in docs:
        logits = model(doc)
        if doc.shape[1] > 1:
            nll = torch.nn.functional.cross_entropy(logits[0, :-1], doc[0, 1:], reduction="sum")
            total, count = total + nll, count + doc.shape[1] - 1
    torch.testing.assert_close(loss, total / count)
    got = torch.autograd.grad(loss, list(model.parameters()))
    want = torch.autograd.grad(total / count, list(model.parameters()))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


def test_packed_input_is_checked():
    model = _model("gdn-scalar", "torch")
    with pytest.raises(ValueError, match=r"must be \[1, T\]"):
        model(torch.zeros(2, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=re.escape("must be non-decreasing, got [0, 3, 2, 4]")):
        model(torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 3, 2, 4]))
    with pytest.raises(ValueError, match=re.escape("must run from 0 to T = 4, got [0, 5]")):
        model(torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 5]))
