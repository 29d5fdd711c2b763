"""Decoding benchmark: tokens/s and latency per token of `generate`, ours against
flash-linear-attention's model of the same design.

    python benchmarks/decode.py [--out DIR] [--specs a,b] [--batches 1,64] [--prompt 2048]
                                [--new-tokens 256] [--no-fla] [--rounds N] [--budget-s S]
                                [--warm-workers N] [--merge] [--smoke]

Each spec in `specs/models` is compiled at the whole-model benchmark's size
(`benchmarks/models.py`: d_model 1024, 8 layers, 8 heads of 128, vocabulary 32,000,
SwiGLU MLP) with bfloat16 weights (the recurrent state stays float32), and continues a
batch of random prompts of `--prompt` tokens greedily by `--new-tokens` tokens, at each
batch size:

- ours: `LanguageModel.generate` (a prefill through the chunk kernel, then one decoding
  step per token replayed from a CUDA graph: one decoding launch per recurrent layer);
- fla: `fla.models.*ForCausalLM.generate` (transformers' GenerationMixin over fla's
  fused recurrent kernels), its config mapped field by field as `models.py` does
  (parameters within 2% of ours), `min_new_tokens` so that it never stops early.

Both are timed through their public `generate`, whole: once with one new token (the
prefill and the first token) and once with all of them, in alternating rounds. The
decoding time is the fastest all-token call less the fastest one-token call (the fastest,
because interference from other work only ever adds time, and a difference of two noisy
numbers amplifies it), so `tokens/s` = batch x (new tokens - 1) / decoding time and
`ms/token` = decoding time / (new tokens - 1); `prefill ms` is the fastest one-token call.

The floor of a decoding step at batch B is the bytes it must move, the weights read once
(less the embedding table, of which B rows are read), the recurrent state read and
written and an attention layer's KV cache at the prompt's length read
(`blocks.cost.layer_state_bytes`), over the device's copy bandwidth measured here;
`ours / floor` is the measured step over it. Hybrid stacks run ours alone.

On CUDA each row of ours also records its step's anatomy (`step_anatomy`): the captured
step replayed alone, its launches and the kernels' own time per step (CUPTI, through
`torch.profiler`), and the costliest kernels; the markdown lists them under the table.

As in `models.py`, every design's kernels are first compiled in `--warm-workers` spawned
processes at once (each generates two tokens at every batch size; fla's autotune configs
shared out among `--fla-shards` of them), and `--budget-s` counts the timing only.

Results: `DIR/decode.json` (machine, versions, commit, every row) and `DIR/decode.md`,
written after every design (`--budget-s` keeps what finished; `--merge` keeps an earlier
file's rows of the specs not run now). `--smoke` runs ours only, tiny, on the CPU (the
test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import picks
from common import first_line, machine
from models import (ISSUE_SIZE, SMOKE_SIZE, SPECS, Size, WarmJob, beside_fla, build_fla, fla_design, load_plan,
                    refusal_text, warm_caches)

ROOT = Path(__file__).resolve().parents[1]
# The issue's targets first (a run cut short by its budget keeps them), then the rest.
FIRST = ["deltanet", "gated-deltanet", "kda", "gated-deltaproduct-2", "gla", "rwkv7"]
COPY_BYTES = 1 << 30  # the bandwidth probe's buffer on CUDA


@dataclass(frozen=True)
class Decode:
    """What is generated: batch sizes, prompt length, new tokens; the model size."""

    size: Size
    batches: tuple[int, ...] = (1, 64)
    prompt: int = 2048
    new_tokens: int = 256

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.size.device.startswith("cuda") else torch.float32


ISSUE = Decode(ISSUE_SIZE)
SMOKE = Decode(SMOKE_SIZE, batches=(1, 3), prompt=16, new_tokens=8)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy (read + write), the median of 5."""
    n = COPY_BYTES if device.startswith("cuda") else 1 << 24
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * n / statistics.median(times)


