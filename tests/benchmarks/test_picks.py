"""`benchmarks/picks.py`: the peer's autotune picks recorded by one run and pinned in the
next, on a real Triton autotuner (the interpreter, whose autotuner cannot time configs:
a pinned key must not be timed at all)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from .test_gpu_scripts import benchmark_module

N = 64


@triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["n"])
@triton.jit
def _fill_block(out, n, BLOCK: tl.constexpr):
    """Writes the BLOCK it was launched with: the config the autotuner chose."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + offs, tl.full([BLOCK], BLOCK, tl.float32), mask=offs < n)


def _launch() -> torch.Tensor:
    out = torch.zeros(N)
    _fill_block[lambda meta: (triton.cdiv(N, meta["BLOCK"]),)](out, N)
    return out


@pytest.fixture()
def picks():
    _fill_block.cache.clear()
    with benchmark_module("picks") as module:
        yield module
    _fill_block.cache.clear()


def test_a_run_records_its_picks_and_the_next_pins_them(picks, monkeypatch, tmp_path: Path) -> None:
    # first run: the autotuner times both configs (here a timer that finds BLOCK 16 faster) and picks
    timed: list[int] = []

    def timing(self, *args, config, **kwargs):
        timed.append(config.kwargs["BLOCK"])
        return [1.0 if config.kwargs["BLOCK"] == 16 else 2.0] * 3

    monkeypatch.setattr(Autotuner, "_bench", timing)
    assert torch.equal(_launch(), torch.full((N,), 16.0))
    assert sorted(timed) == [16, 32]
    picks.record(tmp_path / picks.FILE)
    written = json.loads((tmp_path / picks.FILE).read_text())
    assert written["machine"] == picks.machine()
    name = f"{__name__}._fill_block"
    (key, config), = written["picks"][name]
    assert key[0] == N and config["kwargs"] == {"BLOCK": 16}

    # the next run, as a fresh process would: nothing cached, the file's pick (edited to 32 so
    # that its use shows) pinned, and any timing an error
    written["picks"][name][0][1]["kwargs"] = {"BLOCK": 32}
    (tmp_path / picks.FILE).write_text(json.dumps(written))
    _fill_block.cache.clear()

    def no_timing(self, *args, **kwargs):
        raise AssertionError("a pinned key was timed")

    monkeypatch.setattr(Autotuner, "_bench", no_timing)
    pinned = picks.pin_from(tmp_path, log=lambda msg: None, committed=tmp_path)
    assert pinned is not None
    assert torch.equal(_launch(), torch.full((N,), 32.0))
    assert _fill_block.best_config.kwargs == {"BLOCK": 32}


def test_picks_of_another_machine_are_not_used(picks, tmp_path: Path) -> None:
    other = {**picks.machine(), "triton": "0.0.0"}
    (tmp_path / picks.FILE).write_text(json.dumps({"machine": other, "picks": {"x": [[[1], {}]]}}))
    assert picks.load(tmp_path / picks.FILE) is None
    assert picks.pin_from(tmp_path, log=lambda msg: None, committed=tmp_path / "nothing") is None


def test_a_fresh_results_folder_starts_from_the_committed_picks(picks, tmp_path: Path) -> None:
    """`--out` somewhere new: the committed picks of this machine are copied there and
    pinned (this run's then join them there); another machine's committed picks are not."""
    committed, fresh = tmp_path / "results", tmp_path / "out" / "models"
    committed.mkdir()
    pick = {"kwargs": {"BLOCK": 32}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    theirs = {"machine": picks.machine(), "designs": ["kda"],
              "picks": {f"{__name__}._fill_block": [[[N, "torch.float32"], pick]]}}
    (committed / picks.FILE).write_text(json.dumps(theirs))
    messages: list[str] = []
    pinned = picks.pin_from(fresh, log=messages.append, committed=committed)
    assert pinned == theirs["picks"] and json.loads((fresh / picks.FILE).read_text()) == theirs
    assert picks.covered(fresh / picks.FILE) == {"kda"}
    assert "a copy of the committed picks" in messages[0]
    assert torch.equal(_launch(), torch.full((N,), 32.0))  # pinned: the committed pick runs

    other = tmp_path / "other"
    (committed / picks.FILE).write_text(json.dumps({**theirs, "machine": {**theirs["machine"], "triton": "0.0.0"}}))
    assert picks.pin_from(other, log=lambda msg: None, committed=committed) is None
    assert not (other / picks.FILE).exists()


def test_recording_merges_with_the_file(picks, tmp_path: Path) -> None:
    """Runs of different designs add up: a key another run recorded stays; this run's new
    keys are added, its known ones not doubled."""
    earlier = {"machine": picks.machine(), "picks": {"fla.ops.other.kernel": [[[128, "torch.bfloat16"],
                                                                                 {"kwargs": {"BT": 64}}]]}}
    (tmp_path / picks.FILE).write_text(json.dumps(earlier))
    _fill_block.cache[(N, "torch.float32")] = triton.Config({"BLOCK": 16})
    first = picks.record(tmp_path / picks.FILE)
    assert picks.record(tmp_path / picks.FILE) == first >= 2
    merged = json.loads((tmp_path / picks.FILE).read_text())["picks"]
    assert merged["fla.ops.other.kernel"] == earlier["picks"]["fla.ops.other.kernel"]
    assert merged[f"{__name__}._fill_block"] == [[[N, "torch.float32"], {
        "kwargs": {"BLOCK": 16}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}]]


def test_keys_that_are_not_plain_data_are_left_out(picks, tmp_path: Path) -> None:
    _fill_block.cache[(N, object())] = triton.Config({"BLOCK": 16})
    _fill_block.cache[(N, "torch.float32")] = triton.Config({"BLOCK": 32})
    mine = picks.current()[f"{__name__}._fill_block"]
    assert mine == [[[N, "torch.float32"], {"kwargs": {"BLOCK": 32}, "num_warps": 4, "num_stages": 3, "num_ctas": 1,
                                           "maxnreg": None}]]
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    messages: list[str] = []
    picks.keep(blocked, log=messages.append)  # a "folder" that is a file: logged, not raised into the run
    assert messages[0].startswith("autotune picks not kept:")


def test_the_picks_name_the_designs_they_cover(picks, tmp_path: Path) -> None:
    """A run names the designs whose peer ran whole steps (`keep(designs=)`); runs add up,
    and picks of another machine (or a file from before designs were named) cover none."""
    path = tmp_path / picks.FILE
    assert picks.covered(path) == set()
    path.write_text(json.dumps({"machine": picks.machine(), "picks": {}}))
    assert picks.covered(path) == set()
    picks.record(path, ["deltanet"])
    picks.keep(tmp_path, log=lambda msg: None, designs=["kda"])
    picks.record(path)
    assert picks.covered(path) == {"deltanet", "kda"}
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "machine": {**data["machine"], "triton": "0.0.0"}}))
    assert picks.covered(path) == set()
    picks.record(path, ["gla"])  # another machine's file is replaced, not merged
    assert picks.covered(path) == {"gla"}
