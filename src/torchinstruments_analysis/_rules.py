"""The findings rules that judge each sample on its own: one onset per tensor where a fact holds.

Each rule is fed the run a span of samples at a time (``ChunkRule``) and keeps, per tensor, only
the first row where its fact held and how often it held (``_chunks.Onsets``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchinstruments_analysis import _rule_base as base
from torchinstruments_analysis._chunks import Onsets
from torchinstruments_analysis._rule_base import Finding, Rule, RuleContext
from torchinstruments_analysis._signals import BIAS, OUTPUT, UPDATE

if TYPE_CHECKING:
    from collections.abc import Iterable

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


class OnsetRule:
    """A rule whose facts are onsets: per tensor, the first sample where a condition holds."""

    def __init__(self, context: RuleContext) -> None:
        self.context = context
        self.onsets = Onsets()

    def add(self, chunk: pl.DataFrame) -> None:
        """Judge the rows of one span of samples."""
        for frame, holds in self.judged(chunk):
            self.onsets.add(frame, holds)

    def findings(self) -> list[Finding]:
        """One finding per tensor where the condition held."""
        return [self.finding(row) for row in self.onsets.rows()]

    def judged(self, chunk: pl.DataFrame) -> Iterable[tuple[pl.DataFrame, pl.Expr]]:
        """The rows this rule reads from a span, each with the condition it checks."""
        raise NotImplementedError

    def finding(self, row: dict[str, Any]) -> Finding:
        """The fact stated for one onset row."""
        raise NotImplementedError


class DeadUnits(OnsetRule):
    """ReLU-family outputs exactly zero in at least ``dead_zero_fraction`` of their entries."""

    def judged(self, chunk: pl.DataFrame) -> Iterable[tuple[pl.DataFrame, pl.Expr]]:
        import polars as pl

        relu = [name for name in self.context.order if _family(self.context, name, _RELU, "relu")]
        rows = base.values(chunk, OUTPUT, "zero_fraction").filter(pl.col("layer").is_in(relu))
        yield rows, pl.col("value") >= self.context.thresholds.dead_zero_fraction

    def finding(self, row: dict[str, Any]) -> Finding:
        limit = self.context.thresholds.dead_zero_fraction
        return base.finding(
            Rule.DEAD_UNITS,
            row,
            "zero_fraction",
            row["value"],
            limit,
            f"{row['value']:.1%} of the outputs of {row['layer']} are exactly zero "
            f"(>= {limit:.0%}) at {base.where(row, self.context)}{base.held(row)}",
        )


class Saturation(OnsetRule):
    """Sigmoid/tanh-family outputs with at least half their entries at a bound of the range."""

    def judged(self, chunk: pl.DataFrame) -> Iterable[tuple[pl.DataFrame, pl.Expr]]:
        import polars as pl

        margin = self.context.thresholds.saturation_margin
        bounded = {name: _bounds(self.context, name) for name in self.context.order}
        squashing = [name for name, bounds in bounded.items() if bounds is not None]
        rows = chunk.filter(pl.col("layer").is_in(squashing))
        wide = base.wide(rows, OUTPUT, ["p25", "p75"])
        for layer in wide.get_column("layer").unique().to_list():
            low, high = bounded[layer] or (0.0, 0.0)
            at_low, at_high = pl.col("p75") <= low + margin, pl.col("p25") >= high - margin
            both = (pl.col("p25") <= low + margin) & (pl.col("p75") >= high - margin)
            yield wide.filter(pl.col("layer") == layer), at_low | at_high | both

    def finding(self, row: dict[str, Any]) -> Finding:
        margin = self.context.thresholds.saturation_margin
        low, high = _bounds(self.context, row["layer"]) or (0.0, 0.0)
        share, where, quartile = _saturated_share(row, low, high, margin)
        return base.finding(
            Rule.SATURATION,
            row,
            quartile,
            row[quartile],
            margin,
            f"at least {share} of the outputs of {row['layer']} lie within {margin:g} of "
            f"{where} of [{low:g}, {high:g}] (p25 {row['p25']:.4g}, p75 {row['p75']:.4g}) "
            f"at {base.where(row, self.context)}{base.held(row)}",
        )


def _saturated_share(
    row: dict[str, Any], low: float, high: float, margin: float
) -> tuple[str, str, str]:
    if row["p75"] <= low + margin:
        return "75%", f"the lower bound {low:g}", "p75"
    if row["p25"] >= high - margin:
        return "75%", f"the upper bound {high:g}", "p25"
    return "50%", "the bounds", "p25"


class NonfiniteOnset(OnsetRule):
    """Per layer and signal, the first sample with ``nonfinite_fraction > 0``."""

    def judged(self, chunk: pl.DataFrame) -> Iterable[tuple[pl.DataFrame, pl.Expr]]:
        import polars as pl

        rows = chunk.filter(
            (pl.col("metric") == "nonfinite_fraction") & pl.col("value").is_not_null()
        )
        yield rows, pl.col("value") > 0

    def findings(self) -> list[Finding]:
        """Every onset; the first of the run is marked as where it started."""
        onsets = self.onsets.rows()
        if not onsets:
            return []
        order = self.context.order
        origin = min(
            onsets, key=lambda r: base.time_order(r["sample_id"], r["signal"], r["layer"], order)
        )
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
                    f"{base.where(row, self.context)}{after}{base.held(row)}",
                )
            )
        return found


class UpdateToWeight(OnsetRule):
    """``update_to_weight`` of a weight outside ``update_to_weight_band``.

    Biases (parameters named ``*bias``) and ratios that are not finite (a parameter of norm 0)
    are left out: a bias that starts at zero has such ratios on every healthy run.
    """

    def judged(self, chunk: pl.DataFrame) -> Iterable[tuple[pl.DataFrame, pl.Expr]]:
        import polars as pl

        low, high = self.context.thresholds.update_to_weight_band
        rows = base.values(chunk, UPDATE, "update_to_weight").filter(
            pl.col("value").is_finite() & ~pl.col("tensor_path").cast(pl.String).str.ends_with(BIAS)
        )
        yield rows, (pl.col("value") < low) | (pl.col("value") > high)

    def finding(self, row: dict[str, Any]) -> Finding:
        low, high = self.context.thresholds.update_to_weight_band
        return base.finding(
            Rule.UPDATE_TO_WEIGHT,
            row,
            "update_to_weight",
            row["value"],
            low if row["value"] < low else high,
            f"the update of {row['layer']}.{row['tensor_path']} is {row['value']:.3g} of its "
            f"weight, outside [{low:g}, {high:g}], at {base.where(row, self.context)}"
            f"{base.held(row)}",
        )


class Outliers(OnsetRule):
    """Outputs whose ``max_abs / rms`` exceeds ``outlier_ratio``."""

    def judged(self, chunk: pl.DataFrame) -> Iterable[tuple[pl.DataFrame, pl.Expr]]:
        import polars as pl

        wide = base.wide(chunk, OUTPUT, ["max_abs", "rms"]).filter(pl.col("rms") > 0)
        wide = wide.with_columns(ratio=pl.col("max_abs") / pl.col("rms"))
        yield wide, pl.col("ratio") > self.context.thresholds.outlier_ratio

    def finding(self, row: dict[str, Any]) -> Finding:
        limit = self.context.thresholds.outlier_ratio
        return base.finding(
            Rule.OUTLIERS,
            row,
            "max_abs/rms",
            row["ratio"],
            limit,
            f"the largest output of {row['layer']} is {row['ratio']:.3g} times its rms "
            f"(above {limit:g}) at {base.where(row, self.context)}{base.held(row)}",
        )
