"""Measuring a sample's outputs and inputs and matching the gradients that flow back into them.

In a sampled forward each observed output (and, with ``record_inputs``, each input tensor,
positional and keyword) is reduced on its device and, when it can take a gradient, gets a tensor
hook (a ``GradientSlot``) that records the gradient of the first backward that reaches the
sample. Tensors computed without autograd inside a forward with autograd (reentrant activation
checkpointing) get their gradients from the recomputation in the backward: the recomputed call is
matched to the original one by ``_recompute``. With ``profile`` the same hooks mark where each
call's forward and backward start and end (see ``_profile``).
"""

from __future__ import annotations

import functools
import time
import weakref
from typing import TYPE_CHECKING, Any

from torch import is_grad_enabled

from torchinstruments_core._capture import GradientSlot, gradient_signal_site
from torchinstruments_core._failures import REDUCER_CONSEQUENCE
from torchinstruments_core._hooks import run_eagerly
from torchinstruments_core._measurement import shareable
from torchinstruments_core._nested import iter_tensors
from torchinstruments_core._profile import CallProfile, CallProfiler, call_device
from torchinstruments_core._records import Signal
from torchinstruments_core._sample import Sample, Site
from torchinstruments_core._signals import fixed_root
from torchinstruments_core._torch_private import (
    current_graph_task_id,
    queue_callback,
    version,
    view_base,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import torch

    from torchinstruments_core._failures import FailureReport
    from torchinstruments_core._layers import Layer
    from torchinstruments_core._measure import Measurer
    from torchinstruments_core._measurement import Measurement

LEARN_BYTES = 8 * 2**20
"""Storage a sample may keep alive to learn which outputs its forward leaves unchanged (8 MiB)."""

_OUTPUT_ROOT = fixed_root(Signal.OUTPUT)
_INPUT_ROOT = fixed_root(Signal.INPUT)


def input_tensors(args: Any, kwargs: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a call's arguments: ``input.0``, ``input.1.key``, ``input.x`` (keyword)."""
    return [*iter_tensors(tuple(args), _INPUT_ROOT), *iter_tensors(dict(kwargs), _INPUT_ROOT)]


class OutputProbe:
    """Owns what is measured on which tensor of a sample, and which sample a gradient belongs to.

    Args:
        measurer: Reduces each tensor on its device.
        failures: Where a failing reducer is reported.
        close: Closes a sample; called when the first backward that reached it completes.
        waiting: The open samples whose outputs still wait for a checkpoint's recomputation.
        record_inputs: Measure the input tensors of each call and their gradients.
        profiler: Times each call (and reads CUDA memory) when ``profile`` is on.
    """

    __slots__ = (
        "_changed",
        "_close",
        "_eager_gradient",
        "_failures",
        "_measurer",
        "_profiler",
        "_unchanged",
        "_waiting",
        "record_inputs",
    )

    def __init__(
        self,
        measurer: Measurer,
        failures: FailureReport,
        close: Callable[[Sample], None],
        waiting: Callable[[], list[Sample]],
        *,
        record_inputs: bool = False,
        profiler: CallProfiler | None = None,
    ) -> None:
        self._measurer = measurer
        self._failures = failures
        self._close = close
        self._waiting = waiting
        self.record_inputs = record_inputs
        self._profiler = profiler
        self._eager_gradient = run_eagerly(self._on_gradient)  # what every GradientSlot calls
        # what the reduction worker reads without a copy (``Measurer.measure``'s ``shared``)
        self._changed: set[Site] = set()  # changed in place after their hook: always copied
        self._unchanged: set[Site] = set()  # outputs a whole forward left as they were: shared

    def observe_inputs(self, sample: Sample, layer: Layer, args: Any, kwargs: Any) -> None:
        """A call starts: measure its inputs, watch their gradients, start its profile."""
        call_index = sample.next_call_index(layer.name)
        tensors = input_tensors(args, kwargs)
        profile, began = None, None
        if self._profiler is not None:
            device = call_device((t for _, t in tensors), layer.module)
            profile = CallProfile(layer.name, call_index, device)
            began = self._profiler.stamp(device)
        sample.open_call(layer.name, call_index, profile)
        for path, tensor in tensors:
            site = Site(layer.name, call_index, Signal.INPUT, path) if self.record_inputs else None
            if site is not None:
                measure = functools.partial(self._measure, tensor, site, layer.histogram)
                self._add(sample, site, tensor, layer.histogram, None, measure, copied=True)
            self._watch_input(sample, site, tensor, layer.histogram, profile)
        if self._profiler is not None and profile is not None and began is not None:
            # measuring the inputs is the observer's work, left out of every call's time
            sample.overhead.append((began, self._profiler.start_forward(profile)))

    def observe(self, sample: Sample, layer: Layer, output: Any) -> None:
        """Measure each tensor of ``output`` and watch for the gradients flowing back into it."""
        call_index, profile = sample.end_call(layer.name)
        end = None
        if self._profiler is not None and profile is not None:
            end = self._profiler.end_forward(profile)
        for path, tensor in iter_tensors(output, _OUTPUT_ROOT):
            site = Site(layer.name, call_index, Signal.OUTPUT, path)
            measure = functools.partial(self._measure_output, sample, tensor, site, layer.histogram)
            self._add(sample, site, tensor, layer.histogram, None, measure)
            if tensor.requires_grad:
                self._watch_gradient(sample, site, tensor, layer.histogram, profile)
                if profile is not None:
                    profile.backward_expected = True
            elif sample.grad_enabled and tensor.is_floating_point() and not is_grad_enabled():
                # computed without autograd inside a forward with it: reentrant checkpointing,
                # whose recomputation in the backward carries the gradient (see _recompute)
                self._expect_recomputed(sample, site)
        if self._profiler is not None and profile is not None and end is not None:
            sample.overhead.append((end, self._profiler.stamp(profile.device)))

    def _watch_input(
        self,
        sample: Sample,
        site: Site | None,
        tensor: torch.Tensor,
        histogram: bool,
        profile: CallProfile | None,
    ) -> None:
        if is_grad_enabled():
            if tensor.requires_grad and (site is not None or profile is not None):
                self._watch_gradient(sample, site, tensor, histogram, profile, ends=True)
                if profile is not None:
                    profile.inputs_expected += 1
        elif site is not None and sample.grad_enabled and tensor.is_floating_point():
            self._expect_recomputed(sample, site)  # inside a reentrant checkpoint

    def _expect_recomputed(self, sample: Sample, site: Site) -> None:
        gradient_site = gradient_signal_site(site)
        sample.recompute.expect(gradient_site)
        sample.expect_gradient(gradient_site, self._measurer.metrics)

    def keep_until_backward(self, sample: Sample, output: Any) -> None:
        """Hold ``sample``'s graph through the root's outputs, measuring nothing there.

        Every observed output waits for a recomputation, so no gradient hook holds the graph:
        these hooks keep it (and start the sample's backward) instead.
        """
        for _, tensor in iter_tensors(output, _OUTPUT_ROOT):
            if tensor.requires_grad:
                slot = GradientSlot(self._eager_gradient, sample, None, False, sample.sentinel)
                sample.handles.append(tensor.register_hook(slot))  # type: ignore[no-untyped-call]

    def observe_recomputed_inputs(self, layer: Layer, args: Any, kwargs: Any) -> None:
        """Watch the gradients of the inputs of a call a checkpoint recomputes in the backward."""
        sample = self._recomputed_sample(current_graph_task_id())
        if sample is None:
            return
        call_index = sample.recompute.begin(layer.name)
        if call_index is not None and self.record_inputs:
            tensors = input_tensors(args, kwargs)
            self._watch_recomputed(sample, layer, call_index, Signal.INPUT, tensors)

    def observe_recomputed(self, layer: Layer, output: Any) -> None:
        """Watch the gradients of an output a checkpoint recomputes in the backward."""
        sample = self._recomputed_sample(current_graph_task_id())
        if sample is None:
            return
        call_index = sample.recompute.end(layer.name)
        if call_index is not None:
            tensors = iter_tensors(output, _OUTPUT_ROOT)
            self._watch_recomputed(sample, layer, call_index, Signal.OUTPUT, tensors)

    def _watch_recomputed(
        self,
        sample: Sample,
        layer: Layer,
        call_index: int,
        signal: Signal,
        tensors: Iterable[tuple[str, torch.Tensor]],
    ) -> None:
        for path, tensor in tensors:
            site = gradient_signal_site(Site(layer.name, call_index, signal, path))
            if tensor.requires_grad and sample.recompute.take(site):
                # its gradient arrives in the checkpoint's own, nested backward
                slot = GradientSlot(self._eager_gradient, sample, site, layer.histogram, None)
                slot.nested = True
                sample.handles.append(tensor.register_hook(slot))  # type: ignore[no-untyped-call]

    def _watch_gradient(
        self,
        sample: Sample,
        site: Site | None,
        tensor: torch.Tensor,
        histogram: bool,
        profile: CallProfile | None = None,
        *,
        ends: bool = False,
    ) -> None:
        """Hook ``tensor``'s gradient; with ``profile``, it starts (or ``ends``) a backward."""
        if profile is not None:
            self._boundary(sample, tensor).append((profile, ends))
        if site is None:
            return
        gradient_site = gradient_signal_site(site)
        slot = GradientSlot(
            self._eager_gradient, sample, gradient_site, histogram, _sentinel(sample, tensor)
        )
        sample.handles.append(tensor.register_hook(slot))  # type: ignore[no-untyped-call]
        sample.expect_gradient(gradient_site, self._measurer.metrics)

    def _boundary(self, sample: Sample, tensor: torch.Tensor) -> list[tuple[CallProfile, bool]]:
        """The calls whose backward starts or ends when ``tensor``'s gradient arrives.

        One hook per tensor, registered before the hooks that measure its gradient: it stamps
        every such call at once, so a parent's window and its child's share their edges, and
        the measurements come after the stamps (inside the windows they start, subtracted).
        """
        found = sample.boundaries.get(id(tensor))
        if found is not None and found[0]() is tensor:
            return found[1].boundary
        slot = GradientSlot(self._eager_gradient, sample, None, False, _sentinel(sample, tensor))
        sample.handles.append(tensor.register_hook(slot))  # type: ignore[no-untyped-call]
        sample.boundaries[id(tensor)] = (weakref.ref(tensor), slot)
        return slot.boundary

    def _recomputed_sample(self, task: int) -> Sample | None:
        """The open sample whose backward (graph task ``task``) recomputes a checkpoint."""
        waiting = self._waiting()
        for sample in waiting:
            if sample.backward_task == task:
                return sample
        for sample in reversed(waiting):  # no gradient reached it yet: this backward is its own
            with sample.lock:
                if sample.backward_task is None and not sample.closed:
                    sample.backward_task = task
                    queue_callback(functools.partial(self._close, sample))
                    return sample
        return None

    def _on_gradient(self, slot: GradientSlot, grad: torch.Tensor) -> None:
        sample = slot.sample
        started = time.perf_counter()
        task = current_graph_task_id()
        with sample.lock:
            if sample.closed:
                return
            if sample.backward_task is None:
                sample.backward_task = task
                queue_callback(functools.partial(self._close, sample))
            elif sample.backward_task != task and not slot.nested:
                return  # only the first backward that reaches a sample is recorded
        if slot.boundary and self._profiler is not None:
            self._profiler.cross(slot.boundary)
        if slot.site is not None:
            self._record_gradient(slot, grad)
        sample.duration_s += time.perf_counter() - started

    def _record_gradient(self, slot: GradientSlot, grad: torch.Tensor) -> None:
        assert slot.site is not None, "only slots with a site measure"
        sample, profiler, site = slot.sample, self._profiler, slot.site
        measure = functools.partial(self._measure_gradient, grad, site, slot.histogram, sample)
        scale = sample.gradient_scale
        if profiler is None:
            self._add(sample, site, grad, slot.histogram, scale, measure, computed=True)
            return
        device = call_device(iter((grad,)), None)
        began = profiler.stamp(device)  # the observer's work: left out of every call's time
        self._add(sample, site, grad, slot.histogram, scale, measure, computed=True)
        sample.overhead.append((began, profiler.stamp(device)))

    def _add(
        self,
        sample: Sample,
        site: Site,
        tensor: torch.Tensor,
        histogram: bool,
        scale: float | torch.Tensor | None,
        measure: Callable[[], Measurement],
        *,
        computed: bool | None = None,
        copied: bool = False,
    ) -> None:
        """Add ``site``'s measurement of ``tensor`` to ``sample``, measuring it only if need be.

        A tensor this sample measured already, unchanged since (a module's input that is the
        previous one's output, what an ``nn.Identity`` returns, the gradient flowing into
        both), reuses that measurement (``Sample.measured``): its values are what measuring
        it again would give, at the cost of none of its reductions. With ``record_inputs``
        that is about half of every tensor measured.

        Only tensors that autograd made are remembered (``computed``: a gradient; ``None``:
        ``_computed`` decides), whose memory only torch's ops write: an input refilled from a
        numpy array between two calls keeps its version. A ``copied`` site (an input, whose
        values at the call's start are kept even if the module then changes it in place) does
        not reuse a measurement the worker still reads in place.
        """
        measurement = sample.measured(tensor, histogram, scale)
        if measurement is not None and copied and measurement.shared is not None:
            measurement = None
        if measurement is None:
            measurement = measure()
            if computed or (computed is None and _computed(tensor)):
                groups = self._measurer.process_groups()
                sample.remember(tensor, histogram, scale, measurement, groups=groups)
        sample.add(site, measurement, histogram=histogram)

    def _measure(self, tensor: torch.Tensor, site: Site, histogram: bool) -> Measurement:
        return measure_site(self._measurer, self._failures, tensor, site, histogram)

    def _measure_output(
        self, sample: Sample, tensor: torch.Tensor, site: Site, histogram: bool
    ) -> Measurement:
        """An output: copied for the worker until a forward shows nothing changes it after.

        The model often changes an output in place once its hook has returned (an in-place
        ReLU after a convolution, ``out += identity``). The first time, the output is copied,
        and it is held (a detached alias, which shares its version counter) until the forward
        ends, with its version noted; if the version is unchanged then (``end_forward``), later
        samples hand the output over without a copy (``shared``), and a change through torch's
        in-place ops then still drops that sample's values instead of mixing them
        (``modified_in_place``). Holding keeps an output the model frees early (a BatchNorm's
        output once the ReLU after it has read it) until the forward ends, so a sample holds at
        most ``LEARN_BYTES`` of outputs (the storage each one keeps); past that an output is
        only weakly referenced, and if it is freed before the forward ends it stays copied and
        is held in a later sample. Only what autograd computed is ever shared, or a view of it:
        not a view of an input (a numpy array a loop refills), a buffer or a parameter. A small
        sample's outputs go to the kernels' queue (``Measurer.queues``), which copies every
        tensor: none is shared, held or learned from there.
        """
        measurer = self._measurer
        if measurer.queues:  # the kernels' queue copies every tensor: nothing to share or learn
            return self._measure_shared(tensor, site, histogram, None, shared=False)
        computed = _computed(tensor)
        shared = computed and site in self._unchanged
        measurement = self._measure_shared(tensor, site, histogram, None, shared=shared)
        learn = computed and not shared and site not in self._changed
        groups = measurer.process_groups
        if learn and measurement.worker is not None and shareable(tensor, groups=groups()):
            sample.unverified.append((site, _hold(sample, tensor), version(tensor)))
        return measurement

    def end_forward(self, sample: Sample, *, failed: bool = False) -> None:
        """The sample's forward ended: its outputs not changed in place are shared from now on.

        An output that was not held and has been freed meanwhile teaches nothing (it stays
        copied, and is held in a later sample), and neither does a forward that raised (what
        would have changed an output may not have run). The held outputs are let go.
        """
        unverified = [] if failed else sample.unverified
        for site, held, seen in unverified:
            tensor = held() if isinstance(held, weakref.ref) else held
            if tensor is not None:
                (self._unchanged if version(tensor) == seen else self._changed).add(site)
        sample.unverified.clear()
        sample.held_bytes = 0

    def _measure_gradient(
        self, grad: torch.Tensor, site: Site, histogram: bool, sample: Sample
    ) -> Measurement:
        """A gradient autograd handed to a hook: it only reads it, so no copy (``shared``).

        Code of the model's may still change it in place (a custom ``backward`` scaling its
        ``grad_output``): the sample that read it then has no values for it
        (``modified_in_place``), and from that check on its gradient is copied.
        """
        shared = not self._measurer.queues and site not in self._changed
        return self._measure_shared(grad, site, histogram, sample.gradient_scale, shared=shared)

    def _measure_shared(
        self,
        tensor: torch.Tensor,
        site: Site,
        histogram: bool,
        scale: float | torch.Tensor | None,
        *,
        shared: bool,
    ) -> Measurement:
        changed = functools.partial(self._note_change, site) if shared else None
        return measure_site(
            self._measurer,
            self._failures,
            tensor,
            site,
            histogram,
            scale,
            shared=shared,
            changed=changed,
        )

    def _note_change(self, site: Site) -> None:
        """A shared tensor of ``site`` changed in place: copy it from the next sample on."""
        self._changed.add(site)
        self._unchanged.discard(site)


def measure_site(
    measurer: Measurer,
    failures: FailureReport,
    tensor: torch.Tensor,
    site: Site,
    histogram: bool,
    scale: float | torch.Tensor | None = None,
    *,
    shared: bool = False,
    changed: Callable[[], None] | None = None,
    step: bool = False,
    in_place: bool = False,
) -> Measurement:
    """Reduce ``tensor`` on its device, reporting each failing reducer with where it failed.

    ``shared``: nothing changes ``tensor`` in place after the hook; ``changed``: called if
    something did; ``step``: a step record's tensor; ``in_place``: nothing changes it until
    the measurement settles (``Measurer.measure``).
    """
    measurement = measurer.measure(
        tensor,
        with_histogram=histogram,
        scale=scale,
        shared=shared,
        changed=changed,
        step=step,
        in_place=in_place,
    )
    measurement.then(functools.partial(_report_errors, failures, site))
    return measurement


def _report_errors(failures: FailureReport, site: Site, measurement: Measurement) -> None:
    """Report each reducer that failed on ``site`` (once its measurement is complete)."""
    for error in measurement.errors:
        where = f"{site.layer} call {site.call_index} {site.signal} {site.tensor_path}"
        key = f"reducer:{type(error).__name__}"
        failures.failed(f"a reducer failed on {where}", error, key, REDUCER_CONSEQUENCE)


def _hold(sample: Sample, tensor: torch.Tensor) -> torch.Tensor | weakref.ref[torch.Tensor]:
    """What keeps ``tensor`` till the forward ends: an alias in ``LEARN_BYTES``, else a weakref."""
    nbytes = tensor.untyped_storage().nbytes()
    if sample.held_bytes + nbytes > LEARN_BYTES:
        return weakref.ref(tensor)
    sample.held_bytes += nbytes
    return tensor.detach()  # shares the version counter, not the graph


def _sentinel(sample: Sample, tensor: torch.Tensor) -> object:
    """What a hook on ``tensor`` holds: the sample's sentinel, except on a leaf.

    A leaf (a tensor the user made, a parameter) outlives the graph: it must not keep the
    sample open once autograd frees the graph (see ``GradientSlot.sentinel``).
    """
    return sample.sentinel if tensor.grad_fn is not None else None


def _computed(tensor: torch.Tensor) -> bool:
    """Whether autograd computed ``tensor`` or what it is a view of (see ``_measure_output``).

    Such memory is written only through torch's ops; an input, a buffer or a numpy array may
    be written around them (a loop refilling its observation buffer, ``F.batch_norm``
    updating its running statistics), where the version does not move.
    """
    base = view_base(tensor)
    return tensor.grad_fn is not None and (base is None or base.grad_fn is not None)
