"""``RunDirectorySink``: Parquet history, result.json, index.md, written off the training thread."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchinstruments_core._config import check_positive_int
from torchinstruments_core._exceptions import ConfigurationError
from torchinstruments_core.run_directory._aggregate import RunAggregates
from torchinstruments_core.run_directory._index import write_index
from torchinstruments_core.run_directory._layout import (
    RunLayout,
    layout_for,
    refuse_existing,
    temporary_sibling,
)
from torchinstruments_core.run_directory._result import write_result
from torchinstruments_core.run_directory._tables import history_schema, samples_schema
from torchinstruments_core.run_directory._tensorboard import TensorBoardHistograms
from torchinstruments_core.run_directory._writer import ChunkWriter, WriterReport

if TYPE_CHECKING:
    from torchinstruments_core._records import RunInfo, SampleRecord

logger = logging.getLogger(__name__)


class RunDirectorySink:
    """Writes a run directory: Parquet history, result.json, index.md and TensorBoard histograms.

    ::

        <output_dir>/                 (or <output_dir>/rank-NNN/ under rank_policy="all")
            history.parts/*.parquet   immutable chunks, readable while the run goes on
            history.parquet           every chunk, compacted when the run ends
            samples.parquet           one row per sample
            result.json               aggregates (the layer catalog until the run ends)
            index.md                  schema, sampling policy, module catalog, ready queries
            tensorboard/              histograms and a few scalars of the focus layers

    A sample goes from the training thread to a bounded queue; a background thread writes chunks
    (atomically: temporary file, then rename), so a run killed at any moment leaves every completed
    chunk readable and at most ``flush_seconds`` of samples unwritten. ``output_dir`` must not
    already hold a run (``RunDirectoryExistsError``): a new run never overwrites an old one.

    Args:
        output_dir: The run's folder; created when the first sample is taken.
        chunk_rows: Rows per chunk (bounds the writer's memory).
        flush_seconds: Longest time a finished sample waits in memory before reaching disk.
        queue_size: Samples that may wait for the writer before the training thread blocks.
        tensorboard: Write the focus layers' histograms to ``tensorboard/``.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        *,
        chunk_rows: int = 200_000,
        flush_seconds: float = 30.0,
        queue_size: int = 64,
        tensorboard: bool = True,
    ) -> None:
        self.output_dir = Path(output_dir)
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise ConfigurationError.invalid("output_dir", str(output_dir), "a directory path")
        refuse_existing(self.output_dir)
        self._chunk_rows = check_positive_int("chunk_rows", chunk_rows, minimum=1)
        self._queue_size = check_positive_int("queue_size", queue_size, minimum=1)
        if not flush_seconds > 0:
            raise ConfigurationError.invalid("flush_seconds", flush_seconds, "a number > 0")
        self._flush_seconds = float(flush_seconds)
        self._tensorboard_enabled = tensorboard
        self.layout: RunLayout | None = None
        self._run: RunInfo | None = None
        self._writer: ChunkWriter | None = None
        self._tensorboard: TensorBoardHistograms | None = None
        self._aggregates = RunAggregates()

    def open(self, run: RunInfo) -> None:
        """Create the run folder, write the catalog and start the writer thread."""
        self._run = run
        self.layout = layout_for(self.output_dir, rank=run.rank, per_rank=run.rank_policy == "all")
        if self._tensorboard_enabled:
            self._tensorboard = TensorBoardHistograms(self.layout.tensorboard)
        write_result(self.layout.result, run, None, status="running")
        write_index(self.layout.index, run, status="running")
        self._writer = ChunkWriter(
            self.layout,
            chunk_rows=self._chunk_rows,
            flush_seconds=self._flush_seconds,
            queue_size=self._queue_size,
            on_sample=[self._aggregates.add, *([self._tensorboard] if self._tensorboard else [])],
        )
        self._writer.start()

    def write(self, sample: SampleRecord) -> None:
        """Queue the sample for the writer thread (blocks only while the queue is full)."""
        if self._writer is None:
            raise RuntimeError("RunDirectorySink.write called before open")
        self._writer.put(sample)

    def close(self) -> None:
        """Write the last chunk, compact the history, write result.json and index.md.

        Raises:
            OSError: Some samples could not be written; the message lists them. Everything that
                could be written has been.
        """
        if self._writer is None or self.layout is None or self._run is None:
            return
        report = self._writer.finish()
        self._writer = None
        if self._tensorboard is not None:
            self._tensorboard.close()
        self._finalize(self.layout, self._run, report)
        if report.lost:
            raise OSError("; ".join(report.lost))

    def _finalize(self, layout: RunLayout, run: RunInfo, report: WriterReport) -> None:
        if report.chunks:
            logger.info("torchinstruments: compacting %d chunks in %s", report.chunks, layout.root)
        compact(layout.parts, "history", layout.history, history_schema())
        compact(layout.parts, "samples", layout.samples, samples_schema())
        write_result(layout.result, run, self._aggregates, status="complete")
        write_index(layout.index, run, status="complete")
        shutil.rmtree(layout.parts, ignore_errors=True)

    def __repr__(self) -> str:
        return f"RunDirectorySink({str(self.output_dir)!r})"


def compact(parts: Path, table: str, target: Path, schema: Any) -> None:
    """Stream every chunk of ``table`` into ``target`` (bounded memory), atomically."""
    import polars as pl

    chunks = sorted(parts.glob(f"{table}-*.parquet"))
    temporary = temporary_sibling(target)
    if chunks:
        pl.scan_parquet(chunks, schema=schema).sink_parquet(temporary)
    else:
        pl.DataFrame(schema=schema).write_parquet(temporary)
    os.replace(temporary, target)
