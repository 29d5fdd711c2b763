"""The mixer layers on the Triton kernel: a whole model, end to end, against the naive loop.

`LanguageModel.set_backend("triton")` routes every mixer's `linear_recurrence` and
`osdn_write_keys` to the Triton backend (on CUDA `auto` does so by itself). In float64
the logits and every parameter gradient must match the naive loop's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from archspec.blocks import build_model  # noqa: E402
from tests.blocks.plans import _osdn, mixer_plan, model_plan  # noqa: E402

PLANS = {
    "osgdn-apf-nh2": mixer_plan("gdn", "scalar", n_h=2, osdn=_osdn(apf=True), head_dim=16, value_dim=16),
    "rwkv7-channel": mixer_plan("kda", "channel", "rwkv7", beta_scale=2.0, head_dim=16, value_dim=16),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_model_on_the_triton_kernel_matches_the_naive_loop(name: str, monkeypatch) -> None:
    from archspec.kernels import api

    api._load_backend("triton")
    calls = []
    for table in (api._RECURRENCE_BACKENDS, api._OSDN_BACKENDS):  # count what reaches the kernel
        fn = table["triton"]
        monkeypatch.setitem(table, "triton", lambda *a, _fn=fn, **kw: calls.append(_fn.__name__) or _fn(*a, **kw))
    torch.manual_seed(3)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(model_plan(PLANS[name], d_model=32, layers=1)).double().to(device)
    ids = torch.randint(0, 13, (2, 9), device=device)
    results = {}
    for backend in ("naive", "triton"):
        model.set_backend(backend)
        model.zero_grad()
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
        results[backend] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert "linear_recurrence_triton" in calls
    assert ("osdn_write_keys_triton" in calls) == (PLANS[name].preconditioner is not None)
    torch.testing.assert_close(results["triton"][0], results["naive"][0], rtol=1e-9, atol=1e-11)
    for n, g in results["naive"][1].items():
        torch.testing.assert_close(results["triton"][1][n], g, rtol=1e-8, atol=1e-11, msg=lambda e, n=n: f"grad of {n}: {e}")
