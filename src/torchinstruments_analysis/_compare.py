"""``diff`` of two runs and ``ranks`` of one: which layers moved, and which ranks disagree."""

from __future__ import annotations

from typing import TYPE_CHECKING

import polars as pl

from torchinstruments_analysis._select import clock, in_execution_order, select
from torchinstruments_analysis._summary import DEFAULT_SIGNALS

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from torchinstruments_analysis.read import Run

SCALE_METRICS = ("rms", "std", "max_abs")
"""Metrics whose ratio between runs or ranks is meaningful (non-negative scales)."""

_TENSOR = ("layer", "call_index", "tensor_path", "signal", "metric")


def diff(
    run_a: Run,
    run_b: Run,
    *,
    fail_above: float | None = None,
    layers: str | Sequence[str] | None = None,
    signals: Iterable[str] = DEFAULT_SIGNALS,
    metrics: Iterable[str] = SCALE_METRICS,
) -> pl.DataFrame:
    """Per layer, signal and metric: how much run B differs from run A, most moved first.

    Rows are matched by ``rank``, layer, ``call_index``, ``tensor_path``, signal, metric and
    step (``sample_id`` where a run has no trainer step); a layer, or a step, present in only
    one run is left out. ``steps`` counts the matched steps, ``a`` and ``b`` are each run's mean
    over them, ``change`` is ``b - a`` and ``ratio`` ``b / a`` (1 when both are equal).
    ``moved`` is the factor between them whichever way, ``max(ratio, 1 / ratio)``, infinite when
    the sign changed or one side is 0; rows are sorted by it, largest first, then in execution
    order. ``rank`` is shown when the runs have several.

    Args:
        run_a: The reference run.
        run_b: The run compared with it.
        fail_above: When given, the column ``exceeds`` says whether ``moved > fail_above``.
        layers: A glob (or globs) on layer names.
        signals: Signals compared.
        metrics: Metrics compared (default the scales ``rms``, ``std``, ``max_abs``: a ratio of
            means or minimums near 0 says little).
    """
    chosen = {"layers": layers, "signals": tuple(signals), "metrics": tuple(metrics)}
    keys = ["rank", *_TENSOR, "clock"]
    a, b = (
        select(run, **chosen).select(*keys[:-1], clock().alias("clock"), "value")  # type: ignore[arg-type]
        for run in (run_a, run_b)
    )
    joined = a.join(b, on=keys, suffix="_b", nulls_equal=True)
    per = joined.group_by("rank", *_TENSOR).agg(
        steps=pl.len(), a=pl.col("value").mean(), b=pl.col("value_b").mean()
    )
    frame = per.with_columns(change=pl.col("b") - pl.col("a"), ratio=_ratio("b", "a"))
    frame = frame.with_columns(moved=_factor(pl.col("ratio")))
    if fail_above is not None:
        frame = frame.with_columns(exceeds=pl.col("moved") > fail_above)
    return _most_first(run_a, frame.collect(), "moved")


def ranks(
    run: Run,
    *,
    layers: str | Sequence[str] | None = None,
    signals: Iterable[str] = DEFAULT_SIGNALS,
    metrics: Iterable[str] = ("rms",),
) -> pl.DataFrame:
    """Per layer, signal and metric: how far the ranks are apart, widest first.

    At each step measured on two ranks or more, the spread is ``max / min`` of the ranks'
    values (1 when equal, infinite when the smallest is 0 or the signs differ). Per layer:
    ``ranks`` (how many were compared), ``steps``, ``max_ratio`` and ``median_ratio`` over the
    steps, and at the step of the widest spread (``step``) the ranks holding the largest and
    the smallest value (``rank_high``, ``rank_low``) and those values. Rows are sorted by
    ``max_ratio``, largest first, then in execution order. Empty for a run with one rank.
    """
    rows = select(run, layers=layers, signals=tuple(signals), metrics=tuple(metrics))
    rows = rows.filter(pl.col("value").is_not_null()).with_columns(clock=clock())
    value = pl.col("value")
    per_step = (
        rows.group_by(*_TENSOR, "clock")
        .agg(
            ranks=pl.col("rank").n_unique(),
            value_high=value.max(),
            value_low=value.min(),
            rank_high=pl.col("rank").get(value.arg_max()),
            rank_low=pl.col("rank").get(value.arg_min()),
        )
        .filter(pl.col("ranks") >= 2)
        .with_columns(spread=_factor(_ratio("value_high", "value_low")))
    )
    widest = pl.col("spread").arg_max()
    per = per_step.group_by(*_TENSOR).agg(
        ranks=pl.col("ranks").max(),
        steps=pl.len(),
        max_ratio=pl.col("spread").max(),
        median_ratio=pl.col("spread").median(),
        step=pl.col("clock").get(widest),
        rank_high=pl.col("rank_high").get(widest),
        rank_low=pl.col("rank_low").get(widest),
        value_high=pl.col("value_high").get(widest),
        value_low=pl.col("value_low").get(widest),
    )
    return _most_first(run, per.collect(), "max_ratio")


def _ratio(numerator: str, denominator: str) -> pl.Expr:
    """``numerator / denominator``, 1 where they are equal (0 and 0 included)."""
    same = pl.col(numerator) == pl.col(denominator)
    return pl.when(same).then(1.0).otherwise(pl.col(numerator) / pl.col(denominator))


def _factor(ratio: pl.Expr) -> pl.Expr:
    """``max(ratio, 1 / ratio)``; infinite for a ratio that is not positive."""
    positive = pl.when(ratio > 0).then(pl.max_horizontal(ratio, 1 / ratio))
    return positive.when(ratio.is_not_null()).then(float("inf")).otherwise(None)


def _most_first(run: Run, frame: pl.DataFrame, column: str) -> pl.DataFrame:
    ordered = in_execution_order(run, frame, "call_index", "tensor_path", "signal", "metric")
    ordered = ordered.sort(column, descending=True, nulls_last=True, maintain_order=True)
    if "rank" in ordered.columns and ordered["rank"].n_unique() <= 1:
        ordered = ordered.drop("rank")
    return ordered
