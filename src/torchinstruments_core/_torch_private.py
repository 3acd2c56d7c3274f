"""The private torch entry points the suite relies on, kept in one place.

Each is pinned by ``tests/test_torch_private.py`` so that a torch release that changes them
fails loudly instead of silently mis-correlating gradients or mis-measuring memory.

- ``queue_callback``: run a function when the current backward pass has finished. It is how a sample
  knows that every gradient of that backward has arrived; DDP and FSDP use the same call.
- ``in_backward``: whether the calling code runs inside an autograd graph task. A root forward
  that starts during a backward is the recomputation of activation checkpointing, not a new sample.
- ``version``: how many in-place torch ops a tensor, its views and its detached aliases have
  seen. The reduction worker reads a gradient (or an output) without copying it and
  afterwards checks that this count has not moved.
- ``view_base``: the tensor a view was taken of. An output is read without a copy only if
  autograd made it, or made what it is a view of: not a view of a numpy array, an input
  buffer or a module's buffer, which can change without moving the version.
- ``memory_events``: every allocation and free a profiler saw, in time order. The public
  ``FunctionEvent`` list folds allocations into the ops that made them and drops the time of
  each free, so peak tensor memory on the CPU, which has no allocator statistics, needs the raw
  Kineto events (``testing.tensor_memory``).
- ``storage_holders``: how many tensors hold a tensor's memory. The parameters' copies of a
  recorded step go into buffers kept for the next one (``_copy_buffers``), written again only
  once nothing but the pool holds them; torch's own CUDA graph trees read the same count.
  Missing from builds before 2.8 without CUDA (registered with the CUDA module until
  pytorch#155451): then ``None``, and every copy is fresh memory.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.profiler import profile


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass that is executing now completes.

    Must be called from inside a backward (a tensor hook).
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def current_graph_task_id() -> int:
    """Id of the autograd graph task executing on this thread, or -1 outside a backward."""
    return int(torch._C._current_graph_task_id())


def compiling() -> bool:
    """Whether dynamo is tracing the code that calls this (``torch.compile``).

    ``torch.compiler.is_compiling`` (torch 2.3 on), else ``torch._dynamo.is_compiling``; a
    constant while traced, so that code it guards is never traced.
    """
    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if check is None:  # torch before 2.3
        check = importlib.import_module("torch._dynamo").is_compiling
    return bool(check())


def in_backward() -> bool:
    """Whether this thread is executing a backward pass right now."""
    return current_graph_task_id() != -1


def version(tensor: torch.Tensor) -> int:
    """The version counter of ``tensor``: in-place torch ops on it and its aliases add one each.

    That is on it, a view of it or a detached alias, under ``inference_mode`` too for a tensor
    made outside it.

    Writes that bypass those ops do not count: through ``tensor.data`` (an alias with a counter
    of its own), ``untyped_storage()``, a numpy view, a collective (``all_reduce`` writes into
    its tensor), a ``DTensor``'s ops as seen from its local tensor, and an op's writes into an
    argument other than its output (``F.batch_norm`` updating ``running_mean``). An inference
    tensor has no counter: this raises ``RuntimeError`` for one.
    """
    return int(tensor._version)


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor that ``tensor`` is a view of (through every view in between); ``None``."""
    base: torch.Tensor | None = tensor._base
    return base


def memory_events(profiler: profile) -> list[tuple[int, int]]:
    """``(time_ns, bytes)`` of each CPU allocation (positive) and free (negative), in time order.

    ``profiler`` must have run with ``profile_memory=True`` and have stopped. Allocations on
    other devices (CUDA's caching allocator) are left out, as torch's own profiler tables do.
    """
    # the stubs of _KinetoEvent lack nbytes(); torch.autograd.profiler reads it the same way
    events: list[Any] = profiler.profiler.kineto_results.events()  # type: ignore[union-attr]
    cpu = torch._C._autograd.DeviceType.CPU
    memory = [
        (event.start_ns(), event.nbytes())
        for event in events
        if event.name() == "[memory]" and event.device_type() == cpu
    ]
    return sorted(memory, key=lambda item: item[0])  # stable: ties keep the recorded order


_storage_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def storage_holders(tensor: torch.Tensor) -> int | None:
    """How many tensors (views, aliases) hold ``tensor``'s storage; ``None`` where unknown.

    Counted while this call holds one more reference of its own: compare against the count of
    a known state of the same tensor, not against a constant. A bare ``UntypedStorage``
    object kept somewhere (``tensor.untyped_storage()`` held on to) does not count: nothing in
    this package keeps one.
    """
    if _storage_use_count is None:
        return None
    return int(_storage_use_count(tensor.untyped_storage()._cdata))
