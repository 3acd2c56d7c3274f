"""What a recorded optimizer step measures, before and after the optimizer's update.

Before the update (the optimizer's step pre-hook, or right after its closure ran): each observed
parameter (``parameter``), the gradient the optimizer is about to use (``parameter_gradient``),
the whole model's gradient norm and counts, and a copy of each observed parameter for its update.
After the update (the step post-hook): each parameter's change (``update``, with
``update_to_weight``), the whole update's norm, and the optimizer's state (``optimizer_state``).

The copies are the only memory this holds across the update: one copy of the observed parameters
that have a gradient, in their own dtype, each let go as soon as its update is measured (the
reduction reading it holds it until it has run); on the CPU their memory is kept for the next
recorded step (``CopyBuffers``), where it is written again only once nobody holds it. A
parameter with such a copy is measured from it; the update is formed in it, and it, the
optimizer's state and the update are reduced where they are (``StepTensor.in_place``):
nothing changes them before the record is delivered. The gradients are read where they are
too, measured first (``gradient_tensors``). An optimizer that may change them in its step has
their reductions waited for in the pre-hook, which makes the copies meanwhile; one whose step
only reads them (``leaves_gradients``) has them reduced during its step, and the post-hook
waits and checks that none changed (``changed_gradients``). The whole-model gradient row comes
after that wait, from their reductions' sums where the kernels made them (``model_gradient``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchinstruments_core._measurement import process_groups_up, shareable
from torchinstruments_core._plain import plain_tensor
from torchinstruments_core._records import UnavailableReason
from torchinstruments_core._signals import ALL_PARAMETERS, MODEL_LAYER, Signal
from torchinstruments_core._step_math import (
    ADAM_RATIO_METRIC,
    GRADIENT_METRICS,
    adam_ratio,
    host_norm,
    norm,
    summed_norm,
    update_to_weight,
    whole_gradient,
    whole_update,
)
from torchinstruments_core._step_records import StepScalars, StepTensor, UnavailableRow
from torchinstruments_core._torch_private import version
from torchinstruments_core.reducers import _native, working_dtype

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence

    import numpy as np
    from numpy.typing import NDArray
    from torch import nn

    from torchinstruments_core._copy_buffers import CopyBuffers
    from torchinstruments_core._layers import Layer
    from torchinstruments_core._measurement import Measurement

UPDATE_TO_WEIGHT = "update_to_weight"
"""The metric on each ``update`` row: rms(update) / rms(parameter before the step)."""


@dataclass(frozen=True, slots=True)
class Owner:
    """The observed module that registers a parameter: its clean name and the parameter's."""

    layer: str
    name: str
    histogram: bool


@dataclass(slots=True)
class PreStepCopy:
    """An observed parameter's values before the update."""

    parameter: torch.Tensor
    owner: Owner
    values: torch.Tensor


class ParameterMap:
    """Which parameters have rows, under which names, and which belong to the model.

    A parameter belongs to the observed module that registers it (``named_parameters`` without
    recursion); a parameter shared by several observed modules belongs to the first in model
    order. The parameters of modules that are not observed have no rows of their own but count
    in the whole-model gradient rows.

    Args:
        model: The observed root module.
        layers: The observed modules, in model order.
    """

    __slots__ = ("_model_ids", "_owners")

    def __init__(self, model: nn.Module, layers: Sequence[Layer]) -> None:
        self._owners: dict[int, Owner] = {}
        for layer in layers:
            for name, parameter in layer.module.named_parameters(recurse=False):
                self._owners.setdefault(id(parameter), Owner(layer.name, name, layer.histogram))
        self._model_ids = {id(p) for p in model.parameters()}

    def owner(self, parameter: torch.Tensor) -> Owner | None:
        """The module and name ``parameter``'s rows go under, if it has rows."""
        return self._owners.get(id(parameter))

    def in_model(self, parameter: torch.Tensor) -> bool:
        """Whether ``parameter`` is one of the model's (the whole-model rows count it)."""
        return id(parameter) in self._model_ids


