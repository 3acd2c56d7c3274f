"""What measuring one tensor gives: a ``Measurement``, filled in now or by a worker later.

A ``Measurement`` holds each reducer's values (``ReducerResult``) as device tensors or host
floats, the histogram, and the reason a value is missing; a worker that reduces off the hooks
fills it in, and ``settle`` waits for that. Beside it: whether a tensor may be read in place
(``shareable``, asked by the probes, the sample and the measurer), the reason text of a reducer's
error (the measurer's and the step records'), and what the measurer's jobs do around a
measurement: whether its worker is done (``reduced``), a reducer's result checked (``checked``),
results that view a reused copy given storage of their own (``unalias``), and an error's frames
dropped so that they keep no copy alive (``forget_frames``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torchinstruments_core._records import UnavailableReason
from torchinstruments_core._torch_private import version

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    from numpy.typing import NDArray

    from torchinstruments_core._background import ReductionWorker
    from torchinstruments_core._native_worker import NativeWorker

_MAX_ERROR_TEXT = 200


@dataclass(slots=True)
class ReducerResult:
    """What one reducer gave for one tensor: its values, or the reason it gave none.

    The values are a tensor on the measured tensor's device, or floats on the host already
    where the compiled kernels reduced a CPU tensor (``FusedReductions``): those need no
    transfer, and reading them back from tensors cost a tensor about 25 us in torch calls.
    """

    metrics: tuple[str, ...]
    values: torch.Tensor | list[float] | None
    error: str | None = None


@dataclass(slots=True)
class Measurement:
    """The reductions of one tensor, still on its device.

    ``reason`` is set when no value exists: an ``UnavailableReason``, or a ``reducer_error: …``
    text when preparing the tensor raised (the error is then in ``errors``).
    """

    reason: str | None
    metrics: tuple[str, ...]
    n_finite: torch.Tensor | float | None = None
    """The finite entries: a 0-d device tensor, or a float on the host (as the values are)."""
    results: list[ReducerResult] = field(default_factory=list)
    histogram: torch.Tensor | list[float] | None = None
    """The packed histogram (``pack_histogram``): device tensor or host floats."""
    histogram_bins: int = 0
    histogram_float64: bool = False
    histogram_edges: list[float] | None = None
    """The histogram's edges where the compiled kernels found them with its counts; ``None``:
    they are searched when the sample's record is built."""
    errors: list[BaseException] = field(default_factory=list)
    worker: ReductionWorker | NativeWorker | None = None
    """The worker filling this measurement in (job ``ticket``); ``None`` once settled."""
    ticket: int | None = None
    finishers: list[Callable[[Measurement], None]] = field(default_factory=list)
    shared: tuple[torch.Tensor, int] | None = None
    """The tensor the worker reduces instead of a copy, and its version at the hand-over."""
    changed: Callable[[], None] | None = None
    """Called by ``let_go`` when the shared tensor changed (its values are then dropped)."""
    summary: NDArray[np.float64] | None = None
    """Where the kernels' queue reduced a finite CPU tensor (``QueuedFill``): their float64
    summary, total, squares, extremes and zeros first (``_native.Profiled.numbers``). The
    whole-model gradient row reuses a gradient's squares and zeros."""

    def then(self, finish: Callable[[Measurement], None]) -> None:
        """Call ``finish(self)`` once complete: now, or in the ``settle`` that completes it.

        Either way it runs on the thread that measured or settles, never on the worker, so it
        may warn or raise (``error_policy``).
        """
        if self.worker is None:
            finish(self)
        else:
            self.finishers.append(finish)

    def settle(self) -> Exception | None:
        """Wait for the worker to fill this measurement in, then run what ``then`` deferred.

        Every deferred call runs even if one raises (a warning turned into an error); the first
        error is returned, for the caller to raise once the sample is safe.
        """
        if self.worker is None:
            return None
        if self.ticket is not None:
            self.worker.wait(self.ticket)
        self.worker = None
        self.let_go()
        finishers, self.finishers = self.finishers, []
        first: Exception | None = None
        for finish in finishers:
            try:
                finish(self)
            except Exception as error:
                first = first or error
        return first

    def let_go(self) -> None:
        """Once the worker is done with a shared tensor: drop it, and its values if it changed.

        Call it where no torch op of the thread that runs the backward is under way (in a
        hook, or as the sample closes): an in-place change that overlapped the reductions
        has then finished, and counted in the tensor's version.
        """
        shared, self.shared = self.shared, None
        if shared is not None and version(shared[0]) != shared[1]:
            self.modified()
            if self.changed is not None:
                self.changed()

    def modified(self) -> None:
        """Drop the values: the tensor changed in place while read (``modified_in_place``)."""
        self.reason = UnavailableReason.MODIFIED_IN_PLACE
        self.n_finite, self.histogram, self.histogram_edges = None, None, None
        self.summary = None
        self.results.clear()
        self.errors.clear()  # a reducer that choked on entries changing under it did not fail


