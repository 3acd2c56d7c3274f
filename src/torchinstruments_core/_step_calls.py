"""``StepCalls``: an optimizer's outermost ``step`` call, told from one nested in it.

torch hooks the ``step`` of the class of each optimizer made. A subclass whose ``step`` calls
``super().step()`` then runs the hooks of both calls once an instance of the parent class
exists too (any made earlier in the process): pre-hook, pre-hook, post-hook, post-hook, for one
optimizer step. A hook that counts steps or records one acts on the outermost call only: the
frame of torch's wrapper that called its pre-hook is kept until its post-hook, and a pre-hook
that finds that frame above it is nested. A call that raised leaves its frame behind until the
next call finds it gone from the stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType

    import torch


class StepCalls:
    """The outermost ``step`` call in progress of each optimizer, by the hooks' frames.

    Both methods take the frame of torch's wrapper that calls the hook (``sys._getframe(1)``
    in the hook itself). A dictionary lookup where no call is nested; the stack is walked only
    when one was left open (nested, or raised).
    """

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open: dict[int, FrameType] = {}
        """The kept calls' frames, by optimizer id; empty unless a call is in progress."""

    def enter(self, optimizer: torch.optim.Optimizer, frame: FrameType) -> bool:
        """A pre-hook: whether its call is the outermost (then kept until its post-hook)."""
        if self.nested(optimizer, frame):
            return False
        self.open[id(optimizer)] = frame
        return True

    def nested(self, optimizer: torch.optim.Optimizer, frame: FrameType) -> bool:
        """Whether the call of ``frame`` runs inside a kept call of the same optimizer.

        A kept call no longer on the stack (it raised) is forgotten.
        """
        opened = self.open.get(id(optimizer))
        if opened is None:
            return False
        if on_stack(opened, frame.f_back):
            return True
        del self.open[id(optimizer)]
        return False

    def leave(self, optimizer: torch.optim.Optimizer, frame: FrameType) -> bool:
        """A post-hook: whether its call is the outermost (then forgotten), or none was kept.

        Only a call found running inside the kept one is not: a kept frame no longer on the
        stack (its call raised) is forgotten, and this call taken for the outermost.
        """
        opened = self.open.get(id(optimizer))
        if opened is not None and opened is not frame and on_stack(opened, frame.f_back):
            return False
        self.open.pop(id(optimizer), None)
        return True

    def forget(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Forget ``optimizer``'s kept call, or every one."""
        if optimizer is None:
            self.open.clear()
        else:
            self.open.pop(id(optimizer), None)


def on_stack(frame: FrameType, start: FrameType | None) -> bool:
    """Whether ``frame`` is ``start`` or one of its callers."""
    while start is not None:
        if start is frame:
            return True
        start = start.f_back
    return False
