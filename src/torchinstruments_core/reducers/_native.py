"""The compiled CPU reductions (``_kernels.c``): whether they are there, and the calls into them.

On the CPU the default profile's work for one tensor (sums, extremes, zeros, the quartiles'
order statistics, the histogram, and the values the built-in reducers make of them: ``profile``)
is one call into ``_kernels``, which releases the GIL for all of it; so is drawing the
quartiles' subsample positions (``draw_positions``). Where POSIX threads are (not on Windows),
the kernels also have a reduction queue: ``submit_profile`` hands a ``profile`` to a thread of
theirs that never takes the GIL (``_native_worker``). The extension is optional: a build
without a C compiler has none, and ``TORCHINSTRUMENTS_NATIVE=0`` in the environment (read at
import) leaves it unused. Without it the same statistics come from numpy and torch (``_host``,
``_host_binning``, ``_select``):
histograms, extremes, zero counts and quartiles bit for bit the same, sums (and so mean, std,
rms and l2_norm) within their rounding (per-lane double sums here, blocked float32 sums there).

Every function here takes a flat float32 or float64 CPU tensor (``usable``) and never keeps it;
it reads a contiguous one in place and a strided one (a 1-D view with a step) from a contiguous
copy.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from torchinstruments_core.reducers import _compiled
from torchinstruments_core.reducers._compiled import ENVIRONMENT_SWITCH as ENVIRONMENT_SWITCH

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

    from numpy.typing import NDArray

    from torchinstruments_core.reducers.functional import QuantilePlan

STATUS_OK = 0
STATUS_NONFINITE = 1
"""A sum is not finite: an entry is NaN or infinite, or (float64) the entries overflow a sum."""
STATUS_BIN_OVERFLOW = 2
"""The grid's rounding put an entry past the last bin (millions of bins; see ``_host_binning``)."""
STATUS_MOMENTS_ON_HOST = 4
"""``profile``: the moments are left to ``functional.host_moment_values`` (the rest is written):
squares that need scaling (a mean large against the spread takes its second pass in ``profile``
since layout 4)."""

_DTYPES = {torch.float32: 0, torch.float64: 1}
_NO_RANKS = np.empty(0, dtype=np.int64)
_SUMMARY = 5
"""Leading values of ``reduce``'s output: total, squares, lo, hi, zeros."""
_GRID = 4
"""Trailing values of ``reduce``'s output with a histogram: the grid's lo, hi, half_lo, scale."""
MOMENTS = 9
"""Leading values of ``profile``'s: ``moments``' nine (``functional.MOMENT_METRICS``)."""
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}
_NO_TABLE = np.empty(0, dtype=np.float64)


KERNELS: ModuleType | None = _compiled.KERNELS
"""The compiled module, or ``None`` (not built, or switched off)."""


def usable(values: torch.Tensor) -> bool:
    """Whether the kernels are there and can read ``values``.

    That is a plain (not a subclass) float32 or float64 CPU tensor without a lazy negation,
    with memory behind it at an address aligned to its dtype; what ``PreparedTensor.values``
    is for nearly every plain CPU tensor it prepares. Not a zero tensor (autograd's
    ``_efficientzerotensor``, which has no memory: its address is 0), nor a view at an odd
    byte offset (``torch.frombuffer``), which the compiled loops may not read.
    """
    if KERNELS is None or type(values) is not torch.Tensor or values.dtype not in _DTYPES:
        return False
    if not values.is_cpu or values.is_neg() or values._is_zerotensor():
        return False
    address = values.data_ptr()
    return address != 0 and address % values.element_size() == 0


def _dense(values: torch.Tensor) -> torch.Tensor:
    """``values`` in contiguous memory, as the kernels read it: itself, or a copy if strided."""
    return values if values.is_contiguous() else values.contiguous()


class Reduced(NamedTuple):
    """What ``reduce`` gives for one tensor."""

    status: int
    """``STATUS_OK``, ``STATUS_NONFINITE`` (only the sums are set) or ``STATUS_BIN_OVERFLOW``."""
    total: float
    squares: float
    lo: float
    hi: float
    zeros: int
    ordered: list[float]
    """The entries at the ranks asked for, in the order asked (ascending)."""
    grid: list[float]
    """The histogram grid's lo, hi, half_lo and scale (exact values of the working dtype)."""
    counts: NDArray[np.int64] | None
    """``bins + 1`` counts: each bin's, then the max's bucket (to be folded into the last)."""


