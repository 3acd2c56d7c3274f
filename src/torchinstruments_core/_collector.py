"""Python's cyclic garbage collector, paused while the observer builds an optimizer step's record.

A recorded optimizer step makes and drops a few thousand small Python objects (a measurement, its
results and its job for each of its tensors, then the rows), none of them in a reference cycle:
each goes when its last reference does. Python's collector does not know that: it counts the
objects made and not yet freed, and every 700 runs a collection, which finds the record's
objects alive, moves them to an older generation and, every tenth time, to the oldest, whose
growth by a quarter starts a full collection of every object in the process. On a small GPT
sampled every step with the step signals (a process of 330,000 objects), that was 917 young
collections in 200 steps, 83 middle ones and 2 full ones of 160 and 179 ms: a training step
stalled for two steps' time, about every 100 sampled steps, where the same loop without the
observer ran no collection at all.

``collector_paused`` turns the collector off for the duration of a call (the optimizer's step
hooks' recorded-step work, ``OptimizerProbe``: the observer's own code, its sink's write and,
for sharded parameters, the collectives that combine them) and back on after, if it was on.
The switch is the process's: another thread runs without the collector meanwhile too. A pause
only puts collections off: the collector's count goes on rising with what any thread makes,
and falls with what is freed, so what the record made and dropped meanwhile leaves it where
it was, and anything else's is collected at the first allocation after the pause. The
post-hook ends with the record delivered and its objects freed, so no collection follows it;
what the pre-hook made lives through the optimizer's own step, where a collection may still
find it. The same 200 steps: 367 young collections (most of them the forward samples'
objects, which live from their hooks to the step's end), 33 middle ones and none of the whole
process. A collector the program turned off stays off.
"""

from __future__ import annotations

import functools
import gc
from typing import TYPE_CHECKING, ParamSpec, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable

_P = ParamSpec("_P")
_R = TypeVar("_R")


def collector_paused(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """``function``, run with the garbage collector off, and on again after if it was on.

    Re-entrant and safe across threads as far as the end state goes: the call that turned it
    off turns it on again, another one inside it finds it off and leaves it so (only a program
    that turns the collector off from another thread meanwhile would find it on again).
    """

    @functools.wraps(function)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        enabled = gc.isenabled()
        try:  # turned off inside: an interrupt right after it still turns it back on
            if enabled:
                gc.disable()
            return function(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return paused
