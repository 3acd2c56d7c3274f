"""Hook objects that stay behind when a model is copied or pickled while observed.

A model's hook dictionaries travel with ``copy.deepcopy`` and ``torch.save(model)``. A plain bound
method would drag the whole observer (and its sink) into the copy, and the copy would then report
into the original run. These hooks copy and pickle as ``inert_hook``, a no-op: the copy is not
observed and the original keeps its observer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, SupportsIndex

if TYPE_CHECKING:
    from collections.abc import Callable


def inert_hook(*args: object) -> None:
    """A hook that does nothing; what an observer's hook becomes in a copy of the model."""
    return None


class Hook:
    """A callable hook that becomes ``inert_hook`` when its model is deep-copied or pickled."""

    __slots__ = ("_function",)

    def __init__(self, function: Callable[..., Any]) -> None:
        self._function = function

    def __call__(self, *args: Any) -> Any:
        return self._function(*args)

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
