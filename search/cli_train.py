"""`archspec train SPEC --task NAME`: train one spec on one task and write its scores.

Writes `DIR/metrics.json` (atomically), `DIR/accuracy.png`, `DIR/training.png` (loss and
validation metrics by step), with `--diagnostics` `DIR/diagnostics.png`, and the trained
model (`DIR/model.safetensors` with `DIR/spec.yaml`: `archspec.load(DIR)`); shows a progress
bar on a terminal and plain progress lines otherwise; prints the metrics. `--resume`
continues an unfinished run in DIR. Exit status 0 when the run finished, 1 when it
diverged or failed (the reason is in metrics.json and printed), 2 for bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from archspec.cli import add_overrides_option
from archspec.errors import ArchspecError


def register(subparsers: argparse._SubParsersAction) -> None:
    from .tasks import PRESET_NAMES, task_names

    p = subparsers.add_parser(
        "train",
        help="train a spec on a quality task; write metrics.json and plots",
        description="Train SPEC on a task (see docs/tasks.md) and write DIR/metrics.json, DIR/accuracy.png, "
        "DIR/training.png and, with --diagnostics, DIR/diagnostics.png. On a terminal a progress bar shows "
        "the run; in a log (tee, nohup, CI) one plain line per validation does.",
    )
    p.add_argument("spec", metavar="SPEC", help="model spec YAML file")
    p.add_argument("--task", required=True, metavar="NAME", help=f"one of: {', '.join(task_names())}")
    add_overrides_option(p, "mixer.transition.n_h=2", what="a spec field")
    p.add_argument(
        "--task-option", dest="task_options", action="append", default=[], metavar="KEY=VALUE",
        help="set a task option (repeatable), e.g. --task-option train_len=64",
    )
    p.add_argument("--preset", choices=PRESET_NAMES, default="cpu", help="task size and training settings (default cpu)")
    p.add_argument("--out", metavar="DIR", help="output directory (default runs/train/<spec>-<task>-s<seed>)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the training data (default 0)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default: the preset's)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the preset's)")
    p.add_argument("--warmup-steps", type=int, help="linear warm-up steps (default: the preset's)")
    p.add_argument("--eval-every", type=int, help="validate every N steps (default: the preset's)")
    p.add_argument("--target", type=float, help="early-stop threshold of the task's validation metric; 0 never stops")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--backend", choices=("torch", "triton", "naive"), help="force a kernel backend (default auto)")
    p.add_argument("--activation-checkpointing", type=int, default=0, metavar="N",
                   help="keep only every N-th block's inputs and run its forward again in the backward: the same "
                   "gradients in less memory (default 0: none)")
    p.add_argument("--diagnostics", action="store_true", help="effective rank, residual ratio q_t, factor norms, and their plot")
    p.add_argument("--no-throughput", action="store_true", help="skip measuring tokens_per_s and peak_mem_bytes")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")
    p.add_argument("--resume", action="store_true",
                   help="continue the unfinished run in DIR from its last validation (same spec and settings)")
    p.set_defaults(func=run)

    e = subparsers.add_parser(
        "experiment",
        help="train the runs of an experiment file (specs/experiments/) and tabulate them",
        description="Train every run and seed of an experiment file into DIR/<run>/s<seed>/ and write "
        "DIR/results.md and DIR/results.json; runs already finished in DIR are skipped.",
    )
    e.add_argument("experiment", metavar="FILE", help="experiment YAML file")
    e.add_argument("--out", metavar="DIR", help="output directory (needed unless --costs-of)")
    add_overrides_option(e, "train.steps=100", what="a field of the experiment file")
    e.add_argument("--only", action="append", default=[], metavar="RUN", help="run only this run (repeatable)")
    e.add_argument("--fresh", action="store_true", help="retrain the selected runs even if DIR has them")
    e.add_argument("--device", default="auto", help="cpu, cuda, ... (default: cuda if available)")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.add_argument("--costs-of", nargs="+", metavar="RESULTS.json",
                   help="train nothing: recompute the cost columns (params, flops_per_token, state_bytes, also at the long context) of these "
                   "results files of FILE from the current code (after a change to the cost model)")
    e.set_defaults(func=run_experiment_command)


def run_experiment_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .experiments import load_experiment, refresh_costs, results_renderable, run_experiment

    if args.costs_of:
        for results_file in args.costs_of:
            changes = refresh_costs(results_file, args.experiment)
            print(f"{results_file}: {len(changes)} cost value(s) changed" + "".join(f"\n  {c}" for c in changes))
        return 0
    if args.out is None:
        raise ArchspecError("archspec experiment: give the output directory, --out DIR")
    results = run_experiment(
        args.experiment, args.out, device=args.device, overrides=args.overrides, only=args.only, fresh=args.fresh, quiet=args.quiet
    )
    Console().print(results_renderable(load_experiment(args.experiment, args.overrides)[0], results))
    # A diverging configuration is a finding; a failed run (an error) is not.
    failed = [name for name, seeds in results.items() for r in seeds.values() if r["status"] == "failed"]
    return 1 if failed else 0


def parse_options(items: list[str], flag: str) -> dict[str, object]:
    """`key=value` strings with YAML values (`train_len=64`, `eval_factors=[1,2]`)."""
    import yaml

    options: dict[str, object] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ArchspecError(f"{flag} {item}: expected KEY=VALUE, e.g. {flag} train_len=64")
        try:
            options[key.strip()] = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ArchspecError(f"{flag} {item}: the value is not valid YAML ({exc.__class__.__name__})") from None
    return options


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .checkpoints import RESUME_FILE, unfinished_step
    from .formatting import number
    from .tasks import get_task
    from .trainer import train

    spec_path = Path(args.spec)
    if not spec_path.is_file():
        raise ArchspecError(f"{args.spec}: no such spec file")
    task = get_task(args.task, args.preset, **parse_options(args.task_options, "--task-option"))
    out = Path(args.out) if args.out else Path("runs") / "train" / f"{spec_path.stem}-{task.name}-s{args.seed}"
    left = unfinished_step(out)
    if left is not None and not args.resume:
        raise ArchspecError(f"{out} holds an unfinished run ({RESUME_FILE}, step {left}): continue it with --resume, "
                            "or choose another --out (or delete that file to start over)")
    result = train(
        args.spec,
        task,
        steps=args.steps,
        seed=args.seed,
        device=args.device,
        out_dir=out,
        overrides=args.overrides,
        diagnostics=args.diagnostics,
        quiet=args.quiet,
        preset=args.preset,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        eval_every=args.eval_every,
        target=args.target,
        backend=args.backend,
        measure_throughput=not args.no_throughput,
        resume=args.resume,
        activation_checkpointing=args.activation_checkpointing,
    )
    console = Console(stderr=result.status != "ok")
    if not args.quiet:
        table = Table(title=f"{spec_path.name} on {task.name}: {result.status} after {result.steps_done} steps")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for name, value in result.metrics.items():
            table.add_row(name, number(value))
        not_measured = result.record.get("not_measured", {})
        for name in not_measured:
            table.add_row(name, "not measured")
        console.print(table)
        for layer, note in result.record.get("diagnostics", {}).get("notes", {}).items():
            console.print(f"layer {layer}: {note}")
        for name, why in not_measured.items():
            console.print(f"{name}: {why}", markup=False, highlight=False, soft_wrap=True)
    if result.status != "ok":
        console.print(f"[bold red]{result.status}[/]: {result.reason}")
    console.print(f"wrote {out / 'metrics.json'}", soft_wrap=True, markup=False)
    saved = result.record.get("checkpoint")
    if saved:
        which = f"{saved['metric']} = {saved['value']:.4g}" if "metric" in saved else "the last weights"
        console.print(f"wrote {out / saved['weights']} (step {saved['step']}, {which}); archspec.load('{out}') rebuilds it",
                      soft_wrap=True, markup=False)
    return 0 if result.status == "ok" else 1
