"""Measure one tensor: decide whether it can be reduced, then run the reducers on its device.

Nothing here leaves the device. A ``Measurement`` (``_measurement``) holds device tensors (or the
reason a value is missing) until the sample closes and every measurement crosses to the host in one
transfer; where the compiled kernels reduced a CPU tensor in one call (``FusedReductions``), it
holds their values as host floats instead, which need no transfer. On the CPU, where torch leaves a
core free, the reducers run on the reduction worker (``_background``) on a copy of the tensor: the
measurement is then filled in later, and ``Measurement.settle`` (called before its values are read)
waits for it. Gradients handed to hooks, and outputs that an earlier forward left unchanged, are
not copied (``Measurer.measure(shared=True)``): that they did not change is checked once the worker
is done with them.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import TYPE_CHECKING

import torch

from torchinstruments_core._background import ReductionWorker, flat_copy, free_core
from torchinstruments_core._measurement import (
    Measurement,
    ReducerResult,
    checked,
    forget_frames,
    process_groups_up,
    reduced,
    reducer_error_reason,
    shareable,
    unalias,
)
from torchinstruments_core._native_worker import NativeWorker
from torchinstruments_core._plain import plain_tensor
from torchinstruments_core._queued import CPU, QueuedFill
from torchinstruments_core._records import UnavailableReason
from torchinstruments_core._torch_private import version
from torchinstruments_core.reducers import (
    HistogramReducer,
    MomentsReducer,
    PrecisionReducer,
    PreparedTensor,
    QuantileReducer,
    Reducer,
    _native,
    working_dtype,
)
from torchinstruments_core.reducers._fused import FusedReductions
from torchinstruments_core.reducers.base import cpu_seed, seeded_cache

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from torchinstruments_core.reducers.base import IndexCache

_QUEUED_DTYPES = frozenset((torch.float32, torch.float64))
"""The dtypes ``Measurer.measure`` hands to the kernels' queue without ``plain_tensor``: those
the kernels read (``_native.usable``), in which a tensor is its own working-dtype values."""

_FRESH = frozenset((MomentsReducer, QuantileReducer, PrecisionReducer, HistogramReducer))
"""The built-in reducers (exactly these classes): their results never view their input."""

SMALL_SAMPLE_ENTRIES = 2**19
"""With ``background=None``, what is measured from one forward sample's start to the next's
leaves the Python worker when the stretch before it measured at most this many CPU entries
(512 Ki, 2 MiB of float32; the size is read one sample late): it goes to the kernels' queue
(``_native_worker``), whose thread holds no GIL, or, without one (no kernels, Windows, custom
reducers), is reduced in the hooks. A small sample's reductions on the Python worker are
mostly Python that holds the GIL the training thread needs, so the worker overlapped little
of them and added its hand-overs: on an MNIST-sized MLP (784-256-128-10, batch 64, 11 tensors,
about 200 k entries a sample) a sampled step cost 2.02x on the worker against 1.87x in the
hooks (one run each, a minute apart), and the queue cut it from 1.82x in the hooks to 1.71x
(one process, alternating, 150 rounds). Larger samples keep the Python worker: reading a
queued job's values back costs the training thread about 40-60 us a tensor in a real step,
about what the worker's GIL costs it there (LeNet-5, 1.9 M entries a sample: 1.45x either
way); at batch 1024 (3.2 M entries) the MLP cost 1.5x on the worker and 2.0x in the hooks."""


def _autocast_off(device: torch.device) -> contextlib.AbstractContextManager[object]:
    # Hooks run inside the user's autocast region; statistics must stay in their working dtype.
    # Outside one there is nothing to switch off (and entering autocast costs ~10 us a tensor).
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class Measurer:
    """Runs the reducers on tensors, each on its own device with a private random generator.

    Args:
        reducers: Scalar reducers applied to every observed tensor.
        histogram: Reducer for the focus modules' histograms.
        seed: Seed of the private generators used for subsampling (the model's random stream is
            never touched).
        background: Reduce CPU tensors off the hooks: ``None`` when torch's intra-op
            threads leave a core free (checked once a sample), ``True`` always, ``False``
            never. A small sample's tensors (``SMALL_SAMPLE_ENTRIES``) go to the kernels'
            queue (``_native_worker``) where there is one and the reducers are the built-in
            ones; other samples' to the reduction worker (``_background``), and with ``None``
            a small sample without the queue stays in the hooks.
    """

    def __init__(
        self,
        reducers: Sequence[Reducer],
        histogram: HistogramReducer,
        *,
        seed: int = 0,
        background: bool | None = None,
    ) -> None:
        self.reducers = tuple(reducers)
        self.histogram = histogram
        self.metrics = tuple(m for r in self.reducers for m in r.metrics)
        self._reducer_metrics = tuple(r.metrics for r in self.reducers)
        # the built-in reducers' CPU work in one call of the compiled kernels (same values)
        self._fused = FusedReductions.plan(self.reducers, histogram)
        # whether a result may view what was reduced: only a reducer not built in (``unalias``)
        self._views = not all(type(r) in _FRESH for r in (*self.reducers, histogram))
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._samples = 0  # samples started: each one's subsample positions have their seed
        self._index_cache = self._new_cache()
        self.background = background
        self._worker = ReductionWorker()
        # the kernels' queue, for the built-in reducers: its thread never takes the GIL
        self._native = NativeWorker() if self._fused and NativeWorker.available() else None
        self._entries = 0  # CPU entries measured since the current forward sample started
        self._small = False  # the previous forward sample was small: off the Python worker
        self._free_core: bool | None = None  # ``free_core()``, read once a sample
        self._groups: bool | None = None  # ``process_groups_up()``, read once a sample
        # the measurements read without a copy, per thread that measured them (``_let_go``)
        self._shared: dict[int, collections.deque[Measurement]] = {}

    def new_sample(self, *, forward: bool = False) -> None:
        """Forget the previous sample's subsample positions; the next one has a seed of its own.

        A new mapping, not a cleared one: the workers' jobs of the previous sample keep theirs.
        The lists of shared tensors of threads that have none left are dropped. A ``forward``
        sample starting decides, from the CPU entries measured since the last one started
        (a step record's, ``measure(step=True)``, left out), whether what is measured until
        the next one starts leaves the Python worker (``SMALL_SAMPLE_ENTRIES``).
        """
        if forward:
            self._small = 0 < self._entries <= SMALL_SAMPLE_ENTRIES
            self._entries = 0
        self._index_cache = self._new_cache()
        # read again: torch's threads, or the process groups, may have changed between samples
        self._free_core = self._groups = None
        self._shared = {  # list(): taken whole, while another thread's hook may add to them
            thread: pending
            for thread, pending in list(self._shared.items())
            if any(measurement.shared is not None for measurement in list(pending))
        }

    def _new_cache(self) -> IndexCache:
        """The next sample's ``IndexCache``, seeded from ``seed`` and the sample's number.

        The CPU positions of every sample are fixed before its first tensor, whichever thread
        reduces it and in whatever order: the reduction worker, the kernels' queue and the
        hooks find the same ones.
        """
        self._samples += 1
        return seeded_cache(_native.mix_seed(self._seed & (2**64 - 1), self._samples))

    @property
    def queues(self) -> bool:
        """Whether this sample's CPU tensors go to the kernels' queue (``SMALL_SAMPLE_ENTRIES``).

        The queue copies every tensor it is handed (``_native_job``), so nothing of such a
        sample is read in place (``measure``'s ``shared``) or teaches what could be.
        """
        return self._small and self._native is not None

    def process_groups(self) -> bool:
        """``process_groups_up()``, read once a sample (at its first shared tensor)."""
        groups = self._groups
        if groups is None:
            groups = self._groups = process_groups_up()
        return groups

    def wait(self) -> None:
        """Block until the reduction workers have reduced every tensor handed to them."""
        self._worker.wait()
        if self._native is not None:
            self._native.wait()

    def copy(self, source: torch.Tensor, destination: torch.Tensor) -> int | None:
        """Queue ``destination.copy_(source)`` on the kernels' queue; the ticket to wait for.

        Where CPU tensors are reduced there (``_in_background``: a free core, or
        ``background_reductions=True``), the queue's thread and a thread waiting for the
        ticket (``wait_for``) copy at once (``NativeWorker.copy``). ``None``: no queue takes
        it; the caller copies.

        Args:
            source: A contiguous CPU tensor of at least one entry, unchanged until the copy has
                run.
            destination: A contiguous CPU tensor of ``source``'s dtype and number of entries,
                whose memory does not overlap ``source``'s.
        """
        native = self._native
        if native is None or not self._in_background(source, None):
            return None
        return native.copy(source, destination)

    def wait_for(self, ticket: int) -> None:
        """Block until the kernels' queue has run job ``ticket`` and those before it."""
        if self._native is not None:
            self._native.wait(ticket)

    def kick(self) -> None:
        """Start the reduction worker on what it holds: a sample's forward has ended."""
        self._worker.kick()

    def on_worker_thread(self) -> bool:
        """Whether the caller is the reduction worker (garbage collection can run there)."""
        return self._worker.on_thread()

    def close(self) -> None:
        """Reduce what the workers hold and stop their threads; later tensors reduce here."""
        self._worker.close()
        if self._native is not None:
            self._native.close()
        shared, self._shared = self._shared, {}
        for pending in shared.values():
            for measurement in pending:
                measurement.let_go()

    def measure(
        self,
        tensor: torch.Tensor,
        *,
        with_histogram: bool,
        scale: float | torch.Tensor | None = None,
        shared: bool = False,
        changed: Callable[[], None] | None = None,
        step: bool = False,
        in_place: bool = False,
    ) -> Measurement:
        """Reduce ``tensor`` (divided by ``scale`` when given, on the tensor's device).

        The histogram is computed too when ``with_histogram`` is set. Never raises: a tensor
        that cannot be reduced gives its reason, and an exception from anything that touches
        the tensor (unwrapping, conversion, a reducer) becomes a ``reducer_error`` reason with
        the error in ``Measurement.errors``.

        ``shared`` says that nothing should change ``tensor`` in place once the hook returns:
        a gradient handed to a hook, which autograd only reads, or an output that a forward
        left unchanged before (``OutputProbe``). The reduction worker then reads it, flat and
        in its working dtype, without a copy (a copy of a large activation costs the hook
        about a millisecond), and checks the tensor's version (``_torch_private.version``)
        once it is done, at the next ``measure`` of the same thread or when the measurement
        settles: if an in-place op changed it by then (a custom ``backward`` that scales its
        ``grad_output`` in place), its values are dropped with the reason
        ``modified_in_place`` instead of mixing old and new entries, and ``changed()`` is
        called, on the thread that checked. Only a tensor whose changes would show in its
        version is shared (``shareable``).

        ``step`` marks a step record's tensor (``_step_records``): it goes to the kernels'
        queue, whose thread reduces it without the GIL, whatever the size of the sample, and it
        does not count toward the size of the next forward sample (``SMALL_SAMPLE_ENTRIES``
        weighs what copying a sample's activations and gradients costs its hooks). It is copied
        there unless ``in_place`` says that nothing changes ``tensor`` until its reduction has
        run (see ``_step_tensors``): a worker then reads it where it is, outside the workers'
        byte budget (``_hand_over``), where it is contiguous and in its working dtype.
        """
        if in_place and step and scale is None:  # a step record's tensor read where it is
            queued = self._queue_in_place(tensor, with_histogram)
            if queued is not None:
                return queued
        if (  # a small sample's plain float CPU tensor, nearly all of one: checked here, inline
            scale is None
            and (self._small or step)
            and type(tensor) is torch.Tensor
            and tensor.dtype in _QUEUED_DTYPES
            and tensor.is_cpu
            and tensor.layout == torch.strided
            and not tensor.is_nested
            and self._native is not None
            and (tensor.requires_grad or not tensor._is_zerotensor())
        ):
            numel = tensor.numel()
            if numel and self._in_background(tensor, None):
                self._entries += 0 if step else numel
                detached = tensor.detach() if tensor.requires_grad else tensor
                return self._queue(detached, numel, tensor.dtype, with_histogram, in_place)
        self._let_go()
        shared = shared and not self.queues and shareable(tensor, groups=self.process_groups())
        try:
            plain = self._plain(tensor, scale)
        except Exception as error:  # an odd tensor must never break the step (error_policy decides)
            return Measurement(reducer_error_reason(error), self.metrics, errors=[error])
        if isinstance(plain, UnavailableReason):
            return Measurement(reason=plain, metrics=self.metrics)
        on_cpu = plain.is_cpu
        if on_cpu:
            numel = plain.numel()
            self._entries += 0 if step else numel
            queues = self.queues or (step and self._native is not None)
            if scale is None and queues and self._in_background(plain, scale):
                dtype = working_dtype(plain.dtype)  # a narrower one's, or a subclass's
                return self._queue(plain, numel, dtype, with_histogram, in_place)
        measurement = Measurement(None, self.metrics, changed=changed)
        if not self._in_background(plain, scale):
            if on_cpu:
                # a custom reducer may draw from the generator: in the order tensors came
                self._worker.wait()
            self._fill(plain, measurement, with_histogram, self._index_cache, plain.dtype)
            return measurement
        # the division by a scale made it (ours), or nobody changes it (``in_place``: not ours)
        owned, read = scale is not None or in_place, in_place and scale is None
        return self._hand_over(
            plain, measurement, with_histogram, owned=owned, shared=shared, read=read
        )

    def _queue_in_place(self, tensor: torch.Tensor, with_histogram: bool) -> Measurement | None:
        """A step record's dense float CPU tensor queued as it is, or ``None`` (``measure``).

        What ``_queue`` and ``_hand_over`` do for such a tensor read where it is, without their
        checks, copies and budget (it holds none of it): a recorded step hands over a few
        hundred tensors on a small transformer, each through half a dozen Python calls there.
        ``None`` where the kernels' queue would not read the tensor itself (strided, sparse,
        another dtype, empty, a subclass) or the measurer reduces in the hooks: ``measure``
        goes on.
        """
        native, fusion = self._native, self._fused
        if (
            native is None
            or fusion is None
            or tensor.layout != torch.strided  # before the rest: CSR has no ``is_contiguous``
            or tensor.is_nested
            or not _native.usable(tensor)  # a plain float32 or float64 CPU tensor, among others
            or not tensor.is_contiguous()
        ):
            return None
        numel = tensor.numel()
        if not numel or not self._in_background(tensor, None):
            return None
        if tensor.requires_grad:
            tensor = tensor.detach()
        measurement = Measurement(None, self.metrics)
        try:  # ``measure`` never raises
            call = fusion.call(numel, with_histogram)
            cache = self._index_cache  # this sample's, whenever the job runs
            seed = cpu_seed(cache, self._generator(CPU), numel, call.size) if call.drawn else None
            job = QueuedFill(
                self, measurement, tensor, seed, call, cache, tensor.dtype, with_histogram
            )
            measurement.ticket = native.submit_ready(job)
        except Exception as error:
            return Measurement(reducer_error_reason(error), self.metrics, errors=[error])
        measurement.worker = native
        return measurement

    def _queue(
        self,
        plain: torch.Tensor,
        numel: int,
        dtype: torch.dtype,
        with_histogram: bool,
        in_place: bool = False,
    ) -> Measurement:
        """A small sample's CPU tensor copied (in ``dtype``) and its profile queued.

        What nearly every tensor of a small sample takes: one ``NativeWorker.submit_copy``,
        its job (``QueuedFill``) filling the measurement in when it is read back. A copy
        that fails (out of memory) gives a measurement with its reason instead. ``in_place``
        (``measure``'s): the job reads ``plain`` where it is, where the kernels can.
        """
        if in_place:
            measurement = Measurement(None, self.metrics)
            return self._hand_over(
                plain, measurement, with_histogram, owned=True, shared=False, queue=True, read=True
            )
        native, fusion = self._native, self._fused
        assert native is not None, "only a sample that queues gets here"
        assert fusion is not None, "the queue is there only for the built-in reducers"
        call = fusion.call(numel, with_histogram)
        cache = self._index_cache  # this sample's, whenever the job runs
        seed = cpu_seed(cache, self._generator(CPU), numel, call.size) if call.drawn else None
        measurement = Measurement(None, self.metrics)
        job = QueuedFill(self, measurement, None, seed, call, cache, plain.dtype, with_histogram)
        try:
            measurement.ticket = native.submit_copy(plain, dtype, job)
        except Exception as error:  # the copy failed (out of memory): no job, a reason
            return Measurement(reducer_error_reason(error), self.metrics, errors=[error])
        measurement.worker = native
        return measurement

    def _hand_over(
        self,
        plain: torch.Tensor,
        measurement: Measurement,
        with_histogram: bool,
        *,
        owned: bool,
        shared: bool,
        queue: bool = False,
        read: bool = False,
    ) -> Measurement:
        """Queue ``plain``'s job on a worker; ``measurement`` is filled in when it has run.

        A small sample's tensors go to the kernels' queue, a larger one's to the Python worker
        (``SMALL_SAMPLE_ENTRIES``); with ``queue``, to the kernels' queue where there is one.
        ``owned``: nothing changes ``plain`` until the measurement settles (the division by a
        scale made it, or ``measure``'s ``in_place``); ``shared``: see ``measure``. A copy that
        fails (out of memory) gives a measurement with its reason instead of a job.

        ``read``: ``plain`` is ``measure``'s ``in_place`` tensor: the model's or the optimizer's
        own (a gradient, the optimizer's state), or memory its step record holds anyway (a
        parameter's copy, the update formed in it, made before the optimizer's step and at
        their peak there). Where the job reads it as it is (dense, in its working dtype), it
        holds none of the workers' byte budget, which bounds what their copies and conversions
        hold: counted, an optimizer step's large tensors made each hand-over wait for the job
        two before it (a budget of 8 MiB against 4 MiB weights), and the hook's work with them.
        """
        nbytes = plain.numel() * working_dtype(plain.dtype).itemsize
        native = self._native if self._small or queue else None
        as_is = plain.dtype in _QUEUED_DTYPES and plain.is_contiguous()
        # read where it is (``_native_job``, ``_job``): nothing of the workers' is held
        held = not (read and as_is and (native is None or _native.usable(plain)))
        try:
            if native is not None:
                measurement.ticket = native.submit(
                    nbytes if held else 0,
                    lambda: self._native_job(plain, measurement, with_histogram, owned=owned),
                )
            else:
                measurement.ticket = self._worker.submit(
                    nbytes,
                    lambda: self._job(
                        plain, measurement, with_histogram, owned=owned, shared=shared
                    ),
                    held=held,
                )
        except Exception as error:  # the copy failed (out of memory): no job, a reason
            return Measurement(reducer_error_reason(error), self.metrics, errors=[error])
        measurement.worker = native or self._worker
        if measurement.shared is not None:
            thread = threading.get_ident()
            self._shared.setdefault(thread, collections.deque()).append(measurement)
        return measurement

    def _let_go(self) -> None:
        """``Measurement.let_go`` of this thread's shared tensors the worker is done with.

        Only this thread's: in its hook no op of its own is under way, but another thread
        may be in the middle of an in-place op whose version moves only when it returns.
        """
        pending = self._shared.get(threading.get_ident())
        while pending and reduced(pending[0]):
            pending.popleft().let_go()

    def _plain(
        self, tensor: torch.Tensor, scale: float | torch.Tensor | None
    ) -> torch.Tensor | UnavailableReason:
        """The tensor to reduce (divided by ``scale``), or why there is none."""
        # ``plain_tensor`` records nothing in autograd (a detach at most): no ``no_grad`` for it,
        # a context that costs the hook a few microseconds on every tensor
        plain = plain_tensor(tensor)
        if isinstance(plain, UnavailableReason) or scale is None:
            return plain
        with torch.no_grad(), _autocast_off(plain.device):  # working dtype: fp16 would underflow
            plain = plain.to(working_dtype(plain.dtype))
            return plain / _on_device(scale, plain)

    def _in_background(self, plain: torch.Tensor, scale: float | torch.Tensor | None) -> bool:
        if not plain.is_cpu or self.background is False:
            return False
        if isinstance(scale, torch.Tensor) and not scale.is_cpu:
            return False
        if self.background is True:
            return True
        if self._small and self._native is None:
            return False
        if self._free_core is None:
            self._free_core = free_core()
        return self._free_core

    def _job(
        self,
        plain: torch.Tensor,
        measurement: Measurement,
        with_histogram: bool,
        *,
        owned: bool,
        shared: bool = False,
    ) -> tuple[Callable[[], None], torch.Tensor | None]:
        """Copy ``plain`` here, in the hook; return the job that reduces the copy, and its buffer.

        The copy is flat and in the working dtype, in a buffer of the worker's (``buffer``):
        the model may change its own tensors in place as soon as the hook returns. A tensor
        that is ``owned`` (nobody else holds it) or ``shared`` (see ``measure``; its version
        is noted in ``measurement.shared``) is handed over as it is instead; if it is strided
        or in a narrower dtype (bfloat16), the worker makes the flat working-dtype tensor the
        reducers read (``PreparedTensor``), off the training thread. A shared tensor is copied
        after all when its storage is larger than the copy would be (a slice of a larger
        activation, such as the last token's): holding it would keep all of that alive, past
        what the worker's byte budget counts.
        """
        dtype = working_dtype(plain.dtype)
        buffer = aliased = None  # what no result may keep reading: reused, or not ours
        # no ``no_grad``: ``plain`` requires no grad (``plain_tensor``), so the copy records nothing
        if owned or (shared and _storage_bytes(plain) <= plain.numel() * dtype.itemsize):
            # handed over as it is (``plain`` is detached already): the worker flattens it.
            # Each torch call here releases the GIL, and while the worker reduces, taking
            # it back costs the hook 5-15 us a call (``benchmarks/gil_handoff.py``).
            copy = plain
            if not owned:
                measurement.shared = (plain, version(plain))
                aliased = copy
        else:
            copy = aliased = buffer = flat_copy(plain, self._worker.buffer(plain.numel(), dtype))
        cache, source_dtype = self._index_cache, plain.dtype  # this sample's, whenever it runs

        def job() -> None:
            self._fill(copy, measurement, with_histogram, cache, source_dtype)
            if aliased is not None and self._views:  # a view of it gets storage of its own
                unalias(measurement, aliased)
            for error in measurement.errors:  # its frames would keep the copy alive
                forget_frames(error)

        return job, buffer

    def _fill(
        self,
        plain: torch.Tensor,
        measurement: Measurement,
        with_histogram: bool,
        cache: IndexCache,
        source_dtype: torch.dtype,
        *,
        fused: bool = True,
    ) -> None:
        """Run the reducers on ``plain`` into ``measurement``; errors become its reason.

        ``fused``: try the kernels' one call first (``_fill_fused``); ``False`` where they
        have given nothing for this tensor already.
        """
        try:
            # ``plain`` requires no grad, and flattening it or the kernels' one call record
            # nothing and meet no autocast: the contexts (about 10 us a tensor) wait for the
            # reducers
            prepared = PreparedTensor(plain, self._generator(plain.device), cache)
            prepared.source_dtype = source_dtype  # a copy is in the working dtype already
            if fused and self._fill_fused(prepared, measurement, with_histogram):
                return
            with torch.no_grad(), _autocast_off(plain.device):
                measurement.n_finite = prepared.n_finite  # reads every entry: fails here if any
        except Exception as error:  # an odd tensor must never break the step
            measurement.reason = reducer_error_reason(error)
            measurement.errors.append(error)
            return
        with torch.no_grad(), _autocast_off(prepared.device):
            for reducer in self.reducers:
                measurement.results.append(self._run(reducer, prepared, measurement))
            if with_histogram:
                self._run_histogram(prepared, measurement)
        # A result that views what it reduced (a custom reducer's slice of its input) gets
        # storage of its own: it is read when the sample is delivered. The flat working-dtype
        # copy made here must not stay alive until then, and a tensor read where it is changes
        # before then (a gradient the optimizer's step writes into, the copy of a parameter its
        # update is formed in, an output changed in place by the next layer). The built-in
        # reducers' results are new tensors or host floats: checked only beside a custom one.
        if not self._views:
            return
        if plain.layout == torch.strided:
            unalias(measurement, plain)
        if prepared.values is not plain:
            unalias(measurement, prepared.values)

    def _fill_fused(
        self, prepared: PreparedTensor, measurement: Measurement, with_histogram: bool
    ) -> bool:
        """Fill ``measurement`` from one call of the compiled kernels, if it can be done.

        The built-in reducers' values for a CPU tensor they would reduce on the host
        (``FusedReductions``); ``False`` leaves the reducers to run as usual, and so does an
        error here, which they then meet and report themselves.
        """
        if self._fused is None or not prepared.values.is_cpu:
            return False
        try:
            fused = self._fused.reduce(prepared, with_histogram)
        except Exception:  # the reducers run instead, and report what fails
            return False
        if fused is None:
            return False
        self._fused_into(
            measurement, prepared.numel, fused.results, fused.histogram, fused.edges, fused.float64
        )
        return True

    def _fused_into(
        self,
        measurement: Measurement,
        numel: int,
        results: list[list[float]],
        histogram: list[float] | None,
        edges: list[float] | None,
        float64: bool,
    ) -> None:
        """Fill ``measurement`` with the kernels' values of a ``numel``-entry tensor.

        Each reducer's values, the histogram, its edges, and whether its working dtype is
        float64 (a ``Fused``, or ``FusedReductions.values`` and the dtype).
        """
        measurement.n_finite = float(numel)  # every entry is finite where the kernels finish
        measurement.results = [
            ReducerResult(metrics, values)
            for metrics, values in zip(self._reducer_metrics, results, strict=True)
        ]
        if histogram is not None:
            measurement.histogram = histogram
            measurement.histogram_bins = self.histogram.bins
            measurement.histogram_float64 = float64
            measurement.histogram_edges = edges

    def _native_job(
        self,
        plain: torch.Tensor,
        measurement: Measurement,
        with_histogram: bool,
        *,
        owned: bool,
    ) -> QueuedFill:
        """The kernels' queue's job for ``plain``, made in the hook (see ``_job``).

        The job reads a flat copy in the working dtype, made here, or ``plain`` itself where it
        is ``owned`` and the kernels can read it as it is (contiguous, in its working dtype). A
        ``shared`` tensor is copied too: the queue's thread reads memory by its address, and a
        ``set_`` or a storage resize of the tensor would free it under the job, where the
        Python worker would only read changed values and drop them (these samples are small,
        and a copy of 16 Ki float32 entries takes about 4 us). Once the job has run, its values
        fill ``measurement`` (``QueuedFill``), on the thread that reads them back.
        """
        assert self._fused is not None
        assert self._native is not None
        dtype = working_dtype(plain.dtype)
        numel = plain.numel()
        buffer = None
        if owned and plain.dtype == dtype and plain.is_contiguous() and _native.usable(plain):
            values = plain
        else:
            values = buffer = flat_copy(plain, self._native.buffer(numel, dtype))
        call = self._fused.call(numel, with_histogram)
        cache = self._index_cache  # this sample's, whenever it runs
        seed = cpu_seed(cache, self._generator(CPU), numel, call.size) if call.drawn else None
        job = QueuedFill(self, measurement, values, seed, call, cache, plain.dtype, with_histogram)
        job.buffer = buffer
        return job

    def _run(
        self, reducer: Reducer, prepared: PreparedTensor, measurement: Measurement
    ) -> ReducerResult:
        try:
            values = checked(reducer.reduce(prepared), len(reducer.metrics))
            return ReducerResult(reducer.metrics, values)
        except Exception as error:  # a reducer must never break the forward (error_policy decides)
            measurement.errors.append(error)
            return ReducerResult(reducer.metrics, None, reducer_error_reason(error))

    def _run_histogram(self, prepared: PreparedTensor, measurement: Measurement) -> None:
        try:
            packed = self.histogram.reduce(prepared)
            measurement.histogram = checked(packed, self.histogram.bins + 4)
            measurement.histogram_bins = self.histogram.bins
            measurement.histogram_float64 = prepared.values.dtype == torch.float64
            measurement.histogram_edges = None  # searched when the record is built
        except Exception as error:
            measurement.errors.append(error)

    def generator(self, device: torch.device) -> torch.Generator:
        """The private random generator of ``device``, seeded once (never the model's).

        Waits for the reduction worker first, where a custom reducer may draw from the CPU
        generator: the draws stay in the order the tensors were measured (the built-in
        reducers' CPU positions come from each sample's seed, ``_new_cache``, instead).
        """
        self._worker.wait()
        return self._generator(device)

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator


def _storage_bytes(tensor: torch.Tensor) -> int:
    """The bytes of the storage ``tensor`` keeps alive (all of it, for a view)."""
    return int(tensor.untyped_storage().nbytes())


def _on_device(scale: float | torch.Tensor, tensor: torch.Tensor) -> float | torch.Tensor:
    """``scale`` as a divisor of ``tensor``: a tensor is moved there, never read on the host."""
    if not isinstance(scale, torch.Tensor):
        return scale
    # non_blocking only towards a device: a host copy must land before it is read
    to_device = tensor.device.type != "cpu"
    plain = scale.detach().reshape(())
    return plain.to(tensor.device, tensor.dtype, non_blocking=to_device)
