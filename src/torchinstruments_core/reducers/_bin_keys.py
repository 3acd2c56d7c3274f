"""How bins become the keys that ``torch.bincount`` counts on the host, and back into counts.

``torch.bincount`` adds one to a counter per key, in a scalar loop. When neighbouring keys
repeat (the zeros of a ReLU, a gradient's narrow peak) each increment waits for the one before
it to be stored, and when they mix with others the processor mispredicts which increments
depend on which: a ReLU output counted that way costs 1.5 times random data, a gradient two to
three times. Lanes take that away, and pairs halve the loop for large tensors:

- Lanes: neighbouring keys go to separate copies of the table (key ``bin + lane * width``,
  the lane cycling with the position), so repeats are ``lanes`` increments apart.
- Pairs: with at most 127 bins a bin fits a byte, and two neighbouring bytes read as one int16
  are one key for both entries, so the loop runs once per two entries (for tensors of at least
  ``PAIRS_FROM`` entries, where that outweighs folding the larger table). The lane is added to
  the low-order byte of each pair (at most ``lanes * width - 1 <= 255``), the high-order byte
  holds a bin (``< width <= 128``), so the key is a non-negative int16 below ``256 * width``.

Counts come back by summing the lanes, and for pairs by counting each byte value in both
positions of the pair table. The keys are exact functions of the bins, so the counts are the
counts of the bins, whatever the order of the entries.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import NDArray

LANES = 3
"""Copies of the table: with three, a repeat waits on an increment three keys back, which has
already been stored; more lanes only spread the table over more of the cache."""
PAIRS_FROM = 2**18
"""Entries from which pairs pay: the pair table's 256 counters per bin cost about 18 µs to
clear, add and fold, more than pairs save on 131,072 entries of random data."""
_PAIR_WIDTH = 128
"""The most bins-plus-one that pairs allow: an int16 key below ``256 * width`` is non-negative."""
_INT16_KEYS = 2**15
"""Single keys fit an int16 up to here; wider tables (over 10,921 bins) take int32, one lane."""
_LOW_BYTE = 0 if sys.byteorder == "little" else 1
"""Which byte of a pair is the int16's low-order byte, which carries the lane."""


@dataclass(frozen=True, slots=True)
class BinKeys:
    """The keys of one histogram's bins: a dtype for the bins, pairs or not, and the lanes.

    ``width`` is ``bins + 1``: the top value ``bins`` (the max, up to rounding) has a counter
    of its own, folded into the last bin by the caller.
    """

    dtype: type[np.integer]
    """The dtype of the bins, which the truncated offsets are cast to (bytes for pairs)."""
    paired: bool
    lanes: int
    width: int

    @property
    def period(self) -> int:
        """Entries after which the lane pattern repeats."""
        return 2 * self.lanes if self.paired else self.lanes

    @property
    def size(self) -> int:
        """Number of distinct keys: the ``minlength`` of the count."""
        return 256 * self.width if self.paired else self.lanes * self.width

    def view(self, bins: NDArray[np.integer]) -> NDArray[np.integer]:
        """The keys of a buffer of bins (an even number for pairs), lanes added: a view."""
        return bins.view(np.int16) if self.paired else bins

    def counts(self, table: NDArray[np.int64], padding: int) -> NDArray[np.int64]:
        """The ``width`` counts of the bins from the counts of the keys.

        Args:
            table: How often each of the ``size`` keys occurred.
            padding: How many zero bins were added to complete a pair (they are taken out).
        """
        by_value = table
        if self.paired:
            pairs = table.reshape(self.width, 256)  # high-order byte, low-order byte
            by_value = pairs.sum(axis=0)
            by_value[: self.width] += pairs.sum(axis=1)
            by_value[0] -= padding
        lanes = by_value[: self.lanes * self.width].reshape(self.lanes, self.width)
        counts: NDArray[np.int64] = lanes.sum(axis=0)
        return counts


def bin_keys(bins: int, entries: int) -> BinKeys:
    """The keys for ``bins`` bins of ``entries`` entries.

    Pairs of bytes for at least ``PAIRS_FROM`` entries in up to 127 bins; else single keys:
    bytes up to 84 bins, int16 up to 10,921, int32 beyond (one lane: the table alone is
    larger than the L2 cache).

    Args:
        bins: Number of bins, at least 1.
        entries: How many entries will be counted.
    """
    width = bins + 1
    if width <= _PAIR_WIDTH and entries >= PAIRS_FROM:
        return BinKeys(np.uint8, paired=True, lanes=min(LANES, 256 // width), width=width)
    if LANES * width <= 256:
        return BinKeys(np.uint8, paired=False, lanes=LANES, width=width)
    if LANES * width <= _INT16_KEYS:
        return BinKeys(np.int16, paired=False, lanes=LANES, width=width)
    return BinKeys(np.int32, paired=False, lanes=1, width=width)


@lru_cache(maxsize=8)
def lane_pattern(keys: BinKeys, length: int) -> NDArray[np.integer]:
    """What to add to ``length`` bins to give each its lane, read-only; slice it by phase.

    Entry ``i`` of a buffer that starts at a multiple of ``keys.period`` gets
    ``pattern[i]``; a block written from position ``p`` adds ``pattern[p % period :]``. The
    pattern is ``length + period`` long for that. Cached: callers ask for a few lengths.
    """
    total = length + keys.period
    pattern = np.zeros(total, dtype=keys.dtype)
    if keys.paired:
        low = pattern[_LOW_BYTE::2]
        low[:] = np.arange(low.size) % keys.lanes * keys.width
    else:
        pattern[:] = np.arange(total) % keys.lanes * keys.width
    pattern.flags.writeable = False
    return pattern
