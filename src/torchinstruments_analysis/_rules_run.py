"""The findings rules that compare samples across the run: drifts, growth, ranks that disagree.

Each is fed the run a span of samples at a time (``ChunkRule``) and keeps only what is per
tensor (a drift's first and last ``window`` values) or what a later span can still complete
(the newest steps of a rank comparison), so memory does not grow with the run's length.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from torchinstruments_analysis import _rule_base as base
from torchinstruments_analysis._chunks import Onsets, chunks
from torchinstruments_analysis._rule_base import KEYS, Finding, Rule, RuleContext
from torchinstruments_analysis._signals import OUTPUT, OUTPUT_GRADIENT

if TYPE_CHECKING:
    import polars as pl


class _Drift:
    """Per tensor whose recent mean ``rms`` moved beyond ``factor`` times its early mean.

    Early: the first ``window`` values of a tensor; recent: the last ``window`` (a tensor needs
    ``2 * window``). The onset is the first sample where the value itself went beyond ``factor``
    times the early mean, found in a second pass over the run for the tensors that moved.
    """

    signal: str
    both_ways: bool
    rule: Rule
    noun: str  # whose rms: "output", "output-gradient"
    verb: str

    def __init__(self, context: RuleContext) -> None:
        self.context = context
        self._heads: pl.DataFrame | None = None
        self._tails: pl.DataFrame | None = None
        self._counts: pl.DataFrame | None = None

    def add(self, chunk: pl.DataFrame) -> None:
        """Keep each tensor's first and last ``window`` values seen so far, and their count."""
        import polars as pl

        window = self.context.thresholds.window
        rows = base.values(chunk, self.signal, "rms").select(*KEYS, "sample_id", "value")
        rows = rows.sort("sample_id")  # the column order group_by(...).head keeps
        heads = rows if self._heads is None else pl.concat([self._heads, rows])
        self._heads = heads.group_by(KEYS, maintain_order=True).head(window)
        tails = rows if self._tails is None else pl.concat([self._tails, rows])
        self._tails = tails.group_by(KEYS, maintain_order=True).tail(window)
        counts = rows.group_by(KEYS).agg(count=pl.len())
        if self._counts is not None:
            counts = pl.concat([self._counts, counts]).group_by(KEYS).agg(pl.col("count").sum())
        self._counts = counts

    def moved(self) -> pl.DataFrame:
        """Per tensor that moved: ``early``, ``recent`` and ``ratio`` (recent over early)."""
        import polars as pl

        t = self.context.thresholds
        factor = self._factor()
        if self._heads is None or self._tails is None or self._counts is None:
            return pl.DataFrame()
        early = self._heads.group_by(KEYS).agg(early=pl.col("value").mean())
        recent = self._tails.group_by(KEYS).agg(recent=pl.col("value").mean())
        both = early.join(recent, on=list(KEYS), nulls_equal=True)
        both = both.join(self._counts, on=list(KEYS), nulls_equal=True)
        both = both.filter((pl.col("count") >= 2 * t.window) & (pl.col("early") > 0))
        both = both.with_columns(ratio=pl.col("recent") / pl.col("early"))
        up, down = pl.col("ratio") > factor, pl.col("ratio") < 1 / factor
        return both.filter((up | down) if self.both_ways else up)

    def onsets(self) -> list[dict[str, Any]]:
        """The first row beyond ``factor`` times the early mean, per tensor that moved."""
        import polars as pl

        moved = self.moved()
        if moved.height == 0:
            return []
        factor = self._factor()
        now, ratio = pl.col("value") / pl.col("early"), pl.col("ratio")
        beyond = ((ratio > factor) & (now > factor)) | ((ratio < 1 / factor) & (now < 1 / factor))
        rows = self.context.history.filter(
            (pl.col("signal") == self.signal) & (pl.col("metric") == "rms")
        )
        found = Onsets()
        for chunk in chunks(self.context, rows):
            judged = base.values(chunk, self.signal, "rms").join(
                moved, on=list(KEYS), nulls_equal=True
            )
            found.add(judged, beyond)
        return found.rows()

    def findings(self) -> list[Finding]:
        """One finding per tensor whose rms moved."""
        t, factor = self.context.thresholds, self._factor()
        either = " either way" if self.both_ways else ""
        return [
            base.finding(
                self.rule,
                row,
                "rms",
                row["ratio"],
                factor,
                f"the {self.noun} rms of {row['layer']} {self.verb} {row['ratio']:.3g} times "
                f"(beyond {factor:g}x{either}) from its first {t.window} samples "
                f"({row['early']:.3g}) to its last {t.window} ({row['recent']:.3g}); first "
                f"beyond at {base.where(row, self.context)}",
            )
            for row in self.onsets()
        ]

    def _factor(self) -> float:
        raise NotImplementedError


