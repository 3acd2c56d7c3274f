"""Turn whatever tensor a module returned into the plain dense tensor its statistics describe.

The reducers work on plain ``torch.Tensor``s. Module outputs and gradients can be other things:

- a nested tensor (strided or jagged layout): its entries are the entries of its components;
- a ``DTensor``: with every placement ``Replicate`` its local tensor is the whole tensor; with a
  ``Shard`` placement the local tensor is this rank's shard, and that is what a forward sample
  measures (a rank never communicates from inside a hook: under ``rank_policy="rank0"`` the
  other ranks would never join the collective); a step record's sharded tensors are combined
  across ranks instead (``_sharded``); with a ``Partial`` placement the local tensor is an
  unreduced summand, so there is no value (``partial_dtensor``);
- another wrapper subclass (``__torch_dispatch__``, e.g. ``TwoTensor`` or a quantized tensor):
  what its entries are is the subclass's own business, so there is no value
  (``tensor_subclass``);
- a subclass that only overrides ``__torch_function__`` (or ``nn.Parameter``): it owns its
  storage, so it is read as a plain tensor, without calling any of its overrides.

Only metadata is read before that decision: nothing here runs an operator of the subclass.
"""

from __future__ import annotations

import sys

import torch

from torchinstruments_core._records import UnavailableReason

_READABLE_FLOATS = frozenset(
    dtype
    for name in (
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
)
"""Floating dtypes whose entries convert to float32 one by one (packed float4 pairs do not)."""


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor | UnavailableReason:
    """The plain, dense, non-empty floating tensor to reduce, or why there is none.

    It never requires grad: ``tensor`` itself when it requires none (a gradient), else detached.
    Nothing here or in its callers writes into it.

    Args:
        tensor: A module output or gradient, possibly nested, a ``DTensor`` or another subclass.

    Returns:
        A plain ``torch.Tensor`` (shape kept, except that a nested tensor's entries come flat),
        or the ``UnavailableReason`` that its rows carry.
    """
    if tensor.is_nested:
        return _classified(_nested_entries(tensor))
    if type(tensor) is not torch.Tensor:
        unwrapped = _unwrap(tensor)
        if isinstance(unwrapped, UnavailableReason):
            return unwrapped
        tensor = unwrapped
    return _classified(tensor)


def _classified(tensor: torch.Tensor | UnavailableReason) -> torch.Tensor | UnavailableReason:
    if isinstance(tensor, UnavailableReason):
        return tensor
    if tensor.is_meta:
        return UnavailableReason.META_TENSOR
    if tensor.layout != torch.strided:
        return UnavailableReason.SPARSE_TENSOR
    if tensor.dtype not in _READABLE_FLOATS:
        return UnavailableReason.UNSUPPORTED_DTYPE
    if tensor.numel() == 0:
        return UnavailableReason.EMPTY_TENSOR
    # detach is a torch call, which hands the GIL over: none for a gradient, which has no graph
    if tensor.requires_grad:
        return tensor.detach()
    if tensor._is_zerotensor():
        # autograd's efficient zero (a gradient known to be 0) has no memory to read; outputs
        # that require grad never are one, so only tensors without a graph are asked
        return torch.zeros(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return tensor


def _nested_entries(tensor: torch.Tensor) -> torch.Tensor | UnavailableReason:
    """The entries of every component, flat: the statistics of a nested tensor are theirs."""
    if tensor.dtype not in _READABLE_FLOATS:
        return UnavailableReason.UNSUPPORTED_DTYPE
    tensor = tensor.detach()
    if tensor.layout == torch.jagged and tensor.is_contiguous():
        # the packed buffer holds exactly the components, back to back: no copy, no host read
        return tensor.values().reshape(-1)
    # with holes (a jagged narrow) or the strided layout: the components one by one
    components = [component.reshape(-1) for component in tensor.unbind()]
    if not components:
        return UnavailableReason.EMPTY_TENSOR
    return torch.cat(components)


def _unwrap(tensor: torch.Tensor) -> torch.Tensor | UnavailableReason:
    """A plain tensor with the subclass's values, or why its values cannot be read here."""
    if type(tensor).__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        # no __torch_dispatch__: the subclass's entries are its own storage. as_subclass is
        # never routed through __torch_function__, so no override of the subclass runs.
        return tensor.as_subclass(torch.Tensor)
    if _is_dtensor(tensor):
        return _dtensor_local(tensor)
    return UnavailableReason.TENSOR_SUBCLASS


def _is_dtensor(tensor: torch.Tensor) -> bool:
    # torch.distributed.tensor is imported only where DTensors exist: no import cost otherwise
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def dtensor_placements(tensor: torch.Tensor) -> tuple[object, ...] | None:
    """The placements of a ``DTensor``, ``None`` for any other tensor (metadata only)."""
    if type(tensor) is torch.Tensor or not _is_dtensor(tensor):
        return None
    return tuple(tensor.placements)  # type: ignore[attr-defined]


def _dtensor_local(tensor: torch.Tensor) -> torch.Tensor | UnavailableReason:
    """The local tensor of a DTensor, unless it is a pending sum (``Partial``)."""
    placements = tensor.placements  # type: ignore[attr-defined]
    if any(placement.is_partial() for placement in placements):
        return UnavailableReason.PARTIAL_DTENSOR
    with torch.no_grad():  # to_local is differentiable; a hook must add nothing to the graph
        local: torch.Tensor = tensor.to_local()  # type: ignore[attr-defined]
    return local
