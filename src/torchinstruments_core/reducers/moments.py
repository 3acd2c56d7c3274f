"""``MomentsReducer``: scale, range and sparsity statistics of a tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchinstruments_core.reducers.functional import MOMENT_METRICS, moments

if TYPE_CHECKING:
    import torch

    from torchinstruments_core.reducers.base import PreparedTensor


@dataclass(frozen=True, slots=True)
class MomentsReducer:
    """Mean, std, min, max, rms, max_abs and l2_norm of the finite entries, two fractions of all.

    Metrics, in order: ``mean``, ``std`` (population), ``min``, ``max``, ``zero_fraction``,
    ``nonfinite_fraction``, ``rms``, ``max_abs``, ``l2_norm`` (``sqrt(sum(x**2))``, the number
    ``clip_grad_norm_`` reports). See ``functional.moments``.
    """

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metric names, in the order of the returned values."""
        return MOMENT_METRICS

    def reduce(self, tensor: PreparedTensor) -> torch.Tensor:
        """Return the nine statistics as a 1-D tensor on ``tensor.device``."""
        return moments(tensor)
