"""A search trial on a real GPU (skipped without CUDA). Imports neither Ray nor moocore:
Ray cannot be carried to the lent GPU machine, so the worker-side path runs directly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from archspec.search.rundir import RunDir, write_yaml_atomic
from archspec.search.space import load_search_spec
from archspec.search.trial import TrialSetup, execute_trial

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_a_gpu_trial_of_the_full_search_trains_on_cuda(tmp_path):
    """One point of specs/search/full-gpu.yaml through the worker-side path (Ray cannot be
    carried to the lent GPU): the trial picks CUDA, trains on both tasks at their GPU
    sizes and reports throughput measured there."""
    loaded = load_search_spec(REPO / "specs" / "search" / "full-gpu.yaml", ["budget.steps=60", "budget.time_per_trial=120"])
    run = RunDir(tmp_path / "run")
    write_yaml_atomic(run.base_file, loaded.base.model_dump(mode="json", exclude_none=True))
    setup = TrialSetup(run_dir=str(run.path), search=loaded.spec)
    overrides = {"mixer.backbone": "gdn", "mixer.transition.type": "householder", "mixer.transition.n_h": 2,
                 "mixer.transition.beta_range": [0, 2], "mixer.heads": 4, "mixer.head_dim": 64,
                 "model.d_model": 256, "model.layers": 2}
    record = execute_trial(setup, 0, overrides)
    print(json.dumps(record.to_json(), indent=1))
    assert record.status == "ok", record.reason
    assert record.device == "cuda:0"  # the first GPU Ray made visible
    assert record.metrics["s5/tokens_per_s"] > 0 and record.metrics["mqar_twice/tokens_per_s"] > 0
    assert record.metrics["s5/peak_mem_bytes"] > 0
    for objective in loaded.spec.metric_names:
        assert math.isfinite(record.metrics[objective])
