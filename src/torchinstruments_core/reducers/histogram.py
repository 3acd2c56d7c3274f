"""``HistogramReducer``: a fixed-bin histogram of a tensor's finite entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchinstruments_core.reducers.functional import histogram

if TYPE_CHECKING:
    import torch

    from torchinstruments_core.reducers.base import PreparedTensor


@dataclass(frozen=True, slots=True, kw_only=True)
class HistogramReducer:
    """A ``bins``-bin histogram of the finite entries over their ``[min, max]``.

    Its output is not a list of scalars, so ``metrics`` is empty and ``reduce`` returns one packed
    tensor of ``2 * bins + 2`` values (see ``functional.histogram``). The engine recognises this
    reducer and splits the packed tensor with ``unpack`` after the transfer to the host.

    Args:
        bins: Number of bins; a positive int.

    Raises:
        ValueError: If ``bins`` is not a positive int.
    """

    bins: int = 64

    def __post_init__(self) -> None:
        if isinstance(self.bins, bool) or not isinstance(self.bins, int) or self.bins < 1:
            raise ValueError(f"HistogramReducer(bins={self.bins!r}): bins must be a positive int")

    @property
    def metrics(self) -> tuple[str, ...]:
        """No scalar metrics: the histogram is returned packed, not as named values."""
        return ()

    def reduce(self, tensor: PreparedTensor) -> torch.Tensor:
        """Return the packed histogram: ``bins + 1`` edges, ``bins`` counts, non-finite count."""
        return histogram(tensor, self.bins)

    def unpack(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split a packed histogram into its edges, its counts and its 0-d non-finite count."""
        edges_end = self.bins + 1
        return packed[:edges_end], packed[edges_end:-1], packed[-1]