def reduce(
    values: torch.Tensor,
    index: torch.Tensor | None,
    size: int,
    ranks: NDArray[np.int64],
    bins: int,
) -> Reduced:
    """One pass for the summary, the order statistics of a subsample, a pass for the bins.

    Args:
        values: A ``usable`` tensor of at least one entry.
        index: Positions of the subsample (int64, contiguous), or ``None`` for the first
            ``size`` entries (all of them when ``size`` is ``values.numel()``).
        size: Entries in the subsample; 0 for no order statistics.
        ranks: Ascending ranks in ``[0, size)`` of the sorted subsample to return.
        bins: Histogram bins over ``[min, max]``; 0 for no histogram.
    """
    assert KERNELS is not None, "reduce needs the compiled kernels (check usable first)"
    values = _dense(values)
    count = ranks.size if size else 0
    out = np.empty(_SUMMARY + count + _GRID, dtype=np.float64)
    counts = np.empty(bins + 1, dtype=np.int64) if bins else None
    status = KERNELS.reduce(
        values.data_ptr(),
        values.numel(),
        _DTYPES[values.dtype],
        0 if index is None else index.data_ptr(),
        size,
        ranks.ctypes.data,
        count,
        bins,
        out.ctypes.data,
        0 if counts is None else counts.ctypes.data,
    )
    numbers = out.tolist()
    return Reduced(
        status,
        numbers[0],
        numbers[1],
        numbers[2],
        numbers[3],
        int(numbers[4]),
        numbers[_SUMMARY : _SUMMARY + count],
        numbers[_SUMMARY + count :],
        counts,
    )


def ratio_sum(
    gradient: torch.Tensor, second: torch.Tensor, correction: float, floor: float
) -> float:
    """The sum of ``gradient**2 / max(second / correction, floor)`` over the entries, in float64.

    One pass over both tensors with the GIL released, reading contiguous ones in place (a
    strided one from a contiguous copy, which ``_step_math.adam_ratio`` leaves to torch), and
    no temporary: torch's expression makes three the size of the tensor, each fresh memory the
    first touch of which faults its pages in. Each entry is ``g**2 * correction / max(v, floor *
    correction)``, the same quotient rounded once per operation in float64.

    Args:
        gradient: A ``usable`` tensor.
        second: A ``usable`` tensor of ``gradient``'s dtype and number of entries.
        correction: The second moment's bias correction, above 0.
        floor: The smallest ``second / correction`` divided by (``eps**2``), at least 0.
    """
    assert KERNELS is not None, "ratio_sum needs the compiled kernels (check usable first)"
    assert gradient.dtype == second.dtype, "ratio_sum reads two tensors of one dtype"
    assert gradient.numel() == second.numel(), "ratio_sum reads two tensors of one size"
    gradient, second = _dense(gradient), _dense(second)
    total: float = KERNELS.ratio_sum(
        gradient.data_ptr(),
        second.data_ptr(),
        gradient.numel(),
        _DTYPES[gradient.dtype],
        float(correction),
        float(floor),
    )
    return total


def differs_here(after: torch.Tensor, before: torch.Tensor) -> bool:
    """Whether ``difference_squares`` forms ``after - before`` into ``before``.

    Both ``usable`` and contiguous, of one dtype and shape. They must not share memory either
    (the caller's: ``before`` is a parameter's copy, ``after`` the parameter), which is not
    checked here.
    """
    return (
        after.dtype == before.dtype
        and after.shape == before.shape
        and after.is_contiguous()
        and before.is_contiguous()
        and usable(after)
        and usable(before)
    )


