"""The observer: decides which forwards are samples, measures them and hands them to the sink.

Life of a sample: the root pre-hook asks the sampler (or the adapter's step plan) whether this root
forward is sampled; if so the per-module hooks are armed, each selected module's outputs are
reduced on their device and gradient hooks are placed on them. The sample closes when the first
backward that reaches it completes, when autograd frees its graph without a backward, when its
step ends, or at ``flush``/removal, whichever comes first. Then its values cross to the host in one
transfer and the sink receives the ``SampleRecord``.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import is_grad_enabled

from torchinstruments_core import _process
from torchinstruments_core._capture import Attachment, GradientSlot, gradient_signal_site
from torchinstruments_core._config import ErrorPolicy, RankPolicy
from torchinstruments_core._exceptions import (
    ConfigurationError,
    ObservationError,
    ObservationWarning,
)
from torchinstruments_core._nested import iter_tensors
from torchinstruments_core._rank import RankInfo, current_rank
from torchinstruments_core._records import RunInfo, Signal
from torchinstruments_core._sample import Sample, Site
from torchinstruments_core._torch_private import current_graph_task_id, in_backward, queue_callback

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    GradientScale = float | torch.Tensor | Callable[[], float | torch.Tensor | None] | None
    from torch import nn

    from torchinstruments_core._layers import Layer
    from torchinstruments_core._measure import Measurement, Measurer
    from torchinstruments_core._transfer import HostTransfer
    from torchinstruments_core.samplers import Sampler
    from torchinstruments_core.sinks import Sink


@dataclass(frozen=True, slots=True)
class _StepPlan:
    step: int | None
    sample: bool


_IDLE = _StepPlan(step=None, sample=False)
_REDUCER_CONSEQUENCE = "the values it could not compute are recorded as unavailable"
_SINK_CONSEQUENCE = "what the sink did not take is lost"
_SCALE_CONSEQUENCE = "this sample records its gradients as they are, still scaled"
_OBSERVE_CONSEQUENCE = "the values of that output this sample could not take are missing"


def _check_scale(scale: object) -> None:
    """Raise unless ``scale`` is None, a finite number > 0 or a one-element tensor."""
    import torch

    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ConfigurationError.invalid("scale", scale, "a tensor of one element")
        return  # its value stays on the device; reading it would wait for the device
    if scale is not None and (
        isinstance(scale, bool)
        or not isinstance(scale, int | float)
        or not (math.isfinite(scale) and scale > 0)
    ):
        raise ConfigurationError.invalid(
            "scale", scale, "a finite number > 0, a one-element tensor, a function, or None"
        )


class _Sentinel:
    """Lives exactly as long as some gradient hook of a sample (see ``GradientSlot.sentinel``)."""


class _ThreadState(threading.local):
    """What one thread's forward is doing: concurrent forwards are separate samples."""

    depth = 0
    active: Sample | None = None
    explicit = False


@dataclass(frozen=True, slots=True)
class ObserverConfig:
    """Everything an observer needs besides the model, validated by ``inject_observer``."""

    layers: list[Layer]
    sampler: Sampler
    measurer: Measurer
    sink: Sink
    rank_policy: RankPolicy
    error_policy: ErrorPolicy
    capture_direct_forwards: bool
    run_id: str
    first_sample_id: int = 0


