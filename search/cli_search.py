"""`archspec search` (run or resume a search) and `archspec pareto` (read and compare runs)."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from archspec.cli import add_overrides_option

HELP_SEARCH = """\
Search a space of model specs with Ray Tune and Optuna for the Pareto front of the
objectives (docs/search.md). Everything goes to the run directory --out: the resolved
search spec, every trial's spec, metrics and status, the Optuna study (study.db, named
after the search; open it with optuna-dashboard, the optional extra `[dashboard]`).
--dry-run checks the spec and prints what it would search, starting nothing. --resume continues a search that crashed, was interrupted or
was killed, without redoing finished trials.
"""

HELP_PARETO = """\
The non-dominated trials of each run as a table; for several runs, hypervolume and IGD+
against a shared reference point (objectives normalised over the union of the fronts).
Works on a search that is still running.
"""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    search = subparsers.add_parser("search", help="search a space of specs (Ray Tune + Optuna)", description=HELP_SEARCH)
    search.add_argument("search", nargs="?", metavar="SEARCH", help="the search spec (YAML); optional with --resume")
    search.add_argument("--out", metavar="DIR", help="the run directory (needed unless --dry-run)")
    search.add_argument("--trials", type=_positive, metavar="N", help="trials to train (overrides budget.trials)")
    search.add_argument("--resume", action="store_true", help="continue the search in DIR")
    search.add_argument("--address", metavar="HOST:PORT", help="join this Ray cluster instead of starting a local Ray")
    add_overrides_option(search, "budget.steps=50", what="a search-spec field")
    search.add_argument("--no-live", dest="live", action="store_false", help="no live view (one line per finished trial)")
    search.add_argument("--dry-run", action="store_true",
                        help="check the search spec and print its space (points, values a constraint rules out), "
                        "tasks, the metrics the trials report against the objectives, budget; start nothing")
    search.set_defaults(func=run_search_command)

    pareto = subparsers.add_parser("pareto", help="Pareto fronts of search runs; hypervolume and IGD+ between them",
                                   description=HELP_PARETO)
    pareto.add_argument("runs", nargs="+", metavar="DIR", help="run directories of `archspec search`")
    pareto.add_argument("--json", action="store_true", help='print {"front": [...], "trials_completed": N, ...} instead of tables')
    pareto.add_argument("--plot", metavar="FILE.png", help="write a plot overlaying the fronts")
    pareto.set_defaults(func=run_pareto_command)


def run_search_command(args: argparse.Namespace) -> int:
    from archspec.errors import ArchspecError
    from archspec.search.pareto import read_run
    from archspec.search.runner import run_search
    from archspec.search.space import load_search_spec
    from archspec.search.tables import run_front_table

    console = Console()
    if args.dry_run:
        if args.search is None or args.resume:
            raise ArchspecError("--dry-run checks a search spec: give SEARCH (and no --resume)")
        from archspec.search.dry_run import print_dry_run

        print_dry_run(load_search_spec(args.search, args.overrides), console)
        return 0
    if args.out is None:
        raise ArchspecError("archspec search: give the run directory, --out DIR (or --dry-run to only check the spec)")
    if args.search is None and not args.resume:
        raise ArchspecError("archspec search: give the search spec (SEARCH), or --resume --out DIR to continue a run")
    if args.search is None and args.overrides:
        raise ArchspecError("--set applies to a search spec file; a resumed run keeps the spec it started with")
    loaded = load_search_spec(args.search, args.overrides) if args.search else None
    outcome = run_search(loaded, args.out, resume=args.resume, trials=args.trials, address=args.address, live=args.live)
    run = read_run(outcome.run.path)
    console.print(run_front_table(run))
    console.print(f"run directory: {outcome.run.path}", markup=False, highlight=False, soft_wrap=True)
    console.print(dashboard_hint(outcome.run.study_url), markup=False, highlight=False, soft_wrap=True)
    if outcome.exhausted:
        print(f"note: {outcome.stopped_because}", file=sys.stderr)
        return 0
    if outcome.stopped_because:
        print(f"error: the search stopped: {outcome.stopped_because}", file=sys.stderr)
        return 1
    if not outcome.complete:
        print(f"interrupted: {outcome.trained} of {outcome.target} trials trained; continue with "
              f"`archspec search --resume --out {args.out}`", file=sys.stderr)
        return 130
    return 0


def dashboard_hint(study_url: str) -> str:
    """How to open the study in optuna-dashboard, an optional extra: the command when it
    is installed, how to install it when not."""
    import importlib.util

    if importlib.util.find_spec("optuna_dashboard") is not None:
        return f"the study: optuna-dashboard {study_url}"
    return (f"the study: {study_url}; to browse it, install the optional dashboard "
            f"(pip install -e \".[dashboard]\" in the repository) and run optuna-dashboard {study_url}")


def run_pareto_command(args: argparse.Namespace) -> int:
    from archspec.search.pareto import check_plot_path, comparison_of, plot_fronts, read_run, report_json
    from archspec.search.tables import comparison_table, run_front_table

    if args.plot:
        check_plot_path(args.plot)  # before reading: a bad --plot is said at once
    runs = [read_run(path) for path in args.runs]
    if args.json:
        print(json.dumps(report_json(runs), indent=2, allow_nan=False))
    else:
        console = Console()
        for run in runs:
            console.print(run_front_table(run))
        comparison = comparison_of(runs) if len(runs) > 1 else None
        if comparison is not None:
            console.print(comparison_table(runs, comparison))
    if args.plot:
        path = plot_fronts(runs, args.plot)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0

