"""``result.json``: per layer, call, signal, tensor and metric, the aggregates of a whole run.

Every selected layer is listed, in execution order (layers that never ran follow in model order),
each with its measurements; the statistics of each metric are those of ``_aggregate``. Strict
JSON: a number that is not finite is written as null.

``status`` is one of ``RunStatus`` (see ``_state``). ``lost`` counts the samples and rows that
never reached the history, with the distinct reasons (``{"samples": 0, "rows": 0, "reasons":
[]}`` when nothing was lost); after a crash the samples that were still in memory are unknown,
so a recovered run says ``null`` for the counts. The aggregates describe exactly the rows of
``history.parquet``.
``samples`` totals the forward samples, ``step_records`` the optimizer steps' records, and
``signals`` says which kind each signal's rows belong to (a step record's measurements are under
the module owning the parameter, with ``tensor_path`` the parameter's name).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from torchinstruments_core.run_directory._aggregate import Key, RunAggregates
from torchinstruments_core.run_directory._atomic import atomic_write_text
from torchinstruments_core.run_directory._signal_docs import signal_entries

if TYPE_CHECKING:
    from pathlib import Path

    from torchinstruments_core._records import RunInfo


def write_result(
    path: Path,
    run: RunInfo,
    aggregates: RunAggregates | None,
    *,
    status: str,
    lost: dict[str, Any] | None = None,
) -> None:
    """Write ``result.json``; without ``aggregates`` the layers have no measurements yet."""
    document = {
        "run_id": run.run_id,
        "rank": run.rank,
        "world_size": run.world_size,
        "rank_policy": run.rank_policy,
        "status": status,
        "lost": lost or {"samples": 0, "rows": 0, "reasons": []},
        "model_class": run.model_class,
        "sampling_policy": run.sampling_policy,
        "metrics": list(run.metrics),
        "samples": aggregates.sample_summary() if aggregates else RunAggregates().sample_summary(),
        **_records(aggregates or RunAggregates()),
        "layers": _layers(run, aggregates.summaries() if aggregates else {}),
    }
    atomic_write_text(path, json.dumps(_finite(document), indent=2, allow_nan=False) + "\n")


def _records(aggregates: RunAggregates) -> dict[str, Any]:
    return {"step_records": aggregates.step_record_summary(), "signals": signal_entries()}


def _layers(run: RunInfo, metrics: dict[Key, dict[str, Any]]) -> list[dict[str, Any]]:
    catalog = {layer.name: layer for layer in run.layers}
    order = list(dict.fromkeys(key[0] for key in metrics if key[0] in catalog))
    order += [name for name in catalog if name not in order]
    grouped: dict[str, dict[tuple[int, str, str], dict[str, Any]]] = {name: {} for name in order}
    for (layer, call, signal, path, metric), summary in metrics.items():
        if layer in grouped:
            grouped[layer].setdefault((call, signal, path), {})[metric] = summary
    return [_layer(catalog[name], grouped[name]) for name in order]


def _layer(info: Any, tensors: dict[tuple[int, str, str], dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": info.name,
        "type": info.type_name,
        "parameters": info.parameter_count,
        "histogram": info.histogram,
        "measurements": [
            {"call_index": call, "signal": signal, "tensor_path": path, "metrics": metrics}
            for (call, signal, path), metrics in tensors.items()
        ],
    }


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value
