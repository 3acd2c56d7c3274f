"""``OptimizerClock``: a trainer's optimizer steps, counted from the optimizer itself.

An adapter that never sees the training loop (Accelerate's tracker only receives ``log`` calls,
on the main process only) still needs the loop's steps. The optimizer knows them: a post-hook
common to all optimizers (public torch API) follows the first optimizer to step one of the
watched model's parameters. It needs nothing but torch, so a plain loop, Accelerate, Fabric or
the Transformers ``Trainer`` count alike, the same way on every process. Under gradient
accumulation the optimizer steps once per synchronization, so one tick is one optimizer step,
whatever the number of micro-batches.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from torch.optim.optimizer import register_optimizer_step_post_hook

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn


class OptimizerClock:
    """Calls ``on_step`` after each step of the optimizer that trains ``model``.

    That optimizer is the first to step one of ``model``'s parameters (any optimizer when none of
    them requires a gradient); optimizers of other models are ignored. A step skipped by the fp16
    ``GradScaler`` (an overflow) runs no optimizer step and is not counted.

    Args:
        model: The watched model (only a weak reference is kept).
        on_step: Called after each counted step.

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

    def __init__(self, model: nn.Module, on_step: Callable[[], None]) -> None:
        self._model = weakref.ref(model)
        self._on_step = on_step
        self._optimizer: weakref.ref[torch.optim.Optimizer] | None = None
        self._handle = register_optimizer_step_post_hook(self._after_step)

    def remove(self) -> None:
        """Stop counting. Safe to call again."""
        self._handle.remove()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._optimizer is None and self._trains_model(optimizer):
            self._optimizer = weakref.ref(optimizer)
        if self._optimizer is not None and self._optimizer() is optimizer:
            self._on_step()

    def _trains_model(self, optimizer: torch.optim.Optimizer) -> bool:
        model = self._model()
        if model is None:
            return False
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        stepped = (id(p) for group in optimizer.param_groups for p in group["params"])
        return not trainable or any(i in trainable for i in stepped)
