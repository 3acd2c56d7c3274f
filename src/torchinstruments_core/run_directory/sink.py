"""``RunDirectorySink``: Parquet history, result.json, index.md, written off the training thread."""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from typing import TYPE_CHECKING

from torchinstruments_core._config import check_positive_int
from torchinstruments_core._exceptions import ConfigurationError
from torchinstruments_core.run_directory._aggregate import RunAggregates
from torchinstruments_core.run_directory._claim import (
    claim_folder,
    lock_folder,
    release_folder,
    unlock_folder,
)
from torchinstruments_core.run_directory._finalize import (
    commit,
    compact,
    compact_tables,
    remove_parts,
)
from torchinstruments_core.run_directory._index import write_index
from torchinstruments_core.run_directory._layout import (
    REPAIR_COMMAND,
    RunLayout,
    layout_for,
    prepare_output_dir,
)
from torchinstruments_core.run_directory._repair import fold_tables
from torchinstruments_core.run_directory._result import write_result
from torchinstruments_core.run_directory._state import RunStatus
from torchinstruments_core.run_directory._tensorboard import TensorBoardHistograms
from torchinstruments_core.run_directory._writer import ChunkWriter, WriterReport, cause
from torchinstruments_core.run_directory._writer_pipe import WriterSettings
from torchinstruments_core.run_directory._writer_process import ProcessWriter

if TYPE_CHECKING:
    from torchinstruments_core._records import RunInfo, SampleRecord

__all__ = ["RunDirectorySink", "compact"]

logger = logging.getLogger(__name__)

