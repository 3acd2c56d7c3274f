"""The observer's locks: re-entrant, so that its SIGTERM handler never waits for itself.

Python runs a signal handler on the main thread between two bytecodes, also inside a ``with``
block that holds one of these locks (a gradient hook holding its sample's lock, the optimizer's
pre-hook lending a copy buffer). The SIGTERM handler finalizes every run there (``_process``):
removing the observer takes the same locks again, on the same thread, and a plain lock then
waits for itself until the scheduler's SIGKILL. A re-entrant one lets the handler through; what
it finds half-updated belongs to a process about to end, or to a sample it closes.
"""

from __future__ import annotations

import threading


def lock() -> threading.RLock:
    """A new lock for the observer's state: re-entrant (see the module's docstring)."""
    return threading.RLock()
