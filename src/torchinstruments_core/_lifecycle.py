"""The sample lifecycle: when a sample opens, which samples are open, and when each closes.

A sample opens at a sampled root forward (or ``open_sample``); while its forward runs it is
*running* in its thread, with the per-module hooks armed. When the forward ends it is *pending*
until the first backward that reaches it completes, autograd frees its graph without a backward,
its step ends, or ``flush``/removal comes, whichever is first. Then it closes: its gradient hooks
are removed and its values start crossing to the host (see ``_delivery``).

Only ``on_root_enter`` and ``on_root_exit`` run on an unsampled forward: keep them lean.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from torch import is_grad_enabled

from torchinstruments_core._capture import Attachment
from torchinstruments_core._delivery import DeliveryQueue
from torchinstruments_core._failures import OBSERVE_CONSEQUENCE
from torchinstruments_core._probe import OutputProbe
from torchinstruments_core._profile import CallProfiler
from torchinstruments_core._sample import Sample
from torchinstruments_core._step_records import StepRecorder
from torchinstruments_core._torch_private import in_backward

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from torch import nn

    from torchinstruments_core._failures import FailureReport
    from torchinstruments_core._layers import Layer
    from torchinstruments_core._measurement import Measurement
    from torchinstruments_core._observer_config import ObserverConfig
    from torchinstruments_core._plan import StepPlan
    from torchinstruments_core._rank_gate import RankGate
    from torchinstruments_core._scale import GradientScaleReader
    from torchinstruments_core._sink_session import SinkSession
    from torchinstruments_core._step_records import StepScalars, StepTensor, UnavailableRow


def _ignore(step: int | None) -> None:
    """What ``on_training_sample`` does until an optimizer is watched."""


class _Sentinel:
    """Lives exactly as long as some gradient hook of a sample (see ``GradientSlot.sentinel``)."""


class _ThreadState(threading.local):
    """What one thread's forward is doing: concurrent forwards are separate samples."""

    depth = 0
    active: Sample | None = None
    explicit = False
    # ``open(step, lazy=True)`` waiting for the first selected module to run: its step, scope
    lazy = False
    lazy_step: int | None = None
    lazy_scope: str | None = None


