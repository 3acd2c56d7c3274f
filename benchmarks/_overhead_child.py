"""One measurement of ``overhead.py``, in a fresh process: one row of one workload, one repeat.

    python benchmarks/_overhead_child.py '<json spec>'

Builds the workload (fixed seeds), runs one plain step so that the optimizer state exists, takes
the memory baseline, attaches the row's instrumentation, runs the warm-up steps (untimed: the first
sample opens files, wandb starts its service), then times the window of steps and writes a JSON
result to ``spec["result"]``. The instrumentation's teardown (compaction, ``run.finish()``) is
timed separately and not counted in the step time.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from _overhead_rows import make_instrument, rows_by_key
from _overhead_workloads import Workload, build, parameter_count

if TYPE_CHECKING:
    from collections.abc import Iterator

    from _overhead_rows import Instrument


def proc_status_kib(field: str, pid: int | str = "self") -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``), or ``None``."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class MemoryProbe:
    """Peak memory above a baseline: CUDA allocator on a GPU, process RSS on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
            self.kind = "torch.cuda.max_memory_allocated"
        else:
            self.baseline = (proc_status_kib("VmRSS") or 0) * 1024
            self.kind = "RSS (VmHWM after reset)" if reset_peak_rss() else "RSS (ru_maxrss)"

    def peak_delta(self) -> int:
        """Bytes of the peak since the baseline, above the baseline."""
        if self.cuda:
            return torch.cuda.max_memory_allocated() - self.baseline
        if self.kind.endswith("(ru_maxrss)"):
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        else:
            peak = (proc_status_kib("VmHWM") or 0) * 1024
        return peak - self.baseline


def child_processes_peak_rss() -> int:
    """Summed peak RSS of this process's descendants (wandb's service), in bytes."""
    try:
        import psutil
    except ImportError:
        return 0
    children = psutil.Process().children(recursive=True)
    return sum((proc_status_kib("VmHWM", child.pid) or 0) * 1024 for child in children)


def cpu_seconds() -> float:
    """CPU time of this process (every thread) and of its living descendants (wandb's service)."""
    own = os.times()
    total = own.user + own.system
    try:
        import psutil
    except ImportError:
        return total
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
    return total


def folder_bytes(folder: Path) -> int:
    """Bytes of every file below ``folder``."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, or else ``perf_counter`` would time only the launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(workload: Workload, instrument: Instrument, step: int) -> torch.Tensor:
    """One training step with the instrumentation told where it begins and ends."""
    instrument.begin(step)
    loss = workload.step()
    instrument.end(step, loss)
    return loss


@contextlib.contextmanager
def profiled(enabled: bool, report: dict[str, Any]) -> Iterator[None]:
    """cProfile the block when ``enabled``; put the top functions into ``report``."""
    if not enabled:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        # Own time over everything; cumulative time of the instrumentation's own functions.
        for key, restrictions in (("tottime", ()), ("cumulative", ("torchinstruments|wandb",))):
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text).sort_stats(key)
            stats.print_stats(*restrictions, 15)
            report[f"profile_{key}"] = text.getvalue()


def timed_window(
    workload: Workload, instrument: Instrument, spec: dict[str, Any], device: torch.device
) -> dict[str, Any]:
    """Time ``spec["steps"]`` steps after the warm-up; per-step times and the window's total."""
    first = spec["warmup"]
    times: list[float] = []
    report: dict[str, Any] = {}
    synchronize(device)
    with profiled(bool(spec.get("profile")), report):
        cpu_started, started = cpu_seconds(), time.perf_counter()
        for step in range(first, first + spec["steps"]):
            begun = time.perf_counter()
            loss = run_step(workload, instrument, step)
            times.append(time.perf_counter() - begun)
        synchronize(device)
        window = time.perf_counter() - started
        cpu = cpu_seconds() - cpu_started
    report |= {
        "window_s": window,
        "cpu_s": cpu,
        "step_times_s": times,
        "sampled": [instrument.sampled(s) for s in range(first, first + spec["steps"])],
        "final_loss": float(loss),
    }
    return report


def measure(spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Build, attach, warm up, time and tear down one row; the result as a JSON-able dict."""
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    workload = build(spec["workload"], device)
    workload.step()  # creates the AdamW state before the memory baseline, in every row alike
    memory = MemoryProbe(device)
    instrument = make_instrument(rows_by_key()[spec["row"]])
    instrument.attach(workload.model, folder)
    for step in range(spec["warmup"]):
        run_step(workload, instrument, step)
    result = timed_window(workload, instrument, spec, device)
    result |= {"peak_delta_bytes": memory.peak_delta(), "memory_kind": memory.kind}
    result["child_processes_peak_rss_bytes"] = child_processes_peak_rss()
    started = time.perf_counter()
    instrument.teardown()
    result["teardown_s"] = time.perf_counter() - started
    result["output_bytes"] = folder_bytes(folder)
    result["output_note"] = instrument.output_note()
    result["parameters"] = parameter_count(workload.model)
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    with tempfile.TemporaryDirectory(prefix="overhead-") as folder:
        result = measure(spec, Path(folder))
    Path(spec["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
