"""``StepCalls``: an optimizer's outermost ``step`` call, told from one nested in it.

torch hooks the ``step`` of the class of each optimizer made. A subclass whose ``step`` calls
``super().step()`` then runs the hooks of both calls once an instance of the parent class
exists too (any made earlier in the process): pre-hook, pre-hook, post-hook, post-hook, for one
optimizer step. A hook that counts steps or records one acts on the outermost call only: the
frame of torch's wrapper that called its pre-hook is kept until its post-hook, and a pre-hook
that finds that frame above it is nested.

A call that raised leaves its frame behind, and a frame keeps its locals and its callers' alive
(the optimizer, a batch, a model rebuilt after an out-of-memory error). The next ``enter`` or
``nested`` of any optimizer forgets every kept frame of its thread that is no longer on the
stack. While dynamo traces a step (``torch.compile``) no frame is read: each call counts as the
outermost, as before nested calls were told apart.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING

from torchinstruments_core._torch_private import compiling

if TYPE_CHECKING:
    from types import FrameType

    import torch


class StepCalls:
    """The outermost ``step`` call in progress of each optimizer, by the hooks' frames.

    The methods read the frame of torch's wrapper that calls the hook (the caller of the hook
    that calls them), unless given one. A dictionary lookup where no call was left open; the
    stack is walked only when one was (nested, or raised).
    """

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open: dict[int, tuple[FrameType, int]] = {}
        """The kept calls' frames and threads, by optimizer id; empty between steps."""

    def enter(self, optimizer: torch.optim.Optimizer, frame: FrameType | None = None) -> bool:
        """A pre-hook: whether its call is the outermost (then kept until its post-hook)."""
        if frame is None:
            if compiling():
                return True
            frame = sys._getframe(2)
        if self.nested(optimizer, frame):
            return False
        self.open[id(optimizer)] = (frame, threading.get_ident())
        return True

    def nested(self, optimizer: torch.optim.Optimizer, frame: FrameType | None = None) -> bool:
        """Whether the call of ``frame`` runs inside a kept call of the same optimizer.

        Kept calls of this thread no longer on the stack (they raised) are forgotten first.
        """
        if not self.open:
            return False
        if frame is None:
            if compiling():
                return False
            frame = sys._getframe(2)
        self._forget_ended(frame)
        kept = self.open.get(id(optimizer))
        return kept is not None and on_stack(kept[0], frame.f_back)

    def leave(self, optimizer: torch.optim.Optimizer, frame: FrameType | None = None) -> bool:
        """A post-hook: whether its call is the outermost (then forgotten), or none was kept.

        Only a call found running inside the kept one is not: a kept frame no longer on the
        stack (its call raised) is forgotten, and this call taken for the outermost.
        """
        kept = self.open.get(id(optimizer))
        if kept is None:
            return True
        if frame is None:
            if compiling():
                return True
            frame = sys._getframe(2)
        if kept[0] is not frame and on_stack(kept[0], frame.f_back):
            return False
        del self.open[id(optimizer)]
        return True

    def forget(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Forget ``optimizer``'s kept call, or every one."""
        if optimizer is None:
            self.open.clear()
        else:
            self.open.pop(id(optimizer), None)

    def _forget_ended(self, frame: FrameType) -> None:
        """Forget the kept calls of this thread that are not on its stack above ``frame``."""
        thread = threading.get_ident()
        ended = [
            key
            for key, (kept, owner) in self.open.items()
            if owner == thread and not on_stack(kept, frame)
        ]
        for key in ended:
            del self.open[key]


def on_stack(frame: FrameType, start: FrameType | None) -> bool:
    """Whether ``frame`` is ``start`` or one of its callers."""
    while start is not None:
        if start is frame:
            return True
        start = start.f_back
    return False
