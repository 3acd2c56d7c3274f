"""Measuring a sample's outputs and matching the gradients that flow back into them.

In a sampled forward each observed output is reduced on its device and, when it can take a
gradient, gets a tensor hook (a ``GradientSlot``) that records the gradient of the first backward
that reaches the sample. Outputs computed without autograd inside a forward with autograd
(reentrant activation checkpointing) get their gradients from the recomputation in the backward:
the recomputed call is matched to the original one by ``_recompute``.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

from torch import is_grad_enabled

from torchinstruments_core._capture import GradientSlot, gradient_signal_site
from torchinstruments_core._failures import REDUCER_CONSEQUENCE
from torchinstruments_core._nested import iter_tensors
from torchinstruments_core._records import Signal
from torchinstruments_core._sample import Sample, Site
from torchinstruments_core._signals import fixed_root
from torchinstruments_core._torch_private import current_graph_task_id, queue_callback

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from torchinstruments_core._failures import FailureReport
    from torchinstruments_core._layers import Layer
    from torchinstruments_core._measure import Measurement, Measurer

_OUTPUT_ROOT = fixed_root(Signal.OUTPUT)


class OutputProbe:
    """Owns what is measured on which tensor of a sample, and which sample a gradient belongs to.

    Args:
        measurer: Reduces each tensor on its device.
        failures: Where a failing reducer is reported.
        close: Closes a sample; called when the first backward that reached it completes.
        waiting: The open samples whose outputs still wait for a checkpoint's recomputation.
    """

    __slots__ = ("_close", "_failures", "_measurer", "_waiting")

    def __init__(
        self,
        measurer: Measurer,
        failures: FailureReport,
        close: Callable[[Sample], None],
        waiting: Callable[[], list[Sample]],
    ) -> None:
        self._measurer = measurer
        self._failures = failures
        self._close = close
        self._waiting = waiting

    def observe(self, sample: Sample, layer: Layer, output: Any) -> None:
        """Measure each tensor of ``output`` and watch for the gradients flowing back into it."""
        call_index = sample.next_call_index(layer.name)
        for path, tensor in iter_tensors(output, _OUTPUT_ROOT):
            site = Site(layer.name, call_index, Signal.OUTPUT, path)
            sample.add(site, self._measure(tensor, site, layer.histogram))
            if tensor.requires_grad:
                self._watch_gradient(sample, site, tensor, layer.histogram)
            elif sample.grad_enabled and tensor.is_floating_point() and not is_grad_enabled():
                # computed without autograd inside a forward with it: reentrant checkpointing,
                # whose recomputation in the backward carries the gradient (see _recompute)
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
                slot = GradientSlot(self._on_gradient, sample, None, False, sample.sentinel)
                sample.handles.append(tensor.register_hook(slot))  # type: ignore[no-untyped-call]

    def observe_recomputed(self, layer: Layer, output: Any) -> None:
        """Watch the gradients of an output a checkpoint recomputes in the backward."""
        sample = self._recomputed_sample(current_graph_task_id())
        if sample is None:
            return
        call_index = sample.recompute.match(layer.name)
        if call_index is None:
            return
        for path, tensor in iter_tensors(output, _OUTPUT_ROOT):
            site = gradient_signal_site(Site(layer.name, call_index, Signal.OUTPUT, path))
            if tensor.requires_grad and sample.recompute.take(site):
                # its gradient arrives in the checkpoint's own, nested backward
                slot = GradientSlot(self._on_gradient, sample, site, layer.histogram, None)
                slot.nested = True
                sample.handles.append(tensor.register_hook(slot))  # type: ignore[no-untyped-call]

    def _watch_gradient(
        self, sample: Sample, site: Site, tensor: torch.Tensor, histogram: bool
    ) -> None:
        gradient_site = gradient_signal_site(site)
        slot = GradientSlot(self._on_gradient, sample, gradient_site, histogram, sample.sentinel)
        sample.handles.append(tensor.register_hook(slot))  # type: ignore[no-untyped-call]
        sample.expect_gradient(gradient_site, self._measurer.metrics)

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
        if slot.site is None:
            return  # a hook that only marks the backward's start (see keep_until_backward)
        measurement = self._measure(grad, slot.site, slot.histogram, sample.gradient_scale)
        sample.add(slot.site, measurement)
        sample.duration_s += time.perf_counter() - started

    def _measure(
        self,
        tensor: torch.Tensor,
        site: Site,
        histogram: bool,
        scale: float | torch.Tensor | None = None,
    ) -> Measurement:
        return measure_site(self._measurer, self._failures, tensor, site, histogram, scale)


def measure_site(
    measurer: Measurer,
    failures: FailureReport,
    tensor: torch.Tensor,
    site: Site,
    histogram: bool,
    scale: float | torch.Tensor | None = None,
) -> Measurement:
    """Reduce ``tensor`` on its device, reporting each failing reducer with where it failed."""
    measurement = measurer.measure(tensor, with_histogram=histogram, scale=scale)
    for error in measurement.errors:
        where = f"{site.layer} call {site.call_index} {site.signal} {site.tensor_path}"
        key = f"reducer:{type(error).__name__}"
        failures.failed(f"a reducer failed on {where}", error, key, REDUCER_CONSEQUENCE)
    return measurement
