"""Rules that state facts about a run, each with its evidence and the threshold it crossed.

``find(run)`` returns one row per finding: which rule, which layer and signal, the metric the rule
read, the first record where the fact held (``sample_id``, and ``step`` under a trainer), the
measured ``value`` there, the ``threshold`` it crossed, and a sentence saying all of that. There is
no score and no verdict beyond the fact: a finding says what the numbers show, not what is wrong.

Rules (``Rule``), all thresholds in ``Thresholds``:

- ``dead_units``: a ReLU-family layer whose outputs are exactly zero in at least
  ``dead_zero_fraction`` of their entries.
- ``saturation``: a sigmoid- or tanh-family layer with at least half its outputs within
  ``saturation_margin`` of a bound (read from the quartiles: ``p75`` near the lower bound, ``p25``
  near the upper one, or both at once).
- ``vanishing_gradient`` / ``exploding_gradient``: the output gradient's ``rms`` of a layer
  against that of the layer after it in forward order (the one the gradient comes from) below
  ``1 / gradient_step_factor`` or above ``gradient_step_factor``.
- ``gradient_growth``: a layer's output-gradient ``rms`` grew more than ``gradient_growth_factor``
  times from its first ``window`` samples to its last ``window`` (shrinking is what converging
  training does, so only growth is named).
- ``gradient_lost``: a layer that had an output gradient has none (``no_gradient``) in a later
  sample that had a backward.
- ``scale_drift``: a layer's output ``rms`` moved more than ``scale_drift_factor`` times, up or
  down, from its first ``window`` samples to its last ``window``.
- ``nonfinite_onset``: the first sample with ``nonfinite_fraction > 0``, per layer and signal;
  the first of them in the run (earliest sample; forward order for outputs, backward order for
  gradients) is marked as where it started.
- ``update_to_weight``: ``update_to_weight`` outside ``update_to_weight_band`` (only where the
  ``update`` signal is recorded).
- ``outliers``: ``max_abs / rms`` of a layer's outputs above ``outlier_ratio``.
- ``rank_disagreement``: the same layer, signal, metric (``rank_metrics``) and step differing
  across ranks by more than ``rank_factor`` times.

Layer families come from the module types in ``result.json``; while a run is still being written
(no ``result.json`` yet) they are guessed from the layer names (``relu``, ``sigmoid``, ``tanh``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from pathlib import Path

    import polars as pl

COLUMNS = (
    "rule",
    "layer",
    "signal",
    "metric",
    "step",
    "sample_id",
    "value",
    "threshold",
    "message",
)
_KEYS = ("rank", "layer", "call_index", "signal", "tensor_path")
_RELU = frozenset({"ReLU", "ReLU6", "RReLU"})
_BOUNDS = {"Sigmoid": (0.0, 1.0), "Hardsigmoid": (0.0, 1.0), "Tanh": (-1.0, 1.0)}
_BOUNDS |= {"Hardtanh": (-1.0, 1.0), "Softsign": (-1.0, 1.0)}


class RunLike(Protocol):
    """What ``find`` reads from a run (``torchinstruments_analysis.read.Run``)."""

    @property
    def path(self) -> Path: ...  # noqa: D102
    @property
    def history(self) -> pl.LazyFrame: ...  # noqa: D102
    @property
    def layers(self) -> list[str]: ...  # noqa: D102


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
        update_to_weight_band: ``update_to_weight`` outside ``[low, high]`` (1e-5, 1e-1).
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
class _Context:
    history: pl.DataFrame  # the rows the rules read, collected once
    order: dict[str, int]  # layer -> forward position
    types: dict[str, str]
    ranks: int
    thresholds: Thresholds


def find(run: RunLike, *, thresholds: Thresholds | None = None) -> pl.DataFrame:
    """Apply every rule to a run and return the findings, one row each (``COLUMNS``).

    Rows come rule by rule (``Rule`` order), then by the sample where the fact first held, then
    in the order a sample visits layers: outputs in forward order, then gradients in backward
    order. A rule whose signal or metric the run lacks gives no row.

    Args:
        run: A run from ``torchinstruments_analysis.read.open_run`` (finished or still running).
        thresholds: Where the rules start to speak; ``Thresholds()`` when not given.
    """
    context = _context(run, thresholds or Thresholds())
    found = [f for rule in RULES for f in rule(context)] if context.history.height else []
    return _frame(_first_per_fact(found), context.order)


def _context(run: RunLike, thresholds: Thresholds) -> _Context:
    import polars as pl

    metrics = ["rms", "zero_fraction", "nonfinite_fraction", "max_abs", "p25", "p75"]
    history = (
        run.history.filter(pl.col("metric").is_in([*metrics, "update_to_weight"]))
        .select("rank", "sample_id", "step", *_KEYS[1:], "metric", "value", "unavailable_reason")
        .collect()
    )
    order = {name: i for i, name in enumerate(run.layers)}
    for name in history.get_column("layer").unique(maintain_order=True).to_list():
        order.setdefault(name, len(order))
    ranks = history.get_column("rank").n_unique() if history.height else 1
    return _Context(history, order, _layer_types(run.path), ranks, thresholds)


def _layer_types(path: Path) -> dict[str, str]:
    for result in [path / "result.json", *sorted(path.glob("rank-*/result.json"))]:
        try:
            layers = json.loads(result.read_text()).get("layers", [])
        except (OSError, ValueError):
            continue
        return {layer["name"]: layer["type"] for layer in layers}
    return {}


def _frame(found: list[Finding], order: dict[str, int]) -> pl.DataFrame:
    import polars as pl

    rank = list(Rule)
    found.sort(
        key=lambda f: (rank.index(f.rule), *_time_order(f.sample_id, f.signal, f.layer, order))
    )
    schema = {
        "rule": pl.String(),
        "layer": pl.String(),
        "signal": pl.String(),
        "metric": pl.String(),
        "step": pl.Int64(),
        "sample_id": pl.Int64(),
        "value": pl.Float64(),
        "threshold": pl.Float64(),
        "message": pl.String(),
    }
    rows = [[getattr(f, c) for c in COLUMNS] for f in found]
    return pl.DataFrame(rows, schema=schema, orient="row")


def _first_per_fact(found: list[Finding]) -> list[Finding]:
    # a rule may hold on several calls, tensors or ranks of one layer: keep its first occurrence
    first: dict[tuple[str, str, str, str], Finding] = {}
    for f in sorted(found, key=lambda f: f.sample_id):
        first.setdefault((f.rule, f.layer, f.signal, f.metric), f)
    return list(first.values())


# --- helpers shared by the rules ------------------------------------------------------------


def _values(context: _Context, signal: str, metric: str) -> pl.DataFrame:
    import polars as pl

    return context.history.filter(
        (pl.col("signal") == signal) & (pl.col("metric") == metric) & pl.col("value").is_not_null()
    )


def _wide(context: _Context, signal: str, metrics: list[str]) -> pl.DataFrame:
    """One row per tensor and sample with one column per metric (rows lacking one dropped)."""
    import polars as pl

    rows = context.history.filter(
        (pl.col("signal") == signal)
        & pl.col("metric").is_in(metrics)
        & pl.col("value").is_not_null()
    )
    if rows.height == 0:
        return pl.DataFrame(schema={**rows.schema, **dict.fromkeys(metrics, pl.Float64())})
    wide = rows.pivot("metric", index=["sample_id", "step", *_KEYS], values="value")
    for metric in metrics:
        if metric not in wide.columns:
            wide = wide.with_columns(pl.lit(None, dtype=pl.Float64()).alias(metric))
    return wide.drop_nulls(metrics)


def _onsets(frame: pl.DataFrame, holds: pl.Expr) -> Iterable[dict[str, Any]]:
    """Per tensor: the first sample where ``holds``, with how many of its samples it held in."""
    import polars as pl

    counted = frame.with_columns(
        _held=holds, _total=pl.len().over(_KEYS), _count=holds.sum().over(_KEYS)
    )
    first = counted.filter(pl.col("_held")).sort("sample_id").group_by(_KEYS).first()
    return first.iter_rows(named=True)


def _where(row: dict[str, Any], context: _Context) -> str:
    at = f"sample {row['sample_id']}" + ("" if row["step"] is None else f" (step {row['step']})")
    extra = [f"rank {row['rank']}"] if context.ranks > 1 else []
    if row.get("call_index", 0):
        extra.append(f"call {row['call_index']}")
    if row.get("tensor_path") not in (None, "output"):
        extra.append(str(row["tensor_path"]))
    return at + (f", {', '.join(extra)}" if extra else "")


def _finding(
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


def _held(row: dict[str, Any]) -> str:
    return f"; held in {row['_count']} of {row['_total']} samples"


def _family(context: _Context, layer: str, types: Iterable[str], word: str) -> bool:
    kind = context.types.get(layer)
    return kind in types if kind is not None else word in layer.lower()


def _bounds(context: _Context, layer: str) -> tuple[float, float] | None:
    kind = context.types.get(layer)
    if kind is not None:
        return _BOUNDS.get(kind)
    name = layer.lower()
    return (0.0, 1.0) if "sigmoid" in name else (-1.0, 1.0) if "tanh" in name else None


# --- the rules ------------------------------------------------------------------------------


def dead_units(context: _Context) -> list[Finding]:
    """ReLU-family outputs exactly zero in at least ``dead_zero_fraction`` of their entries."""
    import polars as pl

    limit = context.thresholds.dead_zero_fraction
    rows = _values(context, "output", "zero_fraction")
    rows = rows.filter(
        pl.col("layer").map_elements(
            lambda name: _family(context, name, _RELU, "relu"), return_dtype=pl.Boolean()
        )
    )
    return [
        _finding(
            Rule.DEAD_UNITS,
            row,
            "zero_fraction",
            row["value"],
            limit,
            f"{row['value']:.1%} of the outputs of {row['layer']} are exactly zero "
            f"(>= {limit:.0%}) at {_where(row, context)}{_held(row)}",
        )
        for row in _onsets(rows, pl.col("value") >= limit)
    ]


def saturation(context: _Context) -> list[Finding]:
    """Sigmoid/tanh-family outputs with at least half their entries at a bound of the range."""
    import polars as pl

    margin = context.thresholds.saturation_margin
    wide = _wide(context, "output", ["p25", "p75"])
    found = []
    for layer in wide.get_column("layer").unique().to_list():
        bounds = _bounds(context, layer)
        if bounds is None:
            continue
        low, high = bounds
        at_low, at_high = pl.col("p75") <= low + margin, pl.col("p25") >= high - margin
        both = (pl.col("p25") <= low + margin) & (pl.col("p75") >= high - margin)
        for row in _onsets(wide.filter(pl.col("layer") == layer), at_low | at_high | both):
            share, where, quartile = _saturated_share(row, low, high, margin)
            found.append(
                _finding(
                    Rule.SATURATION,
                    row,
                    quartile,
                    row[quartile],
                    margin,
                    f"at least {share} of the outputs of {row['layer']} lie within {margin:g} of "
                    f"{where} of [{low:g}, {high:g}] (p25 {row['p25']:.4g}, p75 {row['p75']:.4g}) "
                    f"at {_where(row, context)}{_held(row)}",
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


def gradient_steps(context: _Context) -> list[Finding]:
    """Output-gradient rms of adjacent layers (backward order) apart by ``gradient_step_factor``."""
    import polars as pl

    factor = context.thresholds.gradient_step_factor
    rows = _values(context, "output_gradient", "rms")
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
        ratio=pl.col("value") / pl.col("_next"), call_index=0, tensor_path=pl.lit("output")
    )
    found = []
    for rule, holds in (
        (Rule.VANISHING_GRADIENT, pl.col("ratio") < 1 / factor),
        (Rule.EXPLODING_GRADIENT, pl.col("ratio") > factor),
    ):
        for row in _onsets(paired, holds):
            found.append(
                _finding(
                    rule,
                    row,
                    "rms",
                    row["ratio"],
                    factor,
                    f"the output-gradient rms of {row['layer']} is {row['ratio']:.3g} times "
                    f"that of {row['_next_layer']}, the layer after it that the gradient comes "
                    f"from (beyond {factor:g}x) at {_where(row, context)}{_held(row)}",
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
        .with_columns(_i=pl.int_range(pl.len()).over(_KEYS), _n=pl.len().over(_KEYS))
        .with_columns(
            early=pl.col("value").filter(index < window).mean().over(_KEYS),
            recent=pl.col("value").filter(index >= count - window).mean().over(_KEYS),
        )
        .filter((count >= 2 * window) & (pl.col("early") > 0))
        .with_columns(
            ratio=pl.col("recent") / pl.col("early"), now=pl.col("value") / pl.col("early")
        )
    )
    up = (pl.col("ratio") > factor) & (pl.col("now") > factor)
    down = (pl.col("ratio") < 1 / factor) & (pl.col("now") < 1 / factor)
    moved = per_tensor.filter((up | down) if both_ways else up)
    return moved.group_by(_KEYS, maintain_order=True).first()


def gradient_growth(context: _Context) -> list[Finding]:
    """Output-gradient rms of the last samples ``gradient_growth_factor`` times the first ones."""
    t = context.thresholds
    factor = t.gradient_growth_factor
    rows = _values(context, "output_gradient", "rms")
    return [
        _finding(
            Rule.GRADIENT_GROWTH,
            row,
            "rms",
            row["ratio"],
            factor,
            f"the output-gradient rms of {row['layer']} grew {row['ratio']:.3g} times (beyond "
            f"{factor:g}x) from its first {t.window} samples ({row['early']:.3g}) to its last "
            f"{t.window} ({row['recent']:.3g}); first beyond at {_where(row, context)}",
        )
        for row in _drifts(rows, t.window, factor, both_ways=False).iter_rows(named=True)
    ]


def scale_drift(context: _Context) -> list[Finding]:
    """Output rms of the last samples ``scale_drift_factor`` times larger or smaller."""
    t = context.thresholds
    factor = t.scale_drift_factor
    rows = _values(context, "output", "rms")
    return [
        _finding(
            Rule.SCALE_DRIFT,
            row,
            "rms",
            row["ratio"],
            factor,
            f"the output rms of {row['layer']} moved {row['ratio']:.3g} times (beyond "
            f"{factor:g}x either way) from its first {t.window} samples ({row['early']:.3g}) "
            f"to its last {t.window} ({row['recent']:.3g}); first beyond at "
            f"{_where(row, context)}",
        )
        for row in _drifts(rows, t.window, factor, both_ways=True).iter_rows(named=True)
    ]


def gradient_lost(context: _Context) -> list[Finding]:
    """A layer that had an output gradient reports ``no_gradient`` in a later backward sample."""
    import polars as pl

    grads = context.history.filter(
        (pl.col("signal") == "output_gradient") & (pl.col("metric") == "rms")
    )
    backward = grads.filter(pl.col("value").is_not_null()).select("rank", "sample_id").unique()
    rows = grads.join(backward, on=["rank", "sample_id"]).sort("sample_id")
    had = pl.col("value").is_not_null().cum_sum().over(_KEYS) > 0
    lost = (pl.col("unavailable_reason") == "no_gradient") & had
    return [
        _finding(
            Rule.GRADIENT_LOST,
            row,
            "rms",
            None,
            0.0,
            f"{row['layer']} has no output gradient at {_where(row, context)} although it "
            f"had one before and other layers have one in that sample{_held(row)}",
        )
        for row in _onsets(rows, lost)
    ]


def nonfinite_onset(context: _Context) -> list[Finding]:
    """Per layer and signal, the first sample with ``nonfinite_fraction > 0``."""
    import polars as pl

    rows = context.history.filter(
        (pl.col("metric") == "nonfinite_fraction") & pl.col("value").is_not_null()
    )
    onsets = list(_onsets(rows, pl.col("value") > 0))
    if not onsets:
        return []
    origin = min(onsets, key=lambda row: _onset_order(row, context))
    found = []
    for row in onsets:
        first = row is origin
        lead = "the first non-finite values of the run" if first else "non-finite values"
        after = "" if first else f" (the first were in {origin['layer']} {origin['signal']})"
        found.append(
            _finding(
                Rule.NONFINITE_ONSET,
                row,
                "nonfinite_fraction",
                row["value"],
                0.0,
                f"{lead}: {row['value']:.3g} of {row['layer']}'s {row['signal']} at "
                f"{_where(row, context)}{after}{_held(row)}",
            )
        )
    return found


def _onset_order(row: dict[str, Any], context: _Context) -> tuple[int, int, int]:
    return _time_order(row["sample_id"], row["signal"], row["layer"], context.order)


def _time_order(
    sample: int, signal: str, layer: str, order: dict[str, int]
) -> tuple[int, int, int]:
    position = order.get(layer, 0)
    gradient = signal.endswith("gradient")
    # in one sample the forward runs first, and a backward visits layers last to first
    return sample, int(gradient), -position if gradient else position


def update_to_weight(context: _Context) -> list[Finding]:
    """``update_to_weight`` outside ``update_to_weight_band``."""
    import polars as pl

    low, high = context.thresholds.update_to_weight_band
    rows = _values(context, "update", "update_to_weight")
    found = []
    for row in _onsets(rows, (pl.col("value") < low) | (pl.col("value") > high)):
        threshold = low if row["value"] < low else high
        found.append(
            _finding(
                Rule.UPDATE_TO_WEIGHT,
                row,
                "update_to_weight",
                row["value"],
                threshold,
                f"the update of {row['layer']}.{row['tensor_path']} is {row['value']:.3g} of its "
                f"weight, outside [{low:g}, {high:g}], at {_where(row, context)}{_held(row)}",
            )
        )
    return found


def outliers(context: _Context) -> list[Finding]:
    """Outputs whose ``max_abs / rms`` exceeds ``outlier_ratio``."""
    import polars as pl

    limit = context.thresholds.outlier_ratio
    wide = _wide(context, "output", ["max_abs", "rms"]).filter(pl.col("rms") > 0)
    wide = wide.with_columns(ratio=pl.col("max_abs") / pl.col("rms"))
    return [
        _finding(
            Rule.OUTLIERS,
            row,
            "max_abs/rms",
            row["ratio"],
            limit,
            f"the largest output of {row['layer']} is {row['ratio']:.3g} times its rms "
            f"(above {limit:g}) at {_where(row, context)}{_held(row)}",
        )
        for row in _onsets(wide, pl.col("ratio") > limit)
    ]


def rank_disagreement(context: _Context) -> list[Finding]:
    """The same layer, signal, metric and step differing across ranks by ``rank_factor``."""
    import polars as pl

    t = context.thresholds
    if context.ranks < 2:
        return []
    rows = context.history.filter(
        pl.col("metric").is_in(t.rank_metrics) & pl.col("value").is_not_null()
    ).with_columns(_at=pl.coalesce("step", "sample_id"), _abs=pl.col("value").abs())
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


RULES: tuple[Callable[[_Context], list[Finding]], ...] = (
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
