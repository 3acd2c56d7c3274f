"""``OptimizerClock``: a trainer's optimizer steps, counted from the optimizers themselves.

An adapter that never sees the training loop (Accelerate's tracker only receives ``log`` calls,
on the main process only) still needs the loop's steps. The optimizers know them: a pre- and a
post-hook common to all optimizers (public torch API) find the optimizers that step the watched
model's parameters and follow them. It needs nothing but torch, so a plain loop, Accelerate or
Fabric count alike, the same way on every process. Under gradient accumulation an optimizer
steps once per synchronization, so one tick is one optimizer step, whatever the number of
micro-batches.

The clock also hands each optimizer it follows to the adapter (``on_optimizer``), which watches
it for the optimizer step signals: from the optimizer's first step's pre-hook for one it found
(so a hook registered there runs in that same step), at once for one it was given.
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any

from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from torchinstruments_core._exceptions import ObservationWarning
from torchinstruments_core._optimizer_probe import check_optimizers
from torchinstruments_core._step_calls import StepCalls

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import torch
    from torch import nn


def _ignore(optimizer: torch.optim.Optimizer) -> None:
    """What ``on_optimizer`` does unless the adapter says otherwise."""


class OptimizerClock:
    """Calls ``on_step`` after each step of the optimizers that train ``model``.

    Unless told which (``follow``), it follows the first optimizer to step one of ``model``'s
    parameters (any optimizer when none of them requires a gradient); optimizers of other models
    are ignored, and a second optimizer of the same model is not followed (it warns once,
    ``ObservationWarning``: steps would be counted before it stepped). Told several, it ticks
    once each of them has stepped since the last tick, so one tick is one step of a loop that
    steps every one of them. A step skipped by the fp16 ``GradScaler`` (an overflow) runs no
    optimizer step and is not counted. A subclass whose ``step`` calls ``super().step()``
    counts once a call (``StepCalls``), though torch runs both calls' hooks.

    Args:
        model: The watched model (only a weak reference is kept).
        on_step: Called after each counted step.
        on_optimizer: Called once with each optimizer followed (the torch optimizer, unwrapped):
            for one found, in the pre-hook of its first step, before the step runs.
        optimizers: The trainer's optimizers, followed at once (see ``follow``); none: the
            first one found.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> ticks = []
        >>> clock = OptimizerClock(model, lambda: ticks.append(len(ticks)))
        >>> for _ in range(3):
        ...     model(torch.ones(1, 2)).sum().backward()
        ...     optimizer.step()
        >>> clock.remove()
        >>> ticks
        [0, 1, 2]
    """

    def __init__(
        self,
        model: nn.Module,
        on_step: Callable[[], None],
        *,
        on_optimizer: Callable[[torch.optim.Optimizer], None] = _ignore,
        optimizers: Iterable[Any] = (),
    ) -> None:
        self._model = weakref.ref(model)
        self._on_step = on_step
        self._on_optimizer = on_optimizer
        self._followed: dict[int, weakref.ref[torch.optim.Optimizer]] = {}
        self._given = False
        # optimizers already judged (found or ignored); weak: an id may be reused after collection
        self._seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._stepped: set[int] = set()  # followed optimizers that stepped since the last tick
        self._calls = StepCalls()  # a subclass's ``step`` calling its parent's is one step
        self._handles = [
            register_optimizer_step_pre_hook(self._before_step),
            register_optimizer_step_post_hook(self._after_step),
        ]
        given = list(optimizers)
        if given:
            self.follow(given)

    def follow(self, optimizers: Iterable[Any]) -> None:
        """Follow exactly these optimizers (the trainer's), instead of the one found.

        A wrapper with a public ``optimizer`` attribute (Accelerate's ``AcceleratedOptimizer``,
        Fabric's optimizer) is unwrapped. Call it before their first step; each goes to
        ``on_optimizer`` at once.

        Raises:
            ConfigurationError: One of them is not an optimizer.
        """
        self._given = True
        self._followed, self._stepped = {}, set()
        for optimizer in check_optimizers(list(optimizers)):
            self._followed[id(optimizer)] = weakref.ref(optimizer)
            self._on_optimizer(optimizer)

    def remove(self) -> None:
        """Stop counting. Safe to call again."""
        for handle in self._handles:
            handle.remove()
        self._calls.forget()

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._calls.enter(optimizer):
            return  # inside a call of the same optimizer's step
        if self._given or optimizer in self._seen:
            return  # one set lookup on every step after an optimizer's first
        self._seen.add(optimizer)
        if not self._trains_model(optimizer):
            return
        if self._followed:
            warnings.warn(_second(optimizer), ObservationWarning, stacklevel=2)
            return
        self._followed[id(optimizer)] = weakref.ref(optimizer)
        self._on_optimizer(optimizer)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._calls.leave(optimizer):
            return  # a nested call's: the outer call's post-hook counts the step
        followed = self._followed.get(id(optimizer))
        if followed is None or followed() is not optimizer:
            return
        self._stepped.add(id(optimizer))
        if len(self._stepped) == len(self._followed):
            self._stepped = set()
            self._on_step()

    def _trains_model(self, optimizer: torch.optim.Optimizer) -> bool:
        model = self._model()
        if model is None:
            return False
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        stepped = (id(p) for group in optimizer.param_groups for p in group["params"])
        return not trainable or any(i in trainable for i in stepped)


def _second(optimizer: torch.optim.Optimizer) -> str:
    return (
        f"a second optimizer ({type(optimizer).__name__}) steps the watched model's parameters; "
        "its steps are not recorded, and the steps are counted by the first one only: pass "
        "every optimizer (watch(..., optimizer=[...]))"
    )
