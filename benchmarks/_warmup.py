"""The benchmarks' warm-up: rounds until the run directory's writer process has started.

The observer starts its writer process when it is made; the process imports its libraries
(polars, numpy, the TensorBoard writer) for about a second on the other core, the one the
kernels' reduction queue uses, and until it is ready a full queue of samples blocks the
training thread once. Sampled steps measured in that second cost the small models far more
than later ones: the MNIST MLP 2.213x after three warm-up rounds against 1.605x after 300
(``paired.py --workload mnist-mlp --rounds 20``, 2026-12-04 22:11 UTC). So a warm-up lasts a
number of rounds and at least ``SECONDS`` of them, whichever is longer: on the larger workloads
the rounds alone take that long.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

SECONDS = 3.0
"""The least warm-up, in seconds (``--warmup-seconds``)."""


def warm_up(run_round: Callable[[int], object], rounds: int, seconds: float, name: str) -> int:
    """Call ``run_round(index)`` for at least ``rounds`` rounds and ``seconds``; how many ran."""
    index, began = 0, time.perf_counter()
    while index < rounds or time.perf_counter() - began < seconds:
        run_round(index)
        index += 1
        print(f"{name}: warming up, round {index}", file=sys.stderr, end="\r")
    return index