def difference_squares(after: torch.Tensor, before: torch.Tensor) -> float:
    """``before`` overwritten with ``after - before``; the sum of its squares, in float64.

    One pass with the GIL released where torch's ``sub`` and ``linalg.vector_norm`` make two:
    each difference is rounded to the dtype once, as torch's ``sub`` rounds it (the same
    values, bit for bit), and its square is summed in float64 (the square root is the update's
    l2 norm, as the kernels' summary gives a tensor's). A NaN or an infinite difference makes
    the sum NaN or infinite.

    Args:
        after: A ``usable`` contiguous tensor.
        before: A ``usable`` contiguous tensor of ``after``'s dtype and shape
            (``differs_here``), whose memory ``after`` does not share, written in place.
    """
    assert KERNELS is not None, "difference_squares needs the compiled kernels (check usable)"
    assert after.dtype == before.dtype, "difference_squares reads two tensors of one dtype"
    assert after.numel() == before.numel(), "difference_squares reads two tensors of one size"
    total: float = KERNELS.difference_squares(
        after.data_ptr(),
        before.data_ptr(),
        before.data_ptr(),
        before.numel(),
        _DTYPES[before.dtype],
    )
    return total


def shifted_squares(values: torch.Tensor, shift: float) -> float:
    """The sum of ``(x - shift)**2`` over the entries of ``values``, in float64.

    The moments' second pass (``functional.host_moment_values``), the loop ``profile`` runs
    where a mean is large against the spread: both give the same sum for the same tensor.

    Args:
        values: A ``usable`` tensor (read from a contiguous copy where it is strided).
        shift: The number subtracted from each entry (in float64).
    """
    assert KERNELS is not None, "shifted_squares needs the compiled kernels (check usable first)"
    values = _dense(values)
    total: float = KERNELS.shifted_squares(
        values.data_ptr(), values.numel(), _DTYPES[values.dtype], float(shift)
    )
    return total


class Profiled(NamedTuple):
    """What ``profile`` gives for one tensor."""

    status: int
    """``STATUS_OK``, ``STATUS_MOMENTS_ON_HOST``, or as ``Reduced.status`` (then only the sums
    are set, or the order statistics too)."""
    numbers: NDArray[np.float64]
    """The sums, extremes and zeros first (``summary``), then what ``reduce``'s ``out`` holds."""
    values: NDArray[np.floating]
    """In the working dtype: ``MOMENTS`` moments (unset with ``STATUS_MOMENTS_ON_HOST``), a
    quantile a level, then, if asked, the packed histogram (``_host_binning.pack_histogram``,
    ``bins + 4`` values) and its ``bins + 1`` edges, the floats ``_edges.histograms_edges``
    finds (all NaN without a finite entry): the kernels search them where they bin, off the
    thread that reads the values back."""

    def summary(self) -> tuple[float, float, float, float, int]:
        """The total, the squares, the extremes and the zeros, as ``Reduced`` has them.

        Read only where needed (the moments left to the host): a tensor the kernels finish
        needs none of them in Python.
        """
        total, squares, lo, hi, zeros = self.numbers[:_SUMMARY].tolist()
        return total, squares, lo, hi, int(zeros)


class ProfileShape(NamedTuple):
    """What a ``profile`` of one subsample size and bin count asks for, worked out once.

    Its quantile ranks and levels, and how long the buffers it writes are (``buffers``): a
    model measures a few sizes a step, and a small sample's hand-over is mostly Python.
    """

    size: int
    """Entries in the subsample; 0 for no quantiles."""
    plan: QuantilePlan | None
    """The ``quantile_plan`` of ``size`` entries; ``None`` for no quantiles."""
    bins: int
    """Histogram bins; 0 for no histogram."""
    ranks: NDArray[np.int64]
    table: NDArray[np.float64]
    numbers: int
    """Float64 entries ``profile`` writes its sums, order statistics and grid into."""
    values: int
    """Entries, in the working dtype, of its values (``Profiled.values``)."""

    def buffers(
        self, dtype: torch.dtype, *, status: bool
    ) -> tuple[NDArray[np.float64], NDArray[np.floating]]:
        """Fresh ``numbers`` and ``values`` buffers for one ``profile`` of a ``dtype`` tensor.

        With ``status``, ``numbers`` holds one float64 more, its last: where a queued job
        writes its status (``_kernels.c`` puts it right after the grid, which is where this
        one ends).
        """
        numbers = np.empty(self.numbers + status, dtype=np.float64)
        return numbers, np.empty(self.values, dtype=_NUMPY_DTYPES[dtype])


