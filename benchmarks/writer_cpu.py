"""The run directory's writer process: its processor time a sample and a row, every step sampled.

    uv run python benchmarks/writer_cpu.py [--workload mnist-mlp small-gpt] [--steps 600]
        [--every 1]

What dense sampling (every step, as after a trigger) asks of the writer process, which shares
the cores with training and the kernels' queue: each workload is observed with the default
profile and a run directory, sampled every ``--every`` steps; after a warm-up the writer
process's user and system time (``/proc/<pid>/stat``, so Linux only) is read before and after
``--steps`` steps, and once more after it had a second to finish what it was given. Reported:
its processor time a sample and a row, and the training step's mean time beside that of a
plain copy and of a copy observed alike with the ``RecordingSink`` (which writes nothing), each
over the same number of steps in the same process. ``writer_cost.py`` measures instead what the
writer costs the training thread's sampled step, one sample at a time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from _overhead_workloads import WORKLOADS, build

from torchinstruments_core import inject_observer
from torchinstruments_core.run_directory import RunDirectorySink
from torchinstruments_core.testing import RecordingSink


def _cpu_seconds(pid: int) -> float:
    """User and system time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rows_a_sample(workload: str, device: torch.device) -> int:
    """How many history rows one sample of ``workload`` has (one step, recording sink)."""
    copy = build(workload, device)
    recording = RecordingSink()
    observer = inject_observer(copy.model, sink=recording)
    observer.begin_step(0, sample=True)
    copy.step()
    observer.end_step()
    observer.remove()
    return len(recording.samples[-1].rows)


def _mean_step(workload: str, steps: int, every: int, *, recording: bool) -> float:
    """The mean step of a plain copy, or of one observed with the recording sink, in ms."""
    copy = build(workload, torch.device("cpu"))
    observer = inject_observer(copy.model, sink=RecordingSink()) if recording else None
    began = 0.0
    for step in range(max(50, 2 * every) + steps):
        if step == max(50, 2 * every):
            began = time.perf_counter()
        if observer is not None:
            observer.begin_step(step, sample=step % every == 0)
        copy.step()
        if observer is not None:
            observer.end_step()
    elapsed = time.perf_counter() - began
    if observer is not None:
        observer.remove()
    return elapsed / steps * 1e3


def measure(workload: str, steps: int, every: int) -> dict[str, float]:
    """The writer process's processor time a sample and a row, and the mean steps."""
    device = torch.device("cpu")
    rows = _rows_a_sample(workload, device)
    copy = build(workload, device)
    with tempfile.TemporaryDirectory() as folder:
        sink = RunDirectorySink(Path(folder) / "run")
        observer = inject_observer(copy.model, sink=sink)
        for step in range(max(50, 2 * every)):  # imports, first chunks, the kernels' warm-up
            observer.begin_step(step, sample=step % every == 0)
            copy.step()
            observer.end_step()
        time.sleep(1.0)
        pid = sink.writer_pid
        if pid is None:
            raise SystemExit("the run directory's writer runs in a thread here, not a process")
        before, began = _cpu_seconds(pid), time.perf_counter()
        for step in range(steps):
            observer.begin_step(10_000 + step, sample=step % every == 0)
            copy.step()
            observer.end_step()
        elapsed = time.perf_counter() - began
        time.sleep(1.5)  # what it was handed, written
        used = _cpu_seconds(pid) - before
        observer.remove()
    samples = len(range(0, steps, every))
    return {
        "rows": rows,
        "sample_ms": used / samples * 1e3,
        "row_us": used / samples / rows * 1e6,
        "step_ms": elapsed / steps * 1e3,
        "recording_ms": _mean_step(workload, steps, every, recording=True),
        "plain_ms": _mean_step(workload, steps, every, recording=False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", nargs="+", default=["mnist-mlp", "small-gpt"])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        raise SystemExit("reads /proc: Linux only")
    unknown = [name for name in args.workload if name not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {sorted(WORKLOADS)}")
    torch.set_num_threads(args.threads)
    print(f"every {args.every} step(s), {args.steps} steps, {args.threads} thread(s)\n")
    print(
        "| workload | rows a sample | writer CPU a sample | a row | step, run directory | "
        "step, recording sink | plain step |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in args.workload:
        print(f"... {name}", file=sys.stderr, flush=True)
        got = measure(name, args.steps, args.every)
        print(
            f"| {name} | {got['rows']:.0f} | {got['sample_ms']:.2f} ms | {got['row_us']:.2f} µs | "
            f"{got['step_ms']:.2f} ms | {got['recording_ms']:.2f} ms | {got['plain_ms']:.2f} ms |",
            flush=True,
        )


if __name__ == "__main__":
    main()
