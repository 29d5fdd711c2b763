"""What one training step keeps for its backward: the tensors autograd saves, per token,
by the module and the call that saved them, for each model spec.

    python benchmarks/activations.py [--specs a,b] [--out DIR] [--tokens T] [--merge]

The whole-model benchmark (`models.py`) measures peak memory; this says what it is made
of. Each spec is built at the benchmark's size (d_model 1024, 8 layers, 8 heads of 128,
vocabulary 32,000) and runs one forward + loss under bfloat16 autocast with the Triton
path of every kernel (`set_backend("triton")`): the autograd functions, and so the saved
tensors, of a CUDA training step. Off CUDA the kernels run under Triton's interpreter
(`TRITON_INTERPRET=1`, set here before Triton is imported) on a short sequence, so the
count takes minutes on a CPU and no GPU.

Every tensor reaching `saved_tensors_hooks` is counted once per storage and attributed
to the innermost module running when it was saved (layer indices dropped, so the rows
sum over layers) and to the function that saved it. The step runs at two lengths, and a
site's bytes per token are the slope between them: what grows with the tokens (the
activations), apart from what does not (autocast's bfloat16 copies of the weights).
Times 16,384 (the benchmark's tokens a step) the sum is the activations' share of that
step's peak memory; the rest of the peak is the weights, their gradients and AdamW's
moments (16 bytes a parameter) and the backward's transient buffers.

Results: `DIR/activations.json` and `DIR/activations.md`. `--merge` keeps an earlier
file's specs that are not counted now, each with the commit it was counted at (a full
count takes about an hour on two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: the CUDA path's functions on a CPU

import torch  # noqa: E402
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook  # noqa: E402

import archspec.kernels  # noqa: E402
import common  # noqa: E402
from archspec.triton_interpreter import patch_language_once_per_launch  # noqa: E402
from archspec.kernels.kinds import triton_interpreter_on  # noqa: E402
from models import ISSUE_SIZE, SMOKE_SIZE, SPECS, Size, load_plan, unfit_at  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEP_TOKENS = ISSUE_SIZE.tokens  # the whole-model benchmark's tokens a step
# The two lengths whose difference is counted: whole chunks of every kernel, and no
# width of the model, so that a shape's token dimension can be told from the others.
SHORT, LONG = 192, 320
# The tree whose code runs (the installed archspec's, which may not be this script's own
# checkout): the saving calls are named by their place in it.
CODE_ROOT = Path(archspec.kernels.__file__).resolve().parents[1]
OWN_CODE = (str(CODE_ROOT / "blocks"), str(CODE_ROOT / "kernels"), str(CODE_ROOT / "archspec"))


@dataclass(frozen=True)
class Site:
    """Where a saved tensor came from: the module (layer index dropped), the function of
    ours that saved it, and its dtype."""

    module: str
    saved_by: str
    dtype: str


def shape_of(tensor: torch.Tensor, tokens: int) -> str | None:
    """`[1, 320, 8, 128]` at 320 tokens -> `T x 8 x 128`, `[2560, 256]` -> `8T x 256` (a
    leading batch of 1 dropped); None for a shape without the tokens (a weight's copy)."""
    dims = list(tensor.shape[1:] if tensor.dim() > 1 and tensor.shape[0] == 1 else tensor.shape)
    named = ["T" if d == tokens else f"{d // tokens}T" if d % tokens == 0 and d > 0 else str(d) for d in dims]
    return " x ".join(named) if any(n.endswith("T") for n in named) else None


def saving_function() -> str:
    """`file:function` of the innermost frame of our own code on the stack: the call that
    handed autograd the tensor (a custom function's forward, or the line of a module that
    ran a torch op)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(OWN_CODE):
            return f"{os.path.relpath(path, CODE_ROOT)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "torch"


def module_name(path: str, module: torch.nn.Module) -> str:
    """`layers.3.mixer.o_norm` -> `mixer.o_norm (RMSNorm)`: the rows of one site sum over layers."""
    parts = [p for p in path.split(".") if not p.isdigit() and p != "layers"]
    return f"{'.'.join(parts) or 'model'} ({type(module).__name__})"


def saved_by_site(model: torch.nn.Module, tokens: int) -> tuple[dict[Site, int], dict[Site, set[str]]]:
    """Bytes autograd keeps for the backward of one loss over `tokens` tokens (one row),
    by site, and the shapes saved at each; parameters themselves are not counted (they
    are kept anyway)."""
    stack: list[str] = ["model (LanguageModel)"]
    names = {m: module_name(n, m) for n, m in model.named_modules() if n}

    def enter(module: torch.nn.Module, _args: Any) -> None:
        if module in names:
            stack.append(names[module])

    def leave(module: torch.nn.Module, _args: Any, _output: Any) -> None:  # returns None: the output stays
        if module in names:
            stack.pop()

    # Global hooks, not the modules' own: a module with hooks of its own may take another
    # path (the fused read-out runs `o_proj`'s forward only when it is hooked).
    hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed: list[tuple[weakref.ref, Site]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        site = Site(stack[-1], saving_function(), str(tensor.dtype).removeprefix("torch."))
        packed.append((weakref.ref(tensor), site, shape_of(tensor, tokens)))
        return tensor

    ids = torch.randint(0, model.plan.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    try:
        # bfloat16 autocast as the trainer's CUDA step (`archspec.training.autocast_for`)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, labels=ids)
    finally:
        for hook in hooks:
            hook.remove()
    # What the graph of `loss` still holds (a tensor saved and released during the forward
    # is gone), each storage once, at its largest view.
    storages: dict[int, tuple[int, Site, str]] = {}
    for ref, site, shape in packed:
        tensor = ref()
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in weights and storage.nbytes() > storages.get(pointer, (0,))[0]:
            storages[pointer] = (storage.nbytes(), site, shape)
    del loss
    sites: dict[Site, int] = defaultdict(int)
    shapes: dict[Site, set[str]] = defaultdict(set)
    for nbytes, site, shape in storages.values():
        sites[site] += nbytes
        if shape is not None:
            shapes[site].add(shape)
    return sites, shapes


def per_token(spec: Path, size: Size, short: int, long: int) -> dict[str, Any]:
    """One spec's saved bytes per token by site (the slope between `short` and `long`
    tokens), its parameters, and the total."""
    from archspec.blocks import build_model

    torch.manual_seed(0)
    model = build_model(load_plan(spec, size))
    model.set_backend("triton")
    (at_short, _), (at_long, shapes) = saved_by_site(model, short), saved_by_site(model, long)
    rows = []
    for site in set(at_short) | set(at_long):
        slope = (at_long.get(site, 0) - at_short.get(site, 0)) / (long - short)
        if slope > 0:
            rows.append({**asdict(site), "shapes": sorted(shapes.get(site, ())), "bytes_per_token": slope})
    rows.sort(key=lambda r: (-r["bytes_per_token"], r["module"], r["saved_by"]))
    total = sum(r["bytes_per_token"] for r in rows)
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "bytes_per_token": total, "layers": size.layers,
            "step_activations_gb": total * STEP_TOKENS / 1e9, "rows": rows}


def keep_earlier(record: dict[str, Any], earlier: dict[str, Any], names: list[str]) -> None:
    """`--merge`: the earlier file's specs not counted now, each with the commit it was
    counted at (the earlier run's, where the spec does not say), so the file can be
    brought up to date one spec at a time."""
    if earlier.get("size") != record["size"] or earlier.get("tokens") != record["tokens"]:
        raise SystemExit("--merge: the earlier results were counted at another size or token lengths; "
                         "count every spec again instead")
    commit = (earlier.get("machine") or {}).get("commit")
    record["specs"] = {name: {"measured": {"commit": commit}, **spec}
                       for name, spec in earlier.get("specs", {}).items() if name not in names}
    record["unfit"] = {**{k: v for k, v in earlier.get("unfit", {}).items() if k not in names}, **record["unfit"]}
    record["failed"] = {k: v for k, v in earlier.get("failed", {}).items() if k not in names}


def commit_notes(record: dict[str, Any]) -> list[str]:
    """Which commit each spec was counted at, where a merged file holds several."""
    commits: dict[str, list[str]] = {}
    for name, spec in record["specs"].items():
        commits.setdefault((spec.get("measured") or {}).get("commit") or "?", []).append(name)
    if len(commits) < 2:
        return []
    return ["", "Counted at several commits (`--merge`): "
            + "; ".join(f"{', '.join(names)}: {commit}" for commit, names in commits.items()) + "."]


def markdown(record: dict[str, Any]) -> str:
    s = record["size"]
    lines = [
        "# What a training step keeps for its backward",
        "",
        f"Saved tensors per token (`benchmarks/activations.py`): d_model {s['d_model']}, {s['layers']} layers, "
        f"{s['heads']} heads of {s['head_dim']}, vocabulary {s['vocab']}; bfloat16 autocast, every kernel's Triton "
        f"path (the CUDA step's autograd functions; run under Triton's interpreter), the slope between "
        f"{record['tokens'][0]} and {record['tokens'][1]} tokens. torch {record['machine']['torch']}, "
        f"commit {record['machine']['commit'] or '?'}. GB: times the whole-model benchmark's "
        f"{STEP_TOKENS:,} tokens a step.",
        "",
        "| spec | params | bytes per token | per token and layer | GB at 16,384 tokens | weights + AdamW GB |",
        "|---|---|---|---|---|---|",
    ]
    for name, d in record["specs"].items():
        lines.append(f"| {name} | {d['params']:,} | {d['bytes_per_token']:,.0f} | {d['bytes_per_token'] / d['layers']:,.0f} | "
                     f"{d['step_activations_gb']:.2f} | {d['params'] * 16 / 1e9:.2f} |")
    for name, d in record["specs"].items():
        lines += ["", f"## {name}", "", "| module | saved by | shapes (T: the tokens) | dtype | bytes per token |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['module']} | `{r['saved_by']}` | {'; '.join(r['shapes'])} | {r['dtype']} | {r['bytes_per_token']:,.0f} |"
                  for r in d["rows"]]
    lines += commit_notes(record)
    lines += common.run_notes(record)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    ap.add_argument("--specs", default=None, help="comma-separated spec names (default: every spec in specs/models)")
    ap.add_argument("--tokens", default=f"{SHORT},{LONG}", help="the two lengths whose difference is counted")
    ap.add_argument("--size", choices=("issue", "smoke"), default="issue",
                    help="the benchmark's model size, or models.py's tiny smoke size (tests)")
    ap.add_argument("--merge", action="store_true",
                    help="keep an earlier results file's specs that are not counted now (each spec records its commit)")
    args = ap.parse_args(argv)
    size = ISSUE_SIZE if args.size == "issue" else SMOKE_SIZE
    if triton_interpreter_on():
        patch_language_once_per_launch()  # the kernels' helper calls skip repeated patching
    short, long = (int(t) for t in args.tokens.split(","))
    if not 0 < short < long:
        print(f"--tokens: two lengths, the shorter first, got {args.tokens!r}", file=sys.stderr)
        return 2
    every = sorted(p.stem for p in SPECS.glob("*.yaml"))
    names = args.specs.split(",") if args.specs else every
    missing = [n for n in names if n not in every]
    if missing:
        print(f"unknown spec(s): {', '.join(missing)} (see {SPECS})", file=sys.stderr)
        return 2
    unfit = unfit_at(names, size)
    record: dict[str, Any] = {"machine": common.machine(), "size": asdict(size), "tokens": [short, long],
                              "specs": {}, "unfit": unfit, "failed": {}}
    out = Path(args.out)
    earlier = json.loads((out / "activations.json").read_text()) if args.merge and (out / "activations.json").exists() else None
    measured = {"commit": record["machine"]["commit"]}
    counted: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for done, name in enumerate(names, start=1):
        if name not in unfit:
            try:
                counted[name] = {**per_token(SPECS / f"{name}.yaml", size, short, long), "measured": measured}
                print(f"{name}: {counted[name]['bytes_per_token']:,.0f} bytes per token", flush=True)
            except Exception as exc:  # one spec failing must not lose the others
                failed[name] = traceback.format_exc()
                print(f"{name} failed: {common.first_line(exc)}", flush=True)
        # after every spec (minutes each): a run cut off keeps what it counted
        current = as_counted(record, earlier, counted, failed, names[:done])
        common.write_results(out, "activations", current, markdown(current))
    return 1 if failed else 0


def as_counted(record: dict[str, Any], earlier: dict[str, Any] | None, counted: dict[str, Any], failed: dict[str, str],
               done: list[str]) -> dict[str, Any]:
    """The results file once the specs `done` are through: those counted now and those that
    failed, and with `--merge` the earlier file's others (those not reached yet among them,
    each with its commit, so a run cut off loses nothing the file held)."""
    current = {**record, "specs": {}, "failed": {}}
    if earlier is not None:
        keep_earlier(current, earlier, done)
    current["specs"] = dict(sorted({**current["specs"], **counted}.items()))
    current["failed"] = {**current["failed"], **failed}
    return current


if __name__ == "__main__":
    sys.exit(main())
