"""Searches on GPUs, checked on the CPU: trials' shares of a GPU (fixed fractions and
`gpu: auto` from the memory estimate), trials that run out of memory, validation results
reported while trials train, and ASHA stopping the trials behind.

Imports without Ray (the GPU machine may lack it): the tests that run a search import it
themselves."""

from __future__ import annotations

import json
import math
import os
import textwrap
import time
from pathlib import Path

import pytest
import torch

from archspec.errors import ArchspecError
from archspec.search.gpu_share import AUTO_STEP, auto_share, share_problem, training_bytes
from archspec.search.rundir import RunDir
from archspec.search.space import load_search_spec

pytestmark = pytest.mark.ray  # starts Ray: runs on one xdist worker (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "specs" / "search" / "bases" / "tiny-deltanet.yaml"
GIB = 1 << 30

BODY = """\
space:
  mixer.transition.n_h: {choices: [3, 1]}
  mixer.short_conv: {choices: [4, 6], when: {mixer.transition.n_h: 3}}
task: {name: s3, options: {train_len: 8, eval_size: 64}}
objectives:
  - token_acc@16: max
  - params: min
budget: {trials: 3, steps: 8}
sampler: grid
"""


def write_spec(tmp_path: Path, body: str = BODY, extra: str = "") -> Path:
    path = tmp_path / "search.yaml"
    path.write_text(f"name: t\nbase: {TINY}\n" + textwrap.dedent(body) + textwrap.dedent(extra))
    return path


def problems_of(path: Path) -> dict[str, str]:
    with pytest.raises(ArchspecError) as caught:
        load_search_spec(path)
    return {str(field): message for _, field, message in caught.value.problems}


# --------------------------------------------------------------------------- resources


def test_gpu_shares_are_fractions_whole_gpus_or_auto(tmp_path):
    for gpu, shown in (("0.125", 0.125), ("2", 2.0), ("auto", "auto")):
        spec = load_search_spec(write_spec(tmp_path, extra=f"resources: {{cpu: 1, gpu: {gpu}}}\n")).spec
        assert spec.resources.gpu == shown and spec.resources.uses_gpu
    assert not load_search_spec(write_spec(tmp_path)).spec.resources.uses_gpu
    bad = {"1.5": "1.5 GPUs: a trial takes a fraction of one GPU", "-0.5": "cannot reserve -0.5 GPUs", "half": "auto"}
    for gpu, says in bad.items():
        found = problems_of(write_spec(tmp_path, extra=f"resources: {{gpu: {gpu}}}\n"))
        assert "resources.gpu" in found and says in found["resources.gpu"], found
    found = problems_of(write_spec(tmp_path, extra="resources: {gpu: 0.5, gpu_memory_gib: 80}\n"))
    assert "only with `gpu: auto`" in found["resources"]


