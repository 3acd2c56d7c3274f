"""How observers meet the end of their process: normal exit, SIGTERM and ``fork``.

- Normal exit: every live observer of the process is removed (its samples delivered, its run
  directory finalized) by an ``atexit`` handler and by a ``multiprocessing`` finalizer. A child
  started by ``multiprocessing`` or ``torch.multiprocessing`` (``spawn``, ``debug_launcher``,
  Lightning's ``ddp_spawn``, ``notebook_launcher``) leaves through ``os._exit`` after running
  multiprocessing's finalizers but never the ``atexit`` handlers, so both are needed.
- SIGTERM (what SLURM and Kubernetes send before SIGKILL): the observers are removed, then the
  handler that was installed before ours runs (Lightning's, for instance); with none, the
  default action ends the process as it would have without us. A SIGTERM that arrives while
  the main thread hands a sample to its sink (``handing_over``) waits until the hand-over is
  done: finalizing the sink from inside its own write would wait for locks that write holds.
- ``fork``: a child process inherits the parent's observers, hooks, sample state and run
  directory, but not its writer thread. In the child every inherited observer turns inert (it
  samples nothing, writes nothing, finalizes nothing); only the process that created an observer
  ever delivers its samples or finalizes its run.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.util
import os
import signal
import threading
import weakref
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import FrameType

log = logging.getLogger(__name__)


class Ending(Protocol):
    """What this module needs of an observer."""

    def remove(self) -> None:
        """Deliver every sample, finalize the sink and remove every hook."""

    def become_inert(self) -> None:
        """Stop observing in a forked child, without touching the parent's files."""


_live: weakref.WeakSet[Ending] = weakref.WeakSet()
_lock = threading.RLock()  # re-entered by a SIGTERM handler that interrupts register()
_hooks_pid: int | None = None  # the process whose exit hooks are installed
_previous_sigterm: Any = None
_handing_over = 0  # hand-overs to a sink under way on the main thread (``handing_over``)
_handing_over_thread: int | None = None  # the thread that began them (the main one)
_postponed: tuple[int, FrameType | None] | None = None  # a SIGTERM that came meanwhile


def register(observer: Ending) -> None:
    """Finalize ``observer`` when this process ends normally or receives SIGTERM."""
    with _lock:
        _install_hooks()
        _live.add(observer)


def unregister(observer: Ending) -> None:
    """Forget ``observer`` (it was removed)."""
    with _lock:
        _live.discard(observer)


def remove_all() -> None:
    """Remove every live observer of this process; each failure is logged, none stops the rest.

    A SIGTERM meanwhile ends the process once they are all finalized (``handing_over``).
    """
    if _hooks_pid != os.getpid():
        return  # inherited through fork: the observers belong to the parent
    with _lock:
        observers = list(_live)
    with handing_over():
        for observer in observers:
            try:
                observer.remove()
            except Exception:  # the process is ending: report and go on with the others
                log.exception("torchinstruments: finalizing %r at process exit failed", observer)


def _install_hooks() -> None:
    global _hooks_pid
    if _hooks_pid == os.getpid():
        return
    _hooks_pid = os.getpid()
    atexit_register()
    # Run by multiprocessing's children before os._exit; registries are per child, so per pid.
    multiprocessing.util.Finalize(None, remove_all, exitpriority=10)
    _install_sigterm_handler()


def atexit_register() -> None:
    """Register ``remove_all`` with ``atexit`` (once per process; a fork child inherits it)."""
    import atexit

    atexit.unregister(remove_all)
    atexit.register(remove_all)


def _install_sigterm_handler() -> None:
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may install handlers; exit hooks still finalize
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main interpreter, or a platform without SIGTERM
        return
    _previous_sigterm = current


@contextlib.contextmanager
def handing_over() -> Iterator[None]:
    """Hold off this module's SIGTERM handler while the block hands samples to a sink.

    Python runs a signal handler on the main thread between two of its bytecodes, so a SIGTERM
    can interrupt a sink's ``write`` while it holds a lock (the run directory's writer holds
    its pipe while it writes a sample). Finalizing the sink right there would wait for that
    lock, or for a thread that waits for it, forever. On the main thread the handler's work is
    postponed to the end of the outermost such block; other threads' blocks never hold it off.
    Removing an observer is such a block too: a SIGTERM in the middle of finalizing a run ends
    the process once the run is finalized, not before.
    """
    global _handing_over, _handing_over_thread
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _handing_over == 0:
        _handing_over_thread = threading.get_ident()
    _handing_over += 1
    try:
        yield
    finally:
        _handing_over -= 1
        if _handing_over == 0 and _postponed is not None:
            _on_sigterm(*_postponed)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _postponed
    if _handing_over:  # in the middle of a sink's write: finalize once it is done
        _postponed = (signum, frame)
        return
    _postponed = None
    remove_all()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
    elif previous in (signal.SIG_DFL, None):
        # End the process as SIGTERM would have without us.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    # SIG_IGN: the process had chosen to ignore SIGTERM; so do we, after finalizing.


def _after_fork_in_child() -> None:
    global _hooks_pid, _lock, _handing_over, _postponed
    _lock = threading.RLock()  # another thread of the parent may have held it during fork
    if threading.get_ident() != _handing_over_thread:
        # the hand-overs under way belong to a thread the child does not have: none will end
        _handing_over, _postponed = 0, None
    observers = list(_live)
    _live.clear()
    _hooks_pid = None  # the child installs its own exit hooks when it creates an observer
    for observer in observers:
        with contextlib.suppress(Exception):
            observer.become_inert()


os.register_at_fork(after_in_child=_after_fork_in_child)
