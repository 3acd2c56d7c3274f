"""What any design that hooks every module in Python pays on a workload, against the observer.

    uv run python benchmarks/hook_floor.py [--workload mnist-mlp lenet ...] [--rounds 200]
        [--threads 1]

One process, one model, one observer attached (its root hooks cost an unsampled step a few
microseconds). Each round runs, in an order that rotates, two unsampled steps before every
configuration below, so that each finds the caches as a sampled step does after unsampled
ones, and one unsampled step after it, timed as that configuration's next step: what it left
for later (the run directory's writer process starts on a sample once its step is over) falls
there, as in ``paired.py``:

- ``hooks``: a forward hook on every leaf module and a tensor hook on each output that requires
  grad; both only keep a reference to their tensor until the step ends. What registering and
  calling a hook per tensor costs, and nothing else.
- ``copies``: the same hooks copying each output and gradient, each into a buffer of its shape
  kept from the steps before (as the observer keeps its copy buffers: copies into fresh memory
  would fault its pages in, a cost of the allocator's, not of copying): what a design pays
  that reads every tensor after its hook returns (the model may change it in place), before it
  reads a single value. The observer copies less: gradients, and outputs a forward showed
  unchanged, are read in place.
- ``copies + kernels``: those copies reduced by the compiled kernels' ``profile`` on the
  training thread, once the step is over: the default profile's statistics, quartiles (one
  draw of positions per tensor size, as the observer draws them) and a 64-bin histogram of
  every tensor (the observer bins only its focus layers' tensors, at most 8). What the
  reductions cost where no other core takes them.
- ``copies + queue``: each copy handed, in its hook, to the kernels' reduction queue (one
  ``submit_profile`` each, the same profile and histograms as ``copies + kernels``, positions
  drawn on the queue's thread from a seed), and once the step is over every job waited for and
  its values read back (one ``tolist`` each). The least that a design handing each tensor to
  another core from Python pays: what the observer would cost if its per-tensor work were one
  call in the hook and one at the close, before any rows or delivery.
- ``lean design``: ``copies + queue`` plus what any observer must add to it, done as leanly as
  Python allows: each tensor's place (its module and whether it is an output or a gradient, a
  tuple), the kernels' output written into buffers kept from step to step, and at the close
  one wait for the queue, each tensor's values read back into one columnar record (lists of
  floats), pickled once and written to a pipe that a writer process reads. No measurement
  objects, no reuse of a tensor measured twice, no in-place reads, no check for a tensor
  changed under the queue, no non-finite fallback, no gradient scale: the least a design with
  rows and a writer process pays, an estimate of what a rewrite of the observer's per-tensor
  path could reach.
- ``observer``: a step the observer samples (default profile, run directory with its writer
  process): hooks, copies, the reductions on another core, the rows and their delivery.

Reported per workload: the median step of each configuration, its ratio to the median of the
unsampled steps, the time it adds, the median of its minor page faults (``ru_minflt``, this
process's: the writer process's are not counted), and the ratio and faults of the step after it.
Page faults are memory the step touched for the first time, or again after the C library gave it
back to the system (glibc returns the top of its heap once more than ``M_TRIM_THRESHOLD`` is free
there; ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296`` in the environment
keep it, see the README). The difference between ``observer`` and ``hooks`` is what the observer's
own Python costs a sampled step beyond the unavoidable; ``copies`` and ``copies + kernels`` say how
much of it the copies and the reductions could take at best, and ``copies + queue`` what handing
the reductions to another core leaves.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import pickle
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from _overhead_workloads import WORKLOADS, build
from _warmup import SECONDS, warm_up

from torchinstruments_core import inject_observer
from torchinstruments_core.reducers import _native
from torchinstruments_core.reducers._fused import _call
from torchinstruments_core.reducers.functional import DEFAULT_SAMPLE_SIZE
from torchinstruments_core.run_directory import RunDirectorySink

if TYPE_CHECKING:
    from collections.abc import Callable
    from multiprocessing.connection import Connection

    import numpy as np
    from _overhead_workloads import Workload
    from torch.utils.hooks import RemovableHandle

CONFIGURATIONS = (
    "hooks",
    "copies",
    "copies + kernels",
    "copies + queue",
    "lean design",
    "observer",
)
BINS = 64
SEED = 7
"""The seed of every subsample's positions (the observer's seeds change with each sample)."""


class FloorHooks:
    """Hooks on every leaf module that keep (or copy) each output and its gradient."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._leaves = [m for m in model.modules() if m is not model and not any(m.children())]
        self._copy = False
        self._to_queue = False  # ``copies + queue``: each copy goes to ``_queue`` in its hook
        self._lean = False  # ``lean design``: the queue, kept outputs, one record to a pipe
        self._queue: object | None = None  # made at the first such step
        self.held: list[torch.Tensor] = []
        self.jobs: list[_native.Queued] = []
        # each step's copies go into the buffers of the steps before, as the observer's spares
        # keep its copy buffers: fresh memory would make the copies fault its pages in
        self._buffers: dict[tuple[torch.Size, torch.dtype], list[torch.Tensor]] = {}
        self._taken: dict[tuple[torch.Size, torch.dtype], int] = {}
        self._places = {id(leaf): index for index, leaf in enumerate(self._leaves)}
        # ``lean design``: each tensor's place, the kernels' output buffers of each position in
        # the step (kept while its size stays), the jobs' tickets, and the writer's pipe
        self._sites: list[tuple[int, int]] = []
        self._outputs: list[tuple[int, np.ndarray, np.ndarray]] = []
        self._tickets: list[int] = []
        self._writer: tuple[Connection, multiprocessing.process.BaseProcess] | None = None
        self._step = 0

    def arm(self, *, copy: bool, queue: bool = False, lean: bool = False) -> list[RemovableHandle]:
        """Register the forward hooks for one step; the caller removes them.

        ``queue``: hand each copy to the kernels' queue in its hook (``copies + queue``);
        ``lean``: that, with kept output buffers and one record to a writer process.
        """
        self._copy = copy
        self._to_queue = queue and not lean
        self._lean = lean
        if (queue or lean) and self._queue is None:
            self._queue = _native.new_queue()
        if lean and self._writer is None:
            self._writer = _start_writer()
        return [leaf.register_forward_hook(self._on_output) for leaf in self._leaves]

    def _keep(self, tensor: torch.Tensor, site: tuple[int, int] = (-1, 1)) -> None:
        kept = self._copied(tensor.detach()) if self._copy else tensor.detach()
        self.held.append(kept)
        if self._lean:
            self._submit_lean(kept.reshape(-1), site)
        elif self._to_queue:
            values = kept.reshape(-1)  # a contiguous copy: a view of its buffer
            call = _call(values.numel(), DEFAULT_SAMPLE_SIZE, BINS)
            seed = SEED if call.drawn else None
            queued = _native.submit_profile(self._queue, values, seed, call.shape)
            self.jobs.append(queued)

    def _submit_lean(self, values: torch.Tensor, site: tuple[int, int]) -> None:
        """Queue ``values``' profile into the output buffers kept for this position."""
        assert _native.KERNELS is not None
        numel = values.numel()
        call = _call(numel, DEFAULT_SAMPLE_SIZE, BINS)
        position = len(self._tickets)
        if position < len(self._outputs) and self._outputs[position][0] == numel:
            _, numbers, out = self._outputs[position]
        else:
            numbers, out = call.shape.buffers(values.dtype, status=True)
            kept = (numel, numbers, out)
            if position < len(self._outputs):
                self._outputs[position] = kept
            else:
                self._outputs.append(kept)
        shape = call.shape
        ticket = _native.KERNELS.queue_submit(
            self._queue,
            SEED if call.drawn else None,
            values.data_ptr(),
            numel,
            0,  # float32
            0,
            shape.size,
            shape.ranks,
            shape.table,
            shape.bins,
            numbers,
            out,
        )
        self._tickets.append(ticket)
        self._sites.append(site)

    def _deliver_lean(self) -> None:
        """Wait for the queue once, read every job's values back, and send one record."""
        if not self._tickets:
            return
        assert self._queue is not None
        assert self._writer is not None
        _native.queue_wait(self._queue, self._tickets[-1])
        count = len(self._tickets)
        outputs = self._outputs[:count]
        record = {
            "step": self._step,
            "sites": self._sites,
            "status": [int(numbers[-1]) for _, numbers, _ in outputs],
            "summary": [numbers[:-1].tolist() for _, numbers, _ in outputs],
            "values": [out.tolist() for _, _, out in outputs],
        }
        self._writer[0].send_bytes(pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))
        self._step += 1
        self._tickets, self._sites = [], []

    def _copied(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` copied into a contiguous buffer of its shape kept from earlier steps."""
        key = (tensor.shape, tensor.dtype)
        buffers = self._buffers.setdefault(key, [])
        taken = self._taken.get(key, 0)
        if taken == len(buffers):
            buffers.append(torch.empty(tensor.shape, dtype=tensor.dtype))
        self._taken[key] = taken + 1
        return buffers[taken].copy_(tensor)

    def release(self) -> None:
        """The step is over: its copies' buffers serve the next step's copies."""
        self.held.clear()
        self._taken.clear()

    def collect(self) -> None:
        """Wait for the queue's jobs and read each one's values back (``copies + queue``).

        ``lean design``: its record is made and handed to the writer process.
        """
        self._deliver_lean()
        if self.jobs:
            last = self.jobs[-1].ticket
            if self._queue is not None and last is not None:
                _native.queue_wait(self._queue, last)
            for queued in self.jobs:
                queued.profiled().numbers.tolist()
        self.jobs.clear()

    def close(self) -> None:
        """Stop the queue's thread and the writer process, where a configuration started them."""
        if self._queue is not None:
            _native.queue_close(self._queue)
        if self._writer is not None:
            connection, process = self._writer
            connection.close()  # the writer reads to the end and exits
            process.join(timeout=30)
            self._writer = None

    def _on_output(self, module: torch.nn.Module, _args: Any, output: Any) -> None:
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return
        place = self._places[id(module)]
        self._keep(output, (place, 0))
        if output.requires_grad:
            output.register_hook(functools.partial(self._keep, site=(place, 1)))

    def reduce(self) -> None:
        """The kernels' default profile of every tensor held, on this thread.

        One draw of subsample positions per tensor size, as the observer draws them once a
        sample per size.
        """
        positions: dict[int, torch.Tensor] = {}
        for tensor in self.held:
            values = tensor.reshape(-1)
            numel = values.numel()
            call = _call(numel, DEFAULT_SAMPLE_SIZE, BINS)
            index = None
            if call.drawn:
                index = positions.get(numel)
                if index is None:
                    index = positions[numel] = _native.draw_positions(SEED, numel, call.size)
            _native.profile(values, index, call.shape)


def measure(name: str, rounds: int) -> dict[str, list[tuple[float, int]]]:
    """Step times (s) and minor page faults: unsampled steps, each configuration, the next step."""
    workload = build(name, torch.device("cpu"))
    floor = FloorHooks(workload.model)
    times: dict[str, list[tuple[float, int]]] = {"unsampled": []}
    for configuration in CONFIGURATIONS:
        times[configuration], times[_next(configuration)] = [], []
    counter = iter(range(10**9))
    with (
        contextlib.closing(floor),  # the queue's thread stops, whatever ends the run
        tempfile.TemporaryDirectory() as folder,
        inject_observer(workload.model, sink=RunDirectorySink(Path(folder) / "run")) as observer,
    ):

        def step(configuration: str) -> tuple[float, int]:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            observer.begin_step(next(counter), sample=configuration == "observer")
            handles = []
            if configuration != "observer" and configuration != "unsampled":
                queue = configuration == "copies + queue"
                lean = configuration == "lean design"
                handles = floor.arm(copy=configuration != "hooks", queue=queue, lean=lean)
            _run(workload, handles, floor, reduce=configuration == "copies + kernels")
            observer.end_step()
            elapsed = time.perf_counter() - started
            return elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

        warm_up(  # every configuration, the observer's writer process and the lean one's started
            lambda index: step(CONFIGURATIONS[index % len(CONFIGURATIONS)]),
            3 * len(CONFIGURATIONS),
            SECONDS,
            name,
        )
        for index in range(rounds):
            shift = index % len(CONFIGURATIONS)
            for configuration in CONFIGURATIONS[shift:] + CONFIGURATIONS[:shift]:
                times["unsampled"] += [step("unsampled"), step("unsampled")]
                times[configuration].append(step(configuration))
                # what the configuration left for later (the observer's writer process starts
                # on a sample once its step is over) falls here, not on the unsampled steps
                times[_next(configuration)].append(step("unsampled"))
            if index % 10 == 9:
                print(f"{name}: round {index + 1}/{rounds}", end="\r", flush=True)
    return times


def _start_writer() -> tuple[Connection, multiprocessing.process.BaseProcess]:
    """A process that reads and unpickles every record written to the returned pipe."""
    context = multiprocessing.get_context("spawn")
    reading, writing = context.Pipe(duplex=False)
    process = context.Process(target=_read_records, args=(reading,), daemon=True)
    process.start()
    reading.close()
    return writing, process


def _read_records(connection: Connection) -> None:
    """The writer process of ``lean design``: unpickle each record, until the pipe closes."""
    with contextlib.suppress(EOFError):
        while True:
            pickle.loads(connection.recv_bytes())


def _next(configuration: str) -> str:
    return f"{configuration}: next step"


def _run(
    workload: Workload, handles: list[RemovableHandle], floor: FloorHooks, *, reduce: bool
) -> None:
    try:
        workload.step()
        if reduce:
            floor.reduce()
    finally:
        for handle in handles:
            handle.remove()
        floor.collect()  # the jobs hold their copies' addresses: they run before these go
        floor.release()


def report(
    name: str, times: dict[str, list[tuple[float, int]]], out: Callable[[str], None] = print
) -> None:
    """One table row per configuration: median step, ratio, time added, page faults, next step."""
    unsampled = statistics.median(t for t, _ in times["unsampled"])
    faults = statistics.median(f for _, f in times["unsampled"])
    out(f"\n{name}: {WORKLOADS[name].description}")
    out(f"unsampled step {unsampled * 1e3:.2f} ms, {faults:.0f} page faults\n")
    out("| configuration | step (ms) | ratio | added (ms) | page faults | next step | its faults |")
    out("|---|---|---|---|---|---|---|")
    for configuration in CONFIGURATIONS:
        median = statistics.median(t for t, _ in times[configuration])
        faulted = statistics.median(f for _, f in times[configuration])
        after = statistics.median(t for t, _ in times[_next(configuration)])
        after_faults = statistics.median(f for _, f in times[_next(configuration)])
        out(
            f"| {configuration} | {median * 1e3:.2f} | {median / unsampled:.3f}x"
            f" | {(median - unsampled) * 1e3:+.2f} | {faulted:.0f} | {after / unsampled:.3f}x"
            f" | {after_faults:.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cpu = sorted(name for name, spec in WORKLOADS.items() if not spec.cuda_only)
    parser.add_argument("--workload", nargs="+", default=["mnist-mlp"], choices=cpu)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if _native.KERNELS is None:
        parser.error("the compiled kernels are not built here: `uv sync` builds them")
    torch.set_num_threads(args.threads)
    for name in args.workload:
        report(name, measure(name, args.rounds))


if __name__ == "__main__":
    main()