class GradientGrowth(_Drift):
    """Output-gradient rms of the last samples ``gradient_growth_factor`` times the first ones."""

    signal, rule, noun, verb = OUTPUT_GRADIENT, Rule.GRADIENT_GROWTH, "output-gradient", "grew"
    both_ways = False

    def _factor(self) -> float:
        return self.context.thresholds.gradient_growth_factor


class ScaleDrift(_Drift):
    """Output rms of the last samples ``scale_drift_factor`` times larger or smaller."""

    signal, rule, noun, verb = OUTPUT, Rule.SCALE_DRIFT, OUTPUT, "moved"
    both_ways = True

    def _factor(self) -> float:
        return self.context.thresholds.scale_drift_factor


class RankDisagreement:
    """The same layer, signal, metric and step differing across ranks by ``rank_factor``.

    A step is judged once every rank has moved past it (ranks number their samples alike, so a
    step's rows may sit in two spans); the newest steps wait for the next span.
    """

    def __init__(self, context: RuleContext) -> None:
        self.context = context
        self._waiting: pl.DataFrame | None = None
        self._first: pl.DataFrame | None = None

    def add(self, chunk: pl.DataFrame) -> None:
        """Judge the steps every rank has passed; keep the newest ones for the next span."""
        import polars as pl

        if self.context.ranks < 2:
            return
        rows = chunk.filter(
            pl.col("metric").is_in(self.context.thresholds.rank_metrics)
            & pl.col("value").is_not_null()
        ).with_columns(_at=pl.coalesce("step", "sample_id"), _abs=pl.col("value").abs())
        if rows.height == 0:
            return
        frontier = rows.group_by("rank").agg(pl.col("_at").max()).get_column("_at").min()
        if self._waiting is not None:
            rows = pl.concat([self._waiting, rows])
        self._judge(rows.filter(pl.col("_at") < frontier))
        self._waiting = rows.filter(pl.col("_at") >= frontier)

    def findings(self) -> list[Finding]:
        """Per layer, signal and metric: the first step where ranks disagreed."""
        if self._waiting is not None:
            self._judge(self._waiting)
            self._waiting = None
        if self._first is None:
            return []
        return [self._finding(row) for row in self._first.iter_rows(named=True)]

    def _judge(self, rows: pl.DataFrame) -> None:
        import polars as pl

        t = self.context.thresholds
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
        spread = spread.with_columns(ratio=ratio).filter(pl.col("ratio") > t.rank_factor)
        if spread.height == 0:
            return
        both = spread if self._first is None else pl.concat([self._first, spread])
        first = both.sort("sample_id").group_by("layer", "signal", "metric").first()
        self._first = first.select(spread.columns)

    def _finding(self, row: dict[str, Any]) -> Finding:
        t = self.context.thresholds
        at = "step" if row["step"] is not None else "sample"
        return Finding(
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
            f"(beyond {t.rank_factor:g}x) at {at} {row['_at']}",
        )