def stepped(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters ``optimizer`` steps, group by group, each once.

    A parameter listed twice in a group (which torch only warns about) is one parameter: one
    set of rows and one copy for its update, which two entries would have formed twice in the
    same buffer while a reduction read it. Called several times a recorded step: a list, and
    the usual case (no parameter listed twice) checked with one set of ids.
    """
    listed = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    if len(set(map(id, listed))) == len(listed):
        return listed
    return [parameter for _, parameter in _stepped_with_groups(optimizer)]


def _stepped_with_groups(
    optimizer: torch.optim.Optimizer,
) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """Each parameter ``optimizer`` steps, once, with the first group that lists it."""
    listed = [
        (group, parameter) for group in optimizer.param_groups for parameter in group["params"]
    ]
    if len({id(parameter) for _, parameter in listed}) == len(listed):
        return listed
    seen: set[int] = set()
    once = []
    for group, parameter in listed:
        if id(parameter) not in seen:
            seen.add(id(parameter))
            once.append((group, parameter))
    return once


def loss_scale(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The loss scale a fused optimizer's gradients still carry, if any.

    A fused optimizer stepped by a GradScaler unscales the gradients inside its own step; the
    scaler leaves the scale on it (``optimizer.grad_scale``), and the gradients are measured
    divided by it.
    """
    scale = getattr(optimizer, "grad_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


_READING_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
)
"""torch's optimizers whose step reads ``.grad`` without writing into it, unless fused or
differentiable (SGD: without Nesterov momentum). Their ``maximize`` and weight decay work on
new tensors (``_foreach_neg``, ``_foreach_add``); SGD's ``foreach`` Nesterov step adds its
momentum into ``.grad``, a fused step may unscale into it, a differentiable one (or one whose
weight decay is a tensor with a gradient) adds its weight decay into it."""


def leaves_gradients(optimizer: torch.optim.Optimizer, gradients: Sequence[StepTensor]) -> bool:
    """Whether ``gradients`` may be reduced while ``optimizer`` steps, instead of before.

    That is: the optimizer is one of torch's that only read their gradients (exactly that
    class, not a subclass, which may change them), in no group fused or differentiable or with
    a hyperparameter that requires a gradient, SGD without Nesterov momentum; no loss scale is
    divided out (``loss_scale``); and a torch in-place operation on any of the gradients would
    move its version (``shareable``: plain tensors, no process group up), so that
    ``changed_gradients`` can tell one the step made after all (a future torch). The caller
    also makes sure no other step hook runs between its own two (``OptimizerProbe``): a hook's
    write through ``.data`` would move no version. The reductions then run on the kernels'
    queue while the optimizer updates the parameters; on a 2.9 M-parameter MLP the pre-hook
    waited about 1.3 ms for them on two cores.
    """
    if type(optimizer) not in _READING_OPTIMIZERS or not gradients:
        return False
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("differentiable"):
            return False
        if type(optimizer) is torch.optim.SGD and group.get("nesterov"):
            return False
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in group.values()):
            return False  # a hyperparameter with a gradient: SGD adds its decay into ``.grad``
    if loss_scale(optimizer) is not None:
        return False
    groups = process_groups_up()
    return all(shareable(item.tensor, groups=groups) for item in gradients)


