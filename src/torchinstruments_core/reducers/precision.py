"""``PrecisionReducer``: how a tensor would fare in bf16, fp16 and fp8, and its tails' weight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchinstruments_core.reducers._formats import FORMATS, FloatFormat
from torchinstruments_core.reducers._precision import PRECISION_METRICS, precision_statistics

if TYPE_CHECKING:
    import torch

    from torchinstruments_core.reducers.base import PreparedTensor, Reducer

__all__ = ["FORMATS", "FloatFormat", "PrecisionReducer", "precision_reducers"]


@dataclass(frozen=True, slots=True)
class PrecisionReducer:
    """Excess kurtosis, and the share of entries each low-precision format could not hold.

    Metrics, in order: ``kurtosis`` (Fisher's excess kurtosis of the finite entries, population
    moments: 0 for a normal distribution, 3 for a Laplace, large for outlier-dominated
    tensors), then for ``bf16``, ``fp16``, ``fp8_e4m3`` and ``fp8_e5m2`` (``FORMATS``, with
    their constants) ``<format>_overflow_fraction`` (finite entries with ``|x|`` above the
    format's largest finite value) and ``<format>_underflow_fraction`` (non-zero entries with
    ``|x|`` below its smallest subnormal), both over all entries. All nine come from one pass
    over the tensor's chunks; see ``_precision.precision_statistics`` for what is shared.
    """

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metric names, in the order of the returned values."""
        return PRECISION_METRICS

    def reduce(self, tensor: PreparedTensor) -> torch.Tensor:
        """Return the nine values as a 1-D tensor on ``tensor.device``."""
        return precision_statistics(tensor)


def precision_reducers() -> tuple[Reducer, ...]:
    """The opt-in reducers for quantization and low-precision work, beside the default ones.

    ``inject_observer(model, reducers=(*default_reducers(), *precision_reducers()))`` adds
    ``kurtosis`` and the bf16, fp16, fp8 e4m3 and e5m2 overflow and underflow fractions (see
    ``PrecisionReducer``) to every observed tensor's rows.
    """
    return (PrecisionReducer(),)
