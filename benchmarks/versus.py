"""This checkout's observer against another revision's, in one process, step against step.

    uv run python benchmarks/versus.py [--baseline HEAD] [--workload mnist-mlp] [--rounds 300]
        [--optimizer]

Two processes on a shared machine differ in speed by more than most changes to the observer
(``paired.py``'s docstring), so a change is measured here inside one process: the observer of
this working tree and the one of ``--baseline`` (a git revision, ``HEAD`` by default: the
working tree's uncommitted changes against the last commit) each observe their own copy of the
workload, beside a plain copy. Every round runs a sampled step of each observed copy, followed
by its next (unsampled) step, and a plain step, in an order that rotates every round; each is
divided by the round's plain step. With ``--optimizer`` each observer is given its copy's
optimizer, so that a sampled step also records the optimizer step signals (as the adapters'
defaults do).

The baseline's ``torchinstruments_core`` is read out of git into a temporary folder under
another name (``ti_baseline``, every import renamed), so that both import side by side. Its
compiled kernels are this checkout's where the two ``_kernels.c`` are the same; where they
differ, the baseline's are built from its own sources by its own ``setup.py`` (``build_ext``,
with a C compiler), so that a change to the kernels is measured in one process too: each
side's kernels are a file of its own, imported under its package's name
(``ti_baseline.reducers._kernels``), with their own queue and state. Both sides use compiled
kernels or neither does, or the script exits. Each observer has its own reduction threads and
writer process.

Printed per workload: the plain step, each observer's sampled step and the step after it over
the plain step (median of the rounds, with the interquartile range), and this checkout's
sampled ratio less the baseline's two ways: the difference of the two medians, and the median
of the per-round differences (below zero, this checkout's sample costs less). The sampled
steps scatter by a few tenths and not symmetrically, so the two can differ: on the MNIST MLP
the first has been about twice the second.

The harness is not quite fair to its two sides: run against ``HEAD`` with no change in the
working tree (2026-12-04), it gave LeNet-5 +0.004x and +0.007x (difference of the medians;
+0.003x and +0.007x the median of the differences) and the MNIST MLP -0.011x (+0.011x). A
difference within about 0.01x is nothing. With two builds of the kernels it can lean further:
on another guest (2026-12-06) a change to the kernels came out +0.049x to +0.086x on the MNIST
MLP in three runs and -0.011x with the two sides swapped (``--baseline`` the revision with the
change, the working tree without it); swap them to check a change of a few hundredths.
"""

from __future__ import annotations

import argparse
import importlib
import io
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import torch
from _overhead_workloads import WORKLOADS
from _rounds import alternate

_ROOT = Path(__file__).resolve().parent.parent
_PACKAGE = "torchinstruments_core"
_BASELINE = "ti_baseline"


def baseline_package(revision: str, folder: Path) -> Any:
    """Import ``revision``'s ``torchinstruments_core`` from ``folder`` as ``ti_baseline``."""
    listing = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", revision, f"src/{_PACKAGE}"],
        cwd=_ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    if not listing:
        raise SystemExit(f"{revision} has no src/{_PACKAGE}")
    ours = _ROOT / "src" / _PACKAGE
    for path in listing:
        content = subprocess.run(
            ["git", "show", f"{revision}:{path}"], cwd=_ROOT, check=True, capture_output=True
        ).stdout
        relative = Path(path).relative_to(f"src/{_PACKAGE}")
        target = folder / _BASELINE / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if relative.suffix in (".py", ".pyi"):
            content = content.replace(_PACKAGE.encode(), _BASELINE.encode())
        target.write_bytes(content)
    reducers = folder / _BASELINE / "reducers"
    kernels = "reducers/_kernels.c"
    theirs, mine = reducers / "_kernels.c", ours / kernels
    if theirs.exists() and (not mine.exists() or theirs.read_bytes() != mine.read_bytes()):
        _build_kernels(revision, reducers)
    else:
        for built in (ours / "reducers").glob("_kernels*.so"):
            shutil.copy2(built, reducers / built.name)
    sys.path.insert(0, str(folder))
    package = importlib.import_module(_BASELINE)
    _check_kernels(package, revision)
    return package


