"""Which models have an observer, without adding anything to the models themselves."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from torchinstruments_core._exceptions import ObserverAlreadyAttachedError

if TYPE_CHECKING:
    from torch import nn

    from torchinstruments_core._observer import Observer

_observers: weakref.WeakKeyDictionary[nn.Module, Observer] = weakref.WeakKeyDictionary()


def claim(model: nn.Module, observer: Observer) -> None:
    """Record that ``observer`` observes ``model``; raise if another one already does."""
    existing = _observers.get(model)
    if existing is not None:
        raise ObserverAlreadyAttachedError(
            f"{type(model).__name__} already has an observer ({existing!r}); call "
            "remove_observer(model) before injecting another"
        )
    _observers[model] = observer


def lookup(model: nn.Module) -> Observer | None:
    """The observer of ``model``, if any."""
    return _observers.get(model)


def forget(model: nn.Module, observer: Observer) -> None:
    """Drop the record, if it is still ``observer``'s."""
    if _observers.get(model) is observer:
        del _observers[model]
