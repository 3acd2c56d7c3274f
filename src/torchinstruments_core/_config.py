"""Policies and the validation of ``inject_observer`` arguments."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, TypeVar

from torchinstruments_core._exceptions import ConfigurationError


class RankPolicy(StrEnum):
    """Which processes of a distributed run observe."""

    RANK0 = "rank0"
    ALL = "all"


class ErrorPolicy(StrEnum):
    """What a failure while observing does: warn and record it, or raise."""

    WARN = "warn"
    RAISE = "raise"


class NonFinitePolicy(StrEnum):
    """What an adapter does when a sampled step holds NaN or Inf values.

    ``WARN`` logs a message naming the first layer of the forward and of the backward and sends
    it to the trainer's loggers; ``STOP`` does the same and asks the trainer to stop;
    ``RAISE`` does the same and raises ``NonFiniteError``; ``IGNORE`` does none of it.
    """

    WARN = "warn"
    STOP = "stop"
    RAISE = "raise"
    IGNORE = "ignore"


E = TypeVar("E", bound=StrEnum)


def parse_choice(enum: type[E], argument: str, value: Any) -> E:
    """Return ``value`` as a member of ``enum``, or raise naming the argument and the choices."""
    try:
        return enum(value)
    except ValueError:
        raise ConfigurationError.invalid(argument, value, [m.value for m in enum]) from None


def check_exclusive(**arguments: object) -> None:
    """Raise when more than one of ``arguments`` is given (not ``None``), naming them."""
    given = [name for name, value in arguments.items() if value is not None]
    if len(given) > 1:
        names = " and ".join(f"`{name}`" for name in given)
        raise ConfigurationError(f"{names} cannot be given together; pass only one of them")


def check_positive_int(
    argument: str, value: Any, *, minimum: int, maximum: int | None = None
) -> int:
    """Return ``value`` if it is an int in ``[minimum, maximum]``, else raise naming the argument.

    ``maximum`` ``None`` leaves the range open above.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError.invalid(argument, value, _int_range(minimum, maximum))
    if maximum is not None and value > maximum:
        raise ConfigurationError.invalid(argument, value, _int_range(minimum, maximum))
    return value


def _int_range(minimum: int, maximum: int | None) -> str:
    if maximum is None:
        return f"an int >= {minimum}"
    return f"an int from {minimum:,} to {maximum:,}"


def check_instance(argument: str, value: Any) -> None:
    """Raise when ``value`` is a class where an instance is expected (``sampler=EveryN…``)."""
    if isinstance(value, type):
        raise ConfigurationError.invalid(
            argument, value, f"an instance, such as {value.__name__}(...), not the class"
        )


def check_run_id(value: Any) -> str | None:
    """Return ``value`` if it is ``None`` or a non-empty str, else raise (it names every row)."""
    if value is None or (isinstance(value, str) and value):
        return value
    raise ConfigurationError.invalid("run_id", value, "a non-empty str, or None to generate one")
