"""The gradient-scale reader: what the recorded gradients are divided by.

Under fp16 mixed precision the loss, and so every gradient, is multiplied by a loss scale; an
adapter hands the scaler's scale (or a function that reads it) to ``Observer.set_gradient_scale``
and each sample divides its gradients by the scale read when it opened.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torchinstruments_core._exceptions import ConfigurationError
from torchinstruments_core._failures import SCALE_CONSEQUENCE

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from torchinstruments_core._failures import FailureReport

    GradientScale = float | torch.Tensor | Callable[[], float | torch.Tensor | None] | None


def check_scale(scale: object) -> None:
    """Raise unless ``scale`` is None, a finite number > 0 or a one-element tensor."""
    import torch

    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ConfigurationError.invalid("scale", scale, "a tensor of one element")
        return  # its value stays on the device; reading it would wait for the device
    if scale is not None and (
        isinstance(scale, bool)
        or not isinstance(scale, int | float)
        or not (math.isfinite(scale) and scale > 0)
    ):
        raise ConfigurationError.invalid(
            "scale", scale, "a finite number > 0, a one-element tensor, a function, or None"
        )


class GradientScaleReader:
    """Owns the gradient scale an adapter set, and reads it when a sample opens.

    Args:
        failures: Where a scale function that fails, or returns an invalid scale, is reported.
    """

    __slots__ = ("_failures", "_scale")

    def __init__(self, failures: FailureReport) -> None:
        self._failures = failures
        self._scale: GradientScale = None

    def set(self, scale: GradientScale) -> None:
        """Use ``scale`` from now on (see ``Observer.set_gradient_scale``).

        Raises:
            ConfigurationError: If ``scale`` is neither a function, ``None``, a finite number
                > 0 nor a one-element tensor.
        """
        if not callable(scale):
            check_scale(scale)
        self._scale = scale

    def read(self) -> float | torch.Tensor | None:
        """The scale now: a function is called; one that fails counts as ``None``."""
        scale = self._scale
        if not callable(scale):
            return scale
        try:
            value = scale()
            check_scale(value)
        except Exception as error:  # an adapter's scale reader must never break the forward
            what = "the gradient scale could not be read"
            self._failures.failed(what, error, "gradient-scale", SCALE_CONSEQUENCE)
            return None
        return value
