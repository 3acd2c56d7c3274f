"""The step window: which optimizer steps are recorded.

A window opens when a sample opens with gradients enabled (a sampled root forward, or
``open_sample``) or when an adapter announces a sampled step (``begin_step(step, sample=True)``);
its key is the trainer step (``None`` in a plain loop). While it is open, the first step of each
watched optimizer is recorded. It closes

- when an adapter announces another step (``begin_step`` with another number);
- when a new training sample opens after an optimizer stepped in it, in a plain loop (the next
  iteration; a trainer step's later samples, such as the next phase of a manual-optimization
  step, keep its window);
- in a plain loop, when an optimizer that already stepped in it steps again (its next,
  unsampled, iteration; in a trainer step, such as a WGAN's critic stepping five times, only
  each optimizer's first step is recorded and the window stays);
- at removal.

A window of a trainer step that closes because another step began, with no optimizer step in it,
is *unstepped*: the fp16 ``GradScaler`` skipped ``optimizer.step()``, and the caller notes it.

Every optimizer pre-hook asks ``claim``; on an unsampled step that is one attribute read.
"""

from __future__ import annotations


class StepWindow:
    """Owns the decision which optimizer steps are recorded (see the module docstring).

    Attributes:
        watching: Whether any optimizer is watched; until then nothing opens.
        open: Whether a window is open; read first by every optimizer pre-hook.
    """

    __slots__ = ("_key", "_stepped", "open", "watching")

    def __init__(self) -> None:
        self.watching = False
        self.open = False
        self._key: int | None = None
        self._stepped: set[int] = set()  # ids of the optimizers that stepped in the window

    @property
    def step(self) -> int | None:
        """The trainer step of the open window (``None`` in a plain loop, or when closed)."""
        return self._key if self.open else None

    def sampled(self, step: int | None) -> int | None:
        """A training sample of ``step`` opened (or a sampled step was announced).

        The open window of the same trainer step stays open (the micro-batches of an
        accumulated step, the next phase of a manual-optimization step after its optimizer
        stepped: each optimizer's first step is recorded once, and no second window notes a
        skipped step). In a plain loop (``None``) it stays open while no optimizer stepped in
        it; otherwise a new window opens.

        Returns:
            The step of a window closed unstepped, to be noted; ``None`` if there is none.
        """
        if not self.watching:
            return None
        if self.open and self._key == step and (step is not None or not self._stepped):
            return None
        unstepped = self._close(noted=self._key != step)
        self.open, self._key = True, step
        return unstepped

    def announced(self, step: int) -> int | None:
        """An adapter began trainer step ``step``: the window of another step closes.

        Returns:
            The step of a window closed unstepped, to be noted; ``None`` if there is none.
        """
        if not self.open or self._key == step:
            return None
        return self._close(noted=True)

    def claim(self, optimizer: object) -> bool:
        """Whether this step of ``optimizer`` is recorded (its first in the open window)."""
        if not self.open:
            return False
        if id(optimizer) in self._stepped:  # its next step: not recorded
            if self._key is None:  # a plain loop's next, unsampled iteration: the window ends
                self._close(noted=False)
            return False  # a trainer step's window lasts until another step is announced
        self._stepped.add(id(optimizer))
        return True

    def close(self) -> None:
        """Close the window without noting anything (removal)."""
        self._close(noted=False)

    def _close(self, *, noted: bool) -> int | None:
        unstepped = self.open and noted and not self._stepped and self._key is not None
        key = self._key
        self.open, self._key = False, None
        self._stepped = set()
        return key if unstepped else None
