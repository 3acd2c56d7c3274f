"""How ``index.md`` and ``result.json`` describe the signals and the two kinds of record.

Everything here is derived from the ``Signal`` definition, so a new signal is documented in every
run directory without an edit here.
"""

from __future__ import annotations

from typing import Any

from torchinstruments_core._signals import RecordKind, Signal, signals_of

RECORD_KINDS = {
    RecordKind.FORWARD: "a sample, one root forward and the backward through its graph",
    RecordKind.STEP: "a step record, one sampled optimizer step",
}


def signal_entries() -> list[dict[str, Any]]:
    """The signals as ``result.json`` lists them: name, record kind, tensor root, description."""
    return [
        {
            "name": signal.value,
            "kind": signal.kind.value,
            "gradient_of": signal.gradient_of.value if signal.gradient_of else None,
            "tensor_root": signal.tensor_root,
            "describes": signal.describes,
        }
        for signal in Signal
    ]


def signal_meaning() -> str:
    """The meaning of the ``signal`` column: its values, by record kind."""
    parts = [
        f"{', '.join(f'`{s}`' for s in signals_of(kind))} ({kind.value} records)"
        for kind in RecordKind
        if signals_of(kind)
    ]
    return "what the tensor is, see Signals: " + "; ".join(parts)


def tensor_path_meaning() -> str:
    """The meaning of the ``tensor_path`` column, from the signals' tensor-path roots."""
    roots = sorted({s.tensor_root for s in Signal if s.tensor_root is not None})
    examples = ", ".join(f"`{root}`, `{root}.0`, `{root}.logits`" for root in roots)
    text = f"where the tensor sits under its signal's root: {examples}"
    if any(s.kind is RecordKind.STEP and s.tensor_root is None for s in Signal):
        text += "; in a step record, the parameter's name within its module (`weight`)"
    for signal in Signal:
        if signal.spec.paths:
            text += f"; for `{signal}`, " + " or ".join(f"`{p}`" for p in signal.spec.paths)
    return text


def signals_section() -> str:
    """The ``## Signals`` section of ``index.md``."""
    lines = [
        "## Signals",
        "",
        "Every id in `sample_id` is one record, of one of two kinds (`samples.parquet`'s `kind`):",
        "",
        *(f"- `{kind.value}`: {text}" for kind, text in RECORD_KINDS.items()),
        "",
        "Both kinds take their ids from one sequence and sit in the same long table. In a step",
        "record `layer` is the module owning the parameter, `tensor_path` the parameter's name and",
        "`call_index` 0. A run written before the `kind` column existed holds samples only.",
        "",
        "| signal | record | gradient of | tensor_path | what it is |",
        "|---|---|---|---|---|",
    ]
    for signal in Signal:
        gradient_of = f"`{signal.gradient_of}`" if signal.gradient_of else ""
        root = _paths_cell(signal)
        lines.append(
            f"| `{signal}` | {signal.kind.value} | {gradient_of} | {root} | {signal.describes} |"
        )
    return "\n".join(lines)


def _paths_cell(signal: Signal) -> str:
    """The ``tensor_path`` cell of a signal's row in the table of signals."""
    if signal.spec.paths:
        return ", ".join(f"`{path}`" for path in signal.spec.paths)
    root = signal.tensor_root
    return f"`{root}`, `{root}.<key>`" if root else "the parameter's name"
