"""A short per-layer table of a finished run, for the end of a training script."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from torchinstruments_core._signals import RecordKind, Signal, tensor_root_of
from torchinstruments_core.run_directory._read import scan_samples

if TYPE_CHECKING:
    from pathlib import Path

# The signals with a summary label, in definition order: a value signal shows its mean std and
# the outlier ratio, a gradient its mean rms; ``non-finite`` covers them all.
_SHOWN = tuple(signal for signal in Signal if signal.spec.summary_label)


def _headers() -> tuple[str, ...]:
    headers: list[str] = []
    for signal in _SHOWN:
        if signal.gradient_of is None:
            headers += [f"{signal.spec.summary_label} std", "max_abs/rms"]
        else:
            headers.append(f"{signal.spec.summary_label} rms")
    return (*headers, "non-finite")


_COLUMNS = _headers()


def summarize_run(folder: Path, *, max_layers: int = 40) -> str:
    """Per layer (first call, whole output): mean output std, outlier ratio, gradient rms.

    The first line says what the columns are: ``output std`` and ``grad rms`` are means over the
    run's samples, ``max_abs/rms`` the ratio of the two means, and ``non-finite`` the largest
    fraction of NaN/Inf seen in the layer's output or gradient. Names and types are never cut.
    The last line names the first sample and layer where non-finite values appeared, if any.

    Args:
        folder: A finished run directory (one holding ``result.json`` and ``history.parquet``).
        max_layers: Rows shown at most (the first ones in execution order).
    """
    result = json.loads((folder / "result.json").read_text())
    shown = result["layers"][:max_layers]
    widths = (
        max([len("layer"), *(len(layer["name"]) for layer in shown)]) + 2,
        max([len("type"), *(len(layer["type"]) for layer in shown)]) + 2,
    )
    count = result["samples"]["count"]
    lines = [
        f"per layer (first call, whole output): means over the run's {count} samples",
        "(max_abs/rms: the ratio of the two means; non-finite: the largest fraction seen)",
        f"{'layer':<{widths[0]}}{'type':<{widths[1]}}" + "".join(f"{c:>13}" for c in _COLUMNS),
    ]
    for layer in shown:
        lines.append(_row(layer, widths))
    if len(result["layers"]) > max_layers:
        lines.append(
            f"… {len(result['layers']) - max_layers} more layers in {folder / 'result.json'}"
        )
    lines.append(_first_nonfinite(folder))
    return "\n".join(lines)


def _row(layer: dict[str, Any], widths: tuple[int, int]) -> str:
    first = {
        m["signal"]: m["metrics"]
        for m in layer["measurements"]
        if m["call_index"] == 0 and m["tensor_path"] == tensor_root_of(m["signal"])
    }
    cells: list[float | None] = []
    worst: list[float | None] = []
    for signal in _SHOWN:
        metrics = first.get(signal.value, {})
        mean = {name: stats.get("mean") for name, stats in metrics.items()}
        if signal.gradient_of is None:
            cells += [mean.get("std"), _ratio(mean)]
        else:
            cells.append(mean.get("rms"))
        worst.append(metrics.get("nonfinite_fraction", {}).get("max"))
    cells.append(max((w for w in worst if w is not None), default=None))
    name, kind = layer["name"], layer["type"]
    return f"{name:<{widths[0]}}{kind:<{widths[1]}}" + "".join(_cell(c) for c in cells)


def _ratio(mean: dict[str, float | None]) -> float | None:
    max_abs, rms = mean.get("max_abs"), mean.get("rms")
    return max_abs / rms if max_abs is not None and rms else None


def _cell(value: float | None) -> str:
    return f"{value:>13.4g}" if value is not None else f"{'-':>13}"


def _first_nonfinite(folder: Path) -> str:
    import polars as pl

    first = (
        pl.scan_parquet(folder / "history.parquet")
        .filter((pl.col("metric") == "nonfinite_fraction") & (pl.col("value") > 0))
        .sort("sample_id")
        .select("sample_id", "step", "layer", "signal")
        .head(1)
        .collect()
    )
    if first.height == 0:
        return "no non-finite values in any sampled output or gradient"
    row = first.row(0, named=True)
    step = f" (step {row['step']})" if row["step"] is not None else ""
    return (
        f"first non-finite values: {_record(folder, row['sample_id'])} {row['sample_id']}{step}, "
        f"layer {row['layer']!r}, {row['signal']}"
    )


def _record(folder: Path, record_id: int) -> str:
    """``sample`` or ``step record``, as samples.parquet says (a run without kinds: sample)."""
    import polars as pl

    kinds = scan_samples(folder).filter(pl.col("sample_id") == record_id).select("kind").collect()
    kind = kinds.item(0, 0) if kinds.height else RecordKind.FORWARD.value
    return "step record" if kind == RecordKind.STEP else "sample"
