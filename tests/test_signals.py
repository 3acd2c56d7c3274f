"""Signals as data: one definition, from which routing, summaries, index.md and keys derive."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest
import torch

from helpers import mlp
from torchinstruments_core import (
    AlwaysSampler,
    ConfigurationError,
    LayerInfo,
    RecordKind,
    RunInfo,
    Signal,
    inject_observer,
)
from torchinstruments_core._signals import ALL_PARAMETERS, MODEL_LAYER, routed_by_default
from torchinstruments_core.routing import LoggerRouter, tensor_key
from torchinstruments_core.run_directory._index import render_index
from torchinstruments_core.run_directory._summary import _COLUMNS

SOURCE = pathlib.Path(__file__).parents[1] / "src"


class Recorder:
    """A logger target that keeps the scalar keys it was given."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def log(self, scalars: object, histograms: object, step: int) -> None:
        self.keys += [*scalars, *histograms]  # type: ignore[misc]


def _run() -> RunInfo:
    layers = (
        LayerInfo("encoder.0", "Linear", 12, True, ("weight", "bias")),
        LayerInfo("encoder.1", "Linear", 12, False, ("weight", "bias")),
    )
    return RunInfo("r", 0, 1, "rank0", "Net", "AlwaysSampler()", layers, ("rms",))


def test_stored_signal_names_never_change() -> None:
    """The strings in Parquet stay ``output``/``output_gradient``; lookups give the members."""
    assert (Signal.OUTPUT.value, Signal.OUTPUT_GRADIENT.value) == ("output", "output_gradient")
    assert Signal.OUTPUT_GRADIENT.gradient_of is Signal.OUTPUT
    assert Signal("output") is Signal.OUTPUT
    assert Signal("output_gradient") is Signal.OUTPUT_GRADIENT
    with pytest.raises(ValueError, match="not_a_signal"):
        Signal("not_a_signal")


def test_every_signal_is_fully_described() -> None:
    """Each signal has a sentence, a kind; a gradient shares its value's kind and tensor root."""
    for signal in Signal:
        assert signal.describes.endswith(".")
        assert isinstance(signal.kind, RecordKind)
        value = signal.gradient_of
        if value is not None:
            assert value.gradient is signal
            assert (value.kind, value.tensor_root) == (signal.kind, signal.tensor_root)
    assert Signal.OUTPUT.tensor_root == "output"
    assert Signal.PARAMETER.tensor_root is None


def test_signal_names_are_spelled_only_in_their_definition() -> None:
    """No source module but ``_signals.py`` holds a signal's name as a string of its own."""
    names = {signal.value for signal in Signal}
    found = []
    for path in SOURCE.rglob("*.py"):
        if path.name == "_signals.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        found += [
            f"{path.relative_to(SOURCE)}:{node.lineno} {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings
        ]
    assert found == []


def test_tensor_keys_omit_only_the_signal_root() -> None:
    """The whole output keeps the short key; a parameter is always named in its key."""
    assert tensor_key("a", 0, Signal.OUTPUT, "output") == "a/output"
    assert tensor_key("a", 0, Signal.OUTPUT_GRADIENT, "output.1") == "a/output_gradient/output.1"
    assert tensor_key("a", 0, Signal.PARAMETER, "weight") == "a/parameter/weight"
    assert tensor_key("a", 0, Signal.PARAMETER, "output") == "a/parameter/output"


def test_router_routes_the_default_signals_or_the_chosen_ones() -> None:
    """By default every routed signal; ``signals=`` narrows it; an unknown name fails at once."""
    assert LoggerRouter(()).signals == routed_by_default()
    assert {Signal.OUTPUT, Signal.OUTPUT_GRADIENT, Signal.PARAMETER_GRADIENT} <= set(
        routed_by_default()
    )
    assert Signal.PARAMETER not in routed_by_default()
    chosen, everything = Recorder(), Recorder()
    model = mlp()
    sink = LoggerRouter([chosen], signals=["output_gradient"], scalar_layers="all")
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        model(torch.randn(2, 4)).sum().backward()
    with inject_observer(model, sampler=AlwaysSampler(), sink=LoggerRouter([everything])):
        model(torch.randn(2, 4)).sum().backward()
    layer_keys = [k for k in chosen.keys if k.count("/") >= 3]
    assert layer_keys
    assert all("/output_gradient/" in k for k in layer_keys)
    assert any("/output/" in k for k in everything.keys)
    with pytest.raises(ConfigurationError, match=r"signals=\['grad'\].*'output_gradient'"):
        LoggerRouter((), signals=["grad"])


