"""``OptimizerProbe``: the optimizer step signals, from each watched optimizer's own step hooks.

Each watched optimizer gets a step pre-hook and a step post-hook (public torch API). On a step the
``StepWindow`` does not claim, the pre-hook reads a few attributes and the post-hook one dict; on a
recorded step the pre-hook measures the gradients where they are (``_step_tensors
.gradient_tensors``) and what ``_step_tensors.before_step`` lists, waits for the gradients'
reductions, then makes the whole-model gradient row from them (``model_gradient``); the
post-hook measures what comes after the update; one step record, delivered when the post-hook
ends. An optimizer whose step only reads its gradients (``leaves_gradients``: torch's AdamW,
among others) has them reduced while it steps: the post-hook waits for them and makes the
whole-model row, and a gradient that changed meanwhile after all (its version moved) has its
values dropped (``modified_in_place``), and the optimizer's later steps wait in the pre-hook.
Both hooks do a recorded step's work with Python's garbage collector paused (``_collector``).

An optimizer stepped with a closure (Lightning without a GradScaler, LBFGS) computes its
gradients inside ``step``, after the pre-hook: the pre-hook then wraps the closure, and the
"before" measurements run when the closure first returns (the parameters are still untouched).
In a plain loop the closure of a step not claimed is wrapped too: its forward is the step's own,
and the step is claimed when it returns if that forward was sampled (``_closure_watched``).

A subclass whose ``step`` calls ``super().step()`` runs the hooks of both calls; only the
outermost call's act (``StepCalls``).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from torchinstruments_core._collector import collector_paused
from torchinstruments_core._copy_buffers import CopyBuffers
from torchinstruments_core._exceptions import ConfigurationError
from torchinstruments_core._records import STEP_SKIPPED
from torchinstruments_core._sharded import holds_shards
from torchinstruments_core._signals import RecordKind, Signal, signals_of
from torchinstruments_core._step_calls import StepCalls
from torchinstruments_core._step_tensors import (
    ParameterMap,
    PreStepCopy,
    before_step,
    changed_gradients,
    gradient_tensors,
    gradient_versions,
    leaves_gradients,
    loss_scale,
    model_gradient,
    model_gradients,
    optimizer_state,
    queue_copies,
    updates,
)
from torchinstruments_core._torch_private import compiling

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType

    from torch import nn
    from torch.utils.hooks import RemovableHandle

    from torchinstruments_core._failures import FailureReport
    from torchinstruments_core._layers import Layer
    from torchinstruments_core._lifecycle import SampleLifecycle
    from torchinstruments_core._measure import Measurer
    from torchinstruments_core._measurement import Measurement
    from torchinstruments_core._sample import Sample
    from torchinstruments_core._step_window import StepWindow

DEFAULT_STEP_SIGNALS: tuple[str, ...] = tuple(s.value for s in signals_of(RecordKind.STEP))
"""The optimizer step signals recorded unless told otherwise: all of them."""

_CONSEQUENCE = "this optimizer step's record misses the values it could not take"


def parse_step_signals(value: Sequence[str] | str) -> frozenset[Signal]:
    """The step signals named by ``value`` (``step_signals``), checked.

    Raises:
        ConfigurationError: ``value`` names something other than an optimizer step signal.
    """
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, Sequence) or not all(n in DEFAULT_STEP_SIGNALS for n in names):
        raise ConfigurationError.invalid("step_signals", value, DEFAULT_STEP_SIGNALS)
    return frozenset(Signal(n) for n in names)


def check_optimizers(value: object) -> tuple[torch.optim.Optimizer, ...]:
    """``optimizer`` of ``inject_observer``: one optimizer or a sequence of them, checked."""
    items = value if isinstance(value, list | tuple) else [value]
    optimizers: list[torch.optim.Optimizer] = []
    for item in items:
        optimizer = unwrap(item)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigurationError.invalid(
                "optimizer", item, "a torch.optim.Optimizer or a sequence of them"
            )
        optimizers.append(optimizer)
    return tuple(optimizers)


def unwrap(optimizer: object) -> object:
    """The torch optimizer inside a wrapper that steps it (Accelerate's ``.optimizer``)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


@dataclass(slots=True)
class _Pending:
    """A recorded step between its pre-hook and its post-hook."""

    optimizer: torch.optim.Optimizer
    record: Sample
    copies: list[PreStepCopy]
    measured: dict[int, Measurement] = field(default_factory=dict)
    """The measurements made before the step, by the id of the tensor measured."""
    gradients: dict[int, Measurement] = field(default_factory=dict)
    """Where the gradients are reduced during the step (``leaves_gradients``): their
    measurements, by the id of the gradient."""
    model: list[torch.Tensor] = field(default_factory=list)
    """Then also the model's gradients as the step was handed them (``model_gradients``), for
    the whole-model row made after it."""
    versions: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    """Then those gradients' versions before the step (``gradient_versions``); emptied once
    checked."""


class OptimizerProbe:
    """Watches optimizers and records the steps the ``StepWindow`` claims.

    Args:
        lifecycle: Opens, fills and delivers the step records.
        window: Decides which steps are recorded.
        failures: Where a failure while measuring is reported.
        signals: The step signals to record.
        measurer: The lifecycle's; it queues the large parameters' copies on the kernels'
            queue (``Measurer.copy``, ``_step_tensors.queue_copies``) and waits for them.
    """

    def __init__(
        self,
        lifecycle: SampleLifecycle,
        window: StepWindow,
        failures: FailureReport,
        signals: frozenset[Signal],
        measurer: Measurer,
    ) -> None:
        self._lifecycle, self._window, self._failures = lifecycle, window, failures
        self._signals = signals
        self._measurer = measurer
        self._parameters: ParameterMap | None = None
        self._watched: dict[int, tuple[weakref.ref[Any], list[RemovableHandle]]] = {}
        self._pending: dict[int, _Pending] = {}
        # the call whose pre-hook claimed a recorded step, by optimizer: only its post-hook
        # closes the record, not a nested call's (a subclass's ``step`` calling the parent's)
        self._calls = StepCalls()
        self._stepping = False  # between a claimed pre-hook and its post-hook
        self._sampled_step: int | None = None  # the step in progress, when announced sampled
        self._announced = False  # an adapter announces the steps (not a plain loop)
        self._quiet = False  # the open window's step, unstepped, is noted (``announced``)
        self._buffers = CopyBuffers()  # the parameters' copies' memory, from step to step
        # the optimizers found changing a gradient they were thought to leave alone
        self._writers: set[int] = set()

    @property
    def watching(self) -> bool:
        """Whether some optimizer is watched."""
        return bool(self._watched)

    def watch(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, layers: list[Layer]
    ) -> None:
        """Hook ``optimizer`` (once; a second call does nothing).

        The first optimizer watched during a step announced sampled (an adapter that finds the
        optimizer in its first step's pre-hook) opens that step's window: the step is recorded.
        """
        known = self._watched.get(id(optimizer))
        if known is not None and known[0]() is optimizer:
            return
        if self._parameters is None:
            self._parameters = ParameterMap(model, layers)
        handles = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]
        self._watched[id(optimizer)] = (weakref.ref(optimizer), handles)
        first = not self._window.watching
        if holds_shards(optimizer):
            # every rank opens the sampled steps' records: they combine shards collectively
            self._lifecycle.joins_steps = True
        self._window.watching = bool(self._signals)
        self._lifecycle.on_training_sample = self.sampled
        if first and self._sampled_step is not None:
            self.sampled(self._sampled_step)

    # -- the window ---------------------------------------------------------------------------

    def sampled(self, step: int | None) -> None:
        """A training sample opened (or a sampled step began): see ``StepWindow.sampled``.

        A sample opened inside a recorded step (by its closure) belongs to that step.
        """
        if not self._stepping:
            self._note(self._window.sampled(step))

    def announced(self, step: int, *, sample: bool, note_unstepped: bool = True) -> None:
        """An adapter began trainer step ``step``; see ``Observer.begin_step``."""
        self._announced = True
        self._stepping = False
        self._sampled_step = step if sample else None
        self._note(self._window.announced(step))  # the window of the step before, as it was told
        self._quiet = not note_unstepped  # for the window of this step
        if sample:
            self.sampled(step)

    def _note(self, unstepped: int | None) -> None:
        if unstepped is None or self._quiet:
            return
        record = self._lifecycle.open_step(unstepped, note=STEP_SKIPPED)
        if record is not None:
            self._lifecycle.deliver_step(record)

    # -- the hooks ----------------------------------------------------------------------------

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if self._calls.open and self._calls.nested(optimizer):
            return None  # a subclass's ``step`` calling the one it overrides: the outer call's
        if self._pending:
            self._abandoned(optimizer)
        if not self._window.open or not self._window.claim(optimizer):
            if self._announced or not self._window.watching:
                return None  # the unsampled step's whole cost (with the tests above)
            # a plain loop: a closure may run this step's sampled forward (``_claim_late``)
            return self._closure_watched(optimizer, args, kwargs)
        self._calls.enter(optimizer)  # torch's wrapper's frame, calling the hooks
        self._stepping = True
        step = self._window.step
        closure = _closure(args, kwargs)
        if closure is None:
            self._before(optimizer, step)
            return None
        wrapped = _Once(closure, functools.partial(self._before, optimizer, step))
        return _with_closure(args, kwargs, wrapped)

    def _closure_watched(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        """In a plain loop, a step not claimed has its closure (if any) watched.

        Its forward is the step's own (LBFGS, an SGD stepped with a closure): a sampled one
        opens the window while the closure runs, and the step is claimed when the closure
        first returns, where the "before" measurements run anyway. Unwatched, the window it
        opened would be claimed by the optimizer's next step, with a forward not its own.
        """
        closure = _closure(args, kwargs)
        if closure is None:
            return None
        frame = None if compiling() else sys._getframe(2)  # torch's wrapper, calling ``_pre``
        late = functools.partial(self._claim_late, optimizer, frame)
        return _with_closure(args, kwargs, _Once(closure, late))

    def _claim_late(self, optimizer: torch.optim.Optimizer, frame: FrameType | None) -> None:
        """The watched closure returned: the step is claimed if its forward opened the window."""
        if self._stepping or not self._window.open or not self._window.claim(optimizer):
            return
        if frame is not None:
            self._calls.enter(optimizer, frame)
        self._stepping = True
        self._before(optimizer, self._window.step)

    @collector_paused  # the record's objects are all freed by reference counts
    def _before(self, optimizer: torch.optim.Optimizer, step: int | None) -> None:
        self._finish(id(optimizer))  # a step that raised before its post-hook
        record = self._lifecycle.open_step(step, joins=self._lifecycle.joins_steps)
        if record is None or self._parameters is None:
            return
        pending = self._pending[id(optimizer)] = _Pending(optimizer, record, [])
        parameters, signals = self._parameters, self._signals
        try:
            scale = loss_scale(optimizer)
            gradients = gradient_tensors(optimizer, parameters, signals, scale)
            during = (
                id(optimizer) not in self._writers
                and self._innermost(optimizer)
                and leaves_gradients(optimizer, gradients)
            )
            if during:  # reduced while the optimizer steps: checked in the post-hook
                pending.model = model = model_gradients(optimizer, parameters)
                pending.versions = gradient_versions([*(g.tensor for g in gradients), *model])
            measured: dict[int, Measurement] = {}
            ticket, copies_queued = None, False
            try:
                # the large copies first on the queue: waiting for them runs no gradient's job
                queued, ticket = queue_copies(
                    optimizer, parameters, signals, self._buffers, self._measurer.copy
                )
                copies_queued = True
                measured = self._lifecycle.measure_step(record, gradients)  # reduced meanwhile
                if during:
                    pending.gradients = measured
                tensors, pending.copies = before_step(
                    optimizer, parameters, signals, scale, self._buffers, queued
                )
            finally:  # before the optimizer may change them, whatever failed meanwhile
                if (gradients and not during) or not copies_queued:
                    # every job: a failure among the copies leaves some queued, unknown here
                    self._lifecycle.wait_for_reductions()
                elif ticket is not None:
                    self._measurer.wait_for(ticket)
            whole = None
            if not during:
                model = model_gradients(optimizer, parameters)
                whole = model_gradient(model, signals, scale, measured)
            pending.measured = self._lifecycle.measure_step(
                record, [*tensors, *([] if whole is None else [whole])]
            )
        except Exception as error:  # observing must never break the training step
            self._failures.failed("measuring before an optimizer step", error, "step", _CONSEQUENCE)

    def _abandoned(self, optimizer: torch.optim.Optimizer) -> None:
        """Deliver the record of ``optimizer``'s last step, if it raised before its post-hook.

        The record holds what was measured before that step; its post-hook never ran. Left
        pending, the next step's post-hook would take it for its own (a step not recorded
        runs the post-hook too) and form its updates from the parameters two steps apart.
        """
        if id(optimizer) in self._pending:
            self._finish(id(optimizer))
            self._stepping = bool(self._pending)

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._pending and self._calls.leave(optimizer):
            self._after(optimizer)  # (the test is an unsampled step's whole cost)

    @collector_paused
    def _after(self, optimizer: torch.optim.Optimizer) -> None:
        pending = self._pending.pop(id(optimizer), None)
        if pending is None or self._parameters is None:
            return
        self._stepping = False
        try:
            # parameters measured from their copies, formed into updates next; gradients
            # reduced during the step, which may be zeroed once the hook returns
            if pending.copies or pending.versions:
                self._lifecycle.wait_for_reductions()
            self._gradients_after(pending)
            updated = updates(pending.copies, pending.measured)
            self._lifecycle.measure_step(pending.record, updated)
            if Signal.OPTIMIZER_STATE in self._signals:
                states = optimizer_state(optimizer, self._parameters)
                self._lifecycle.measure_step(pending.record, states)
        except Exception as error:  # observing must never break the training step
            self._failures.failed("measuring after an optimizer step", error, "step", _CONSEQUENCE)
        finally:
            self._close(pending)

    def _innermost(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether no other hook of ``optimizer`` runs between the observer's two.

        Its pre-hook is the last of the optimizer's own (torch runs the global ones before
        them) and its post-hook the first (the global ones run after them): nothing but the
        optimizer's step then runs while the gradients are reduced during it. torch keeps
        the hooks in ordered dicts by handle id (``_optimizer_step_pre_hooks``, private: a
        torch without them gets ``False``).
        """
        watched = self._watched.get(id(optimizer))
        pre = getattr(optimizer, "_optimizer_step_pre_hooks", None)
        post = getattr(optimizer, "_optimizer_step_post_hooks", None)
        if watched is None or not isinstance(pre, dict) or not isinstance(post, dict):
            return False
        if not pre or not post:
            return False
        ours_pre, ours_post = watched[1]
        return bool(next(reversed(pre)) == ours_pre.id and next(iter(post)) == ours_post.id)

    def _gradients_after(self, pending: _Pending) -> None:
        """Check the gradients reduced during the step, then make the whole-model row.

        Nothing to do where they were reduced before it. One that changed (its version moved)
        has its values dropped: they could mix what the step was handed and what it wrote; the
        whole-model row then has none either, and the optimizer's later steps wait for their
        gradients' reductions in the pre-hook. The caller has waited for the reductions.
        """
        if not pending.versions:
            return
        changed = changed_gradients(pending.versions)
        pending.versions = []
        if changed:
            self._writers.add(id(pending.optimizer))
            for key in changed:
                measurement = pending.gradients.get(key)
                if measurement is not None:
                    measurement.modified()
        scale = loss_scale(pending.optimizer)
        signals, measured = self._signals, pending.gradients
        whole = model_gradient(pending.model, signals, scale, measured, changed)
        pending.model = []
        if whole is not None:
            self._lifecycle.measure_step(pending.record, [whole])

    def _close(self, pending: _Pending) -> None:
        """Deliver ``pending``'s record; gradients reduced during its step checked first."""
        try:
            if pending.versions:  # not checked yet: the step raised, or the post-hook failed
                self._lifecycle.wait_for_reductions()
                self._gradients_after(pending)
        except Exception as error:  # observing must never break the training step
            self._failures.failed("measuring after an optimizer step", error, "step", _CONSEQUENCE)
        finally:
            pending.copies.clear()
            self._lifecycle.deliver_step(pending.record)

    def _finish(self, key: int) -> None:
        pending = self._pending.pop(key, None)
        if pending is not None:  # a step that raised before its post-hook
            self._close(pending)

    def remove(self) -> None:
        """Remove every hook and deliver what is pending. Safe to call again."""
        for _, handles in self._watched.values():
            for handle in handles:
                handle.remove()
        self._watched.clear()
        self._calls.forget()
        for key in list(self._pending):
            self._finish(key)
        self._window.close()
        self._window.watching = False
        self._parameters = None
        self._buffers.clear()
        self._writers.clear()


def _closure(args: Any, kwargs: Any) -> Callable[[], Any] | None:
    """The closure a step was given; ``args`` starts with the optimizer (``step``'s own)."""
    if "closure" in kwargs:
        return cast("Callable[[], Any] | None", kwargs["closure"])
    return cast("Callable[[], Any] | None", (args[1:2] or (None,))[0])


def _with_closure(args: Any, kwargs: Any, wrapped: _Once) -> tuple[Any, Any]:
    """The step's arguments with ``wrapped`` in its closure's place (a pre-hook's result)."""
    if "closure" in kwargs:
        return args, {**kwargs, "closure": wrapped}
    return (args[0], wrapped, *args[2:]), kwargs


class _Once:
    """A closure that runs ``after`` once, when it first returns (see the module docstring)."""

    __slots__ = ("_after", "_closure", "_done")

    def __init__(self, closure: Callable[[], Any], after: Callable[[], None]) -> None:
        self._closure, self._after, self._done = closure, after, False

    def __call__(self) -> Any:
        result = self._closure()
        if not self._done:
            self._done = True
            self._after()
        return result