def _build_kernels(revision: str, reducers: Path) -> None:
    """Build ``revision``'s kernels as that revision builds them, into ``reducers``.

    Its ``setup.py`` (with its compiler flags) runs ``build_ext --inplace`` on its
    ``_kernels.c`` in a folder of its own, through this Python's setuptools, as the package's
    installation does: the two sides' kernels differ in their sources only.
    """
    wanted = ["setup.py", "pyproject.toml", "README.md", f"src/{_PACKAGE}/reducers/_kernels.c"]
    files = subprocess.run(  # those the revision has (README.md: its metadata reads it)
        ["git", "ls-tree", "--name-only", revision, "--", *wanted],
        cwd=_ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    print(f"building {revision}'s kernels (they differ from this checkout's)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="versus-kernels-") as tree:
        archive = subprocess.run(
            ["git", "archive", revision, *files], cwd=_ROOT, check=True, capture_output=True
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as members:
            members.extractall(tree)  # this repository's own files
        done = subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
            cwd=tree,
            capture_output=True,
            text=True,
            check=False,
        )
        built = list((Path(tree) / "src" / _PACKAGE / "reducers").glob("_kernels*.so"))
        if done.returncode != 0 or not built:  # the extension is optional: no compiler, no file
            raise SystemExit(
                f"building {revision}'s kernels failed (compare the two with paired.py in "
                f"separate processes instead):\n{done.stderr[-3000:]}"
            )
        for path in built:
            shutil.copy2(path, reducers / path.name)


def _check_kernels(baseline: Any, revision: str) -> None:
    """Both sides reduce with their own compiled kernels, or neither does; else exit."""
    mine = importlib.import_module(f"{_PACKAGE}.reducers._native").KERNELS
    theirs = importlib.import_module(f"{_BASELINE}.reducers._native").KERNELS
    if (mine is None) != (theirs is None):
        side = "this checkout" if mine is None else revision
        raise SystemExit(
            f"{side} reduces without its compiled kernels and the other with them: the two "
            "would not compare (build them: uv sync --reinstall-package torchinstruments-suite)"
        )
    if theirs is not None and not str(theirs.__file__).startswith(str(baseline.__path__[0])):
        raise SystemExit(f"{revision}'s kernels were not loaded from its own folder")


def measure(
    name: str, packages: dict[str, Any], rounds: int, warmup: int, *, optimizer: bool = False
) -> dict[str, list[float]]:
    """Each configuration's step over the round's plain step, ``rounds`` rounds."""

    def observer(package: Any) -> Any:
        return lambda copy, folder: package.inject_observer(
            copy.model, output_dir=folder, optimizer=copy.optimizer if optimizer else None
        )

    times = alternate(
        name, {label: observer(package) for label, package in packages.items()}, rounds, warmup
    )
    base = times["plain"]
    ratios = {
        key: [t / p for t, p in zip(values, base, strict=True)] for key, values in times.items()
    }
    ratios["plain"] = base
    return ratios


def _median_iqr(values: list[float]) -> str:
    quartiles = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):.3f}x ({quartiles[0]:.3f}-{quartiles[2]:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="a git revision (default: HEAD)")
    parser.add_argument("--workload", nargs="+", default=["mnist-mlp"], choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=100, help="rounds, and at least 3 s")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--optimizer", action="store_true", help="also record the optimizer step signals"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import torchinstruments_core

    with tempfile.TemporaryDirectory(prefix="versus-baseline-") as folder:
        packages = {
            "this checkout": torchinstruments_core,
            args.baseline: baseline_package(args.baseline, Path(folder)),
        }
        signals = ", optimizer step signals" if args.optimizer else ""
        print(
            f"\nthis checkout against {args.baseline}, one process, {args.rounds} rounds{signals}"
        )
        print(f"{torch.get_num_threads()} thread(s), torch {torch.__version__}\n")
        print(
            "| workload | plain step (ms) | this checkout: sampled | the step after |"
            f" {args.baseline}: sampled | the step after | difference of the medians |"
            " median of the differences |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name in args.workload:
            ratios = measure(name, packages, args.rounds, args.warmup, optimizer=args.optimizer)
            ours, theirs = ratios["this checkout"], ratios[args.baseline]
            apart = statistics.median(ours) - statistics.median(theirs)
            difference = statistics.median(a - b for a, b in zip(ours, theirs, strict=True))
            print(
                f"| {name} | {statistics.median(ratios['plain']) * 1e3:.2f} |"
                f" {_median_iqr(ours)} | {statistics.median(ratios['this checkout after']):.3f}x |"
                f" {_median_iqr(theirs)} | {statistics.median(ratios[f'{args.baseline} after']):.3f}x |"
                f" {apart:+.3f}x | {difference:+.3f}x |"
            )


if __name__ == "__main__":
    main()