def test_documented_scalar_keys_cover_each_routed_signal() -> None:
    """``scalar_keys`` lists forward keys, then step keys, then the whole-model keys.

    Each focus layer's step keys name each parameter, with the metrics the signal's definition
    routes.
    """
    keys = LoggerRouter(()).scalar_keys(_run())
    assert keys[:2] == ["telemetry/nonfinite_tensors", "telemetry/collection_duration_ms"]
    forward = [s for s in routed_by_default() if s.kind is RecordKind.FORWARD and s.tensor_root]
    assert keys[2:4] == [f"telemetry/encoder.0/{signal}/rms" for signal in forward]
    assert keys[4:] == [
        "telemetry/step/nonfinite_tensors",
        "telemetry/step/collection_duration_ms",
        "telemetry/encoder.0/parameter_gradient/weight/rms",
        "telemetry/encoder.0/parameter_gradient/bias/rms",
        "telemetry/encoder.0/update/weight/update_to_weight",
        "telemetry/encoder.0/update/bias/update_to_weight",
        "telemetry/model/parameter_gradient/l2_norm",
        "telemetry/model/parameter_gradient/nonfinite_count",
        "telemetry/model/parameter_gradient/zero_count",
        "telemetry/model/update/l2_norm",
    ]
    assert not any("<" in key or "*" in key for key in keys)


def test_routed_step_metrics_are_data_of_the_signals() -> None:
    """Which step metrics reach the loggers is each signal's definition, not the router's."""
    assert Signal.PARAMETER_GRADIENT.spec.routed_metrics == ("rms",)
    assert Signal.UPDATE.spec.routed_metrics == ("update_to_weight",)
    assert Signal.PARAMETER_GRADIENT.spec.model_metrics == (
        "l2_norm",
        "nonfinite_count",
        "zero_count",
    )
    assert Signal.UPDATE.spec.model_metrics == ("l2_norm",)
    assert all(s.spec.routed_metrics is None for s in Signal if s.kind is RecordKind.FORWARD)
    assert tensor_key(MODEL_LAYER, 0, Signal.UPDATE, ALL_PARAMETERS) == "model/update"


def test_index_md_lists_every_signal_with_its_kind_and_root() -> None:
    """index.md's Signals table holds each signal's kind, gradient, root and sentence."""
    index = render_index(_run(), status="running")
    assert "## Signals" in index
    for signal in Signal:
        row = next(line for line in index.splitlines() if line.startswith(f"| `{signal}` |"))
        assert f"| {signal.kind} |" in row
        assert signal.describes in row
        root = f"`{signal.tensor_root}`" if signal.tensor_root else "the parameter's name"
        if signal.spec.paths:  # time and memory: fixed paths, not a tensor's
            root = ", ".join(f"`{path}`" for path in signal.spec.paths)
        assert root in row
    schema_row = next(line for line in index.splitlines() if line.startswith("| `signal` |"))
    assert all(f"`{signal}`" in schema_row for signal in Signal)
    assert "`kind`" in index
    assert "- `step`: a step record" in index


def test_result_json_carries_the_signal_catalog(tmp_path: pathlib.Path) -> None:
    """result.json lists every signal with its record kind, gradient and tensor root."""
    model = mlp()
    with inject_observer(model, sampler=AlwaysSampler(), output_dir=tmp_path / "run"):
        model(torch.randn(2, 4)).sum().backward()
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["signals"] == [
        {
            "name": signal.value,
            "kind": signal.kind.value,
            "gradient_of": signal.gradient_of.value if signal.gradient_of else None,
            "tensor_root": signal.tensor_root,
            "describes": signal.describes,
        }
        for signal in Signal
    ]
    assert result["step_records"]["count"] == 0


def test_summary_columns_derive_from_the_summarized_signals() -> None:
    """The end-of-run table's columns come from the signals with a summary label."""
    assert _COLUMNS == ("output std", "max_abs/rms", "grad rms", "non-finite")


def test_the_analysis_package_reads_the_names_the_core_writes() -> None:
    """The torch-free analysis package spells each signal once, exactly as the core writes it."""
    from torchinstruments_analysis import _signals as analysis_signals

    for signal in Signal:
        assert getattr(analysis_signals, signal.name) == signal.value
    assert analysis_signals.MODEL_LAYER == MODEL_LAYER
