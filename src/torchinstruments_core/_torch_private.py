"""The two private autograd entry points the engine relies on, kept in one place.

Both are pinned by ``tests/test_torch_private.py`` so that a torch release that changes them
fails loudly instead of silently mis-correlating gradients.

- ``queue_callback``: run a function when the current backward pass has finished. It is how a sample
  knows that every gradient of that backward has arrived; DDP and FSDP use the same call.
- ``in_backward``: whether the calling code runs inside an autograd graph task. A root forward
  that starts during a backward is the recomputation of activation checkpointing, not a new sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Callable


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass that is executing now completes.

    Must be called from inside a backward (a tensor hook).
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def current_graph_task_id() -> int:
    """Id of the autograd graph task executing on this thread, or -1 outside a backward."""
    return int(torch._C._current_graph_task_id())


def in_backward() -> bool:
    """Whether this thread is executing a backward pass right now."""
    return current_graph_task_id() != -1
