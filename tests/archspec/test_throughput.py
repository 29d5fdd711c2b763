"""`measure_training_throughput` and `archspec bench` on a tiny model (figures are
checked for sense, not speed: speed goals live in benchmarks/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import archspec
from archspec.errors import ArchspecError
from archspec.search.cli import main
from archspec.throughput import measure_training_throughput

ROOT = Path(__file__).resolve().parents[2]
DELTANET = ROOT / "specs" / "models" / "deltanet.yaml"
TINY = {"model.layers": 1, "model.d_model": 16, "mixer.heads": 2, "mixer.head_dim": 8, "model.vocab_size": 32}



def _median(values):
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class _Counting(nn.Module):
    """An embedding + linear model that counts its forward calls and the tokens seen."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32)
        self.calls, self.shapes = 0, set()

    def forward(self, ids):
        self.calls += 1
        self.shapes.add(tuple(ids.shape))
        return self.head(self.embed(ids))


def test_counts_steps_and_leaves_the_model_and_rng_alone():
    model = _Counting()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    report = measure_training_throughput(model, batch=3, seq_len=7, device="cpu", warmup=2, steps=4)
    assert model.calls == 6 and model.shapes == {(3, 7)}
    assert len(report.step_seconds) == 4
    assert report.tokens_per_s == pytest.approx(3 * 7 / _median(report.step_seconds))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    params_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert report.peak_mem_bytes is None or report.peak_mem_bytes >= params_bytes


def test_real_model_and_bad_arguments():
    model = archspec.compile(DELTANET, **TINY)
    report = measure_training_throughput(model, batch=2, seq_len=16, device="cpu", warmup=1, steps=2)
    assert report.tokens_per_s > 0 and report.batch == 2 and report.seq_len == 16 and report.device == "cpu"
    with pytest.raises(ArchspecError, match="batch"):
        measure_training_throughput(model, batch=0, seq_len=16)


def test_bench_cli(tmp_path, capsys):
    out = tmp_path / "bench.json"
    sets = [a for k, v in TINY.items() for a in ("--set", f"{k}={v}")]
    code = main(["bench", str(DELTANET), *sets, "--batch", "2", "--seq-len", "16", "--warmup", "1", "--steps", "2", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["tokens_per_s"] > 0 and data["batch"] == 2 and data["seq_len"] == 16
    assert data["params"] == sum(p.numel() for p in archspec.compile(DELTANET, **TINY).parameters())
    assert "tokens/s" in capsys.readouterr().out


def test_bench_cli_bad_input(tmp_path, capsys):
    assert main(["bench", str(tmp_path / "missing.yaml")]) == 2
    assert main(["bench", str(DELTANET), "--set", "mixer.heads=-1"]) == 2
    err = capsys.readouterr().err
    assert "missing.yaml" in err and "mixer.heads" in err and "Traceback" not in err


def test_real_model_runs_the_training_step_and_is_left_as_it_was():
    """The LM goes through the trainer's step (loss without logits, AdamW timed apart);
    its weights come back unchanged and without gradients."""
    model = archspec.compile(DELTANET, **TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = measure_training_throughput(model, batch=2, seq_len=16, device="cpu", warmup=1, steps=3)
    assert len(report.step_seconds) == len(report.optimizer_seconds) == 3
    assert report.optimizer_s > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.gpu
def test_gpu_peak_memory_counts_the_optimizer_state():
    """On CUDA the step runs under bf16 autocast with fused AdamW, replayed from a CUDA
    graph (or eagerly, asked so): the peak holds at least the float32 weights, their
    gradients and AdamW's two moments."""
    model = archspec.compile(DELTANET, **{**TINY, "model.d_model": 256, "model.vocab_size": 4096})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = measure_training_throughput(model, batch=2, seq_len=256, device="cuda", warmup=1, steps=2)
    assert report.cuda_graph and report.eager_reason is None  # the trainer's step: a graph's replay
    params_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert report.peak_mem_bytes >= 4 * params_bytes
    assert all(torch.equal(before[k].cuda(), v) for k, v in model.state_dict().items())
    eager = measure_training_throughput(model, batch=2, seq_len=256, device="cuda", warmup=1, steps=2, graphed=False)
    assert not eager.cuda_graph and eager.eager_reason == "the eager step was asked for"
    assert eager.peak_mem_bytes >= 4 * params_bytes


def test_bench_cli_times_a_hybrid(tmp_path, capsys):
    hybrid = Path(DELTANET).parent / "kimi-linear-hybrid.yaml"
    sets = ["model.layers=2", "layout.ratio='1:1'", "model.d_model=16", "mixer.heads=2", "mixer.head_dim=8",
            "attention.head_dim=8", "attention.window=4"]
    out = tmp_path / "bench.json"
    code = main(["bench", str(hybrid), *[a for s in sets for a in ("--set", s)], "--batch", "2", "--seq-len", "16",
                 "--warmup", "1", "--steps", "2", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["tokens_per_s"] > 0
    assert data["params"] == sum(p.numel() for p in archspec.compile(archspec.load_spec(hybrid, sets)).parameters())
