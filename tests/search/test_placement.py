"""Trials placed on the GPUs of one host, on a CPU machine: a Ray head declares 4 GPUs
(`ray start --head --num-gpus 4`, as the README's several-GPU commands do) and searches
join it with `--address`. Each trial reports where it ran (tests/search/placement_probe.py
trains nothing; its trials meet at a rendezvous, so they finish only if Ray ran them
all at once): 4 trials of one GPU run together on 4 distinct GPUs, each seeing only its
own in CUDA_VISIBLE_DEVICES; a trial of 2 GPUs trains data-parallel over its pair (two
ranks in one process group, gloo here: no CUDA), each rank seeing the pair; every
trial and every rank has NCCL_NVLS_ENABLE=0. The pure functions of `search/placement.py` are tested without Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from archspec.search.placement import TRIAL_ENV, placement_problem, trial_device, visible_devices

pytestmark = pytest.mark.ray  # starts Ray: runs on one xdist worker (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "specs" / "search" / "bases" / "tiny-deltanet.yaml"

SEARCH = """\
name: placed
base: {base}
space:
  mixer.transition.n_h: {{choices: [1, 2, 3, 4]}}
task: {{name: s3, options: {{train_len: 8, eval_size: 64}}}}
objectives: [{{token_acc@16: max}}]
budget: {{trials: {trials}, steps: 1}}
sampler: grid
resources: {resources}
"""


def test_the_device_a_trial_trains_on():
    assert trial_device(True, cuda_devices=1) == "cuda:0"  # the first (only) GPU Ray made visible
    assert trial_device(True, cuda_devices=2) == "cuda:0"  # the launcher's rank 0; rank r takes cuda:r
    assert trial_device(False, cuda_devices=8) == "cpu"  # no GPU reserved: none used, though CUDA is there
    assert trial_device(True, cuda_devices=0) == "cpu"  # a GPU Ray only declares (no CUDA): the CPU


def test_a_trial_whose_environment_is_not_what_ray_assigned_is_caught():
    env = {"CUDA_VISIBLE_DEVICES": "3", **TRIAL_ENV}
    assert visible_devices(env) == ["3"] and visible_devices({}) == [] and visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert placement_problem(["3"], env) is None
    assert placement_problem([], {**TRIAL_ENV}) is None  # a CPU trial
    assert "Ray assigned GPU(s) 2 but CUDA_VISIBLE_DEVICES is '3'" in placement_problem(["2"], env)
    assert "Ray assigned GPU(s) 2,3" in placement_problem(["2", "3"], env)
    assert "lacks NCCL_NVLS_ENABLE=0" in placement_problem(["3"], {"CUDA_VISIBLE_DEVICES": "3", "NCCL_NVLS_ENABLE": "1"})


# --------------------------------------------------------------------------- on a Ray head (tests/conftest.py)


def search_on(head: str, tmp_path: Path, trials: int, resources: str) -> list:
    from archspec.search.rundir import RunDir
    from archspec.search.runner import run_search
    from archspec.search.space import load_search_spec
    from tests.search.placement_probe import probe_train

    path = tmp_path / "search.yaml"
    path.write_text(SEARCH.format(base=TINY, trials=trials, resources=resources))
    outcome = run_search(load_search_spec(path, check_objectives=False), tmp_path / "run", address=head,
                         train_fn=probe_train, live=False)
    records = RunDir(tmp_path / "run").read_trials()
    assert outcome.complete and [r.status for r in records] == ["ok"] * trials, [r.reason for r in records]
    for record in records:
        assert record.metrics["met"] == trials  # all of them ran at once
        assert record.placement["nccl_nvls_enable"] == "0" and record.metrics["ranks_nvls_off"] == 1
        assert record.placement["cuda_visible_devices"] == ",".join(record.placement["gpu_ids"])
        assert record.device == "cpu"  # the GPUs are declared, not real: training falls back
    return records


def test_four_trials_of_one_gpu_run_at_once_each_on_its_own(ray_head_4_gpus, tmp_path):
    records = search_on(ray_head_4_gpus, tmp_path, 4, "{cpu: 1, gpu: 1}")
    assert sorted(g for r in records for g in r.placement["gpu_ids"]) == ["0", "1", "2", "3"]
    assert all(r.metrics["ranks_visible_gpus"] == 1 and r.metrics["ranks"] == 1 for r in records)


def test_a_trial_of_two_gpus_trains_data_parallel_over_its_pair(ray_head_4_gpus, tmp_path):
    records = search_on(ray_head_4_gpus, tmp_path, 1, "{cpu: 2, gpu: 2}")
    for record in records:
        assert len(record.placement["gpu_ids"]) == 2
        assert record.metrics["ranks"] == 2 and record.metrics["rank_sum"] == 1 + 2  # one process group of 2
        assert record.metrics["ranks_visible_gpus"] == 2  # each rank sees the trial's pair
