"""``index.md``: what a person or an LLM needs to read a run without the code.

The Polars queries it lists are ``QUERIES``; the test suite runs each of them against a real run,
so the index never shows a query that does not work.
"""

from __future__ import annotations

import platform
import time
from typing import TYPE_CHECKING, Any

from torchinstruments_core._records import UnavailableReason
from torchinstruments_core.run_directory._atomic import atomic_write_text
from torchinstruments_core.run_directory._escape import escape_text, markdown_cell, markdown_code
from torchinstruments_core.run_directory._signal_docs import (
    signal_meaning,
    signals_section,
    tensor_path_meaning,
)
from torchinstruments_core.run_directory._tables import (
    HISTORY_COLUMNS,
    SAMPLES_COLUMNS,
    dtype_text,
)

if TYPE_CHECKING:
    from pathlib import Path

    from torchinstruments_core._records import RunInfo
    from torchinstruments_core.run_directory._aggregate import RunAggregates

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

_SAMPLE_MEANINGS = {
    "run_id": "which run",
    "rank": "which process (global rank)",
    "sample_id": "the sample or step record, as in history.parquet",
    "step": "the trainer step of the record (null without a trainer)",
    "optimizer_step": "the adapter's own count of optimizer steps, where `step` follows the "
    "user's logged numbering instead (Accelerate); null otherwise",
    "timestamp": "when the sample's root forward began (UTC)",
    "forward_only": "true when no backward reached the sample (no `output_gradient` rows)",
    "collection_duration_ms": "host time spent observing the sample; the first sample also pays "
    "one-time warm-up, so quote the median (result.json `samples.collection_duration_ms`)",
    "rows": "how many rows of history.parquet the sample has",
    "kind": "`forward` for a sample (a root forward and its backward), `step` for a step record "
    "(rows of one optimizer step: see Signals)",
    "note": "why a step record has no rows: `optimizer_step_skipped` when no watched optimizer "
    "stepped in a sampled trainer step (the fp16 GradScaler skipped it: inf or NaN gradients); "
    "null otherwise, and absent in runs written before it existed",
}

_STATUSES = """\
`running`: being written (read the chunks in `history.parts/`), or the process died before
finalizing; `complete`: finalized, every sample is in `history.parquet`; `complete_with_losses`:
finalized, `lost` in result.json counts the samples and rows that were not written and why;
`needs_repair`: finalizing failed (e.g. a full disk), the chunks are intact; `recovered`:
completed by `python -m torchinstruments_core.run_directory repair` after a crash or a kill."""

_METRICS = """\
Statistics describe the finite entries of a tensor; the two fractions describe the whole tensor.
`mean`, `std` (population), `min`, `max`, `rms`, `max_abs`, `l2_norm` (`sqrt(sum(x**2))`, what
`clip_grad_norm_` reports for one tensor); `p25`, `p50`, `p75` (exact up to 8,192 entries;
from a uniform random subsample of 8,192 entries for larger tensors: rank error below 0.030 with
probability above 0.999999, typically 0.005);
`zero_fraction`, `nonfinite_fraction` (NaN and ±Inf).
`max_abs / rms` large means outlier-dominated ranges (int8/fp8 quantization risk).
Opt-in (`precision_reducers()`): `kurtosis` (excess, 0 for a normal distribution) and, for
`bf16`, `fp16`, `fp8_e4m3`, `fp8_e5m2`, `<format>_overflow_fraction` (finite entries beyond the
format's largest finite value) and `<format>_underflow_fraction` (non-zero entries below its
smallest subnormal), over all entries.
Step records add: `update_to_weight` on `update` rows (rms(update) / rms(parameter before the
step)); `gradient_rms_ratio` on Adam-family `<name>.exp_avg_sq` rows (rms(g / sqrt(v_hat)), v_hat
the bias-corrected second moment, floored at eps**2); on the whole-model rows (`layer` `<model>`,
`tensor_path` `*`): `parameter_gradient` `l2_norm` (clip_grad_norm_'s total norm over the model's
parameters the optimizer steps), `nonfinite_count` and `zero_count` (entries), and `update`
`l2_norm` (over the observed parameters)."""

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