def profile_shape(size: int, plan: QuantilePlan | None, bins: int) -> ProfileShape:
    """The ``ProfileShape`` of ``size`` subsample entries (with ``plan``) and ``bins`` bins."""
    ranks, table = (_NO_RANKS, _NO_TABLE) if plan is None or not size else (plan.ranks, plan.table)
    numbers = _SUMMARY + ranks.size + _GRID
    values = MOMENTS + table.size // 3 + (2 * bins + 5 if bins else 0)
    return ProfileShape(size, plan, bins, ranks, table, numbers, values)


def profile(values: torch.Tensor, index: torch.Tensor | None, shape: ProfileShape) -> Profiled:
    """``reduce``, then in the same call the values the built-in reducers give from its output.

    The nine moments as ``functional.host_moment_values`` computes them, the quantiles as
    ``QuantilePlan.interpolate`` lerps them and the histogram as ``pack_histogram`` packs it,
    with the same float operations in the working dtype: the Python around ``reduce`` cost a
    small tensor three times the kernel's own time.

    Args:
        values: A ``usable`` tensor of at least one entry.
        index: Positions of the subsample (int64, contiguous), or ``None`` (``reduce``).
        shape: The subsample's size, its quantile plan and the histogram's bins
            (``profile_shape``).
    """
    assert KERNELS is not None, "profile needs the compiled kernels (check usable first)"
    values = _dense(values)
    numbers, out = shape.buffers(values.dtype, status=False)
    status = KERNELS.profile(
        values.data_ptr(),
        values.numel(),
        _DTYPES[values.dtype],
        0 if index is None else index.data_ptr(),
        shape.size,
        shape.ranks,
        shape.table,
        shape.bins,
        numbers,
        out,
    )
    return Profiled(status, numbers, out)


QUEUE = KERNELS is not None and hasattr(KERNELS, "queue_new")
"""Whether the kernels have their reduction queue (a thread that runs ``profile`` without the
GIL: ``queue_submit``); a build for Windows has none."""


LINGER_MAX_NS: int = int(KERNELS.LINGER_MAX_NS) if KERNELS is not None and QUEUE else 0
"""The longest linger ``new_queue`` takes, in nanoseconds (a minute); 0 without a queue."""


def new_queue(linger_ns: int | None = None) -> object:
    """An empty reduction queue of the kernels (its thread starts with the first job).

    Args:
        linger_ns: How long the queue's thread looks for a next job (every 50 us, asleep in
            between) before it sleeps until a submit wakes it; ``None`` for the kernels'
            default, 0.5 ms; at most a minute. A job submitted while it lingers costs no
            wake (``queue_wakes``) and waits up to about 100 us for the thread's nap to end.

    Raises:
        ValueError: ``linger_ns`` is negative or over a minute.
    """
    if KERNELS is None or not QUEUE:
        raise RuntimeError("the compiled kernels have no reduction queue here (check QUEUE)")
    return KERNELS.queue_new() if linger_ns is None else KERNELS.queue_new(linger_ns)


class Queued(NamedTuple):
    """A ``profile`` handed to a reduction queue (``submit_profile``), and what keeps it going.

    Every buffer the job reads or writes is held here: the queue's thread has only their
    addresses, so this must stay alive until the job has run.
    """

    ticket: int | None
    """The job's ticket (``queue_finished`` reaches it once the job has run); ``None``: it ran
    in the caller."""
    numbers: NDArray[np.float64]
    values: NDArray[np.floating]
    source: torch.Tensor
    plan: QuantilePlan | None

    @property
    def status(self) -> int:
        """The job's status (``Profiled.status``), once it has run."""
        return int(self.numbers[-1])

    def profiled(self) -> Profiled:
        """What ``profile`` would have given, once the job has run."""
        return Profiled(self.status, self.numbers[:-1], self.values)


STATUS_NO_MEMORY = 8
"""A queued job could not allocate its tables: nothing it wrote is usable."""


