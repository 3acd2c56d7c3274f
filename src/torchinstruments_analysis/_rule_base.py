"""The records the findings rules share: rules, thresholds, findings, and row helpers."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from torchinstruments_analysis._signals import OUTPUT

if TYPE_CHECKING:
    import polars as pl

KEYS = ("rank", "layer", "call_index", "signal", "tensor_path")


class Rule(StrEnum):
    """The rules ``find`` applies, in the order its rows come."""

    NONFINITE_ONSET = "nonfinite_onset"
    DEAD_UNITS = "dead_units"
    SATURATION = "saturation"
    VANISHING_GRADIENT = "vanishing_gradient"
    EXPLODING_GRADIENT = "exploding_gradient"
    GRADIENT_GROWTH = "gradient_growth"
    GRADIENT_LOST = "gradient_lost"
    SCALE_DRIFT = "scale_drift"
    OUTLIERS = "outliers"
    UPDATE_TO_WEIGHT = "update_to_weight"
    RANK_DISAGREEMENT = "rank_disagreement"


@dataclass(frozen=True, slots=True, kw_only=True)
class Thresholds:
    """Where each rule starts to speak; every default can be changed.

    Attributes:
        dead_zero_fraction: ``dead_units`` when at least this share of a ReLU-family layer's
            outputs is exactly zero (0.99).
        saturation_margin: ``saturation`` counts an output within this distance of a bound of
            its range as at the bound (0.01).
        gradient_step_factor: ``vanishing_gradient``/``exploding_gradient`` when a layer's
            output-gradient rms is this many times smaller/larger than the next layer's (100).
        gradient_growth_factor: ``gradient_growth`` when the output-gradient rms of the last
            ``window`` samples is this many times that of the first ``window`` (100).
        scale_drift_factor: ``scale_drift`` when the output rms of the last ``window`` samples
            is this many times larger or smaller than that of the first ``window`` (10).
        window: How many samples make "early" and "recent" (3); the drift and growth rules need
            at least twice this many samples of a layer.
        update_to_weight_band: ``update_to_weight`` outside ``[low, high]`` (1e-5, 1e-1): two
            decades either side of the ~1e-3 of healthy training (Karpathy's rule of thumb), so
            Adam's first steps on small weights (lr 1e-3 on GPT-2's 0.02 init: ~5e-2) pass.
        outlier_ratio: ``outliers`` when ``max_abs / rms`` of a layer's outputs exceeds it (50).
        rank_factor: ``rank_disagreement`` when ranks differ by more than this factor (10).
        rank_metrics: The metrics compared across ranks (``rms``).
    """

    dead_zero_fraction: float = 0.99
    saturation_margin: float = 0.01
    gradient_step_factor: float = 100.0
    gradient_growth_factor: float = 100.0
    scale_drift_factor: float = 10.0
    window: int = 3
    update_to_weight_band: tuple[float, float] = (1e-5, 1e-1)
    outlier_ratio: float = 50.0
    rank_factor: float = 10.0
    rank_metrics: tuple[str, ...] = ("rms",)

    def __post_init__(self) -> None:
        for name in ("gradient_step_factor", "gradient_growth_factor", "scale_drift_factor"):
            _require(name, getattr(self, name), getattr(self, name) > 1, "a factor above 1")
        for name in ("outlier_ratio", "rank_factor"):
            _require(name, getattr(self, name), getattr(self, name) > 1, "a factor above 1")
        _require("dead_zero_fraction", self.dead_zero_fraction, 0 < self.dead_zero_fraction <= 1)
        _require("saturation_margin", self.saturation_margin, 0 <= self.saturation_margin < 0.5)
        _require("window", self.window, self.window >= 1, "an integer of at least 1")
        low, high = self.update_to_weight_band
        _require("update_to_weight_band", self.update_to_weight_band, 0 <= low < high, "low < high")


def _require(name: str, value: object, ok: bool, expected: str = "a value in range") -> None:
    if not ok:
        raise ValueError(f"Thresholds.{name}={value!r} is invalid: expected {expected}")


@dataclass(frozen=True, slots=True)
class Finding:
    """One fact: the rule, where it held first, the value there and the threshold crossed."""

    rule: Rule
    layer: str
    signal: str
    metric: str
    step: int | None
    sample_id: int
    value: float | None
    threshold: float
    message: str


@dataclass(frozen=True, slots=True)
class RuleContext:
    """The rules' view of a run: its rows lazily (read a span of samples at a time), its layers."""

    history: pl.LazyFrame
    order: dict[str, int]  # layer -> forward position
    types: dict[str, str]
    ranks: int
    thresholds: Thresholds
    spans: tuple[tuple[int, int], ...]  # [first, last] sample ids, in order, covering the run


class ChunkRule(Protocol):
    """A rule fed the run a span of samples at a time (bounded memory), in sample order."""

    def add(self, chunk: pl.DataFrame) -> None:
        """Take in the rows of the next span of samples."""

    def findings(self) -> list[Finding]:
        """The facts, once every span was added."""


def values(chunk: pl.DataFrame, signal: str, metric: str) -> pl.DataFrame:
    """The rows of one signal's metric that have a value."""
    import polars as pl

    return chunk.filter(
        (pl.col("signal") == signal) & (pl.col("metric") == metric) & pl.col("value").is_not_null()
    )


def wide(chunk: pl.DataFrame, signal: str, metrics: list[str]) -> pl.DataFrame:
    """One row per tensor and sample with one column per metric (rows lacking one dropped)."""
    import polars as pl

    index = ["sample_id", "step", *KEYS]
    rows = chunk.filter(
        (pl.col("signal") == signal)
        & pl.col("metric").is_in(metrics)
        & pl.col("value").is_not_null()
    )
    if rows.height == 0:
        empty = {name: rows.schema[name] for name in index} | dict.fromkeys(metrics, pl.Float64())
        return pl.DataFrame(schema=empty)
    wide = rows.pivot("metric", index=index, values="value")
    for metric in metrics:
        if metric not in wide.columns:
            wide = wide.with_columns(pl.lit(None, dtype=pl.Float64()).alias(metric))
    return wide.select(*index, *metrics).drop_nulls(metrics)


def where(row: dict[str, Any], context: RuleContext) -> str:
    at = f"sample {row['sample_id']}" + ("" if row["step"] is None else f" (step {row['step']})")
    extra = [f"rank {row['rank']}"] if context.ranks > 1 else []
    if row.get("call_index", 0):
        extra.append(f"call {row['call_index']}")
    if row.get("tensor_path") not in (None, OUTPUT):
        extra.append(str(row["tensor_path"]))
    return at + (f", {', '.join(extra)}" if extra else "")


def finding(
    rule: Rule,
    row: dict[str, Any],
    metric: str,
    value: float | None,
    threshold: float,
    message: str,
) -> Finding:
    return Finding(
        rule,
        row["layer"],
        row["signal"],
        metric,
        row["step"],
        row["sample_id"],
        value,
        threshold,
        message,
    )


def held(row: dict[str, Any]) -> str:
    return f"; held in {row['_count']} of {row['_total']} samples"


def time_order(sample: int, signal: str, layer: str, order: dict[str, int]) -> tuple[int, int, int]:
    position = order.get(layer, 0)
    gradient = signal.endswith("gradient")
    # in one sample the forward runs first, and a backward visits layers last to first
    return sample, int(gradient), -position if gradient else position
