"""`benchmarks/short_conv.py --smoke`: every setting runs ours forward and backward on the
CPU interpreter, also at another launch setting (tiles of 16 positions, several a
sequence), which must give the table's outputs and gradients, and the results are written
with the bytes floor of each pass."""

from __future__ import annotations

import json
import sys

from .test_gpu_scripts import benchmark_module


def test_smoke_run_writes_every_setting(tmp_path):
    with benchmark_module("short_conv") as bench:
        record = bench.main(["--smoke", "--out", str(tmp_path), "--launch", "block_t=16,num_warps=2"])
    sys.modules.pop("models", None)
    written = json.loads((tmp_path / "short_conv.json").read_text())
    assert written == json.loads(json.dumps(record))
    assert [r["setting"] for r in written["rows"]] == ["q/v", "key", "packed"]
    for r in written["rows"]:
        assert set(r["ms"]) == {"ours", "ours[block_t=16,num_warps=2]"}
        assert all(set(passes) == {"forward", "forward+backward"} for passes in r["ms"].values())
        assert 0 <= r["max_rel_err"]["block_t=16,num_warps=2"] < 1e-5  # float32: the sums' order only
        element = 4  # the smoke run is float32
        tensor_ms = r["B"] * r["T"] * r["C"] * element / bench.COPY_BYTES_PER_S * 1e3
        assert r["floor_ms"]["forward"] == 2 * tensor_ms and r["floor_ms"]["forward+backward"] == 5 * tensor_ms
    assert written["rows"][2]["documents"] >= 1 and written["rows"][1]["head_dim"] == 8
    assert "| packed |" in (tmp_path / "short_conv.md").read_text()


def test_a_peer_that_refuses_is_recorded_and_ours_still_timed():
    """An earlier `kernels/` whose conv raises, and fla where it is not installed (or will
    not run on CPU tensors): each is recorded in the row with its error; ours is timed."""

    class Refusing:
        @staticmethod
        def short_conv(*args, **kwargs):
            raise TypeError("short_conv() got an unexpected keyword argument 'head_dim'")

    with benchmark_module("short_conv") as bench:
        row = bench.time_setting(bench.SMOKE_SETTINGS[0], 1, Refusing(), True, [], "cpu", lambda fn: (fn(), 0.0)[1])
        table = bench.markdown({"machine": bench.machine(), "rounds": 1, "against": "old", "rows": [row]})
    sys.modules.pop("models", None)
    assert set(row["ms"]) == {"ours"}
    assert row["refused"]["before"] == "TypeError: short_conv() got an unexpected keyword argument 'head_dim'"
    assert "fla" in row["refused"]
    assert "- before refused: TypeError" in table and "- fla refused: " in table
