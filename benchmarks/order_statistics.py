"""The quartiles' order statistics in the compiled kernels, against numpy, on shaped data.

    uv run python benchmarks/order_statistics.py [--size 8192] [--repeat 7]

Times ``_native.order_statistics`` (the radix selection of ``reducers/_kernels.c``) for the
default quartile plan's ranks over ``--size`` entries of each pattern below, in float32 and
float64, next to ``np.sort`` and ``np.partition`` of the same array (what the reducers use
without the kernels), and checks the values against the sort. The patterns are the shapes a
selection by digits finds hard or easy: normal entries, a ReLU's (half of them zeros), uniform
ones in one binade, a few integers, subnormals, many binades, and one value with rare
outliers. Prints a Markdown table, microseconds a call (the best of ``--repeat`` runs of a
timing loop).
"""

from __future__ import annotations

import argparse
import functools
import timeit
from typing import TYPE_CHECKING

import numpy as np
import torch

from torchinstruments_core.reducers import _native
from torchinstruments_core.reducers.functional import DEFAULT_QUANTILES, quantile_plan

if TYPE_CHECKING:
    from collections.abc import Callable


def patterns(size: int) -> dict[str, np.ndarray]:
    """The arrays timed, in float64, by name."""
    rng = np.random.default_rng(0)
    normal = rng.standard_normal(size)
    return {
        "normal": normal,
        "ReLU (half zeros)": np.maximum(normal, 0.0),
        "uniform [0, 1)": rng.random(size),
        "five integers": rng.integers(0, 5, size).astype(np.float64),
        "subnormal (x 1e-40)": normal * 1e-40,
        "log-normal (many binades)": np.exp(10 * normal),
        "ones, 0.1 % outliers": np.where(rng.random(size) < 0.001, normal, 1.0),
    }


def best(call: Callable[[], object], repeat: int) -> float:
    """Microseconds a call, the best of ``repeat`` timing loops of about 50 ms."""
    number = max(1, int(0.05 / max(timeit.timeit(call, number=3) / 3, 1e-7)))
    return min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    if _native.KERNELS is None:
        raise SystemExit("the compiled kernels are not installed (or TORCHINSTRUMENTS_NATIVE=0)")
    torch.set_num_threads(1)
    ranks = quantile_plan(args.size, DEFAULT_QUANTILES).ranks
    print(f"order statistics at ranks {ranks.tolist()} of {args.size:,} entries, µs a call\n")
    print("| pattern | dtype | kernels | np.sort | np.partition |")
    print("|---|---|---|---|---|")
    for name, values in patterns(args.size).items():
        for dtype in (np.float32, np.float64):
            array = values.astype(dtype)
            tensor = torch.from_numpy(array)
            found = _native.order_statistics(tensor, None, args.size, ranks)
            if found != np.sort(array)[ranks].astype(np.float64).tolist():
                raise SystemExit(f"{name}, {dtype.__name__}: the kernels disagree with np.sort")
            kernels = best(
                functools.partial(_native.order_statistics, tensor, None, args.size, ranks),
                args.repeat,
            )
            sort = best(functools.partial(np.sort, array), args.repeat)
            partition = best(functools.partial(np.partition, array, ranks), args.repeat)
            print(f"| {name} | {dtype.__name__} | {kernels:.1f} | {sort:.1f} | {partition:.1f} |")


if __name__ == "__main__":
    main()
