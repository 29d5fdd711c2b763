"""Where one step's device time goes: a profiled call's kernels, summed by name and by the
part of the model they serve (`CATEGORIES`), so that a whole-model row that misses its
target says which part limits it (ours and fla's kernels side by side).

On CUDA the profiler's device events are the kernels; on the CPU (the smoke run) the
operators stand in for them, so the path runs in CI.
"""

from __future__ import annotations

from typing import Callable

import torch

# (category, substrings of a kernel's lowercased name), first match wins. Names are ours
# (`kernels/triton`, `kernels/*.py`) and fla 0.6.0's; anything unmatched is "other"
# (torch's elementwise kernels, copies, reductions).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("cross_entropy", "softmax_ce", "logsumexp", "linear_cross", "_ce_", "nll_loss", "log_softmax")),
    ("attention", ("flash_fwd", "flash_bwd", "fmha", "attention", "sdpa", "cudnn_generated_fort_native_sdpa")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
                "matmul", "aten::linear", "sm90_", "sm80_")),
    ("short conv", ("conv",)),
    ("norms", ("norm",)),
    ("activation", ("swiglu", "swish", "silu", "sigmoid", "relu", "gelu")),
    ("recurrence", ("inverse_kernel", "prepare_kernel", "state_forward", "state_backward", "output_kernel",
                    "output_backward", "chunk", "gate_cumsum", "log_decay", "osdn_", "solve_tril", "wy",
                    "recompute_w_u", "merge_16x16", "kda", "gla", "delta", "rwkv", "cumsum", "fused_recurrent", "gdn_gate",
                    "compute_dh0", "gate_output_correction", "k_update")),
)
OTHER = "other"
KEPT_KERNELS = 30  # the heaviest kernels a record keeps by name


def category(name: str) -> str:
    low = name.lower()
    for label, needles in CATEGORIES:
        if any(n in low for n in needles):
            return label
    return OTHER


def profile(call: Callable[[], None], device: str) -> dict:
    """Run `call` once under the profiler: `busy_ms` (the kernels' summed device time),
    `categories` (ms per `CATEGORIES` label) and the `KEPT_KERNELS` heaviest `kernels`
    as [name, launches, ms]."""
    cuda = device.startswith("cuda")
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    if cuda:
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=[activity]) as prof:
        call()
        if cuda:
            torch.cuda.synchronize()
    wanted = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    by_name: dict[str, list[float]] = {}  # name -> [launches, ms]
    for event in prof.events():
        if event.device_type != wanted:
            continue
        # CPU operators nest (aten::linear holds aten::addmm): each counts its own time only.
        us = event.device_time if cuda else event.self_cpu_time_total
        entry = by_name.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += us / 1e3
    categories: dict[str, float] = {}
    for name, (_, ms) in by_name.items():
        label = category(name)
        categories[label] = categories.get(label, 0.0) + ms
    heaviest = sorted(by_name.items(), key=lambda item: -item[1][1])[:KEPT_KERNELS]
    return {
        "busy_ms": round(sum(ms for _, ms in by_name.values()), 3),
        "categories": {k: round(v, 3) for k, v in sorted(categories.items(), key=lambda kv: -kv[1])},
        "kernels": [[name, int(launches), round(ms, 3)] for name, (launches, ms) in heaviest],
    }


def markdown(anatomies: dict[str, dict], step_ms: dict[tuple[str, str], float] | None = None,
             host_ms: dict[tuple[str, str], tuple[float, float]] | None = None) -> list[str]:
    """A table of every design's profiled step: ms per category, ours and fla's rows.
    With `step_ms` (the timed step of (spec, impl) at the profiled setting), the share of
    the step the device spent idle: the host's (Python, launches) where it is large; with
    `host_ms`, the host's time to issue the forward + loss and the backward, which says
    which half it is."""
    if not anatomies:
        return []
    step_ms, host_ms = step_ms or {}, host_ms or {}
    labels = [label for label, _ in CATEGORIES] + [OTHER]
    lines = ["", "Where one forward + loss + backward spends its device time (one profiled step of each design "
             "at the setting shown, ms of kernel time by part of the model; `idle`: the share of the timed step "
             "no kernel ran; `host ms`: the host's time to issue the forward + loss and the backward, "
             "medians of the timed steps, which near the step's time where the host bounds it; `models.json` keeps "
             "the heaviest kernels by name):", "",
             "| spec | setting | impl | step ms | busy ms | idle | host ms fwd / bwd | " + " | ".join(labels) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(labels)]
    for spec in sorted(anatomies):
        setting = anatomies[spec]["setting"]
        for impl, prof in anatomies[spec]["impls"].items():
            step = step_ms.get((spec, impl))
            timed = "-" if step is None else f"{step:.2f}"
            idle = "-" if not step else f"{max(0.0, 1 - prof['busy_ms'] / step):.0%}"
            host = host_ms.get((spec, impl))
            issued = "-" if host is None else f"{host[0]:.2f} / {host[1]:.2f}"
            cells = [f"{prof['categories'].get(label, 0.0):.2f}" for label in labels]
            lines.append(f"| {spec} | {setting} | {impl} | {timed} | {prof['busy_ms']:.2f} | {idle} | {issued} | "
                         + " | ".join(cells) + " |")
    return lines
