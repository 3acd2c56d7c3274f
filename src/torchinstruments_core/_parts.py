"""``PartCalls``: a loop that calls the parts of the watched model, never the model itself.

A GAN kept in one module (``gan.G(z)``, ``gan.D(x)``), an encoder and a decoder called in turn:
the adapter watches the container, and its own forward never runs. An adapter that never sees
the loop (Accelerate's tracker, Fabric's callback) opens its samples at the model's forward,
and the tracker's step windows (``StepNumbering``) follow it: such a loop got no forward
samples, and the tracker's step records waited for a number until the run ended.

``PartCalls`` puts a forward pre-hook and a forward hook on each direct child of the model
(through wrapper attributes: ``DistributedDataParallel.module``, a compiled model's
``_orig_mod``, Fabric's ``_original_module``; the unwrapped model itself too, for
``model.module(x)``). A call of one of them
with gradients enabled, outside the model's own forward, is then what a training forward of
the model is: it counts for the step windows, and in a sampled step it is a sample of its own
(opened in the pre-hook, its forward finished by a hook added then, after the per-module hooks
of the sampled step, so that a part that is itself an observed layer is measured first). A
part's call inside another's, or in the backward (activation checkpointing recomputing it), is
none; each thread's calls are its own. Once the model's own forward runs
with gradients enabled (the usual loop) the hooks remove themselves: they cost only loops that
need them, one hook call a part's call.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchinstruments_core._torch_private import in_backward

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.utils.hooks import RemovableHandle

    from torchinstruments_core._observer import Observer

_WRAPPERS = ("_original_module", "module", "_orig_mod")
"""Attributes under which a wrapper keeps the model it wraps (Fabric, DDP, ``torch.compile``)."""


class PartCalls:
    """Counts the training calls of a model's parts made outside its own forward; samples them.

    Args:
        model: The watched model (wrapped or not).
        own_forwards: How many training forwards of the model itself ran so far
            (``Observer.training_forwards``); once it is not 0 the hooks go.
        sampled: Whether the step in progress is sampled, and its number: a part's call then
            opens a sample (``open_sample``) that its return finishes (``finish_forward``), in
            the thread that called it.
        open_sample: ``Observer.open_sample``.
        finish_forward: ``Observer.finish_forward``.
    """

    def __init__(
        self,
        model: nn.Module,
        own_forwards: Callable[[], int],
        sampled: Callable[[], int | None],
        open_sample: Callable[[int], object],
        finish_forward: Callable[[], None],
    ) -> None:
        self.count = 0
        """Training calls of the parts so far (with gradients enabled, outside a backward)."""
        self.called: list[str] = []
        """The names of the parts called, in the order of their first call."""
        self._own, self._sampled = own_forwards, sampled
        self._open, self._finish = open_sample, finish_forward
        # per thread: parts' calls in progress (one part may call another), and the hook that
        # finishes the sample the outermost one opened; another thread's calls are its own
        self._local = threading.local()
        self._handles: list[RemovableHandle] = []
        self._finishing: set[RemovableHandle] = set()
        inner = _unwrapped(model)
        parts = [(name, part) for name, part in inner.named_children()]
        if inner is not model:
            parts.append(("(the unwrapped model)", inner))
        for name, part in parts:
            self._handles.append(part.register_forward_pre_hook(self._pre_hook(name)))
            self._handles.append(part.register_forward_hook(self._post_hook, always_call=True))

    @classmethod
    def of(
        cls, observer: Observer, model: nn.Module, sampled: Callable[[], int | None]
    ) -> PartCalls:
        """The part calls of ``model``, watched by ``observer``; ``sampled`` as above."""
        return cls(
            model,
            lambda: observer.training_forwards,
            sampled,
            observer.open_sample,
            observer.finish_forward,
        )

    def _pre_hook(self, name: str) -> Callable[[nn.Module, Any], None]:
        def called(module: nn.Module, args: Any) -> None:
            self._entered(name, module)

        return called

    def _entered(self, name: str, part: nn.Module) -> None:
        if self._own():  # the model's own forward runs: it is the loop's forward
            self.remove()
            return
        local = self._local
        depth = getattr(local, "depth", 0)
        local.depth = depth + 1
        # not a training call: nested in another part, without gradients, or a recomputation
        # in the backward (activation checkpointing)
        if depth or not torch.is_grad_enabled() or in_backward():
            return
        self.count += 1
        if name not in self.called:
            self.called.append(name)
        step = self._sampled()
        if step is not None:
            self._open(step)
            # registered now, after the per-module hooks the sampled step armed: a part that is
            # itself an observed layer has its output measured before its sample's forward ends
            handle = part.register_forward_hook(self._finished, always_call=True)
            self._finishing.add(handle)
            local.finishing = handle

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        local = self._local
        local.depth = max(getattr(local, "depth", 0) - 1, 0)

    def _finished(self, module: nn.Module, args: Any, output: Any) -> None:
        """The outermost part's call returned (or raised): its sample's forward ends."""
        handle = getattr(self._local, "finishing", None)
        self._local.finishing = None
        if handle is not None:
            handle.remove()
            self._finishing.discard(handle)
        self._finish()

    def remove(self) -> None:
        """Remove the hooks. Safe to call again."""
        handles, self._handles = self._handles, []
        finishing, self._finishing = self._finishing, set()
        for handle in [*handles, *finishing]:
            handle.remove()


def _unwrapped(model: nn.Module) -> nn.Module:
    """``model`` without its wrappers (Fabric's, ``DistributedDataParallel``, ``torch.compile``)."""
    for attribute in _WRAPPERS:
        inner = getattr(model, attribute, None)
        if isinstance(inner, nn.Module) and inner is not model:
            return _unwrapped(inner)
    return model
