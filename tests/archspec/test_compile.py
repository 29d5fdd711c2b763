"""`archspec.compile`: every shipped spec builds, runs forward and backward, and costs what
the analytic model says; overrides and saved modules round-trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import archspec
from archspec.compiler import load_compiled, save_compiled
from archspec.cost import estimate
from archspec.errors import ArchspecError

MODELS = Path(__file__).resolve().parents[2] / "specs" / "models"
SPECS = sorted(MODELS.glob("*.yaml"))


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_shipped_spec_compiles_and_trains_one_step(path):
    torch.manual_seed(0)
    model = archspec.compile(path)
    spec = archspec.load_spec(path)
    assert model.plan == archspec.lower(spec)
    # the cost model's exact count (independent of the module) matches the module
    assert sum(p.numel() for p in model.parameters()) == estimate(spec).params
    ids = torch.randint(0, spec.model.vocab_size, (2, 12))
    logits = model(ids)
    assert logits.shape == (2, 12, spec.model.vocab_size)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # every weight matrix of the mixers gets a gradient signal
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if ".mixer." in n and p.dim() == 2)


def test_keyword_overrides_in_both_spellings():
    model = archspec.compile(MODELS / "deltaproduct-2.yaml", mixer__heads=2, **{"model.layers": 1, "mixer.transition.n_h": 3})
    assert (model.plan.mixer.heads, model.plan.layers, model.plan.mixer.n_h) == (2, 1, 3)
    with pytest.raises(ArchspecError) as info:
        archspec.compile(MODELS / "deltanet.yaml", mixer__haeds=2)
    assert "did you mean heads?" in str(info.value) and "override mixer.haeds=2" in str(info.value)


def test_compile_accepts_a_dict_and_a_spec():
    data = {"name": "tiny", "mixer": {"heads": 2, "head_dim": 16}, "model": {"d_model": 32, "layers": 1}}
    assert archspec.compile(data).plan == archspec.compile(archspec.load_spec(data)).plan


def test_saved_module_rebuilds_with_the_same_outputs(tmp_path):
    spec = archspec.load_spec(MODELS / "osgdn-apf.yaml", ["model.layers=1", "mixer.heads=2"])
    model = archspec.compile(spec)
    target = tmp_path / "out" / "model.pt"
    save_compiled(model, spec, target)
    assert [p.name for p in target.parent.iterdir()] == ["model.pt"]  # no temp file left
    again = load_compiled(target)
    assert again.plan == model.plan
    ids = torch.randint(0, 256, (1, 10))
    torch.testing.assert_close(again(ids), model(ids), rtol=0, atol=0)


def test_loading_something_else_is_a_clear_error(tmp_path):
    bogus = tmp_path / "x.pt"
    torch.save({"weights": torch.zeros(2)}, bogus)
    with pytest.raises(ArchspecError, match="not a saved archspec module"):
        load_compiled(bogus)
    with pytest.raises(ArchspecError, match="no such file"):
        load_compiled(tmp_path / "missing.pt")
