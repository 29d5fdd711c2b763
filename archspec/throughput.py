"""Measured training throughput and peak memory of a module, and `archspec bench`.

`measure_training_throughput` runs the trainer's own training step (`archspec.training`:
bfloat16 autocast over float32 weights on CUDA, the loss without logits, fused AdamW) on
random tokens after a warm-up, on the device the caller names: the numbers a search
reports as `tokens_per_s` (forward + loss + backward) and `peak_mem_bytes` (the whole
step, optimizer state included: what training the model really needs). The optimizer
step is timed on its own (`optimizer_s`); it runs at learning rate 0 and the weights are
restored afterwards, so measuring leaves the module as it was. Each step is timed on its
own and the median step gives `tokens_per_s`, so that one step slowed by another process
on a shared machine does not move the figure.

Peak memory: on CUDA, `torch.cuda.max_memory_allocated` over the measured steps
(weights, gradients, AdamW's two moments, activations). On the CPU it is not measured
(`peak_mem_bytes` None, `peak_mem_note` says why): PyTorch keeps that counter only for
CUDA, and the process's resident memory (what an earlier version reported) mixes in
whatever the C allocator kept from earlier work and the interpreter's own memory, so it
read, for example, half a megabyte for training a model whose weights alone take more.
A figure that cannot be trusted is worse than none in a table of measurements (the
estimate before building, `blocks/memory.py`, is labelled as one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from archspec.errors import ArchspecError
from archspec.training import TrainingStep, autocast_for, make_optimizer

__all__ = ["ThroughputReport", "autocast_for", "measure_training_throughput", "register"]

CPU_PEAK_NOTE = (
    "not measured on the CPU: PyTorch counts peak memory only on CUDA (torch.cuda.max_memory_allocated), "
    "and the process's resident memory mixes in the C allocator's cache and earlier work"
)


@dataclass(frozen=True)
class ThroughputReport:
    tokens_per_s: float  # forward + loss + backward, after warm-up: batch * seq_len / median step time
    peak_mem_bytes: int | None  # the whole training step, optimizer state included; None off CUDA
    batch: int
    seq_len: int
    device: str
    steps: int
    step_seconds: tuple[float, ...]  # wall time of each timed forward + loss + backward
    optimizer_seconds: tuple[float, ...] = ()  # wall time of each timed optimizer step
    peak_mem_note: str | None = None  # why peak_mem_bytes is None
    cuda_graph: bool = False  # the step was replayed from a CUDA graph (`TrainingStep`)
    eager_reason: str | None = None  # why it was not

    @property
    def optimizer_s(self) -> float:
        """Median optimizer step (AdamW over every parameter), seconds."""
        return statistics.median(self.optimizer_seconds) if self.optimizer_seconds else float("nan")


def _vocab_size(model: nn.Module) -> int:
    plan = getattr(model, "plan", None)
    if plan is not None and hasattr(plan, "vocab_size"):
        return int(plan.vocab_size)
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.num_embeddings
    raise ArchspecError("cannot tell the module's vocabulary size: pass vocab_size=")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_training_throughput(
    model: nn.Module,
    *,
    batch: int,
    seq_len: int,
    device: str | torch.device = "cpu",
    warmup: int = 3,
    steps: int = 5,
    vocab_size: int | None = None,
    seed: int = 0,
    graphed: bool | None = None,
    step: TrainingStep | None = None,
) -> ThroughputReport:
    """Tokens per second of the training step on `[batch, seq_len]` random tokens.

    The step is the trainer's (`TrainingStep`): replayed from a CUDA graph where it can be
    (`graphed` None), always eager (False), or a graph or an error (True). With a graph,
    the peak is the larger of the most allocated at once (the warm-up's eager steps and
    the capture) and what is allocated between replays with the graph's private pool
    counted whole (`GraphedStep.pool_bytes`: it stays reserved between replays). A caller
    that trains the module next passes its own `step` (the trainer does), so the graph
    captured here is the one its training replays, not captured a second time; `graphed`
    applies to a step made here.

    The module is moved to `device`; its weights are restored and its gradients cleared
    afterwards. Inputs come from a private generator, so measuring does not disturb the
    global random state.
    """
    if batch < 1 or seq_len < 1 or steps < 1 or warmup < 0:
        raise ArchspecError(f"throughput: need batch, seq_len, steps >= 1 and warmup >= 0; got {batch}, {seq_len}, {steps}, {warmup}")
    device = torch.device(device)
    vocab = vocab_size or _vocab_size(model)
    model.to(device)
    was_training = model.training
    model.train()
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (batch, seq_len + 1), generator=generator).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    # Learning rate 0 keeps the weights as they are; the copy guards against a step that a
    # non-finite gradient would still turn into NaN.
    saved = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    optimizer = make_optimizer(model, lr=0.0, device=device)

    owned = step is None
    step = TrainingStep(model, device=device, graphed=graphed) if step is None else step

    def forward_backward() -> None:
        step(inputs, labels)

    def optimizer_step() -> None:
        optimizer.step()
        model.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        forward_backward()
        optimizer_step()
    _synchronize(device)
    step_seconds, optimizer_seconds = [], []
    for _ in range(steps):
        start = time.perf_counter()
        forward_backward()
        _synchronize(device)
        middle = time.perf_counter()
        optimizer_step()
        _synchronize(device)
        step_seconds.append(middle - start)
        optimizer_seconds.append(time.perf_counter() - middle)

    peak: int | None = None
    note: str | None = None
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        if step.graphed:  # during a replay the whole pool is in use, its free blocks too
            reserved, allocated = step.graph.pool_bytes
            peak = max(peak, int(torch.cuda.memory_allocated(device)) + reserved - allocated)
    else:
        note = CPU_PEAK_NOTE if device.type == "cpu" else f"not measured on {device.type}: no peak-memory counter there"
    graph_used, eager_reason = step.graphed, step.eager_reason
    del optimizer
    if owned:
        del step  # the graph and its memory pool go before the weights come back (in place, where it read them)
    model.load_state_dict(saved)
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return ThroughputReport(
        tokens_per_s=batch * seq_len / statistics.median(step_seconds),
        peak_mem_bytes=peak,
        batch=batch,
        seq_len=seq_len,
        device=str(device),
        steps=steps,
        step_seconds=tuple(step_seconds),
        optimizer_seconds=tuple(optimizer_seconds),
        peak_mem_note=note,
        cuda_graph=graph_used,
        eager_reason=eager_reason,
    )


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------- archspec bench


def register(subparsers: argparse._SubParsersAction) -> None:
    from archspec.cli import add_overrides_option  # the CLI module imports the spec stack: only when the CLI runs

    bench = subparsers.add_parser(
        "bench",
        help="measure a spec's training throughput (tokens/s, forward+loss+backward) and peak memory",
        description="Compile SPEC and time the training step (forward, loss, backward; the AdamW step "
        "apart) on random tokens on the current device, bfloat16 autocast on CUDA "
        "(the tokens_per_s and peak_mem_bytes a search reports).",
    )
    bench.add_argument("spec", metavar="SPEC", help="model spec YAML file")
    add_overrides_option(bench, what="a spec field")
    bench.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    bench.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    bench.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    bench.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3; the first calls are slow)")
    bench.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    bench.add_argument("--eager", action="store_true",
                       help="time the eager step, not its CUDA-graph replay (on CUDA the trainer replays a graph "
                            "where the model allows it)")
    bench.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    bench.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    import archspec
    from archspec.atomic import write_text_atomic

    device = args.device or default_device()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ArchspecError(f"--device {device}: no CUDA device is available here")
    from archspec.blocks import build_model
    from archspec.memory import check_fits

    spec = archspec.load_spec(args.spec, args.overrides)
    plan = archspec.lower(spec)
    what = f"spec {spec.name!r}"
    check_fits(plan, "cpu", what=what)  # built on the CPU first
    check_fits(plan, device, batch=args.batch, seq_len=args.seq_len, training=True, what=what)
    model = build_model(plan)
    report = measure_training_throughput(
        model, batch=args.batch, seq_len=args.seq_len, device=device, warmup=args.warmup, steps=args.steps,
        graphed=False if args.eager else None,
    )
    table = Table(title=f"archspec bench {args.spec}")
    table.add_column("tokens/s", justify="right")
    table.add_column("optimizer step", justify="right")
    table.add_column("peak memory", justify="right")
    table.add_column("batch x seq_len", justify="right")
    table.add_column("device")
    table.add_column("step")
    table.add_column("params", justify="right")
    params = sum(p.numel() for p in model.parameters())
    mem = "not measured" if report.peak_mem_bytes is None else f"{report.peak_mem_bytes / 2**20:,.1f} MiB"
    table.add_row(f"{report.tokens_per_s:,.0f}", f"{report.optimizer_s * 1e3:,.1f} ms", mem, f"{report.batch} x {report.seq_len}", report.device, "CUDA graph" if report.cuda_graph else "eager", f"{params:,}")
    console = Console()
    console.print(table)
    if report.peak_mem_note:
        console.print(f"peak memory: {report.peak_mem_note}", markup=False, highlight=False, soft_wrap=True)
    if not report.cuda_graph and report.eager_reason and device.startswith("cuda"):
        console.print(f"eager step: {report.eager_reason}", markup=False, highlight=False, soft_wrap=True)
    if args.json:
        record = {"spec": str(args.spec), "params": params, **asdict(report), "optimizer_s": report.optimizer_s}
        write_text_atomic(args.json, json.dumps(record, indent=2) + "\n")
    return 0

