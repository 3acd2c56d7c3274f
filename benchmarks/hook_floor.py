"""What any design that hooks every module in Python pays on a workload, against the observer.

    uv run python benchmarks/hook_floor.py [--workload mnist-mlp lenet ...] [--rounds 200]

One process, one model, one observer attached (its root hooks cost an unsampled step a few
microseconds). Each round runs, in an order that rotates, two unsampled steps before every
configuration below, so that each finds the caches as a sampled step does after unsampled
ones (``paired.py`` measures the same way):

- ``hooks``: a forward hook on every leaf module and a tensor hook on each output that requires
  grad; both only keep a reference to their tensor until the step ends. What registering and
  calling a hook per tensor costs, and nothing else.
- ``copies``: the same hooks copying each output and gradient (``clone``): what a design pays
  that reads every tensor after its hook returns (the model may change it in place), before it
  reads a single value. The observer copies less: gradients, and outputs a forward showed
  unchanged, are read in place.
- ``copies + kernels``: those copies reduced by the compiled kernels' ``profile`` on the
  training thread, once the backward is over: the default profile's statistics, quartiles and a
  64-bin histogram of every tensor (the observer bins only its focus layers' tensors, at most
  8). What the reductions cost where no other core takes them.
- ``observer``: a step the observer samples (default profile, run directory with its writer
  process): hooks, copies, the reductions on another core, the rows and their delivery.

Reported per workload: the median step of each configuration, its ratio to the median of the
unsampled steps, the time it adds, and the median of its minor page faults (``ru_minflt``):
memory the step touched for the first time, or again after the C library gave it back to the
system (glibc returns the top of its heap once more than ``M_TRIM_THRESHOLD`` is free there;
``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296`` in the environment keep
it, see the README). The difference between ``observer`` and ``hooks`` is
what the observer's own Python costs a sampled step beyond the unavoidable; ``copies`` and
``copies + kernels`` say how much of it the copies and the reductions could take at best.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from _overhead_workloads import WORKLOADS, build

from torchinstruments_core import inject_observer
from torchinstruments_core.reducers import _native
from torchinstruments_core.reducers._fused import _call
from torchinstruments_core.reducers.functional import DEFAULT_SAMPLE_SIZE
from torchinstruments_core.run_directory import RunDirectorySink

if TYPE_CHECKING:
    from collections.abc import Callable

    from _overhead_workloads import Workload
    from torch.utils.hooks import RemovableHandle

CONFIGURATIONS = ("hooks", "copies", "copies + kernels", "observer")
BINS = 64


class FloorHooks:
    """Hooks on every leaf module that keep (or copy) each output and its gradient."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._leaves = [m for m in model.modules() if m is not model and not any(m.children())]
        self._copy = False
        self.held: list[torch.Tensor] = []

    def arm(self, *, copy: bool) -> list[RemovableHandle]:
        """Register the forward hooks for one step; the caller removes them."""
        self._copy = copy
        return [leaf.register_forward_hook(self._on_output) for leaf in self._leaves]

    def _keep(self, tensor: torch.Tensor) -> None:
        self.held.append(tensor.detach().clone() if self._copy else tensor.detach())

    def _on_output(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return
        self._keep(output)
        if output.requires_grad:
            output.register_hook(self._keep)

    def reduce(self) -> None:
        """The kernels' default profile of every tensor held, on this thread."""
        for tensor in self.held:
            values = tensor.reshape(-1)
            call = _call(values.numel(), DEFAULT_SAMPLE_SIZE, BINS)
            index = _native.draw_positions(7, values.numel(), call.size) if call.drawn else None
            _native.profile(values, index, call.size, call.plan, call.bins)


def measure(name: str, rounds: int) -> dict[str, list[tuple[float, int]]]:
    """Step times (seconds) and minor page faults of the unsampled steps and of each configuration."""
    workload = build(name, torch.device("cpu"))
    floor = FloorHooks(workload.model)
    times: dict[str, list[tuple[float, int]]] = {"unsampled": [], **{c: [] for c in CONFIGURATIONS}}
    with tempfile.TemporaryDirectory() as folder:
        observer = inject_observer(workload.model, sink=RunDirectorySink(Path(folder) / "run"))
        counter = iter(range(10**9))

        def step(configuration: str) -> tuple[float, int]:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            observer.begin_step(next(counter), sample=configuration == "observer")
            handles = []
            if configuration in ("hooks", "copies", "copies + kernels"):
                handles = floor.arm(copy=configuration != "hooks")
            _run(workload, handles, floor, reduce=configuration == "copies + kernels")
            observer.end_step()
            elapsed = time.perf_counter() - started
            return elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

        for configuration in CONFIGURATIONS * 3:  # warm-up
            step(configuration)
        for index in range(rounds):
            shift = index % len(CONFIGURATIONS)
            for configuration in CONFIGURATIONS[shift:] + CONFIGURATIONS[:shift]:
                times["unsampled"] += [step("unsampled"), step("unsampled")]
                times[configuration].append(step(configuration))
            if index % 10 == 9:
                print(f"{name}: round {index + 1}/{rounds}", end="\r", flush=True)
        observer.remove()
    return times


def _run(
    workload: Workload, handles: list[RemovableHandle], floor: FloorHooks, *, reduce: bool
) -> None:
    try:
        workload.step()
    finally:
        for handle in handles:
            handle.remove()
    if reduce:
        floor.reduce()
    floor.held.clear()


def report(
    name: str, times: dict[str, list[tuple[float, int]]], out: Callable[[str], None] = print
) -> None:
    """One table row per configuration: median step, ratio, time added and page faults."""
    unsampled = statistics.median(t for t, _ in times["unsampled"])
    faults = statistics.median(f for _, f in times["unsampled"])
    out(f"\n{name}: {WORKLOADS[name].description}")
    out(f"unsampled step {unsampled * 1e3:.2f} ms, {faults:.0f} page faults\n")
    out("| configuration | step (ms) | ratio | added (ms) | page faults |")
    out("|---|---|---|---|---|")
    for configuration in CONFIGURATIONS:
        median = statistics.median(t for t, _ in times[configuration])
        added = (median - unsampled) * 1e3
        faulted = statistics.median(f for _, f in times[configuration])
        out(
            f"| {configuration} | {median * 1e3:.2f} | {median / unsampled:.3f}x | {added:+.2f}"
            f" | {faulted:.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", nargs="+", default=["mnist-mlp"], choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.workload:
        report(name, measure(name, args.rounds))


if __name__ == "__main__":
    main()