def step_bytes(model: torch.nn.Module, plan, batch: int, context: int) -> int:
    """Bytes one decoding step must move: every weight read once except the embedding
    table (B rows of it), and the decoding state read and written (an attention layer's
    KV cache after `context` tokens, read; written: one token's key and value, neglected)."""
    from archspec.blocks.cost import layer_state_bytes

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed.weight
    weights -= embed.numel() * embed.element_size() - batch * embed.shape[1] * embed.element_size()
    state = 0
    for layer in plan.layer_plans:
        size = layer_state_bytes(layer, context, activation_bytes=embed.element_size())
        state += size if getattr(layer, "kind", "recurrent") == "attention" else 2 * size
    return weights + batch * state


@dataclass
class Row:
    design: str
    spec: str
    impl: str
    batch: int
    prompt: int
    new_tokens: int
    params: int | None = None
    tokens_per_s: float | None = None
    ms_per_token: float | None = None
    prefill_ms: float | None = None
    floor_ms: float | None = None
    peak_mem_bytes: int | None = None
    rounds: int = 0
    refused: str | None = None
    first_ms_all: list[float] | None = None  # every timed one-token call
    whole_ms_all: list[float] | None = None  # every timed all-token call
    anatomy: dict | None = None  # ours on CUDA: the captured step's kernels (`step_anatomy`)


class Contender:
    """One model's `generate(prompt, n)`, as the benchmark calls it."""

    def __init__(self, name: str, model: torch.nn.Module, call: Callable[[torch.Tensor, int], torch.Tensor]):
        self.name, self.model, self.call = name, model, call
        self.params = sum(p.numel() for p in model.parameters())


def ours(plan, run: Decode) -> Contender:
    from archspec.blocks import build_model

    model = build_model(plan).to(run.size.device, run.dtype).eval()

    def call(prompt: torch.Tensor, n: int) -> torch.Tensor:
        return model.generate(prompt, n, temperature=0)

    return Contender("ours", model, call)


def theirs(plan, run: Decode, params: int) -> Contender:
    model = build_fla(plan, run.size.device, params).to(run.dtype).eval()

    def call(prompt: torch.Tensor, n: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, use_cache=True)

    return Contender("fla", model, call)


def _warm(job: WarmJob) -> str:
    """This benchmark's warm-up: a prefill and one decoding step at every batch size."""
    from archspec.blocks import count_params

    run = job.setup
    plan = load_plan(SPECS / f"{job.spec}.yaml", run.size)
    gen = ours(plan, run) if job.impl == "ours" else theirs(plan, run, count_params(plan))
    for batch in run.batches:
        gen.call(torch.randint(run.size.vocab, (batch, run.prompt), device=run.size.device), 2)
    return "ok"


