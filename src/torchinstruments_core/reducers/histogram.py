"""``HistogramReducer``: a fixed-bin histogram of a tensor's finite entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchinstruments_core._exceptions import ConfigurationError
from torchinstruments_core.reducers.functional import histogram_counts, split_histogram

if TYPE_CHECKING:
    import torch

    from torchinstruments_core.reducers.base import PreparedTensor


MAX_HISTOGRAM_BINS = 65_536
"""The most bins a histogram may have. Each bin costs a few bytes per histogram on the device,
and finding its edge about a microsecond of host time when the sample is delivered (60 ms for a
histogram of 65,536 bins on one CPU core, within 15 MiB); far more bins would allocate gigabytes
in the backward (10**7 bins took 19 GiB)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HistogramReducer:
    """A ``bins``-bin histogram of the finite entries over their ``[min, max]``.

    Its output is not a list of scalars, so ``metrics`` is empty and ``reduce`` returns one packed
    tensor of ``bins + 4`` values (see ``functional.histogram_counts``): what needs the data, on
    its device. The engine recognises this reducer and, after the transfer to the host, splits
    the packed values into edges, counts and the non-finite count with
    ``functional.split_histogram``; ``unpack`` does the same for a caller of ``reduce``.

    Args:
        bins: Number of bins; an int from 1 to ``MAX_HISTOGRAM_BINS`` (65,536).

    Raises:
        ConfigurationError: If ``bins`` is not such an int (a ``ValueError``).
    """

    bins: int = 64

    def __post_init__(self) -> None:
        bins = self.bins
        if (
            isinstance(bins, bool)
            or not isinstance(bins, int)
            or not 1 <= bins <= MAX_HISTOGRAM_BINS
        ):
            raise ConfigurationError(
                f"HistogramReducer(bins={bins!r}): bins must be a positive int "
                f"of at most {MAX_HISTOGRAM_BINS:,}"
            )

    @property
    def metrics(self) -> tuple[str, ...]:
        """No scalar metrics: the histogram is returned packed, not as named values."""
        return ()

    def reduce(self, tensor: PreparedTensor) -> torch.Tensor:
        """Return the packed histogram: the grid's lo, hi and scale, the counts, non-finite."""
        return histogram_counts(tensor, self.bins)

    def unpack(
        self, packed: torch.Tensor | list[float], *, float64: bool = False
    ) -> tuple[list[float], list[float], float]:
        """Split a packed histogram, read on the host, into its edges, counts and non-finite count.

        Args:
            packed: What ``reduce`` returned (a tensor is read on the host) or its values.
            float64: Whether the tensor was float64 (its histogram computed in float64).
        """
        values = packed if isinstance(packed, list) else packed.tolist()
        return split_histogram(values, self.bins, float64=float64)
