"""Reading a long run: time and peak memory of ``summary``, ``first_nonfinite`` and ``find``.

Writes a synthetic finished run (default 10,000 samples x 100 layers x 2 signals x 11 metrics,
22 M rows, in ``history.parquet`` compacted by the core as at the end of a run) whose layers
from 50 on turn non-finite at nine tenths of the run, then measures in a fresh process each:
``open_run``, ``summary`` (every layer, the default signals and metrics), ``first_nonfinite``
and ``findings.find`` (every rule, default thresholds). The same for a shorter run (default
2,300 samples, 5 M rows): a peak that does not grow with the run is bounded memory.

    uv run python benchmarks/analysis.py [--samples 10000] [--short 2300] [--layers 100]

Prints a Markdown table: seconds and peak RSS (``VmHWM``, Linux) of each step, and the process's
peak after imports.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from compaction import METRICS

BROKEN_LAYER = 50


def write_run(root: Path, samples: int, layers: int, per_chunk: int = 100) -> None:
    import numpy as np
    import polars as pl

    from torchinstruments_core.run_directory import history_schema
    from torchinstruments_core.run_directory.sink import compact

    names = [f"blocks.{i // 4}.layer{i % 4}" for i in range(layers)]
    keys = pl.DataFrame(
        {
            "layer": [n for n in names for _ in range(2 * len(METRICS))],
            "signal": [s for _ in names for s in ("output", "output_gradient") for _ in METRICS],
            "metric": [m for _ in names for _ in range(2) for m in METRICS],
        }
    )
    broken_at = samples * 9 // 10
    rng = np.random.default_rng(0)
    parts = root / "history.parts"
    parts.mkdir(parents=True)
    for number, start in enumerate(range(0, samples, per_chunk)):
        ids = pl.DataFrame({"sample_id": range(start, min(start + per_chunk, samples))})
        frame = ids.join(keys, how="cross")
        broken = (pl.col("sample_id") >= broken_at) & pl.col("layer").is_in(names[BROKEN_LAYER:])
        fraction = pl.col("metric").str.ends_with("_fraction")
        value = pl.Series(np.abs(rng.standard_normal(frame.height)))
        frame = frame.with_columns(
            run_id=pl.lit("bench"),
            rank=pl.lit(0, dtype=pl.Int32),
            step=pl.col("sample_id") * 10,
            timestamp=pl.lit(1_700_000_000_000_000).cast(pl.Datetime("us", "UTC")),
            call_index=pl.lit(0, dtype=pl.Int32),
            tensor_path=pl.lit("output"),
            value=pl.when(broken & (pl.col("metric") == "nonfinite_fraction"))
            .then(1.0)
            .when(broken)
            .then(None)
            .when(fraction)
            .then(0.0)
            .otherwise(value),
            unavailable_reason=pl.when(broken & ~fraction).then(pl.lit("no_finite_values")),
        ).select(list(history_schema()))
        frame.write_parquet(parts / f"history-{number:06d}.parquet")
    compact(parts, "history", root / "history.parquet", history_schema())
    for chunk in parts.iterdir():
        chunk.unlink()
    parts.rmdir()
    result = {"status": "complete", "layers": [{"name": name} for name in names]}
    (root / "result.json").write_text(json.dumps(result))


def measure(step: str, root: Path) -> dict[str, float]:
    code = f"""
import json, time
from torchinstruments_analysis import first_nonfinite, open_run, summary

def peak_mib():
    # VmHWM belongs to this process image: ru_maxrss would keep the parent's peak across exec
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

import polars
baseline = peak_mib()
started = time.perf_counter()
run = open_run({str(root)!r})
if {step!r} == "summary":
    rows = summary(run).height
elif {step!r} == "first_nonfinite":
    rows = first_nonfinite(run).height
elif {step!r} == "find":
    from torchinstruments_analysis.findings import find
    rows = find(run).height
else:
    rows = len(run.layers)
seconds = time.perf_counter() - started
peak = peak_mib()
print(json.dumps({{"seconds": seconds, "peak_mib": peak, "baseline_mib": baseline, "rows": rows}}))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--short", type=int, default=2_300, help="samples of the shorter run")
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--keep", type=Path, help="write the runs under here (reused if there)")
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        base = arguments.keep or Path(folder)
        print("| run rows | step | seconds | peak RSS (MiB) | RSS after imports (MiB) | rows out |")
        print("|---|---|---|---|---|---|")
        for samples in (arguments.samples, arguments.short):
            root = base / f"run-{samples}x{arguments.layers}"
            if not root.exists():
                write_run(root, samples, arguments.layers)
            rows = _rows(root)
            for step in ("open_run", "summary", "first_nonfinite", "find"):
                m = measure(step, root)
                print(
                    f"| {rows / 1e6:.1f} M | `{step}` | {m['seconds']:.1f} | "
                    f"{m['peak_mib']:.0f} | {m['baseline_mib']:.0f} | {m['rows']:.0f} |"
                )


def _rows(root: Path) -> int:
    import polars as pl

    return int(pl.scan_parquet(root / "history.parquet").select(pl.len()).collect().item())


if __name__ == "__main__":
    main()
