"""The GPU scripts' smoke modes on the CPU interpreter, so that the commands planned for a
time-boxed GPU call (`docs/gpu-session.md`) cannot rot between sessions: the benchmark and
the correctness check run end to end on tiny shapes, the budget stops a run cleanly with
its results written, and the warm-up workers compile, time out and shard configs."""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def scripts():
    """`benchmarks/kernels.py` as the module `kernels` (the check script imports it so, and
    the warm-up workers unpickle jobs by that name); the repository's `kernels/` folder
    could shadow it, so it is swapped out meanwhile."""
    saved = sys.modules.pop("kernels", None)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        bench = importlib.import_module("kernels")
        assert Path(bench.__file__).parent == BENCHMARKS
        yield bench, importlib.import_module("triton_gpu_check")
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop("kernels", None)
        if saved is not None:
            sys.modules["kernels"] = saved


@contextlib.contextmanager
def benchmark_module(name: str):
    """`benchmarks/<name>.py` imported as `name`, with `benchmarks/kernels.py` as `kernels`
    as the `scripts` fixture has it; the path and modules are put back afterwards."""
    saved = sys.modules.pop("kernels", None)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop(name, None)
        sys.modules.pop("kernels", None)
        if saved is not None:
            sys.modules["kernels"] = saved


def test_benchmark_smoke_writes_every_plan(scripts, tmp_path: Path) -> None:
    bench, _ = scripts
    results = bench.main(["--smoke", "--plans", "deltanet,osdn-apf-gdn", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "kernels.json").read_text())
    assert list(written["plans"]) == ["deltanet", "osdn-apf-gdn"] == list(results["plans"])
    for entry in written["plans"].values():
        assert {row["impl"]: row["error"] for row in entry["rows"]} == {"triton": "", "torch": ""}
        assert entry["floors"]["floor_fwdbwd_ms"] > entry["floors"]["floor_fwd_ms"] > 0
    assert "| deltanet |" in (tmp_path / "kernels.md").read_text()


def test_benchmark_budget_and_resume(scripts, tmp_path: Path) -> None:
    """No plan starts without the time it needs; a later call measures only the rest."""
    bench, _ = scripts
    first = bench.main(["--smoke", "--plans", "deltanet,gdn", "--out", str(tmp_path), "--budget-s", "1", "--min-plan-s", "5"])
    assert first["plans"] == {} and "budget" in first["stopped"]
    bench.main(["--smoke", "--plans", "deltanet", "--out", str(tmp_path)])
    merged = bench.main(["--smoke", "--plans", "deltanet,gdn", "--out", str(tmp_path), "--resume", str(tmp_path / "kernels.json")])
    assert list(merged["plans"]) == ["deltanet", "gdn"] and merged["resumed_from"]


def test_forward_and_backward_takes_fixed_output_gradients(scripts, monkeypatch) -> None:
    """The timed step runs the backward from given `dO`, `dS`: no loss kernels in it, and
    the gradients are those of `<o, dO> + <s, dS>`."""
    import torch

    bench, _ = scripts
    x = torch.randn(3, 4, requires_grad=True)
    seen = []
    fn = lambda: (2 * x, x.sum(0))  # noqa: E731
    real_grad = torch.autograd.grad

    def grad(outputs, inputs, grad_outputs, **kw):
        seen.append((outputs, grad_outputs))
        return real_grad(outputs, inputs, grad_outputs, **kw)

    monkeypatch.setattr(torch.autograd, "grad", grad)
    bench._forward_and_backward(fn, {"x": x})()
    (outputs, (d_o, d_s)), = seen
    assert [t.shape for t in outputs] == [(3, 4), (4,)] and d_o.shape == (3, 4) and d_s.shape == (4,)
    assert outputs[0].grad_fn.name() == "MulBackward0"  # the output itself, no cast or square after it


