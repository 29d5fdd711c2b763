"""Loss benchmark: the language model's head and cross-entropy, forward + backward, ours
beside flash-linear-attention's `FusedLinearCrossEntropyLoss`, and our per-chunk softmax
step alone, also at other launch settings.

    python benchmarks/loss.py [--rounds 5] [--against DIR] [--launch block_v=4096,num_warps=8 ...]
                              [--out DIR] [--smoke]

The shapes are the whole-model benchmark's head (`models.py`): 16,384 rows of d_model
1,024 in bfloat16 (the final norm's output under autocast), a float32 weight of 32,000
words (the master weight, which autocast casts), targets uniform over the vocabulary.

- `linear`: hidden rows -> mean loss -> the gradients of the rows and the weight, under
  bfloat16 autocast: ours `kernels.linear_cross_entropy` (chunks of `chunk_rows_for`), fla's
  loss as its models call it (8 chunks). Median ms, and the call's peak memory above its
  inputs (MiB): the head's transient memory in a training step.
- `softmax`: our step over all 16,384 x 32,000 bfloat16 logits in one call
  (`softmax_ce_grad_triton`: the loss of each row, the logits overwritten by their
  gradient; later calls read the gradients the first wrote, the same work). Floor: two
  reads and one write of the logits at the copy rate measured in the same run.

Each `--launch` times the softmax step at other `CrossEntropyLaunch` settings (the table
in `kernels/triton/launch.py`) after checking its losses and gradients against the
table's (`max_rel_err`). `--against DIR` also times an earlier copy of `kernels/` (`git
archive REV kernels | tar -x -C DIR`) on both rows. Implementations are timed alternately
in one process, `--rounds` rounds. Results: `DIR/loss.{json,md}`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import first_line, launch_with, machine, parse_peer_arguments, peer_arguments, relative_error, write_results  # noqa: E402  (a script beside its helpers)

# (rows, d_model, vocabulary): the whole-model benchmark's step (B=8, T=2048)
SIZE = (16_384, 1_024, 32_000)
SMOKE_SIZE = (48, 32, 208)
MIB = 1 << 20


def parse_launch(text: str):
    """`block_v=8192,num_warps=16` -> a `CrossEntropyLaunch` with those fields changed."""
    from archspec.kernels.triton.launch import CROSS_ENTROPY_LAUNCH

    return launch_with(CROSS_ENTROPY_LAUNCH, text)


def inputs(size: tuple[int, int, int], device: str) -> dict[str, torch.Tensor]:
    rows, d, vocab = size
    gen = torch.Generator(device=device).manual_seed(0)
    half = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's smoke run in float32
    hidden = torch.randn(rows, d, device=device, generator=gen).to(half).requires_grad_()
    weight = (torch.randn(vocab, d, device=device, generator=gen) / d ** 0.5).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    # logits of the spread a trained head gives (a few units), for the softmax row
    logits = (2 * torch.randn(rows, vocab, device=device, generator=gen)).to(half)
    return {"hidden": hidden, "weight": weight, "targets": targets, "logits": logits}


def linear_calls(x: dict[str, torch.Tensor], before: Any | None, with_fla: bool
                 ) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    """Per implementation, one forward + backward of the head (the gradients of the rows
    and the weight); and the peers that could not be had, with why."""
    from archspec.kernels import linear_cross_entropy

    hidden, weight, targets = x["hidden"], x["weight"], x["targets"]
    device = hidden.device.type
    losses: dict[str, Callable[[], torch.Tensor]] = {
        "ours": lambda: linear_cross_entropy(hidden, weight, targets, backend="triton")}
    refused: dict[str, str] = {}
    if before is not None:
        losses["before"] = lambda: before.linear_cross_entropy(hidden, weight, targets, backend="triton")
    if with_fla:
        try:
            from fla.modules import FusedLinearCrossEntropyLoss
        except ImportError as exc:
            refused["fla"] = first_line(exc)
        else:
            fla_loss = FusedLinearCrossEntropyLoss()
            losses["fla"] = lambda: fla_loss(hidden, targets, weight)

    def step(loss: Callable[[], torch.Tensor]) -> Callable[[], Any]:
        def run() -> tuple[torch.Tensor, ...]:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                value = loss()
            return (value, *torch.autograd.grad(value, [hidden, weight]))
        return run

    return {name: step(loss) for name, loss in losses.items()}, refused


def softmax_calls(x: dict[str, torch.Tensor], before: Any | None, launches: list[str]
                  ) -> tuple[dict[str, Callable[[], Any]], dict[str, float]]:
    """Our softmax step (and an earlier copy's, and ours at each of `launches`) over the
    whole logits buffer in place; and each launch's largest error against the table's."""
    from archspec.kernels.triton.cross_entropy import softmax_ce_grad_triton
    from archspec.kernels.triton.launch import CROSS_ENTROPY_LAUNCH

    logits, targets = x["logits"], x["targets"]
    scale = torch.full((), 1.0 / logits.shape[0], device=logits.device)

    def at(launch, fn=softmax_ce_grad_triton) -> Callable[[], Any]:
        options = {} if launch is None else {"launch": launch}
        return lambda buffer=logits: (fn(buffer, targets, ignore_index=-100, scale=scale, **options), buffer)

    calls = {"ours": at(None)}
    if before is not None:
        from importlib import import_module

        calls["before"] = at(None, import_module(f"{before.__name__}.triton.cross_entropy").softmax_ce_grad_triton)
    errors: dict[str, float] = {}
    if launches:
        want = at(CROSS_ENTROPY_LAUNCH)(logits.clone())
        for text in launches:
            got = at(parse_launch(text))(logits.clone())
            errors[text] = max(relative_error(g, w) for g, w in zip(got, want))
            calls[f"ours[{text}]"] = at(parse_launch(text))
    return calls, errors


def peak_mib(fn: Callable[[], Any]) -> float | None:
    """Memory a call holds at its peak above what was allocated before it (CUDA only)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / MIB


def copy_rate(x: torch.Tensor, time_fn: Callable[[Callable[[], Any]], float]) -> float | None:
    """Bytes per second of a device-to-device copy of `x` (read and written), or None
    where the timer has no clock (the smoke run)."""
    target = torch.empty_like(x)
    ms = time_fn(lambda: target.copy_(x))
    return 2 * x.numel() * x.element_size() / (ms / 1e3) if ms > 0 else None


def run(size: tuple[int, int, int], rounds: int, before: Any | None, with_fla: bool, launches: list[str], device: str,
        time_fn: Callable[[Callable[[], Any]], float]) -> dict[str, Any]:
    x = inputs(size, device)
    rows: dict[str, dict[str, Callable[[], Any]]] = {}
    rows["linear"], refused = linear_calls(x, before, with_fla)
    rows["softmax"], errors = softmax_calls(x, before, launches)
    peaks: dict[str, float | None] = {}
    for row, table in rows.items():  # one untimed call each: a peer that refuses is recorded, not fatal
        for impl, fn in list(table.items()):
            try:
                peak = peak_mib(fn)
            except Exception as exc:  # an earlier kernels/ of another API, fla's kernel on this machine
                refused[impl if row == "linear" else f"{impl} ({row})"] = first_line(exc)
                del table[impl]
            else:
                if row == "linear":
                    peaks[impl] = peak
    ms: dict[str, dict[str, list[float]]] = {row: {impl: [] for impl in table} for row, table in rows.items()}
    for _ in range(rounds):
        for row, table in rows.items():  # alternately: the host's and clocks' drift falls on all alike
            for impl, fn in table.items():
                ms[row][impl].append(time_fn(fn))
    rate = copy_rate(x["logits"], time_fn)
    logit_bytes = x["logits"].numel() * x["logits"].element_size()
    return {"rows": size[0], "d_model": size[1], "vocab": size[2], "dtype": str(x["hidden"].dtype).removeprefix("torch."),
            "ms": {row: {impl: statistics.median(v) for impl, v in table.items()} for row, table in ms.items()},
            "peak_mib": peaks, "max_rel_err": errors, "refused": refused, "copy_bytes_per_s": rate,
            "softmax_floor_ms": None if rate is None else 3 * logit_bytes / rate * 1e3}


def markdown(record: dict) -> str:
    m, r = record["machine"], record["result"]
    lines = ["# The head's linear cross-entropy: ours against flash-linear-attention's", "",
             f"{m.get('device', 'CPU')}, torch {m['torch']}, Triton {m['triton']}, fla {m['fla']}, commit {m['commit']} "
             f"(kernels {m['kernels_sha1']}), {m['date']}. {r['rows']:,} rows, d_model {r['d_model']:,}, vocabulary "
             f"{r['vocab']:,}, {r['dtype']} rows and a float32 weight under autocast; median ms of {record['rounds']} "
             "alternating rounds." + (f" `before`: the kernels in {record['against']}." if record.get("against") else ""),
             "", "| implementation | linear fwd+bwd ms | its peak above inputs MiB | softmax step ms |", "|---|---|---|---|"]
    impls = list(dict.fromkeys([*r["ms"]["linear"], *r["ms"]["softmax"]]))
    for impl in impls:
        linear, soft = r["ms"]["linear"].get(impl), r["ms"]["softmax"].get(impl)
        peak = r["peak_mib"].get(impl)
        lines.append(f"| {impl} | {'-' if linear is None else f'{linear:.3f}'} | {'-' if peak is None else f'{peak:.0f}'} | "
                     f"{'-' if soft is None else f'{soft:.3f}'} |")
    if r["softmax_floor_ms"] is not None:
        lines += ["", f"Softmax step floor: two reads and one write of the logits at the measured copy rate "
                      f"({r['copy_bytes_per_s'] / 1e12:.2f} TB/s): {r['softmax_floor_ms']:.3f} ms."]
    if r["max_rel_err"]:
        lines += ["", "Launch settings against the table's, largest relative error of the losses and gradients: "
                  + "; ".join(f"{k}: {v:.1e}" for k, v in r["max_rel_err"].items()) + "."]
    lines += [f"- {impl} refused: {why}" for impl, why in sorted(r["refused"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peer_arguments(parser, "our softmax step (CrossEntropyLaunch)", "block_v=4096,num_warps=8")
    args, time_fn, device, before = parse_peer_arguments(parser, argv, parse_launch)
    size = SMOKE_SIZE if args.smoke else SIZE
    record = {"machine": machine(), "rounds": args.rounds, "against": None if args.against is None else str(args.against),
              "result": run(size, args.rounds, before, not args.no_fla, args.launch, device, time_fn)}
    table = markdown(record)
    write_results(args.out, "loss", record, table)
    print(table, flush=True)
    return record


if __name__ == "__main__":
    main()
