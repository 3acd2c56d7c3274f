"""Optimizer step signals: which parameters have rows, histograms, and an unchanged training."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from optimizer_helpers import (
    MODEL,
    Reference,
    float64_mlp,
    one_adam_step,
    parameter_names,
    step_records,
    train,
    values_of,
)
from torchinstruments_core import AlwaysSampler, inject_observer
from torchinstruments_core.testing import RecordingSink


class Tied(nn.Module):
    """An embedding whose weight the output head shares, and a block the selector skips."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 4, dtype=torch.float64)
        self.block = nn.Sequential(nn.Linear(4, 4, dtype=torch.float64))
        self.head = nn.Linear(4, 10, bias=False, dtype=torch.float64)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens)))


def test_a_shared_parameter_belongs_to_its_first_observed_owner() -> None:
    """A tied weight's rows are under its first observed owner; unobserved parameters count.

    The parameters of a module that is not observed have no rows but are in the whole-model
    gradient norm; the whole-model update norm covers the observed parameters only.
    """
    from torchinstruments_core import by_name

    model = Tied()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = Reference(optimizer, parameter_names(model))
    sink = RecordingSink()
    selector = by_name("embed", "head")
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer, selector=selector
    ):
        model(torch.tensor([[1, 2, 3]])).square().mean().backward()
        optimizer.step()
    (record,) = step_records(sink)
    owners = {(r.layer, r.tensor_path) for r in record.rows if str(r.signal) == "parameter"}
    assert owners == {("embed", "weight")}
    (copies,) = reference.steps
    rows = values_of(record)
    assert {"block.0.weight", "block.0.bias"} <= set(copies.gradient)
    every = torch.cat([g.reshape(-1) for g in copies.gradient.values()])
    norm = rows[(MODEL, "parameter_gradient", "*", "l2_norm")]
    assert norm == pytest.approx(torch.linalg.vector_norm(every).item())
    update = copies.after["embed.weight"] - copies.before["embed.weight"]
    norm = rows[(MODEL, "update", "*", "l2_norm")]
    assert norm == pytest.approx(torch.linalg.vector_norm(update).item())


def test_focus_layers_get_histograms_of_their_step_tensors() -> None:
    """The focus layers' routed step tensors have histograms; others, and other layers', none.

    ``parameter`` and ``optimizer_state`` are not routed (no destination would show them).
    """
    from torchinstruments_core import by_name

    record = one_adam_step(focus_selector=by_name("2"))
    histograms = {(h.layer, str(h.signal), h.tensor_path) for h in record.histograms}
    assert histograms == {
        ("2", signal, f"{name}{suffix}")
        for name in ("weight", "bias")
        for signal, suffix in [("parameter_gradient", ""), ("update", "")]
    }


def test_recording_the_steps_leaves_the_training_bit_identical() -> None:
    """Parameters and optimizer state after recorded steps equal an unobserved run's exactly."""

    def trained(observed: bool) -> tuple[dict[str, torch.Tensor], Any]:
        model = float64_mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        if observed:
            sink = RecordingSink()
            with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
                train(model, [optimizer], steps=3)
            assert len(step_records(sink)) == 3
        else:
            train(model, [optimizer], steps=3)
        return model.state_dict(), optimizer.state_dict()["state"]

    (weights, state), (bare_weights, bare_state) = trained(True), trained(False)
    for name, value in weights.items():
        assert torch.equal(value, bare_weights[name]), name
    for index, entries in state.items():
        for key, value in entries.items():
            assert torch.equal(value, bare_state[index][key]), (index, key)