def test_rows_timed_with_a_loss_in_the_step_are_not_mixed_in(scripts, tmp_path: Path) -> None:
    """Files before session 8 timed forward+backward with a loss inside the step: `--resume`
    measures again, and `--peers` says their forward+backward was timed so."""
    bench, _ = scripts
    bench.main(["--smoke", "--plans", "deltanet", "--out", str(tmp_path)])
    old = json.loads((tmp_path / "kernels.json").read_text())
    del old["backward"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    again = bench.main(["--smoke", "--plans", "deltanet", "--out", str(tmp_path), "--resume", str(tmp_path / "old.json")])
    assert "resumed_from" not in again and list(again["plans"]) == ["deltanet"]
    bench.main(["--smoke", "--plans", "deltanet", "--no-torch", "--out", str(tmp_path), "--peers", str(tmp_path / "old.json")])
    assert "timed with a loss in the step" in (tmp_path / "kernels.md").read_text()


def test_deadline_interrupts_python_code(scripts) -> None:
    bench, _ = scripts
    start = time.monotonic()
    with pytest.raises(bench.OutOfTime), bench.deadline(0.2):
        while True:
            time.sleep(0.01)
    assert time.monotonic() - start < 1.0


def test_check_gaps_smoke(scripts, tmp_path: Path) -> None:
    """Packed batches (against float64 and each sequence alone), float16, n_h = 4."""
    _, check = scripts
    results = check.main(["--smoke", "--gaps", "--plans", "gated-deltaproduct-2,deltanet,deltaproduct-4", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "triton_gpu_check_gaps.json").read_text())
    assert set(written["checks"]) == {"packed:gated-deltaproduct-2/bfloat16", "packed:gated-deltaproduct-2/float32",
                                      "path:deltanet/float16", "path:deltaproduct-4/bfloat16", "path:deltaproduct-4/float32"}
    assert all(r["pass"] for r in results["checks"].values()), results["checks"]
    packed = written["checks"]["packed:gated-deltaproduct-2/float32"]
    assert packed["alone_vs_packed"]["o"] < 1e-6 and "d_initial_state" in packed["alone_vs_packed"]


def test_check_default_smoke(scripts, tmp_path: Path) -> None:
    _, check = scripts
    results = check.main(["--smoke", "--plans", "gdn", "--out", str(tmp_path)])
    assert set(results["checks"]) == {"path:gdn/bfloat16", "path:gdn/float32", "naive:gdn/float32"}
    assert all(r["pass"] for r in results["checks"].values())
    assert all(s["finite"] for s in results["stability"])


def test_warm_pool_compiles_times_out_and_shards(scripts) -> None:
    """Workers run jobs (here on the CPU interpreter), a stopped pool reports a job as not
    finished instead of waiting, and a shard (1, 3) of 7 autotune configs is 1 and 4."""
    bench, _ = scripts
    pool = bench.WarmPool(1)
    try:
        job = bench.WarmJob("gdn", "triton", "float32", (1, 32, 1, 16, 16), states=True, lengths=(20, 12), device="cpu")
        with pool.stopped():
            pending = pool.submit([job])
            assert pool.wait(pending, 0.5)[0][1].startswith(bench.NOT_DONE)
        assert pool.wait(pending, 60)[0][1] == "ok"
        assert pool.pool.apply(_shard_of_seven) == [1, 4]
    finally:
        pool.close()


def _shard_of_seven() -> list[int]:
    """Runs in a warm-up worker, where `_worker_init` has patched the autotuner."""
    import triton
    import triton.language as tl

    bench = sys.modules["kernels"]

    @triton.jit
    def kernel(x, N: tl.constexpr):
        pass

    tuner = triton.autotune([triton.Config({"N": i}) for i in range(7)], key=[])(kernel)
    bench._SHARD = (1, 3)
    return [c.kwargs["N"] for c in tuner.prune_configs({})]


def test_variants_smoke_runs_each_setting_in_its_own_process(tmp_path: Path) -> None:
    """`benchmarks/variants.py` passes each launch setting to a fresh `kernels.py` through
    the environment and gathers one row per plan and setting."""
    import subprocess

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "variants.py"), "--smoke", "--plans", "deltanet",
                           "--variants", "8,4 4,4/2:solve=doubling", "--check", "deltanet", "--out", str(out), "--work", str(tmp_path / "work"), "--budget-s", "200"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((out / "variants.json").read_text())
    assert [r["variant"] for r in results] == ["8,4", "4,4/2:solve=doubling"]
    assert results[1]["env"] == {"ARCHSPEC_TRITON_WARPS": "4,4", "ARCHSPEC_TRITON_STAGES": "2", "ARCHSPEC_TRITON_SOLVE": "doubling"}
    for r in results:
        assert r["rc"] == 0 and set(r["plans"]) == {"deltanet"}
        assert r["plans"]["deltanet"]["error"] == ""
    assert "check" not in results[0]  # the defaults: checked by the calls that time them
    assert results[1]["check"] and all(c["pass"] for c in results[1]["check"].values())  # ran under the variant
    assert "| deltanet |" in (out / "variants.md").read_text()


def test_variants_table_lists_the_plans_each_setting_times(tmp_path: Path) -> None:
    with benchmark_module("variants") as variants:
        out = tmp_path / "out"
        variants.main(["--smoke", "--plans", "deltanet", "--variants", "8,4 8,4:osdn_stats=1@osdn-deltanet",
                       "--out", str(out), "--work", str(tmp_path / "work"), "--budget-s", "200"])
        table = (out / "variants.md").read_text()
        assert "| deltanet |" in table and "| osdn-deltanet |" in table


