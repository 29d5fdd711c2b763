"""The trainer on a tiny model: metrics.json schema and values against independent
computations, determinism, divergence and failure recorded instead of raised, early
stop, the schedule, and `archspec train` through the CLI entry point."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import archspec
from archspec.search import trainer
from archspec.search.cli import main
from archspec.search.tasks import get_task
from archspec.search.tasks.groups import running_products

ROOT = Path(__file__).resolve().parents[2]
DELTANET = str(ROOT / "specs" / "models" / "deltanet.yaml")
TINY = ["model.layers=1", "model.d_model=16", "mixer.heads=2", "mixer.head_dim=8", "model.mlp=none"]



def tiny_s3():
    return get_task("s3", train_len=8, eval_size=16)


def test_metrics_json_schema_and_cost_values(tmp_path):
    task = tiny_s3()
    result = trainer.train(
        DELTANET, task, steps=6, seed=0, out_dir=tmp_path, overrides=TINY, quiet=True, eval_every=3, batch_size=8
    )
    assert result.status == "ok" and result.reason is None and result.steps_done == 6

    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["status"] == "ok"
    assert record["task"]["name"] == "s3" and record["task"]["train_len"] == 8
    assert record["spec"]["name"] == "deltanet" and record["spec"]["model"]["vocab_size"] == 6  # from the task
    m = record["metrics"]
    for n in (8, 16, 32):
        assert 0.0 <= m[f"token_acc@{n}"] <= 1.0 and 0.0 <= m[f"seq_acc@{n}"] <= 1.0
    assert all(isinstance(v, float) for v in m.values())

    # Cost metrics against the module and the analytic model, built independently.
    model = archspec.compile(DELTANET, **{k: v for k, v in (o.split("=") for o in TINY)}, **{"model.vocab_size": 6})
    assert m["params"] == sum(p.numel() for p in model.parameters())
    report = archspec.cost.estimate(model.plan)  # FLOPs at the reference length, not the task's
    assert m["flops_per_token"] == report.flops_per_token and m["state_bytes"] == report.state_bytes
    assert m["tokens_per_s"] > 0
    # Peak memory is not measured on the CPU: absent, with the reason, never a guess.
    assert "peak_mem_bytes" not in m and "CUDA" in record["not_measured"]["peak_mem_bytes"]
    assert record["train"]["cuda_graph"] is False and "need a CUDA device" in record["train"]["eager_step"]

    assert [e["step"] for e in record["evals"]] == [3, 6]
    assert record["history"][0]["step"] == 1 and math.isfinite(record["history"][-1]["loss"])
    curves = record["curves"]["test"]
    assert len(curves[0]["values"]) == 32  # the 4L evaluation split, one value per position
    assert (tmp_path / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert record["files"]["accuracy_plot"] == "accuracy.png"
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert record["files"]["training_plot"] == "training.png"


@pytest.mark.gpu
def test_gpu_trainer_replays_its_step_and_trains_as_the_eager_step(monkeypatch):
    """On CUDA the trainer replays its step from a CUDA graph, captured once at the task's
    longest training sequence (parity draws each batch's length, padded to it): the loss
    of every step and the final scores are the eager trainer's, to the order of float
    sums."""
    from archspec.training import TrainingStep

    def run():
        task = get_task("parity", max_train_len=24, eval_lengths=(24, 48), eval_size=32)
        return trainer.train(DELTANET, task, steps=12, seed=1, device="cuda", overrides=TINY, quiet=True,
                             eval_every=6, batch_size=8, target=0, measure_throughput=False)

    graphed = run()
    assert graphed.status == "ok" and graphed.record["train"]["cuda_graph"], graphed.record["train"]["eager_step"]
    monkeypatch.setattr(trainer, "TrainingStep", lambda *a, **k: TrainingStep(*a, **k, graphed=False))
    eager = run()
    assert eager.record["train"]["cuda_graph"] is False
    losses = [[h["loss"] for h in r.record["history"]] for r in (graphed, eager)]
    assert len(losses[0]) == 12
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=1e-3, atol=1e-5)
    for name, value in eager.record["metrics"].items():
        assert graphed.record["metrics"][name] == pytest.approx(value, rel=1e-2, abs=1e-2), name


def test_training_learns_bytes_beyond_uniform():
    # A uniform byte model scores 8 bits per byte; 80 steps learn the byte frequencies.
    task = get_task("bytes_lm", seq_len=32, eval_windows=16)
    result = trainer.train(
        DELTANET, task, steps=80, seed=0, overrides=TINY, quiet=True, measure_throughput=False, lr=1e-2, warmup_steps=5
    )
    assert result.status == "ok"
    assert result.metrics["bpb"] < 5.5
    losses = [h["loss"] for h in result.record["history"]]
    assert losses[-1] < losses[0] - 1.0


def _strip_timing(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in ("tokens_per_s", "peak_mem_bytes")}


def test_deterministic_under_a_seed():
    runs = [
        trainer.train(DELTANET, tiny_s3(), steps=5, seed=s, overrides=TINY, quiet=True, measure_throughput=False)
        for s in (3, 3, 4)
    ]
    losses = [[h["loss"] for h in r.record["history"]] for r in runs]
    assert losses[0] == losses[1]
    assert _strip_timing(runs[0].metrics) == _strip_timing(runs[1].metrics)
    assert losses[0] != losses[2]


def test_activation_checkpointing_trains_the_same_run(tmp_path, capsys):
    """Checkpointing changes memory, not the mathematics: every logged loss and the final
    metrics are the plain run's (CPU, deterministic), it is recorded, and a bad value is a
    clear error; the CLI takes it too."""
    two_layers = [*TINY[1:], "model.layers=2"]
    runs = [trainer.train(DELTANET, tiny_s3(), steps=5, seed=3, overrides=two_layers, quiet=True,
                          measure_throughput=False, activation_checkpointing=n) for n in (0, 1)]
    assert [h["loss"] for h in runs[0].record["history"]] == [h["loss"] for h in runs[1].record["history"]]
    assert _strip_timing(runs[0].metrics) == _strip_timing(runs[1].metrics)
    assert [r.record["train"]["activation_checkpointing"] for r in runs] == [0, 1]
    for bad in (-1, 1.5, True):
        with pytest.raises(archspec.errors.ArchspecError, match="activation_checkpointing must be an integer >= 0"):
            trainer.train(DELTANET, tiny_s3(), steps=1, overrides=TINY, quiet=True, measure_throughput=False,
                          activation_checkpointing=bad)
    out = tmp_path / "run"
    code = main(["train", DELTANET, "--task", "s3", "--steps", "2", "--quiet", "--no-throughput", "--out", str(out),
                 "--activation-checkpointing", "1", *(x for o in two_layers for x in ("--set", o))])
    assert code == 0
    assert json.loads((out / "metrics.json").read_text())["train"]["activation_checkpointing"] == 1


class _NaNAfter(nn.Module):
    """Wraps a model; from the `at`-th training forward on, its logits are NaN."""

    def __init__(self, inner: nn.Module, at: int):
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, ids):
        logits = self.inner(ids)
        if self.training:
            self.calls += 1
            if self.calls >= self.at:
                return logits * float("nan")
        return logits


def test_divergence_is_recorded_not_raised(tmp_path, monkeypatch):
    original = trainer.build_model_for_task

    def build(spec, task, overrides=()):
        built = original(spec, task, overrides)
        built.model = _NaNAfter(built.model, at=3)
        return built

    monkeypatch.setattr(trainer, "build_model_for_task", build)
    result = trainer.train(
        DELTANET, tiny_s3(), steps=10, seed=0, out_dir=tmp_path, overrides=TINY, quiet=True, measure_throughput=False
    )
    assert result.status == "diverged"
    assert result.steps_done == 3 and "step 3" in result.reason and "nan" in result.reason
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["status"] == "diverged" and record["reason"] == result.reason
    assert "params" in record["metrics"] and "token_acc@8" not in record["metrics"]


def test_a_failing_kernel_is_recorded_as_failed(tmp_path, monkeypatch):
    original = trainer.build_model_for_task

    def build(spec, task, overrides=()):
        built = original(spec, task, overrides)

        def boom(module, inputs):
            raise RuntimeError("kernel exploded")

        built.model.blocks[0].mixer.register_forward_pre_hook(boom)
        return built

    monkeypatch.setattr(trainer, "build_model_for_task", build)
    result = trainer.train(DELTANET, tiny_s3(), steps=3, out_dir=tmp_path, overrides=TINY, quiet=True)
    assert result.status == "failed" and "kernel exploded" in result.reason
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "failed"


class _Oracle(nn.Module):
    """Predicts the running product of S3 exactly (a stand-in for a trained model)."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table
        self.unused = nn.Parameter(torch.zeros(1))  # AdamW needs something to optimise
        self.plan = None

    def forward(self, ids):
        y = running_products(self.table, ids.cpu())
        return torch.nn.functional.one_hot(y, self.table.shape[0]).float() * 10 + self.unused * 0


def test_early_stop_and_evaluation_of_a_perfect_model(monkeypatch):
    task = tiny_s3()
    original = trainer.build_model_for_task

    def build(spec, t, overrides=()):
        built = original(spec, t, overrides)
        built.model = _Oracle(t.group.table)
        return built

    monkeypatch.setattr(trainer, "build_model_for_task", build)
    monkeypatch.setattr(trainer, "cost_metrics", lambda plan, device="cpu": {})
    result = trainer.train(DELTANET, task, steps=50, eval_every=4, overrides=TINY, quiet=True, measure_throughput=False)
    assert result.status == "ok" and result.steps_done == 4 and result.record["train"]["early_stopped"]
    assert result.metrics["token_acc@32"] == 1.0 and result.metrics["seq_acc@32"] == 1.0


def test_time_limit_ends_the_loop_and_still_evaluates():
    result = trainer.train(
        DELTANET, tiny_s3(), steps=10_000, overrides=TINY, quiet=True, measure_throughput=False, time_limit_s=0.0
    )
    assert result.status == "ok" and result.steps_done == 1 and result.record["train"]["time_limited"]
    assert "token_acc@8" in result.metrics


def test_schedule_by_hand():
    cfg = trainer.TrainConfig(steps=110, batch_size=1, lr=1.0, warmup_steps=10, eval_every=10, min_lr_ratio=0.1)
    assert trainer.lr_factor(0, cfg) == pytest.approx(0.1)
    assert trainer.lr_factor(9, cfg) == pytest.approx(1.0)
    assert trainer.lr_factor(10, cfg) == pytest.approx(1.0)
    assert trainer.lr_factor(60, cfg) == pytest.approx(0.55)  # halfway down the cosine
    assert trainer.lr_factor(110, cfg) == pytest.approx(0.1)


def test_bad_settings_are_clear_errors():
    with pytest.raises(archspec.errors.ArchspecError, match="batch size"):
        trainer.train(DELTANET, tiny_s3(), batch_size=0, overrides=TINY, quiet=True)


def test_cli_train_writes_metrics(tmp_path, capsys):
    out = tmp_path / "run"
    code = main([
        "train", DELTANET, "--task", "parity", "--steps", "4", "--out", str(out), "--quiet", "--no-throughput",
        "--task-option", "eval_lengths=[40,50]", "--task-option", "eval_size=8", "--diagnostics",
        *[a for s in TINY for a in ("--set", s)],
    ])
    assert code == 0
    record = json.loads((out / "metrics.json").read_text())
    assert set(record["metrics"]) >= {"scaled_acc@40", "scaled_acc@50", "scaled_acc", "params"}
    assert record["task"]["eval_lengths"] == [40, 50]
    # Diagnostics: one layer of two heads, replayed on the longest split (50 symbols + query).
    assert set(record["metrics"]) >= {"erank@0.0", "erank@0.1", "q_geo@0", "q_geo", "max_factor_norm"}
    assert len(record["diagnostics"]["erank"][0][0]) == 51
    assert record["metrics"]["max_factor_norm"] == pytest.approx(1.0)  # DeltaNet: symmetric factors
    assert (out / "diagnostics.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--task", "s9x"], "unknown task"),
        (["--task", "s3", "--task-option", "lenght=3"], "unknown option"),
        (["--task", "s3", "--set", "mixer.heads=zero"], "mixer.heads"),
        (["--task", "s3", "--steps", "-1"], "steps must be"),
    ],
)
def test_cli_train_bad_input_is_one_clear_line(tmp_path, capsys, argv, message):
    code = main(["train", DELTANET, "--out", str(tmp_path), "--quiet", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def _experiment_file(tmp_path, **extra) -> Path:
    import yaml

    data = {
        "name": "tiny",
        "task": {"name": "s3", "options": {"train_len": 4, "eval_size": 8}},
        "train": {"steps": 2, "batch_size": 4, "measure_throughput": False},
        "set": TINY,
        "seeds": [0, 1],
        "runs": [
            {"name": "dn", "spec": DELTANET},
            {"name": "dp2", "spec": DELTANET, "set": ["mixer.transition.n_h=2", "mixer.transition.beta_range=[0,2]"]},
        ],
        "report": ["token_acc@4", "token_acc@8"],
        **extra,
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_experiment_runs_every_run_and_seed_then_resumes(tmp_path, capsys):
    path, out = _experiment_file(tmp_path), tmp_path / "out"
    assert main(["experiment", str(path), "--out", str(out), "--quiet"]) == 0
    results = json.loads((out / "results.json").read_text())["results"]
    assert set(results) == {"dn", "dp2"} and set(results["dn"]) == {"0", "1"}
    # Each cell of results.md is the mean of the seeds' metrics.json values.
    seeds = [json.loads((out / "dp2" / f"s{s}" / "metrics.json").read_text())["metrics"]["token_acc@8"] for s in (0, 1)]
    row = next(line for line in (out / "results.md").read_text().splitlines() if line.startswith("| dp2 |"))
    assert f"{sum(seeds) / 2:.3f} ({seeds[0]:.3f}, {seeds[1]:.3f})" in row
    printed = capsys.readouterr().out
    for metric in ("token_acc@4", "token_acc@8", "status", "steps", "seconds"):
        assert f"│ {metric} " in printed  # a row of its own, the name whole
    assert "…" not in printed
    stamp = (out / "dn" / "s0" / "metrics.json").stat().st_mtime_ns
    assert main(["experiment", str(path), "--out", str(out), "--quiet", "--only", "dp2", "--fresh"]) == 0
    assert (out / "dn" / "s0" / "metrics.json").stat().st_mtime_ns == stamp  # not retrained


def test_experiment_errors_name_the_field(tmp_path, capsys):
    path = _experiment_file(tmp_path, train={"stepz": 3}, runs=[{"name": "x", "spec": "nope.yaml"}])
    assert main(["experiment", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "train.stepz" in err and "no option 'stepz'" in err and "runs[0].spec" in err and "nope.yaml" in err


@pytest.mark.parametrize(
    "task,options,expected",
    [
        ("a5", ["train_len=4", "eval_size=4"], "seq_acc@16"),
        ("d4", ["train_len=4", "eval_size=4"], "token_acc@8"),
        ("mod_arith", ["eval_lengths=[41]", "eval_size=4"], "scaled_acc@41"),
        ("mod_arith_brackets", ["eval_lengths=[45]", "eval_size=4"], "scaled_acc"),
        ("mqar", ["eval_size=4"], "token_acc@64"),
        ("mqar_twice", ["eval_size=4"], "seq_acc@64"),
        ("bytes_lm", ["seq_len=16", "eval_windows=4"], "bpb"),
    ],
)
def test_every_task_trains_and_evaluates_from_the_cli(tmp_path, task, options, expected):
    out = tmp_path / task
    argv = ["train", DELTANET, "--task", task, "--steps", "2", "--batch-size", "4", "--out", str(out), "--quiet", "--no-throughput"]
    argv += [a for o in options for a in ("--task-option", o)] + [a for s in TINY for a in ("--set", s)]
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())["metrics"]
    assert math.isfinite(metrics[expected])
    assert (out / "accuracy.png").exists()


def test_ctrl_c_keeps_what_was_measured(tmp_path, monkeypatch):
    original = trainer.build_model_for_task

    def build(spec, task, overrides=()):
        built = original(spec, task, overrides)
        calls = []

        def interrupt(module, inputs):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt

        built.model.register_forward_pre_hook(interrupt)
        return built

    monkeypatch.setattr(trainer, "build_model_for_task", build)
    with pytest.raises(KeyboardInterrupt):
        trainer.train(DELTANET, tiny_s3(), steps=10, out_dir=tmp_path, overrides=TINY, quiet=True, measure_throughput=False)
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["status"] == "interrupted" and record["metrics"]["params"] > 0
    assert [h["step"] for h in record["history"]] == [1, 2]


HYBRID = str(ROOT / "specs" / "models" / "qwen3-next-hybrid.yaml")
TINY_HYBRID = ["model.layers=4", "layout.ratio='1:1'", "model.d_model=32", "mixer.heads=2", "mixer.head_dim=8", "attention.heads=4",
               "attention.head_dim=8", "layout.overrides=[{layers: [3], attention: {window: 4}}]"]


def test_a_hybrid_trains_with_diagnostics_from_the_cli(tmp_path, capsys):
    """Recurrent and attention layers train together; the cost metrics include the long
    context; diagnostics cover the recurrent layers and name the attention ones."""
    out = tmp_path / "run"
    code = main([
        "train", HYBRID, "--task", "s3", "--steps", "30", "--batch-size", "16", "--out", str(out),
        "--task-option", "train_len=8", "--task-option", "eval_size=16", "--diagnostics", "--lr", "0.01",
        *[a for s in TINY_HYBRID for a in ("--set", s)],
    ])
    assert code == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "layer 1: attention layer" in printed and "layer 3: attention layer" in printed
    record = json.loads((out / "metrics.json").read_text())
    m = record["metrics"]
    model = archspec.compile(archspec.load_spec(HYBRID, [*TINY_HYBRID, "model.vocab_size=6"]))
    report = archspec.cost.estimate(model.plan)
    assert m["params"] == sum(p.numel() for p in model.parameters()) == report.params
    # layer 1's KV cache grows with the context (layer 3's window keeps 3 tokens)
    assert m["state_bytes@32768"] == report.state_bytes_long > m["state_bytes"] == report.state_bytes
    assert m["tokens_per_s"] > 0
    assert record["diagnostics"]["layers"] == [0, 2] and set(record["diagnostics"]["notes"]) == {"1", "3"}
    assert {"erank@0.0", "erank@2.1", "q_geo@2"} <= set(m) and "erank@1.0" not in m
    losses = [h["loss"] for h in record["history"]]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # it learns
    assert (out / "diagnostics.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_train_prints_plain_progress_lines_when_not_a_terminal(tmp_path, capsys):
    """Under pytest the output is a pipe, as under tee, nohup or a cluster job: one line
    when training starts and one per validation, with the step, the loss and the
    early-stop metric, then the table with whole numbers written whole."""
    out = tmp_path / "run"
    code = main(["train", DELTANET, "--task", "s3", "--steps", "6", "--eval-every", "2", "--out", str(out),
                 "--task-option", "train_len=4", "--task-option", "eval_size=8", "--batch-size", "4",
                 *[a for s in TINY for a in ("--set", s)]])
    assert code == 0
    text = capsys.readouterr().out
    record = json.loads((out / "metrics.json").read_text())
    lines = [line for line in text.splitlines() if line.startswith("deltanet on s3: ")]
    assert lines[0].startswith("deltanet on s3: training, 6 steps  [")
    steps = [e["step"] for e in record["evals"]]
    assert steps == [2, 4, 6] and len(lines) == 1 + len(steps)
    for line, evaluation in zip(lines[1:], record["evals"]):
        assert line.startswith(f"deltanet on s3: step {evaluation['step']}/6  loss ")
        assert f"seq_acc@4 {evaluation['seq_acc@4']:.3f}" in line
    assert f"{int(record['metrics']['params']):,}" in text  # 1,234 not 1234.0 nor 1.234e+03
    assert "peak_mem_bytes" in text and "not measured" in text


def test_training_plot_shows_the_recorded_curves(tmp_path):
    """The PNG is drawn from metrics.json's history and evals: their values are the
    plotted lines' data (checked on the figure matplotlib builds)."""
    import matplotlib.pyplot as plt

    from archspec.search import plots

    history = [{"step": s, "loss": 2.0 / s, "lr": 1e-3} for s in range(1, 11)]
    evals = [{"step": 5, "token_acc@4": 0.5, "seq_acc@4": 0.25}, {"step": 10, "token_acc@4": 0.75, "seq_acc@4": 0.5}]
    captured = {}
    original = plots._save

    def keep(fig, path):
        captured["axes"] = [[(line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()]
                            for ax in fig.axes]
        return original(fig, path)

    plots._save = keep
    try:
        path = plots.plot_training(history, evals, tmp_path / "training.png", title="t", watched="seq_acc@4")
    finally:
        plots._save = original
    assert path.read_bytes()[:4] == b"\x89PNG"
    loss, val = captured["axes"]
    assert loss == [("training loss", list(range(1, 11)), [2.0 / s for s in range(1, 11)])]
    assert val == [("token_acc@4", [5, 10], [0.5, 0.75]), ("seq_acc@4 (early stop)", [5, 10], [0.25, 0.5])]
    plt.close("all")


def test_progress_lines_say_a_long_run_is_alive_between_validations():
    import io

    from rich.console import Console

    from archspec.search.progress import training_progress

    stream = io.StringIO()
    console = Console(file=stream, force_terminal=False, width=200)
    with training_progress("dp2 on s3", 3, quiet=False, console=console) as progress:
        progress.every_s = 0.0  # a line at every step, as after LINE_EVERY_S seconds
        progress.stepped(1, 1.5)
        progress.validated(2, 1.25, {"token_acc@4": 0.5, "seq_acc@4": 0.25}, "seq_acc@4")
    lines = [line.split("  [")[0] for line in stream.getvalue().splitlines()]
    assert lines == ["dp2 on s3: training, 3 steps", "dp2 on s3: step 1/3  loss 1.5000",
                     "dp2 on s3: step 2/3  loss 1.2500  seq_acc@4 0.250"]
    silent = io.StringIO()
    with training_progress("x", 3, quiet=True, console=Console(file=silent)) as progress:
        progress.stepped(1, 1.0)
    assert silent.getvalue() == ""