_open_sinks: weakref.WeakSet[RunDirectorySink] = weakref.WeakSet()
_FATAL = (KeyboardInterrupt, SystemExit, GeneratorExit)
_WRITERS = ("process", "thread")


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
    chunk readable and at most ``flush_seconds`` of samples unwritten.

    Checked when the sink is made (at injection, before training starts): ``output_dir`` is made
    absolute (a later ``os.chdir`` does not move the run), created, and probed with a temporary
    file (``ConfigurationError`` if it cannot be); it must not hold a run or any name a run
    writes, links included (``RunDirectoryExistsError``); and no other sink of this process may
    hold it. Across processes the folder is locked when the run opens (its first sample).

    Only the process that opened the run writes and finalizes it: in a process forked from it
    (a ``DataLoader`` worker, ``os.fork()``), ``write`` and ``close`` do nothing.

    Nothing is lost silently: every sample is either in the history or counted in ``lost`` in
    result.json (status ``complete_with_losses``), and ``close`` raises ``OSError`` saying how
    many samples and rows were lost and why. A writer thread that dies is never waited on.

    Args:
        output_dir: The run's folder.
        chunk_rows: Rows per chunk (bounds the writer's memory, also while writes fail).
        flush_seconds: Longest time a finished sample waits in memory before reaching disk, and
            the interval between retries of a chunk that could not be written.
        queue_size: Samples that may wait for the writer before the training thread blocks.
        tensorboard: Write the focus layers' histograms to ``tensorboard/``.
        writer: ``"process"`` (the default): a process of its own writes the chunks, the
            TensorBoard file and the aggregates, so that the writer never holds the training
            process's GIL (``_writer_process``); if it cannot start, a thread writes instead,
            with a warning. ``"thread"``: a thread of the training process writes.

    Attributes:
        report: After ``close``: chunks, samples and rows written, and ``losses``.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        *,
        chunk_rows: int = 200_000,
        flush_seconds: float = 30.0,
        queue_size: int = 64,
        tensorboard: bool = True,
        writer: str = "process",
    ) -> None:
        self._chunk_rows = check_positive_int("chunk_rows", chunk_rows, minimum=1)
        self._queue_size = check_positive_int("queue_size", queue_size, minimum=1)
        if not flush_seconds > 0:
            raise ConfigurationError.invalid("flush_seconds", flush_seconds, "a number > 0")
        self._flush_seconds = float(flush_seconds)
        self._tensorboard_enabled = tensorboard
        if writer not in _WRITERS:
            raise ConfigurationError.invalid("writer", writer, " or ".join(map(repr, _WRITERS)))
        self._writer_kind = writer
        self.output_dir = prepare_output_dir(output_dir)
        claim_folder(self.output_dir, self)
        self.layout: RunLayout | None = None
        self.report: WriterReport | None = None
        self._run: RunInfo | None = None
        self._writer: ChunkWriter | ProcessWriter | None = None
        self._tensorboard: TensorBoardHistograms | None = None
        self._aggregates = RunAggregates()
        self._refold = False  # the aggregates are to be read back from the compacted tables
        self._owner_pid: int | None = None
        self._inherited = False  # set in a forked child, where this sink must do nothing
        self._lock: int | None = None

    def open(self, run: RunInfo) -> None:
        """Create the run folder, lock it, write the catalog and start the writer thread."""
        self._run = run
        layout = layout_for(self.output_dir, rank=run.rank, per_rank=run.rank_policy == "all")
        self._lock = lock_folder(layout.root)
        self.layout = layout
        self._owner_pid = os.getpid()
        _open_sinks.add(self)
        write_result(layout.result, run, None, status=RunStatus.RUNNING)
        write_index(layout.index, run, status=RunStatus.RUNNING)
        if self._writer_kind == "thread":
            self._writer = self._thread_writer()
            return
        settings = WriterSettings(
            layout,
            run,
            chunk_rows=self._chunk_rows,
            flush_seconds=self._flush_seconds,
            queue_size=self._queue_size,
            tensorboard=self._tensorboard_enabled,
        )
        self._writer = ProcessWriter(settings, in_process=self._thread_writer)
        self._writer.start()

    def _thread_writer(self) -> ChunkWriter:
        """A started writer thread of this process, with the sink's TensorBoard file."""
        assert self.layout is not None
        assert self._run is not None
        if self._tensorboard_enabled:
            self._tensorboard = TensorBoardHistograms(self.layout.tensorboard, self._run)
        writer = ChunkWriter(
            self.layout,
            chunk_rows=self._chunk_rows,
            flush_seconds=self._flush_seconds,
            queue_size=self._queue_size,
            on_sample=[self._tensorboard] if self._tensorboard else [],
            on_written=[self._aggregates.add],
        )
        writer.start()
        return writer

    @property
    def writer_pid(self) -> int | None:
        """The id of the writer process while the run is open; ``None`` when a thread writes."""
        writer = self._writer
        if isinstance(writer, ProcessWriter) and not writer.in_process:
            return writer.pid
        return None

    def write(self, sample: SampleRecord) -> None:
        """Queue the sample for the writer thread (blocks only while the queue is full)."""
        if self._inherited:
            return
        if self._writer is None:
            raise RuntimeError("RunDirectorySink.write called before open")
        self._writer.put(sample)

    def close(self) -> None:
        """Write the last chunk, compact the history, write index.md and result.json.

        Does nothing in a process other than the one that opened the run.

        Raises:
            OSError: Some samples were lost (the message counts them and says why), or the run
                could not be finalized (its chunks are intact; the message gives the repair
                command). Everything that could be written has been.
        """
        if self._owner_pid is not None and self._owner_pid != os.getpid():
            return  # a forked copy: the parent's run is not ours to touch
        release_folder(self.output_dir, self)
        writer, self._writer = self._writer, None
        if writer is None or self.layout is None or self._run is None:
            return
        try:
            self._close(writer, self.layout, self._run)
        except _FATAL:
            raise
        except Exception:
            raise
        except BaseException as error:  # a Polars panic must not escape into training
            raise RuntimeError(f"finalizing {self.layout.root} failed: {error!r}") from error
        finally:
            unlock_folder(self._lock)
            self._lock = None
            _open_sinks.discard(self)

    def _close(self, writer: ChunkWriter | ProcessWriter, layout: RunLayout, run: RunInfo) -> None:
        self.report = report = writer.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if isinstance(writer, ProcessWriter):
            if writer.aggregates is not None:
                self._aggregates = writer.aggregates
            self._refold = writer.died  # its aggregates died with it: fold what it wrote
        if report.chunks:
            logger.info("torchinstruments: compacting %d chunks in %s", report.chunks, layout.root)
        self._finalize(layout, run, report)
        if report.losses:
            raise OSError(f"{layout.root}: {report.losses.describe()}")

    def _finalize(self, layout: RunLayout, run: RunInfo, report: WriterReport) -> None:
        losses = report.losses
        status = RunStatus.COMPLETE_WITH_LOSSES if losses else RunStatus.COMPLETE
        try:
            compact_tables(layout)
            if self._refold:
                self._aggregates = fold_tables(layout)
            commit(layout, run, self._aggregates, status=status, lost=losses.as_json())
        except _FATAL:
            raise
        except BaseException as error:  # a Polars panic too: the chunks are still intact
            self._unfinalized(layout, run, report, error)
        remove_parts(layout)

    def _unfinalized(
        self, layout: RunLayout, run: RunInfo, report: WriterReport, error: BaseException
    ) -> None:
        losses = report.losses
        losses.note(f"finalizing failed ({cause(error)})")
        # The chunks stay authoritative; say so if the disk allows (else "running" says the same).
        with contextlib.suppress(Exception):
            write_result(
                layout.result,
                run,
                self._aggregates,
                status=RunStatus.NEEDS_REPAIR,
                lost=losses.as_json(),
            )
        raise OSError(
            f"{layout.root} could not be finalized ({type(error).__name__}: {error}); its chunks "
            f"in history.parts are intact: complete it with `{REPAIR_COMMAND} {layout.root}`"
            + (f". Besides, {losses.describe()}" if losses.samples else "")
        ) from error

    def __repr__(self) -> str:
        return f"RunDirectorySink({str(self.output_dir)!r})"


def _inherit_after_fork() -> None:
    for sink in list(_open_sinks):
        sink._inherited = True


os.register_at_fork(after_in_child=_inherit_after_fork)