def test_variants_check_only_the_plans_a_setting_times() -> None:
    with benchmark_module("variants") as variants:
        check = "osdn-deltanet,gdn,gla-scalar"
        assert variants.plans_to_check("8,4", "gdn", check) == ""
        assert variants.plans_to_check("8,4:gate_in_first=1", "gla-scalar,gdn,kda", check) == "gdn,gla-scalar"
        assert variants.plans_to_check("8,4:osdn_blocked=1", "", check) == check
        assert variants.plans_to_check("8,4:osdn_blocked=1", "osdn-gdn", check) == ""
        assert variants.plans_to_check("8,4:x=1", "gdn", "") == ""


def test_adopted_variant_rows_replace_ours_and_say_where_from(scripts, tmp_path: Path) -> None:
    """`adopt_variant_rows.py`: our row of the named plan is the variant's, with its
    provenance in the JSON and the table; fla/torch rows and other plans are untouched;
    a variant or plan that the file lacks is refused by name."""
    bench, _ = scripts
    bench.main(["--smoke", "--plans", "deltanet,kda", "--out", str(tmp_path)])
    before = json.loads((tmp_path / "kernels.json").read_text())
    adopt = importlib.import_module("adopt_variant_rows")
    variant = {"variant": "8,4:output_warps=4@kda", "env": {"ARCHSPEC_TRITON_OUTPUT_WARPS": "4"},
               "machine": {"kernels_sha1": "abc123"},
               "plans": {"kda": {"plan": "kda", "impl": "triton", "fwd_ms": 1.25, "fwdbwd_ms": 5.5, "error": ""}}}
    variants_file = tmp_path / "variants.json"
    variants_file.write_text(json.dumps([variant]))
    adopt.main([str(variants_file), "8,4:output_warps=4@kda", "kda", "--setting", "call 9, 4 warps", "--results", str(tmp_path)])
    after = json.loads((tmp_path / "kernels.json").read_text())
    ours = [r for r in after["plans"]["kda"]["rows"] if r["impl"] == "triton"]
    assert len(ours) == 1 and ours[0]["fwd_ms"] == 1.25 and ours[0]["fwdbwd_ms"] == 5.5
    assert ours[0]["setting"] == "call 9, 4 warps" and ours[0]["machine"] == {"kernels_sha1": "abc123"}
    assert ours[0]["env"] == {"ARCHSPEC_TRITON_OUTPUT_WARPS": "4"}
    assert [r for r in after["plans"]["kda"]["rows"] if r["impl"] != "triton"] == \
        [r for r in before["plans"]["kda"]["rows"] if r["impl"] != "triton"]
    assert after["plans"]["deltanet"] == before["plans"]["deltanet"]
    table = (tmp_path / "kernels.md").read_text()
    assert "| kda | " in table and "1.250" in table and "- kda / triton: call 9, 4 warps" in table
    with pytest.raises(SystemExit, match="no variant"):
        adopt.main([str(variants_file), "8,8", "kda", "--setting", "x", "--results", str(tmp_path)])
    with pytest.raises(SystemExit, match="no timing of 'deltanet'"):
        adopt.main([str(variants_file), "8,4:output_warps=4@kda", "deltanet", "--setting", "x", "--results", str(tmp_path)])


def test_table_reports_calls_that_waited_on_the_host(scripts) -> None:
    """A row whose wall time exceeds its kernels' GPU time by more than 10% is listed with
    both numbers (the session-5 table: scalar GLA 0.349 ms wall for 0.222 of kernels); one
    within 10% is not."""
    bench, _ = scripts
    row = lambda impl, fwd, fwd_gpu: {"impl": impl, "fwd_ms": fwd, "fwdbwd_ms": 2.0, "error": "",  # noqa: E731
                                      "kernels": {"forward": [["a", fwd_gpu], ["(sum of all kernels)", fwd_gpu]],
                                                  "forward_backward": [["(sum of all kernels)", 1.95]]}}
    waits = bench.host_waits([("gla-scalar", row("triton", 0.349, 0.222)), ("deltanet", row("triton", 0.502, 0.4955))])
    assert waits == [("gla-scalar", "triton", "forward", 0.349, 0.222, None)]
    table = bench.markdown({"machine": {"torch": "x", "date": "d"}, "shape": dict(B=1, T=1, H=1, K=1, V=1), "dtype": "bf16",
                            "plans": {"gla-scalar": {"floors": {"floor_fwd_ms": 0.1, "floor_fwdbwd_ms": 0.2},
                                                     "rows": [{**row("triton", 0.349, 0.222), "host_fwd_ms": 0.31}]}}})
    assert "| gla-scalar / triton | forward | 0.349 | 0.222 | 0.310 |" in table