def submit_profile(
    queue: object | None, values: torch.Tensor, seed: int | None, shape: ProfileShape
) -> Queued:
    """``profile`` of ``values`` on ``queue``'s thread, or here when ``queue`` is ``None``.

    Args:
        queue: A reduction queue (``new_queue``), or ``None`` to run the job in the caller.
        values: A ``usable``, contiguous tensor, which nothing changes until the job has run.
        seed: The seed of the subsample's positions, drawn as ``draw_positions`` draws them,
            or ``None`` for the first ``shape.size`` entries (all of them, for exact
            quartiles).
        shape: The subsample's size, its quantile plan and the histogram's bins
            (``profile_shape``).

    An exception that interrupts it once the job is queued (a ``KeyboardInterrupt``) leaves
    only once the job has run: the returned ``Queued`` is what holds its buffers.
    """
    assert KERNELS is not None, "submit_profile needs the kernels (check QUEUE)"
    numbers, out = shape.buffers(values.dtype, status=True)
    if queue is not None:
        try:
            ticket = KERNELS.queue_submit(
                queue,
                seed,
                values.data_ptr(),
                values.numel(),
                _DTYPES[values.dtype],
                0,
                shape.size,
                shape.ranks,
                shape.table,
                shape.bins,
                numbers,
                out,
            )
            return Queued(ticket, numbers, out, values, shape.plan)
        except BaseException:
            # an interrupt once it is queued (as the call returns, before its ticket is known):
            # nothing would hold what the job reads and writes
            drain(queue)
            raise
    try:  # as the queue's thread would: its own draw, and no memory a status, not an error
        index = None if seed is None else draw_positions(seed, values.numel(), shape.size)
        profiled = profile(values, index, shape)
        numbers[:-1], numbers[-1], out = profiled.numbers, profiled.status, profiled.values
    except MemoryError:
        numbers[-1] = STATUS_NO_MEMORY
    return Queued(None, numbers, out, values, shape.plan)


_EVERY_JOB = (1 << 63) - 1
"""A ticket past any job's: ``queue_wait`` for it waits for every job submitted so far."""


def drain(queue: object) -> None:
    """Wait for every job submitted to ``queue`` so far, running those not started meanwhile.

    What an exception that may have left a job queued, its ticket not known (an interrupt as
    the submit returns), and held by nothing, waits for before it leaves: the job reads and
    writes memory that would be let go. A queue of another process (this one a child made by
    ``fork``, where the kernels refuse it) has no job of this process's: nothing to wait for.
    """
    assert KERNELS is not None
    with contextlib.suppress(RuntimeError):
        KERNELS.queue_wait(queue, _EVERY_JOB)


COPY_PIECE_BYTES = 1 << 20
"""The bytes of each job ``queue_copy`` queues: a large tensor's copy in pieces, so that the
queue's thread and a waiter share it (``queue_wait``)."""


def queue_copy(queue: object, source: torch.Tensor, destination: torch.Tensor) -> int:
    """Queue ``destination.copy_(source)`` as jobs of ``queue``'s; the last one's ticket.

    Byte copies of ``COPY_PIECE_BYTES`` or less, in their turn among the profile jobs, run by
    the queue's thread or by a caller of ``queue_wait``: two processors copy at once. The
    caller keeps both tensors alive, and ``source`` unchanged, until the last job has run.
    Where this raises (a ``KeyboardInterrupt`` between two pieces, no memory for a job), the
    pieces it queued have run before the exception leaves it.

    Args:
        queue: A reduction queue (``new_queue``).
        source: A contiguous CPU tensor of at least one entry.
        destination: A contiguous CPU tensor of ``source``'s dtype and number of entries,
            whose memory does not overlap ``source``'s.
    """
    assert KERNELS is not None, "queue_copy needs the kernels' queue (check QUEUE)"
    assert source.device.type == destination.device.type == "cpu"
    assert source.is_contiguous(), "queue_copy reads a contiguous tensor"
    assert destination.is_contiguous(), "queue_copy writes a contiguous tensor"
    assert source.dtype == destination.dtype, "queue_copy copies within one dtype"
    assert source.numel() == destination.numel() > 0, "queue_copy copies the same entries"
    nbytes = source.numel() * source.element_size()
    read, write = source.data_ptr(), destination.data_ptr()
    assert read + nbytes <= write or write + nbytes <= read, "queue_copy: the two overlap"
    ticket = 0
    try:
        for offset in range(0, nbytes, COPY_PIECE_BYTES):
            size = min(COPY_PIECE_BYTES, nbytes - offset)
            ticket = KERNELS.queue_copy(queue, read + offset, write + offset, size)
    except BaseException:
        # an interrupt, or no memory for a job, between two pieces: nobody would hold the two
        # tensors for the pieces already queued, which read and write them. They run first.
        drain(queue)
        raise
    return int(ticket)


