"""Figures of a run (or two runs side by side), and a report folder a person can open.

``plot`` writes PNG files with matplotlib's Agg backend (no display needed): a layer x step heatmap
of one metric of one signal, on a log colour scale for scale metrics (``rms``, ``max_abs``,
``std``; values at or below zero left blank) and a linear one otherwise, and the same metric over
steps for a few chosen layers (the layers the findings name first, then layers spread over the
depth). Given two runs, the heatmaps stand side by side on one colour scale and the chosen
layers of both share one axis (solid: first run, dashed: second).

Each cell is the mean over the layer's calls, tensors and ranks at that step (``sample_id``
where the run has no trainer step). ``report`` writes the figures of outputs and output
gradients and ``findings.md`` into one folder, with an ``index.md`` linking them.

matplotlib is optional: ``uv add "matplotlib>=3.8"`` (or ``uv run --with "matplotlib>=3.8"``).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from torchinstruments_analysis._escape import escape_text
from torchinstruments_analysis._signals import OUTPUT, OUTPUT_GRADIENT
from torchinstruments_analysis.findings import find

if TYPE_CHECKING:
    from collections.abc import Sequence

    import polars as pl

    from torchinstruments_analysis.findings import RunLike

LOG_SCALE_METRICS = frozenset({"rms", "max_abs", "std"})
CHOSEN_LAYERS = 6
REPORT_FIGURES = ((OUTPUT, "rms"), (OUTPUT_GRADIENT, "rms"), (OUTPUT, "zero_fraction"))


def plot(
    run_or_runs: RunLike | Sequence[RunLike],
    out_dir: str | Path,
    *,
    metric: str = "rms",
    signal: str = OUTPUT,
    layers: Sequence[str] | None = None,
) -> list[Path]:
    """Write the heatmap and the chosen layers' lines of ``signal``/``metric``; return the PNGs.

    Args:
        run_or_runs: One run, or a list or tuple of two runs to compare (``read.open_run``).
        out_dir: Folder for the files (created).
        metric: The metric to draw (``rms``, ``max_abs``, ``zero_fraction``, …).
        signal: The signal to draw (``output``, ``output_gradient``, …).
        layers: The layers drawn over steps; by default the layers the findings of the first
            run name, then layers spread over the depth (at most ``CHOSEN_LAYERS``).

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
        ValueError: More than two runs are given.
    """
    runs: list[RunLike] = (
        list(run_or_runs)
        if isinstance(run_or_runs, list | tuple)
        else [cast("RunLike", run_or_runs)]
    )
    if not 1 <= len(runs) <= 2:
        raise ValueError(f"plot takes one run or two runs to compare, got {len(runs)}")
    pyplot = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables = [_table(run, signal, metric) for run in runs]
    stem = f"{signal}_{metric}" + ("_compare" if len(runs) == 2 else "")
    heatmap = _heatmap(pyplot, runs, tables, metric, signal, out / f"{stem}_heatmap.png")
    chosen = list(layers) if layers is not None else _chosen(runs[0], tables[0], find(runs[0]))
    lines = _lines(pyplot, runs, tables, chosen, (metric, signal), out / f"{stem}_layers.png")
    return [heatmap, lines]


def report(run: RunLike, out_dir: str | Path) -> Path:
    """Write the figures and ``findings.md`` into ``out_dir`` with an ``index.md``; return it.

    Raises:
        ImportError: matplotlib is not installed.
    """
    folder = Path(out_dir)
    found = find(run)
    figures = [
        path
        for signal, metric in REPORT_FIGURES
        for path in plot(
            run,
            folder,
            metric=metric,
            signal=signal,
            layers=_chosen(run, _table(run, signal, metric), found),
        )
    ]
    (folder / "findings.md").write_text(findings_markdown(found), encoding="utf-8")
    links = "\n".join(f"![{p.stem}]({p.name})" for p in figures)
    (folder / "index.md").write_text(
        f"# Run {_markdown_text(str(run.path))}\n\n{found.height} findings: "
        f"[findings.md](findings.md)\n\n{links}\n",
        encoding="utf-8",
    )
    return folder


def findings_markdown(found: pl.DataFrame) -> str:
    """The findings as a Markdown table, names and messages escaped to stay in their cells."""
    lines = ["# Findings", ""]
    if found.height == 0:
        return "\n".join([*lines, "No rule found anything.", ""])
    lines += ["| rule | layer | signal | sample | step | value | threshold | message |"]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for row in found.iter_rows(named=True):
        cells = [
            row["rule"],
            _markdown_cell(row["layer"], code=True),
            row["signal"],
            str(row["sample_id"]),
            "" if row["step"] is None else str(row["step"]),
            "" if row["value"] is None else f"{row['value']:.4g}",
            f"{row['threshold']:.4g}",
            _markdown_cell(row["message"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, ""])


def _pyplot() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise ImportError(
            'plots need matplotlib: uv add "matplotlib>=3.8" (or pip install "matplotlib>=3.8")'
        ) from None
    matplotlib.use("Agg", force=True)  # files only: no display, no GUI event loop
    return importlib.import_module("matplotlib.pyplot")


def _table(run: RunLike, signal: str, metric: str) -> pl.DataFrame:
    """Mean ``metric`` per layer and step (``sample_id`` without a trainer step)."""
    import polars as pl

    rows = run.history.filter(
        (pl.col("signal") == signal) & (pl.col("metric") == metric) & pl.col("value").is_not_null()
    ).collect()
    at = "step" if rows.height and rows.get_column("step").null_count() == 0 else "sample_id"
    order = {name: i for i, name in enumerate(run.layers)}
    table = rows.group_by("layer", x=pl.col(at)).agg(pl.col("value").mean()).sort("x")
    position = pl.col("layer").replace_strict(order, default=len(order), return_dtype=pl.Int64())
    return table.with_columns(position=position, axis=pl.lit(at))


def _matrix(table: pl.DataFrame) -> tuple[list[str], list[int], Any]:
    import numpy as np

    layers = table.sort("position").get_column("layer").unique(maintain_order=True).to_list()
    xs = sorted(table.get_column("x").unique().to_list())
    grid = np.full((len(layers), len(xs)), np.nan)
    row, col = {n: i for i, n in enumerate(layers)}, {x: j for j, x in enumerate(xs)}
    for layer, x, value in table.select("layer", "x", "value").iter_rows():
        grid[row[layer], col[x]] = value
    return layers, xs, grid


def _heatmap(
    pyplot: Any, runs: list[Any], tables: list[pl.DataFrame], metric: str, signal: str, path: Path
) -> Path:
    import numpy as np

    colors = importlib.import_module("matplotlib.colors")
    matrices = [_matrix(table) for table in tables]
    height = max(2.5, 0.3 * max(len(m[0]) for m in matrices) + 1.5)
    figure, axes = pyplot.subplots(1, len(runs), figsize=(6 * len(runs), height), squeeze=False)
    values = np.concatenate([m[2].ravel() for m in matrices])
    norm = _norm(colors, values, metric)
    image = None
    for ax, run, (layers, xs, grid), table in zip(axes[0], runs, matrices, tables, strict=True):
        shown = np.where(grid > 0, grid, np.nan) if metric in LOG_SCALE_METRICS else grid
        image = ax.imshow(shown, aspect="auto", interpolation="nearest", norm=norm, cmap="viridis")
        ax.set_yticks(range(len(layers)), [_label(n) for n in layers], fontsize=7)
        ticks = range(0, len(xs), max(1, len(xs) // 8))
        ax.set_xticks(list(ticks), [str(xs[i]) for i in ticks], fontsize=7)
        ax.set_xlabel(_axis(table))
        ax.set_title(_label(Path(run.path).name), fontsize=9)
    if image is not None:
        figure.colorbar(image, ax=axes[0].tolist(), label=f"{signal} {metric}")
    figure.suptitle(f"{signal} {metric} per layer", fontsize=10)
    return _save(pyplot, figure, path)


def _norm(colors: Any, values: Any, metric: str) -> Any:
    import numpy as np

    finite = values[np.isfinite(values)]
    if metric in LOG_SCALE_METRICS:
        positive = finite[finite > 0]
        if positive.size:
            return colors.LogNorm(vmin=positive.min(), vmax=max(positive.max(), positive.min()))
    if finite.size:
        return colors.Normalize(vmin=finite.min(), vmax=finite.max())
    return colors.Normalize()


def _lines(
    pyplot: Any,
    runs: list[Any],
    tables: list[pl.DataFrame],
    chosen: list[str],
    what: tuple[str, str],
    path: Path,
) -> Path:
    import polars as pl

    metric, signal = what
    figure, ax = pyplot.subplots(figsize=(7, 4))
    cycle = pyplot.rcParams["axes.prop_cycle"].by_key()["color"]
    for style, run, table in zip(("-", "--"), runs, tables, strict=False):
        for i, layer in enumerate(chosen):
            points = table.filter(pl.col("layer") == layer).sort("x")
            label = _label(layer) + ("" if len(runs) == 1 else f" ({_label(Path(run.path).name)})")
            ax.plot(
                points.get_column("x").to_list(),
                points.get_column("value").to_list(),
                style,
                color=cycle[i % len(cycle)],
                label=label,
                marker=".",
            )
    if metric in LOG_SCALE_METRICS and _all_positive(tables):
        ax.set_yscale("log")
    ax.set_xlabel(_axis(tables[0]))
    ax.set_ylabel(f"{signal} {metric}")
    if chosen:
        ax.legend(fontsize=7)
    ax.set_title(f"{signal} {metric} of chosen layers", fontsize=10)
    return _save(pyplot, figure, path)


def _chosen(run: RunLike, table: pl.DataFrame, found: pl.DataFrame) -> list[str]:
    """The layers the findings name first, then layers spread over the depth."""
    present = table.sort("position").get_column("layer").unique(maintain_order=True).to_list()
    named = [n for n in found.get_column("layer").unique(maintain_order=True) if n in present]
    step = max(1, len(present) // CHOSEN_LAYERS)
    spread = [*present[::step], *present[-1:]]
    return list(dict.fromkeys([*named, *spread]))[:CHOSEN_LAYERS]


def _all_positive(tables: list[pl.DataFrame]) -> bool:
    return all(t.height == 0 or t.get_column("value").min() > 0 for t in tables)  # type: ignore[operator]


def _axis(table: pl.DataFrame) -> str:
    return "step" if table.height and table.get_column("axis")[0] == "step" else "sample"


def _save(pyplot: Any, figure: Any, path: Path) -> Path:
    figure.savefig(path, dpi=90, bbox_inches="tight")
    pyplot.close(figure)
    return path


def _label(text: str) -> str:
    # matplotlib reads $...$ as math; a layer name is plain text
    return escape_text(text).replace("$", r"\$")


def _markdown_text(text: str) -> str:
    return escape_text(text).replace("|", "\\|")


def _markdown_cell(text: str, *, code: bool = False) -> str:
    escaped = escape_text(text)
    if code:
        longest = max((len(run) for run in re.findall("`+", escaped)), default=0)
        fence = "`" * (longest + 1)  # a code span fenced longer than any backtick run inside
        pad = " " if escaped.startswith("`") or escaped.endswith("`") else ""
        escaped = f"{fence}{pad}{escaped}{pad}{fence}"
    return escaped.replace("|", "\\|")