def time_side_by_side(gens: list[Contender], prompt: torch.Tensor, run: Decode, rounds: int, rows: dict[str, Row]) -> None:
    """Warm each up (kernels compiled, graphs captured), then alternate rounds of a
    one-token and an all-tokens call; a generator that raises is dropped with its error."""
    device, n = run.size.device, run.new_tokens
    live = list(gens)
    first: dict[str, list[float]] = {g.name: [] for g in live}
    whole: dict[str, list[float]] = {g.name: [] for g in live}
    peak: dict[str, int] = {g.name: 0 for g in live}

    def timed(g: Contender, tokens: int) -> float:
        _sync(device)
        start = time.perf_counter()
        out = g.call(prompt, tokens)
        _sync(device)
        seconds = time.perf_counter() - start
        if out.shape != (prompt.shape[0], prompt.shape[1] + tokens):
            raise RuntimeError(f"{g.name} generated {tuple(out.shape)}, expected {(prompt.shape[0], prompt.shape[1] + tokens)}")
        return seconds

    def attempt(g: Contender, warm: bool) -> None:
        try:
            if warm:
                g.call(prompt, n)
                return
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            first[g.name].append(timed(g, 1))
            whole[g.name].append(timed(g, n))
            if device.startswith("cuda"):
                peak[g.name] = max(peak[g.name], torch.cuda.max_memory_allocated())
        except Exception as exc:  # fla's generate may refuse this machine or this transformers
            rows[g.name].refused = refusal_text(exc)
            live.remove(g)

    for g in list(live):
        attempt(g, warm=True)
    for r in range(rounds):
        for g in (list(live) if r % 2 == 0 else live[::-1]):
            if g in live:
                attempt(g, warm=False)
    for g in live:
        seconds = min(whole[g.name]) - min(first[g.name])
        row = rows[g.name]
        if seconds <= 0:
            row.refused = (f"timing: the {n}-token call was not slower than the one-token call "
                           f"({min(whole[g.name]):.4f} s against {min(first[g.name]):.4f} s); too few tokens or too noisy")
            continue
        row.tokens_per_s = prompt.shape[0] * (n - 1) / seconds
        row.ms_per_token = 1e3 * seconds / (n - 1)
        row.prefill_ms = 1e3 * min(first[g.name])
        row.first_ms_all = [round(1e3 * s, 3) for s in first[g.name]]
        row.whole_ms_all = [round(1e3 * s, 3) for s in whole[g.name]]
        row.rounds = rounds
        row.peak_mem_bytes = peak[g.name] if device.startswith("cuda") else None


ANATOMY_REPLAYS = 20  # captured steps profiled per row
ANATOMY_TOP = 8  # kernels listed per row, by time
ANATOMY_ROUNDS = 3  # alternating rounds of the step's replay, overlapped and not (the fastest of each)


def step_anatomy(model: torch.nn.Module, prompt: torch.Tensor) -> dict:
    """What one decoding step of ours is made of on CUDA: its CUDA graph replayed alone
    (ms per step), the kernels inside it as CUPTI sees them (launches per step, busy ms per
    step: the gap to the replay time is launch latency) and the costliest kernels. Where
    the kernels launch overlapped (`launch.overlapped`: programmatic dependent launch on
    sm_90), the step is also captured and replayed with that off (`replay_plain_ms`), the
    two alternating, so the row shows what the overlap gains."""
    from archspec.blocks.generate import CapturedStep, kv_capacity, prefill
    from archspec.kernels.triton import launch

    context = min(prompt.shape[1], 256)
    chosen = launch.DECODE_OVERLAP
    capable = launch.overlap_supported(prompt.device)
    settings = (True, False) if capable else (chosen,)
    per_replay = 5 + 5 * ANATOMY_REPLAYS
    steps = ANATOMY_ROUNDS * len(settings) * per_replay + 1 + ANATOMY_REPLAYS  # an attention cache holds them all
    replay: dict[bool, list[float]] = {flag: [] for flag in settings}
    try:
        with torch.no_grad():
            _, state = prefill(model, list(prompt[:, :context]), kv_capacity(context + steps))
            tokens = prompt[:, -1]
            for _ in range(ANATOMY_ROUNDS):
                for flag in settings:
                    launch.DECODE_OVERLAP = flag
                    step = CapturedStep(model, state)  # captured anew: the graph keeps its launches' attributes
                    for _ in range(5):
                        step(tokens)
                    _sync("cuda")
                    start = time.perf_counter()
                    for _ in range(5 * ANATOMY_REPLAYS):
                        step(tokens)
                    _sync("cuda")
                    replay[flag].append(1e3 * (time.perf_counter() - start) / (5 * ANATOMY_REPLAYS))
            launch.DECODE_OVERLAP = chosen
            step = CapturedStep(model, state)
            step(tokens)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(ANATOMY_REPLAYS):
                    step(tokens)
                _sync("cuda")
    finally:
        launch.DECODE_OVERLAP = chosen
    replay_ms = min(replay[chosen])
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time)
    busy_us = sum(sum(times) for times in kernels.values()) / ANATOMY_REPLAYS
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:ANATOMY_TOP]
    return {
        "replay_ms": round(replay_ms, 4), "busy_ms": round(busy_us / 1e3, 4),
        "replay_plain_ms": round(min(replay[False]), 4) if capable else None,
        "launches": round(sum(len(t) for t in kernels.values()) / ANATOMY_REPLAYS),
        "top": [{"kernel": name[:80], "per_step": round(len(times) / ANATOMY_REPLAYS),
                 "us_each": round(statistics.mean(times), 2)} for name, times in top],
    }


