"""``first_nonfinite``: the first sample with NaN or Inf, and where in it they started.

In the forward a non-finite value flows from a layer to the layers after it; in the backward
the gradient flows from the last layer to the first. So within the first sample holding one,
the first layer in execution order whose ``output`` is non-finite is where the forward went
wrong, and the first in reverse execution order whose ``output_gradient`` is, where the
backward did. Whether the layer *started* it or was *passed* a non-finite input is told by what
flowed into it: its ``input`` signal when recorded, else the previous layer's ``output`` in
execution order (for the backward: the next layer's ``output_gradient``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import polars as pl

from torchinstruments_analysis._select import FORWARD_SIGNALS
from torchinstruments_analysis._signals import INPUT, OUTPUT, OUTPUT_GRADIENT

if TYPE_CHECKING:
    from torchinstruments_analysis.read import Run

NO_FINITE_VALUES = "no_finite_values"

SCHEMA = pl.Schema(
    {
        "rank": pl.Int32(),
        "sample_id": pl.Int64(),
        "step": pl.Int64(),
        "direction": pl.String(),
        "signal": pl.String(),
        "layer": pl.String(),
        "call_index": pl.Int32(),
        "tensor_path": pl.String(),
        "nonfinite_fraction": pl.Float64(),
        "started": pl.Boolean(),
        "evidence": pl.String(),
        "compared_with": pl.String(),
    }
)
"""The columns of ``first_nonfinite``'s frame."""

# direction, the signal searched, the signal that flowed into it, and the search order
_DIRECTIONS = (
    ("forward", OUTPUT, INPUT, False),
    ("backward", OUTPUT_GRADIENT, None, True),
)


def nonfinite() -> pl.Expr:
    """A row that says its tensor held NaN or Inf."""
    fraction = (pl.col("metric") == "nonfinite_fraction") & (pl.col("value") > 0)
    return fraction | (pl.col("unavailable_reason") == NO_FINITE_VALUES)


def first_nonfinite(run: Run) -> pl.DataFrame:
    """Per rank, the first sample holding a non-finite value, and the layers where it showed.

    The first sample is the lowest ``sample_id`` of the rank with a row whose
    ``nonfinite_fraction`` is above 0 or whose value is unavailable for ``no_finite_values``
    (only the signals of a sample's forward and backward are searched, not step records). In it,
    one row per direction with a non-finite tensor:

    - ``forward``: the first layer in execution order whose ``output`` is non-finite;
    - ``backward``: the first layer in reverse execution order whose ``output_gradient`` is.

    ``started`` is true when what flowed into the layer was finite: in the forward its
    ``input`` signal when recorded, else the previous layer's ``output``; in the backward the
    next layer's ``output_gradient``, unless the layer's own ``output`` was already non-finite
    in the forward (then it was passed on from there: ``forward_output``). ``evidence`` says
    which was compared (``input``, ``forward_output``, ``previous_layer`` or ``next_layer``,
    named in ``compared_with``), or ``first_layer`` / ``last_layer`` when nothing measured flows
    into it; ``started`` is true then. Execution order is a line: without an ``input`` signal
    the first non-finite output always follows a finite one, so in the forward only ``input``
    can say "passed on" (a non-finite batch reaching the first layer shows as ``first_layer``).
    ``nonfinite_fraction`` is the largest over the layer's
    tensors (null where only ``no_finite_values`` said so). An empty frame: nothing non-finite.
    """
    bad = run.history.filter(pl.col("signal").is_in(FORWARD_SIGNALS), nonfinite())
    first = bad.group_by("rank").agg(pl.col("sample_id").min()).collect().sort("rank")
    if first.height == 0:
        return pl.DataFrame(schema=SCHEMA)
    # one explicit condition per rank, so the scan skips row groups by their statistics
    where = pl.any_horizontal(
        (pl.col("rank") == rank) & (pl.col("sample_id") == sample_id)
        for rank, sample_id in first.iter_rows()
    )
    rows = run.history.filter(where, pl.col("signal").is_in(FORWARD_SIGNALS)).collect()
    found = [
        row
        for (rank,), one in rows.group_by("rank", maintain_order=True)
        for row in _in_sample(run, one, int(str(rank)))
    ]
    return pl.DataFrame(found, schema=SCHEMA, orient="row")  # per rank: forward, backward


_State = dict[tuple[str, str], tuple[bool, int, str, "float | None"]]


def _in_sample(run: Run, rows: pl.DataFrame, rank: int) -> list[tuple[object, ...]]:
    state = _tensor_state(rows)
    sample_id, step = rows["sample_id"][0], rows["step"][0]
    order = _order(run, state)
    found: list[tuple[object, ...]] = []
    for direction, signal, into, backwards in _DIRECTIONS:
        walk = order[::-1] if backwards else order
        hit = _first_bad(state, walk, signal)
        if hit is None:
            continue
        started, evidence, compared = _origin(state, walk, hit, signal, into, backwards)
        _, call, path, fraction = state[(hit, signal)]
        found.append(
            (
                rank,
                sample_id,
                step,
                direction,
                signal,
                hit,
                call,
                path,
                fraction,
                started,
                evidence,
                compared,
            )
        )
    return found


def _tensor_state(rows: pl.DataFrame) -> _State:
    """Per layer and signal: non-finite?, the first bad call and tensor, the largest fraction."""
    flagged = rows.with_columns(bad=nonfinite()).sort("call_index", "tensor_path")
    per = flagged.group_by("layer", "signal").agg(
        pl.col("bad").any(),
        pl.col("call_index").filter("bad").first().fill_null(pl.col("call_index").first()),
        pl.col("tensor_path").filter("bad").first().fill_null(pl.col("tensor_path").first()),
        pl.col("value").filter(pl.col("metric") == "nonfinite_fraction").max(),
    )
    return {(r[0], r[1]): (r[2], r[3], r[4], r[5]) for r in per.iter_rows()}


def _order(run: Run, state: _State) -> list[str]:
    present = {layer for layer, _ in state}
    known = [layer for layer in run.layers if layer in present]
    return known + sorted(present - set(known))


def _first_bad(state: _State, walk: list[str], signal: str) -> str | None:
    return next(
        (layer for layer in walk if (layer, signal) in state and state[(layer, signal)][0]), None
    )


def _origin(
    state: _State, walk: list[str], hit: str, signal: str, into: str | None, backwards: bool
) -> tuple[bool, str, str | None]:
    """Started there?, what was compared (``evidence``), and the layer compared with."""
    if into is not None and (hit, into) in state:
        return not state[(hit, into)][0], into, None
    if backwards and state.get((hit, OUTPUT), (False,))[0]:
        return False, "forward_output", None  # a non-finite forward makes its gradient so
    before = [layer for layer in walk[: walk.index(hit)] if (layer, signal) in state]
    if not before:
        return True, "last_layer" if backwards else "first_layer", None
    neighbour = before[-1]
    evidence = "next_layer" if backwards else "previous_layer"
    return not state[(neighbour, signal)][0], evidence, neighbour
