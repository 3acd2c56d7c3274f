"""``torchinstruments``: the analysis API from a shell, one subcommand per question.

::

    torchinstruments summary RUN [--layers GLOB] [--signal S] [--metric M] [--rank R]
                                 [--steps A:B] [--json]
    torchinstruments first-nonfinite RUN [--json]      exit 1 when something is non-finite
    torchinstruments diff RUN_A RUN_B [--fail-above RATIO] [--json]   exit 1 above RATIO
    torchinstruments ranks RUN [--json]
    torchinstruments findings RUN [--json]             exit 1 when a rule fires
    torchinstruments plot RUN [RUN ...] --out DIR
    torchinstruments report RUN --out DIR
    torchinstruments watch RUN [--interval SECONDS]

A thin layer: each subcommand opens the run, calls one function of
``torchinstruments_analysis`` and prints its frame (a rich table when rich is installed, plain
columns with ``--plain`` or without it, JSON with ``--json``). Exit status 2: the run could not
be read, or a part of the suite is missing. Nothing heavy is imported before a subcommand runs,
and torch never is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import polars as pl

    from torchinstruments_analysis.read import Run

EXIT_OK = 0
EXIT_FOUND = 1
EXIT_ERROR = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    arguments = parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = arguments.handler
    try:
        return handler(arguments)
    except (FileNotFoundError, NotImplementedError, ImportError) as error:
        print(f"torchinstruments: {error}", file=sys.stderr)
        return EXIT_ERROR


def parser() -> argparse.ArgumentParser:
    """The argument parser, with one subparser per command."""
    root = argparse.ArgumentParser(
        prog="torchinstruments",
        description="Find where training went wrong, from a torchinstruments run directory.",
    )
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _summary_parser(commands)
    _one_run(
        commands,
        "first-nonfinite",
        _first_nonfinite,
        "the first sample and layer holding NaN/Inf, forward and backward (exit 1 when found)",
    )
    _diff_parser(commands)
    _one_run(commands, "ranks", _ranks, "per layer, how far the ranks' values are apart")
    _one_run(commands, "findings", _findings, "the rules that fire on the run (exit 1 if any)")
    _plot_parsers(commands)
    watch = commands.add_parser("watch", help="follow a run while it is written")
    watch.add_argument("run", type=Path)
    watch.add_argument("--interval", type=float, default=5.0, help="seconds between reads")
    watch.set_defaults(handler=_watch)
    return root


def _output_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--json", action="store_true", help="print JSON instead of a table")
    command.add_argument("--plain", action="store_true", help="plain columns, even with rich")


def _one_run(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    handler: Callable[[argparse.Namespace], int],
    help_text: str,
) -> argparse.ArgumentParser:
    command = commands.add_parser(name, help=help_text, description=help_text)
    command.add_argument("run", type=Path, help="run folder (or a folder of rank-NNN/ runs)")
    _output_options(command)
    command.set_defaults(handler=handler)
    return command


def _summary_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    command = _one_run(commands, "summary", _summary, "per layer, in execution order")
    command.add_argument("--layers", help="glob on layer names, e.g. 'blocks.*.attn'")
    command.add_argument("--signal", action="append", help="signal shown (repeatable)")
    command.add_argument("--metric", action="append", help="metric shown (repeatable)")
    command.add_argument("--rank", type=int, action="append", help="rank kept (repeatable)")
    command.add_argument("--steps", type=_steps, help="A:B keeps A <= step < B; A: or :B")


def _diff_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    help_text = "per layer, how much RUN_B moved against RUN_A (most moved first)"
    command = commands.add_parser("diff", help=help_text, description=help_text)
    command.add_argument("run_a", type=Path)
    command.add_argument("run_b", type=Path)
    command.add_argument("--fail-above", type=float, help="exit 1 when a layer moved more")
    command.add_argument("--layers", help="glob on layer names")
    command.add_argument("--metric", action="append", help="metric compared (repeatable)")
    command.add_argument("--top", type=int, default=20, help="rows printed (JSON has all)")
    _output_options(command)
    command.set_defaults(handler=_diff)


def _plot_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plot = commands.add_parser("plot", help="per-layer plots of one run or several")
    plot.add_argument("runs", type=Path, nargs="+")
    plot.add_argument("--out", type=Path, required=True, help="folder for the images")
    plot.set_defaults(handler=_plot)
    report = commands.add_parser("report", help="a report of the run with its plots")
    report.add_argument("run", type=Path)
    report.add_argument("--out", type=Path, required=True, help="folder for the report")
    report.set_defaults(handler=_report)


def _steps(text: str) -> tuple[int | None, int | None]:
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return (int(lo) if lo else None, int(hi) if hi else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not A:B (either may be empty)") from None


def _open(path: Path) -> Run:
    from torchinstruments_analysis.read import open_run

    run = open_run(path)
    if not run.complete:
        chunks = sum(len(folder.history) for folder in run.folders)
        print(
            f"note: the run is not finished (status {run.status}); reading {chunks} file(s) "
            "written so far",
            file=sys.stderr,
        )
    return run


def _show(arguments: argparse.Namespace, frame: pl.DataFrame, title: str, *runs: Run) -> None:
    from torchinstruments_analysis._render import as_json, rows_of, table

    if arguments.json:
        meta = [{"path": str(r.path), "status": r.status, "complete": r.complete} for r in runs]
        as_json({"runs": meta, "rows": rows_of(frame)})
    else:
        table(frame, title=title, plain=arguments.plain)


def _summary(arguments: argparse.Namespace) -> int:
    from torchinstruments_analysis._summary import DEFAULT_METRICS, DEFAULT_SIGNALS, summary

    run = _open(arguments.run)
    frame = summary(
        run,
        layers=arguments.layers,
        signals=arguments.signal or DEFAULT_SIGNALS,
        metrics=arguments.metric or DEFAULT_METRICS,
        ranks=arguments.rank,
        steps=arguments.steps,
    )
    _show(arguments, frame, f"{run.path}: per layer, in execution order", run)
    return EXIT_OK


def _first_nonfinite(arguments: argparse.Namespace) -> int:
    from torchinstruments_analysis._nonfinite import first_nonfinite

    run = _open(arguments.run)
    frame = first_nonfinite(run)
    if frame.height == 0 and not arguments.json:
        print(f"{run.path}: no non-finite value in any sample")
        return EXIT_OK
    _show(arguments, frame, f"{run.path}: the first sample holding NaN/Inf", run)
    return EXIT_FOUND if frame.height else EXIT_OK


def _diff(arguments: argparse.Namespace) -> int:
    from torchinstruments_analysis._compare import SCALE_METRICS, diff
    from torchinstruments_analysis.read import open_runs

    run_a, run_b = open_runs(arguments.run_a, arguments.run_b)
    frame = diff(
        run_a,
        run_b,
        fail_above=arguments.fail_above,
        layers=arguments.layers,
        metrics=arguments.metric or SCALE_METRICS,
    )
    shown = frame if arguments.json else frame.head(arguments.top)
    title = f"{run_b.path} against {run_a.path}: most moved first ({frame.height} rows)"
    _show(arguments, shown, title, run_a, run_b)
    exceeded = "exceeds" in frame.columns and frame["exceeds"].fill_null(False).any()
    return EXIT_FOUND if exceeded else EXIT_OK


def _ranks(arguments: argparse.Namespace) -> int:
    from torchinstruments_analysis._compare import ranks

    run = _open(arguments.run)
    frame = ranks(run)
    if frame.height == 0 and not arguments.json:
        print(f"{run.path}: no step was measured on two ranks or more")
        return EXIT_OK
    _show(arguments, frame, f"{run.path}: ranks apart, widest first", run)
    return EXIT_OK


def _findings(arguments: argparse.Namespace) -> int:
    from torchinstruments_analysis.findings import find

    run = _open(arguments.run)
    frame = find(run)
    _show(arguments, frame, f"{run.path}: findings", run)
    return EXIT_FOUND if frame.height else EXIT_OK


def _plot(arguments: argparse.Namespace) -> int:
    from torchinstruments_analysis.plots import plot

    runs = [_open(path) for path in arguments.runs]
    for path in plot(runs[0] if len(runs) == 1 else runs, arguments.out):
        print(path)
    return EXIT_OK


def _report(arguments: argparse.Namespace) -> int:
    from torchinstruments_analysis.plots import report

    print(report(_open(arguments.run), arguments.out))
    return EXIT_OK


def _watch(arguments: argparse.Namespace) -> int:
    from torchinstruments_analysis.watch import watch

    watch(arguments.run, interval=arguments.interval)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
