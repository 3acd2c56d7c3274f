"""The overhead targets, measured step against step in one process: unsampled and sampled steps.

    uv run python benchmarks/paired.py [--workload transformer] [--rounds 40] [--compile]
        [--exact-quartiles] [--sink run-directory|recording] [--device cpu|cuda] [--optimizer]

``overhead.py`` gives every configuration a fresh process, which is right for memory and for
comparing tools, but on a shared machine the speed of two processes can differ by 10 %, more
than the 1 % an unsampled step may cost. Here two copies of the same workload (same seed, same
weights, same batches) live in one process: one plain, one observed (default profile, run
directory). Each round runs one step of each configuration: plain, observed but not sampled,
observed and sampled, in an order that rotates every round, so that drift and what a step
leaves behind (caches, the writer thread) fall on every configuration alike. Step time is wall
time (``time.perf_counter``): what the training loop waits, including any wait for the GIL
while the run directory's writer thread works.

With ``--compile`` both copies are ``torch.compile``d (inductor) and the observed one is
observed as ``inject_observer(torch.compile(model))``. With ``--device cuda`` every step ends
with ``torch.cuda.synchronize()``, so a step's time includes its kernels, and memory comes from
the CUDA allocator's own peak statistic.

With ``--optimizer`` the workload's optimizer is passed to ``inject_observer`` too, so a sampled
step also records the optimizer step signals (parameters, gradients, updates, optimizer state).

Reported: each configuration's median step; each ratio as the median of the per-round ratios,
with the interquartile range of those ratios. The sampled step carries everything a sample
costs on the training thread (hooks, reductions, the handover to the writer).

The unsampled step's cost is below what whole steps can resolve here, so it is also timed
directly: ``begin_step``, the root module's two hooks and ``end_step``, which is all an
unsampled step runs, around a model that does nothing, against the same model unobserved.

Then two more steps of each configuration run under the torch profiler
(``testing.tensor_memory``), the second measured: its peak tensor memory above what was
allocated when it started, what it left allocated, and the memory target: a sampled step's
peak at most the largest activation (in float32) above the plain step's.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from _overhead_workloads import WORKLOADS, Workload, build

if TYPE_CHECKING:
    from collections.abc import Callable

CONFIGURATIONS = ("plain", "unsampled", "sampled")


def _step(
    configuration: str, plain: Workload, observed: Workload, observer: object, step: int
) -> float:
    workload = plain if configuration == "plain" else observed
    cuda = next(workload.model.parameters()).is_cuda
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    if configuration != "plain":
        observer.begin_step(step, sample=configuration == "sampled")  # type: ignore[attr-defined]
    workload.step()
    if configuration != "plain":
        observer.end_step()  # type: ignore[attr-defined]
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _largest_activation(workload: Workload) -> int:
    """Bytes of the largest tensor any module of ``workload`` outputs in one step, in float32."""
    sizes = [0]

    def record(module: torch.nn.Module, inputs: object, output: object) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        sizes.extend(t.numel() * 4 for t in outputs if isinstance(t, torch.Tensor))

    handles = [m.register_forward_hook(record) for m in workload.model.modules()]
    workload.step()
    for handle in handles:
        handle.remove()
    return max(sizes)


def _memory_table(
    plain: Workload, observed: Workload, observer: object, step: int, largest: int
) -> None:
    """Peak and net tensor memory of a profiled step per configuration, against the target."""
    mib = 2**20
    print("\n| configuration | peak tensor memory of the step (MiB) | left allocated (MiB) |")
    print("|---|---|---|")
    peaks = {}
    for offset, name in enumerate(CONFIGURATIONS):
        # twice: a first profiled step cannot see the frees of tensors allocated before it
        for repeat in range(2):
            peak, net = _memory(
                lambda name=name, at=step + 2 * offset + repeat: _step(  # type: ignore[misc]
                    name, plain, observed, observer, at
                ),
                next(plain.model.parameters()).device,
            )
        peaks[name] = peak
        print(f"| {name} | {peak / mib:.1f} | {net / mib:.1f} |")
    added = peaks["sampled"] - peaks["plain"]
    verdict = "met" if added <= largest else "NOT met"
    print(
        f"\nsampled peak - plain peak: {added / mib:.1f} MiB; largest activation in float32: "
        f"{largest / mib:.1f} MiB; target {verdict}"
    )


def _unsampled_cost(plain_step_s: float, repeats: int) -> None:
    """What the observer adds to an unsampled step, timed on a model that does nothing.

    An unsampled step runs ``begin_step``, the root module's two hooks and ``end_step``; no
    per-module hook is registered. Their cost does not depend on the model, so timing them
    around ``nn.Identity`` measures it to the microsecond, which whole steps cannot here.
    """
    from torchinstruments_core import inject_observer
    from torchinstruments_core.testing import RecordingSink

    plain, observed = torch.nn.Identity(), torch.nn.Identity()
    observer = inject_observer(observed, sink=RecordingSink())
    example = torch.ones(1)
    counter = iter(range(10**9))

    def observed_step() -> None:
        observer.begin_step(next(counter), sample=False)
        observed(example)
        observer.end_step()

    def best(step: Callable[[], object]) -> float:
        return min(timeit.repeat(step, number=repeats, repeat=5)) / repeats

    plain_s, observed_s = best(lambda: plain(example)), best(observed_step)
    observer.remove()
    added = observed_s - plain_s
    print(
        f"\nunsampled step, observer's own time (begin_step, root hooks, end_step; best of 5 x "
        f"{repeats}): {added * 1e6:.1f} us, {1 + added / plain_step_s:.6f}x of the median "
        "plain step"
    )


def _memory(step: Callable[[], object], device: torch.device) -> tuple[int, int]:
    """Peak and net tensor memory of ``step`` above its start: CUDA's allocator, else the CPU's."""
    if device.type != "cuda":
        from torchinstruments_core.testing import tensor_memory

        memory = tensor_memory(step)
        return memory.peak, memory.net
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, torch.cuda.memory_allocated() - start


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="transformer", choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--probe-repeats", type=int, default=20000, help="timed calls for the unsampled cost"
    )
    parser.add_argument(
        "--exact-quartiles", action="store_true", help="QuantileReducer(exact=True): sort it all"
    )
    parser.add_argument("--sink", choices=["run-directory", "recording"], default="run-directory")
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile both models; observe the compiled"
    )
    parser.add_argument(
        "--optimizer", action="store_true", help="also record the optimizer step signals"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from torchinstruments_core import MomentsReducer, QuantileReducer, Reducer, inject_observer
    from torchinstruments_core.testing import RecordingSink

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    if WORKLOADS[args.workload].cuda_only and args.device != "cuda":
        parser.error(f"--workload {args.workload}: needs --device cuda (a GPU)")
    device = torch.device(args.device)
    plain, observed = build(args.workload, device), build(args.workload, device)
    if args.compile:
        plain.model = torch.compile(plain.model)  # type: ignore[assignment]
        observed.model = torch.compile(observed.model)  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as folder:
        reducers: list[Reducer] | None = (
            [MomentsReducer(), QuantileReducer(exact=True)] if args.exact_quartiles else None
        )
        destination = (
            {"sink": RecordingSink()}
            if args.sink == "recording"
            else {"output_dir": Path(folder) / "run"}
        )
        optimizer = observed.optimizer if args.optimizer else None
        observer = inject_observer(
            observed.model, reducers=reducers, optimizer=optimizer, **destination
        )
        times: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
        for index in range(args.warmup + args.rounds):
            order = CONFIGURATIONS[index % 3 :] + CONFIGURATIONS[: index % 3]
            round_times = {name: _step(name, plain, observed, observer, index) for name in order}
            if index >= args.warmup:
                for name, seconds in round_times.items():
                    times[name].append(seconds)
            print(f"round {index + 1}/{args.warmup + args.rounds}", file=sys.stderr, end="\r")
        print(file=sys.stderr)
        _report(args, times)
        plain_step_s = statistics.median(times["plain"])
        _unsampled_cost(plain_step_s, args.probe_repeats)
        _memory_table(
            plain, observed, observer, args.warmup + args.rounds, _largest_activation(plain)
        )
        observer.remove()


def _report(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    """The timing table: median steps, and the ratios to plain with their spread."""
    quartiles = "exact quartiles" if args.exact_quartiles else "default profile"
    print(f"{WORKLOADS[args.workload].description}; {args.threads} thread(s), {args.rounds} rounds")
    compiled = ", both models compiled (inductor)" if args.compile else ""
    steps = ", optimizer step signals" if args.optimizer else ""
    print(f"observed with the {quartiles}, {args.sink}{compiled}{steps}")
    gpu = f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    print(f"{platform.processor() or platform.machine()}{gpu}, torch {torch.__version__}\n")
    print("| configuration | median step (ms) | ratio to plain, median of rounds | IQR of ratios |")
    print("|---|---|---|---|")
    for name in CONFIGURATIONS:
        median = statistics.median(times[name]) * 1000
        ratios = [t / p for t, p in zip(times[name], times["plain"], strict=True)]
        q1, q2, q3 = _quartiles(ratios)
        print(f"| {name} | {median:.1f} | {q2:.3f}x | {q1:.3f}-{q3:.3f} |")


if __name__ == "__main__":
    main()
