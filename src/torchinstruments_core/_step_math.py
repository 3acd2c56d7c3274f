"""Device-side arithmetic of an optimizer step's signals: nothing here reads a value on the host.

Whole-model norms and counts, the update-to-weight ratio and Adam's gradient-to-second-moment
ratio are computed on the tensors' devices and stay there until the step record crosses to the
host with everything else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from torchinstruments_core._signals import ALL_PARAMETERS, MODEL_LAYER, Signal
from torchinstruments_core._step_records import StepScalars
from torchinstruments_core.reducers import working_dtype

if TYPE_CHECKING:
    from collections.abc import Sequence

GRADIENT_METRICS = ("l2_norm", "nonfinite_count", "zero_count")
"""The whole-model ``parameter_gradient`` row's metrics."""

ADAM_RATIO_METRIC = "gradient_rms_ratio"
"""The metric on an Adam-family ``<name>.exp_avg_sq`` row: rms(g / sqrt(v_hat))."""


def _common_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def norm(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The l2 norm of ``tensor``, in ``dtype`` (default: its working dtype), on its device."""
    result: torch.Tensor = torch.linalg.vector_norm(
        tensor, dtype=dtype or working_dtype(tensor.dtype)
    )
    return result


def _gathered(values: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``values`` (scalars on any devices) stacked on ``device``, without waiting for a copy."""
    moved = [v.to(device, non_blocking=device.type != "cpu") for v in values]
    return torch.stack(moved)


def whole_gradient(
    gradients: Sequence[torch.Tensor], scale: torch.Tensor | None = None
) -> StepScalars:
    """The whole-model ``parameter_gradient`` row: l2 norm, non-finite and zero entries.

    The norm is ``torch.nn.utils.clip_grad_norm_``'s total norm: the l2 norm of the per-tensor
    l2 norms, computed in float32 (float64 when a gradient is float64).

    Args:
        gradients: Plain dense gradient tensors, at least one.
        scale: A loss scale the gradients still carry (the norm is divided by it; the counts
            do not change).
    """
    dtype = _common_dtype(gradients)
    device = gradients[0].device
    norms = _gathered([norm(g, dtype) for g in gradients], device)
    nonfinite = _gathered([(~torch.isfinite(g)).sum() for g in gradients], device).sum()
    zeros = _gathered([(g == 0).sum() for g in gradients], device).sum()
    entries = sum(g.numel() for g in gradients)
    total = torch.linalg.vector_norm(norms)
    if scale is not None:
        total = total / scale.detach().reshape(()).to(device, dtype, non_blocking=True)
    values = torch.stack([total, nonfinite.to(dtype), zeros.to(dtype)])
    return StepScalars(
        MODEL_LAYER,
        Signal.PARAMETER_GRADIENT,
        ALL_PARAMETERS,
        GRADIENT_METRICS,
        values,
        (entries - nonfinite).to(dtype),
    )


def whole_update(norms: Sequence[torch.Tensor]) -> StepScalars:
    """The whole-model ``update`` row: the l2 norm of the per-parameter update norms."""
    device = norms[0].device
    total = torch.linalg.vector_norm(_gathered(norms, device)).reshape(1)
    # a non-finite total comes from non-finite updates: the row reads non_finite_result
    counted = torch.ones((), dtype=total.dtype, device=device)
    return StepScalars(MODEL_LAYER, Signal.UPDATE, ALL_PARAMETERS, ("l2_norm",), total, counted)


def adam_ratio(
    gradient: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
) -> torch.Tensor | None:
    """rms(g / sqrt(v_hat)) of an Adam-family parameter after its step, as StableAdamW tracks it.

    ``v_hat`` is the bias-corrected second moment the step divided by (``max_exp_avg_sq`` under
    ``amsgrad``), floored at ``eps**2`` as StableAdamW does. ``None`` when the optimizer holds no
    ``exp_avg_sq``, ``step`` and ``betas`` for the parameter.
    """
    second = state.get("max_exp_avg_sq") if group.get("amsgrad") else state.get("exp_avg_sq")
    step, betas = state.get("step"), group.get("betas")
    if not isinstance(second, torch.Tensor) or step is None or betas is None:
        return None
    dtype = working_dtype(second.dtype)
    beta2 = float(betas[1])
    correction: float | torch.Tensor
    if isinstance(step, torch.Tensor) and step.device.type != "cpu":  # capturable: stay there
        correction = 1 - torch.pow(beta2, step.to(second.device, dtype))
    else:  # a host number: a CPU tensor is read without waiting for any device
        correction = 1 - beta2 ** float(step)
    eps = float(group.get("eps", 1e-8))
    v_hat = second.to(dtype) / correction
    ratio = gradient.to(dtype).square() / torch.clamp(v_hat, min=eps * eps)
    return ratio.mean().sqrt()


def update_to_weight(update_norm: torch.Tensor, weight_norm: torch.Tensor) -> torch.Tensor:
    """rms(update) / rms(parameter before the step): the ratio of the two l2 norms."""
    return update_norm / weight_norm