def run_design(spec: Path, run: Decode, *, with_fla: bool, rounds: int, bandwidth: float,
               log: Callable[[str], None]) -> list[Row]:
    plan = load_plan(spec, run.size)
    design = fla_design(plan)
    gens, refusal = beside_fla(plan, ours(plan, run), lambda params: theirs(plan, run, params),
                               with_fla=with_fla, label=spec.stem, log=log)
    rows: list[Row] = []
    for batch in run.batches:
        prompt = torch.randint(run.size.vocab, (batch, run.prompt), generator=torch.Generator().manual_seed(batch))
        prompt = prompt.to(run.size.device)
        floor_ms = 1e3 * step_bytes(gens[0].model, plan, batch, run.prompt) / bandwidth
        by_impl = {g.name: Row(design or spec.stem, spec.stem, g.name, batch, run.prompt, run.new_tokens, g.params,
                               floor_ms=floor_ms) for g in gens}
        time_side_by_side(gens, prompt, run, rounds, by_impl)
        mine = by_impl.get("ours")
        if run.size.device.startswith("cuda") and mine is not None and mine.refused is None:
            try:
                mine.anatomy = step_anatomy(gens[0].model, prompt)
            except Exception as exc:  # the profiler is a view, not the measurement: keep the row
                mine.anatomy = {"error": first_line(exc)}
        rows += by_impl.values()
        if refusal is not None and "fla" not in by_impl:
            rows.append(Row(design or spec.stem, spec.stem, "fla", batch, run.prompt, run.new_tokens, refused=refusal))
        for row in by_impl.values():
            log(f"  B={batch:<3} {row.impl:4}: " + (f"refused: {row.refused.splitlines()[0]}" if row.refused else
                f"{row.tokens_per_s:,.0f} tok/s, {row.ms_per_token:.3f} ms/token (floor {floor_ms:.3f}), "
                f"prefill {row.prefill_ms:.1f} ms"))
    for g in gens:
        del g.model
    if run.size.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- results


