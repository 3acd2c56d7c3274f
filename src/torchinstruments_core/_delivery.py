"""The delivery queue: closed samples whose values are crossing to the host, then the sink.

A closed sample starts its device-to-host transfer at once (asynchronous on CUDA) and waits here.
A drain delivers, in closing order, every sample whose transfer has landed (or all of them, when
told to wait): it builds the ``SampleRecord`` and hands it to the sink. Only the process that
created the queue delivers: a child made by ``fork`` never writes into the parent's run.
"""

from __future__ import annotations

import collections
import os
import time
from typing import TYPE_CHECKING

from torchinstruments_core._process import handing_over

if TYPE_CHECKING:
    import threading

    from torchinstruments_core._rank_gate import RankGate
    from torchinstruments_core._sample import Sample
    from torchinstruments_core._sink_session import SinkSession
    from torchinstruments_core._transfer import HostTransfer


class DeliveryQueue:
    """Owns the transfers in flight and their delivery to the sink, in the order samples closed.

    Args:
        lock: The observer's re-entrant lock; sink writes happen while it is held, so that a
            sample closing in another thread waits for the delivery in progress.
        sink: Where the records go.
        run_id: Written into every record.
        gate: Tells each record's rank.
    """

    __slots__ = ("_draining", "_gate", "_in_flight", "_lock", "_pid", "_run_id", "_sink")

    def __init__(
        self, lock: threading.RLock, sink: SinkSession, run_id: str, gate: RankGate
    ) -> None:
        self._lock = lock
        self._sink = sink
        self._run_id = run_id
        self._gate = gate
        self._pid = os.getpid()  # only this process delivers samples
        # each closed sample, with its transfer (``None``: its settle was interrupted, ``push``)
        self._in_flight: collections.deque[tuple[Sample, HostTransfer | None]] = collections.deque()
        self._draining = False

    def push(self, sample: Sample) -> None:
        """Start moving ``sample``'s values to the host and queue it for delivery.

        A ``KeyboardInterrupt`` while it waits for the CPU reduction worker (a Ctrl-C at the end
        of a sampled backward, where the training thread waits) still queues it: the next
        drain settles it, the worker having run its jobs meanwhile, and delivers it in its
        turn.
        """
        started = time.perf_counter()
        try:
            error = sample.settle()  # waits for the CPU reduction worker's jobs of this sample
        except KeyboardInterrupt:
            with self._lock:
                self._in_flight.append((sample, None))
            raise
        transfer = sample.start_transfer()
        sample.duration_s += time.perf_counter() - started
        with self._lock:
            self._in_flight.append((sample, transfer))
        if error is not None:  # raised only now: the sample is queued, its values delivered
            raise error

    def drain(self, *, wait: bool) -> None:
        """Deliver the samples whose values have landed; with ``wait``, every queued sample."""
        # nothing queued (every unsampled step): no lock. Not when waiting: another thread may
        # have taken the last sample off the queue and be writing it, under the lock.
        if not wait and not self._in_flight:
            return
        deferred: Exception | None = None  # a settle's error, raised once delivered (``push``)
        # a SIGTERM meanwhile finalizes once the lock is let go (``handing_over``)
        with handing_over(), self._lock:
            if self._draining:
                return  # a sink write re-entered the observer; the outer drain delivers
            self._draining = True
            try:
                while self._in_flight:
                    sample, transfer = self._in_flight[0]
                    if transfer is None:  # its settle was interrupted (``push``): again now
                        try:
                            deferred = sample.settle() or deferred
                            transfer = sample.start_transfer()
                        except Exception:  # it cannot be settled: dropped, as ``push`` drops it
                            self._in_flight.popleft()
                            raise
                        self._in_flight[0] = (sample, transfer)
                    if not wait and not transfer.ready():
                        break
                    self._in_flight.popleft()
                    self._deliver(sample, transfer)
            finally:
                self._draining = False
        if deferred is not None:
            raise deferred

    def abandon(self, lock: threading.RLock) -> None:
        """Drop every queued sample and use ``lock`` from now on (in a child made by ``fork``)."""
        self._lock = lock
        self._in_flight.clear()

    def _deliver(self, sample: Sample, transfer: HostTransfer) -> None:
        if os.getpid() != self._pid:
            return  # a forked child never writes into the parent's run
        record = sample.build(transfer, run_id=self._run_id, rank=self._gate.resolve().rank)
        self._sink.write(record)
