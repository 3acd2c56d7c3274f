"""Pins the behaviour of the private torch calls in ``_torch_private``.

If a torch release changes them, these tests fail before gradients are silently mis-correlated
or memory silently mis-measured.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch.profiler import ProfilerActivity, profile

from torchinstruments_core._torch_private import (
    current_graph_task_id,
    in_backward,
    memory_events,
    queue_callback,
    storage_holders,
    version,
    view_base,
)


def test_graph_task_id_is_minus_one_outside_and_stable_within_a_backward() -> None:
    """Outside a backward the id is -1; every hook of one backward sees one id; the next differs."""
    seen: list[int] = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    z = y * 3
    y.register_hook(lambda g: seen.append(current_graph_task_id()))
    z.register_hook(lambda g: seen.append(current_graph_task_id()))
    assert current_graph_task_id() == -1
    assert not in_backward()
    z.sum().backward(retain_graph=True)
    z.sum().backward()
    assert len(seen) == 4
    assert seen[0] == seen[1] != -1
    assert seen[2] == seen[3] != seen[0]


def test_queued_callback_runs_once_after_every_hook_of_the_backward() -> None:
    """A callback queued from a tensor hook runs after the last hook of that backward."""
    events: list[str] = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    z = y * 3

    def first(_: torch.Tensor) -> None:
        events.append("z")
        queue_callback(lambda: events.append("done"))

    z.register_hook(first)
    y.register_hook(lambda _: events.append("y"))
    torch.autograd.grad(z.sum(), [x])
    assert events == ["z", "y", "done"]


def test_checkpoint_recomputation_runs_inside_the_backward() -> None:
    """The recomputation of activation checkpointing happens in a backward (both variants)."""
    for reentrant in (False, True):
        inside: list[bool] = []

        def block(t: torch.Tensor, seen: list[bool] = inside) -> torch.Tensor:
            seen.append(in_backward())
            return t.sin()

        x = torch.ones(3, requires_grad=True)
        checkpoint.checkpoint(block, x, use_reentrant=reentrant).sum().backward()
        assert inside == [False, True]


def test_profiler_memory_events_carry_every_allocation_and_free_in_order() -> None:
    """Profiled CPU allocations and frees appear with their sizes and device, in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        first = torch.ones(1_000_000)
        second = first * 2
        del first
        del second
    sizes = [size for _, size in memory_events(profiler)]
    big = [size for size in sizes if abs(size) == 4_000_000]
    assert big == [4_000_000, 4_000_000, -4_000_000, -4_000_000]
    times = [time for time, _ in memory_events(profiler)]
    assert times == sorted(times)
    raw = profiler.profiler.kineto_results.events()  # what memory_events filters by device
    devices = {e.device_type() for e in raw if e.name() == "[memory]" and abs(e.nbytes()) > 1e6}
    assert devices == {torch._C._autograd.DeviceType.CPU}


def test_version_counts_in_place_ops_on_a_tensor_and_its_aliases() -> None:
    """The count that tells a gradient read without a copy from one changed meanwhile."""
    tensor = torch.randn(8)
    start = version(tensor)
    _ = tensor * 2  # out of place: no change
    assert version(tensor) == start
    tensor.mul_(2)
    assert version(tensor) == start + 1
    alias = tensor.detach().reshape(-1)  # what the worker reads
    alias.add_(1)
    assert version(tensor) == start + 2
    with torch.no_grad():
        tensor[0] = 0.0
    assert version(alias) == start + 3


def test_view_base_is_the_tensor_every_view_was_taken_of() -> None:
    """The root of a chain of views, which tells a computed output's view from an input's."""
    tensor = torch.randn(4, 3)
    flat = tensor.view(-1)
    assert view_base(flat) is tensor
    assert view_base(flat[3:].view(3, 3)) is tensor  # through every view in between
    assert view_base(tensor) is None
    assert view_base(tensor * 2) is None


def test_storage_holders_counts_every_tensor_on_the_memory() -> None:
    """Views and detached aliases each count one; the count falls back as they go.

    Where this torch build has no count (before 2.8 without CUDA) it is ``None`` and the
    parameters' copies are never reused (``_copy_buffers``).
    """
    tensor = torch.zeros(16)
    alone = storage_holders(tensor)
    if alone is None:
        pytest.skip("this torch build cannot count holders")
    view = tensor[4:].view(3, 4)
    alias = tensor.detach()
    assert storage_holders(tensor) == alone + 2
    assert storage_holders(view) == alone + 2
    del view
    assert storage_holders(alias) == alone + 1
    del alias
    assert storage_holders(tensor) == alone
    assert storage_holders(torch.zeros(16)) == alone  # a fresh tensor: the same baseline
