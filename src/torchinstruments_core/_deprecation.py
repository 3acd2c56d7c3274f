"""Old names that still work: each use warns (``DeprecationWarning``) and names the new one.

The warning points at the user's line, not at ours: the first caller outside the
``torchinstruments_*`` packages, however deep a dataclass ``__init__`` and ``__post_init__``
chain sits below it. Giving an argument under both names raises instead, whatever the values.
"""

from __future__ import annotations

import inspect
import warnings
from typing import TypeVar

from torchinstruments_core._exceptions import ConfigurationError

T = TypeVar("T")

_PACKAGES = ("torchinstruments_core", "torchinstruments_lightning", "torchinstruments_accelerate")


def renamed_argument(
    owner: str, new: str, value: T, old: str, old_value: T | None, default: T
) -> T:
    """The value of argument ``new``, or of its deprecated name ``old`` when that is given.

    ``old`` counts as given when it is not ``None``, ``new`` when it differs from ``default``
    (for a ``None`` default: when it is not ``None``).

    Raises:
        ConfigurationError: Both names are given.
    """
    if old_value is None:
        return value
    if value is not default and value != default:
        raise ConfigurationError(
            f"{owner}: `{old}` is the deprecated name of `{new}`; pass only `{new}`"
        )
    warn_deprecated(f"{owner}: the argument `{old}` is deprecated; use `{new}`")
    return old_value


def warn_deprecated(message: str) -> None:
    """Warn with ``message``, attributed to the first frame outside this library."""
    level, frame = 1, inspect.currentframe()
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith(_PACKAGES):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)
