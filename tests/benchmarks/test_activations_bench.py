"""`benchmarks/activations.py` at models.py's smoke size on the CPU: the saved bytes per
token of the sites whose size follows from the plan alone, the total against the whole
graph's own count, and a spec with no form at the size left out with its reason."""

from __future__ import annotations

import json

from pathlib import Path

import pytest

from .test_gpu_scripts import benchmark_module

REPO = Path(__file__).resolve().parents[2]
SMOKE_TOKENS = "64,128"  # two lengths of whole 64-token chunks


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("activations")
    with benchmark_module("activations") as bench:
        status = bench.main(["--size", "smoke", "--tokens", SMOKE_TOKENS, "--out", str(out),
                             "--specs", "deltanet,gated-deltanet,jet-nemotron-placement"])
    assert status == 0
    return json.loads((out / "activations.json").read_text()), (out / "activations.md").read_text()


def site(spec: dict, module: str, saved_by: str) -> dict:
    return next(r for r in spec["rows"] if r["module"].startswith(module) and r["saved_by"].endswith(saved_by))


def test_sites_the_plan_sizes(record):
    import archspec
    from archspec.blocks.mlp import mlp_hidden_size

    data, _ = record
    size = data["size"]
    d_model, heads, head_dim = size["d_model"], size["heads"], size["head_dim"]
    bf16, f32 = 2, 4
    for name, value_width in (("deltanet", 1), ("gated-deltanet", 2)):  # Gated DeltaNet: expand_v 2
        spec = data["specs"][name]
        plan = archspec.lower(archspec.load_spec(REPO / "specs" / "models" / f"{name}.yaml"))
        hidden = mlp_hidden_size(plan.mlp, d_model, plan.mlp_ratio)
        # SwiGLU keeps its gate and up projections, the product is formed again
        assert site(spec, "blocks.mlp ", "swiglu_linear")["bytes_per_token"] == 2 * hidden * bf16
        # no norm keeps the float32 residual stream, only its bfloat16 output (which the
        # projection after a pre-norm keeps anyway) and one float a row
        final = {r["dtype"]: r["bytes_per_token"] for r in spec["rows"]
                 if r["module"].startswith("model ") and r["saved_by"].endswith("add_rms_norm")}
        assert final == pytest.approx({"float32": f32, "bfloat16": d_model * bf16}, abs=1)
        assert not any(r["dtype"] == "float32" and f"T x {d_model}" in r["shapes"] for r in spec["rows"])
        # the value projection before its short convolution
        v = site(spec, "blocks.mixer.conv.v ", "short_conv")
        assert v["bytes_per_token"] == heads * head_dim * value_width * bf16 and v["shapes"] == [
            f"T x {heads * head_dim * value_width}"]
        assert site(spec, "embed ", "hidden_states")["bytes_per_token"] == 8  # the token ids, int64
        assert spec["step_activations_gb"] == pytest.approx(spec["bytes_per_token"] * 16_384 / 1e9)
    # The read-out keeps the output norm's input (Gated DeltaNet's values twice as wide), not
    # the normalised rows `o_proj` reads nor Gated DeltaNet's output gate: those are formed
    # again (the gate from `g_proj`'s input, which that projection keeps anyway).
    read_out = {name: next(r for r in data["specs"][name]["rows"]
                           if r["saved_by"].endswith("rms_norm_linear") and r["dtype"] == "bfloat16")
                for name in ("deltanet", "gated-deltanet")}
    assert read_out["deltanet"]["bytes_per_token"] == heads * head_dim * bf16
    assert read_out["gated-deltanet"]["bytes_per_token"] == 2 * heads * head_dim * bf16
    assert not any(r["module"].startswith("blocks.mixer.o_proj ") for s in data["specs"].values() for r in s["rows"])


def test_rows_add_up_to_the_total(record):
    data, table = record
    for name, spec in data["specs"].items():
        assert sum(r["bytes_per_token"] for r in spec["rows"]) == pytest.approx(spec["bytes_per_token"])
        assert f"| {name} | {spec['params']:,} | {spec['bytes_per_token']:,.0f} |" in table


def test_a_spec_without_a_form_at_the_size_is_left_out(record):
    data, table = record
    assert set(data["specs"]) == {"deltanet", "gated-deltanet"}
    assert "layer 14 is past the last layer" in data["unfit"]["jet-nemotron-placement"]
    assert "No form at this size: jet-nemotron-placement" in table


def test_merge_keeps_the_specs_not_counted_again_with_their_commit(record, tmp_path):
    data, _ = record
    earlier = {**data, "machine": {**data["machine"], "commit": "0123abc"}}
    earlier["specs"] = {name: {k: v for k, v in spec.items() if k != "measured"} for name, spec in data["specs"].items()}
    (tmp_path / "activations.json").write_text(json.dumps(earlier))
    with benchmark_module("activations") as bench:
        assert bench.main(["--size", "smoke", "--tokens", SMOKE_TOKENS, "--out", str(tmp_path),
                           "--specs", "deltanet", "--merge"]) == 0
    merged = json.loads((tmp_path / "activations.json").read_text())
    assert list(merged["specs"]) == ["deltanet", "gated-deltanet"]
    assert merged["specs"]["gated-deltanet"]["measured"] == {"commit": "0123abc"}
    assert merged["specs"]["gated-deltanet"]["rows"] == data["specs"]["gated-deltanet"]["rows"]
    assert merged["specs"]["deltanet"]["measured"] == {"commit": merged["machine"]["commit"]}
    assert merged["specs"]["deltanet"]["bytes_per_token"] == data["specs"]["deltanet"]["bytes_per_token"]
    assert "jet-nemotron-placement" in merged["unfit"]
    table = (tmp_path / "activations.md").read_text()
    assert "Counted at several commits (`--merge`)" in table and "gated-deltanet: 0123abc" in table
    with benchmark_module("activations") as bench:  # another size cannot be merged into these counts
        with pytest.raises(SystemExit, match="another size or token lengths"):
            bench.main(["--size", "smoke", "--tokens", "64,192", "--out", str(tmp_path), "--specs", "deltanet", "--merge"])


def test_a_run_cut_off_after_one_spec_keeps_the_earlier_counts(record, tmp_path):
    """The file is written after every spec: once the first of two specs is through, it holds
    that spec counted now and the earlier file's count of the second (with its commit),
    so a run stopped there loses nothing."""
    data, _ = record
    earlier = {**data, "machine": {**data["machine"], "commit": "0123abc"}}
    earlier["specs"] = {name: {k: v for k, v in spec.items() if k != "measured"} for name, spec in data["specs"].items()}
    with benchmark_module("activations") as bench:
        now = {**data, "specs": {}, "failed": {}, "unfit": {}}
        counted = {"deltanet": {**data["specs"]["deltanet"], "measured": {"commit": "4567def"}}}
        after_one = bench.as_counted(now, earlier, counted, {}, ["deltanet"])
        fresh = bench.as_counted(now, None, counted, {"gated-deltanet": "Traceback ..."}, ["deltanet", "gated-deltanet"])
    assert after_one["specs"]["deltanet"]["measured"] == {"commit": "4567def"}
    assert after_one["specs"]["gated-deltanet"]["measured"] == {"commit": "0123abc"}
    assert list(fresh["specs"]) == ["deltanet"] and set(fresh["failed"]) == {"gated-deltanet"}
