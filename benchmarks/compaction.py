"""Compaction of a long run: time and peak memory of finalizing a run directory.

Writes the chunks of a synthetic run (default 10,000 samples x 100 layers x 2 signals x 11 metrics,
22 M rows) the way the background writer does, then measures, in a fresh process each, the
compaction of ``history.parts`` into ``history.parquet`` (polars streaming) and the online
aggregates behind ``result.json`` folded over every row of the run.

    uv run python benchmarks/compaction.py [--samples 10000] [--layers 100]

Prints a Markdown table: rows, chunks, seconds and peak RSS of each step, and the process's
baseline RSS after imports.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METRICS = (
    "mean",
    "std",
    "min",
    "max",
    "zero_fraction",
    "nonfinite_fraction",
    "rms",
    "max_abs",
    "p25",
    "p50",
    "p75",
)


def write_chunks(parts: Path, samples: int, layers: int, per_chunk: int) -> int:
    import numpy as np
    import polars as pl

    from torchinstruments_core.run_directory import history_schema

    parts.mkdir(parents=True)
    keys = pl.DataFrame(
        {
            "layer": [
                f"blocks.{i // 4}.layer{i % 4}"
                for i in range(layers)
                for _ in range(2 * len(METRICS))
            ],
            "signal": [
                s for _ in range(layers) for s in ("output", "output_gradient") for _ in METRICS
            ],
            "metric": [m for _ in range(layers) for _ in range(2) for m in METRICS],
        }
    )
    rng = np.random.default_rng(0)
    chunks = 0
    for start in range(0, samples, per_chunk):
        ids = pl.DataFrame({"sample_id": range(start, min(start + per_chunk, samples))})
        frame = ids.join(keys, how="cross")
        frame = frame.with_columns(
            run_id=pl.lit("bench"),
            rank=pl.lit(0, dtype=pl.Int32),
            step=pl.col("sample_id") * 10,
            timestamp=pl.lit(1_700_000_000_000_000).cast(pl.Datetime("us", "UTC")),
            call_index=pl.lit(0, dtype=pl.Int32),
            tensor_path=pl.lit("output"),
            value=pl.Series(rng.standard_normal(frame.height)),
            unavailable_reason=pl.lit(None, dtype=pl.String),
        ).select(list(history_schema()))
        frame.write_parquet(parts / f"history-{chunks:06d}.parquet")
        chunks += 1
    return chunks


def measure(step: str, root: Path) -> dict[str, float]:
    code = f"""
import json, resource, sys, time
from pathlib import Path
from torchinstruments_core import LayerInfo, RunInfo
from torchinstruments_core.run_directory import history_schema
from torchinstruments_core.run_directory.sink import compact
from torchinstruments_core.run_directory._result import write_result
root = Path({str(root)!r})
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
started = time.perf_counter()
if {step!r} == "compact":
    compact(root / "history.parts", "history", root / "history.parquet", history_schema())
else:
    import polars as pl
    from torchinstruments_core import SampleRecord, Signal, StatRow
    from torchinstruments_core.run_directory._aggregate import RunAggregates
    aggregates = RunAggregates()
    for part in sorted((root / "history.parts").glob("history-*.parquet")):
        frame = pl.read_parquet(part)
        for (sample_id,), rows in frame.group_by("sample_id", maintain_order=True):
            stat_rows = tuple(
                StatRow(r["layer"], r["call_index"], Signal(r["signal"]), r["tensor_path"], r["metric"], r["value"], None)
                for r in rows.iter_rows(named=True)
            )
            aggregates.add(SampleRecord("bench", 0, sample_id, None, 0.0, False, 1.0, stat_rows, ()))
    run = RunInfo("bench", 0, 1, "rank0", "Bench", "bench", (), ())
    write_result(root / "result.json", run, aggregates, status="complete")
seconds = time.perf_counter() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"seconds": seconds, "peak_mib": peak, "baseline_mib": baseline}}))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--per-chunk", type=int, default=100, help="samples per chunk")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        started = time.perf_counter()
        print(f"writing {args.samples} samples x {args.layers} layers ...", file=sys.stderr)
        chunks = write_chunks(root / "history.parts", args.samples, args.layers, args.per_chunk)
        print(f"wrote {chunks} chunks in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        rows = args.samples * args.layers * 2 * len(METRICS)
        size = sum(p.stat().st_size for p in (root / "history.parts").iterdir()) / 2**20
        results = {step: measure(step, root) for step in ("compact", "result")}
        print(f"\n{rows:,} rows in {chunks} chunks ({size:.0f} MiB of Parquet)\n")
        print("| step | seconds | peak RSS (MiB) | RSS after imports (MiB) |")
        print("|---|---|---|---|")
        labels = (
            ("compact", "compact history.parts -> history.parquet"),
            ("result", "fold every row into the result.json aggregates, write it"),
        )
        for step, label in labels:
            r = results[step]
            print(
                f"| {label} | {r['seconds']:.1f} | {r['peak_mib']:.0f} | {r['baseline_mib']:.0f} |"
            )
    print(
        f"\nmax RSS of this driver: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    )


if __name__ == "__main__":
    main()
