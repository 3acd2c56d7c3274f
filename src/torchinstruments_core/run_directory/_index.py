"""``index.md``: what a person or an LLM needs to read a run without the code.

The Polars queries it lists are ``QUERIES``; the test suite runs each of them against a real run,
so the index never shows a query that does not work.
"""

from __future__ import annotations

import platform
import time
from typing import TYPE_CHECKING

from torchinstruments_core._records import UnavailableReason
from torchinstruments_core.run_directory._layout import atomic_write_text
from torchinstruments_core.run_directory._signal_docs import (
    signal_meaning,
    signals_section,
    tensor_path_meaning,
)
from torchinstruments_core.run_directory._tables import history_schema

if TYPE_CHECKING:
    from pathlib import Path

    from torchinstruments_core._records import RunInfo

_MEANINGS = {
    "run_id": "which run",
    "rank": "which process (global rank)",
    "sample_id": "the record (a sample or a step record, see Signals): 0, 1, 2 … within the run "
    "and rank",
    "step": "the trainer step of the record (null without a trainer)",
    "timestamp": "when the sample's root forward (or the step record) began (UTC)",
    "layer": "the module's name in the model, wrapper prefixes removed; `<root>` is the model",
    "call_index": "which call of the module within the sample (0 for the first)",
    "signal": signal_meaning(),
    "tensor_path": tensor_path_meaning(),
    "metric": "the statistic (see Metrics)",
    "value": "the statistic's value; null exactly when `unavailable_reason` is set",
    "unavailable_reason": "why there is no value: " + ", ".join(UnavailableReason),
}

_METRICS = """\
Statistics describe the finite entries of a tensor; the two fractions describe the whole tensor.
`mean`, `std` (population), `min`, `max`, `rms`, `max_abs`; `p25`, `p50`, `p75` (from a uniform
random subsample of 32,768 entries for larger tensors: rank error below 0.015 with probability
above 0.999999); `zero_fraction`, `nonfinite_fraction` (NaN and ±Inf).
`max_abs / rms` large means outlier-dominated ranges (int8/fp8 quantization risk)."""

QUERIES: tuple[tuple[str, str], ...] = (
    (
        "Where did non-finite values first appear?",
        """\
first_nonfinite = (
    history.filter((pl.col("metric") == "nonfinite_fraction") & (pl.col("value") > 0))
    .sort("sample_id")
    .group_by("layer", "signal", maintain_order=True)
    .agg(pl.col("sample_id").first(), pl.col("step").first(), fraction=pl.col("value").first())
    .collect()
)
print(first_nonfinite)""",
    ),
    (
        "Activation scale (std of outputs) per layer over the run",
        """\
scale = (
    history.filter((pl.col("signal") == "output") & (pl.col("metric") == "std"))
    .group_by("layer", maintain_order=True)
    .agg(first=pl.col("value").first(), last=pl.col("value").last(), max=pl.col("value").max())
    .collect()
)
print(scale)""",
    ),
    (
        "Outlier ratio max_abs / rms per layer (quantization risk), largest first",
        """\
outliers = (
    history.filter(pl.col("signal") == "output")
    .filter(pl.col("metric").is_in(["max_abs", "rms"]))
    .collect()
    .pivot(on="metric", index=["layer", "call_index", "tensor_path", "sample_id"], values="value")
    .group_by("layer")
    .agg(ratio=(pl.col("max_abs") / pl.col("rms")).max())
    .sort("ratio", descending=True, nulls_last=True)
)
print(outliers)""",
    ),
    (
        "Gradient rms per layer in the last sample with a backward",
        """\
gradient_rms = history.filter(
    (pl.col("signal") == "output_gradient") & (pl.col("metric") == "rms")
)
last = gradient_rms.select(pl.col("sample_id").max()).collect().item()
gradients = (
    gradient_rms.filter(pl.col("sample_id") == last)
    .select("layer", "call_index", "tensor_path", "value")
    .collect()
)
print(gradients)""",
    ),
    (
        "Records of each kind: forward samples and optimizer-step records",
        """\
kinds = (
    pl.scan_parquet("samples.parquet")
    .group_by("kind")
    .agg(records=pl.len(), first_id=pl.col("sample_id").min(), last_id=pl.col("sample_id").max())
    .collect()
)
print(kinds)""",
    ),
    (
        "Values that could not be computed, and why",
        """\
missing = (
    history.filter(pl.col("value").is_null())
    .group_by("layer", "signal", "unavailable_reason")
    .agg(rows=pl.len())
    .collect()
)
print(missing)""",
    ),
)

QUERY_PRELUDE = 'import polars as pl\n\nhistory = pl.scan_parquet("history.parquet")'


def write_index(path: Path, run: RunInfo, *, status: str) -> None:
    """Write ``index.md`` for ``run``."""
    atomic_write_text(path, render_index(run, status=status))


def render_index(run: RunInfo, *, status: str) -> str:
    """The text of ``index.md``."""
    parts = [_header(run, status), _files(), _schema(), signals_section()]
    parts += ["## Metrics\n\n" + _METRICS]
    parts += [_catalog(run), _queries()]
    return "\n\n".join(parts) + "\n"


def _header(run: RunInfo, status: str) -> str:
    import torch

    from torchinstruments_core import __version__

    return "\n".join(
        [
            f"# Telemetry run `{run.run_id}`",
            "",
            f"- status: {status}",
            f"- model: `{run.model_class}`, {len(run.layers)} observed modules",
            f"- rank {run.rank} of {run.world_size} (rank_policy `{run.rank_policy}`)",
            f"- sampling: {run.sampling_policy}",
            f"- written: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            f"- versions: torchinstruments-suite {__version__}, torch {torch.__version__}, "
            f"Python {platform.python_version()}",
        ]
    )


def _files() -> str:
    return """## Files

| file | what it holds |
|---|---|
| `history.parquet` | the long table: one row per scalar (schema below) |
| `samples.parquet` | a row per record: kind (`forward` sample or `step` record), step, \
optimizer_step, forward_only, collection_duration_ms |
| `history.parts/` | the same data in immutable chunks while the run is going (removed at the end) |
| `result.json` | aggregates per layer, call, signal, tensor and metric over the whole run |
| `tensorboard/` | histograms of the focus modules: `tensorboard --logdir tensorboard` |"""


def _schema() -> str:
    lines = ["## Schema of history.parquet", "", "| column | dtype | meaning |", "|---|---|---|"]
    for name, dtype in history_schema().items():
        lines.append(f"| `{name}` | {dtype} | {_MEANINGS[name]} |")
    return "\n".join(lines)


def _catalog(run: RunInfo) -> str:
    lines = [
        "## Observed modules",
        "",
        "| module | type | parameters | histogram |",
        "|---|---|---|---|",
    ]
    for layer in run.layers:
        mark = "yes" if layer.histogram else ""
        lines.append(f"| `{layer.name}` | {layer.type_name} | {layer.parameter_count:,} | {mark} |")
    return "\n".join(lines)


def _queries() -> str:
    blocks = ["## Ready queries", "", "Run from this folder (`pip install polars`).", ""]
    blocks += ["```python", QUERY_PRELUDE, "```"]
    for title, code in QUERIES:
        blocks += ["", f"### {title}", "", "```python", code, "```"]
    return "\n".join(blocks)