def test_auto_share_is_three_times_the_estimate_plus_a_gib_in_sixteenths():
    # (3 x 1 + 1) GiB of 16 GiB is a quarter; 3 x 5 + 1 = 16 GiB is the whole GPU.
    assert auto_share([GIB, GIB // 2], 16 * GIB) == 0.25
    assert auto_share([5 * GIB], 16 * GIB) == 1.0
    assert auto_share([0], 140 * GIB) == AUTO_STEP  # never less than a sixteenth
    assert auto_share([GIB], 64 * GIB) == AUTO_STEP  # 4 GiB of 64: exactly a sixteenth ...
    assert auto_share([GIB + 1], 64 * GIB) == 2 * AUTO_STEP  # ... and 3 bytes more round up to two
    assert auto_share([40 * GIB], 64 * GIB) == 1.0  # larger than the GPU: all of it ...
    assert share_problem([40 * GIB], 1.0, 64 * GIB) is None  # ... and it fits there
    refused = share_problem([40 * GIB], 0.5, 64 * GIB)
    assert refused.startswith("out of memory: the training step needs at least 40.0 GiB") and "32.0 GiB (0.5 of a 64.0 GiB GPU)" in refused


def test_auto_places_each_trial_by_its_own_estimate(tmp_path):
    """The driver sizes each proposal's share from its spec: a wider model gets more."""
    from types import SimpleNamespace

    from archspec.blocks.memory import estimate_memory
    from archspec.search.runner import placement
    from archspec.search.trainer import plan_for_task
    from archspec.search.trial import GPU_SHARE_KEY, TrialSetup, compose_spec, make_task
    from archspec.search.rundir import write_yaml_atomic

    loaded = load_search_spec(write_spec(tmp_path, extra="resources: {gpu: auto, gpu_memory_gib: 0.5}\ntrain: {batch_size: 512}\n"))
    run = RunDir(tmp_path / "run")
    write_yaml_atomic(run.base_file, loaded.base.model_dump(mode="json", exclude_none=True))
    setup = TrialSetup(run_dir=str(run.path), search=loaded.spec)
    task = make_task(loaded.spec.tasks[0])
    shares = {}
    for n_h in (1, 3):
        overrides = {"mixer.transition.n_h": n_h}
        plan, _ = plan_for_task(compose_spec(run, overrides, task=task), task)
        need = estimate_memory(plan, batch=512, seq_len=task.train_len, training=True, activation_bytes=2).total
        assert training_bytes(compose_spec(run, overrides, task=task), task, {"batch_size": 512}) == need
        shares[n_h] = placement({"trial_number": 0, "overrides": overrides}, setup=setup, tasks=[task], gpu_bytes=GIB // 2)
        assert shares[n_h] == {GPU_SHARE_KEY: min(1.0, math.ceil((3 * need + GIB) / (GIB // 2) * 16) / 16)}
        # once a finished trial measured its peak at 1.2x its estimate, the factor is 1.2 x 1.25
        learned = SimpleNamespace(measurements=lambda: [(1.2 * GIB, GIB)])
        share = placement({"overrides": overrides}, setup=setup, tasks=[task], gpu_bytes=8 * GIB, measured=learned)
        assert share == {GPU_SHARE_KEY: max(1, math.ceil((math.ceil(need * 1.5) + GIB) * 16 / (8 * GIB))) / 16}
    fixed = setup.search.model_copy(update={"resources": setup.search.resources.model_copy(update={"gpu": 0.25})})
    assert placement({"overrides": {}}, setup=TrialSetup(str(run.path), fixed), tasks=[task], gpu_bytes=None) == {GPU_SHARE_KEY: 0.25}


def test_trial_resources_ask_ray_for_the_share_in_the_config():
    pytest.importorskip("ray")
    from archspec.search.runner import trial_resources

    assert trial_resources({"gpu_share": 0.125}, cpu=2, gpu=0.0).required_resources == {"CPU": 2, "GPU": 0.125}
    assert trial_resources({}, cpu=1, gpu=1.0).required_resources == {"CPU": 1, "GPU": 1.0}


def test_auto_without_a_gpu_or_its_memory_is_refused_before_anything_is_written(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("reads the GPU's memory here")
    from archspec.search.cli import main

    path = write_spec(tmp_path, extra="resources: {gpu: auto}\n")
    assert main(["search", str(path), "--out", str(tmp_path / "run"), "--no-live"]) == 2
    err = capsys.readouterr().err
    assert "resources.gpu_memory_gib" in err and "no CUDA device" in err
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- out of memory


def test_the_trainer_records_running_out_of_memory_with_its_peak(monkeypatch, tmp_path):
    """An OutOfMemoryError in the third training step: the run is failed, `out of memory`,
    with the peak the allocator reached; the two validations before it were reported."""
    import archspec.search.trainer as trainer
    import archspec.training as training

    real = training.training_loss  # what the trainer's step (TrainingStep) calls on the CPU
    calls = {"n": 0}

    def failing_loss(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has 139 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "training_loss", failing_loss)
    monkeypatch.setattr(trainer, "peak_bytes", lambda device: 3 * GIB)
    seen = []
    result = trainer.train(TINY, "s3", task_options={"train_len": 8, "eval_size": 32}, steps=6, eval_every=1, batch_size=4,
                           measure_throughput=False, quiet=True, out_dir=tmp_path / "out",
                           on_validation=lambda step, metrics: seen.append((step, sorted(metrics))))
    assert result.status == "failed"
    assert result.reason.startswith("out of memory: CUDA out of memory. Tried to allocate 8.00 GiB")
    assert result.reason.endswith("peak 3.0 GiB allocated")
    assert result.metrics["peak_mem_bytes"] == 3 * GIB
    assert seen == [(1, ["seq_acc@8", "token_acc@8"]), (2, ["seq_acc@8", "token_acc@8"])]
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["reason"] == result.reason


# --------------------------------------------------------------------------- on Ray


ASHA = """\
resources: {cpu: 1, concurrent: 1}
scheduler: {type: asha, metric: token_acc@8, grace_steps: 2, reduction_factor: 2}
"""


def test_scheduler_section_is_checked_against_what_trials_report(tmp_path):
    found = problems_of(write_spec(tmp_path, extra="scheduler: {type: asha, metric: token_acc@16, grace_steps: 8}\n"))
    assert "do not report 'token_acc@16' while they train" in found["scheduler.metric"]
    assert "token_acc@8, seq_acc@8" in found["scheduler.metric"]
    assert "leave nothing to stop" in found["scheduler.grace_steps"]
    found = problems_of(write_spec(tmp_path, extra="scheduler: {type: hyperband, metric: token_acc@8, grace_steps: 2}\n"))
    assert "scheduler.type" in found
    # data-parallel trials report only at their end: nothing for a scheduler to act on
    for resources in ("{cpu: 2, data_parallel: 2}", "{cpu: 2, gpu: 2}"):
        found = problems_of(write_spec(tmp_path, extra=f"resources: {resources}\n"
                                       "scheduler: {type: asha, metric: token_acc@8, grace_steps: 2}\n"))
        assert "data-parallel trials (2 processes each) report only when they end" in found["scheduler"], found


def test_asha_stops_the_trial_behind_and_out_of_memory_fails_one_while_the_search_goes_on(tmp_path):
    """Three grid points, one at a time, each reporting its quality at every step: n_h = 3
    runs to the end; n_h = 3 with short_conv 6 runs out of GPU memory (failed, `out of
    memory`); n_h = 1, worse than n_h = 3 at ASHA's first rung (step 2), is stopped there
    and recorded `stopped` with that validation's metrics, PRUNED in the study."""
    pytest.importorskip("ray")
    import optuna
    from ray import cloudpickle

    import tests.search.cheap as cheap
    from archspec.search.runner import run_search
    from archspec.search.schedulers import make_scheduler

    cloudpickle.register_pickle_by_value(cheap)
    loaded = load_search_spec(write_spec(tmp_path, extra=ASHA))
    asha = make_scheduler(loaded.spec)
    assert asha.metric == "token_acc@8"
    outcome = run_search(loaded, tmp_path / "run", train_fn=cheap.cheap_train_reporting, live=False)
    assert outcome.complete and outcome.trained == 3
    run = RunDir(tmp_path / "run")
    records = {r.overrides.get("mixer.short_conv", r.overrides["mixer.transition.n_h"]): r for r in run.read_trials()}
    ok, oom, stopped = records[4], records[6], records[1]
    assert ok.status == "ok" and ok.metrics["token_acc@16"] > 0
    assert oom.status == "failed" and oom.reason.startswith("out of memory: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert stopped.status == "stopped" and "ASHA scheduler at step 2" in stopped.reason
    from archspec import load_spec

    expected = cheap.quality(load_spec(TINY, [("mixer.transition.n_h", 1)]))
    assert stopped.metrics["token_acc@8"] == expected and stopped.metrics["seq_acc@8"] == expected / 2
    assert not (run.trial_dir(stopped.number) / "s3" / "calls.json").exists()  # it never got to the end
    study = optuna.load_study(study_name="t", storage=run.study_url)
    states = {t.number: (t.state.name, t.user_attrs.get("status")) for t in study.trials}
    assert states[stopped.number] == ("PRUNED", "stopped") and states[oom.number] == ("FAIL", "failed")
    assert states[ok.number] == ("COMPLETE", "ok")


def test_trials_with_half_a_gpu_share_one_gpu_at_once(tmp_path, monkeypatch):
    """On a Ray that declares one (fake) GPU, two trials of `gpu: 0.5` run side by side on
    GPU 0, and Ray's view of each (trial_times.json) spans its worker's."""
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    import tests.search.cheap as cheap
    from archspec.search.runner import run_search
    from archspec.search.timing import read_trial_times

    cloudpickle.register_pickle_by_value(cheap)
    real_init = ray.init
    monkeypatch.setattr(ray, "init", lambda **kwargs: real_init(num_gpus=1, **kwargs))
    meet = tmp_path / "meet"  # each trial ends only once both have started (tests/search/cheap.py)
    meet.mkdir()
    monkeypatch.setenv("CHEAP_MEET", str(meet))
    monkeypatch.setenv("CHEAP_MEET_COUNT", "2")
    monkeypatch.setenv("CHEAP_SLEEP", "2")
    body = BODY.replace("choices: [3, 1]}\n  mixer.short_conv: {choices: [4, 6], when: {mixer.transition.n_h: 3}}",
                        "choices: [3, 1]}").replace("trials: 3", "trials: 2")
    loaded = load_search_spec(write_spec(tmp_path, body, extra="resources: {cpu: 1, gpu: 0.5}\n"))
    assert run_search(loaded, tmp_path / "run", train_fn=cheap.cheap_train, live=False).complete
    run = RunDir(tmp_path / "run")
    first, second = sorted(run.read_trials(), key=lambda r: r.started_at)
    for record in (first, second):
        assert record.status == "ok" and record.placement["gpu_ids"] == ["0"] and record.placement["gpu_share"] == 0.5
    assert second.started_at < first.finished_at - 1.0  # both held the one GPU at once
    times = read_trial_times(run.ray_dir)
    for record in (first, second):
        t = times[record.number]
        assert t["added_at"] <= t["started_at"] <= record.started_at + 1.0
        assert t["finished_at"] >= record.finished_at - 0.01


def test_a_trial_on_a_share_of_the_gpu_is_checked_against_its_share_before_training(tmp_path, monkeypatch):
    """On CUDA (the device is `cuda:0`, the first GPU Ray made visible) a trial given a
    share of a GPU runs the share checks before training: here they refuse it, and the
    trial is recorded failed with their reason, untrained."""
    import archspec.search.trial as trial
    from archspec.search.rundir import write_yaml_atomic
    from archspec.search.trial import TrialSetup, execute_trial

    checked = []
    monkeypatch.setattr(trial, "device_for", lambda setup: "cuda:0")
    monkeypatch.setattr(trial, "execute_gpu_checks",
                        lambda setup, overrides, tasks, share: checked.append(share) or "over its share (test)")
    search = load_search_spec(write_spec(tmp_path, extra="resources: {cpu: 1, gpu: 0.25}\n")).spec
    run = RunDir(tmp_path / "run")
    write_yaml_atomic(run.base_file, {"extends": str(TINY), "name": "tiny"})
    setup = TrialSetup(run_dir=str(run.path), search=search, train_fn=lambda *a, **k: pytest.fail("trained"))
    record = execute_trial(setup, 0, {"mixer.transition.n_h": 2}, gpu_share=0.25)
    assert checked == [0.25]
    assert record.status == "failed" and record.reason == "over its share (test)" and record.device == "cuda:0"


def test_auto_learns_its_factor_from_the_peaks_finished_trials_measured():
    """Until a trial has measured its step on the GPU the estimate is tripled; then the
    factor is the largest measured/estimated ratio so far, with a quarter of headroom,
    never below 1. Running trials and out-of-memory ones teach nothing; each trial's
    estimate is computed once however often the driver asks."""
    from types import SimpleNamespace

    from archspec.search.gpu_share import MEASURED_HEADROOM, MeasuredMemory, calibrated_factor

    assert calibrated_factor([]) == 3.0
    assert calibrated_factor([(2 * GIB, GIB), (GIB, GIB)]) == 2 * MEASURED_HEADROOM
    assert calibrated_factor([(GIB // 2, GIB)]) == 1.0  # below the estimate (a lower bound): the estimate
    assert auto_share([GIB], 16 * GIB, factor=1.0) == 2 * AUTO_STEP  # (1 + 1) GiB of 16
    assert auto_share([GIB], 16 * GIB) == 4 * AUTO_STEP  # (3 + 1) GiB of 16

    def record(number, status, overrides, metrics, reason=None):
        return SimpleNamespace(number=number, status=status, overrides=overrides, metrics=metrics, reason=reason)

    tasks = [SimpleNamespace(name="s4"), SimpleNamespace(name="mqar")]
    records = [
        record(0, "ok", {"w": 1}, {"s4/peak_mem_bytes": 3.0 * GIB, "mqar/peak_mem_bytes": 1.0 * GIB}),
        record(1, None, {"w": 2}, {"s4/peak_mem_bytes": 9.0 * GIB}),  # still running
        record(2, "failed", {"w": 3}, {"s4/peak_mem_bytes": 8.0 * GIB}, reason="out of memory: ... peak 8.0 GiB"),
        record(3, "failed", {"w": 4}, {}, reason="RuntimeError: no peak measured"),
    ]
    calls = []

    def estimate(overrides, task):
        calls.append((overrides["w"], task.name))
        return GIB * overrides["w"]

    measured = MeasuredMemory(lambda: records, tasks, estimate)
    assert measured.measurements() == [(3.0 * GIB, GIB), (1.0 * GIB, GIB)]
    assert calibrated_factor(measured.measurements()) == 3 * MEASURED_HEADROOM
    records[1] = record(1, "ok", {"w": 2}, {"s4/peak_mem_bytes": 9.0 * GIB})  # it finished: its ratio 4.5 leads now
    assert calibrated_factor(measured.measurements()) == 4.5 * MEASURED_HEADROOM
    assert calls == [(1, "s4"), (1, "mqar"), (2, "s4")]  # once per trial and task, not per question