def markdown(record: dict[str, Any]) -> str:
    m, s, d = record["machine"], record["size"], record["decode"]
    lines = [
        "# Decoding: ours against flash-linear-attention",
        "",
        f"{m.get('device', 'CPU')}, torch {m['torch']}, Triton {m['triton']}, fla {m['fla'] or 'not installed'}, "
        f"commit {m['commit'] or '?'}, {m['date']}.",
        f"d_model {s['d_model']}, {s['layers']} layers, {s['heads']} heads of {s['head_dim']}, vocabulary {s['vocab']}; "
        f"{d['dtype']} weights, float32 state; prompts of {d['prompt']} random tokens, {d['new_tokens']} new tokens, "
        f"greedy, through each model's `generate`. tokens/s and ms/token: the decoding time (the call with every new "
        f"token less the call with one, the fastest of {record['rounds']} alternating rounds each). floor: the weights (less "
        f"the embedding table) read and the recurrent state read and written once per step, at the measured copy "
        f"bandwidth {record['bandwidth_gb_s']:.0f} GB/s.",
        "",
        "| design | spec | batch | tokens/s ours / fla | ratio | ms/token ours / fla | floor ms | ours / floor | prefill ms ours / fla |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = record["rows"]
    for spec, batch in sorted({(r["spec"], r["batch"]) for r in rows}):
        group = {r["impl"]: r for r in rows if r["spec"] == spec and r["batch"] == batch}
        o, f = group.get("ours"), group.get("fla")
        if o is None:
            continue
        if o.get("refused"):
            lines.append(f"| {o['design']} | {spec} | {batch} | ours: {o['refused'].splitlines()[0][:120]} | | | | | |")
            continue
        over_floor = f"{o['ms_per_token'] / o['floor_ms']:.1f}"
        if f is None or f.get("refused"):
            note = "" if f is None else f" (fla: {f['refused'].splitlines()[0][:80]})"
            lines.append(f"| {o['design']} | {spec} | {batch} | {o['tokens_per_s']:,.0f}{note} | - | "
                         f"{o['ms_per_token']:.3f} | {o['floor_ms']:.3f} | {over_floor} | {o['prefill_ms']:.1f} |")
            continue
        lines.append(f"| {o['design']} | {spec} | {batch} | {o['tokens_per_s']:,.0f} / {f['tokens_per_s']:,.0f} | "
                     f"{o['tokens_per_s'] / f['tokens_per_s']:.2f} | {o['ms_per_token']:.3f} / {f['ms_per_token']:.3f} | "
                     f"{o['floor_ms']:.3f} | {over_floor} | {o['prefill_ms']:.1f} / {f['prefill_ms']:.1f} |")
    import common

    anatomies = [r for r in rows if r["impl"] == "ours" and r.get("anatomy") and "top" in r["anatomy"]]
    if anatomies:
        lines += ["", "Ours' decoding step replayed from its CUDA graph alone, and the kernels in it (CUPTI; busy: the "
                  "kernels' own time, the rest is launch latency; not overlapped: the replay with programmatic "
                  "dependent launch off, timed alternately with it on):", "",
                  "| spec | batch | replay ms | not overlapped | launches | busy ms | costliest kernels: per step x us each |",
                  "|---|---|---|---|---|---|---|"]
        for r in sorted(anatomies, key=lambda r: (r["spec"], r["batch"])):
            a = r["anatomy"]
            plain = f"{a['replay_plain_ms']:.3f}" if a.get("replay_plain_ms") is not None else "-"
            top = ", ".join(f"{k['kernel'].split('(')[0][:40]} {k['per_step']}x{k['us_each']:.1f}" for k in a["top"][:4])
            lines.append(f"| {r['spec']} | {r['batch']} | {a['replay_ms']:.3f} | {plain} | {a['launches']} | "
                         f"{a['busy_ms']:.3f} | {top} |")
    lines += common.run_notes(record)
    return "\n".join(lines) + "\n"


def write_results(out: Path, record: dict[str, Any]) -> None:
    import common

    common.write_results(out, "decode", record, markdown(record))


# --------------------------------------------------------------------------- main


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(x) for x in text.split(","))
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    ap.add_argument("--specs", default=None, help="comma-separated spec names (default: every spec in specs/models)")
    ap.add_argument("--batches", type=_ints, default=None, help="batch sizes (default 1,64)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 2048)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens (default 256)")
    ap.add_argument("--no-fla", action="store_true", help="ours only")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per batch size (alternating)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no design after this many seconds")
    ap.add_argument("--warm-workers", type=int, default=None,
                    help="processes that compile every design first (default 8 on CUDA, 0 with --smoke; 0: none)")
    ap.add_argument("--fla-shards", type=int, default=3, help="warm-up jobs that share one fla model's autotune configs")
    ap.add_argument("--retune", action="store_true",
                    help="let fla autotune afresh, not from the picks an earlier run left in --out (fla_autotune.json; "
                         "a fresh --out starts from the committed ones)")
    ap.add_argument("--smoke", action="store_true", help="ours only, tiny size, on the CPU")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of specs not run now from an earlier decode.json in --out (runs split over calls)")
    args = ap.parse_args(argv)

    run = SMOKE if args.smoke else ISSUE
    changes = {k: v for k, v in (("batches", args.batches), ("prompt", args.prompt), ("new_tokens", args.new_tokens))
               if v is not None}
    run = Decode(**{**asdict(run), "size": run.size, **changes})
    if run.new_tokens < 2 or run.prompt < 1:
        print("need --new-tokens >= 2 (the decoding time is the call with all of them less the call with one) "
              "and --prompt >= 1", file=sys.stderr)
        return 2
    if run.size.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke on the CPU", file=sys.stderr)
        return 2
    every = sorted(p.stem for p in SPECS.glob("*.yaml"))
    names = args.specs.split(",") if args.specs else [n for n in FIRST if n in every] + [n for n in every if n not in FIRST]
    missing = [n for n in names if not (SPECS / f"{n}.yaml").exists()]
    if missing:
        print(f"unknown spec(s): {', '.join(missing)} (see {SPECS})", file=sys.stderr)
        return 2
    with_fla = not (args.no_fla or args.smoke)
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {msg}", flush=True)

    record: dict[str, Any] = {
        "machine": machine(), "size": asdict(run.size),
        "decode": {"batches": list(run.batches), "prompt": run.prompt, "new_tokens": run.new_tokens,
                   "dtype": str(run.dtype).removeprefix("torch.")},
        "rounds": args.rounds, "rows": [], "skipped": [], "failed": {},
    }
    out = Path(args.out)
    if args.merge and (out / "decode.json").exists():
        earlier = json.loads((out / "decode.json").read_text())
        record["rows"] = [r for r in earlier.get("rows", []) if r["spec"] not in names]
        record["failed"] = {k: v for k, v in earlier.get("failed", {}).items() if k not in names}
        record["earlier_machines"] = [earlier.get("machine"), *earlier.get("earlier_machines", [])]
    pinned = picks.pin_from(out, log) if with_fla and not args.retune and run.size.device == "cuda" else None
    workers = args.warm_workers if args.warm_workers is not None else 0 if args.smoke else 8
    if workers > 0:
        warm_caches(names, run.size, run, _warm, with_fla=with_fla, workers=workers, fla_shards=args.fla_shards, log=log,
                    pinned=pinned, covered=picks.covered(out / picks.FILE))
    # Measured once the warm-up's processes are gone: a copy that shares the device with
    # compiling processes reads low, and the floor with it.
    bandwidth = copy_bandwidth(run.size.device)
    log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    if args.merge and record["rows"]:
        # one floor for every row: the fastest copy any run measured (interference only slows it)
        earlier_gb_s = earlier.get("bandwidth_gb_s", 0.0)
        bandwidth = max(bandwidth, earlier_gb_s * 1e9)
        for row in record["rows"]:
            if row.get("floor_ms") is not None and earlier_gb_s:
                row["floor_ms"] *= earlier_gb_s * 1e9 / bandwidth
    record["bandwidth_gb_s"] = bandwidth / 1e9
    timing_began = time.perf_counter()  # the budget is the timing's own: warming is not counted
    for i, name in enumerate(names):
        spent = time.perf_counter() - timing_began
        if args.budget_s is not None and i and spent + spent / i > args.budget_s:
            record["skipped"] = names[i:]
            log(f"budget: {spent:.0f} s spent, skipping {', '.join(names[i:])}")
            break
        try:
            rows = run_design(SPECS / f"{name}.yaml", run, with_fla=with_fla, rounds=args.rounds, bandwidth=bandwidth,
                              log=log)
            record["rows"] += [asdict(r) for r in rows]
        except Exception as exc:  # one design failing (out of memory, ...) must not lose the others
            record["failed"][name] = traceback.format_exc()
            log(f"{name} failed: {first_line(exc)}")
        write_results(out, record)
        if with_fla and run.size.device == "cuda":
            # after every design: a run cut short keeps what it tuned; covered where fla's
            # model generated at every batch
            fla_rows = [r for r in record["rows"] if r["spec"] == name and r["impl"] == "fla"]
            whole = bool(fla_rows) and all(r["refused"] is None for r in fla_rows)
            picks.keep(out, log, designs=[name] if whole else ())
    write_results(out, record)
    log(f"wrote {out / 'decode.json'} and {out / 'decode.md'}")
    return 1 if record["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
