"""The GPU scripts of `benchmarks/` on the CPU interpreter (`--smoke`), so that the commands
a GPU call runs cannot rot: each runs end to end on tiny shapes and writes its results;
and the pieces they share (plans from the specs, the floors, the peer's mapping) are
checked against independent numbers."""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@contextlib.contextmanager
def benchmark_module(name: str):
    """`benchmarks/<name>.py` imported by its name (the scripts import `common` so), the
    path and the modules put back afterwards."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
        for module in (name, "common", "picks", "anatomy", "models"):
            sys.modules.pop(module, None)


def test_kernel_times_smoke_writes_every_row(tmp_path: Path) -> None:
    with benchmark_module("kernel_times") as bench:
        results = bench.main(["--smoke", "--plans", "deltanet,kda,osgdn-apf", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "kernel_times.json").read_text())
    rows = [(r["plan"], r["gates"]) for r in written["rows"]]
    # kda's channel gate is timed in every regime, osgdn-apf's scalar gate with mild gates only
    assert rows == [("deltanet", "none"), ("kda", "mild"), ("kda", "strong"), ("kda", "init"), ("osgdn-apf", "mild")]
    assert all(not r["errors"] and set(r["ms"]) == {"forward", "forward+backward"} for r in results["rows"])
    for r in written["rows"]:  # one forward+backward profiled, heaviest kernel first
        kernels = r["kernels"]["ours"]
        assert kernels and all(ms >= 0 and n >= 1 for _, n, ms in kernels)
        assert [ms for *_, ms in kernels] == sorted((ms for *_, ms in kernels), reverse=True)
    assert "Per kernel, one profiled forward+backward" in (tmp_path / "kernel_times.md").read_text()
    assert "| kda | strong |" in (tmp_path / "kernel_times.md").read_text()


def test_kernel_times_against_an_earlier_copy_of_the_kernels(tmp_path: Path) -> None:
    """`--against DIR`: an earlier copy of `kernels/` (here the current one, copied) timed
    beside ours, and its rows in a table of their own."""
    import shutil

    shutil.copytree(BENCHMARKS.parent / "kernels", tmp_path / "copy" / "kernels")
    with benchmark_module("kernel_times") as bench:
        results = bench.main(["--smoke", "--plans", "gated-deltanet", "--against", str(tmp_path / "copy"),
                              "--out", str(tmp_path)])
        sys.modules.pop("kernels_before", None)
    assert set(results["rows"][0]["ms"]["forward"]) == {"ours", "before"} and not results["rows"][0]["errors"]
    assert "| gated-deltanet | mild |" in (tmp_path / "kernel_times.md").read_text().split("Against the kernels of")[1]


def test_floors_count_the_kernels_products() -> None:
    """DeltaNet's forward floor, counted here by hand from the kernel's products per chunk
    (`docs/kernel.md`): A = K~ W~^T, P = Tinv K~, X = Tinv Z (three [64, 64] x 64-wide
    products), Y = X - P S_0 and S += E~^T Y, the read-out Q~ S_0, M_E and M_E Y; and the
    block-substitution inverse's 16 products of 16 x 16 tiles."""
    with benchmark_module("kernel_times") as bench:
        b = next(p for p in bench.PLANS if p.name == "deltanet")
        B, T, H, K, V = 1, 128, 2, 32, 48
        x = bench.make_inputs(b.plan, B, T, H, K, V, torch.float32, "cpu")
        floors = bench.floors(b, x, dict(B=B, T=T, H=H, K=K, V=V))
    L = C = 64
    per_chunk = 2 * (L * K * L + L * L * K + L * L * V + 2 * L * K * V + C * K * V + C * K * L + C * L * V) + 16 * 2 * 16**3
    assert floors["flops_fwd"] == B * H * (T // C) * per_chunk
    read = sum(t.numel() * 4 for t in x.values())
    assert floors["bytes_fwd"] == read + B * T * H * V * 4


def test_plans_come_from_the_specs() -> None:
    with benchmark_module("common") as common:
        plans = {b.name: b.plan for b in common.PLANS}
    assert (plans["gated-deltaproduct-4"].n_h, plans["gated-deltaproduct-4"].gate) == (4, "scalar")
    assert (plans["gla-scalar"].transition, plans["gla-scalar"].gate) == ("diagonal", "scalar")
    assert plans["osgdn"].preconditioner is not None and not plans["osgdn"].preconditioner.apf
    assert plans["deltaproduct-2"].beta_scale == 2.0  # the spec's beta_range [0, 2]


def test_every_gpu_check_plan_lowers() -> None:
    """gpu_check's plans are specs with overrides; one the spec rules refuse would stop the
    whole check on the GPU before it ran anything."""
    with benchmark_module("gpu_check") as check:
        plans = {b.name: b.plan for b in check.CHECK_PLANS}
    assert (plans["linear-attention"].transition, plans["linear-attention"].gate) == ("diagonal", "none")
    assert (plans["rwkv7-scalar-2"].n_h, plans["rwkv7-scalar-2"].gate) == (2, "scalar")


@pytest.mark.parametrize("regime, least, most", [
    ("mild", 1.0, 1.0),  # a few nats a chunk
    ("strong", 1.0, 1.0),  # trained KDA layers: about 52 nats a chunk, under twice the bound
    # an initialised model's (Mamba2's time steps): a head whose fastest channel decays past
    # twice the bound in a chunk (rate times time step near 16 x 0.1) takes the sub-chunk path
    ("init", 0.5, 1.0),
    ("fast", 0.0, 0.3),  # gpu_check's: about 7 nats a token, only the slowest heads fit
])
def test_gate_regimes_take_the_paths_they_are_named_for(regime: str, least: float, most: float) -> None:
    """The share of (chunk, head) pairs that `decay.py`'s path 1 takes: the chunk decays by
    at most twice the factorization bound (e^80) in every channel; the gate in float32."""
    with benchmark_module("common") as common:
        kda = next(b.plan for b in common.PLANS if b.name == "kda")
        g = common.make_inputs(kda, 2, 1024, 16, 64, 64, torch.bfloat16, "cpu", gates=regime)["g"]
    assert g.dtype == torch.float32
    chunk = -g.double().reshape(2, 16, 64, 16, 64).sum(2).amax(-1)  # [B, chunk, H]: the most any channel decays
    assert least <= (chunk <= 80).double().mean().item() <= most


def test_steep_gates_take_the_sub_chunk_path_everywhere() -> None:
    """`gpu_check.py`'s steep gates: every (chunk, head) decays past path 1's limit (80 nats
    in some channel), and every 16-token sub-chunk's cumulative gate stays within path 2's
    bound (40) of its midpoint, halfway between its first and last rows'."""
    with benchmark_module("common") as common:
        kda = next(b.plan for b in common.PLANS if b.name == "kda")
        g = common.make_inputs(kda, 2, 1024, 4, 64, 64, torch.bfloat16, "cpu", gates="steep")["g"]
    G = g.double().reshape(2, 16, 64, 4, 64).cumsum(2)  # [B, chunk, token, H, K], within each chunk
    assert bool((-G[:, :, -1]).amax(-1).gt(80).all())  # the most any channel decays, per chunk and head
    sub = G.reshape(2, 16, 4, 16, 4, 64)
    mid = 0.5 * (sub[:, :, :, :1] + sub[:, :, :, -1:])
    assert bool((sub - mid).abs().amax().le(40))


def test_fast_gates_take_the_exact_path_almost_everywhere() -> None:
    """`gpu_check.py`'s fast gates: most 16-token sub-chunks of every head decay past path
    2's bound (40 nats of their midpoint in some channel), so the exact path runs."""
    with benchmark_module("common") as common:
        kda = next(b.plan for b in common.PLANS if b.name == "kda")
        g = common.make_inputs(kda, 2, 1024, 4, 64, 64, torch.bfloat16, "cpu", gates="fast")["g"]
    sub = g.double().reshape(2, 16, 4, 16, 4, 64).cumsum(3)  # [B, chunk, sub-chunk, token, H, K]
    mid = 0.5 * (sub[:, :, :, :1] + sub[:, :, :, -1:])
    within = (sub - mid).abs().amax((3, 5)).le(40)  # [B, chunk, sub-chunk, H]
    assert within.double().mean().item() < 0.5


def test_fla_mapping_covers_its_recurrences() -> None:
    """Which fla op each plan maps to (None where fla has no such recurrence)."""
    with benchmark_module("common") as common:
        ops = {b.name: common.fla_op(b.plan) for b in common.PLANS}
    assert {n for n, op in ops.items() if op is None} == {"osdn", "osdn-apf", "osgdn", "osgdn-apf", "oskda"}
    assert (ops["deltanet"], ops["gated-deltanet"], ops["kda"], ops["rwkv7"]) == ("delta_rule", "gated_delta_rule", "kda", "rwkv7")
    assert (ops["gla"], ops["gla-scalar"], ops["deltaproduct-3"]) == ("gla", "simple_gla", "gated_delta_product")


@pytest.mark.slow
def test_gpu_check_smoke(tmp_path: Path) -> None:
    with benchmark_module("gpu_check") as check:
        results = check.main(["--smoke", "--plans", "deltanet,kda,osgdn-apf", "--dtypes", "float32", "--out", str(tmp_path)])
    labels = [c["check"] for c in results["checks"]]
    assert labels == ["path:deltanet/mild/float32", "naive:deltanet/mild/float32", "path:kda/mild/float32",
                      "path:kda/strong/float32", "path:kda/steep/float32", "path:kda/fast/float32",
                      "naive:kda/mild/float32", "packed:kda/mild/float32",
                      "path:osgdn-apf/mild/float32", "packed:osgdn-apf/mild/float32"]
    assert all(c["pass"] for c in results["checks"]), results["checks"]
    assert any(k.startswith("alone ") for k in results["checks"][7]["errors"])  # each packed sequence alone
    assert [s["finite"] for s in results["stability"]] == [True, True]
    assert json.loads((tmp_path / "gpu_check.json").read_text())["checks"] == json.loads(json.dumps(results["checks"]))
    # a later call checks one plan again and keeps the rest
    with benchmark_module("gpu_check") as check:
        merged = check.main(["--smoke", "--plans", "deltanet", "--dtypes", "float32", "--merge", "--out", str(tmp_path)])
    assert sorted(c["check"] for c in merged["checks"]) == sorted(labels)
    assert [c["check"] for c in merged["checks"]][-2:] == ["path:deltanet/mild/float32", "naive:deltanet/mild/float32"]
    assert merged["not_run"] == [] and len(merged["earlier_machines"]) == 1


def test_sweep_smoke_screens_each_setting(tmp_path: Path) -> None:
    with benchmark_module("sweep") as sweep:
        results = sweep.main(["--smoke", "--plans", "deltanet", "--set", "backward_bk=16", "--set", "scan_prefetch=2",
                              "--out", str(tmp_path / "sweep.json")])
        with pytest.raises(SystemExit, match="NAME=V1,V2"):
            sweep.parse_settings(["backward_warp=4"])
    assert [r["setting"] for r in results["rows"]] == ["table", "backward_bk=16", "scan_prefetch=2"]
    assert all(r["worst_vs_table"] < 1e-4 and not r["suspect"] for r in results["rows"])


def test_init_gates_are_those_of_each_specs_initialised_layer() -> None:
    """The kernel benchmark's `init` regime is what the spec's own layer, as the LM
    initialises it, forms from unit-RMS rows: KDA's gate with Mamba2's time steps decays by
    a fraction of a nat a token on average and keeps every 16-token sub-chunk within the
    factorization bound (40 nats in every channel: never the exact path); RWKV-7's own
    decay stays under e^{-1/2} a token and GLA's is about 1/16 of log 2, every 64-token
    chunk within path 1's limit (80). The same seed gives the same gates."""
    import math

    import archspec
    from archspec.blocks import build_model

    specs = BENCHMARKS.parent / "specs" / "models"
    with benchmark_module("common") as common:
        for name in ("kda", "rwkv7", "gla"):
            # 32 heads: the mean decay of a few heads is mostly their random rates'
            spec = archspec.load_spec(specs / f"{name}.yaml", [("mixer.heads", 32), ("mixer.head_dim", 16),
                                                               ("model.d_model", common.INIT_GATE_D_MODEL),
                                                               ("model.layers", 3)])
            plan = archspec.lower(spec)
            g = common.make_inputs(plan.mixer, 1, 256, 32, 16, 16, torch.float32, "cpu", gates="init")["g"].detach()
            again = common.make_inputs(plan.mixer, 1, 256, 32, 16, 16, torch.float32, "cpu", gates="init")["g"]
            assert torch.equal(g, again.detach()), name
            # the model's own middle layer (RWKV-7's initial speeds depend on the depth),
            # initialised by the LM, on unit-RMS rows: the same spread
            torch.manual_seed(0)
            gate = build_model(plan).blocks[1].mixer.gate
            with torch.no_grad():
                own = gate(torch.randn(1, 256, common.INIT_GATE_D_MODEL, generator=torch.Generator().manual_seed(1)))
            assert g.shape == own.shape
            ratio = g.mean() / own.mean()
            assert 0.67 < ratio < 1.5, (name, float(g.mean()), float(own.mean()))
            chunk_decay = -g.view(1, 4, 64, 32, 16).sum(2)  # per 64-token chunk, head and channel
            sub_chunk_decay = -g.view(1, 16, 16, 32, 16).sum(2)  # per 16-token sub-chunk
            assert bool(sub_chunk_decay.max() <= 40) and (name == "kda" or bool(chunk_decay.max() <= 80)), name
            if name == "kda":
                assert 0.01 < -g.mean() < 0.5
            if name == "rwkv7":
                assert g.min() >= -math.exp(-0.5) and g.max() < 0
            if name == "gla":
                assert -g.mean() == pytest.approx(math.log(2) / 16, rel=0.2)
