"""Choosing the rows a question is about: layers by glob, signals, metrics, ranks and steps."""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

import polars as pl

from torchinstruments_analysis._signals import INPUT, INPUT_GRADIENT, OUTPUT, OUTPUT_GRADIENT

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from torchinstruments_analysis.read import Run

FORWARD_SIGNALS = (OUTPUT, OUTPUT_GRADIENT, INPUT, INPUT_GRADIENT)
"""The signals measured in a sample's forward and backward (not in an optimizer step)."""


def clock() -> pl.Expr:
    """The step a row belongs to: the trainer's ``step``, or ``sample_id`` without a trainer."""
    return pl.coalesce(pl.col("step"), pl.col("sample_id"))


def matching_layers(run: Run, layers: str | Sequence[str] | None) -> list[str] | None:
    """The run's layer names matching any of the globs (``fnmatch``, case-sensitive)."""
    if layers is None:
        return None
    patterns = [layers] if isinstance(layers, str) else list(layers)
    names = _all_layers(run)
    return [name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def select(
    run: Run,
    *,
    layers: str | Sequence[str] | None = None,
    signals: Iterable[str] | None = None,
    metrics: Iterable[str] | None = None,
    ranks: Iterable[int] | None = None,
    steps: tuple[int | None, int | None] | None = None,
) -> pl.LazyFrame:
    """``run.history`` restricted lazily; ``None`` keeps everything on that axis.

    Args:
        run: The run.
        layers: A glob or globs on layer names (``"blocks.*.attn"``).
        signals: Signals kept.
        metrics: Metrics kept.
        ranks: Ranks kept.
        steps: ``(lo, hi)``: rows with ``lo <= step < hi`` (``sample_id`` where ``step`` is
            null); either bound may be ``None``.
    """
    frame = run.history
    names = matching_layers(run, layers)
    conditions = [
        _within("layer", names),
        _within("signal", signals),
        _within("metric", metrics),
        _within("rank", ranks),
        *_step_bounds(steps),
    ]
    kept = [condition for condition in conditions if condition is not None]
    return frame.filter(*kept) if kept else frame


def _within(column: str, values: Iterable[object] | None) -> pl.Expr | None:
    return None if values is None else pl.col(column).is_in(list(values))


def _step_bounds(steps: tuple[int | None, int | None] | None) -> list[pl.Expr | None]:
    if steps is None:
        return []
    lo, hi = steps
    return [
        None if lo is None else clock() >= lo,
        None if hi is None else clock() < hi,
    ]


def _all_layers(run: Run) -> list[str]:
    seen = run.history.select(pl.col("layer").unique()).collect()["layer"].to_list()
    return list(dict.fromkeys([*run.layers, *sorted(seen)]))


def execution_rank(run: Run) -> pl.DataFrame:
    """``layer`` and ``order``: each catalogued layer's position in the forward."""
    return pl.DataFrame(
        {"layer": list(run.layers), "order": list(range(len(run.layers)))},
        schema={"layer": pl.String(), "order": pl.Int64()},
    )


def in_execution_order(run: Run, frame: pl.DataFrame, *then: str) -> pl.DataFrame:
    """``frame`` sorted by its ``layer``'s forward position (unknown layers last), then ``then``."""
    ordered = frame.join(execution_rank(run), on="layer", how="left", maintain_order="left")
    keys = ["order", "layer", *then]
    return ordered.sort(keys, nulls_last=True, maintain_order=True).drop("order")