def gradient_versions(gradients: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """Each gradient with its version now, for ``changed_gradients`` after the step."""
    return [(gradient, version(gradient)) for gradient in gradients]


def changed_gradients(versions: Sequence[tuple[torch.Tensor, int]]) -> set[int]:
    """The ids of the gradients whose version moved since ``gradient_versions``."""
    return {id(tensor) for tensor, seen in versions if version(tensor) != seen}


def gradient_tensors(
    optimizer: torch.optim.Optimizer,
    parameters: ParameterMap,
    signals: frozenset[Signal],
    scale: torch.Tensor | None,
) -> list[StepTensor]:
    """Each observed parameter's gradient (``parameter_gradient``), read where it is.

    Nothing is copied: the caller waits for their reductions before the optimizer runs
    (``OptimizerProbe``), so that an optimizer that changes its gradients in place (torch's SGD
    adds its Nesterov momentum into them under ``foreach``) does so only once they are
    measured; where the optimizer only reads them (``leaves_gradients``), before the step's
    post-hook returns instead.
    """
    if Signal.PARAMETER_GRADIENT not in signals:
        return []
    tensors: list[StepTensor] = []
    for parameter in stepped(optimizer):
        owner = parameters.owner(parameter)
        if owner is None or parameter.grad is None:
            continue
        tensors.append(
            StepTensor(
                owner.layer,
                Signal.PARAMETER_GRADIENT,
                owner.name,
                parameter.grad,
                owner.histogram,
                (),
                scale,
                in_place=True,
            )
        )
    return tensors


QUEUED_COPY_BYTES = 1 << 18
"""The least bytes of a parameter whose copy ``queue_copies`` hands to the kernels' queue: a
smaller one is copied by the caller, in less time than the hand-over takes."""


def queue_copies(
    optimizer: torch.optim.Optimizer,
    parameters: ParameterMap,
    signals: frozenset[Signal],
    buffers: CopyBuffers,
    copy_on_queue: Callable[[torch.Tensor, torch.Tensor], int | None],
) -> tuple[dict[int, torch.Tensor], int | None]:
    """Hand the large parameters' copies to the kernels' queue, before anything else is queued.

    Each observed parameter with a gradient whose update is recorded, a contiguous CPU tensor
    of ``QUEUED_COPY_BYTES`` or more with a buffer of ``buffers``' to copy into
    (``CopyBuffers.lend``), is copied there by ``copy_on_queue`` (``Measurer.copy``), while
    the caller copies the others (``before_step``); waiting for the ticket then has the
    waiting thread copy too (``_native.queue_wait``). On the 2.9 M-parameter MLP of
    ``benchmarks/`` the training thread's copies took 2.2-2.8 ms, these 1.4-1.6 ms.

    Returns:
        The buffers being filled, by the id of their parameter (for ``before_step``), and the
        ticket to wait for before the optimizer runs (``None``: nothing queued).
    """
    queued: dict[int, torch.Tensor] = {}
    ticket: int | None = None
    if Signal.UPDATE not in signals:
        return queued, ticket
    for parameter in stepped(optimizer):
        if parameter.grad is None or parameters.owner(parameter) is None:
            continue
        values = plain_tensor(parameter)
        if (
            not isinstance(values, torch.Tensor)
            or values.device.type != "cpu"
            or values.numel() * values.element_size() < QUEUED_COPY_BYTES
            or not values.is_contiguous()
        ):
            continue
        buffer = buffers.lend(values)
        if buffer is None:
            continue
        taken = copy_on_queue(values, buffer)
        if taken is None:  # no queue: the caller copies every one
            break
        queued[id(parameter)], ticket = buffer, taken
    return queued, ticket


def before_step(
    optimizer: torch.optim.Optimizer,
    parameters: ParameterMap,
    signals: frozenset[Signal],
    scale: torch.Tensor | None,
    buffers: CopyBuffers,
    queued: Mapping[int, torch.Tensor] | None = None,
) -> tuple[list[StepTensor], list[PreStepCopy]]:
    """The parameters, and the copies the updates need.

    Each observed parameter's gradient is measured apart, first (``gradient_tensors``), and the
    whole-model gradient row once those reductions have run (``model_gradient``). The copies
    go into ``buffers``' memory where it has some free (``CopyBuffers``); those in ``queued``
    (by the parameter's id: ``queue_copies``) are the kernels' queue's to make, and the
    caller waits for them before any of these tensors is measured.
    """
    tensors: list[StepTensor] = []
    copies: list[PreStepCopy] = []
    for parameter in stepped(optimizer):
        owner = parameters.owner(parameter)
        if owner is None:
            continue
        copy = None
        if parameter.grad is not None and Signal.UPDATE in signals:
            made = None if queued is None else queued.get(id(parameter))
            if made is not None:
                copy = PreStepCopy(parameter, owner, made)
            else:
                copy = _copy(parameter, owner, buffers)
            if copy is not None:
                copies.append(copy)
        if Signal.PARAMETER in signals:
            tensors.append(_parameter_tensor(parameter, owner, copy))
    return tensors, copies


def model_gradients(
    optimizer: torch.optim.Optimizer, parameters: ParameterMap
) -> list[torch.Tensor]:
    """The ``.grad`` of each of the model's parameters that ``optimizer`` steps, as they are."""
    return [
        parameter.grad
        for parameter in stepped(optimizer)
        if parameter.grad is not None and parameters.in_model(parameter)
    ]


def model_gradient(
    gradients: Sequence[torch.Tensor],
    signals: frozenset[Signal],
    scale: torch.Tensor | None,
    measured: Mapping[int, Measurement],
    changed: Collection[int] = (),
) -> StepScalars | UnavailableRow | None:
    """The whole-model gradient row, over ``gradients`` (``model_gradients``).

    Made once the observed gradients' reductions have run: one that the kernels' queue reduced
    (``measured``, by the id of the ``.grad`` tensor, without a loss scale) gives its sum of
    squares and zeros from that reduction (``Measurement.summary``) rather than another pass
    over it. ``None`` without ``parameter_gradient`` or without a gradient. Where one of the
    gradients is in ``changed`` (ids: the step changed it while it was reduced,
    ``changed_gradients``), the row has no values, with the reason ``modified_in_place``. A
    sparse (COO) gradient counts its stored values, coalesced as ``clip_grad_norm_`` sums
    them, and the entries it does not store as zeros; a gradient that cannot be read
    otherwise (another sparse layout, an unsupported dtype) leaves the row without values,
    with its reason.
    """
    signal = Signal.PARAMETER_GRADIENT
    if signal not in signals:
        return None
    if any(id(gradient) in changed for gradient in gradients):
        reason = UnavailableReason.MODIFIED_IN_PLACE
        return UnavailableRow(MODEL_LAYER, signal, ALL_PARAMETERS, GRADIENT_METRICS, reason)
    plains: list[torch.Tensor] = []
    summaries: list[NDArray[np.float64] | None] = []
    unstored = 0
    for gradient in gradients:
        plain = plain_tensor(gradient)
        if plain is UnavailableReason.SPARSE_TENSOR and gradient.layout == torch.sparse_coo:
            values = gradient.detach().coalesce().values()
            plains.append(values)
            summaries.append(None)
            unstored += gradient.numel() - values.numel()
        elif isinstance(plain, torch.Tensor):
            plains.append(plain)
            measurement = measured.get(id(gradient)) if scale is None else None
            summaries.append(None if measurement is None else measurement.summary)
        elif plain is not UnavailableReason.EMPTY_TENSOR:  # an empty one adds nothing
            return UnavailableRow(MODEL_LAYER, signal, ALL_PARAMETERS, GRADIENT_METRICS, plain)
    return whole_gradient(plains, scale, summaries, unstored) if plains else None


def _parameter_tensor(
    parameter: torch.Tensor, owner: Owner, copy: PreStepCopy | None
) -> StepTensor:
    if copy is not None and type(parameter.detach()) is torch.Tensor:
        # the copy the update needs holds the same values, and nothing changes it before the
        # post-hook waits for its reduction (``updates``): read there, not copied again
        return _tensor(owner, Signal.PARAMETER, owner.name, copy.values, in_place=True)
    # the optimizer changes the parameter itself once the hook returns: copied
    return _tensor(owner, Signal.PARAMETER, owner.name, parameter.detach())


def _tensor(
    owner: Owner,
    signal: Signal,
    path: str,
    tensor: torch.Tensor,
    *extra: tuple[str, torch.Tensor | float],
    in_place: bool = False,
) -> StepTensor:
    # A histogram only where a destination shows it: the loggers and the run directory's
    # TensorBoard receive the routed signals' histograms; the Parquet tables hold none.
    histogram = owner.histogram and signal.spec.routed
    return StepTensor(owner.layer, signal, path, tensor, histogram, tuple(extra), in_place=in_place)


def _copy(parameter: torch.Tensor, owner: Owner, buffers: CopyBuffers) -> PreStepCopy | None:
    values = plain_tensor(parameter)  # a DTensor's local shard: the update is the shard's
    if not isinstance(values, torch.Tensor):
        return None
    return PreStepCopy(parameter, owner, buffers.copy(values))


def updates(
    copies: list[PreStepCopy], measured: Mapping[int, Measurement]
) -> Iterator[StepTensor | StepScalars]:
    """Each copied parameter's update, then the whole update's norm; frees each copy.

    The update is computed into the copy's own memory (after minus before), with its norm in
    the same pass where the kernels read both (``_difference``), measured where it is
    (``StepTensor.in_place``), and the copy is let go before the next one: nothing beyond
    the copies is held, each by its reduction until its values are read back (on the kernels'
    queue, when the record is delivered). The caller waits for the reductions of the
    parameters measured from these copies first (``measured``, by the id of the tensor
    measured): their norms before the step come from them (``_weight_norm``).
    """
    norms: list[torch.Tensor | float] = []
    widest = torch.float32
    while copies:
        copy = copies.pop(0)
        after = plain_tensor(copy.parameter)
        if not isinstance(after, torch.Tensor):
            continue
        weight_norm = _weight_norm(copy, measured)
        update, size = _difference(after, copy.values)
        norms.append(size)
        dtype = working_dtype(update.dtype)
        widest = torch.float64 if dtype == torch.float64 else widest
        ratio = update_to_weight(size, weight_norm, dtype)
        yield _tensor(
            copy.owner,
            Signal.UPDATE,
            copy.owner.name,
            update,
            (UPDATE_TO_WEIGHT, ratio),
            in_place=True,
        )
        del copy, update
    if norms:
        yield whole_update(norms, widest)


def _difference(
    after: torch.Tensor, before: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | float]:
    """``after - before`` formed in ``before``'s memory, and its l2 norm.

    One pass of the kernels where they read both (``_native.differs_here``), the norm a host
    float from their float64 sum of squares (``difference_squares``); elsewhere torch's ``sub``
    (an output that is exactly one of its inputs is allowed) and ``norm``. The same update,
    bit for bit, either way.
    """
    if _native.differs_here(after, before):
        squares = _native.difference_squares(after, before)
        return before, host_norm(squares, before.dtype)
    update = torch.sub(after, before, out=before)
    return update, norm(update)


def _weight_norm(copy: PreStepCopy, measured: Mapping[int, Measurement]) -> torch.Tensor | float:
    """The norm of ``copy``'s values, the parameter before the step (``summed_norm``).

    Where the parameter was reduced from this copy on the kernels' queue, their sum of squares
    comes from that reduction (``Measurement.summary``, complete once the caller has waited),
    which saves a pass; the copy still holds those values for any other way.
    """
    measurement = measured.get(id(copy.values))
    return summed_norm(copy.values, None if measurement is None else measurement.summary)


_SCALAR_STATE = frozenset(("step", "mu_product", "eta", "mu"))
"""The scalar counters torch's optimizers keep per parameter (Adam's ``step``, NAdam's
``mu_product``, ASGD's ``eta`` and ``mu``): 0-d tensors, as a 0-d parameter's moments are."""


def optimizer_state(
    optimizer: torch.optim.Optimizer, parameters: ParameterMap
) -> Iterator[StepTensor]:
    """The state tensors ``optimizer`` holds for each observed parameter, by their names.

    Only tensors of the parameter's shape (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``);
    scalars such as ``step`` are left out, also beside a 0-d parameter, whose shape they
    share: torch's own scalar counters by name (``_SCALAR_STATE``). An Adam-family
    ``exp_avg_sq`` row also carries ``gradient_rms_ratio`` (see ``adam_ratio``).
    """
    for group, parameter in _stepped_with_groups(optimizer):
        owner = parameters.owner(parameter)
        state = optimizer.state.get(parameter) if owner is not None else None
        if owner is None or not state:
            continue
        yield from _state_tensors(parameter, owner, state, group)


def _state_tensors(
    parameter: torch.Tensor, owner: Owner, state: dict[str, Any], group: dict[str, Any]
) -> Iterator[StepTensor]:
    scalar = parameter.dim() == 0
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or value.shape != parameter.shape:
            continue
        if scalar and key in _SCALAR_STATE:
            continue
        path = f"{owner.name}.{key}"
        ratio = None
        if key == "exp_avg_sq" and parameter.grad is not None:
            gradient = plain_tensor(parameter.grad)
            if isinstance(gradient, torch.Tensor):
                local_state = {
                    k: plain_tensor(v) if k.endswith("sq") else v for k, v in state.items()
                }
                ratio = adam_ratio(gradient, local_state, group)
        extra = () if ratio is None else ((ADAM_RATIO_METRIC, ratio),)
        # measured after the update, and the record is delivered before the post-hook returns
        yield _tensor(owner, Signal.OPTIMIZER_STATE, path, value, *extra, in_place=True)
