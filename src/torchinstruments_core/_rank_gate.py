"""The rank gate: whether this process observes at all, under the rank policy.

The rank is read when first needed, not at injection: an observer may be injected before
``torch.distributed.init_process_group`` (see ``_rank``). Until then the gate is open.
"""

from __future__ import annotations

from torchinstruments_core._config import RankPolicy
from torchinstruments_core._rank import RankInfo, current_rank


class RankGate:
    """Owns this process's rank, once read, and whether the rank policy lets it observe.

    Args:
        policy: ``RankPolicy.RANK0`` observes only global rank 0; ``RankPolicy.ALL`` every rank.

    Attributes:
        enabled: Whether this process observes; ``True`` until the rank, once read, says no.
    """

    __slots__ = ("_policy", "_rank", "enabled")

    def __init__(self, policy: RankPolicy) -> None:
        self._policy = policy
        self._rank: RankInfo | None = None
        self.enabled = True

    def resolve(self) -> RankInfo:
        """This process's rank, read now if it was not yet."""
        if self._rank is None:
            self._rank = current_rank()
            self.enabled = self._policy is RankPolicy.ALL or self._rank.rank == 0
        return self._rank

    def admits(self) -> bool:
        """Whether this process observes, reading the rank if it was not yet."""
        if self._rank is None:  # inline check: this runs on every root forward
            self.resolve()
        return self.enabled

    def close_for_good(self) -> None:
        """Never observe again and never read the rank again (in a child made by ``fork``)."""
        self.enabled = False
        self._rank = self._rank or RankInfo(rank=-1, world_size=0)
