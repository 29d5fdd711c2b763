"""The `archspec` command.

It lives in `search` because that is the top of the import graph
(`search -> archspec -> blocks -> kernels`): the language commands (validate, compile,
schema) come from `archspec.cli`, the training, search and analysis commands from this
package. Each command module exposes `register(subparsers)`, which adds its subparser and
sets `func=run`, `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from archspec.errors import ArchspecError

# Modules that contribute commands, in the order `archspec --help` lists them.
COMMAND_MODULES = (
    "archspec.cli",
    "archspec.cli_export",
    "archspec.search.cli_train",
    "archspec.search.cli_search",
    "archspec.throughput",
)


def build_parser() -> argparse.ArgumentParser:
    # Search specs and experiment files become kinds `archspec validate` and `schema` know.
    importlib.import_module("archspec.search.file_kinds")
    parser = argparse.ArgumentParser(
        prog="archspec",
        description="Declarative architecture search for linear-RNN sequence mixers.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a command module not written yet
            if exc.name == name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ArchspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
