"""Where a sampled step's time goes: the observer's phases, timed inside one process.

    uv run python benchmarks/sampled_profile.py [--workload small-gpt] [--steps 20]
        [--warmup 3] [--sink run-directory|recording] [--writer process|thread]
        [--stub-reductions] [--optimizer]

The engine's functions are wrapped with timers (wall clock, ``time.perf_counter``, or with
``--clock cpu`` the thread's CPU time, steadier on a busy machine; about a microsecond per call,
against tens to hundreds for what they time) and a workload runs
``--steps`` sampled steps after the warm-up (sampled steps for at least ``--warmup`` seconds,
``_warmup``: the run directory's writer process starts meanwhile, and until it is ready a full
queue of samples blocks the training thread once, which would add a tenth of a second to the
mean of every phase around delivery), then as many unsampled ones. Reported per
sampled step: the step itself, the unsampled step, and each phase in milliseconds, split by the
thread it ran on: ``training``, ``reductions`` (the CPU reduction worker, on where torch's
threads leave a core free: with the default ``--threads 1`` on two cores or more) and
``writer`` (the run directory's). Phases nest: ``measure`` (the hook's part) holds the
hand-over to the worker (the copy, and any wait for room), or, without the worker, the
reductions themselves; ``reduce: all reducers of a tensor`` holds the statistics pass and each
reducer; ``deliver`` holds ``build`` (rows and histogram edges) and the hand-over to the sink;
``settle`` is the wait for the worker's last tensors when a sample closes (at the end of its
backward).
The ``entry:`` phases time the observer's entry points on the training thread whole (a layer's
forward hook, a gradient hook, closing the sample, ``begin_step`` and ``end_step``): their sum is
all the observer's own time there, and what the step gains beyond it is the model's work slowed
beside the reduction worker (the caches, the memory bandwidth, the GIL). With
``--stub-reductions`` every reduction gives no value at once, so the hooks, hand-overs, rows and
delivery run without the reductions they wrap.
With ``--optimizer`` the observer is given the workload's optimizer, so that a sampled step
also records the optimizer step signals (as the adapters' defaults do), and the optimizer's
step hooks are timed whole (``entry: optimizer step hooks``) with their parts: the
parameters' copies before the step, the updates formed after it, Adam's ratio, each wait for
the kernels' queue (whose thread, not a Python one, these timers do not see) and the step
record's close (its values read back and delivered). These nest too: ``step record:
hand-overs`` holds the updates formed and Adam's ratio, which are computed as the tensors are
handed over.
The run directory's writer runs in a process of its own (the default, ``--writer process``),
which these timers do not see: what is left of it here is pickling each sample, inside
``deliver``. With ``--writer thread`` it runs on a thread of this process, and its phases show
as ``writer``: turning samples into Parquet chunks, the TensorBoard histograms and the
aggregates of ``result.json``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _overhead_workloads import WORKLOADS, build
from _warmup import SECONDS, warm_up

_TIMES: dict[tuple[str, str], float] = collections.defaultdict(float)
_MAIN = threading.main_thread()
_CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = time.perf_counter


def _timed(owner: Any, attribute: str, phase: str) -> None:
    """Replace ``owner.attribute`` with a wrapper adding its time to ``phase``, per thread."""
    original = getattr(owner, attribute)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = _clock()
        try:
            return original(*args, **kwargs)
        finally:
            _TIMES[_thread(), phase] += _clock() - started

    setattr(owner, attribute, wrapper)


def _thread() -> str:
    current = threading.current_thread()
    if current is _MAIN:
        return "training"
    return "reductions" if current.name == "torchinstruments-reductions" else "writer"


def _instrument() -> None:
    from torchinstruments_core import (
        _background,
        _capture,
        _delivery,
        _hooks,
        _lifecycle,
        _measure,
        _observer,
        _sample,
        reducers,
    )
    from torchinstruments_core.reducers import base
    from torchinstruments_core.run_directory import _aggregate, _tensorboard, _writer

    _timed(_measure.Measurer, "measure", "measure")
    _timed(_background.ReductionWorker, "submit", "measure: hand-over (copy, wait for room)")
    _timed(_measure.Measurer, "_fill", "reduce: all reducers of a tensor")
    _timed(base, "summarize", "reduce: statistics pass")
    _timed(reducers.MomentsReducer, "reduce", "reduce: moments")
    _timed(reducers.QuantileReducer, "reduce", "reduce: quartiles (gather, select)")
    _timed(reducers.HistogramReducer, "reduce", "reduce: histogram (binning)")
    _timed(_sample.Sample, "settle", "settle (waits for the worker's last tensors)")
    _timed(_sample.Sample, "start_transfer", "transfer to host")
    _timed(_delivery.DeliveryQueue, "_deliver", "deliver")
    _timed(_sample.Sample, "build", "deliver: build (rows, histogram edges)")
    _timed(_writer, "history_frame", "history chunk: frame")
    _timed(_writer, "samples_frame", "samples chunk: frame")
    _timed(_writer, "atomic_write_parquet", "chunks: Parquet write")
    _timed(_tensorboard.TensorBoardHistograms, "__call__", "TensorBoard histograms")
    _timed(_aggregate.RunAggregates, "add", "result.json aggregates")
    # the observer's entry points on the training thread, each timed whole (what it calls
    # included): every second of the observer's own there is inside one of them
    _timed_entry(_hooks.Hook, "__call__", "entry: module hooks (every layer's forward)")
    _timed_entry(_capture.GradientSlot, "__call__", "entry: gradient hooks")
    _timed_entry(_lifecycle.SampleLifecycle, "_close", "entry: closing the sample")
    _timed_entry(_observer.Observer, "begin_step", "entry: begin_step")
    _timed_entry(_observer.Observer, "end_step", "entry: end_step")


def _instrument_optimizer() -> None:
    """Time the optimizer step hooks and their parts (``--optimizer``)."""
    from torchinstruments_core import _lifecycle, _measure, _optimizer_probe, _step_tensors

    hooks = "entry: optimizer step hooks"
    _timed_entry(_optimizer_probe.OptimizerProbe, "_pre", hooks)
    _timed_entry(_optimizer_probe.OptimizerProbe, "_post", hooks)
    _timed(_optimizer_probe.OptimizerProbe, "_before", "step record: before the step")
    copied = "step record: parameters copied"  # the queued copies, the caller's, the wait
    _timed(_optimizer_probe, "queue_copies", copied)
    _timed(_optimizer_probe, "before_step", copied)
    _timed(_measure.Measurer, "wait_for", copied)
    _timed(_optimizer_probe.OptimizerProbe, "_after", "step record: after the step")
    _timed(_step_tensors, "_difference", "step record: updates formed")
    _timed(_step_tensors, "adam_ratio", "step record: Adam's ratio")
    _timed(_lifecycle.SampleLifecycle, "measure_step", "step record: hand-overs")
    _timed(_lifecycle.SampleLifecycle, "wait_for_reductions", "step record: waits for the queue")
    _timed(_optimizer_probe.OptimizerProbe, "_close", "step record: close (read back, deliver)")


_ENTERED = threading.local()


def _timed_entry(owner: Any, attribute: str, phase: str) -> None:
    """``_timed`` for an entry point: only its outermost call counts (entry points nest)."""
    original = getattr(owner, attribute)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_ENTERED, "inside", False):
            return original(*args, **kwargs)
        _ENTERED.inside = True
        started = _clock()
        try:
            return original(*args, **kwargs)
        finally:
            _ENTERED.inside = False
            _TIMES[_thread(), phase] += _clock() - started

    setattr(owner, attribute, wrapper)


def _stub_reductions() -> None:
    """Make every reduction give no value at once, keeping everything around it.

    The hooks, hand-overs, rows and delivery then run as before (every value unavailable),
    so the difference to a normal run is what the reductions themselves cost the step.
    """
    from torchinstruments_core import _measure

    def fill(self: Any, plain: Any, measurement: Any, *args: Any) -> None:
        measurement.reason = "empty_tensor"

    _measure.Measurer._fill = fill  # type: ignore[method-assign,assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="small-gpt", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--warmup", type=float, default=SECONDS, help="seconds of sampled steps first"
    )
    parser.add_argument("--sink", choices=["run-directory", "recording"], default="run-directory")
    parser.add_argument("--writer", choices=["process", "thread"], default="process")
    parser.add_argument(
        "--clock", choices=sorted(_CLOCKS), default="wall", help="cpu: the thread's CPU time"
    )
    parser.add_argument(
        "--optimizer",
        action="store_true",
        help="give the observer the optimizer: the step signals are recorded too",
    )
    parser.add_argument(
        "--stub-reductions",
        action="store_true",
        help="every reduction gives no value at once: what is left is the observer around them",
    )
    args = parser.parse_args()
    if args.stub_reductions:
        _stub_reductions()
    global _clock
    _clock = _CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    from torchinstruments_core import inject_observer
    from torchinstruments_core.run_directory import RunDirectorySink
    from torchinstruments_core.testing import RecordingSink

    workload = build(args.workload, torch.device("cpu"))
    with tempfile.TemporaryDirectory() as folder:
        destination: dict[str, Any] = (
            {"sink": RecordingSink()}
            if args.sink == "recording"
            else {"sink": RunDirectorySink(Path(folder) / "run", writer=args.writer)}
        )
        _instrument()  # before the observer: it binds some of the methods timed (``_close``)
        if args.optimizer:
            _instrument_optimizer()
            destination["optimizer"] = workload.optimizer
        observer = inject_observer(workload.model, **destination)

        def step(number: int, sample: bool) -> float:
            started = _clock()
            observer.begin_step(number, sample=sample)
            workload.step()
            observer.end_step()
            return _clock() - started

        warm = warm_up(lambda index: step(index, True), 3, args.warmup, args.workload)
        _TIMES.clear()  # the warm-up steps'
        sampled = [step(warm + n, True) for n in range(args.steps)]
        phases = dict(_TIMES)
        unsampled = [step(warm + args.steps + n, False) for n in range(args.steps)]
        observer.remove()
    _print(args, statistics.median(sampled), statistics.median(unsampled), phases)


def _print(
    args: argparse.Namespace, sampled: float, unsampled: float, phases: dict[tuple[str, str], float]
) -> None:
    sink = args.sink if args.sink == "recording" else f"{args.sink} (writer: {args.writer})"
    stub = ", reductions stubbed out" if args.stub_reductions else ""
    stub += ", optimizer step signals" if args.optimizer else ""
    print(f"{WORKLOADS[args.workload].description}; {sink}{stub}, {args.steps} sampled steps\n")
    print(f"median sampled step {sampled * 1e3:.1f} ms, unsampled {unsampled * 1e3:.1f} ms")
    entries = sum(t for (thread, phase), t in phases.items() if phase.startswith("entry:"))
    print(
        f"the observer's entry points on the training thread: {entries / args.steps * 1e3:.2f} ms"
        f" of the {(sampled - unsampled) * 1e3:.2f} ms between the medians\n"
    )
    print("| thread | phase | ms per sampled step |")
    print("|---|---|---|")
    for (thread, phase), seconds in sorted(phases.items()):
        print(f"| {thread} | {phase} | {seconds / args.steps * 1e3:.2f} |")


if __name__ == "__main__":
    main()