def queue_finished(queue: object) -> int:
    """How many jobs ``queue`` has run, in the order they were submitted."""
    assert KERNELS is not None
    return int(KERNELS.queue_finished(queue))


def queue_wakes(queue: object) -> int:
    """How many of ``queue``'s submits found its thread asleep and had to wake it."""
    assert KERNELS is not None
    return int(KERNELS.queue_wakes(queue))


def queue_helped(queue: object) -> int:
    """How many of ``queue``'s jobs a caller of ``queue_wait`` ran itself, not its thread."""
    assert KERNELS is not None
    return int(KERNELS.queue_helped(queue))


def queue_wait(queue: object, ticket: int, *, run: bool = True) -> None:
    """Block, with the GIL released, until the job with ``ticket`` and those before it have run.

    Meanwhile the caller runs the jobs up to ``ticket`` that the queue's thread has not
    started, in the order they were submitted (``queue_helped`` counts them), and waits only
    for those the thread is running: on two processors a sample's close that found its last
    jobs queued finishes them in about half the time. The values are the same whichever thread
    ran a job. ``run=False``: the caller only waits (``benchmarks/`` compares the two).
    """
    assert KERNELS is not None
    KERNELS.queue_wait(queue, ticket, int(run))


def queue_close(queue: object) -> None:
    """Run what ``queue`` holds, then stop its thread; later jobs run in the caller.

    Returns once every job submitted before has run, also those a caller of ``queue_wait``
    took and is still running after the thread stopped: nothing reads or writes a job's
    buffers after it.
    """
    assert KERNELS is not None
    KERNELS.queue_close(queue)


def queue_closer(queue: object) -> Callable[[], None]:
    """``queue_close`` of ``queue``, bound to the kernels that made it, to call later.

    A finalizer that runs once the kernels are switched off (``KERNELS`` set to ``None``, as a
    test comparing the two paths does) still closes a queue they made.
    """
    assert KERNELS is not None
    return functools.partial(KERNELS.queue_close, queue)


def histogram(
    values: torch.Tensor, lo: float, hi: float, bins: int
) -> tuple[int, list[float], NDArray[np.int64]]:
    """The grid over ``[lo, hi]`` (lo, hi, half_lo, scale) and the ``bins + 1`` bucket counts.

    Args:
        values: A ``usable`` tensor, every entry finite, whose smallest entry is ``lo`` and
            largest ``hi``.
        lo: The smallest entry.
        hi: The largest entry.
        bins: Number of bins.

    Returns:
        The status (``STATUS_OK`` or ``STATUS_BIN_OVERFLOW``), the grid and the counts.
    """
    assert KERNELS is not None, "histogram needs the compiled kernels (check usable first)"
    values = _dense(values)
    grid = np.empty(_GRID, dtype=np.float64)
    counts = np.empty(bins + 1, dtype=np.int64)
    status = KERNELS.histogram(
        values.data_ptr(),
        values.numel(),
        _DTYPES[values.dtype],
        lo,
        hi,
        bins,
        grid.ctypes.data,
        counts.ctypes.data,
    )
    return status, grid.tolist(), counts


