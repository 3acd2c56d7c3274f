"""The findings rules: each a function from a ``RuleContext`` to the facts it found."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from torchinstruments_analysis import _rule_base as base
from torchinstruments_analysis._rule_base import KEYS, Finding, Rule, RuleContext
from torchinstruments_analysis._signals import OUTPUT, OUTPUT_GRADIENT, UPDATE

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import polars as pl

_RELU = frozenset({"ReLU", "ReLU6", "RReLU"})
_BOUNDS = {"Sigmoid": (0.0, 1.0), "Hardsigmoid": (0.0, 1.0), "Tanh": (-1.0, 1.0)}
_BOUNDS |= {"Hardtanh": (-1.0, 1.0), "Softsign": (-1.0, 1.0)}


def _family(context: RuleContext, layer: str, types: Iterable[str], word: str) -> bool:
    kind = context.types.get(layer)
    return kind in types if kind is not None else word in layer.lower()


def _bounds(context: RuleContext, layer: str) -> tuple[float, float] | None:
    kind = context.types.get(layer)
    if kind is not None:
        return _BOUNDS.get(kind)
    name = layer.lower()
    return (0.0, 1.0) if "sigmoid" in name else (-1.0, 1.0) if "tanh" in name else None


def dead_units(context: RuleContext) -> list[Finding]:
    """ReLU-family outputs exactly zero in at least ``dead_zero_fraction`` of their entries."""
    import polars as pl

    limit = context.thresholds.dead_zero_fraction
    rows = base.values(context, OUTPUT, "zero_fraction")
    names = rows.get_column("layer").unique().to_list()
    relu = [name for name in names if _family(context, name, _RELU, "relu")]
    rows = rows.filter(pl.col("layer").is_in(relu))
    return [
        base.finding(
            Rule.DEAD_UNITS,
            row,
            "zero_fraction",
            row["value"],
            limit,
            f"{row['value']:.1%} of the outputs of {row['layer']} are exactly zero "
            f"(>= {limit:.0%}) at {base.where(row, context)}{base.held(row)}",
        )
        for row in base.onsets(rows, pl.col("value") >= limit)
    ]


def saturation(context: RuleContext) -> list[Finding]:
    """Sigmoid/tanh-family outputs with at least half their entries at a bound of the range."""
    import polars as pl

    margin = context.thresholds.saturation_margin
    wide = base.wide(context, OUTPUT, ["p25", "p75"])
    found = []
    for layer in wide.get_column("layer").unique().to_list():
        bounds = _bounds(context, layer)
        if bounds is None:
            continue
        low, high = bounds
        at_low, at_high = pl.col("p75") <= low + margin, pl.col("p25") >= high - margin
        both = (pl.col("p25") <= low + margin) & (pl.col("p75") >= high - margin)
        for row in base.onsets(wide.filter(pl.col("layer") == layer), at_low | at_high | both):
            share, where, quartile = _saturated_share(row, low, high, margin)
            found.append(
                base.finding(
                    Rule.SATURATION,
                    row,
                    quartile,
                    row[quartile],
                    margin,
                    f"at least {share} of the outputs of {row['layer']} lie within {margin:g} of "
                    f"{where} of [{low:g}, {high:g}] (p25 {row['p25']:.4g}, p75 {row['p75']:.4g}) "
                    f"at {base.where(row, context)}{base.held(row)}",
                )
            )
    return found


def _saturated_share(
    row: dict[str, Any], low: float, high: float, margin: float
) -> tuple[str, str, str]:
    if row["p75"] <= low + margin:
        return "75%", f"the lower bound {low:g}", "p75"
    if row["p25"] >= high - margin:
        return "75%", f"the upper bound {high:g}", "p25"
    return "50%", "the bounds", "p25"


def gradient_steps(context: RuleContext) -> list[Finding]:
    """Output-gradient rms of adjacent layers (backward order) apart by ``gradient_step_factor``."""
    import polars as pl

    factor = context.thresholds.gradient_step_factor
    rows = base.values(context, OUTPUT_GRADIENT, "rms")
    per_layer = rows.group_by("rank", "sample_id", "step", "layer", "signal").agg(
        pl.col("value").max()
    )
    ordered = per_layer.with_columns(
        _pos=pl.col("layer").replace_strict(context.order, return_dtype=pl.Int64())
    ).sort("rank", "sample_id", "_pos")
    nxt = pl.col("value").shift(-1).over("rank", "sample_id")
    paired = ordered.with_columns(
        _next=nxt, _next_layer=pl.col("layer").shift(-1).over("rank", "sample_id")
    ).filter(pl.col("_next") > 0)
    paired = paired.with_columns(
        ratio=pl.col("value") / pl.col("_next"), call_index=0, tensor_path=pl.lit(OUTPUT)
    )
    found = []
    for rule, holds in (
        (Rule.VANISHING_GRADIENT, pl.col("ratio") < 1 / factor),
        (Rule.EXPLODING_GRADIENT, pl.col("ratio") > factor),
    ):
        for row in base.onsets(paired, holds):
            found.append(
                base.finding(
                    rule,
                    row,
                    "rms",
                    row["ratio"],
                    factor,
                    f"the output-gradient rms of {row['layer']} is {row['ratio']:.3g} times "
                    f"that of {row['_next_layer']}, the layer after it that the gradient comes "
                    f"from (beyond {factor:g}x) at {base.where(row, context)}{base.held(row)}",
                )
            )
    return found


def _drifts(rows: pl.DataFrame, window: int, factor: float, *, both_ways: bool) -> pl.DataFrame:
    """Per tensor whose recent mean moved beyond ``factor`` times its early mean: the onset.

    The onset is the first sample where the value itself went beyond ``factor`` times the early
    mean; the row carries ``early``, ``recent`` and ``ratio`` (recent over early). Early: the
    first ``window`` values; recent: the last ``window`` (a tensor needs ``2 * window``).
    """
    import polars as pl

    index, count = pl.col("_i"), pl.col("_n")
    per_tensor = (
        rows.sort("sample_id")
        .with_columns(_i=pl.int_range(pl.len()).over(KEYS), _n=pl.len().over(KEYS))
        .with_columns(
            early=pl.col("value").filter(index < window).mean().over(KEYS),
            recent=pl.col("value").filter(index >= count - window).mean().over(KEYS),
        )
        .filter((count >= 2 * window) & (pl.col("early") > 0))
        .with_columns(
            ratio=pl.col("recent") / pl.col("early"), now=pl.col("value") / pl.col("early")
        )
    )
    up = (pl.col("ratio") > factor) & (pl.col("now") > factor)
    down = (pl.col("ratio") < 1 / factor) & (pl.col("now") < 1 / factor)
    moved = per_tensor.filter((up | down) if both_ways else up)
    return moved.group_by(KEYS, maintain_order=True).first()


def gradient_growth(context: RuleContext) -> list[Finding]:
    """Output-gradient rms of the last samples ``gradient_growth_factor`` times the first ones."""
    t = context.thresholds
    factor = t.gradient_growth_factor
    rows = base.values(context, OUTPUT_GRADIENT, "rms")
    return [
        base.finding(
            Rule.GRADIENT_GROWTH,
            row,
            "rms",
            row["ratio"],
            factor,
            f"the output-gradient rms of {row['layer']} grew {row['ratio']:.3g} times (beyond "
            f"{factor:g}x) from its first {t.window} samples ({row['early']:.3g}) to its last "
            f"{t.window} ({row['recent']:.3g}); first beyond at {base.where(row, context)}",
        )
        for row in _drifts(rows, t.window, factor, both_ways=False).iter_rows(named=True)
    ]


def scale_drift(context: RuleContext) -> list[Finding]:
    """Output rms of the last samples ``scale_drift_factor`` times larger or smaller."""
    t = context.thresholds
    factor = t.scale_drift_factor
    rows = base.values(context, OUTPUT, "rms")
    return [
        base.finding(
            Rule.SCALE_DRIFT,
            row,
            "rms",
            row["ratio"],
            factor,
            f"the output rms of {row['layer']} moved {row['ratio']:.3g} times (beyond "
            f"{factor:g}x either way) from its first {t.window} samples ({row['early']:.3g}) "
            f"to its last {t.window} ({row['recent']:.3g}); first beyond at "
            f"{base.where(row, context)}",
        )
        for row in _drifts(rows, t.window, factor, both_ways=True).iter_rows(named=True)
    ]


def gradient_lost(context: RuleContext) -> list[Finding]:
    """A layer that had an output gradient reports ``no_gradient`` in a later backward sample."""
    import polars as pl

    grads = base.gather(
        context.history.filter((pl.col("signal") == OUTPUT_GRADIENT) & (pl.col("metric") == "rms"))
    )
    backward = grads.filter(pl.col("value").is_not_null()).select("rank", "sample_id").unique()
    rows = grads.join(backward, on=["rank", "sample_id"]).sort("sample_id")
    had = pl.col("value").is_not_null().cum_sum().over(KEYS) > 0
    lost = (pl.col("unavailable_reason") == "no_gradient") & had
    return [
        base.finding(
            Rule.GRADIENT_LOST,
            row,
            "rms",
            None,
            0.0,
            f"{row['layer']} has no output gradient at {base.where(row, context)} although it "
            f"had one before and other layers have one in that sample{base.held(row)}",
        )
        for row in base.onsets(rows, lost)
    ]


def nonfinite_onset(context: RuleContext) -> list[Finding]:
    """Per layer and signal, the first sample with ``nonfinite_fraction > 0``."""
    import polars as pl

    rows = base.gather(
        context.history.filter(
            (pl.col("metric") == "nonfinite_fraction") & pl.col("value").is_not_null()
        )
    )
    onsets = list(base.onsets(rows, pl.col("value") > 0))
    if not onsets:
        return []
    origin = min(onsets, key=lambda row: _onset_order(row, context))
    found = []
    for row in onsets:
        first = row is origin
        lead = "the first non-finite values of the run" if first else "non-finite values"
        after = "" if first else f" (the first were in {origin['layer']} {origin['signal']})"
        found.append(
            base.finding(
                Rule.NONFINITE_ONSET,
                row,
                "nonfinite_fraction",
                row["value"],
                0.0,
                f"{lead}: {row['value']:.3g} of {row['layer']}'s {row['signal']} at "
                f"{base.where(row, context)}{after}{base.held(row)}",
            )
        )
    return found


def _onset_order(row: dict[str, Any], context: RuleContext) -> tuple[int, int, int]:
    return base.time_order(row["sample_id"], row["signal"], row["layer"], context.order)


def update_to_weight(context: RuleContext) -> list[Finding]:
    """``update_to_weight`` outside ``update_to_weight_band``."""
    import polars as pl

    low, high = context.thresholds.update_to_weight_band
    rows = base.values(context, UPDATE, "update_to_weight")
    found = []
    for row in base.onsets(rows, (pl.col("value") < low) | (pl.col("value") > high)):
        threshold = low if row["value"] < low else high
        found.append(
            base.finding(
                Rule.UPDATE_TO_WEIGHT,
                row,
                "update_to_weight",
                row["value"],
                threshold,
                f"the update of {row['layer']}.{row['tensor_path']} is {row['value']:.3g} of its "
                f"weight, outside [{low:g}, {high:g}], at {base.where(row, context)}"
                f"{base.held(row)}",
            )
        )
    return found


def outliers(context: RuleContext) -> list[Finding]:
    """Outputs whose ``max_abs / rms`` exceeds ``outlier_ratio``."""
    import polars as pl

    limit = context.thresholds.outlier_ratio
    wide = base.wide(context, OUTPUT, ["max_abs", "rms"]).filter(pl.col("rms") > 0)
    wide = wide.with_columns(ratio=pl.col("max_abs") / pl.col("rms"))
    return [
        base.finding(
            Rule.OUTLIERS,
            row,
            "max_abs/rms",
            row["ratio"],
            limit,
            f"the largest output of {row['layer']} is {row['ratio']:.3g} times its rms "
            f"(above {limit:g}) at {base.where(row, context)}{base.held(row)}",
        )
        for row in base.onsets(wide, pl.col("ratio") > limit)
    ]


def rank_disagreement(context: RuleContext) -> list[Finding]:
    """The same layer, signal, metric and step differing across ranks by ``rank_factor``."""
    import polars as pl

    t = context.thresholds
    if context.ranks < 2:
        return []
    rows = base.gather(
        context.history.filter(
            pl.col("metric").is_in(t.rank_metrics) & pl.col("value").is_not_null()
        ).with_columns(_at=pl.coalesce("step", "sample_id"), _abs=pl.col("value").abs())
    )
    keys = ["layer", "call_index", "signal", "tensor_path", "metric", "_at"]
    spread = (
        rows.group_by(keys)
        .agg(
            low=pl.col("_abs").min(),
            high=pl.col("_abs").max(),
            ranks=pl.col("rank").n_unique(),
            low_rank=pl.col("rank").sort_by("_abs").first(),
            high_rank=pl.col("rank").sort_by("_abs").last(),
            sample_id=pl.col("sample_id").min(),
            step=pl.col("step").first(),
        )
        .filter(pl.col("ranks") >= 2)
    )
    ratio = pl.when(pl.col("low") > 0).then(pl.col("high") / pl.col("low")).otherwise(math.inf)
    spread = spread.with_columns(ratio=ratio, rank=0).filter(pl.col("ratio") > t.rank_factor)
    first = spread.sort("sample_id").group_by("layer", "signal", "metric").first()
    return [
        Finding(
            Rule.RANK_DISAGREEMENT,
            row["layer"],
            row["signal"],
            row["metric"],
            row["step"],
            row["sample_id"],
            row["ratio"],
            t.rank_factor,
            f"the {row['metric']} of {row['layer']}'s {row['signal']} on rank "
            f"{row['high_rank']} is {row['ratio']:.3g} times that on rank {row['low_rank']} "
            f"(beyond {t.rank_factor:g}x) at {'step' if row['step'] is not None else 'sample'}"
            f" {row['_at']}",
        )
        for row in first.iter_rows(named=True)
    ]


RULES: tuple[Callable[[RuleContext], list[Finding]], ...] = (
    nonfinite_onset,
    dead_units,
    saturation,
    gradient_steps,
    gradient_growth,
    gradient_lost,
    scale_drift,
    outliers,
    update_to_weight,
    rank_disagreement,
)
