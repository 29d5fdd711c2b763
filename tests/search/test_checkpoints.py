"""Trained weights: the best checkpoint by the validation metric, `archspec.load`, resume.

The saved model is checked against what the run recorded (the loaded weights score
exactly the numbers in metrics.json), the checkpoint's step against the validations in
the record, and a resumed run against the run that never stopped (every loss, the
learning rate of every step, the weights, the scores: equal on the CPU).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

import archspec
from archspec import weights
from archspec.errors import ArchspecError
from archspec.search import trainer
from archspec.search.checkpoints import RESUME_FILE
from archspec.search.cli import main
from archspec.search.tasks import ValidationMetric, get_task

ROOT = Path(__file__).resolve().parents[2]
DELTANET = str(ROOT / "specs" / "models" / "deltanet.yaml")
GDN = str(ROOT / "specs" / "models" / "gated-deltanet.yaml")
TINY = ["model.layers=1", "model.d_model=16", "mixer.heads=2", "mixer.head_dim=8", "model.mlp=none"]
RUN = dict(steps=8, seed=3, overrides=TINY, quiet=True, eval_every=4, batch_size=8, measure_throughput=False, lr=3e-2)


def tiny_s3():
    return get_task("s3", train_len=8, eval_size=16)


def best_validation(evals: list[dict], metric: ValidationMetric) -> dict:
    """The validation the checkpoint should come from, chosen here independently: the
    best value, and the latest of equal ones."""
    sign = 1 if metric.higher_is_better else -1
    return max(evals, key=lambda e: (sign * e[metric.name], e["step"]))


def test_the_saved_weights_are_the_best_validation_and_score_what_the_run_recorded(tmp_path):
    task = get_task("bytes_lm", seq_len=16, eval_windows=8)  # bpb: lower is better
    result = trainer.train(DELTANET, task, out_dir=tmp_path, **{**RUN, "steps": 12, "eval_every": 3})
    assert result.status == "ok"
    record = json.loads((tmp_path / "metrics.json").read_text())
    best = best_validation(record["evals"], task.validation_metric)
    saved = record["checkpoint"]
    assert saved == {"weights": "model.safetensors", "step": best["step"], "metric": "bpb", "value": best["bpb"],
                     "higher_is_better": False, "spec": "spec.yaml"}
    metadata = weights.read_metadata(tmp_path / "model.safetensors")
    assert int(metadata["step"]) == best["step"] and float(metadata["value"]) == best["bpb"]
    assert not (tmp_path / RESUME_FILE).exists()  # a finished run leaves no resume state

    model = archspec.load(tmp_path)
    assert not model.training
    # The loaded model scores exactly the run's final evaluation (which is of the kept weights)
    # and its validation value at the checkpoint's step.
    final, _ = trainer.evaluate(model, task, task.eval_sets(), torch.device("cpu"), 256, with_curves=False)
    assert final == {k: v for k, v in record["metrics"].items() if k in final}
    val, _ = trainer.evaluate(model, task, task.validation_sets(), torch.device("cpu"), 256, with_curves=False)
    assert val["bpb"] == best["bpb"]
    # The spec beside the weights is the fully resolved one: it loads without the original YAML.
    spec = archspec.load_spec(tmp_path / "spec.yaml")
    assert spec.model.vocab_size == 256 and spec.model.d_model == 16 and spec.extends is None


def test_tied_weights_round_trip(tmp_path):
    model = archspec.compile(GDN, **{"model.tie_embeddings": True, "model.d_model": 16, "mixer.heads": 2,
                                     "mixer.head_dim": 8, "model.layers": 1, "model.vocab_size": 11})
    spec = archspec.load_spec(GDN, [("model.tie_embeddings", True), ("model.d_model", 16), ("mixer.heads", 2),
                                    ("mixer.head_dim", 8), ("model.layers", 1), ("model.vocab_size", 11)])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # not the initialisation a rebuild would give anyway
    weights.save(model, spec, tmp_path)
    loaded = archspec.load(tmp_path)
    assert loaded.head.weight is loaded.embed.weight
    reference = model.state_dict()
    assert set(loaded.state_dict()) == set(reference)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    ids = torch.randint(11, (2, 9))
    torch.testing.assert_close(loaded(ids), model.eval()(ids), rtol=0, atol=0)


def test_bad_weights_directories_are_named(tmp_path):
    with pytest.raises(ArchspecError, match="no such directory"):
        archspec.load(tmp_path / "missing")
    with pytest.raises(ArchspecError, match="no model.safetensors here"):
        archspec.load(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    weights.write_spec(tmp_path, archspec.load_spec(DELTANET))
    with pytest.raises(ArchspecError, match="not a safetensors file"):
        archspec.load(tmp_path)
    # Weights of another size: every tensor that does not fit is named with both shapes.
    small = archspec.load_spec(DELTANET, [("model.d_model", 16), ("mixer.heads", 2), ("mixer.head_dim", 8)])
    weights.save_state(tmp_path / "model.safetensors", archspec.compile(small))
    with pytest.raises(ArchspecError, match=r"embed.weight: shape \(\d+, 16\) in the file"):
        archspec.load(tmp_path)


def _interrupt_at(task, call: int, monkeypatch):
    """Make the `call`-th training batch raise KeyboardInterrupt (Ctrl-C mid-run)."""
    original = type(task).train_batch
    calls = {"n": 0}

    def train_batch(self, batch_size, generator):
        calls["n"] += 1
        if calls["n"] == call:
            raise KeyboardInterrupt
        return original(self, batch_size, generator)

    monkeypatch.setattr(type(task), "train_batch", train_batch)
    return monkeypatch


def test_resume_continues_exactly_like_the_run_that_never_stopped(tmp_path, monkeypatch):
    whole = trainer.train(DELTANET, tiny_s3(), out_dir=tmp_path / "whole", **RUN)
    assert whole.status == "ok"

    # Ctrl-C during step 7: the last resume state is the validation at step 4 (N/2).
    with monkeypatch.context() as patch:
        _interrupt_at(tiny_s3(), 7, patch)
        with pytest.raises(KeyboardInterrupt):
            trainer.train(DELTANET, tiny_s3(), out_dir=tmp_path / "parts", **RUN)
    parts = tmp_path / "parts"
    assert json.loads((parts / "metrics.json").read_text())["status"] == "interrupted"
    assert torch.load(parts / RESUME_FILE, weights_only=True)["step"] == 4

    # The CLI refuses to start over an unfinished run without --resume, and continues it with.
    flags = ["train", DELTANET, "--task", "s3", "--task-option", "train_len=8", "--task-option", "eval_size=16",
             "--out", str(parts), "--quiet", "--no-throughput", "--steps", "8", "--seed", "3", "--eval-every", "4",
             "--batch-size", "8", "--lr", "0.03", *(f"--set={o}" for o in TINY)]
    assert main(flags) == 2
    assert main([*flags, "--resume"]) == 0
    resumed = json.loads((parts / "metrics.json").read_text())
    assert resumed["status"] == "ok" and resumed["train"]["steps_done"] == 8
    assert resumed["checkpoint"]["resumed_from_step"] == 4
    # Every step's loss and learning rate (the optimizer's state, the schedule and the data
    # position), the weights and the scores are those of the run that never stopped.
    assert resumed["history"] == whole.record["history"]
    assert resumed["evals"] == whole.record["evals"]
    assert resumed["metrics"] == whole.metrics
    assert not (parts / RESUME_FILE).exists()
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(parts / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [h["step"] for h in resumed["history"]] == list(range(1, 9))


def test_resume_with_other_settings_or_nothing_to_resume_is_refused(tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        _interrupt_at(tiny_s3(), 6, patch)
        with pytest.raises(KeyboardInterrupt):
            trainer.train(DELTANET, tiny_s3(), out_dir=tmp_path, **RUN)
    with pytest.raises(ArchspecError, match=r"other settings.*train\.lr \(0\.03 then, 0\.01 now\)"):
        trainer.train(DELTANET, tiny_s3(), out_dir=tmp_path, resume=True, **{**RUN, "lr": 1e-2})
    with pytest.raises(ArchspecError, match=r"spec\.mixer\.heads"):
        trainer.train(DELTANET, tiny_s3(), out_dir=tmp_path, resume=True,
                      **{**RUN, "overrides": [*TINY[:2], "mixer.heads=4", *TINY[3:]]})
    with pytest.raises(ArchspecError, match="no resume.pt to resume from"):
        trainer.train(DELTANET, tiny_s3(), out_dir=tmp_path / "fresh", resume=True, **RUN)


def test_validation_metric_directions():
    lower = ValidationMetric("bpb", higher_is_better=False)
    higher = ValidationMetric("seq_acc@8")
    assert lower.keeps(3.0, None) and lower.keeps(2.0, 3.0) and lower.keeps(2.0, 2.0) and not lower.keeps(2.5, 2.0)
    assert higher.keeps(0.5, 0.5) and not higher.keeps(0.4, 0.5) and not higher.keeps(float("nan"), None)
    assert get_task("s3").validation_metric == ValidationMetric("seq_acc@32")
    assert get_task("bytes_lm").validation_metric == ValidationMetric("bpb", False)


def test_every_search_trial_saves_its_model(tmp_path):
    from archspec.search.rundir import RunDir, write_yaml_atomic
    from archspec.search.space import load_search_spec
    from archspec.search.trial import TrialSetup, execute_trial

    tiny = ROOT / "specs" / "search" / "bases" / "tiny-deltanet.yaml"
    path = tmp_path / "search.yaml"
    path.write_text(f"name: t\nbase: {tiny}\n" + textwrap.dedent("""\
        space:
          mixer.transition.n_h: {choices: [1, 2]}
        task: {name: s3, options: {train_len: 8, eval_size: 16}}
        objectives:
          - token_acc@16: max
        budget: {trials: 2, steps: 4}
        train: {measure_throughput: false, eval_every: 2}
        """))
    run = RunDir(tmp_path / "run")
    write_yaml_atomic(run.base_file, {"extends": str(tiny), "name": "tiny"})
    setup = TrialSetup(run_dir=str(run.path), search=load_search_spec(path).spec)
    record = execute_trial(setup, 0, {"mixer.transition.n_h": 2})
    assert record.status == "ok", record.reason
    folder = run.trial_dir(0) / "s3"
    model = archspec.load(folder)
    assert model.plan.mixer.n_h == 2
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["checkpoint"]["step"] in (2, 4)