def order_statistics(
    values: torch.Tensor, index: torch.Tensor | None, size: int, ranks: NDArray[np.int64]
) -> list[float]:
    """The entries at ``ranks`` (ascending) of the sorted subsample ``values[index]``.

    Args:
        values: A ``usable`` tensor whose subsampled entries are all finite.
        index: Positions of the subsample (int64, contiguous), or ``None`` for the first
            ``size`` entries.
        size: Entries in the subsample.
        ranks: Ascending ranks in ``[0, size)``.
    """
    assert KERNELS is not None, "order_statistics needs the compiled kernels"
    values = _dense(values)
    out = np.empty(ranks.size, dtype=np.float64)
    KERNELS.order_statistics(
        values.data_ptr(),
        _DTYPES[values.dtype],
        0 if index is None else index.data_ptr(),
        size,
        ranks.ctypes.data,
        ranks.size,
        out.ctypes.data,
    )
    return out.tolist()


def edges(lo: float, hi: float, scale: float, bins: int, *, float64: bool) -> list[float]:
    """The ``bins + 1`` edges of a finite grid, as ``_edges.histograms_edges`` defines them.

    Each inner edge is the first float whose offset reaches its bin, found by bisection over
    the floats in C (a few microseconds a histogram, against about 10 in numpy).

    Args:
        lo: The grid's lower end (a value of the working dtype).
        hi: Its upper end.
        scale: Its scale.
        bins: Number of bins.
        float64: Whether the grid is in float64; float32 otherwise.
    """
    assert KERNELS is not None, "edges needs the compiled kernels"
    out = np.empty(bins + 1, dtype=np.float64)
    KERNELS.edges(int(float64), lo, hi, scale, bins, out.ctypes.data)
    return out.tolist()


_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_SHIFTS = tuple(np.uint64(bits) for bits in (30, 27, 31, 11))


_MASK64 = 2**64 - 1
_GAMMA_INT = int(_GOLDEN_GAMMA)
_MIX_INT = (int(_MIX[0]), int(_MIX[1]))  # SplitMix64's, as the kernels' ``splitmix64``


def mix_seed(seed: int, *values: int) -> int:
    """A 64-bit seed mixed from ``seed`` and ``values`` (non-negative), one SplitMix64 step each.

    Seeds for several draws from one seed of a generator (``PreparedTensor.random_index``):
    different ``values`` give unrelated streams, the same ones the same stream.
    """
    for value in values:
        z = (seed + (value + 1) * _GAMMA_INT) & _MASK64
        z = ((z ^ (z >> 30)) * _MIX_INT[0]) & _MASK64
        z = ((z ^ (z >> 27)) * _MIX_INT[1]) & _MASK64
        seed = z ^ (z >> 31)
    return seed


def draw_positions(seed: int, numel: int, size: int) -> torch.Tensor:
    """``size`` uniform positions in ``[0, numel)``, with replacement, from a 64-bit ``seed``.

    The ``i``-th is SplitMix64's output for counter ``i`` of stream ``seed``, its top 53 bits
    as a double in ``[0, 1)``, times ``numel``, truncated: each position's chance is within
    ``numel / 2**53`` of ``1 / numel``, and the draws are independent of the values they pick.
    The kernels draw 8,192 positions in about a third of the time ``torch.randint`` takes with
    a ``torch.Generator`` on the CPU (26 against 82 us on a 2-vCPU Zen 1 guest); without them
    numpy computes the same positions with the same operations (about 140 us), so a run gives
    the same quartiles with and without the kernels.

    Args:
        seed: The stream, in ``[0, 2**64)``.
        numel: Entries of the tensor (at least one).
        size: Positions to draw.
    """
    if KERNELS is not None:
        # on the CPU whatever torch's default device is: the kernels write into its memory
        out = torch.empty(size, dtype=torch.int64, device="cpu")
        KERNELS.draw(seed, numel, size, out.data_ptr())
        return out
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as C's does
        z = np.arange(1, size + 1, dtype=np.uint64) * _GOLDEN_GAMMA + np.uint64(seed)
        z = (z ^ (z >> _SHIFTS[0])) * _MIX[0]
        z = (z ^ (z >> _SHIFTS[1])) * _MIX[1]
        z ^= z >> _SHIFTS[2]
    unit = (z >> _SHIFTS[3]).astype(np.float64) * 2.0**-53
    positions = (unit * float(numel)).astype(np.int64)
    np.minimum(positions, numel - 1, out=positions)
    return torch.from_numpy(positions)
