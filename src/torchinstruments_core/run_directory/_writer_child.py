"""The writer process's side: open the run's writer, write each sample, report at the end.

Started by ``_writer_process.ProcessWriter`` with ``python -c``; it imports no torch (nor the
engine), only this package's writing modules. It ignores SIGINT and SIGTERM (the training
process closes the run), runs at a niceness ``NICENESS`` above the training process's, and
when its pipe closes without a ``finish`` (the training process died) it writes what it holds
as a last chunk and exits, leaving the run to ``repair``. On Linux it is a ``SCHED_BATCH``
process: the write of a sample that wakes it never has it preempt the training thread at once
(on an MNIST-sized MLP's sampled steps, 0.015-0.05x less at the median; ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
from typing import TYPE_CHECKING, BinaryIO

from torchinstruments_core.run_directory._aggregate import RunAggregates
from torchinstruments_core.run_directory._tensorboard import TensorBoardHistograms
from torchinstruments_core.run_directory._writer import ChunkWriter, cause
from torchinstruments_core.run_directory._writer_pipe import (
    SAMPLE_TAG,
    decode,
    read_frame,
    receive,
    send,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchinstruments_core.run_directory._writer_pipe import WriterSettings

NICENESS = 10
"""Added to the writer process's niceness: its work can wait, the training step cannot."""


def serve(read_fd: int, write_fd: int) -> None:
    """The writer process: open the run's writer, take samples until told to finish."""
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):  # no nice on Windows
        os.nice(NICENESS)  # where the cores are busy, training and its reductions go first
    with contextlib.suppress(OSError, AttributeError):  # Linux only
        # a batch process: woken by a sample, it never preempts the training thread at once
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    incoming = open(read_fd, "rb")  # noqa: SIM115
    outgoing = open(write_fd, "wb")  # noqa: SIM115
    lock = threading.Lock()

    def reply(content: object) -> None:
        with lock:
            send(outgoing, content)

    opening = receive(incoming)
    if opening is None:
        return
    settings: WriterSettings = opening[1]
    try:
        writer, histograms, aggregates = _open(settings, reply)
    except Exception as error:
        reply(("failed", cause(error)))
        return
    reply(("ready",))
    finished = _take_samples(incoming, writer, reply)
    report = writer.finish()
    if histograms is not None:
        try:
            histograms.close()
        except Exception as error:
            report.losses.note(f"the TensorBoard histograms could not be closed ({cause(error)})")
    if finished:
        reply(("done", report, aggregates))


def _open(
    settings: WriterSettings, reply: Callable[[object], None]
) -> tuple[ChunkWriter, TensorBoardHistograms | None, RunAggregates]:
    histograms = (
        TensorBoardHistograms(settings.layout.tensorboard, settings.run)
        if settings.tensorboard
        else None
    )
    aggregates = RunAggregates()
    writer = ChunkWriter(
        settings.layout,
        chunk_rows=settings.chunk_rows,
        flush_seconds=settings.flush_seconds,
        queue_size=settings.queue_size,
        on_sample=[histograms] if histograms is not None else [],
        on_written=[aggregates.add],
        on_chunk=lambda samples: reply(("written", samples)),
    )
    writer.start()
    return writer, histograms, aggregates


def _take_samples(incoming: BinaryIO, writer: ChunkWriter, reply: Callable[[object], None]) -> bool:
    """Hand each sample to the writer; whether the training process asked to finish."""
    while True:
        payload = read_frame(incoming)
        if payload is None:
            return False  # the training process is gone: write what we hold and exit
        if payload.startswith(SAMPLE_TAG):
            sample = decode(payload[len(SAMPLE_TAG) :])
            try:
                writer.put(sample)
            except OSError as error:
                reply(("error", str(error)))
            del sample
            continue
        if pickle.loads(payload)[0] == "finish":
            return True
