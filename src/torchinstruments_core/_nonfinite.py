"""Where a sample's non-finite values began: the first layer in the forward and in the backward.

Pure host work on a delivered ``SampleRecord``: its ``nonfinite_fraction`` rows already hold, for
every observed tensor, the share of NaN and Inf entries. A record's rows are in the order they
were measured, which is the execution order: outputs as the forward called the modules, output
gradients as the backward reached them. So the first non-finite output is the first row with a
positive fraction, and likewise for the output gradients.

A layer *started* the non-finite values when the tensor observed before it was finite: the
previous observed output in the forward, the previous observed output gradient in the backward.
Code between two observed modules (a residual add, a functional call, a hook) is not observed,
so "started there" also covers values that turned non-finite just before the layer. The first
tensor of each pass has no observed input (the batch, the gradient of the loss), so whether it
started them is not known (``started`` is ``None``).

Example:
    >>> from torchinstruments_core import SampleRecord, Signal, StatRow
    >>> def row(layer, signal, fraction):
    ...     return StatRow(layer, 0, signal, "output", "nonfinite_fraction", fraction, None)
    >>> rows = (row("fc1", Signal.OUTPUT, 0.0), row("fc2", Signal.OUTPUT, 1.0),
    ...         row("fc2", Signal.OUTPUT_GRADIENT, 1.0), row("fc1", Signal.OUTPUT_GRADIENT, 1.0))
    >>> onset = find_onset(SampleRecord("r", 0, 3, 7, 0.0, False, 0.0, rows, ()))
    >>> onset.forward.layer, onset.forward.started, onset.backward.layer, onset.backward.started
    ('fc2', True, 'fc2', None)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchinstruments_core._rows import row_parts
from torchinstruments_core._signals import RecordKind, Signal, tensor_root_of

if TYPE_CHECKING:
    from torchinstruments_core._records import SampleRecord

NONFINITE_METRIC = "nonfinite_fraction"


@dataclass(frozen=True, slots=True)
class NonFiniteTensor:
    """The first non-finite tensor of one pass of a sample.

    Attributes:
        layer: The module's name.
        call_index: Which call of the module in the sample.
        signal: ``Signal.OUTPUT`` (forward) or ``Signal.OUTPUT_GRADIENT`` (backward).
        tensor_path: Where in the module's output the tensor sits (``output``, ``output.0``).
        fraction: The share of its entries that are NaN or Inf.
        started: ``True`` when the tensor execution reached the module with was finite (the
            module made the values non-finite), ``False`` when it was not (they were passed
            on), ``None`` when that tensor is not observed (the first of its pass).
    """

    layer: str
    call_index: int
    signal: Signal
    tensor_path: str
    fraction: float
    started: bool | None

    def describe(self) -> str:
        """E.g. ``'fc2' output (started there: its input was finite)``."""
        where = repr(self.layer)
        if self.call_index:
            where += f" call {self.call_index}"
        what = str(self.signal)
        if self.tensor_path != tensor_root_of(self.signal):
            what += f" {self.tensor_path}"
        gradient = self.signal is Signal.OUTPUT_GRADIENT
        source = "the gradient flowing into it" if gradient else "its input"
        if self.started is None:
            how = f"the first observed tensor of its pass; {source} is not observed"
        elif self.started:
            # What runs between two observed modules (a residual add, a functional call) is not
            # observed: the values may have turned non-finite there, just before this layer.
            how = "started there, or in unobserved code just before it: the tensor observed "
            how += "before it was finite"
        else:
            how = f"passed on: {source} was already non-finite"
        return f"{where} {what}, {self.fraction:.0%} non-finite ({how})"


@dataclass(frozen=True, slots=True)
class NonFiniteOnset:
    """The first non-finite tensor of a sample's forward and of its backward.

    Attributes:
        step: The sample's step (the trainer's, as logged), ``None`` without one.
        sample_id: The sample's id.
        forward: The first non-finite output in forward order, ``None`` if all were finite.
        backward: The first non-finite output gradient in backward order, ``None`` if all were
            finite (or the sample had no backward).
    """

    step: int | None
    sample_id: int
    forward: NonFiniteTensor | None
    backward: NonFiniteTensor | None

    def message(self) -> str:
        """One line naming the step and the first layer of each pass."""
        at = f"step {self.step}" if self.step is not None else "a step"
        forward = self.forward.describe() if self.forward else "all outputs finite"
        backward = self.backward.describe() if self.backward else "all output gradients finite"
        return (
            f"non-finite values at {at} (sample {self.sample_id}): "
            f"forward: first at {forward}; backward: first at {backward}"
        )


def find_onset(record: SampleRecord) -> NonFiniteOnset | None:
    """The first non-finite output and output gradient of ``record``, or ``None`` if none.

    Only samples (``RecordKind.FORWARD``) are read; a step record gives ``None``.
    """
    if record.kind is not RecordKind.FORWARD:
        return None
    forward = _first(record, Signal.OUTPUT)
    backward = _first(record, Signal.OUTPUT_GRADIENT)
    if forward is None and backward is None:
        return None
    return NonFiniteOnset(record.step, record.sample_id, forward, backward)


def _first(record: SampleRecord, signal: Signal) -> NonFiniteTensor | None:
    """The first tensor of ``signal`` with non-finite entries, in the order of the rows."""
    previous: float | None = None
    for part in row_parts(record.rows):  # the rows' parts: no ``StatRow`` is made
        if part.signal is not signal:
            continue
        for metric, value in zip(part.metrics, part.values, strict=True):
            if metric != NONFINITE_METRIC or value is None:
                continue
            if value > 0:
                started = None if previous is None else previous == 0
                return NonFiniteTensor(
                    part.layer, part.call_index, signal, part.tensor_path, value, started
                )
            previous = value
    return None
