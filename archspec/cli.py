"""The language commands: `archspec validate`, `archspec compile`, `archspec schema`.

`validate` and `schema` handle every kind of file registered in `archspec.spec.kinds`
(model specs here; search specs and experiments register from `archspec.search`).

`search/cli.py` is the entry point and calls `register`. Errors the user can fix are
`ArchspecError`s: printed as located messages, exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from archspec.atomic import write_text_atomic
from archspec.errors import ArchspecError


def add_overrides_option(parser: argparse.ArgumentParser, example: str = "mixer.heads=8", what: str = "a field") -> None:
    """`--set KEY=VALUE` (repeatable, value parsed as YAML) into `args.overrides`: the one
    definition every command shares."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help=f"override {what} by its dotted key, value parsed as YAML (repeatable), e.g. --set {example}",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    validate = subparsers.add_parser(
        "validate", help="check model specs, search specs and experiment files; one line per file",
        description="Check each FILE: a model spec, a search spec or an experiment file, recognised by its "
        "top-level keys (or as --kind says). Every problem of a file is reported at once, with its file, "
        "line, column and dotted field. Exit status 2 when any file has a problem.",
    )
    validate.add_argument("specs", nargs="+", metavar="FILE", help="YAML files: model specs, search specs, experiments")
    validate.add_argument("--kind", metavar="KIND", help="read every FILE as this kind: model, search or experiment")
    add_overrides_option(validate)
    validate.set_defaults(func=run_validate)

    compile_ = subparsers.add_parser("compile", help="lower and build a spec; print plan, cost and caveats")
    compile_.add_argument("spec", metavar="SPEC", help="model spec YAML file")
    add_overrides_option(compile_)
    compile_.add_argument("--save", metavar="FILE", help="write the module (state_dict and resolved spec) to FILE")
    compile_.add_argument("--seq-len", type=int, default=2048, metavar="T", help="sequence length for FLOPs/token (default 2048)")
    compile_.add_argument(
        "--long-context", type=int, default=32768, metavar="T",
        help="the long context at which FLOPs/token and the decoding state are also given (default 32768)",
    )
    compile_.set_defaults(func=run_compile)

    schema = subparsers.add_parser(
        "schema", help="write the JSON Schema of model specs, search specs or experiments (for editors)",
        description="Write the JSON Schema of one kind of file. The committed copies under specs/ "
        "(spec.schema.json, search.schema.json, experiment.schema.json) are what the shipped files' "
        "yaml-language-server modelines point at.",
    )
    schema.add_argument("--kind", default="model", metavar="KIND", help="model (default), search or experiment")
    schema.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of standard output")
    schema.set_defaults(func=run_schema)


def run_validate(args: argparse.Namespace) -> int:
    from archspec.spec.kinds import kind_named, recognise_file

    forced = kind_named(args.kind) if args.kind else None
    failed = 0
    for path in args.specs:
        try:
            kind = forced or recognise_file(path)
            summary = kind.check(path, args.overrides)
        except ArchspecError as exc:
            failed += 1
            print(f"error: {exc}", file=sys.stderr)
            continue
        print(f"ok  {path}  ({summary})")
    return 2 if failed else 0


def run_compile(args: argparse.Namespace) -> int:
    from archspec.blocks import build_model
    from archspec.compiler import save_compiled
    from archspec.cost import estimate
    from archspec.lowering import lower
    from archspec.report import compile_report
    from archspec.spec.loader import load_spec

    if args.seq_len < 1:
        raise ArchspecError(f"--seq-len must be >= 1, got {args.seq_len}")
    if args.long_context < 1:
        raise ArchspecError(f"--long-context must be >= 1, got {args.long_context}")
    from archspec.memory import check_fits

    spec = load_spec(args.spec, args.overrides)
    plan = lower(spec)
    check_fits(plan, "cpu", what=f"spec {spec.name!r}")  # validate checks numbers one by one; their product must fit
    model = build_model(plan)
    cost = estimate(plan, seq_len=args.seq_len, long_context=args.long_context)
    console = Console(file=sys.stdout)
    console.print(compile_report(plan, cost, estimate(plan, seq_len=args.seq_len, long_context=args.long_context, device="cuda")))
    built = sum(p.numel() for p in model.parameters())
    if built != cost.params:  # the cost model mirrors the modules; say so if it ever drifts
        console.print(f"[red]warning: the built module has {built:,} parameters, the cost model says {cost.params:,}[/red]")
    if args.save:
        save_compiled(model, spec, args.save)
        console.print(f"saved {args.save}", soft_wrap=True, markup=False)  # a path is not wrapped where it could not be copied whole
    return 0


def run_schema(args: argparse.Namespace) -> int:
    import json

    from archspec.spec.kinds import kind_named

    text = json.dumps(kind_named(args.kind).schema(), indent=2) + "\n"
    if args.output:
        try:
            write_text_atomic(args.output, text)
        except OSError as exc:
            raise ArchspecError(f"cannot write {args.output}: {exc.strerror or exc}") from None
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return 0
