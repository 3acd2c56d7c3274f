"""Gradients of outputs (and inputs) that reentrant activation checkpointing computes twice.

``torch.utils.checkpoint(..., use_reentrant=True)`` (DeepSpeed's and older Transformers' default)
runs the checkpointed block's forward without autograd: its modules' outputs cannot take a
gradient hook. The backward runs the block again, this time with autograd, and back-propagates
through that recomputation. A sample notes each output it saw computed without autograd inside a
forward that had autograd on; during the backward, the k-th recomputed call of a module is
matched to the k-th such call of the same module in the sample (same module, same
``call_index``), and the recomputed output's gradient is recorded under the original call. With
``record_inputs`` the inputs computed without autograd wait and are matched the same way (the call
is matched once, in its pre-hook, and its forward hook takes the same match).

Limit: calls are matched per module in order. A module shared by several checkpointed segments
is recomputed segment by segment in backward order, so its calls in different segments can be
matched to each other; outputs never recomputed keep rows saying ``no_gradient``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchinstruments_core._sample import Site


class RecomputeLedger:
    """The outputs of one sample that wait for their recomputation, per module and call."""

    __slots__ = ("_calls", "_matched", "_open", "_sites")

    def __init__(self) -> None:
        self._calls: dict[str, list[int]] = {}
        self._matched: dict[str, int] = {}
        self._open: dict[str, list[int | None]] = {}  # recomputed calls whose forward runs
        self._sites: set[Site] = set()

    def expect(self, gradient_site: Site) -> None:
        """Note that ``gradient_site``'s output was computed without autograd."""
        calls = self._calls.setdefault(gradient_site.layer, [])
        if not calls or calls[-1] != gradient_site.call_index:
            calls.append(gradient_site.call_index)
        self._sites.add(gradient_site)

    @property
    def waiting(self) -> bool:
        """Whether some output still waits for its recomputation."""
        return bool(self._sites)

    def match(self, layer: str) -> int | None:
        """The original ``call_index`` of the next recomputed call of ``layer``, if any."""
        calls = self._calls.get(layer, ())
        position = self._matched.get(layer, 0)
        if position >= len(calls):
            return None
        self._matched[layer] = position + 1
        return calls[position]

    def begin(self, layer: str) -> int | None:
        """A recomputed call of ``layer`` starts (its pre-hook): match it, until ``end``."""
        call_index = self.match(layer)
        self._open.setdefault(layer, []).append(call_index)
        return call_index

    def end(self, layer: str) -> int | None:
        """A recomputed call of ``layer`` ends: the call ``begin`` matched, else the next one."""
        calls = self._open.get(layer)
        if calls:
            return calls.pop()
        return self.match(layer)

    def take(self, gradient_site: Site) -> bool:
        """Claim ``gradient_site`` for a recomputed output; ``False`` if not waiting (any more)."""
        if gradient_site in self._sites:
            self._sites.discard(gradient_site)
            return True
        return False