def test_autotuned_configs_of_a_peer(scripts, monkeypatch) -> None:
    """`kernels.autotuned_configs` reads the configuration each loaded autotuner picked,
    through a heuristics wrapper, and skips those that have not run."""
    import types

    bench, _ = scripts
    picked = types.SimpleNamespace(best_config="BV: 64, num_warps: 4, num_stages: 3")
    unpicked = types.SimpleNamespace(best_config=None)
    wrapped = types.SimpleNamespace(fn=picked)
    module = types.ModuleType("peerpkg.ops.h")
    module.kernel_h, module.kernel_o, module.wrapped = picked, unpicked, wrapped
    monkeypatch.setitem(sys.modules, "peerpkg.ops.h", module)
    assert bench.autotuned_configs("peerpkg") == {
        "peerpkg.ops.h.kernel_h": "BV: 64, num_warps: 4, num_stages: 3",
        "peerpkg.ops.h.wrapped": "BV: 64, num_warps: 4, num_stages: 3",
    }
    assert bench.autotuned_configs("nothing-loaded") == {}


def test_side_by_side_rounds_set_the_target_ratio(scripts, monkeypatch) -> None:
    """Ours and fla's call alternate (`side_by_side_rounds`); a pass fla refuses gets no
    pair; the target's ratio is the medians' and the table marks it (session 7: Gated
    DeltaNet 0.71 ms wall against fla's 0.46 of another run, 0.675 against 1.240 side by side)."""
    bench, _ = scripts
    plan = bench.plan_named("gdn")
    order = []

    def refusing_backward(*_):
        raise RuntimeError("fla: gated backward refused")

    calls = {"triton": lambda: ("o", None), "fla": lambda: ("o", None)}
    monkeypatch.setattr(bench, "impl_callable", lambda p, impl, x: calls[impl])
    monkeypatch.setattr(bench, "_forward_and_backward",
                        lambda f, x: (lambda: order.append("ours-fb")) if f is calls["triton"] else refusing_backward)
    times = iter([0.7, 1.2, 0.6, 1.3, 0.68, 1.25])  # ours, fla, ours, fla, ...
    monkeypatch.setattr(bench, "_bench", lambda fn: (order.append("ours" if fn is calls["triton"] else "fla"), next(times))[1])
    pairs = bench.side_by_side_rounds(plan, {}, rounds=3, seconds=30)
    assert order == ["ours", "fla"] * 3
    assert pairs == {"fwd_ms": {"ours_ms": [0.7, 0.6, 0.68], "fla_ms": [1.2, 1.3, 1.25]}}
    floors = {"floor_fwd_ms": 0.07, "floor_fwdbwd_ms": 0.2}
    rows = [{"impl": "triton", "fwd_ms": 0.71, "fwdbwd_ms": 2.45, "error": ""},
            {"impl": "fla", "fwd_ms": 0.46, "fwdbwd_ms": None, "error": "backward: refused"}]
    results = {"machine": {"torch": "x", "date": "d"}, "shape": {"B": 1, "T": 1, "H": 1, "K": 1, "V": 1}, "dtype": "bf16",
               "plans": {"gdn": {"floors": floors, "rows": rows, "side_by_side": pairs}}}
    target = next(t for t in bench.targets(results) if t["target"].startswith("gdn forward: ours / fla"))
    assert target["target"].endswith("side by side") and target["ratio"] == pytest.approx(0.68 / 1.25) and target["met"]
    table = bench.markdown(results)
    assert "| gdn | 0.070 | 0.710 | 0.460 | 0.54† |" in table
    assert "| gdn | forward | 0.680 | 1.250 | 0.54 |" in table
    del results["plans"]["gdn"]["side_by_side"]  # without the rounds: the two rows' ratio
    target = next(t for t in bench.targets(results) if t["target"].startswith("gdn forward: ours / fla"))
    assert target["ratio"] == pytest.approx(0.71 / 0.46) and not target["met"]