def write_index(
    path: Path,
    run: RunInfo,
    *,
    status: str,
    aggregates: RunAggregates | None = None,
    lost: dict[str, Any] | None = None,
) -> None:
    """Write ``index.md`` for ``run`` (with the sample totals and losses once it is finished)."""
    atomic_write_text(path, render_index(run, status=status, aggregates=aggregates, lost=lost))


def render_index(
    run: RunInfo,
    *,
    status: str,
    aggregates: RunAggregates | None = None,
    lost: dict[str, Any] | None = None,
) -> str:
    """The text of ``index.md``. Every name from the model or the user is escaped."""
    header = _header(run, status) + _totals(aggregates) + _lost(lost)
    parts = [header, "## Status\n\n" + _STATUSES, _files(), _schema(), _samples_schema()]
    parts += [signals_section(), "## Metrics\n\n" + _METRICS, _catalog(run), _queries()]
    return "\n\n".join(parts) + "\n"


def _header(run: RunInfo, status: str) -> str:
    import torch

    from torchinstruments_core import __version__

    return "\n".join(
        [
            f"# Telemetry run {markdown_code(run.run_id)}",
            "",
            f"- status: {escape_text(status)}",
            f"- model: {markdown_code(run.model_class)}, {len(run.layers)} observed modules",
            f"- rank {run.rank} of {run.world_size} (rank_policy {markdown_code(run.rank_policy)})",
            f"- sampling: {escape_text(run.sampling_policy)}",
            f"- written: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            f"- versions: torchinstruments-suite {__version__}, torch {torch.__version__}, "
            f"Python {platform.python_version()}",
        ]
    )


def _totals(aggregates: RunAggregates | None) -> str:
    if aggregates is None or not aggregates.samples:
        return ""
    duration = aggregates.sample_summary()["collection_duration_ms"]
    return (
        f"\n- samples: {aggregates.samples} ({aggregates.forward_only} forward-only); "
        f"collection time per sample: median {duration['median']:.3g} ms, "
        f"mean {duration['mean']:.3g} ms, max {duration['max']:.3g} ms (the first sample "
        "includes one-time warm-up, which the mean carries and the median does not)"
    )


def _lost(lost: dict[str, Any] | None) -> str:
    if not lost or not (lost.get("samples") or lost.get("rows") or lost.get("reasons")):
        return ""
    counts = (
        f"{lost['samples']} samples ({lost['rows']} rows)"
        if lost.get("samples") is not None
        else "an unknown number of samples"
    )
    reasons = "; ".join(escape_text(str(reason)) for reason in lost.get("reasons", []))
    return f"\n- lost: {counts}: {reasons}"


def _files() -> str:
    return """## Files

| file | what it holds |
|---|---|
| `history.parquet` | the long table: one row per scalar (schema below) |
| `samples.parquet` | a row per record, a `forward` sample or a `step` record (schema below) |
| `history.parts/` | the same data in immutable chunks while the run is going (removed at the end) |
| `result.json` | aggregates per layer, call, signal, tensor and metric over the whole run |
| `tensorboard/` | focus histograms (left out when a trainer's TensorBoard logger takes them) |"""


def _schema() -> str:
    lines = ["## Schema of history.parquet", "", "| column | dtype | meaning |", "|---|---|---|"]
    for name, dtype in HISTORY_COLUMNS.items():
        lines.append(f"| `{name}` | {dtype_text(dtype)} | {_MEANINGS[name]} |")
    return "\n".join(lines)


def _samples_schema() -> str:
    lines = ["## Schema of samples.parquet", "", "| column | dtype | meaning |", "|---|---|---|"]
    for name, dtype in SAMPLES_COLUMNS.items():
        lines.append(f"| `{name}` | {dtype_text(dtype)} | {_SAMPLE_MEANINGS.get(name, '')} |")
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
        name, kind = markdown_cell(layer.name), markdown_cell(layer.type_name, code=False)
        lines.append(f"| {name} | {kind} | {layer.parameter_count:,} | {mark} |")
    return "\n".join(lines)


def _queries() -> str:
    blocks = ["## Ready queries", "", "Run from this folder (`pip install polars`).", ""]
    blocks += ["```python", QUERY_PRELUDE, "```"]
    for title, code in QUERIES:
        blocks += ["", f"### {title}", "", "```python", code, "```"]
    return "\n".join(blocks)
