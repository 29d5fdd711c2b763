"""`benchmarks/loss.py --smoke`: the head's forward + backward and the softmax step run on
the CPU interpreter, the step also at another launch setting (blocks of 64 columns, a
loop of several a row), which must give the table's losses and gradients; the results are
written. fla, absent here, is recorded as refused and ours still timed."""

from __future__ import annotations

import json

import pytest

from .test_gpu_scripts import benchmark_module


def test_smoke_run_writes_both_rows(tmp_path):
    with benchmark_module("loss") as bench:
        record = bench.main(["--smoke", "--out", str(tmp_path), "--launch", "block_v=64,num_warps=2"])
    written = json.loads((tmp_path / "loss.json").read_text())
    assert written == json.loads(json.dumps(record))
    r = written["result"]
    assert (r["rows"], r["d_model"], r["vocab"]) == (48, 32, 208)
    assert set(r["ms"]["linear"]) == {"ours"}
    assert set(r["ms"]["softmax"]) == {"ours", "ours[block_v=64,num_warps=2]"}
    assert 0 <= r["max_rel_err"]["block_v=64,num_warps=2"] < 1e-5  # float32: the sums' order only
    assert r["softmax_floor_ms"] is None  # no clock, no copy rate
    assert "| ours[block_v=64,num_warps=2] | - | - |" in (tmp_path / "loss.md").read_text()


def test_a_launch_setting_that_is_not_one_is_refused():
    with benchmark_module("loss") as bench:
        with pytest.raises(ValueError, match="block_v"):
            bench.parse_launch("block_w=64")
        with pytest.raises(ValueError, match="positive integers"):
            bench.parse_launch("block_v=0")
        assert bench.parse_launch("block_v=8192,num_warps=16").block_v == 8192


def test_fla_absent_is_recorded_and_ours_still_timed():
    with benchmark_module("loss") as bench:
        result = bench.run(bench.SMOKE_SIZE, 1, None, True, [], "cpu", lambda fn: (fn(), 0.0)[1])
        table = bench.markdown({"machine": bench.machine(), "rounds": 1, "against": None, "result": result})
    assert set(result["ms"]["linear"]) == {"ours"} and "fla" in result["refused"]
    assert "- fla refused: " in table
