"""`benchmarks/models.py`: the smoke mode end to end on the CPU (ours only, tiny size),
the packed batch it builds, the labels it hands fla, and (where flash-linear-attention is
installed) that every mapped fla config has our parameter count within 2%."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from .test_gpu_scripts import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("models") as module:
        yield module


def test_smoke_run_writes_every_setting(bench, tmp_path):
    quick = ["--smoke", "--out", str(tmp_path), "--rounds", "1", "--warmup", "0"]
    assert bench.main([*quick, "--specs", "gated-deltanet", "--warm-workers", "1"]) == 0  # warmed in a worker
    # A run split over two calls; a spec with no form at the size is left out, with its reason.
    assert bench.main([*quick, "--specs", "osdn-apf,jet-nemotron-placement", "--merge", "--anatomy-at", "packed"]) == 0
    record = json.loads((tmp_path / "models.json").read_text())
    assert list(record["unfit"]) == ["jet-nemotron-placement"]
    assert "layout.attention_at[0]: layer 14 is past the last layer" in record["unfit"]["jet-nemotron-placement"]
    assert "No form at this size: jet-nemotron-placement (layout.attention_at[0]" in (tmp_path / "models.md").read_text()
    assert record["machine"]["torch"] == torch.__version__ and "commit" in record["machine"]
    # fla is not asked (--smoke), yet the design it has no model of says so in every setting.
    refused = [r for r in record["rows"] if r["impl"] == "fla"]
    assert {(r["spec"], r["setting"]) for r in refused} == {("osdn-apf", s) for s in ("T=32", "T=64", "packed")}
    assert all(r["refused"] == "flash-linear-attention has no model of this design" for r in refused)
    rows = [r for r in record["rows"] if r["impl"] != "fla"]
    assert {(r["spec"], r["setting"]) for r in rows} == {
        (spec, setting) for spec in ("gated-deltanet", "osdn-apf") for setting in ("T=32", "T=64", "packed")
    }
    for r in rows:
        assert r["impl"] == "ours" and r["tokens_per_s"] > 0 and r["optimizer_ms"] > 0 and r["params"] > 0
        assert r["batch"] * r["seq_len"] == 64  # equal tokens per step in every setting
        assert r["warmup_s"] is not None and r["warmup_s"] >= 0
        assert r["measured"]["kernels_sha1"] == record["machine"]["kernels_sha1"]
        # On the CPU nothing runs asynchronously: issuing the two halves is the whole step
        # (medians of one round: the step's own time holds both and the syncs around them).
        assert 0 < r["host_forward_ms"] and 0 < r["host_backward_ms"]
        assert r["host_forward_ms"] + r["host_backward_ms"] <= r["step_ms"]
    assert next(r for r in rows if r["setting"] == "packed")["documents"] > 1
    table = (tmp_path / "models.md").read_text()
    assert "| gated-deltanet | gated-deltanet | packed |" in table
    # One step of each design profiled: at the first setting by default, at --anatomy-at's
    # where given; the earlier call's kept by --merge.
    assert {spec: entry["setting"] for spec, entry in record["anatomy"].items()} == {
        "gated-deltanet": "T=32", "osdn-apf": "packed"}
    for spec, entry in record["anatomy"].items():
        assert set(entry["impls"]) == {"ours"}
        prof = entry["impls"]["ours"]
        assert prof["busy_ms"] > 0 and sum(prof["categories"].values()) == pytest.approx(prof["busy_ms"], abs=0.01)
        assert prof["categories"]["matmul"] > 0 and prof["kernels"][0][2] >= prof["kernels"][-1][2]
        row = next(r for r in rows if r["spec"] == spec and r["setting"] == entry["setting"])
        step = row["step_ms"]
        host = f"{row['host_forward_ms']:.2f} / {row['host_backward_ms']:.2f}"
        assert f"| {spec} | {entry['setting']} | ours | {step:.2f} | {prof['busy_ms']:.2f} |" in table
        assert f"| {host} |" in table.split(f"| {spec} | {entry['setting']} | ours | {step:.2f} |")[1].splitlines()[0]


def test_a_merged_run_keeps_the_earlier_rows_of_a_spec_its_budget_skips(bench, tmp_path):
    """`--merge` with `--budget-s`: the spec timed again has this run's rows, the one the
    budget skipped keeps the earlier run's (once, every named spec's were dropped at the
    start, so a skipped one vanished from the table)."""
    quick = ["--smoke", "--out", str(tmp_path), "--rounds", "1", "--warmup", "0", "--no-anatomy", "--warm-workers", "0"]
    assert bench.main([*quick, "--specs", "deltanet,gla"]) == 0
    first = json.loads((tmp_path / "models.json").read_text())
    kept = [r for r in first["rows"] if r["spec"] == "deltanet"]
    assert bench.main([*quick, "--specs", "gla,deltanet", "--merge", "--budget-s", "1e-6"]) == 0
    second = json.loads((tmp_path / "models.json").read_text())
    assert second["skipped"] == ["deltanet"]
    assert [r for r in second["rows"] if r["spec"] == "deltanet"] == kept
    gla = [r for r in second["rows"] if r["spec"] == "gla"]
    assert len(gla) == 3 and not any(r in first["rows"] for r in gla)  # timed again, the earlier ones gone
    assert "| deltanet | deltanet | T=32 |" in (tmp_path / "models.md").read_text()


def test_a_merged_run_cut_short_keeps_the_earlier_rows_of_the_settings_it_did_not_reach(bench, tmp_path, monkeypatch):
    """A design that fails after its first setting (out of memory, a killed call) under
    `--merge`: that setting has this run's rows, the two it did not reach the earlier run's."""
    quick = ["--smoke", "--out", str(tmp_path), "--rounds", "1", "--warmup", "0", "--no-anatomy", "--warm-workers", "0"]
    assert bench.main([*quick, "--specs", "deltanet"]) == 0
    first = json.loads((tmp_path / "models.json").read_text())["rows"]
    timed = bench.run_design

    def cut_after_the_first_setting(*args, on_setting, **kwargs):
        def keep_one(rows):
            on_setting(rows)
            raise RuntimeError("cut short")
        return timed(*args, on_setting=keep_one, **kwargs)

    monkeypatch.setattr(bench, "run_design", cut_after_the_first_setting)
    assert bench.main([*quick, "--specs", "deltanet", "--merge"]) == 1  # the failure is reported
    record = json.loads((tmp_path / "models.json").read_text())
    assert "cut short" in record["failed"]["deltanet"]
    by_setting = {r["setting"]: r for r in record["rows"]}
    assert len(record["rows"]) == 3 and set(by_setting) == {"T=32", "T=64", "packed"}
    assert by_setting["T=32"] not in first  # timed again
    assert [by_setting["T=64"], by_setting["packed"]] == [r for r in first if r["setting"] != "T=32"]


def test_a_profiled_setting_the_size_lacks_is_refused(bench, tmp_path, capsys):
    assert bench.main(["--smoke", "--out", str(tmp_path), "--specs", "deltanet", "--anatomy-at", "T=2048"]) == 2
    assert "--anatomy-at T=2048: not a setting of this size (T=32, T=64, packed)" in capsys.readouterr().err
    assert not (tmp_path / "models.json").exists()


def test_a_run_of_specs_without_a_form_at_its_size_times_nothing(bench, tmp_path, capsys):
    assert bench.main(["--smoke", "--out", str(tmp_path), "--specs", "jet-nemotron-placement"]) == 2
    assert "no spec to time at this size" in capsys.readouterr().err
    assert not (tmp_path / "models.json").exists()


@pytest.mark.parametrize("name, part", [
    ("chunk_backward_kernel", "recurrence"),  # ours
    ("inverse_kernel", "recurrence"),
    ("log_decay_forward_kernel", "recurrence"),
    ("chunk_kda_fwd_kernel_intra_sub_chunk", "recurrence"),  # fla's
    ("recompute_w_u_fwd_kernel", "recurrence"),
    ("short_conv_forward_kernel", "short conv"),
    ("causal_conv1d_fwd_kernel", "short conv"),
    ("rms_norm_backward_kernel", "norms"),
    ("layer_norm_gated_fwd_kernel", "norms"),
    ("softmax_ce_grad_kernel", "loss"),
    ("fused_linear_cross_entropy_kernel", "loss"),
    ("swiglu_forward_kernel", "activation"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>", "attention"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
])
def test_a_kernel_name_is_put_in_its_part_of_the_model(name, part):
    with benchmark_module("anatomy") as anatomy:
        assert anatomy.category(name) == part


def test_merged_rows_say_which_run_measured_them(bench):
    def row(spec, commit, device="H200", setting="T=2048"):
        return {"spec": spec, "setting": setting, "measured": {"commit": commit, "kernels_sha1": commit[:3], "date": "2026-12-0" + commit[-1],
                                           "device": device}}

    assert bench.measured_notes([row("kda", "aaa1"), row("kda", "aaa1"), row("gla", "aaa1")]) == []  # one run: nothing to say
    notes = bench.measured_notes([row("kda", "aaa1"), row("gla", "bbb2"), row("rwkv7", "bbb2")])
    assert notes[-1] == ("Measured in several runs (`--merge`): kda: H200, commit aaa1, kernels aaa, 2026-12-01; "
                         "gla, rwkv7: H200, commit bbb2, kernels bbb, 2026-12-02.")
    # A spec whose settings come from two runs (a run cut short) names the settings of each.
    split = bench.measured_notes([row("kda", "aaa1", setting="T=2048"), row("kda", "aaa1", setting="T=8192"),
                                  row("kda", "bbb2", setting="packed"), row("gla", "bbb2")])
    assert split[-1] == ("Measured in several runs (`--merge`): kda (T=2048, T=8192): H200, commit aaa1, kernels aaa, "
                         "2026-12-01; kda (packed), gla: H200, commit bbb2, kernels bbb, 2026-12-02.")
    mixed = bench.measured_notes([row("kda", "aaa1"), row("gla", "bbb2", device="H100")])
    assert mixed[-1].startswith("Measured in several runs (`--merge`): kda: H200, commit aaa1")
    assert "gla: H100, commit bbb2" in mixed[-1] and mixed[-1].endswith("by their ratios to fla's only.")


def test_graphed_rows_are_listed_against_ours_and_fla(bench):
    """Each `ours-graph` row's tokens/s against ours eager and fla's of the
    same setting, a refusal with its first line; nothing when there is none."""
    def row(impl, tps, setting="T=2048", refused=None, peak=None):
        return {"spec": "deltanet", "setting": setting, "impl": impl, "tokens_per_s": tps, "refused": refused,
                "peak_mem_bytes": peak}

    assert bench.graphed_notes([row("ours", 100.0), row("fla", 80.0)]) == []
    notes = bench.graphed_notes([row("ours", 100.0), row("ours-graph", 150.0, peak=6.5e9), row("fla", 75.0),
                                 row("ours", 90.0, "T=8192"), row("ours-graph", None, "T=8192", "RuntimeError: capture\nmore")])
    assert notes[-1] == ("Ours with the step replayed from a CUDA graph, as the trainer runs it (`archspec.training."
                         "TrainingStep`; packed documents run eagerly), tokens/s: "
                         "deltanet T=2048: 150 (1.50x ours, 2.00x fla, peak 6.50 GB); deltanet T=8192: refused (RuntimeError: capture).")


def test_packed_batch_and_the_labels_fla_gets(bench):
    lengths = bench.document_lengths(1000, 5, 300, seed=3)
    assert sum(lengths) == 1000 and all(0 < n <= 300 for n in lengths) and len(lengths) > 2
    size = bench.SMOKE_SIZE
    batch = bench.make_batch(size, 1, 64, packed=True)
    cu = batch.cu_seqlens.long()
    assert int(cu[0]) == 0 and int(cu[-1]) == 64
    # HF models shift: position t is scored against hf_labels[t + 1], which must be ours.
    hf = batch.hf_labels
    assert torch.equal(hf[:, 1:], batch.labels[:, :-1])
    assert (batch.labels[0, cu[1:] - 1] == -100).all()  # no token predicts another document's


def test_unknown_spec_is_refused(bench, tmp_path, capsys):
    assert bench.main(["--smoke", "--out", str(tmp_path), "--specs", "nope"]) == 2
    assert "unknown spec(s): nope" in capsys.readouterr().err


def test_fla_configs_match_our_parameter_counts(bench):
    pytest.importorskip("fla.models")
    from archspec.blocks import count_params

    designs = set()
    for spec in sorted(bench.SPECS.glob("*.yaml")):
        plan = bench.load_plan(spec, bench.ISSUE_SIZE)
        if bench.fla_design(plan) is None:
            continue
        designs.add(bench.fla_design(plan))
        ours = count_params(plan)
        with torch.device("meta"):
            theirs = sum(p.numel() for p in bench.build_fla(plan, "meta", ours).parameters())
        assert abs(theirs / ours - 1) <= bench.PARAM_TOLERANCE, f"{spec.stem}: fla {theirs:,} against ours {ours:,}"
    assert designs == set(bench.FLA_MODELS)


def test_a_refusing_peer_is_recorded_and_ours_still_timed(bench):
    size = bench.SMOKE_SIZE
    plan = bench.load_plan(bench.SPECS / "kda.yaml", size)
    ours = bench.ours(plan, size)

    def refuse(batch):
        raise RuntimeError("the gated backward refuses on this machine")

    peer = bench.Trainee("fla", torch.nn.Linear(2, 2), refuse, size.device)
    rows = {name: bench.Row("kda", "kda", "T=32", name, 2, 32) for name in ("ours", "fla")}
    bench.time_side_by_side([ours, peer], bench.make_batch(size, 2, 32, packed=False), rounds=1, warmup=0,
                            device=size.device, rows=rows)
    assert rows["fla"].refused == "RuntimeError: the gated backward refuses on this machine"
    assert rows["fla"].tokens_per_s is None
    assert rows["ours"].refused is None and rows["ours"].tokens_per_s > 0


def test_a_compile_worker_launches_each_config_once_and_times_nothing(monkeypatch):
    """The warm-up workers replace the autotuner's benchmarker; Triton calls what the
    `do_bench` property returns as `do_bench(kernel_call, quantiles=...)`, with no `self`
    (a `self` parameter made every fla warm-up job fail with a TypeError on the H200)."""
    from triton.runtime.autotuner import Autotuner

    with benchmark_module("common") as common:
        for name in ("prune_configs", "run", "do_bench"):
            monkeypatch.setattr(Autotuner, name, Autotuner.__dict__[name])  # restored after the test
        monkeypatch.delenv("FLA_CACHE_RESULTS", raising=False)  # _worker_init sets it
        common._worker_init()
        benchmarker = Autotuner.__dict__["do_bench"].fget(object.__new__(Autotuner))
        launches = []
        assert benchmarker(lambda: launches.append(1), quantiles=(0.5, 0.2, 0.8)) == [0.0, 0.0, 0.0]
        assert launches == [1]


def test_warm_up_processes_are_as_many_as_the_device_memory_holds(bench, monkeypatch):
    """15 warm-up processes of about 15 GB each ran a 140 GB H200 out of memory."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (139 * 2**30, 140 * 2**30))
    assert bench.fitting_workers(15) == 139 // 16
    assert bench.fitting_workers(4) == 4
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (2**30, 140 * 2**30))
    assert bench.fitting_workers(15) == 1


