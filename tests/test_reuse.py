"""A tensor observed at several sites of one sample is reduced once, and every site gets its rows.

A module's input is the previous module's output, ``nn.Identity`` and ``nn.Dropout(p=0)`` return
their input, and the gradient flowing into such a tensor reaches each site's hook as the same
tensor: measuring it again would give the very same values.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from torchinstruments_core import AlwaysSampler, Signal, by_name, inject_observer
from torchinstruments_core._measure import Measurer
from torchinstruments_core.testing import RecordingSink

METRICS = ("mean", "std", "min", "max", "p25", "p50", "p75", "rms", "zero_fraction")
SHARED_SITES = [  # one tensor in the forward, one gradient in the backward
    ("0", Signal.OUTPUT, "output"),
    ("1", Signal.INPUT, "input.0"),
    ("1", Signal.OUTPUT, "output"),
    ("2", Signal.INPUT, "input.0"),
    ("2", Signal.OUTPUT, "output"),
    ("3", Signal.INPUT, "input.0"),
]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Identity(), nn.Dropout(p=0.0), nn.Linear(32, 1))


def _measured(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every tensor handed to the reducers, in order."""
    seen: list[torch.Tensor] = []
    measure = Measurer.measure

    def counting(self: Measurer, tensor: torch.Tensor, **options: object) -> object:
        seen.append(tensor)
        return measure(self, tensor, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(Measurer, "measure", counting)
    return seen


def _value(sink: RecordingSink, layer: str, signal: Signal, path: str, metric: str) -> float:
    value = sink.value(layer, signal, metric, tensor_path=path)
    assert value is not None, (layer, signal, path, metric)
    return value


@pytest.mark.parametrize("background", [True, False], ids=["worker", "inline"])
def test_a_tensor_seen_at_several_sites_is_reduced_once(
    monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    """Six sites share one activation and six its gradient: two reductions, the same rows.

    The rows equal those of an independent reduction of the tensor (float64 references).
    """
    measured = _measured(monkeypatch)
    model, sink = _model(), RecordingSink()
    x = torch.randn(64, 8)
    options = {"record_inputs": True, "background_reductions": background, "error_policy": "raise"}
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, **options):  # type: ignore[arg-type]
        model(x).square().mean().backward()
    # x, the shared activation, the last output; their gradients but x's (it needs none)
    assert len(measured) == 5
    hidden = model[0](x).detach().double()
    for metric, expected in {"mean": hidden.mean(), "max": hidden.max()}.items():
        for layer, signal, path in SHARED_SITES:
            assert _value(sink, layer, signal, path, metric) == pytest.approx(expected.item())
    gradient_of = {Signal.OUTPUT: Signal.OUTPUT_GRADIENT, Signal.INPUT: Signal.INPUT_GRADIENT}
    for metric in METRICS:
        for gradient in (False, True):
            values = {
                _value(sink, layer, gradient_of[signal] if gradient else signal, path, metric)
                for layer, signal, path in SHARED_SITES
            }
            assert len(values) == 1, (metric, gradient, values)


def test_a_tensor_changed_in_place_between_sites_is_measured_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ReLU(inplace=True)``: its input holds the values before, its output those after."""
    measured = _measured(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(inplace=True), nn.Linear(32, 1))
    sink = RecordingSink()
    x = torch.randn(64, 8)
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, record_inputs=True):
        model(x).sum().backward()
    before = model[0](x).detach()
    assert _value(sink, "0", Signal.OUTPUT, "output", "min") == pytest.approx(before.min().item())
    assert _value(sink, "1", Signal.INPUT, "input.0", "min") == pytest.approx(before.min().item())
    assert before.min() < 0
    assert _value(sink, "1", Signal.OUTPUT, "output", "min") == 0.0
    # the same object, measured again once the in-place op moved its version
    assert sum(tensor is measured[1] for tensor in measured[:4]) == 2


def test_a_reused_measurement_delivers_histograms_only_for_the_focus_sites() -> None:
    """A focus layer's histogram is not delivered for another layer's site sharing its tensor.

    Here the focus layer comes first (its measurement has a histogram, reused by the others) and
    the second focus layer last (its input and the first layer's output are one tensor, whose
    first measurement had a histogram too): histograms appear for the focus sites only.
    """
    model, sink = _model(), RecordingSink()
    focus = by_name("0", "2")
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, record_inputs=True, focus_selector=focus
    ):
        model(torch.randn(64, 8)).sum().backward()
    (sample,) = sink.samples
    delivered = {(h.layer, h.signal, h.tensor_path) for h in sample.histograms}
    assert delivered == {
        ("0", Signal.INPUT, "input.0"),
        ("0", Signal.OUTPUT, "output"),
        ("0", Signal.OUTPUT_GRADIENT, "output"),
        ("2", Signal.INPUT, "input.0"),
        ("2", Signal.INPUT_GRADIENT, "input.0"),
        ("2", Signal.OUTPUT, "output"),
        ("2", Signal.OUTPUT_GRADIENT, "output"),
    }
    counts = {(h.layer, h.signal): h.counts for h in sample.histograms}
    assert counts["0", Signal.OUTPUT] == counts["2", Signal.INPUT] == counts["2", Signal.OUTPUT]


def test_a_histogram_asked_for_later_measures_the_tensor_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tensor first measured without a histogram is measured again for a focus site."""
    measured = _measured(monkeypatch)
    model, sink = _model(), RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, focus_selector=by_name("1")):
        model(torch.randn(64, 8)).sum().backward()
    (sample,) = sink.samples
    assert {(h.layer, h.signal) for h in sample.histograms} == {
        ("1", Signal.OUTPUT),
        ("1", Signal.OUTPUT_GRADIENT),
    }
    # outputs: layer 0's (no histogram), layer 1's (the same tensor, with one), layer 3's;
    # layer 2's reuses layer 1's; gradients likewise
    assert len(measured) == 6


