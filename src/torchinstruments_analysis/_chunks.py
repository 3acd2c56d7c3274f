"""Reading a run a span of samples at a time, and onsets folded over the spans.

The findings rules never hold the run: ``find`` reads the rows of a span of consecutive sample
ids (about ``chunk_rows`` rows, the run's own row groups, so a span reads only its part of the
files), hands it to every rule, and drops it. What a rule keeps between spans is per tensor
(first onset, counts), never per sample, so memory does not grow with the length of the run.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from torchinstruments_analysis._rule_base import KEYS

if TYPE_CHECKING:
    from collections.abc import Iterator

    import polars as pl

    from torchinstruments_analysis._rule_base import RuleContext


def spans(history: pl.LazyFrame, chunk_rows: int) -> tuple[tuple[int, int], ...]:
    """``[first, last]`` sample ids of consecutive spans holding about ``chunk_rows`` rows each."""
    import polars as pl

    sample = pl.col("sample_id")
    counted = history.select(rows=pl.len(), low=sample.min(), high=sample.max()).collect(
        engine="streaming"
    )
    rows, low, high = counted.row(0)
    if not rows or low is None:
        return ()
    per_sample = rows / (high - low + 1)  # samples are numbered 0, 1, 2 ... on every rank
    width = max(1, math.floor(chunk_rows / per_sample))
    return tuple((start, min(start + width, high + 1) - 1) for start in range(low, high + 1, width))


def chunks(context: RuleContext, rows: pl.LazyFrame | None = None) -> Iterator[pl.DataFrame]:
    """The rows of each span in turn (``rows``: a narrower view of the run's history)."""
    import polars as pl

    frame = context.history if rows is None else rows
    for first, last in context.spans:
        yield frame.filter(pl.col("sample_id").is_between(first, last)).collect(engine="streaming")


class Onsets:
    """Per tensor, over the spans in order: the first row where a fact held, and how often.

    Each row of ``rows()`` is the first row where the fact held with ``_count`` (the samples it
    held in) and ``_total`` (the tensor's samples that were judged).
    """

    __slots__ = ("_firsts", "_tallies")

    def __init__(self) -> None:
        self._tallies: pl.DataFrame | None = None
        self._firsts: pl.DataFrame | None = None

    def add(self, frame: pl.DataFrame, holds: pl.Expr) -> None:
        """Judge one span's rows of some tensors (each row one tensor in one sample)."""
        import polars as pl

        if frame.height == 0:
            return
        tallies = frame.group_by(KEYS).agg(_total=pl.len(), _count=holds.sum())
        self._tallies = _fold(self._tallies, tallies)
        first = frame.filter(holds).sort("sample_id").group_by(KEYS, maintain_order=True).first()
        if first.height:
            # an earlier span's onset stays the onset
            both = first if self._firsts is None else pl.concat([self._firsts, first])
            self._firsts = both.group_by(KEYS, maintain_order=True).first()

    def rows(self) -> list[dict[str, Any]]:
        """Per tensor where the fact held: its first row with ``_count`` and ``_total``."""
        if self._firsts is None or self._tallies is None:
            return []
        counted = self._firsts.join(self._tallies, on=list(KEYS), how="left", nulls_equal=True)
        return counted.to_dicts()


def _fold(before: pl.DataFrame | None, tallies: pl.DataFrame) -> pl.DataFrame:
    import polars as pl

    if before is None:
        return tallies
    both = pl.concat([before, tallies])
    return both.group_by(KEYS).agg(pl.col("_total").sum(), pl.col("_count").sum())