def test_launch_sweep_sets_and_restores_the_knobs() -> None:
    """`launch_sweep.py`: a grid is every combination of each `;`-separated part; a setting
    sets `launch.py`'s knob of that name (warps into the pair, "0" as False for a switch)
    and `restore` puts every one back."""
    with benchmark_module("launch_sweep") as sweep:
        from archspec.kernels.triton import launch

        assert sweep.settings_of("a=1,2 b=3; c=4") == [{"a": "1", "b": "3"}, {"a": "2", "b": "3"}, {"c": "4"}]
        before = (launch.WARPS, launch.STATE_STAGES, launch.CHANNEL_PASSES, launch.SPLIT_UNGATED)
        previous = sweep.apply({"state_warps": "2", "state_stages": "3", "channel_passes": "0", "split_ungated": "1"})
        assert (launch.WARPS, launch.STATE_STAGES, launch.CHANNEL_PASSES, launch.SPLIT_UNGATED) == (
            (before[0][0], 2), "3", False, True)
        sweep.restore(previous)
        assert (launch.WARPS, launch.STATE_STAGES, launch.CHANNEL_PASSES, launch.SPLIT_UNGATED) == before
        with pytest.raises(SystemExit, match="no knob"):
            sweep.apply({"no_such_knob": "1"})


def test_launch_sweep_smoke_screens_every_setting(tmp_path: Path) -> None:
    """`benchmarks/launch_sweep.py --smoke --backward` runs the defaults and every setting
    of the grid, forward and backward, and compares each setting's output and gradients
    with the defaults' (on the interpreter launch settings change nothing: 0)."""
    import subprocess

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "launch_sweep.py"), "--smoke", "--backward", "--plans", "gdn",
                           "--grid", "state_stages=3; stages=2 output_warps=2,4", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((out / "launch_sweep.json").read_text())["plans"]["gdn"]["settings"]
    assert [r["setting"] for r in rows] == [{}, {"state_stages": "3"}, {"stages": "2", "output_warps": "2"},
                                            {"stages": "2", "output_warps": "4"}]
    assert all(r.get("error") is None and r["rel_diff"] == 0.0 and not r["suspect"] for r in rows)


def test_a_variant_that_fails_says_why_in_its_table(tmp_path: Path) -> None:
    """A setting whose kernels fail (here one that `launch.py` refuses at import) reports the
    check's error and the timing's, not a bare FAIL and an empty row: on the GPU the files
    with the reasons stay on the device."""
    with benchmark_module("variants") as variants:
        out = tmp_path / "out"
        variants.main(["--smoke", "--plans", "deltanet", "--variants", "8,4:solve=bogus", "--check", "deltanet",
                       "--out", str(out), "--work", str(tmp_path / "work"), "--budget-s", "200"])
        result = json.loads((out / "variants.json").read_text())[0]
        failed = [v for v in result["check"].values() if not v["pass"]]
        assert failed and all("ARCHSPEC_TRITON_SOLVE='bogus'" in v["error"] for v in failed)
        assert result["error"].startswith("not timed: deltanet") and "ARCHSPEC_TRITON_SOLVE" in result["error"]
        table = (out / "variants.md").read_text()
        assert "FAIL (" in table and "not timed: deltanet" in table


def test_launch_sweep_goes_on_in_a_fresh_process_after_a_gpu_fault(tmp_path: Path, monkeypatch) -> None:
    """A setting that faults the GPU ends its plan (the context is lost: its other settings
    are recorded as not run), and the plans left run in a fresh process that adds to the
    same file. The fault is injected into this process; the continuation runs for real."""
    with benchmark_module("launch_sweep") as sweep:
        from archspec.kernels.triton import launch

        screened = sweep.screened

        def faulting(forward, inputs, backward):
            if forward.args[0].name == "deltanet" and launch.STATE_STAGES == "3":
                raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")
            return screened(forward, inputs, backward)

        monkeypatch.setattr(sweep, "screened", faulting)
        out = tmp_path / "out"
        results = sweep.main(["--smoke", "--plans", "deltanet,gdn", "--grid", "state_stages=3; stages=2",
                              "--out", str(out), "--budget-s", "250"])
    assert sweep.gpu_fault(RuntimeError("an illegal memory access was encountered"))
    assert not sweep.gpu_fault(RuntimeError("out of resource: shared memory, Required: 262144"))
    dn = results["plans"]["deltanet"]
    assert [r.get("error", "")[:30] for r in dn["settings"]] == [
        "", "RuntimeError: Triton Error [CU", "not run: an earlier setting fa"]
    assert dn["continued_in_fresh_process"] == ["gdn"]
    gdn = results["plans"]["gdn"]["settings"]  # from the fresh process, merged into the same file
    assert [r["setting"] for r in gdn] == [{}, {"state_stages": "3"}, {"stages": "2"}]
    assert all(r.get("error") is None and r["rel_diff"] == 0.0 for r in gdn)
    assert json.loads((out / "launch_sweep.json").read_text())["plans"].keys() == {"deltanet", "gdn"}
