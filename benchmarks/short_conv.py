"""Short-convolution benchmark: the mixer streams' causal depthwise conv with its SiLU,
forward and forward + backward, ours beside flash-linear-attention's `causal_conv1d`.

    python benchmarks/short_conv.py [--rounds 5] [--against DIR] [--launch block_t=128,num_warps=8 ...]
                                    [--out DIR] [--smoke]

The shapes are one stream of the whole-model benchmark's layer (`models.py`: 16,384 tokens
a step, d_model 1024, kernel width 4, bfloat16): `q/v` (no norm), `key` (our conv also
L2-normalises each head of 128, which fla does inside its recurrence instead, so fla's
row is the conv alone) and `packed` (one row of documents of 64-4,096 tokens, as
`models.py` packs them, with `cu_seqlens`). A DeltaNet layer runs three such streams.

Per call it reports the median ms (`triton.testing.do_bench`) of ours and fla's timed
alternately in one process, `--rounds` rounds, and the floor: the bytes a pass must move
(forward x and y; backward x, dy and dx; the weight's few bytes aside) over the copy rate
measured on the H200. `--against DIR` also times an earlier copy of `kernels/` (`git
archive REV kernels | tar -x -C DIR`), alternately with the others; each `--launch`
times our kernels at other settings than `ShortConvLaunch`'s (the table in
`kernels/triton/launch.py`), after checking their output and gradients against the
table's (`max_rel_err`: a miscompile is off by far more than bfloat16's rounding).
Results: `DIR/short_conv.{json,md}`.

`do_bench` puts CUDA events around each call, so a call that issues several kernels (a
backward through autograd) also counts the host's gaps between them. On the H200 the
two-pass backward of a q/v stream took 0.51 ms here and 0.155 ms of device time in the
whole DeltaNet step's profile (`models.py`'s anatomy), where a one-pass backward that was
faster here was slower: judge a kernel change by that profile.
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

COPY_BYTES_PER_S = 4.27e12  # device-to-device copy measured on the H200 (kernel_times.py)
WIDTH = 4  # the models' conv width (`short_conv: 4` in specs/models)
EPS = 1e-6

# (name, B, T, C, head_dim, packed): one stream of the whole-model benchmark's layer
SETTINGS = [("q/v", 8, 2048, 1024, 0, False), ("key", 8, 2048, 1024, 128, False), ("packed", 1, 16384, 1024, 0, True)]
SMOKE_SETTINGS = [("q/v", 2, 40, 16, 0, False), ("key", 2, 40, 16, 8, False), ("packed", 1, 80, 16, 0, True)]


def document_offsets(total: int, seed: int = 0) -> torch.Tensor:
    """`cu_seqlens` of `total` tokens in documents of 64-4,096 (models.py's packed row)."""
    from models import ISSUE_SIZE, document_lengths

    lengths = document_lengths(total, min(ISSUE_SIZE.min_doc, total), min(ISSUE_SIZE.max_doc, total), seed)
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def floor_ms(B: int, T: int, C: int, element_bytes: int) -> dict[str, float]:
    """The fewest bytes each pass moves over the copy rate: forward x and y, forward +
    backward those and x, dy, dx again."""
    tensor = B * T * C * element_bytes
    return {"forward": 2 * tensor / COPY_BYTES_PER_S * 1e3, "forward+backward": 5 * tensor / COPY_BYTES_PER_S * 1e3}


def parse_launch(text: str):
    """`block_t=128,num_warps=8` -> a `ShortConvLaunch` with those fields changed."""
    from archspec.kernels.triton.launch import SHORT_CONV_LAUNCH

    return launch_with(SHORT_CONV_LAUNCH, text)


def at_launch(x: torch.Tensor, w: torch.Tensor, head: int, cu: torch.Tensor | None, dy: torch.Tensor, launch
              ) -> dict[str, Callable[[], Any]]:
    """Our Triton forward and forward + backward called at `launch` (no autograd: the
    backward from the fixed `dy`); each returns `[y]` or `[y, dx, dw]`."""
    from archspec.kernels.short_conv import packed_sequence_index
    from archspec.kernels.triton.short_conv import short_conv_backward_triton, short_conv_forward_triton

    starts, docs = (None, None) if cu is None else packed_sequence_index(cu, x.shape[1])
    xd, w2 = x.detach(), w.detach()
    options = dict(activation=True, head=head, eps=EPS, launch=launch)

    def forward() -> list[torch.Tensor]:
        return [short_conv_forward_triton(xd, w2, None, starts, docs, **options)]

    def both() -> list[torch.Tensor]:
        return forward() + list(short_conv_backward_triton(xd, w2, None, starts, docs, dy, **options))

    return {"forward": forward, "forward+backward": both}


def calls(x: torch.Tensor, w: torch.Tensor, head: int, cu: torch.Tensor | None, dy: torch.Tensor,
          before: Any | None, with_fla: bool) -> tuple[dict[str, dict[str, Callable[[], Any]]], dict[str, str]]:
    """Per implementation, its forward and forward + backward (from the fixed `dy`); and
    the peers that could not be had (fla not installed), with why."""
    from archspec.kernels import short_conv

    impls: dict[str, Callable[[], torch.Tensor]] = {
        "ours": lambda: short_conv(x, w, cu_seqlens=cu, head_dim=head, eps=EPS, backend="triton")}
    refused: dict[str, str] = {}
    if before is not None:
        impls["before"] = lambda: before.short_conv(x, w, cu_seqlens=cu, head_dim=head, eps=EPS, backend="triton")
    if with_fla:
        try:
            from fla.modules.causal_conv1d.ops import causal_conv1d
        except ImportError as exc:
            refused["fla"] = first_line(exc)
        else:
            impls["fla"] = lambda: causal_conv1d(x, w, activation="silu", backend="triton", cu_seqlens=cu)[0]

    def both(fn: Callable[[], torch.Tensor]) -> Callable[[], Any]:
        return lambda: torch.autograd.grad(fn(), [x, w], dy)

    return {name: {"forward": fn, "forward+backward": both(fn)} for name, fn in impls.items()}, refused


def time_setting(setting: tuple, rounds: int, before: Any | None, with_fla: bool, launches: list[str], device: str,
                 time_fn: Callable[[Callable[[], Any]], float]) -> dict[str, Any]:
    name, B, T, C, head, packed = setting
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(B, T, C, device=device, dtype=dtype, generator=gen).requires_grad_()
    # float32 like the models' conv weights, which autocast leaves as they are
    w = (0.5 * torch.randn(C, WIDTH, device=device, generator=gen)).requires_grad_()
    dy = torch.randn(B, T, C, device=device, dtype=dtype, generator=gen)
    cu = document_offsets(T).to(device) if packed else None
    table, refused = calls(x, w, head, cu, dy, before, with_fla)
    for impl, passes in list(table.items()):  # one untimed call each: a peer that refuses is recorded, not fatal
        try:
            passes["forward+backward"]()
        except Exception as exc:  # an earlier kernels/ of another API, fla's kernel on this machine
            refused[impl] = first_line(exc)
            del table[impl]
    errors: dict[str, float] = {}
    if launches:
        from archspec.kernels.triton.launch import SHORT_CONV_LAUNCH

        reference = at_launch(x, w, head, cu, dy, SHORT_CONV_LAUNCH)["forward+backward"]()
        for text in launches:
            passes = at_launch(x, w, head, cu, dy, parse_launch(text))
            errors[text] = max(relative_error(g, r) for g, r in zip(passes["forward+backward"](), reference))
            table[f"ours[{text}]"] = passes
    ms: dict[str, dict[str, list[float]]] = {impl: {p: [] for p in passes} for impl, passes in table.items()}
    for _ in range(rounds):
        for impl, passes in table.items():  # alternately: the host's and clocks' drift falls on all alike
            for p, fn in passes.items():
                ms[impl][p].append(time_fn(fn))
    row = {"setting": name, "B": B, "T": T, "C": C, "head_dim": head, "documents": None if cu is None else len(cu) - 1,
           "floor_ms": floor_ms(B, T, C, x.element_size()), "max_rel_err": errors, "refused": refused,
           "ms": {impl: {p: statistics.median(v) for p, v in passes.items()} for impl, passes in ms.items()}}
    return row


def markdown(record: dict) -> str:
    m = record["machine"]
    named = ["ours", "before", "fla"]
    impls = [i for i in named if any(i in r["ms"] for r in record["rows"])]
    impls += sorted({i for r in record["rows"] for i in r["ms"] if i not in named})  # ours at other launches
    head = " | ".join(f"{i} {p}" for p in ("forward", "forward+backward") for i in impls)
    lines = ["# Short convolution: ours against flash-linear-attention's causal_conv1d", "",
             f"{m.get('device', 'CPU')}, torch {m['torch']}, Triton {m['triton']}, fla {m['fla']}, commit {m['commit']} "
             f"(kernels {m['kernels_sha1']}), {m['date']}. Width {WIDTH}, SiLU, bfloat16; median ms of "
             f"{record['rounds']} alternating rounds; floor: the bytes a pass moves over {COPY_BYTES_PER_S / 1e12:.2f} "
             "TB/s. `key` normalises each head of 128 in our conv (fla's row is its conv alone)."
             + (f" `before`: the kernels in {record['against']}." if record.get("against") else ""), "",
             f"| setting | {head} | floor fwd / fwd+bwd |", "|---|" + "---|" * (2 * len(impls) + 1)]
    for r in record["rows"]:
        cells = [f"{r['ms'][i][p]:.3f}" if i in r["ms"] else "-" for p in ("forward", "forward+backward") for i in impls]
        lines.append(f"| {r['setting']} | " + " | ".join(cells) +
                     f" | {r['floor_ms']['forward']:.3f} / {r['floor_ms']['forward+backward']:.3f} |")
    refusals = {(impl, why) for r in record["rows"] for impl, why in r.get("refused", {}).items()}
    lines += [""] + [f"- {impl} refused: {why}" for impl, why in sorted(refusals)] if refusals else []
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peer_arguments(parser, "our kernels (ShortConvLaunch)", "block_t=128,num_warps=8")
    args, time_fn, device, before = parse_peer_arguments(parser, argv, parse_launch)
    settings = SMOKE_SETTINGS if args.smoke else SETTINGS
    record = {"machine": machine(), "rounds": args.rounds, "against": None if args.against is None else str(args.against),
              "rows": []}
    for setting in settings:
        record["rows"].append(time_setting(setting, args.rounds, before, not args.no_fla, args.launch, device, time_fn))
        write_results(args.out, "short_conv", record, markdown(record))  # after every setting
    table = markdown(record)
    print(table, flush=True)
    return record


if __name__ == "__main__":
    main()
