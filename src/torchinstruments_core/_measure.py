"""Measure one tensor: decide whether it can be reduced, then run the reducers on its device.

Nothing here leaves the device. A ``Measurement`` holds device tensors (or the reason a value is
missing) until the sample closes and every measurement crosses to the host in one transfer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from torchinstruments_core._records import UnavailableReason
from torchinstruments_core.reducers import (
    HistogramReducer,
    PreparedTensor,
    Reducer,
    working_dtype,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

_MAX_ERROR_TEXT = 200


@dataclass(slots=True)
class ReducerResult:
    """What one reducer gave for one tensor: device values, or the reason it gave none."""

    metrics: tuple[str, ...]
    values: torch.Tensor | None
    error: str | None = None


@dataclass(slots=True)
class Measurement:
    """The reductions of one tensor, still on its device."""

    reason: UnavailableReason | None
    metrics: tuple[str, ...]
    n_finite: torch.Tensor | None = None
    results: list[ReducerResult] = field(default_factory=list)
    histogram: torch.Tensor | None = None
    histogram_bins: int = 0
    histogram_float64: bool = False
    errors: list[BaseException] = field(default_factory=list)


def classify(tensor: torch.Tensor) -> UnavailableReason | None:
    """Why ``tensor`` cannot be reduced, or ``None`` when it can."""
    if tensor.is_meta:
        return UnavailableReason.META_TENSOR
    if tensor.layout != torch.strided:
        return UnavailableReason.SPARSE_TENSOR
    if not tensor.is_floating_point():
        return UnavailableReason.UNSUPPORTED_DTYPE
    if tensor.numel() == 0:
        return UnavailableReason.EMPTY_TENSOR
    return None


def reducer_error_reason(error: BaseException) -> str:
    """The ``unavailable_reason`` of a value whose reducer raised."""
    text = f"{UnavailableReason.REDUCER_ERROR}: {type(error).__name__}: {error}"
    return text[:_MAX_ERROR_TEXT]


def _autocast_off(device: torch.device) -> contextlib.AbstractContextManager[object]:
    # Hooks run inside the user's autocast region; statistics must stay in their working dtype.
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class Measurer:
    """Runs the reducers on tensors, each on its own device with a private random generator.

    Args:
        reducers: Scalar reducers applied to every observed tensor.
        histogram: Reducer for the focus modules' histograms.
        seed: Seed of the private generators used for subsampling (the model's random stream is
            never touched).
    """

    def __init__(
        self, reducers: Sequence[Reducer], histogram: HistogramReducer, *, seed: int = 0
    ) -> None:
        self.reducers = tuple(reducers)
        self.histogram = histogram
        self.metrics = tuple(m for r in self.reducers for m in r.metrics)
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._index_cache: dict[tuple[torch.device, int, int], torch.Tensor] = {}

    def new_sample(self) -> None:
        """Forget the subsample positions of the previous sample; the next one draws its own."""
        self._index_cache.clear()

    def measure(
        self,
        tensor: torch.Tensor,
        *,
        with_histogram: bool,
        scale: float | torch.Tensor | None = None,
    ) -> Measurement:
        """Reduce ``tensor`` (divided by ``scale`` when given, on the tensor's device).

        The histogram is computed too when ``with_histogram`` is set.
        """
        reason = classify(tensor)
        if reason is not None:
            return Measurement(reason=reason, metrics=self.metrics)
        with torch.no_grad(), _autocast_off(tensor.device):
            if scale is not None:  # in the working dtype: fp16 would underflow
                dtype = working_dtype(tensor.dtype)
                if isinstance(scale, torch.Tensor):  # never read on the host: no device sync
                    # non_blocking only towards a device: a host copy must land before it is read
                    to_device = tensor.device.type != "cpu"
                    scale = (
                        scale.detach().reshape(()).to(tensor.device, dtype, non_blocking=to_device)
                    )
                tensor = tensor.detach().to(dtype) / scale
            prepared = PreparedTensor(tensor, self._generator(tensor.device), self._index_cache)
            measurement = Measurement(None, self.metrics, n_finite=prepared.n_finite)
            for reducer in self.reducers:
                measurement.results.append(self._run(reducer, prepared, measurement))
            if with_histogram:
                self._run_histogram(prepared, measurement)
        return measurement

    def _run(
        self, reducer: Reducer, prepared: PreparedTensor, measurement: Measurement
    ) -> ReducerResult:
        try:
            return ReducerResult(reducer.metrics, reducer.reduce(prepared).reshape(-1))
        except Exception as error:  # a reducer must never break the forward (error_policy decides)
            measurement.errors.append(error)
            return ReducerResult(reducer.metrics, None, reducer_error_reason(error))

    def _run_histogram(self, prepared: PreparedTensor, measurement: Measurement) -> None:
        try:
            measurement.histogram = self.histogram.reduce(prepared).reshape(-1)
            measurement.histogram_bins = self.histogram.bins
            measurement.histogram_float64 = prepared.values.dtype == torch.float64
        except Exception as error:
            measurement.errors.append(error)

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator
