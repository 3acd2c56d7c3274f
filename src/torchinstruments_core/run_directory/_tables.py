"""The long table and the per-sample table, as polars frames with a fixed schema."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchinstruments_core._rows import row_parts

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    import polars as pl

    from torchinstruments_core._records import SampleRecord


DType = tuple[str, tuple[tuple[str, str], ...]]
"""A column's polars dtype, without polars: the class's name and its keyword arguments."""

_SAMPLE_COLUMNS: dict[str, DType] = {  # which run, process and sample a row belongs to
    "run_id": ("String", ()),
    "rank": ("Int32", ()),
    "sample_id": ("Int64", ()),
    "step": ("Int64", ()),
    "timestamp": ("Datetime", (("time_unit", "us"), ("time_zone", "UTC"))),
}

HISTORY_COLUMNS: dict[str, DType] = _SAMPLE_COLUMNS | {
    "layer": ("String", ()),
    "call_index": ("Int32", ()),
    "signal": ("String", ()),
    "tensor_path": ("String", ()),
    "metric": ("String", ()),
    "value": ("Float64", ()),
    "unavailable_reason": ("String", ()),
}
"""The columns of ``history.parquet`` (``history_schema``)."""

SAMPLES_COLUMNS: dict[str, DType] = _SAMPLE_COLUMNS | {
    "kind": ("String", ()),
    "optimizer_step": ("Int64", ()),
    "forward_only": ("Boolean", ()),
    "collection_duration_ms": ("Float64", ()),
    "rows": ("Int64", ()),
    "note": ("String", ()),
}
"""The columns of ``samples.parquet`` (``samples_schema``)."""


def dtype_text(dtype: DType) -> str:
    """How polars prints ``dtype`` (``Int32``, ``Datetime(time_unit='us', time_zone='UTC')``).

    ``index.md`` shows the schemas this way without importing polars: the run directory opens
    in the first sampled forward, on the training thread, where importing polars took about
    0.5 s (a 2-vCPU guest, 2026-12-05).
    """
    name, arguments = dtype
    if not arguments:
        return name
    return f"{name}({', '.join(f'{key}={value!r}' for key, value in arguments)})"


def _schema(columns: Mapping[str, DType]) -> pl.Schema:
    import polars as pl

    return pl.Schema(
        {name: getattr(pl, kind)(**dict(arguments)) for name, (kind, arguments) in columns.items()}
    )


def history_schema() -> pl.Schema:
    """The dtype of every column of ``history.parquet``; the same in every run."""
    return _schema(HISTORY_COLUMNS)


def samples_schema() -> pl.Schema:
    """The dtype of every column of ``samples.parquet``.

    ``kind`` is ``"forward"`` for a sample and ``"step"`` for a step record (``RecordKind``; a run
    written before the column existed holds samples only). ``optimizer_step`` is an adapter's own
    count of optimizer steps where ``step`` follows the user's numbering
    (``SampleRecord.optimizer_step``), null otherwise. ``note`` says why a step record has no
    rows (``SampleRecord.note``: ``optimizer_step_skipped``), null otherwise; a run written before
    the column existed has none.
    """
    return _schema(SAMPLES_COLUMNS)


def history_frames(samples: Sequence[SampleRecord]) -> list[pl.DataFrame]:
    """The rows of each of ``samples`` as the long table: one frame built, a slice of it each.

    The writer builds the frames of a few thousand rows of samples at once (``_writer.BATCH_ROWS``):
    a frame's construction costs about 0.1 ms beyond its rows, as much as the 132 rows of an
    MNIST-sized MLP's sample, and a batch pays it once. The ``timestamp`` column holds integer
    microseconds since the epoch here: ``history_frame`` makes the chunk's timestamps datetimes
    at once (per sample, that query cost a third of the frame's time). The columns come from the
    rows' parts (``_rows.row_parts``), a few list operations per observed tensor, without making
    a ``StatRow`` per row.
    """
    columns: dict[str, list[object]] = {name: [] for name in HISTORY_COLUMNS}
    heights = [_extend_history(columns, sample) for sample in samples]
    frame = _raw_frame(columns, history_schema())
    frames, offset = [], 0
    for height in heights:
        frames.append(frame.slice(offset, height))
        offset += height
    return frames


def sample_history(sample: SampleRecord) -> pl.DataFrame:
    """The rows of one sample as the long table (``history_frames`` of that sample alone)."""
    return history_frames([sample])[0]


def _extend_history(columns: dict[str, list[object]], sample: SampleRecord) -> int:
    """Append the rows of ``sample`` to the long table's ``columns``; how many there are."""
    count = len(sample.rows)
    names = ("layer", "call_index", "signal", "tensor_path", "metric", "value")
    layer, call_index, signal, path, metric, value = (columns[name] for name in names)
    reasons = columns["unavailable_reason"]
    for part in row_parts(sample.rows):
        size = len(part.metrics)
        layer += [part.layer] * size
        call_index += [part.call_index] * size
        # a Signal is a str: Polars reads its text, without the enum's slow ``.value``
        signal += [part.signal] * size
        path += [part.tensor_path] * size
        metric += part.metrics
        value += part.values
        reasons += part.reasons or [None] * size
    # a list per column, no object per row: a burst of short-lived objects would be promoted
    # by the garbage collections it sets off, and make the full ones come sooner
    columns["run_id"] += [sample.run_id] * count
    columns["rank"] += [sample.rank] * count
    columns["sample_id"] += [sample.sample_id] * count
    columns["step"] += [sample.step] * count
    columns["timestamp"] += [int(sample.timestamp * 1_000_000)] * count
    return count


def history_frame(
    samples: Sequence[SampleRecord], built: Mapping[int, pl.DataFrame] | None = None
) -> pl.DataFrame:
    """The rows of ``samples`` as the long table.

    Args:
        samples: The records, in order.
        built: Frames already built by ``sample_history`` (integer timestamps), by
            ``sample_id``; the others are built here.
    """
    import polars as pl

    ready = built or {}
    frames = [_built(ready, sample) for sample in samples]
    if not frames:
        return _frame({name: [] for name in HISTORY_COLUMNS}, history_schema())
    return _timestamps(pl.concat(frames, rechunk=True))


def _built(ready: Mapping[int, pl.DataFrame], sample: SampleRecord) -> pl.DataFrame:
    frame = ready.get(sample.sample_id)
    return sample_history(sample) if frame is None else frame


def samples_frame(
    samples: Sequence[SampleRecord], rows: Sequence[int] | None = None
) -> pl.DataFrame:
    """One row per record (sample or step record).

    Args:
        samples: The records, in order.
        rows: How many rows each has, where the records no longer hold them (the writer lets
            them go once their frame is built); by default ``len(record.rows)``.
    """
    columns: dict[str, Sequence[object]] = {
        "run_id": [s.run_id for s in samples],
        "rank": [s.rank for s in samples],
        "sample_id": [s.sample_id for s in samples],
        "step": [s.step for s in samples],
        "timestamp": [int(s.timestamp * 1_000_000) for s in samples],
        "kind": [s.kind.value for s in samples],
        "optimizer_step": [s.optimizer_step for s in samples],
        "forward_only": [s.forward_only for s in samples],
        "collection_duration_ms": [s.collection_duration_ms for s in samples],
        "rows": [len(s.rows) for s in samples] if rows is None else rows,
        "note": [s.note for s in samples],
    }
    return _frame(columns, samples_schema())


def _frame(columns: Mapping[str, Sequence[object]], schema: pl.Schema) -> pl.DataFrame:
    return _timestamps(_raw_frame(columns, schema))


def _raw_frame(columns: Mapping[str, Sequence[object]], schema: pl.Schema) -> pl.DataFrame:
    """The frame with ``schema``, except ``timestamp``: integer microseconds since the epoch."""
    import polars as pl

    raw = {name: pl.Int64() if name == "timestamp" else dtype for name, dtype in schema.items()}
    return pl.DataFrame(columns, schema=raw)


def _timestamps(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` with its integer ``timestamp`` column made UTC datetimes (microseconds)."""
    import polars as pl

    return frame.with_columns(
        pl.from_epoch("timestamp", time_unit="us").dt.replace_time_zone("UTC")
    )
