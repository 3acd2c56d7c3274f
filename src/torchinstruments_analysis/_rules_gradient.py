"""The findings rules on output gradients: steps between neighbours, and gradients lost.

Each is fed the run a span of samples at a time (``ChunkRule``) and keeps, per tensor, only the
first row where its fact held and how often it held (``_chunks.Onsets``), plus, for a lost
gradient, which tensors had one in an earlier span.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchinstruments_analysis import _rule_base as base
from torchinstruments_analysis._chunks import Onsets
from torchinstruments_analysis._rule_base import KEYS, Finding, Rule, RuleContext
from torchinstruments_analysis._rules import OnsetRule
from torchinstruments_analysis._signals import OUTPUT, OUTPUT_GRADIENT

if TYPE_CHECKING:
    import polars as pl


class GradientSteps:
    """Output-gradient rms of adjacent layers (backward order) apart by ``gradient_step_factor``.

    Gives ``vanishing_gradient`` and ``exploding_gradient`` findings. Adjacent is in execution
    order: the gradient's path in a chain, not where branches run side by side (attention's
    query, key and value; a gated MLP's gate and up projections) or a residual adds to it.
    """

    def __init__(self, context: RuleContext) -> None:
        self.context = context
        self.onsets = {Rule.VANISHING_GRADIENT: Onsets(), Rule.EXPLODING_GRADIENT: Onsets()}

    def add(self, chunk: pl.DataFrame) -> None:
        """Pair each layer with the next one in the same sample, and judge the ratio."""
        import polars as pl

        factor = self.context.thresholds.gradient_step_factor
        paired = _next_layer_ratio(chunk, self.context.order)
        self.onsets[Rule.VANISHING_GRADIENT].add(paired, pl.col("ratio") < 1 / factor)
        self.onsets[Rule.EXPLODING_GRADIENT].add(paired, pl.col("ratio") > factor)

    def findings(self) -> list[Finding]:
        """One finding per layer and direction where the step held."""
        factor = self.context.thresholds.gradient_step_factor
        return [
            base.finding(
                rule,
                row,
                "rms",
                row["ratio"],
                factor,
                f"the output-gradient rms of {row['layer']} is {row['ratio']:.3g} times "
                f"that of {row['_next_layer']}, the next observed layer in execution order "
                f"(beyond {factor:g}x) at {base.where(row, self.context)}{base.held(row)}",
            )
            for rule, onsets in self.onsets.items()
            for row in onsets.rows()
        ]


def _next_layer_ratio(chunk: pl.DataFrame, order: dict[str, int]) -> pl.DataFrame:
    import polars as pl

    rows = base.values(chunk, OUTPUT_GRADIENT, "rms")
    per_layer = rows.group_by("rank", "sample_id", "step", "layer", "signal").agg(
        pl.col("value").max()
    )
    ordered = per_layer.with_columns(
        _pos=pl.col("layer").replace_strict(order, return_dtype=pl.Int64())
    ).sort("rank", "sample_id", "_pos")
    nxt = pl.col("value").shift(-1).over("rank", "sample_id")
    paired = ordered.with_columns(
        _next=nxt, _next_layer=pl.col("layer").shift(-1).over("rank", "sample_id")
    ).filter(pl.col("_next") > 0)
    return paired.with_columns(
        ratio=pl.col("value") / pl.col("_next"),
        call_index=pl.lit(0, dtype=rows.schema["call_index"]),
        tensor_path=pl.lit(OUTPUT).cast(rows.schema["tensor_path"]),
    ).select("sample_id", "step", *KEYS, "ratio", "_next_layer")


class GradientLost(OnsetRule):
    """A layer that had an output gradient reports ``no_gradient`` in a later backward sample."""

    def __init__(self, context: RuleContext) -> None:
        super().__init__(context)
        self._had: pl.DataFrame | None = None  # the tensors that had a gradient in a past span

    def add(self, chunk: pl.DataFrame) -> None:
        """Judge one span; remember which tensors had a gradient so far."""
        import polars as pl

        grads = chunk.filter((pl.col("signal") == OUTPUT_GRADIENT) & (pl.col("metric") == "rms"))
        backward = grads.filter(pl.col("value").is_not_null()).select("rank", "sample_id").unique()
        rows = grads.join(backward, on=["rank", "sample_id"])
        before = pl.lit(value=False)
        if self._had is not None:
            rows = rows.join(self._had, on=list(KEYS), how="left", nulls_equal=True)
            before = pl.col("_before").fill_null(value=False)
        rows = rows.sort("sample_id")  # a join keeps no order; "had" reads them in time
        had = before | (pl.col("value").is_not_null().cum_sum().over(KEYS) > 0)
        self.onsets.add(rows, (pl.col("unavailable_reason") == "no_gradient") & had)
        measured = grads.filter(pl.col("value").is_not_null()).select(KEYS).unique()
        known = measured if self._had is None else pl.concat([self._had.select(KEYS), measured])
        self._had = known.unique().with_columns(_before=pl.lit(value=True))

    def finding(self, row: dict[str, Any]) -> Finding:
        return base.finding(
            Rule.GRADIENT_LOST,
            row,
            "rms",
            None,
            0.0,
            f"{row['layer']} has no output gradient at {base.where(row, self.context)} although "
            f"it had one before and other layers have one in that sample{base.held(row)}",
        )