def shareable(tensor: torch.Tensor, *, groups: bool | None = None) -> bool:
    """Whether any in-place change of ``tensor`` would move its version (``Measurer.measure``).

    Not a wrapper subclass (a ``DTensor``'s ops move its own version, not its local tensor's),
    a nested tensor or an inference tensor (which has no version), and not once a process
    group is up: a collective (a tensor-parallel ``all_reduce`` of a gradient in its
    ``backward``) writes into a tensor without moving its version. ``groups``: whether one is
    up, if the caller knows (``process_groups_up``), else asked here.
    """
    return (
        type(tensor) is torch.Tensor
        and not tensor.is_nested
        and not tensor.is_inference()
        and not (process_groups_up() if groups is None else groups)
    )


def process_groups_up() -> bool:
    """Whether a default process group is up (``torch.distributed`` initialized)."""
    return dist.is_available() and dist.is_initialized()


def reducer_error_reason(error: BaseException) -> str:
    """The ``unavailable_reason`` of a value whose reducer raised."""
    text = f"{UnavailableReason.REDUCER_ERROR}: {type(error).__name__}: {error}"
    return text[:_MAX_ERROR_TEXT]


def reduced(measurement: Measurement) -> bool:
    """Whether the worker filling ``measurement`` in has done so (or none was given it)."""
    worker = measurement.worker
    return worker is None or worker.done(measurement.ticket)


def checked(values: object, size: int) -> torch.Tensor:
    """A reducer's result as the flat plain tensor the host transfer can read, or raise why not.

    A wrong result found here costs its reducer's values; found in the transfer, it would cost
    the whole sample, raised inside the user's backward.
    """
    if type(values) is not torch.Tensor:
        raise TypeError(f"a reducer returned {type(values).__name__}, not a plain torch.Tensor")
    if values.is_meta or values.dtype.is_complex or values.layout != torch.strided:
        raise TypeError(
            f"a reducer returned a {values.dtype} {values.layout} tensor on {values.device}"
        )
    if values.numel() != size:
        raise ValueError(f"a reducer returned {values.numel()} values for {size} metrics")
    # a torch call releases the GIL on the worker (``_host.host_values``): none where not needed
    return values if values.dim() == 1 else values.reshape(-1)


def forget_frames(error: BaseException) -> None:
    """Drop the tracebacks of ``error`` and of the errors it was raised from or during."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.with_traceback(None)
        pending += [current.__cause__, current.__context__]


def unalias(measurement: Measurement, buffer: torch.Tensor) -> None:
    """Give the results that are views of ``buffer`` storage of their own.

    A reducer may return a slice of its input, and before the results are read the buffer is
    reused for later copies, or the tensor read where it is changes (a gradient, a step
    record's copy of a parameter once its update is formed in it).
    """
    storage = buffer.untyped_storage()
    start, end, device = storage.data_ptr(), storage.data_ptr() + storage.nbytes(), buffer.device

    def own(values: torch.Tensor) -> torch.Tensor:
        # one pointer a result (what the hooks pay for every tensor): in the buffer's memory?
        inside = start <= values.data_ptr() < end and values.device == device
        return values.clone() if inside else values

    # host floats (the kernels' values) view no buffer: only tensors may need a copy
    for result in measurement.results:
        if isinstance(result.values, torch.Tensor):
            result.values = own(result.values)
    if isinstance(measurement.histogram, torch.Tensor):
        measurement.histogram = own(measurement.histogram)
    if isinstance(measurement.n_finite, torch.Tensor):
        measurement.n_finite = own(measurement.n_finite)
