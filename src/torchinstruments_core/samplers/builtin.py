"""Built-in samplers: every forward, every n-th forward, the first forward after each interval."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from torchinstruments_core._exceptions import ConfigurationError

if TYPE_CHECKING:
    from collections.abc import Callable


class AlwaysSampler:
    """Sample every root forward. For tests and short debugging runs: it costs the most."""

    def should_sample(self, forward_index: int) -> bool:
        """Return ``True``."""
        return True

    def __repr__(self) -> str:
        return "AlwaysSampler()"


class EveryNForwardsSampler:
    """Sample root forwards ``offset``, ``offset + n``, ``offset + 2n`` ….

    Args:
        n: Distance between sampled forwards, at least 1.
        offset: Index of the first sampled forward (default 0: the very first forward is sampled,
            so a short run always shows something).

    Example:
        >>> sampler = EveryNForwardsSampler(3)
        >>> [i for i in range(10) if sampler.should_sample(i)]
        [0, 3, 6, 9]
    """

    def __init__(self, n: int, *, offset: int = 0) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigurationError.invalid("n", n, "an int >= 1")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ConfigurationError.invalid("offset", offset, "an int >= 0")
        self.n = n
        self.offset = offset

    def should_sample(self, forward_index: int) -> bool:
        """Return whether ``forward_index`` is ``offset`` plus a multiple of ``n``."""
        return forward_index >= self.offset and (forward_index - self.offset) % self.n == 0

    def __repr__(self) -> str:
        return f"EveryNForwardsSampler(n={self.n}, offset={self.offset})"


class IntervalSampler:
    """Sample the first root forward, then the first one after each ``seconds`` have passed.

    The interval is measured from the previous sample, so a slow step never causes a burst.

    Args:
        seconds: Minimum time between samples, greater than 0.
        clock: Monotonic clock in seconds; replaceable for tests.
    """

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        valid = isinstance(seconds, int | float) and not isinstance(seconds, bool)
        if not valid or not seconds > 0:
            raise ConfigurationError.invalid("interval", seconds, "a number of seconds > 0")
        self.seconds = float(seconds)
        self._clock = clock
        self._last: float | None = None

    def should_sample(self, forward_index: int) -> bool:
        """Return whether ``seconds`` have passed since the last sample (or none was taken)."""
        now = self._clock()
        if self._last is not None and now - self._last < self.seconds:
            return False
        self._last = now
        return True

    def __repr__(self) -> str:
        return f"IntervalSampler(seconds={self.seconds:g})"
