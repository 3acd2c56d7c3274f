"""A sample's rows as a few columns per measured tensor, made into ``StatRow``s only when read.

A sample of a small GPT has about 800 rows, a few per metric of each observed tensor. Made as
``StatRow`` objects when the sample closes, they cost the training thread about a millisecond
(a frozen dataclass sets each field through ``object.__setattr__``), and the run directory's
writer then took them apart again, column by column. ``SampleRows`` keeps each tensor's part
instead: where it was observed, its metric names (one tuple shared by every tensor of a run),
its values and, where some are missing, their reasons. Iterating or indexing it makes the rows,
once; ``row_parts`` reads the parts of any rows (one part per ``StatRow`` of a plain tuple), and
what only needs columns (the history table, the routed scalars, the non-finite onset) reads
those and never makes a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, overload

from torchinstruments_core._records import StatRow

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from torchinstruments_core._signals import Signal


class RowPart(NamedTuple):
    """The rows of one observed tensor: one per metric, in order."""

    layer: str
    call_index: int
    signal: Signal
    tensor_path: str
    metrics: tuple[str, ...]
    values: Sequence[float | None]
    reasons: Sequence[str | None] | None
    """Each value's ``unavailable_reason``; ``None`` when every value is there."""

    def rows(self) -> Iterator[StatRow]:
        """This part's ``StatRow``s."""
        where = (self.layer, self.call_index, self.signal, self.tensor_path)
        reasons = self.reasons or (None,) * len(self.metrics)
        for metric, value, reason in zip(self.metrics, self.values, reasons, strict=True):
            yield StatRow(*where, metric, value, reason)


class SampleRows(Sequence[StatRow]):
    """The rows of a sample, kept as ``RowPart``s; a sequence of ``StatRow`` like a tuple.

    Equal to a tuple (or any sequence) of the same rows, hashed like one, and pickled as one.

    Args:
        parts: The parts, in the order of their rows.
    """

    __slots__ = ("_count", "_parts", "_rows")

    def __init__(self, parts: Iterable[RowPart]) -> None:
        self._parts = tuple(parts)
        self._count = sum(len(part.metrics) for part in self._parts)
        self._rows: tuple[StatRow, ...] | None = None

    @property
    def parts(self) -> tuple[RowPart, ...]:
        """The parts, in order."""
        return self._parts

    def _made(self) -> tuple[StatRow, ...]:
        rows = self._rows
        if rows is None:  # two threads may both make them: the same rows either way
            rows = self._rows = tuple(row for part in self._parts for row in part.rows())
        return rows

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> StatRow: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[StatRow, ...]: ...

    def __getitem__(self, index: int | slice) -> StatRow | tuple[StatRow, ...]:
        return self._made()[index]

    def __iter__(self) -> Iterator[StatRow]:
        return iter(self._made())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SampleRows | tuple | list):
            return self._made() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._made())

    def __repr__(self) -> str:
        return f"SampleRows({len(self._parts)} parts, {self._count} rows)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (tuple, (self._made(),))


def row_parts(rows: Sequence[StatRow]) -> Iterator[RowPart]:
    """The parts of ``rows``: a ``SampleRows``'s own, else one part per row."""
    if isinstance(rows, SampleRows):
        yield from rows.parts
        return
    for row in rows:
        reasons = None if row.unavailable_reason is None else (row.unavailable_reason,)
        where = (row.layer, row.call_index, row.signal, row.tensor_path)
        yield RowPart(*where, (row.metric,), (row.value,), reasons)
