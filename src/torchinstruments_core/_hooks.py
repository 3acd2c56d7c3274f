"""Hook objects that stay behind when a model is copied or pickled, and that compile as calls.

A model's hook dictionaries travel with ``copy.deepcopy`` and ``torch.save(model)``. A plain bound
method would drag the whole observer (and its sink) into the copy, and the copy would then report
into the original run. These hooks copy and pickle as ``inert_hook``, a no-op: the copy is not
observed and the original keeps its observer.

Under ``torch.compile`` the hooks are never traced: a compiled region that reaches one calls it
as plain Python. A sampled forward runs as plain Python altogether (``force_eager``), so every
module hook fires on real tensors, and the compiled graphs of unsampled forwards stay as they were.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, SupportsIndex, TypeVar

from torchinstruments_core._locks import lock

if TYPE_CHECKING:
    from collections.abc import Callable

F = TypeVar("F", bound="Callable[..., Any]")


def run_eagerly(function: F) -> F:
    """``function``, called as is from compiled code instead of being traced into its graph.

    The observer's hooks do bookkeeping and reductions that have no place in a graph; traced,
    they would break it at every ``.item()`` and guard on the observer's state.
    """
    import torch

    return torch.compiler.disable(function)  # type: ignore[no-untyped-call,no-any-return]


class _EagerStance:
    """The ``force_eager`` stance, held while any observer has a sample armed.

    Observers arm and disarm in any order (two models, nested steps); the stance is set when the
    first holder arrives and the one found then is restored when the last one leaves.
    """

    def __init__(self) -> None:
        self._lock = lock()
        self._holders = 0
        self._stance: Any = None

    def acquire(self) -> Callable[[], None]:
        import torch

        set_stance = getattr(torch.compiler, "set_stance", None)
        if set_stance is None:
            return _nothing
        with self._lock:
            if self._holders == 0:
                # takes effect now; its __exit__ restores the stance found
                self._stance = set_stance("force_eager")
            self._holders += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                self._holders -= 1
                if self._holders == 0:
                    stance, self._stance = self._stance, None
                    stance.__exit__(None, None, None)

        return release


_EAGER = _EagerStance()


def _nothing() -> None:
    return None


def force_eager() -> Callable[[], None]:
    """Run compiled functions as plain Python until the returned function is called.

    ``torch.compiler.set_stance("force_eager")`` (torch 2.6 and later) makes a sampled forward
    take the model's own Python code, where the per-module hooks fire, without compiling a
    variant of the graph with the hooks in it; the unsampled forwards keep the compiled graph.
    The stance is process-wide: it holds while any observer has a sample armed. Older torch
    has no stances: the returned function does nothing, and compiled code traces up to each
    hook, breaking its graph there (see the README).
    """
    return _EAGER.acquire()


def inert_hook(*args: object) -> None:
    """A hook that does nothing; what an observer's hook becomes in a copy of the model."""
    return None


class Hook:
    """A callable hook that becomes ``inert_hook`` when its model is deep-copied or pickled."""

    __slots__ = ("_function",)

    def __init__(self, function: Callable[..., Any]) -> None:
        self._function = function

    def _call(self, *args: Any) -> Any:
        return self._function(*args)

    # compiled code calls the hook as it is; traced, it would inspect the observer's state
    __call__ = run_eagerly(_call)

    def __deepcopy__(self, memo: dict[int, object]) -> Callable[..., None]:
        return inert_hook

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        # Unpickling calls inert_hook() once and stores its result; return the function itself.
        return (_inert_hook_factory, ())


def _inert_hook_factory() -> Callable[..., None]:
    return inert_hook


class ForwardPatch:
    """An instance-level ``forward`` that observes direct ``module.forward(x)`` calls.

    Copies and pickles of the module get the forward it replaced (rebound to the copy), so the copy
    runs the user's forward and is not observed.
    """

    __slots__ = ("_observe", "original", "replaced_instance_attribute")

    def __init__(
        self,
        original: Callable[..., Any],
        observe: Callable[..., Any],
        *,
        replaced_instance_attribute: bool,
    ) -> None:
        self.original = original
        self._observe = observe
        # True when the module already had an instance-level forward (Accelerate's autocast
        # wrapper, another tool's patch): removal puts that one back instead of deleting ours.
        self.replaced_instance_attribute = replaced_instance_attribute

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._observe(self.original, args, kwargs)

    def __deepcopy__(self, memo: dict[int, object]) -> object:
        import copy

        return copy.deepcopy(self.original, memo)

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        return self.original.__reduce_ex__(protocol)