class SampleLifecycle:
    """Owns the open samples, the per-module hooks' arming, and when each sample closes.

    ``running`` and ``pending`` are guarded by one re-entrant lock: a weakref finalizer (a graph
    freed without a backward) can close a sample while the lock is held in the same thread.

    Args:
        model: The observed root module (held only by the hooks' ``Attachment``).
        config: The observer's configuration.
        plan: Decides which root forwards are samples.
        gate: Whether this rank observes.
        scale: The gradient scale each new sample divides its gradients by.
        sink: Opened when the first sample starts; receives the delivered samples.
        failures: Where failures while observing are reported.
    """

    def __init__(
        self,
        model: nn.Module,
        config: ObserverConfig,
        *,
        plan: StepPlan,
        gate: RankGate,
        scale: GradientScaleReader,
        sink: SinkSession,
        failures: FailureReport,
    ) -> None:
        self._plan, self._gate, self._scale, self._sink = plan, gate, scale, sink
        self._failures, self._measurer = failures, config.measurer
        self._root_layer = next((x for x in config.layers if x.module is model), None)
        self._lock = threading.RLock()
        self._local = _ThreadState()
        self.removed = False
        self._forward_index = 0
        self.training_forwards = 0
        self.next_sample_id = config.first_sample_id
        self._running: dict[int, Sample] = {}  # samples whose forward runs, in any thread
        self._lazy = 0  # lazy opens waiting for a module to run, in any thread (arming stays)
        self._pending: dict[int, Sample] = {}  # forward done, waiting for their backward
        self._finalizers: dict[int, weakref.finalize[Any, Any]] = {}
        self._released: collections.deque[Sample] = collections.deque()  # see _on_graph_released
        self._delivery = DeliveryQueue(self._lock, sink, config.run_id, gate)
        self._profiler = CallProfiler() if config.profile else None
        self._probe = OutputProbe(
            config.measurer,
            failures,
            self._close,
            self._waiting,
            record_inputs=config.record_inputs,
            profiler=self._profiler,
        )
        self._steps = StepRecorder(config.measurer, failures)
        self._joining: set[int] = set()  # records of a rank that does not observe (see open_step)
        self.joins_steps = False  # sharded parameters: sampled steps open records on every rank
        # Told of each sample opened with gradients enabled (its optimizer step may be recorded).
        self.on_training_sample: Callable[[int | None], None] = _ignore
        pre_hooks = config.record_inputs or config.profile
        self.attachment = Attachment(
            model,
            config.layers,
            on_enter=self.on_root_enter,
            on_exit=self.on_root_exit,
            on_output=self._on_output,
            direct=config.capture_direct_forwards,
            on_input=self._on_input if pre_hooks else None,
        )
        self._root_inputs = pre_hooks and self._root_layer is not None

    # -- the forward --------------------------------------------------------------------------

    def on_root_enter(self, args: Any = (), kwargs: Any = None) -> None:
        """A root forward starts: open a sample if the plan and the rank gate say so."""
        local = self._local
        local.depth += 1
        if local.depth > 1 or local.active is not None or self.removed or in_backward():
            return  # nested in a sample, or activation checkpointing recomputing the root
        index = self._forward_index
        self._forward_index += 1
        self.training_forwards += is_grad_enabled()
        if self._gate.admits():
            if self._plan.samples(index):
                self._start(self._plan.step)
                if self._root_inputs and self._root_layer is not None:
                    self._on_input(self._root_layer, args, kwargs or {})
        elif self.joins_steps and self._plan.samples(index) and is_grad_enabled():
            self.on_training_sample(self._plan.step)  # its step record joins the collectives

    def on_root_exit(self, output: Any) -> None:
        """A root forward ends (``output`` is ``None`` if it raised): its sample's forward ends."""
        local = self._local
        local.depth = max(local.depth - 1, 0)
        sample = local.active
        if sample is None:
            return
        if self._root_layer is not None and output is not None:
            self._on_output(self._root_layer, output)
        if local.depth == 0 and not local.explicit:
            if output is not None and sample.recompute.waiting and not sample.handles:
                self._probe.keep_until_backward(sample, output)
            self._end_forward(failed=output is None)

    def open(self, step: int | None, *, lazy: bool = False, scope: str | None = None) -> bool:
        """Start a sample now, ended by ``finish_explicit`` (see ``Observer.open_sample``).

        ``lazy``: arm the hooks now and start the sample at the first selected module that runs
        in this thread (``_observe``); if none runs before ``finish_explicit``, there is none.
        ``scope``: the sample's ``SampleRecord.scope``.
        """
        local = self._local
        if local.active is not None or local.lazy:
            self.finish_explicit()
        self._gate.resolve()
        if self.removed or not self._gate.enabled:
            return False
        local.explicit = True
        if not lazy:
            self._start(step, scope)
            return True
        with self._lock:
            self._lazy += 1
        local.lazy, local.lazy_step, local.lazy_scope = True, step, scope
        self.attachment.arm()
        return True

    def finish_explicit(self) -> None:
        """End the forward of the sample ``open`` started in this thread, if any."""
        local = self._local
        explicit, local.explicit = local.explicit, False
        if self._end_lazy():  # no module ran since the lazy open: no sample of its own
            self.update_arming()
        if explicit:  # what runs in this thread (a root forward's sample, if one) ends too
            self._end_forward(failed=False)

    def _end_lazy(self) -> bool:
        """Forget this thread's lazy open, if one still waits; whether one did (lock re-entered)."""
        local = self._local
        if not local.lazy:
            return False
        local.lazy, local.lazy_step, local.lazy_scope = False, None, None
        with self._lock:
            self._lazy -= 1
        return True

    def _start(self, step: int | None, scope: str | None = None) -> None:
        started = time.perf_counter()
        self._close_released()
        self._delivery.drain(wait=False)
        self._sink.open()
        self._measurer.new_sample(forward=True)
        scale = self._scale.read()
        with self._lock:
            sample = Sample(self.next_sample_id, step, time.time(), scale)
            sample.scope = scope if scope is not None else self._local.lazy_scope
            self.next_sample_id += 1
            sentinel = _Sentinel()
            sample.sentinel = sentinel
            self._finalizers[sample.sample_id] = weakref.finalize(
                sentinel, self._on_graph_released, sample
            )
            self._running[sample.sample_id] = sample
            self._end_lazy()  # a lazy open of this thread is served by this sample, however started
        self._local.active = sample
        self.attachment.arm()
        if sample.grad_enabled:
            self.on_training_sample(step)
        sample.duration_s += time.perf_counter() - started

    def _on_input(self, layer: Layer, args: Any, kwargs: Any) -> None:
        probe = self._probe
        self._observe(
            layer, "the inputs", probe.observe_inputs, probe.observe_recomputed_inputs, args, kwargs
        )

    def _on_output(self, layer: Layer, output: Any) -> None:
        probe = self._probe
        self._observe(layer, "the output", probe.observe, probe.observe_recomputed, output)

    def _observe(
        self,
        layer: Layer,
        what: str,
        in_sample: Callable[..., None],
        recomputed: Callable[..., None],
        *values: Any,
    ) -> None:
        """Hand a layer's inputs or output to the probe; a failure is reported, never raised."""
        local = self._local
        sample = local.active
        if sample is None and local.lazy and not in_backward():
            self._start(local.lazy_step)  # the first module since a lazy open: its sample starts
            sample = local.active
        if sample is None:
            if self._pending and in_backward():
                try:
                    recomputed(layer, *values)
                except Exception as error:  # inside the user's backward: never raise from here
                    message = f"matching {what} of {layer.name} in a recomputation failed"
                    self._failures.failed(message, error, "recompute", OBSERVE_CONSEQUENCE)
            return
        started = time.perf_counter()
        try:
            in_sample(sample, layer, *values)
        except Exception as error:  # an odd tensor must never break the user's forward
            message = f"observing {what} of {layer.name} failed"
            self._failures.failed(message, error, "observe", OBSERVE_CONSEQUENCE)
        sample.duration_s += time.perf_counter() - started

    def _end_forward(self, *, failed: bool) -> None:
        local = self._local
        sample, local.active = local.active, None
        if sample is None:
            return
        self._probe.end_forward(sample, failed=failed)
        self._measurer.kick()
        keep = sample.expects_gradients and not failed
        with self._lock:
            self._running.pop(sample.sample_id, None)
            if keep:
                self._pending[sample.sample_id] = sample
                sample.sentinel = None  # from now on only the graph keeps it alive
        self.update_arming()
        if not keep:
            self._close(sample)

    # -- step records ------------------------------------------------------------------------

    def record_step(
        self, step: int | None, tensors: Iterable[StepTensor | StepScalars]
    ) -> int | None:
        """Measure one optimizer step's tensors into a step record and deliver it like a sample.

        Every rank of a sharded tensor's group must call it for the same steps: a rank that
        does not observe measures its shards and joins the collective, and records nothing.

        Returns:
            The record's id, from the samples' sequence; ``None`` when nothing was recorded (a
            rank that does not observe, or after removal).
        """
        record = self.open_step(step, joins=True)
        if record is None:
            return None
        joining = id(record) in self._joining
        self.measure_step(record, tensors)
        self.deliver_step(record)
        return None if joining else record.sample_id

    def open_step(
        self, step: int | None, note: str | None = None, *, joins: bool = False
    ) -> Sample | None:
        """A new step record with the next id, or ``None`` (a rank that does not observe, removal).

        Measure into it with ``measure_step``, then hand it on with ``deliver_step``; ``note``
        is its ``SampleRecord.note``. With ``joins`` a rank that does not observe gets a record
        that writes nothing: it measures only sharded tensors and joins the collectives that
        combine them (see ``_sharded``), so the observing ranks never wait for it in vain.
        """
        self._gate.resolve()
        if self.removed:
            return None
        if not self._gate.enabled:
            return self._joining_record(step) if joins else None
        started = time.perf_counter()
        self._delivery.drain(wait=False)
        self._sink.open()
        with self._lock:
            record = self._steps.open(self.next_sample_id, step)
            self.next_sample_id += 1
        record.note = note
        record.duration_s += time.perf_counter() - started
        return record

    def _joining_record(self, step: int | None) -> Sample:
        record = self._steps.open(-1, step)
        self._joining.add(id(record))
        return record

    def measure_step(
        self, record: Sample, tensors: Iterable[StepTensor | StepScalars | UnavailableRow]
    ) -> dict[int, Measurement]:
        """Reduce ``tensors`` into ``record``, on their devices; their measurements, by id."""
        return self._steps.measure(record, tensors, writes=id(record) not in self._joining)

    def wait_for_reductions(self) -> None:
        """Block until the workers have reduced every tensor handed to them (``Measurer.wait``).

        A step record's gradients are read where they are, which the optimizer may change once
        its pre-hook returns: the pre-hook waits here first. Its parameters are measured from
        the copies their updates are then formed in (``_step_tensors``): the post-hook waits
        here first too.
        """
        self._measurer.wait()

    def deliver_step(self, record: Sample) -> None:
        """Close the step record: its values start crossing to the host, then reach the sink.

        Its sharded tensors are combined across ranks first, one collective per process group.
        """
        self._steps.combine(record)
        self._measurer.new_sample()  # its subsample positions would outlive the step otherwise
        if id(record) in self._joining:
            self._joining.discard(id(record))
            return
        record.closed = True  # complete: nothing joins it on its way to the host
        self._delivery.push(record)
        self._delivery.drain(wait=False)

    # -- the per-module hooks -----------------------------------------------------------------

    def arm_for_step(self) -> None:
        """Arm the per-module hooks for a sampled step, before its first forward."""
        if self.removed:
            self.update_arming()
            return
        self._gate.resolve()
        if self._gate.enabled:
            self.attachment.arm()

    def update_arming(self) -> None:
        """Remove the per-module hooks unless something still needs them.

        A forward in any thread, a sampled step (for its next micro-batch) or a checkpoint's
        recomputation in the backward (see ``_recompute``) does. Nothing armed, nothing to
        remove: an unsampled step's ``begin_step`` and ``end_step`` take no lock here.
        """
        if not self.attachment.armed:
            return
        with self._lock:
            needed = (
                bool(self._running)
                or self._lazy > 0
                or self._plan.sampling
                or any(s.recompute.waiting for s in self._pending.values())
            )
            if not needed:
                self.attachment.disarm()

    # -- closing, removal and fork -------------------------------------------------------------

    def close_step(self, step: int) -> None:
        """Close the samples of trainer step ``step``; deliver those whose values landed."""
        self._close_released()
        if self._pending:  # an unsampled step has none: no lock
            with self._lock:
                ended = [s for s in self._pending.values() if s.step == step]
            for sample in ended:
                self._close(sample)
        self._delivery.drain(wait=False)

    def flush(self) -> None:
        """Close every pending sample and deliver every closed one, waiting for the device."""
        self._close_released()
        with self._lock:
            pending = list(self._pending.values())
        for sample in pending:
            self._close(sample)
        self._delivery.drain(wait=True)

    def stop(self) -> bool:
        """Mark the observer removed; ``False`` if it already was."""
        with self._lock:
            if self.removed:
                return False
            self.removed = True
            return True

    def cut_short(self) -> None:
        """Close the forwards still running, in every thread; each keeps what it measured."""
        self._local.explicit = False
        self._end_forward(failed=True)
        with self._lock:
            running = list(self._running.values())  # forwards of other threads
            self._running.clear()
        for sample in running:
            self._close(sample)

    def _waiting(self) -> list[Sample]:
        with self._lock:
            return [s for s in self._pending.values() if s.recompute.waiting and not s.closed]

    def _on_graph_released(self, sample: Sample) -> None:
        # Autograd freed the graph: no backward will reach this sample any more. This runs inside
        # garbage collection, where an exception cannot reach the user, so under "raise" the
        # sample is delivered at the next safe point (a root forward, end_step, flush, removal).
        # Garbage collection can also run on the reduction worker, in the middle of a job: that
        # thread must never wait for the lock (its holder may be waiting for the job), so the
        # sample is closed at the next safe point instead.
        if self._measurer.on_worker_thread():
            self._released.append(sample)
            return
        self._close(sample, deliver=not self._failures.raises)

    def _close_released(self) -> None:
        """Close the samples whose graph was freed on the reduction worker (a safe point)."""
        while self._released:
            self._close(self._released.popleft())

    def _close(self, sample: Sample, *, deliver: bool = True) -> None:
        with self._lock:
            with sample.lock:
                if sample.closed:
                    return
                sample.closed = True
            for handle in sample.handles:
                handle.remove()
            sample.handles.clear()
            if self._profiler is not None:
                for profile in sample.profiles:
                    self._profiler.forget(profile)
            finalizer = self._finalizers.pop(sample.sample_id, None)
            if finalizer is not None:
                finalizer.detach()
            self._pending.pop(sample.sample_id, None)
            self._delivery.push(sample)
        if deliver:
            self._delivery.drain(wait=False)

    def abandon(self) -> None:
        """Forget every open sample without delivering it (in a child made by ``fork``)."""
        self._lock = threading.RLock()  # another thread may have held it during the fork
        self._local = _ThreadState()
        self._lazy = 0
        self._running.clear()
        self._pending.clear()
        self._delivery.abandon(self._lock)
        for finalizer in self._finalizers.values():
            finalizer.detach()
        self._finalizers.clear()

    def release(self) -> None:
        """Drop the references to the model's modules and to samples in thread-local state."""
        self._root_layer = None
        self._local = _ThreadState()
