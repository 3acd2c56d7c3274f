"""What the kernels' queue gains by lingering for its next job: two queues side by side.

    uv run python benchmarks/queue_linger.py [--workload mnist-mlp] [--rounds 300]
        [--warmup-seconds 3]

A small sample's tensors go to the kernels' queue (``_native_worker``), whose thread sleeps when
it has no job; a job that finds it asleep wakes it, which costs the hook a futex wake and, on a
virtual machine, the interrupt that reaches the other processor. After each job the thread
therefore lingers (0.5 ms by default), looking for the next one every 50 us, asleep in between.
Three copies of a workload (same seed, weights and batches) live in one process: one plain, and
two observed with the default profile and a run directory, ``linger`` with the queue as it is
and ``wake`` with a queue whose thread sleeps at once after each job. Each round runs one step
of each in an order that rotates: the plain step, and for each observed copy an unsampled step,
a sampled one and the step after it. Reported: the median of each ratio to the plain step of
the same round, the median of the per-round difference, and how many jobs a sample had to wake
the thread for, after a warm-up of at least ``--warmup`` rounds and ``--warmup-seconds``
(``_warmup``). Then, on Linux, the processor time the queue's thread spends on one job and the
whole linger after it (``/proc``), which is what lingering costs the core it runs on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from _overhead_workloads import WORKLOADS, build
from _side_by_side import observed_steps, rotating_ratios
from _warmup import SECONDS

if TYPE_CHECKING:
    from torchinstruments_core import Observer

CONFIGURATIONS = ("linger", "wake")
_SEQUENCE = (False, True, False)
"""Each observed copy's steps in a round: unsampled, sampled, and the step after it."""


def _thread_cpu_per_job(jobs: int = 100) -> float | None:
    """Microseconds of the queue thread's processor time per job and its linger (Linux)."""
    from torchinstruments_core.reducers import _native

    if not Path("/proc/self/task").is_dir():
        return None
    before = set(os.listdir("/proc/self/task"))
    queue = _native.new_queue()
    values = torch.randn(1000)

    def run_one() -> None:
        shape = _native.profile_shape(0, None, 0)  # no quartiles, no histogram
        queued = _native.submit_profile(queue, values, None, shape)  # its buffers, held
        _native.queue_wait(queue, queued.ticket or 0)

    run_one()  # starts the thread
    (thread,) = set(os.listdir("/proc/self/task")) - before - {str(threading.get_native_id())}

    def used_ns() -> int:
        return int(Path(f"/proc/self/task/{thread}/schedstat").read_text().split()[0])

    time.sleep(0.05)
    started = used_ns()
    for _ in range(jobs):
        run_one()
        time.sleep(0.01)  # past the linger: each job's linger runs whole
    spent = used_ns() - started
    _native.queue_close(queue)
    return spent / jobs / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="mnist-mlp", choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10, help="rounds first, at the least")
    parser.add_argument(
        "--warmup-seconds", type=float, default=SECONDS, help="and at least this long"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from torchinstruments_core import inject_observer
    from torchinstruments_core._native_worker import NativeWorker

    if not NativeWorker.available():
        sys.exit("the compiled kernels have no queue here")
    device = torch.device("cpu")
    plain = build(args.workload, device)
    with tempfile.TemporaryDirectory() as folder:
        copies = {kind: build(args.workload, device) for kind in CONFIGURATIONS}
        observers: dict[str, Observer] = {
            kind: inject_observer(copies[kind].model, output_dir=Path(folder) / kind)
            for kind in copies
        }
        workers = {"linger": NativeWorker(), "wake": NativeWorker(linger_ns=0)}
        for kind, observer in observers.items():
            observer._config.measurer._native = workers[kind]
        runs = {kind: observed_steps(observers[kind], copies[kind], _SEQUENCE) for kind in copies}
        woken = dict.fromkeys(copies, 0)

        def warmed() -> None:  # the wakes of the measured rounds only
            woken.update({kind: workers[kind].wakes() for kind in copies})

        ratios = rotating_ratios(
            plain,
            runs,
            rounds=args.rounds,
            warmup=args.warmup,
            warmup_seconds=args.warmup_seconds,
            label=args.workload,
            warmed=warmed,
        )
        sampled = {kind: [sequence[1] for sequence in ratios[kind]] for kind in copies}
        after = {kind: [sequence[2] for sequence in ratios[kind]] for kind in copies}
        wakes = {kind: (workers[kind].wakes() - woken[kind]) / args.rounds for kind in copies}
        for observer in observers.values():
            observer.remove()
    print(f"\n{WORKLOADS[args.workload].description}; {args.rounds} rounds\n")
    print("| queue | sampled step | the step after it | wakes a sample |")
    print("|---|---|---|---|")
    for kind in copies:
        print(
            f"| {kind} | {statistics.median(sampled[kind]):.3f}x | "
            f"{statistics.median(after[kind]):.3f}x | {wakes[kind]:.1f} |"
        )
    difference = [a - b for a, b in zip(sampled["linger"], sampled["wake"], strict=True)]
    print(
        f"\nsampled step, linger minus wake, per round: median "
        f"{statistics.median(difference):+.3f}, mean {statistics.mean(difference):+.3f}"
    )
    cpu = _thread_cpu_per_job()
    if cpu is not None:
        print(f"the queue thread's processor time for a job and its whole linger: {cpu:.0f} us")


if __name__ == "__main__":
    main()
