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
  against that of the next observed layer in forward order below ``1 / gradient_step_factor``
  or above ``gradient_step_factor``: in a chain the layer its gradient comes from; in a model
  with parallel branches or residual adds not always (see the README's Limits).
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
- ``update_to_weight``: a weight's ``update_to_weight`` (rms of its update over rms of the
  weight, ~1e-3 in healthy training) outside ``update_to_weight_band`` (only where the ``update``
  signal is recorded: ``inject_observer(..., optimizer=opt)``). Biases and ratios that are not
  finite are left out (a bias that starts at zero has an infinite ratio, then one near 1).
- ``outliers``: ``max_abs / rms`` of a layer's outputs above ``outlier_ratio``.
- ``rank_disagreement``: the same layer, signal, metric (``rank_metrics``) and step differing
  across ranks by more than ``rank_factor`` times.

Layer families come from the module types in ``result.json``; while a run is still being written
(no ``result.json`` yet) they are guessed from the layer names (``relu``, ``sigmoid``, ``tanh``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Protocol

from torchinstruments_analysis import _rules, _rules_gradient, _rules_run
from torchinstruments_analysis._chunks import chunks, spans
from torchinstruments_analysis._rule_base import (
    KEYS,
    ChunkRule,
    Finding,
    Rule,
    RuleContext,
    Thresholds,
    time_order,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

    import polars as pl

__all__ = ["COLUMNS", "Finding", "Rule", "RunLike", "Thresholds", "find"]

CHUNK_ROWS = 250_000
"""How many rows of the run ``find`` reads at a time by default (its memory bound)."""

RULES: tuple[Callable[[RuleContext], ChunkRule], ...] = (
    _rules.NonfiniteOnset,
    _rules.DeadUnits,
    _rules.Saturation,
    _rules_gradient.GradientSteps,
    _rules_run.GradientGrowth,
    _rules_gradient.GradientLost,
    _rules_run.ScaleDrift,
    _rules.Outliers,
    _rules.UpdateToWeight,
    _rules_run.RankDisagreement,
)

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


class RunLike(Protocol):
    """What ``find`` reads from a run (``torchinstruments_analysis.read.Run``)."""

    @property
    def path(self) -> Path: ...  # noqa: D102
    @property
    def history(self) -> pl.LazyFrame: ...  # noqa: D102
    @property
    def layers(self) -> Sequence[str]: ...  # noqa: D102


def find(
    run: RunLike, *, thresholds: Thresholds | None = None, chunk_rows: int = CHUNK_ROWS
) -> pl.DataFrame:
    """Apply every rule to a run and return the findings, one row each (``COLUMNS``).

    Rows come rule by rule (``Rule`` order), then by the sample where the fact first held, then
    in the order a sample visits layers: outputs in forward order, then gradients in backward
    order. A rule whose signal or metric the run lacks gives no row.

    The run is read a span of consecutive samples at a time, about ``chunk_rows`` rows each,
    and every rule keeps only per-tensor state between spans: memory is bounded by
    ``chunk_rows``, not by the length of the run, and the findings do not depend on it.

    Args:
        run: A run from ``torchinstruments_analysis.read.open_run`` (finished or still running).
        thresholds: Where the rules start to speak; ``Thresholds()`` when not given.
        chunk_rows: About how many rows of the run are read at once (at least 1).

    Raises:
        ValueError: ``chunk_rows`` is below 1.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows!r} is invalid: expected an integer of at least 1")
    context = _context(run, thresholds or Thresholds(), chunk_rows)
    rules = [rule(context) for rule in RULES]
    for chunk in chunks(context):
        # a layer missing from the run's catalog comes after it, in the order first seen
        for name in chunk.get_column("layer").unique(maintain_order=True).to_list():
            context.order.setdefault(name, len(context.order))
        for rule in rules:
            rule.add(chunk)
    found = [f for rule in rules for f in rule.findings()]
    return _frame(_first_per_fact(found), context.order)


def _context(run: RunLike, thresholds: Thresholds, chunk_rows: int) -> RuleContext:
    """The rules' view of the run (still lazy) and the spans of samples it is read in."""
    import polars as pl

    metrics = ["rms", "zero_fraction", "nonfinite_fraction", "max_abs", "p25", "p75"]
    names = ["layer", "signal", "tensor_path", "metric", "unavailable_reason"]
    history = (
        run.history.filter(pl.col("metric").is_in([*metrics, "update_to_weight"]))
        .select("rank", "sample_id", "step", *KEYS[1:], "metric", "value", "unavailable_reason")
        # a name repeats in every sample: as a category the rules group and join on integers
        .with_columns(pl.col(name).cast(pl.Categorical) for name in names)
    )
    ranks = run.history.select(pl.col("rank").n_unique()).collect(engine="streaming").item()
    order = {name: i for i, name in enumerate(run.layers)}
    # spans sized on every row of the run: counting them reads only the files' metadata
    parts = spans(run.history, chunk_rows)
    return RuleContext(history, order, _layer_types(run.path), max(ranks, 1), thresholds, parts)


def _layer_types(path: Path) -> dict[str, str]:
    for result in [path / "result.json", *sorted(path.glob("rank-*/result.json"))]:
        try:
            layers = json.loads(result.read_text()).get("layers", [])
        except (OSError, ValueError):
            continue
        # a catalog without types (an older or hand-written result.json): names decide instead
        return {layer["name"]: layer["type"] for layer in layers if "type" in layer}
    return {}


def _frame(found: list[Finding], order: dict[str, int]) -> pl.DataFrame:
    import polars as pl

    rank = list(Rule)
    found.sort(
        key=lambda f: (rank.index(f.rule), *time_order(f.sample_id, f.signal, f.layer, order))
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
