"""What crosses the pipes between the training process and its writer process, and how.

A message is an 8-byte little-endian length, then a pickle. To the writer: ``("open",
settings)``, then ``("sample", record)`` for each sample, then ``("finish",)``. Back to the
training process: ``("ready",)`` or ``("failed", why)``, ``("written", samples)`` for each
chunk on disk, ``("error", message)`` for a failure to raise at the next ``put`` (a full disk),
and at the end ``("done", report, aggregates)``.

A sample's message is the pickle of ``("sample",)`` followed by the record's own pickle
(``encode``): the training thread pickles each record once, and the writer process tells a
sample from the other messages by that prefix, without unpickling a tuple around it. Both
sides import this module; it imports no torch.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import pickle
import struct
from typing import TYPE_CHECKING, Any, BinaryIO

from torchinstruments_core._records import HistogramRecord, RecordKind, SampleRecord, Signal
from torchinstruments_core._rows import RowPart, SampleRows, row_parts

if TYPE_CHECKING:
    from torchinstruments_core._records import RunInfo
    from torchinstruments_core.run_directory._layout import RunLayout

_SCALAR_NAMES = (
    "run_id",
    "rank",
    "sample_id",
    "step",
    "timestamp",
    "forward_only",
    "collection_duration_ms",
    "optimizer_step",
    "note",
    "scope",
)
"""The fields of a ``SampleRecord`` that ``encode`` passes as they are; with ``rows``,
``histograms`` and ``kind`` they are all of them (``test_writer_process`` checks it)."""
_SCALAR_FIELDS = operator.attrgetter(*_SCALAR_NAMES)
_LENGTH = struct.Struct("<Q")
SAMPLE_TAG = pickle.dumps(("sample",), protocol=pickle.HIGHEST_PROTOCOL)
"""What a sample's message starts with, before the record's own pickle."""


@dataclasses.dataclass(frozen=True, slots=True)
class WriterSettings:
    """What the writer process needs to open a run's writer."""

    layout: RunLayout
    run: RunInfo
    chunk_rows: int
    flush_seconds: float
    queue_size: int
    tensorboard: bool


def encode(sample: SampleRecord) -> bytes:
    """A record as bytes for the writer process: its rows as their parts, never as rows.

    Everything goes as plain tuples, enums as their text: pickle rebuilds a record, a
    ``RowPart`` or an enum member through a Python call each, which on an MNIST-sized MLP (11
    tensors, 10 histograms) took the training thread 33 us a sample, against 19 us this way.
    """
    fields = _SCALAR_FIELDS(sample)
    parts = tuple(
        (p.layer, p.call_index, str(p.signal), p.tensor_path, p.metrics, p.values, p.reasons)
        for p in row_parts(sample.rows)
    )
    histograms = tuple(
        (h.layer, h.call_index, str(h.signal), h.tensor_path, h.edges, h.counts, h.nonfinite_count)
        for h in sample.histograms
    )
    content = (fields, str(sample.kind), parts, histograms)
    return pickle.dumps(content, protocol=pickle.HIGHEST_PROTOCOL)


def decode(payload: bytes) -> SampleRecord:
    """The record ``encode`` made, with its rows as a ``SampleRows``."""
    fields, kind, parts, histograms = pickle.loads(payload)
    rows = SampleRows(RowPart(p[0], p[1], _enum(Signal, p[2]), *p[3:]) for p in parts)
    return SampleRecord(
        **dict(zip(_SCALAR_NAMES, fields, strict=True)),
        rows=rows,
        histograms=tuple(
            HistogramRecord(h[0], h[1], _enum(Signal, h[2]), *h[3:]) for h in histograms
        ),
        kind=_enum(RecordKind, kind),
    )


def _enum(kind: Any, value: str) -> Any:
    """The member of the str enum ``kind`` with ``value``, else ``value`` itself.

    A record made outside the engine may carry a plain string, which is written as it is.
    """
    return kind._value2member_map_.get(value, value)


def message(content: object) -> bytes:
    """``content`` framed: its length, then its pickle."""
    payload = pickle.dumps(content, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


def sample_message(encoded: bytes) -> bytes:
    """The framed message of a sample that ``encode`` made into ``encoded``."""
    return _LENGTH.pack(len(SAMPLE_TAG) + len(encoded)) + SAMPLE_TAG + encoded


def send(stream: BinaryIO, content: object) -> None:
    """Frame ``content`` onto ``stream`` and flush it."""
    stream.write(message(content))
    stream.flush()


def write_all(pipe: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` to ``pipe`` (the GIL released while the pipe is full)."""
    view = memoryview(data)
    while view:
        view = view[os.write(pipe, view) :]


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next message's bytes, or ``None`` at the end of the pipe (a partial message too)."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(header)
    payload = stream.read(length)
    return payload if len(payload) == length else None


def receive(stream: BinaryIO) -> Any:
    """The next message, unpickled, or ``None`` at the end of the pipe."""
    frame = read_frame(stream)
    return None if frame is None else pickle.loads(frame)
