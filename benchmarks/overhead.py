"""Overhead of observing a training step: ours, PyPI torchinstruments and wandb.watch, side by side.

    uv run --with torchinstruments==0.10.2 python benchmarks/overhead.py [--workloads transformer]

(Without ``--with torchinstruments==0.10.2`` the PyPI rows are skipped with a note.) For each
workload (an MLP, a small CNN, the reference 4-layer ``nn.TransformerEncoder``; with
``--device cuda`` also a GPT-style model of 0.34 B parameters in bf16) every row is the same
training loop with different instrumentation: none, ours unsampled, ours sampling every step
(``RecordingSink`` and the run directory), ours every 10 steps, PyPI ``torchinstruments`` 0.10.2
every step and every 10 forwards, and ``wandb.watch(log="all")`` with ``log_freq`` 1 and 10.

Method: each (row, repeat) runs in a fresh process (``_overhead_child.py``), so that no hook,
thread, service process, allocator cache or imported module of one row can slow another, and
so that the peak-memory baseline is clean. Rows are interleaved (repeat 1 of every row, then
repeat 2 ...; the order rotates each repeat) so that drift of a shared machine hits every row
alike. Each child builds the workload from the same seeds (same initial weights, same batches),
runs one plain step (creating the AdamW state), takes the memory baseline, attaches, runs the
warm-up steps (never timed: first samples open files, wandb starts its service), then times a
window of ``--steps`` steps with ``time.perf_counter`` (synchronizing CUDA around it).

Reported: the step time of a repeat is the window's mean (total / steps), which for the
every-10-steps rows includes exactly one sampled step in ten, then the median over the repeats;
the ratio to the uninstrumented row; the spread over repeats; the CPU time per step of the
process's threads and its descendants (wandb's service), which shows work moved off the training
thread onto a spare core; the median sampled and unsampled step where the harness knows which
steps sample; the peak memory above the baseline (process RSS, or
``torch.cuda.max_memory_allocated`` on a GPU); the bytes the instrumentation wrote (after its
teardown); and the teardown time (compaction, ``run.finish()``), which is not in the step time.
A final loss that differs from the uninstrumented one is flagged under the table.

Cost: every row runs (warm-up + steps) x repeats steps, the slow rows included. On a 2-core
machine the transformer alone took 25 min with the defaults (PyPI every step: 8 s a step);
``--rows``, ``--repeats`` and ``--quick`` trim it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _overhead_rows import ROWS, Row, rows_by_key
from _overhead_workloads import WORKLOADS

CHILD = Path(__file__).with_name("_overhead_child.py")
MIB = 2**20
QUICK = {"steps": 10, "warmup": 10, "repeats": 1}


@dataclass(slots=True)
class RowResult:
    """Every repeat of one row of one workload, or why it did not run."""

    row: Row
    repeats: list[dict[str, Any]] = field(default_factory=list)
    skipped: str | None = None
    errors: list[str] = field(default_factory=list)

    def step_seconds(self) -> list[float]:
        """The window mean of each repeat."""
        return [r["window_s"] / len(r["step_times_s"]) for r in self.repeats]

    def median_step(self) -> float | None:
        """The median over repeats of the window mean."""
        values = self.step_seconds()
        return statistics.median(values) if values else None


# -- running children -----------------------------------------------------------------------


def run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter (the same one, so the same environment)."""
    with tempfile.TemporaryDirectory(prefix="overhead-result-") as folder:
        spec = spec | {"result": str(Path(folder) / "result.json")}
        try:
            done = subprocess.run(
                [sys.executable, str(CHILD), json.dumps(spec)],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if done.returncode != 0:
            lines = [x for x in done.stderr.strip().splitlines() if x.strip()]
            return {"error": f"exit {done.returncode}: {lines[-1] if lines else '?'}"}
        return json.loads(Path(spec["result"]).read_text())


def calibrate_steps(base: dict[str, Any], seconds: float, timeout: float) -> int:
    """Timed steps for about ``seconds`` of uninstrumented training, a multiple of 10."""
    probe = run_child(base | {"row": "baseline", "steps": 10}, timeout)
    if "error" in probe:
        raise SystemExit(f"the uninstrumented {base['workload']} failed: {probe['error']}")
    step = probe["window_s"] / 10
    return max(10, math.ceil(seconds / step / 10) * 10)


def skip_reason(row: Row) -> str | None:
    """Why a row cannot run in this environment, or ``None``."""
    if row.tool == "pypi" and importlib.util.find_spec("torchinstruments") is None:
        return (
            "PyPI torchinstruments is not importable: run the harness with "
            "`uv run --with torchinstruments==0.10.2 python benchmarks/overhead.py`"
        )
    if row.tool == "wandb" and importlib.util.find_spec("wandb") is None:
        return "wandb is not installed (`uv sync --extra wandb`)"
    return None


def run_workload(name: str, rows: list[Row], args: argparse.Namespace) -> dict[str, Any]:
    """Every repeat of every row of one workload, interleaved."""
    base = {"workload": name, "device": args.device, "threads": args.threads}
    base |= {"warmup": args.warmup, "profile": False}
    steps = args.steps or calibrate_steps(base, args.seconds, args.row_timeout)
    results = {row.key: RowResult(row, skipped=skip_reason(row)) for row in rows}
    runnable = [row for row in rows if results[row.key].skipped is None]
    for repeat in range(args.repeats):
        shift = repeat % len(runnable)
        for row in runnable[shift:] + runnable[:shift]:
            outcome = run_child(base | {"row": row.key, "steps": steps}, args.row_timeout)
            record(results[row.key], outcome, name, repeat, args.repeats)
    return {"name": name, "steps": steps, "results": results}


def record(result: RowResult, outcome: dict[str, Any], name: str, repeat: int, of: int) -> None:
    """Keep one repeat's outcome and say it on stderr."""
    where = f"[{name} {repeat + 1}/{of}] {result.row.key}"
    if "error" in outcome:
        result.errors.append(outcome["error"])
        print(f"{where}: {outcome['error']}", file=sys.stderr, flush=True)
        return
    result.repeats.append(outcome)
    mean_ms = 1000 * outcome["window_s"] / len(outcome["step_times_s"])
    print(f"{where}: {mean_ms:.1f} ms/step", file=sys.stderr, flush=True)


def run_profile(name: str, row: Row, args: argparse.Namespace, steps: int) -> dict[str, Any]:
    """One extra, cProfiled repeat of ``row`` (not in the table: profiling slows it down)."""
    spec = {"workload": name, "device": args.device, "threads": args.threads}
    spec |= {"warmup": args.warmup, "profile": True, "row": row.key, "steps": steps}
    return run_child(spec, args.row_timeout)


# -- the table ------------------------------------------------------------------------------


def human_bytes(count: float) -> str:
    """``1.2 MiB``, ``340 KiB``, ``0 B``."""
    for unit, size in (("GiB", 2**30), ("MiB", MIB), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


def split_steps(result: RowResult) -> str:
    """Median sampled / unsampled step in ms, over every repeat, where the harness knows."""
    parts = []
    for wanted in (True, False):
        times = [
            t
            for r in result.repeats
            for t, s in zip(r["step_times_s"], r["sampled"], strict=True)
            if s is wanted
        ]
        parts.append(f"{1000 * statistics.median(times):.1f}" if times else "-")
    return " / ".join(parts)


def row_notes(result: RowResult, baseline_loss: float | None) -> list[str]:
    """What the table cannot hold: skips, errors, in-memory output, side processes, losses."""
    notes = []
    if result.errors:
        notes.append(f"{len(result.errors)} repeat(s) failed: {result.errors[-1]}")
    last = result.repeats[-1] if result.repeats else {}
    if last.get("output_note"):
        notes.append(last["output_note"])
    service = last.get("child_processes_peak_rss_bytes", 0)
    if service:
        notes.append(f"plus {human_bytes(service)} peak RSS in child processes (wandb service)")
    losses = {r["final_loss"] for r in result.repeats}
    if baseline_loss is not None and losses and losses != {baseline_loss}:
        notes.append(f"final loss {sorted(losses)} differs from uninstrumented {baseline_loss}")
    return notes


def table_row(result: RowResult, baseline: float | None, device: str) -> str:
    """One Markdown line of the table."""
    label = result.row.label
    median = result.median_step()
    if median is None:
        why = "skipped" if result.skipped else "failed"
        return f"| {label} | {why} | | | | | | | |"
    steps = result.step_seconds()
    ratio = f"{median / baseline:.2f}x" if baseline else "-"
    spread = f"{1000 * min(steps):.1f}-{1000 * max(steps):.1f}"
    cpu = statistics.median(r["cpu_s"] / len(r["step_times_s"]) for r in result.repeats)
    split = split_steps(result) if device == "cpu" else "-"
    memory = statistics.median(r["peak_delta_bytes"] for r in result.repeats) / MIB
    written = human_bytes(statistics.median(r["output_bytes"] for r in result.repeats))
    teardown = statistics.median(r["teardown_s"] for r in result.repeats)
    return (
        f"| {label} | {1000 * median:.1f} | {ratio} | {spread} | {1000 * cpu:.1f} | {split} "
        f"| {memory:.1f} "
        f"| {written} | {teardown:.2f} |"
    )


def workload_table(run: dict[str, Any], args: argparse.Namespace) -> str:
    """The Markdown section of one workload: heading, method line, table, notes."""
    results: dict[str, RowResult] = run["results"]
    baseline_result = results.get("baseline")
    baseline = baseline_result.median_step() if baseline_result else None
    base_loss = (
        baseline_result.repeats[0]["final_loss"]
        if baseline_result and baseline_result.repeats
        else None
    )
    any_repeat = next((r.repeats[0] for r in results.values() if r.repeats), {})
    spec = WORKLOADS[run["name"]]
    lines = [
        f"### {spec.name}: {spec.description}"
        + (f" ({any_repeat['parameters']:,} parameters)" if any_repeat else ""),
        "",
        f"{run['steps']} timed steps after {args.warmup} warm-up steps, {args.repeats} repeat(s), "
        f"device {args.device}, {args.threads} torch thread(s); memory: "
        f"{any_repeat.get('memory_kind', '-')} above the baseline.",
        "",
        "| configuration | step (ms) | vs uninstrumented | repeats min-max (ms) "
        "| CPU per step (ms) | sampled / unsampled step, median (ms) | peak memory delta (MiB) "
        "| output written | teardown (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [table_row(r, baseline, args.device) for r in results.values()]
    notes = [
        (r.row.label, n)
        for r in results.values()
        for n in ([r.skipped] if r.skipped else row_notes(r, base_loss))
    ]
    if notes:
        lines += ["", *(f"- {label}: {note}" for label, note in notes)]
    return "\n".join(lines)


def profile_section(name: str, row: Row, outcome: dict[str, Any]) -> str:
    """The cProfile top functions of one profiled repeat, as a Markdown section."""
    if "error" in outcome:
        return f"### cProfile of {name} / {row.label}: {outcome['error']}"
    own = outcome["profile_tottime"].strip()
    cumulative = outcome["profile_cumulative"].strip()
    return (
        f"### cProfile of {name} / {row.label}, {len(outcome['step_times_s'])} steps\n\n"
        f"By own time:\n\n```\n{own}\n```\n\n"
        f"The instrumentation's functions by cumulative time:\n\n```\n{cumulative}\n```"
    )


# -- the machine ----------------------------------------------------------------------------


def cpu_model() -> str:
    """The ``model name`` of ``/proc/cpuinfo``, else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version(name: str) -> str:
    """The installed version of a distribution, or ``not installed``."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_line(args: argparse.Namespace) -> str:
    """CPU, cores, memory, OS, Python, torch and the compared packages, on one line."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = f", GPU {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    return (
        f"Machine: {cpu_model()}, {cores} cores usable ({os.cpu_count()} online), "
        f"{memory:.1f} GiB RAM{gpu}, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__} with "
        f"{args.threads} thread(s); torchinstruments-suite {package_version('torchinstruments-suite')}, "
        f"torchinstruments (PyPI) {package_version('torchinstruments')}, "
        f"wandb {package_version('wandb')}, polars {package_version('polars')}"
    )


# -- the command line -----------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options; ``--quick`` overrides steps, warm-up and repeats."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=None, help="comma-separated: " + ",".join(WORKLOADS))
    parser.add_argument(
        "--rows", default=",".join(r.key for r in ROWS), help="comma-separated row keys"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: ~--seconds)")
    parser.add_argument(
        "--seconds", type=float, default=3.0, help="uninstrumented seconds per repeat"
    )
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps after attaching")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="10 steps, 10 warm-up, 1 repeat")
    parser.add_argument("--output", type=Path, default=None, help="also write the Markdown here")
    parser.add_argument("--row-timeout", type=float, default=900.0, help="seconds per child")
    parser.add_argument("--profile", default=None, help="also cProfile one repeat of this row key")
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    return check_args(args, parser)


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Refuse what cannot run, naming the option, the value and the choices."""
    default = "mlp,cnn,transformer" + (",gpt" if args.device == "cuda" else "")
    args.workloads = [w for w in (args.workloads or default).split(",") if w]
    for name in args.workloads:
        if name not in WORKLOADS:
            parser.error(f"--workloads: unknown {name!r}; choose from {', '.join(WORKLOADS)}")
        if WORKLOADS[name].cuda_only and args.device != "cuda":
            parser.error(f"--workloads: {name!r} needs --device cuda (a GPU)")
    known = rows_by_key()
    for key in args.rows.split(","):
        if key not in known:
            parser.error(f"--rows: unknown {key!r}; choose from {', '.join(known)}")
    args.rows = [known[key] for key in args.rows.split(",")]
    if args.profile is not None and args.profile not in known:
        parser.error(f"--profile: unknown {args.profile!r}; choose from {', '.join(known)}")
    if args.steps is not None and (args.steps < 10 or args.steps % 10):
        parser.error(f"--steps: {args.steps} is not a positive multiple of 10 (every-10 rows)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: CUDA is not available on this machine")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    sections = [machine_line(args)]
    for name in args.workloads:
        run = run_workload(name, args.rows, args)
        sections.append(workload_table(run, args))
        print("\n" + sections[-1] + "\n", flush=True)
        if args.profile:
            row = rows_by_key()[args.profile]
            sections.append(profile_section(name, row, run_profile(name, row, args, run["steps"])))
    sections.append(f"Total wall time: {time.perf_counter() - started:.0f} s.")
    text = "\n\n".join(sections) + "\n"
    print("\n" + text)
    if args.output is not None:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
