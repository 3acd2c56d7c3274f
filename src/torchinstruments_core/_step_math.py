"""Device-side arithmetic of an optimizer step's signals: nothing here waits for a device.

Whole-model norms and counts, the update-to-weight ratio and Adam's gradient-to-second-moment
ratio are computed on the tensors' devices and stay there until the step record crosses to the
host with everything else. Only CPU tensors are summed and counted on the host, where reading
them waits for nothing: gradients (``_norms_and_counts``), parameters before the step
(``summed_norm``), updates (``_native.difference_squares``) and Adam's ratio (``ratio_sum``).
Those give host floats, from float64 sums rounded to the tensors' working dtype (where torch's
float32 norm sums in float32, a norm below about 1e-19 or above about 1e19 underflows to 0 or
overflows to infinity there, and not here), and what is computed from host floats alone stays
one (``update_to_weight``, ``whole_update``): a torch scalar costs a few microseconds to make
and as many to stack into its row, per tensor.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torchinstruments_core._signals import ALL_PARAMETERS, MODEL_LAYER, Signal
from torchinstruments_core._step_records import StepScalars
from torchinstruments_core.reducers import _native, working_dtype
from torchinstruments_core.reducers._host import summarize

if TYPE_CHECKING:
    from collections.abc import Sequence

    from numpy.typing import NDArray

    from torchinstruments_core.reducers._host import HostSummary

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


_FLOAT32_INFINITE = 3.4028235677973366e38
"""The smallest float64 that rounds to float32's infinity: float32's largest finite value plus
half its last place (that value's last bit is odd, so the tie goes up)."""


def rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (float32; float64 leaves it), as a host float.

    What a 0-d torch tensor of ``dtype`` would hold, without making one: numpy's conversion
    rounds to nearest, and a value past float32's range is infinite (without numpy's overflow
    warning, which a program that turns warnings into errors would raise).
    """
    if dtype != torch.float32 or not math.isfinite(value):
        return value
    if abs(value) >= _FLOAT32_INFINITE:
        return math.copysign(math.inf, value)
    return float(np.float32(value))


def host_norm(squares: float, dtype: torch.dtype) -> float:
    """The l2 norm from a float64 sum of squares, rounded to the working ``dtype``."""
    return rounded(math.sqrt(squares), dtype)


def summed_norm(tensor: torch.Tensor, summary: NDArray[np.float64] | None) -> torch.Tensor | float:
    """The l2 norm of ``tensor``, in its working dtype: a host float, or a tensor on its device.

    A finite float32 or float64 CPU tensor's is the square root of the kernels' float64 sum of
    squares, a host float: from ``summary`` (its own reduction's, ``Measurement.summary``)
    without a pass, or from one pass of theirs (``_host.summarize``), so that both ways give the
    same value. Any other tensor's is torch's (``norm``).
    """
    if summary is not None and tensor.is_cpu and tensor.dtype in _SUMMED:
        squares = float(summary[1])
    else:
        found = _finite_summary(tensor)
        if found is None:
            return norm(tensor)
        squares = found.squares
    return host_norm(squares, working_dtype(tensor.dtype))


def _gathered(values: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``values`` (scalars on any devices) stacked on ``device``, without waiting for a copy."""
    moved = [v.to(device, non_blocking=device.type != "cpu") for v in values]
    return torch.stack(moved)


def whole_gradient(
    gradients: Sequence[torch.Tensor],
    scale: torch.Tensor | None = None,
    summaries: Sequence[NDArray[np.float64] | None] = (),
    unstored: int = 0,
) -> StepScalars:
    """The whole-model ``parameter_gradient`` row: l2 norm, non-finite and zero entries.

    The norm is ``torch.nn.utils.clip_grad_norm_``'s total norm: the l2 norm of the per-tensor
    l2 norms, computed in float32 (float64 when a gradient is float64).

    Args:
        gradients: Plain dense gradient tensors, at least one.
        scale: A loss scale the gradients still carry (the norm is divided by it; the counts
            do not change).
        summaries: For each gradient, or none: the kernels' summary of it where its own
            reduction has one (``Measurement.summary``, a finite CPU gradient), whose squares
            and zeros are then taken instead of another pass; ``None`` for the others.
        unstored: Entries of sparse gradients that they do not store (zeros), whose stored
            values are among ``gradients``.
    """
    dtype = _common_dtype(gradients)
    device = gradients[0].device
    norms, nonfinite, zeros = _norms_and_counts(gradients, dtype, device, summaries)
    zeros = zeros + unstored
    entries = sum(g.numel() for g in gradients) + unstored
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


def _norms_and_counts(
    gradients: Sequence[torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    summaries: Sequence[NDArray[np.float64] | None] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each gradient's l2 norm (in ``dtype``), and their non-finite and zero entries, on ``device``.

    A float32 or float64 CPU gradient that the compiled kernels read is summed and counted in
    their one pass (``_host.summarize``: about 40 us for 200 k float32 entries, where torch's
    ``isfinite`` and ``== 0`` and their sums took 500 us, more than an MNIST-sized MLP's
    whole training step); its norm is the square root of that pass's sum of squares, in
    float64, and it finishes only where every entry is finite. Any other gradient, and one
    with a non-finite entry, is measured by torch on its device, read nowhere. A float32 or
    float64 CPU gradient with a summary in ``summaries`` (the same pass, made by its own
    reduction) takes that summary's squares and zeros instead of a pass of its own.
    """
    norms: list[torch.Tensor] = []
    host_norms: list[float] = []
    nonfinite: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []
    host_zeros = 0
    for index, gradient in enumerate(gradients):
        known = summaries[index] if summaries else None
        if known is not None and gradient.is_cpu and gradient.dtype in _SUMMED:
            host_norms.append(math.sqrt(float(known[1])))
            host_zeros += int(known[4])
            continue
        summary = _finite_summary(gradient)
        if summary is not None:
            host_norms.append(math.sqrt(summary.squares))
            host_zeros += summary.zeros
            continue
        norms.append(norm(gradient, dtype))
        nonfinite.append((~torch.isfinite(gradient)).sum())
        zeros.append((gradient == 0).sum())
    parts = [_gathered(norms, device)] if norms else []
    if host_norms:  # the host's float64 norms, rounded to ``dtype`` as torch's would be
        host = torch.tensor(host_norms, dtype=torch.float64)
        parts.append(host.to(device, dtype, non_blocking=device.type != "cpu"))
    return torch.cat(parts), _total(nonfinite, 0, device), _total(zeros, host_zeros, device)


_SUMMED = (torch.float32, torch.float64)


def _finite_summary(gradient: torch.Tensor) -> HostSummary | None:
    """``_host.summarize`` of a CPU gradient the kernels read, if every entry is finite."""
    if not gradient.is_cpu or gradient.dtype not in _SUMMED:
        return None
    flat = gradient.reshape(-1)  # a view where it is contiguous: the kernels read it in place
    return summarize(flat) if _native.usable(flat) else None


def _total(counts: list[torch.Tensor], host: int, device: torch.device) -> torch.Tensor:
    """``host`` plus the sum of the device ``counts``, on ``device``."""
    if not counts:
        return torch.tensor(host, dtype=torch.int64, device=device)
    return _gathered(counts, device).sum() + host


def whole_update(norms: Sequence[torch.Tensor | float], dtype: torch.dtype) -> StepScalars:
    """The whole-model ``update`` row: the l2 norm of the per-parameter update norms.

    ``dtype``: the widest working dtype of the updates, the total's. Host floats alone (the
    kernels formed every update, ``_native.difference_squares``) give a host float, summed in
    float64 and rounded to ``dtype``; otherwise torch's norm of them all, on the first tensor's
    device. A non-finite total comes from non-finite updates: the row reads
    ``non_finite_result``.
    """
    metrics = ("l2_norm",)
    if all(isinstance(value, float) for value in norms):
        # squared and summed in float64 without scaling, as torch's float64 norm
        total = rounded(math.sqrt(sum(value * value for value in norms)), dtype)
        return StepScalars(MODEL_LAYER, Signal.UPDATE, ALL_PARAMETERS, metrics, [total], 1.0)
    device = next(value.device for value in norms if isinstance(value, torch.Tensor))
    tensors = [
        value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=dtype)
        for value in norms
    ]
    total_tensor = torch.linalg.vector_norm(_gathered(tensors, device)).reshape(1)
    counted = torch.ones((), dtype=total_tensor.dtype, device=device)
    return StepScalars(MODEL_LAYER, Signal.UPDATE, ALL_PARAMETERS, metrics, total_tensor, counted)


def adam_ratio(
    gradient: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
) -> torch.Tensor | float | None:
    """rms(g / sqrt(v_hat)) of an Adam-family parameter after its step, as StableAdamW tracks it.

    ``v_hat`` is the bias-corrected second moment the step divided by (``max_exp_avg_sq`` under
    ``amsgrad``), floored at ``eps**2`` as StableAdamW does. A host float (rounded to the
    working dtype) where the kernels sum it (``_summed_on_host``), else a tensor on the
    tensors' device. ``None`` when the optimizer holds no ``exp_avg_sq``, ``step`` and
    ``betas`` for the parameter.
    """
    second = state.get("max_exp_avg_sq") if group.get("amsgrad") else state.get("exp_avg_sq")
    step, betas = state.get("step"), group.get("betas")
    if not isinstance(second, torch.Tensor) or step is None or betas is None:
        return None
    dtype = working_dtype(second.dtype)
    beta2 = betas[1]  # a float, or a tensor (on the device under capturable)
    count: float | torch.Tensor
    if isinstance(step, torch.Tensor) and step.device.type != "cpu":  # capturable: stay there
        count = step.to(second.device, dtype)
    else:  # a host number: a CPU tensor is read without waiting for any device
        count = float(step)
    correction = 1 - beta2**count
    eps = float(group.get("eps", 1e-8))
    if _summed_on_host(gradient, second, correction, eps * eps):
        total = _native.ratio_sum(gradient, second, float(correction), eps * eps)
        return rounded(math.sqrt(total / max(gradient.numel(), 1)), dtype)
    v_hat = (second.to(dtype) / correction).clamp_(min=eps * eps)  # in place: a new tensor
    return gradient.to(dtype).square().div_(v_hat).mean().sqrt()


def _summed_on_host(
    gradient: torch.Tensor, second: torch.Tensor, correction: Any, floor: float
) -> bool:
    """Whether the kernels' ``ratio_sum`` computes Adam's ratio of these two CPU tensors.

    That is both contiguous and ``usable`` by the kernels, of one dtype and shape, with a
    positive bias correction known on the host and a floor that is a number (a NaN ``eps``
    takes torch's expression, which gives NaN). On a 2.9 M-parameter MLP torch's expression
    took 4.4 ms of the training thread a step, about half of it faulting in the pages of its
    three temporaries; the kernels' one pass makes none. A strided pair takes torch's
    expression too: the kernels would read contiguous copies of both.
    """
    return (
        isinstance(correction, float)
        and correction > 0
        and floor >= 0
        and gradient.dtype == second.dtype
        and gradient.shape == second.shape
        and gradient.is_contiguous()
        and second.is_contiguous()
        and _native.usable(gradient)
        and _native.usable(second)
    )


def update_to_weight(
    update_norm: torch.Tensor | float, weight_norm: torch.Tensor | float, dtype: torch.dtype
) -> torch.Tensor | float:
    """rms(update) / rms(parameter before the step): the ratio of the two l2 norms.

    Two host floats give a host float, the quotient rounded to the working ``dtype`` (float32's
    division of the same two values gives the same: float64 holds more than twice its digits),
    a zero norm before the step as torch's division gives it (infinite, or NaN over a zero
    update). Otherwise a tensor, where the tensor norm is.
    """
    if isinstance(update_norm, float) and isinstance(weight_norm, float):
        if weight_norm == 0.0:
            quotient = math.nan if update_norm == 0.0 or math.isnan(update_norm) else math.inf
        else:
            quotient = update_norm / weight_norm
        return rounded(quotient, dtype)
    if not isinstance(update_norm, torch.Tensor):
        assert isinstance(weight_norm, torch.Tensor)
        update_norm = torch.tensor(update_norm, dtype=dtype, device=weight_norm.device)
    elif not isinstance(weight_norm, torch.Tensor):
        weight_norm = torch.tensor(weight_norm, dtype=dtype, device=update_norm.device)
    return update_norm / weight_norm
