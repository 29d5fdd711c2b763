"""The initialisation lets a small model learn: a sanity check, not a benchmark."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from archspec.blocks import build_model

from .plans import mixer_plan, model_plan


def test_small_model_learns_a_periodic_sequence():
    """Sequences repeat a random 3-token pattern: after the first period every token is
    predictable. From the uniform loss ln(13) ~ 2.56 the model must get well below 1."""
    torch.manual_seed(0)
    model = build_model(model_plan(mixer_plan("gdn", "scalar"), d_model=32, layers=2))
    model.set_backend("torch")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(150):
        ids = torch.randint(0, 13, (16, 3), generator=gen).repeat(1, 8)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits[:, 3:].flatten(0, 1), ids[:, 4:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(13)) < 0.3  # starts near uniform: no blown-up init
    assert sum(losses[-10:]) / 10 < 0.5
