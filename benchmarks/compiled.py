"""A ``torch.compile``d model, observed: graphs, graph breaks, recompiles and step times.

    uv run python benchmarks/compiled.py [--workload transformer] [--backend inductor] [--steps 12]

Configurations of the same workload, each in its own process: the compiled model alone;
``inject_observer(torch.compile(model))`` (the observer on the compiled module), never sampling
and sampling every other step; and ``torch.compile(model)`` after ``inject_observer(model)``
(the observer's root hooks inside the compiled code), sampling every other step. Steps are driven
through ``begin_step``, as the trainer adapters drive them. Reported per configuration: graphs
compiled, graph breaks (dynamo's counters), graphs compiled after the first two steps
(recompiles caused by sampling), and the median unsampled and sampled step (wall time) against
the compiled model's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _overhead_workloads import WORKLOADS, build

CONFIGURATIONS = {
    "compiled": "`torch.compile(model)`, no observer",
    "observe-compiled-never": "`inject_observer(torch.compile(model))`, never sampling",
    "observe-compiled": "`inject_observer(torch.compile(model))`, every other step",
    "compile-observed": "`inject_observer(model)`, then `torch.compile(model)`, every other step",
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
    workload.model = torch.compile(workload.model, backend=args.backend)  # type: ignore[assignment]
    if configuration.startswith("observe-compiled"):
        observer = inject_observer(workload.model, output_dir=folder / configuration)
    graphs_after_warmup = 0
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(args.steps):
        sampled = observer is not None and step % 2 == 0 and not configuration.endswith("never")
        started = time.perf_counter()
        if observer is not None:
            observer.begin_step(step, sample=sampled)
        workload.step()
        if observer is not None:
            observer.end_step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        if step >= 2:
            times[sampled].append(time.perf_counter() - started)
        if step == 1:
            graphs_after_warmup = counters["stats"]["unique_graphs"]
    if observer is not None:
        observer.remove()
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "recompiled": counters["stats"]["unique_graphs"] - graphs_after_warmup,
        "unsampled": statistics.median(times[False]) * 1000,
        "sampled": statistics.median(times[True]) * 1000 if times[True] else math.nan,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="transformer", choices=sorted(WORKLOADS))
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", choices=sorted(CONFIGURATIONS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child is not None:  # one configuration, in a fresh process
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(_run(args.child, args, Path(folder))))
        return
    results = {}
    for name in CONFIGURATIONS:
        child = [sys.executable, __file__, "--child", name, *sys.argv[1:]]
        output = subprocess.run(child, check=True, capture_output=True, text=True).stdout
        results[name] = json.loads(output.strip().splitlines()[-1])
        print(f"{name}: done", file=sys.stderr)
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
        sampled = "-" if math.isnan(result["sampled"]) else f"{result['sampled']:.1f}"
        print(
            f"| {CONFIGURATIONS[name]} | {result['graphs']:.0f} | {result['breaks']:.0f} "
            f"| {result['recompiled']:.0f} | {unsampled} | {sampled} |"
        )


if __name__ == "__main__":
    main()
