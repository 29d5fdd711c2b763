"""`benchmarks/decode.py`: the smoke mode end to end on the CPU (ours only, tiny size), the
bytes floor of a decoding step against the cost model's counts, and a peer whose
`generate` refuses recorded while ours is still timed."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from .test_gpu_scripts import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("decode") as module:
        yield module
    sys.modules.pop("models", None)


def test_smoke_run_writes_every_batch(bench, tmp_path):
    quick = ["--smoke", "--out", str(tmp_path), "--rounds", "1"]
    assert bench.main([*quick, "--specs", "gated-deltanet", "--warm-workers", "1"]) == 0  # warmed in a worker
    assert bench.main([*quick, "--specs", "osdn-apf", "--merge"]) == 0  # a run split over two calls
    record = json.loads((tmp_path / "decode.json").read_text())
    assert record["machine"]["torch"] == torch.__version__ and record["bandwidth_gb_s"] > 0
    # fla is not asked (--smoke), yet the design it has no model of says so at every batch.
    refused = [r for r in record["rows"] if r["impl"] == "fla"]
    assert {(r["spec"], r["batch"]) for r in refused} == {("osdn-apf", 1), ("osdn-apf", 3)}
    assert all(r["refused"] == "flash-linear-attention has no model of this design" for r in refused)
    rows = [r for r in record["rows"] if r["impl"] != "fla"]
    assert {(r["spec"], r["batch"]) for r in rows} == {(s, b) for s in ("gated-deltanet", "osdn-apf") for b in (1, 3)}
    timed = [r for r in rows if r["refused"] is None]
    # A shared CPU can make a one-token call slower than an eight-token one; such a row says
    # so instead of printing a negative rate. Most rows are timed.
    assert len(timed) >= 3 and all(r["refused"].startswith("timing:") for r in rows if r not in timed)
    for r in rows:
        assert r["impl"] == "ours" and r["prompt"] == 16 and r["new_tokens"] == 8 and r["floor_ms"] > 0
    for r in timed:
        assert r["tokens_per_s"] > 0 and r["ms_per_token"] > 0 and r["prefill_ms"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 7 * 1e3 / (7 * r["ms_per_token"]))
        assert min(r["whole_ms_all"]) - min(r["first_ms_all"]) == pytest.approx(7 * r["ms_per_token"], abs=2e-3)
    table = (tmp_path / "decode.md").read_text()
    assert all(f"| {r['design']} | {r['spec']} | {r['batch']} | {r['tokens_per_s']:,.0f} " in table for r in timed)
    assert "| osdn-apf | osdn-apf | 1 | " in table and "(fla: flash-linear-attention has no model of this design)" in table
    assert bench.main([*quick, "--specs", "nonesuch"]) == 2
    assert bench.main([*quick, "--new-tokens", "1"]) == 2


def test_the_floor_counts_weights_once_and_the_state_twice(bench):
    """float32 on the CPU: every weight but the embedding table, B of its rows, the
    recurrent state (S, conv tails, OSDN's d) read and written, a KV cache read."""
    from archspec.blocks.cost import count_params

    run = bench.SMOKE
    plan = bench.load_plan(bench.SPECS / "osdn-apf.yaml", run.size)
    model = bench.ours(plan, run).model
    d, vocab, B = plan.d_model, plan.vocab_size, 3
    m = plan.mixer
    per_layer = 4 * (m.heads * m.head_dim * m.value_dim + m.heads * m.head_dim)  # S and d, float32
    per_layer += 4 * (m.short_conv - 1) * m.heads * (2 * m.head_dim + m.value_dim)  # q, k, v tails
    expected = 4 * (count_params(plan) - vocab * d + B * d) + 2 * B * plan.layers * per_layer
    assert bench.step_bytes(model, plan, B, context=16) == expected

    import dataclasses

    run = dataclasses.replace(run, size=dataclasses.replace(run.size, layers=4))  # 3:1, so layer 3 is attention
    hybrid = bench.load_plan(bench.SPECS / "qwen3-next-hybrid.yaml", run.size)
    attention = [p for p in hybrid.layer_plans if getattr(p, "kind", "") == "attention"]
    assert attention
    recurrent_only = bench.step_bytes(bench.ours(hybrid, run).model, hybrid, B, context=0)
    # each attention layer adds its keys and values of 16 tokens, read once
    kv = sum(2 * a.kv_heads * a.head_dim * 16 * 4 for a in attention)
    assert bench.step_bytes(bench.ours(hybrid, run).model, hybrid, B, context=16) == recurrent_only + B * kv


def test_a_refusing_peer_is_recorded_and_ours_still_timed(bench):
    run = bench.SMOKE
    plan = bench.load_plan(bench.SPECS / "kda.yaml", run.size)
    ours = bench.ours(plan, run)

    def refuse(prompt, n):
        raise RuntimeError("generate refuses on this machine")

    peer = bench.Contender("fla", torch.nn.Linear(2, 2), refuse)
    rows = {name: bench.Row("kda", "kda", name, 2, run.prompt, run.new_tokens) for name in ("ours", "fla")}
    prompt = torch.randint(run.size.vocab, (2, run.prompt))
    bench.time_side_by_side([ours, peer], prompt, run, rounds=1, rows=rows)
    assert rows["fla"].refused == "RuntimeError: generate refuses on this machine" and rows["fla"].tokens_per_s is None
    assert rows["ours"].refused is None and rows["ours"].tokens_per_s > 0
