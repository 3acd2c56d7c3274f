"""The reducer extension point: a ``Reducer`` turns one prepared tensor into a few device scalars.

A reducer never leaves the device: no ``.item()``, no ``.cpu()``. It returns a 1-D tensor with one
entry per name in ``metrics``, in the working dtype, and NaN for a value it cannot define (the
engine turns NaN into a null with a reason). ``PreparedTensor`` holds the work shared between
reducers (the flattened working-dtype copy, the finite mask and its count), computed at most once
per tensor.
"""

from __future__ import annotations

from functools import cached_property
from typing import Protocol, runtime_checkable

import torch


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are computed in: float64 for float64 input, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class PreparedTensor:
    """A dense, non-empty floating tensor, flattened to its working dtype, with shared derivations.

    Args:
        tensor: A dense floating-point tensor with at least one element. It is detached and never
            modified.
        generator: Random source for subsampling, on the tensor's device. A private generator keeps
            the model's own random stream untouched.
    """

    def __init__(self, tensor: torch.Tensor, generator: torch.Generator) -> None:
        self.source_dtype = tensor.dtype
        self.values = tensor.detach().reshape(-1).to(working_dtype(tensor.dtype))
        self.numel = self.values.numel()
        self.generator = generator

    @property
    def device(self) -> torch.device:
        """Device the tensor and every reduction live on."""
        return self.values.device

    @cached_property
    def finite(self) -> torch.Tensor:
        """Boolean mask of the finite entries."""
        return torch.isfinite(self.values)

    @cached_property
    def n_finite(self) -> torch.Tensor:
        """Number of finite entries, a 0-d int64 tensor (exact past 2**24 elements)."""
        return torch.count_nonzero(self.finite)

    @cached_property
    def all_finite(self) -> bool | None:
        """Whether every entry is finite, when that is free to know (CPU); ``None`` on accelerators.

        Asking an accelerator would synchronize the host with the device, so reducers there take
        the masked path instead.
        """
        if self.device.type != "cpu":
            return None
        return bool(self.n_finite == self.numel)


@runtime_checkable
class Reducer(Protocol):
    """Computes named statistics of a tensor on its device."""

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metric names, in the order of the returned values."""
        ...

    def reduce(self, tensor: PreparedTensor) -> torch.Tensor:
        """Return a 1-D tensor of ``len(metrics)`` values on ``tensor.device``."""
        ...