@pytest.mark.parametrize("pinned", [True, False])
def test_pinned_picks_warm_a_covered_design_in_one_job_and_share_out_the_others(bench, monkeypatch, pinned):
    """With an earlier run's picks, fla's model of a design they cover compiles its pinned
    configs in one job; one they do not cover shares its configs out over `fla_shards`
    jobs, as on a cold machine (one job compiling every config of fla's RWKV-7 ran past
    220 s on an H100 while the other designs waited). Without picks every design shares."""
    jobs = []

    def run_none(fn, items, *args, **kwargs):
        jobs.extend(job for job, _ in items)
        return ["ok"] * len(items)

    monkeypatch.setattr(bench.common, "map_in_workers", run_none)
    bench.warm_caches(["deltanet", "rwkv7"], bench.SMOKE_SIZE, bench.SMOKE_SIZE, bench._warm, with_fla=True, workers=2,
                      fla_shards=3, log=lambda msg: None, pinned={"a.kernel": []} if pinned else None,
                      covered={"deltanet"})
    shares = [(0, 1)] if pinned else [(0, 3), (1, 3), (2, 3)]
    assert [(j.spec, j.impl, j.shard) for j in jobs] == [
        ("deltanet", "ours", None), *(("deltanet", "fla", s) for s in shares),
        ("rwkv7", "ours", None), ("rwkv7", "fla", (0, 3)), ("rwkv7", "fla", (1, 3)), ("rwkv7", "fla", (2, 3))]


@pytest.mark.parametrize("error,asked", [(RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces "
                                                       "incorrect results"), 1),
                                         (torch.OutOfMemoryError("CUDA out of memory"), 3)])
def test_a_peer_refusing_the_design_is_not_asked_again(bench, monkeypatch, error, asked):
    """A refusal of the machine holds at every setting; running out of memory may not."""
    size = bench.SMOKE_SIZE
    calls = []

    def refuse(batch):
        calls.append(batch)
        raise error

    def beside_fla(plan, mine, theirs, **kwargs):
        return [mine, bench.Trainee("fla", torch.nn.Linear(2, 2), refuse, size.device)], None

    monkeypatch.setattr(bench, "beside_fla", beside_fla)
    rows = bench.run_design(bench.SPECS / "kda.yaml", size, with_fla=True, rounds=1, warmup=0, log=lambda msg: None)
    theirs = [r for r in rows if r.impl == "fla"]
    assert len(calls) == asked
    assert [r.setting for r in theirs] == [name for name, _, _ in size.settings()]
    assert all(r.refused == bench.refusal_text(error) and r.tokens_per_s is None for r in theirs)
    assert all(r.tokens_per_s > 0 for r in rows if r.impl == "ours")


def test_fla_designs_take_their_own_decay_form(bench):
    """A spec is fla's design only with that design's decay: RWKV-7's and GLA's own forms,
    Mamba2's for KDA; with another form it has no fla counterpart."""
    for name, design in (("rwkv7", "rwkv7"), ("gla", "gla"), ("kda", "kda")):
        plan = bench.load_plan(bench.SPECS / f"{name}.yaml", bench.SMOKE_SIZE)
        assert bench.fla_design(plan) == design
        other = "mamba2" if plan.mixer.decay != "mamba2" else "rwkv7"
        changed = dataclasses.replace(plan, mixer=dataclasses.replace(plan.mixer, decay=other))
        assert bench.fla_design(changed) is None, name
