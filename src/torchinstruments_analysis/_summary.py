"""``summary``: one row per layer (and call and output tensor) in forward execution order."""

from __future__ import annotations

from typing import TYPE_CHECKING

import polars as pl

from torchinstruments_analysis._select import in_execution_order, select
from torchinstruments_analysis._signals import (
    BIAS,
    MODEL_LAYER,
    OUTPUT,
    OUTPUT_GRADIENT,
    PARAMETER_GRADIENT,
    UPDATE,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from torchinstruments_analysis.read import Run

DEFAULT_SIGNALS = (OUTPUT, OUTPUT_GRADIENT)
DEFAULT_METRICS = ("rms", "zero_fraction", "nonfinite_fraction")
UPDATE_TO_WEIGHT = "update_to_weight"
"""A step record's metric (the size of the update against the weight), summed up when present."""

STEP_COLUMNS = {
    UPDATE_TO_WEIGHT: (UPDATE, UPDATE_TO_WEIGHT),
    f"{PARAMETER_GRADIENT}_rms": (PARAMETER_GRADIENT, "rms"),
}
"""Per-layer columns from step records, when the run has them: column -> (signal, metric)."""

_KEYS = ("rank", "layer", "call_index", "tensor_path")
_TENTH = 0.1


def summary(
    run: Run,
    *,
    layers: str | Sequence[str] | None = None,
    signals: Iterable[str] = DEFAULT_SIGNALS,
    metrics: Iterable[str] = DEFAULT_METRICS,
    ranks: Iterable[int] | None = None,
    steps: tuple[int | None, int | None] | None = None,
) -> pl.DataFrame:
    """Per layer, in forward execution order: each signal's metrics over the run.

    One row per ``layer``, ``call_index`` and ``tensor_path`` (and ``rank`` when the run has
    several: ranks are never averaged together). ``samples`` counts the samples measured. For
    each signal and metric, ``<signal>_<metric>`` is the mean over the samples, except
    ``nonfinite_fraction``, whose column is the largest fraction seen; every metric that is not
    a fraction also gets ``<signal>_<metric>_early`` and ``…_recent``, its mean over the first
    and the last tenth of the rank's samples (of those asked about: ``steps`` narrows them;
    a layer not measured in a tenth has null there). When the run holds step records with
    ``update_to_weight``, the columns ``update_to_weight`` (mean over the layer's weights
    and steps), ``update_to_weight_early`` and ``…_recent`` follow; without such rows they are
    absent. Likewise ``parameter_gradient_rms`` (the gradient the optimizer used). Both are
    over the layer's weights only (biases, which often start at zero, and ratios that are not
    finite are left out). The whole-model rows of step records (layer ``<model>``) are not a
    layer and never appear. A column of a signal or metric the run never measured holds nulls.

    Args:
        run: An opened run (``open_run``).
        layers: A glob (or globs) on layer names; ``None``: every layer.
        signals: Signals shown, in this order (default ``output`` and ``output_gradient``).
        metrics: Metrics shown, in this order (default ``rms``, ``zero_fraction``,
            ``nonfinite_fraction``).
        ranks: Ranks kept; ``None``: all.
        steps: ``(lo, hi)``: only ``lo <= step < hi`` (``sample_id`` without a trainer step).
    """
    signals, metrics = tuple(signals), tuple(metrics)
    rows = select(run, layers=layers, ranks=ranks, steps=steps)
    rows = rows.filter(pl.col("layer") != MODEL_LAYER)
    measured = rows.filter(pl.col("signal").is_in(signals), pl.col("metric").is_in(metrics))
    wide = _wide(_statistics(measured, _KEYS), signals, metrics)
    for column, (signal, metric) in STEP_COLUMNS.items():
        per_layer = _statistics(_weights(rows, signal, metric), ("rank", "layer"))
        if per_layer.height:
            wide = wide.join(_per_layer(per_layer, column), on=["rank", "layer"], how="left")
    if wide["rank"].n_unique() <= 1:
        wide = wide.drop("rank")
    return in_execution_order(run, wide, "call_index", "tensor_path")


def _statistics(rows: pl.LazyFrame, keys: Sequence[str]) -> pl.DataFrame:
    sample, value = pl.col("sample_id"), pl.col("value")
    # The first and last tenth of each rank's samples in the rows asked about, collected on
    # their own: in one query with the aggregation below the scan would be shared, and cached
    # whole in memory. The aggregation is then plain sums the streaming engine runs in bounded
    # memory (n_unique would hold every sample id of every group).
    tenths = (
        rows.select("rank", "sample_id")
        .unique()
        .group_by("rank")
        .agg(first=sample.quantile(_TENTH, "lower"), last=sample.quantile(1 - _TENTH, "higher"))
        .collect(engine="streaming")
    )
    marked = rows.join(tenths.lazy(), on="rank", how="left")
    return (
        marked.group_by(*keys, "signal", "metric")
        .agg(
            samples=pl.len(),  # one row per sample and tensor
            mean=value.mean(),
            max=value.max(),
            early=pl.when(sample <= pl.col("first")).then(value).mean(),
            recent=pl.when(sample >= pl.col("last")).then(value).mean(),
        )
        .collect(engine="streaming")
    )


def _columns(signal: str, metric: str) -> dict[str, str]:
    """Output column name for each statistic shown of one signal's metric."""
    name = f"{signal}_{metric}"
    if metric == "nonfinite_fraction":
        return {name: "max"}
    if metric.endswith("_fraction"):
        return {name: "mean"}
    return {name: "mean", f"{name}_early": "early", f"{name}_recent": "recent"}


def _wide(stats: pl.DataFrame, signals: Sequence[str], metrics: Sequence[str]) -> pl.DataFrame:
    keys = stats.group_by(*_KEYS).agg(samples=pl.col("samples").max())
    columns: list[str] = []
    for signal in signals:
        for metric in metrics:
            one = stats.filter(pl.col("signal") == signal, pl.col("metric") == metric)
            chosen = _columns(signal, metric)
            picked = one.select(*_KEYS, *(pl.col(s).alias(c) for c, s in chosen.items()))
            keys = keys.join(picked, on=list(_KEYS), how="left", nulls_equal=True)
            columns += list(chosen)
    return keys.select(*_KEYS, "samples", *columns)


def _weights(rows: pl.LazyFrame, signal: str, metric: str) -> pl.LazyFrame:
    """The finite values of one step signal's metric on the layers' weights (not biases)."""
    return rows.filter(
        pl.col("signal") == signal,
        pl.col("metric") == metric,
        ~pl.col("tensor_path").str.ends_with(BIAS),
        pl.col("value").is_finite(),
    )


def _per_layer(stats: pl.DataFrame, column: str) -> pl.DataFrame:
    return stats.group_by("rank", "layer").agg(
        pl.col("mean").mean().alias(column),
        pl.col("early").mean().alias(f"{column}_early"),
        pl.col("recent").mean().alias(f"{column}_recent"),
    )
