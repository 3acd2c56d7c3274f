"""A ``torch.compile``d model, observed: graphs, graph breaks, recompiles and step times.

    uv run python benchmarks/compiled.py [--workload transformer] [--backend inductor] [--steps 12]

Three configurations of the same workload, each in a fresh dynamo state: the compiled model
alone; ``inject_observer(torch.compile(model))`` (the observer on the compiled module); and
``torch.compile(model)`` after ``inject_observer(model)`` (the observer's root hooks inside the
compiled code). Steps alternate between sampled and unsampled through ``begin_step``, as the
trainer adapters drive it. Reported per configuration: graphs compiled, graph breaks (dynamo's
counters), graphs compiled after the first two steps (recompiles caused by sampling), and the
median unsampled and sampled step (CPU time of the training thread) against the compiled model's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _overhead_workloads import WORKLOADS, build

CONFIGURATIONS = {
    "compiled": "torch.compile(model), no observer",
    "observe-compiled": "inject_observer(torch.compile(model))",
    "compile-observed": "inject_observer(model), then torch.compile(model)",
}


def _run(configuration: str, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    from torch._dynamo.utils import counters

    from torchinstruments_core import inject_observer

    torch._dynamo.reset()
    counters.clear()
    workload = build(args.workload, torch.device(args.device))
    observer = None
    if configuration == "compile-observed":
        observer = inject_observer(workload.model, output_dir=folder / configuration)
    workload.model = torch.compile(workload.model, backend=args.backend)
    if configuration == "observe-compiled":
        observer = inject_observer(workload.model, output_dir=folder / configuration)
    graphs_after_warmup = 0
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(args.steps):
        sampled = step % 2 == 0
        started = time.thread_time()
        if observer is not None:
            observer.begin_step(step, sample=sampled)
        workload.step()
        if observer is not None:
            observer.end_step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        if step >= 2:
            times[sampled].append(time.thread_time() - started)
        if step == 1:
            graphs_after_warmup = counters["stats"]["unique_graphs"]
        print(f"{configuration}: step {step + 1}/{args.steps}", file=sys.stderr, end="\r")
    if observer is not None:
        observer.remove()
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "recompiled": counters["stats"]["unique_graphs"] - graphs_after_warmup,
        "unsampled": statistics.median(times[False]) * 1000,
        "sampled": statistics.median(times[True]) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="transformer", choices=sorted(WORKLOADS))
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        results = {name: _run(name, args, Path(folder)) for name in CONFIGURATIONS}
    print(file=sys.stderr)
    print(f"{WORKLOADS[args.workload].description}; backend {args.backend}, {args.device}")
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.steps} steps\n")
    print(
        "| configuration | graphs | graph breaks | graphs compiled after step 2 "
        "| unsampled step (ms) | sampled step (ms) |"
    )
    print("|---|---|---|---|---|---|")
    base = results["compiled"]["unsampled"]
    for name, result in results.items():
        unsampled = f"{result['unsampled']:.1f} ({result['unsampled'] / base:.2f}x)"
        sampled = "-" if name == "compiled" else f"{result['sampled']:.1f}"
        print(
            f"| {CONFIGURATIONS[name]} | {result['graphs']:.0f} | {result['breaks']:.0f} "
            f"| {result['recompiled']:.0f} | {unsampled} | {sampled} |"
        )


if __name__ == "__main__":
    main()
