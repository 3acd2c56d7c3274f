"""Which models have an observer, without adding anything to the models themselves.

It knows observers only as things that can be removed, so that it imports nothing of the
observer (which imports it to forget its model at removal).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Protocol

from torchinstruments_core._exceptions import ObserverAlreadyAttachedError

if TYPE_CHECKING:
    from torch import nn


class Removable(Protocol):
    """What the registry needs of an observer."""

    def remove(self) -> None:
        """Remove every hook, deliver every sample and close the sink."""


_observers: weakref.WeakKeyDictionary[nn.Module, Removable] = weakref.WeakKeyDictionary()


def claim(model: nn.Module, observer: Removable) -> None:
    """Record that ``observer`` observes ``model``; raise if another one already does."""
    existing = _observers.get(model)
    if existing is not None:
        raise ObserverAlreadyAttachedError(
            f"{type(model).__name__} already has an observer ({existing!r}); call "
            "remove_observer(model) before injecting another"
        )
    _observers[model] = observer


def lookup(model: nn.Module) -> Removable | None:
    """The observer of ``model``, if any."""
    return _observers.get(model)


def forget(model: nn.Module, observer: Removable) -> None:
    """Drop the record, if it is still ``observer``'s."""
    if _observers.get(model) is observer:
        del _observers[model]
