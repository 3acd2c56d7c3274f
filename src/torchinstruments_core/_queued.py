"""The job of one small sample's tensor on the kernels' queue, which fills its measurement in.

``Measurer`` hands a small sample's CPU tensors to the kernels' reduction queue
(``NativeWorker.submit_copy``); each goes with a ``QueuedFill``, which the worker reads back once
the kernels' thread has run it, on the thread that settles or measures, and which fills the
tensor's ``Measurement`` in from what the kernels wrote, or, where they did not finish, through
the measurer's reducers on the copy the job read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from torchinstruments_core._measurement import forget_frames
from torchinstruments_core._native_worker import ProfileJob
from torchinstruments_core.reducers import PreparedTensor, _native

if TYPE_CHECKING:
    from torchinstruments_core._measure import Measurer
    from torchinstruments_core._measurement import Measurement
    from torchinstruments_core.reducers._fused import FusedReductions, _Call
    from torchinstruments_core.reducers.base import IndexCache

CPU = torch.device("cpu")
"""The device of everything the kernels' queue reads."""


class QueuedFill(ProfileJob):
    """A tensor's job on the kernels' queue, which fills its measurement in once it has run.

    Read back on the thread that settles or measures (``ProfileJob.complete``). Where the
    kernels finished (``STATUS_OK``, nearly every tensor) their values go in as they are;
    otherwise ``FusedReductions.finish`` completes them (the moments on the host), or the
    reducers run on the copy the job read, with the same subsample positions (``cpu_seed``).
    The job itself, not closures around it: a small sample makes one per tensor, in its hooks.
    """

    __slots__ = ("_cache", "_measurement", "_measurer", "_source_dtype", "_with_histogram")

    def __init__(
        self,
        measurer: Measurer,
        measurement: Measurement,
        values: torch.Tensor | None,
        seed: int | None,
        call: _Call,
        cache: IndexCache,
        source_dtype: torch.dtype,
        with_histogram: bool,
    ) -> None:
        super().__init__(values, seed, call)
        self._measurer = measurer
        self._measurement = measurement
        self._cache = cache
        self._source_dtype = source_dtype
        self._with_histogram = with_histogram

    def read_back(self, queued: _native.Queued) -> None:
        """Fill the measurement in from what the job wrote (``queued.values``, the kernels')."""
        measurer, out = self._measurer, queued.values
        fusion = measurer._fused
        assert fusion is not None, "only the kernels' jobs are read back here"
        if queued.status != _native.STATUS_OK:
            self._finish_otherwise(fusion, queued.profiled())
            return
        call, measurement = self._call, self._measurement
        results, histogram, edges = fusion.values(out.tolist(), call)
        measurer._fused_into(
            measurement, call.numel, results, histogram, edges, out.dtype == np.float64
        )
        measurement.summary = queued.numbers

    def _finish_otherwise(self, fusion: FusedReductions, profiled: _native.Profiled) -> None:
        """The kernels did not finish: the moments on the host, or the reducers on the copy."""
        measurer, measurement, values = self._measurer, self._measurement, self._values
        assert values is not None, "a job is read back before it lets its values go"
        try:
            fused = fusion.finish(profiled, self._call, self._prepared)
        except Exception:  # the reducers run instead, and report what fails
            fused = None
        if fused is not None:
            measurer._fused_into(
                measurement,
                self._call.numel,
                fused.results,
                fused.histogram,
                fused.edges,
                fused.float64,
            )
            return
        with_histogram, cache = self._with_histogram, self._cache
        # ``_fill`` gives a custom reducer's view of the copy storage of its own
        measurer._fill(values, measurement, with_histogram, cache, self._source_dtype, fused=False)
        for error in measurement.errors:  # their frames would keep it alive too
            forget_frames(error)

    def _prepared(self) -> PreparedTensor:
        assert self._values is not None, "a job is read back before it lets its values go"
        return PreparedTensor(self._values, self._measurer._generator(CPU), self._cache)