def test_each_sample_measures_its_own_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tensor fed to two samples is measured in each (nothing carries over)."""
    measured = _measured(monkeypatch)
    model = nn.Sequential(nn.Identity(), nn.Linear(8, 1))
    sink = RecordingSink()
    x = torch.randn(16, 8, requires_grad=True) * 2.0  # made by autograd: reusable
    focus = by_name("0", "1")  # a histogram everywhere: one measurement of x serves each site
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, record_inputs=True, focus_selector=focus
    ):
        for _ in range(2):
            model(x).sum().backward(retain_graph=True)
    assert len(sink.samples) == 2
    assert sum(tensor is x for tensor in measured) == 2  # once a sample, for three sites


class _Refilled(nn.Module):
    """Calls its cell on one input tensor, a view of a numpy buffer refilled between calls."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(4, 4)
        self.buffer = np.zeros((2, 4), dtype=np.float32)
        self.x = torch.from_numpy(self.buffer)

    def forward(self, frames: np.ndarray) -> torch.Tensor:
        total = torch.zeros(())
        for frame in frames:
            self.buffer[:] = frame  # a numpy write: the tensor's version does not move
            total = total + self.cell(self.x).sum()
        return total


def test_an_input_refilled_through_numpy_is_measured_at_every_call() -> None:
    """Only tensors autograd made are reused: a numpy write moves no version counter."""
    model, sink = _Refilled(), RecordingSink()
    frames = np.stack([np.full((2, 4), float(t), np.float32) for t in range(3)])
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, record_inputs=True):
        model(frames).backward()
    means = {
        row.call_index: row.value
        for row in sink.rows
        if (row.layer, row.signal, row.metric) == ("cell", Signal.INPUT, "mean")
    }
    assert means == {0: 0.0, 1: 1.0, 2: 2.0}


def test_an_input_keeps_its_values_when_its_module_changes_a_shared_output_in_place() -> None:
    """An input site does not reuse an output the worker reads in place.

    After an evaluation sample, where ``Dropout(inplace=True)`` leaves the first layer's output
    as it is, that output is read in place; in training the dropout changes it, so the output
    site loses that sample's values (``modified_in_place``), but the dropout's input site,
    whose values at the call's start are copied, keeps them, as it did without reuse.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5, inplace=True), nn.Linear(32, 1))
    sink = RecordingSink()
    with inject_observer(
        model,
        sampler=AlwaysSampler(),
        sink=sink,
        record_inputs=True,
        background_reductions=True,
    ):
        for train in (False, True, True):
            model.train(train)
            model(torch.randn(64, 8)).sum().backward()
    for sample in sink.samples:
        reasons = {
            (row.layer, row.signal): row.unavailable_reason
            for row in sample.rows
            if row.metric == "mean"
        }
        assert reasons["1", Signal.INPUT] is None, sample.sample_id


def test_a_late_site_of_a_closed_sample_leaves_a_held_measurement_to_the_closer() -> None:
    """A gradient arriving after the sample closed never settles a measurement the sample holds.

    Whoever closed the sample settles it (possibly on another thread at that moment); a
    measurement of the sample's own, reused for the late site, is not settled twice.
    """
    from torchinstruments_core._measurement import Measurement
    from torchinstruments_core._sample import Sample, Site

    class Worker:
        def wait(self, ticket: int | None = None) -> None:
            pass

    finished: list[str] = []
    measurement = Measurement(None, ("mean",), worker=Worker(), ticket=1)  # type: ignore[arg-type]
    measurement.then(lambda _: finished.append("finished"))
    sample = Sample(0, None, 0.0, None)
    sample.add(Site("a", 0, Signal.OUTPUT_GRADIENT, "output"), measurement)
    sample.closed = True
    sample.add(Site("b", 0, Signal.OUTPUT_GRADIENT, "output"), measurement)  # late, reused
    assert finished == []
    assert sample.settle() is None
    assert finished == ["finished"]


def test_a_hugging_face_models_zero_dropouts_reuse_the_layer_before(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A BERT with random weights and dropout 0, into a real run directory (Parquet).

    Each ``...attention.output.dropout`` returns the dense layer's output: its rows, read back
    from ``history.parquet``, are the dense layer's, output and gradient, and fewer tensors
    are reduced than there are sites.
    """
    transformers = pytest.importorskip("transformers")
    import polars as pl

    measured = _measured(monkeypatch)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).train()
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    with inject_observer(model, sampler=AlwaysSampler(), output_dir=tmp_path / "run"):
        model(input_ids=tokens).last_hidden_state.square().mean().backward()
    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    site = ("layer", "call_index", "signal", "tensor_path")
    reduced = history.filter(pl.col("unavailable_reason").fill_null("") != "no_gradient")
    sites = reduced.select(site).unique().height
    # each block's two dropouts after a dense layer: output and gradient, not reduced again
    assert 0 < len(measured) <= sites - 2 * 2 * 2

    def rows(layer: str) -> list[tuple[str, str, float | None]]:
        picked = history.filter(pl.col("layer") == layer).sort("signal", "metric")
        return list(zip(picked["signal"], picked["metric"], picked["value"], strict=True))

    for block in range(2):
        dense = rows(f"encoder.layer.{block}.attention.output.dense")
        assert {signal for signal, _, _ in dense} == {"output", "output_gradient"}
        assert rows(f"encoder.layer.{block}.attention.output.dropout") == dense