class Observer:
    """Observes one model. Create it with ``inject_observer``; remove it with ``remove``.

    Usable as a context manager: leaving the ``with`` block removes it.
    """

    def __init__(self, model: nn.Module, config: ObserverConfig) -> None:
        self._model: nn.Module | None = model
        self._model_class = type(model).__qualname__
        self._config = config
        self._layers = config.layers
        self._root_layer = next((x for x in config.layers if x.module is model), None)
        self._lock = threading.RLock()
        self._pid = os.getpid()  # only this process delivers samples and finalizes the run
        self._rank: RankInfo | None = None
        self._enabled = True
        self._sink_open = False
        self._removed = False
        self._local = _ThreadState()
        self._forward_index = 0
        self._training_forwards = 0
        self._next_sample_id = config.first_sample_id
        self._running: dict[int, Sample] = {}  # samples whose forward runs, in any thread
        self._plan: _StepPlan | None = None
        self._gradient_scale: GradientScale = None
        self._pending: dict[int, Sample] = {}
        self._finalizers: dict[int, weakref.finalize[Any, Any]] = {}
        self._in_flight: collections.deque[tuple[Sample, HostTransfer]] = collections.deque()
        self._draining = False
        self._warned: set[str] = set()
        self._attachment = Attachment(
            model,
            config.layers,
            on_enter=self._on_root_enter,
            on_exit=self._on_root_exit,
            on_output=self._on_output,
            direct=config.capture_direct_forwards,
        )

    # -- public surface ----------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        """Identifier of this run (generated per process unless ``run_id`` was given)."""
        return self._config.run_id

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Clean names of the observed modules, in model order."""
        return tuple(layer.name for layer in self._layers)

    @property
    def focus_layer_names(self) -> tuple[str, ...]:
        """The focus layers: their tensors also get histograms, and adapters route their scalars."""
        return tuple(layer.name for layer in self._layers if layer.histogram)

    @property
    def histogram_layer_names(self) -> tuple[str, ...]:
        """Deprecated name of ``focus_layer_names`` (warns)."""
        message = "Observer.histogram_layer_names is deprecated; use Observer.focus_layer_names"
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return self.focus_layer_names

    @property
    def attached(self) -> bool:
        """Whether hooks are in place (``False`` after removal and on ranks that do not observe)."""
        return not self._removed and self._enabled

    @property
    def next_sample_id(self) -> int:
        """The ``sample_id`` of the next sample (samples taken so far plus ``first_sample_id``)."""
        return self._next_sample_id

    @property
    def samples_taken(self) -> int:
        """Deprecated name of ``next_sample_id`` (warns)."""
        warnings.warn(
            "Observer.samples_taken is deprecated; use Observer.next_sample_id",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.next_sample_id

    @property
    def training_forwards(self) -> int:
        """Root forwards run so far with gradients enabled (an evaluation under no_grad is not)."""
        return self._training_forwards

    def begin_step(self, step: int, *, sample: bool) -> None:
        """Announce that the coming root forwards belong to trainer step ``step``.

        Every root forward until ``end_step`` is sampled when ``sample`` is true (all micro-batches
        of an accumulated step), and none is otherwise. Once an adapter calls this, the sampler is
        no longer consulted: forwards outside ``begin_step``/``end_step`` are not sampled.

        A sampled step arms the per-module hooks now, before its first forward, and keeps them
        until ``end_step``: a compiled model then runs the whole step as plain Python (see
        ``force_eager``) instead of compiling a variant of its graph with the hooks in it.
        """
        self._plan = _StepPlan(step=step, sample=sample)
        if sample and not self._removed:
            self._resolve_rank()
            if self._enabled:
                self._attachment.arm()
        else:
            self._update_arming()  # a sampled step that never saw its end_step

    def open_sample(self, step: int | None = None) -> bool:
        """Start a sample now, without waiting for a root forward.

        For trainers whose step is not a call of the observed module (a LightningModule's
        ``training_step`` calls its submodules): every selected module called until
        ``finish_forward`` belongs to this sample, and the gradients flowing back into their
        outputs are matched to it as usual.

        Returns:
            Whether a sample was opened (``False`` on a rank that does not observe, or after
            removal).
        """
        if self._local.active is not None:
            self.finish_forward()
        self._resolve_rank()
        if self._removed or not self._enabled:
            return False
        self._local.explicit = True
        self._start(step)
        return True

    def finish_forward(self) -> None:
        """End the forward part of the sample opened with ``open_sample``.

        It then waits for its backward, or closes at once when no output can receive a gradient.
        """
        local = self._local
        explicit, local.explicit = local.explicit, False
        if explicit:
            self._end_forward(failed=False)

    def set_gradient_scale(self, scale: GradientScale) -> None:
        """Report gradients divided by ``scale`` in the samples opened from now on.

        Under fp16 mixed precision the loss is multiplied by a loss scale before the backward,
        so every gradient is too; an adapter passes the scaler's scale so that the recorded
        gradients are the unscaled ones. ``None`` (the default) records them as they are.

        Args:
            scale: A number; a one-element tensor, on any device, that the gradients are divided
                by on their device, so nothing waits for the device to read it (a GPU scaler's
                scale is such a tensor: ``scaler.scale(torch.ones((), device=device))``); a
                function returning either (or ``None``), called when each sample opens, so it
                sees the scale of that step's backward even if the scaler changes it after this
                call; or ``None``.

        Raises:
            ConfigurationError: If ``scale`` is a number that is not finite and positive, or of
                another type.
        """
        if not callable(scale):
            _check_scale(scale)
        self._gradient_scale = scale

    def _current_gradient_scale(self) -> float | torch.Tensor | None:
        scale = self._gradient_scale
        if not callable(scale):
            return scale
        try:
            value = scale()
            _check_scale(value)
        except Exception as error:  # an adapter's scale reader must never break the forward
            self._failed(
                "the gradient scale could not be read", error, "gradient-scale", _SCALE_CONSEQUENCE
            )
            return None
        return value

    def end_step(self) -> None:
        """Announce that the current step has ended: its samples close and go to the sink.

        Until the next ``begin_step`` no root forward is sampled.
        """
        plan, self._plan = self._plan, _IDLE
        self._update_arming()
        if plan is None or plan.step is None:
            return
        with self._lock:
            ended = [s for s in self._pending.values() if s.step == plan.step]
        for sample in ended:
            self._close(sample)
        self._drain(wait=False)

    def flush(self) -> None:
        """Close every open sample and wait until the sink has received all of them."""
        with self._lock:
            pending = list(self._pending.values())
        for sample in pending:
            self._close(sample)
        self._drain(wait=True)

    def remove(self) -> None:
        """Remove every hook, deliver every sample and close the sink. Safe to call again."""
        with self._lock:
            if self._removed:
                return
            self._removed = True
        self._attachment.detach()
        _process.unregister(self)
        self._local.explicit = False
        self._end_forward(failed=True)  # a forward cut short (an exception) keeps what it measured
        with self._lock:
            cut_short = list(self._running.values())  # forwards of other threads
            self._running.clear()
        for sample in cut_short:
            self._close(sample)
        try:
            if self._enabled:
                try:
                    self.flush()
                finally:  # the sink is closed (its files finalized) even if delivery raised
                    self._open_sink()
                    self._guard("close", self._config.sink.close)
        finally:
            self._release_references()

    def __enter__(self) -> Observer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "attached" if self.attached else "removed"
        return f"Observer({self._model_class}, layers={len(self._layers)}, {state})"

    # -- attachment ---------------------------------------------------------------------------

    def _attach(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self._resolve_rank()
        if self._enabled:
            self._attachment.attach()
            # A script that never removes its observer still gets a finalized run directory,
            # at exit (a multiprocessing child's too) or on SIGTERM.
            _process.register(self)

    def become_inert(self) -> None:
        """Stop observing for good, in a child process that ``fork`` made (see ``_process``).

        The child inherits this observer's hooks and open samples but not the sink's writer
        thread: it samples nothing, delivers nothing and never finalizes the parent's run.
        """
        self._lock = threading.RLock()  # another thread may have held it during the fork
        self._enabled = False
        self._rank = self._rank or RankInfo(rank=-1, world_size=0)  # never resolved again
        self._local = _ThreadState()
        self._running.clear()
        self._pending.clear()
        self._in_flight.clear()
        for finalizer in self._finalizers.values():
            finalizer.detach()
        self._finalizers.clear()

    def _release_references(self) -> None:
        _process.unregister(self)
        self._config.measurer.new_sample()  # drop the cached subsample positions
        from torchinstruments_core._registry import forget

        if self._model is not None:
            forget(self._model, self)
        self._model = None
        self._layers = []
        self._root_layer = None
        self._local = _ThreadState()

    def _resolve_rank(self) -> RankInfo:
        if self._rank is None:
            self._rank = current_rank()
            self._enabled = self._config.rank_policy is RankPolicy.ALL or self._rank.rank == 0
        return self._rank

    # -- the forward --------------------------------------------------------------------------

    def _on_root_enter(self) -> None:
        local = self._local
        local.depth += 1
        if local.depth > 1 or local.active is not None or self._removed or in_backward():
            return  # nested in a sample, or activation checkpointing recomputing the root
        index = self._forward_index
        self._forward_index += 1
        self._training_forwards += is_grad_enabled()
        if self._decide(index):
            self._start(self._plan.step if self._plan is not None else None)

    def _decide(self, forward_index: int) -> bool:
        self._resolve_rank()
        if not self._enabled:
            return False
        if self._plan is None:
            return self._config.sampler.should_sample(forward_index)
        return self._plan.sample

    def _start(self, step: int | None) -> None:
        started = time.perf_counter()
        self._drain(wait=False)
        self._open_sink()
        self._config.measurer.new_sample()
        scale = self._current_gradient_scale()
        with self._lock:
            sample = Sample(self._next_sample_id, step, time.time(), scale)
            self._next_sample_id += 1
            sentinel = _Sentinel()
            sample.sentinel = sentinel
            self._finalizers[sample.sample_id] = weakref.finalize(
                sentinel, self._on_graph_released, sample
            )
            self._running[sample.sample_id] = sample
        self._local.active = sample
        self._attachment.arm()
        sample.duration_s += time.perf_counter() - started

    def _on_root_exit(self, output: Any) -> None:
        local = self._local
        local.depth = max(local.depth - 1, 0)
        sample = local.active
        if sample is None:
            return
        if self._root_layer is not None and output is not None:
            self._on_output(self._root_layer, output)
        if local.depth == 0 and not local.explicit:
            if output is not None and sample.recompute.waiting and not sample.handles:
                self._keep_until_backward(sample, output)
            self._end_forward(failed=output is None)

    def _end_forward(self, *, failed: bool) -> None:
        local = self._local
        sample, local.active = local.active, None
        if sample is None:
            return
        keep = sample.expects_gradients and not failed
        with self._lock:
            self._running.pop(sample.sample_id, None)
            if keep:
                self._pending[sample.sample_id] = sample
                sample.sentinel = None  # from now on only the graph keeps it alive
        self._update_arming()
        if not keep:
            self._close(sample)

    def _update_arming(self) -> None:
        """Remove the per-module hooks unless something still needs them.

        A forward in any thread, a sampled step (for its next micro-batch) or a checkpoint's
        recomputation in the backward (see ``_recompute``) does.
        """
        with self._lock:
            needed = (
                bool(self._running)
                or (self._plan is not None and self._plan.sample)
                or any(s.recompute.waiting for s in self._pending.values())
            )
            if not needed:
                self._attachment.disarm()

    def _on_output(self, layer: Layer, output: Any) -> None:
        sample = self._local.active
        if sample is None:
            if self._pending and in_backward():
                try:
                    self._on_recomputed_output(layer, output)
                except Exception as error:  # inside the user's backward: never raise from here
                    what = f"matching the recomputed output of {layer.name} failed"
                    self._failed(what, error, "recompute", _OBSERVE_CONSEQUENCE)
            return
        started = time.perf_counter()
        try:
            self._observe(sample, layer, output)
        except Exception as error:  # an odd output must never break the user's forward
            self._failed(
                f"observing the output of {layer.name} failed",
                error,
                "observe",
                _OBSERVE_CONSEQUENCE,
            )
        sample.duration_s += time.perf_counter() - started

    def _observe(self, sample: Sample, layer: Layer, output: Any) -> None:
        call_index = sample.next_call_index(layer.name)
        for path, tensor in iter_tensors(output):
            site = Site(layer.name, call_index, Signal.OUTPUT, path)
            sample.add(site, self._measure(tensor, site, layer.histogram))
            if tensor.requires_grad:
                self._watch_gradient(sample, site, tensor, layer.histogram)
            elif sample.grad_enabled and tensor.is_floating_point() and not is_grad_enabled():
                # computed without autograd inside a forward with it: reentrant checkpointing,
                # whose recomputation in the backward carries the gradient (see _recompute)
                gradient_site = gradient_signal_site(site)
                sample.recompute.expect(gradient_site)
                sample.expect_gradient(gradient_site, self._config.measurer.metrics)

    def _watch_gradient(
        self, sample: Sample, site: Site, tensor: torch.Tensor, histogram: bool
    ) -> None:
        gradient_site = gradient_signal_site(site)
        slot = GradientSlot(self._on_gradient, sample, gradient_site, histogram, sample.sentinel)
        sample.handles.append(tensor.register_hook(slot))  # type: ignore[no-untyped-call]
        sample.expect_gradient(gradient_site, self._config.measurer.metrics)

    def _keep_until_backward(self, sample: Sample, output: Any) -> None:
        # Every observed output waits for a recomputation, so no gradient hook holds the sample's
        # graph: hooks on the root's outputs keep it (and start its backward) without measuring.
        for _, tensor in iter_tensors(output):
            if tensor.requires_grad:
                slot = GradientSlot(self._on_gradient, sample, None, False, sample.sentinel)
                sample.handles.append(tensor.register_hook(slot))  # type: ignore[no-untyped-call]

    def _on_recomputed_output(self, layer: Layer, output: Any) -> None:
        sample = self._recomputed_sample(current_graph_task_id())
        if sample is None:
            return
        call_index = sample.recompute.match(layer.name)
        if call_index is None:
            return
        for path, tensor in iter_tensors(output):
            site = Site(layer.name, call_index, Signal.OUTPUT_GRADIENT, path)
            if tensor.requires_grad and sample.recompute.take(site):
                # its gradient arrives in the checkpoint's own, nested backward
                slot = GradientSlot(self._on_gradient, sample, site, layer.histogram, None)
                slot.nested = True
                sample.handles.append(tensor.register_hook(slot))  # type: ignore[no-untyped-call]

    def _recomputed_sample(self, task: int) -> Sample | None:
        """The pending sample whose backward (graph task ``task``) recomputes a checkpoint."""
        with self._lock:
            waiting = [s for s in self._pending.values() if s.recompute.waiting and not s.closed]
        for sample in waiting:
            if sample.backward_task == task:
                return sample
        for sample in reversed(waiting):  # no gradient reached it yet: this backward is its own
            with sample.lock:
                if sample.backward_task is None and not sample.closed:
                    sample.backward_task = task
                    queue_callback(functools.partial(self._on_backward_done, sample))
                    return sample
        return None

    # -- the backward -------------------------------------------------------------------------

    def _on_gradient(self, slot: GradientSlot, grad: torch.Tensor) -> None:
        sample = slot.sample
        started = time.perf_counter()
        task = current_graph_task_id()
        with sample.lock:
            if sample.closed:
                return
            if sample.backward_task is None:
                sample.backward_task = task
                queue_callback(functools.partial(self._on_backward_done, sample))
            elif sample.backward_task != task and not slot.nested:
                return  # only the first backward that reaches a sample is recorded
        if slot.site is None:
            return  # a hook that only marks the backward's start (see _keep_until_backward)
        measurement = self._measure(grad, slot.site, slot.histogram, sample.gradient_scale)
        sample.add(slot.site, measurement)
        sample.duration_s += time.perf_counter() - started

    def _on_backward_done(self, sample: Sample) -> None:
        self._close(sample)

    def _on_graph_released(self, sample: Sample) -> None:
        # Autograd freed the graph: no backward will reach this sample any more. This runs inside
        # garbage collection, where an exception cannot reach the user, so under "raise" the
        # sample is delivered at the next safe point (a root forward, end_step, flush, removal).
        self._close(sample, deliver=self._config.error_policy is ErrorPolicy.WARN)

    # -- closing and delivery -----------------------------------------------------------------

    def _close(self, sample: Sample, *, deliver: bool = True) -> None:
        with self._lock:
            with sample.lock:
                if sample.closed:
                    return
                sample.closed = True
            for handle in sample.handles:
                handle.remove()
            sample.handles.clear()
            finalizer = self._finalizers.pop(sample.sample_id, None)
            if finalizer is not None:
                finalizer.detach()
            self._pending.pop(sample.sample_id, None)
            started = time.perf_counter()
            transfer = sample.start_transfer()
            sample.duration_s += time.perf_counter() - started
            self._in_flight.append((sample, transfer))
        if deliver:
            self._drain(wait=False)

    def _drain(self, *, wait: bool) -> None:
        with self._lock:
            if self._draining:
                return  # a sink write re-entered the observer; the outer drain delivers
            self._draining = True
            try:
                while self._in_flight:
                    sample, transfer = self._in_flight[0]
                    if not wait and not transfer.ready():
                        break
                    self._in_flight.popleft()
                    self._deliver(sample, transfer)
            finally:
                self._draining = False

    def _deliver(self, sample: Sample, transfer: HostTransfer) -> None:
        if os.getpid() != self._pid:
            return  # a forked child never writes into the parent's run
        rank = self._resolve_rank().rank
        record = sample.build(transfer, run_id=self._config.run_id, rank=rank)
        self._guard(f"write sample {record.sample_id}", self._config.sink.write, record)

    def _open_sink(self) -> None:
        with self._lock:
            if self._sink_open:
                return
            self._sink_open = True
        self._guard("open the run", self._config.sink.open, self._run_info())

    def _run_info(self) -> RunInfo:
        rank = self._resolve_rank()
        plan = "step-driven by the trainer adapter" if self._plan is not None else None
        return RunInfo(
            run_id=self._config.run_id,
            rank=rank.rank,
            world_size=rank.world_size,
            rank_policy=str(self._config.rank_policy),
            model_class=self._model_class,
            sampling_policy=plan or repr(self._config.sampler),
            layers=tuple(layer.info() for layer in self._layers),
            metrics=self._config.measurer.metrics,
        )

    # -- failures -----------------------------------------------------------------------------

    def _measure(
        self,
        tensor: torch.Tensor,
        site: Site,
        histogram: bool,
        scale: float | torch.Tensor | None = None,
    ) -> Measurement:
        measurement = self._config.measurer.measure(tensor, with_histogram=histogram, scale=scale)
        for error in measurement.errors:
            where = f"{site.layer} call {site.call_index} {site.signal} {site.tensor_path}"
            key = f"reducer:{type(error).__name__}"
            self._failed(f"a reducer failed on {where}", error, key, _REDUCER_CONSEQUENCE)
        return measurement

    def _guard(self, action: str, function: Callable[..., None], *args: Any) -> None:
        try:
            function(*args)
        except Exception as error:
            sink = type(self._config.sink).__name__
            what = f"the sink {sink} could not {action}"
            self._failed(what, error, f"sink:{action.split()[0]}", _SINK_CONSEQUENCE)

    def _failed(self, what: str, error: BaseException, key: str, consequence: str) -> None:
        message = f"torchinstruments: {what}: {type(error).__name__}: {error}"
        if self._config.error_policy is ErrorPolicy.RAISE:
            raise ObservationError(message) from error
        if key not in self._warned:  # one warning per cause, not one per step
            self._warned.add(key)
            warnings.warn(
                f"{message}. Training continues; {consequence}. Further failures of this kind "
                "are not reported again. Pass error_policy='raise' to stop instead.",
                ObservationWarning,
                stacklevel=2,
            )
