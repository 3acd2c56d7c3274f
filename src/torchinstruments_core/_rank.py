"""The global rank and world size of this process, resolved when first needed.

An observer may be injected before ``torch.distributed.init_process_group`` (as under
``torch.multiprocessing.spawn``), so the rank is read at the first sample, not at injection.
Launchers such as ``torchrun`` set ``RANK`` and ``WORLD_SIZE`` before the process group exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class RankInfo:
    """The process's place in the run."""

    rank: int
    world_size: int


def current_rank() -> RankInfo:
    """Rank and world size from the process group, else the launcher's environment, else 0 of 1."""
    if dist.is_available() and dist.is_initialized():
        return RankInfo(dist.get_rank(), dist.get_world_size())
    rank = os.environ.get("RANK")
    world = os.environ.get("WORLD_SIZE")
    if rank is not None and rank.isdigit():
        return RankInfo(int(rank), int(world) if world and world.isdigit() else int(rank) + 1)
    return RankInfo(0, 1)
