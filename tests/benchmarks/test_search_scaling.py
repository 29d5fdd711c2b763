"""`benchmarks/search_scaling.py`: the smoke mode end to end on the CPU (searches on the
shared Ray head of declared GPUs, `--address`, and data-parallel ranks over gloo), and
the speed-ups and efficiencies of its table against numbers worked out by hand."""

from __future__ import annotations

import json

import pytest

from .test_gpu_scripts import benchmark_module

pytestmark = pytest.mark.ray  # starts Ray: runs on one xdist worker (tests/conftest.py)


def test_efficiency_is_the_speedup_over_one_divided_by_the_count():
    with benchmark_module("search_scaling") as bench:
        rows = [{"gpus": 2, "trials_per_hour": 170.0}, {"gpus": 1, "trials_per_hour": 100.0},
                {"gpus": 8, "trials_per_hour": 680.0}]
        bench.efficiencies(rows, "gpus", "trials_per_hour")
        assert [(r["speedup"], r["efficiency"]) for r in rows] == [(1.7, 0.85), (1.0, 1.0), (6.8, 0.85)]
        alone = [{"processes": 2, "tokens_per_s": 10.0}]  # no row of one: nothing to compare with
        bench.efficiencies(alone, "processes", "tokens_per_s")
        assert alone[0]["speedup"] is None and alone[0]["efficiency"] is None


def test_smoke_run_measures_both_parts_and_writes_the_table(ray_head_4_gpus, tmp_path, capsys):
    pytest.importorskip("ray")
    with benchmark_module("search_scaling") as bench:
        # one count of the search (a search costs ~10 s here); both of the data-parallel trial
        code = bench.main(["--smoke", "--address", ray_head_4_gpus, "--gpus", "2", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    record = json.loads((tmp_path / "search_scaling.json").read_text())
    assert code == 0, record["failed"]
    assert record["machine"]["ray"] and record["machine"]["torch"] and record["smoke"] is True
    [row] = record["search"]
    assert row["gpus"] == 2 and row["trials"] == row["ok"] == 2 and row["complete"]  # one round: a trial per GPU
    assert row["trials_per_hour"] == pytest.approx(2 * 3600 / row["window_s"])
    assert row["speedup"] is None  # no count of one to compare with
    ddp = {r["processes"]: r for r in record["ddp"]}
    assert sorted(ddp) == [1, 2] and ddp[2]["backend"] == "gloo"
    assert ddp[1]["global_batch"] == 2 and ddp[2]["global_batch"] == 4  # two rows per process
    assert all(r["tokens_per_s"] > 0 for r in ddp.values())
    assert ddp[2]["efficiency"] == pytest.approx(ddp[2]["tokens_per_s"] / ddp[1]["tokens_per_s"] / 2)
    table = (tmp_path / "search_scaling.md").read_text()
    assert "| GPUs | trials |" in table and "| processes | global batch |" in table
    assert printed.rstrip().splitlines()[-1].startswith("[")  # the log's last line follows the table
    assert table.strip().splitlines()[-1] in printed
