"""The gradients of an optimizer that only reads them, reduced while it steps.

A recorded step's gradients are read where they are, on the kernels' queue. An optimizer that may
write into them (torch's SGD with Nesterov momentum under ``foreach``, a subclass, a fused one)
has them measured before its step begins: the pre-hook waits. One whose step only reads them
(``_step_tensors.leaves_gradients``: torch's AdamW, SGD without Nesterov momentum, ...) has them
reduced during its step, and the post-hook waits and checks their versions: a gradient something
changed in place meanwhile loses its values (``modified_in_place``, and the whole-model row
too), and that optimizer's later steps wait in the pre-hook. The values are those of the gradient
the step was handed, either way.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import pytest
import torch
from torch import nn

import torchinstruments_core._measure as measure_module
from optimizer_helpers import step_records
from torchinstruments_core import AlwaysSampler, SampleRecord, inject_observer
from torchinstruments_core._lifecycle import SampleLifecycle
from torchinstruments_core._step_tensors import leaves_gradients
from torchinstruments_core.testing import RecordingSink

MODIFIED = "modified_in_place"


class _SubclassedAdamW(torch.optim.AdamW):
    """A subclass may change its gradients in its own step: it is not trusted to leave them."""


@pytest.fixture
def wait_sites(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the probe's functions that waited for the reductions, in order.

    The kernels' queue takes the step's tensors on a thread of its own (``free_core``), as on
    a machine whose torch leaves a core free.
    """
    monkeypatch.setattr(measure_module, "free_core", lambda: True)
    sites: list[str] = []
    wait = SampleLifecycle.wait_for_reductions

    def noted(self: SampleLifecycle) -> None:
        sites.append(sys._getframe(1).f_code.co_name)
        wait(self)

    monkeypatch.setattr(SampleLifecycle, "wait_for_reductions", noted)
    return sites


def _layer() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(256, 256)


def _gradient_rows(record: SampleRecord, layer: str = "0") -> dict[tuple[str, str], Any]:
    """``(tensor_path, metric)`` -> (value, reason) of one record's ``parameter_gradient`` rows."""
    return {
        (r.tensor_path, r.metric): (r.value, r.unavailable_reason)
        for r in record.rows
        if str(r.signal) == "parameter_gradient" and r.layer == layer
    }


def _model_gradient(record: SampleRecord) -> dict[str, Any]:
    return {
        r.metric: (r.value, r.unavailable_reason)
        for r in record.rows
        if str(r.signal) == "parameter_gradient" and r.layer == "<model>"
    }


def _check_values(record: SampleRecord, handed: dict[str, torch.Tensor]) -> None:
    """Its gradient rows are those of the gradients ``handed`` to the step (float64 copies)."""
    rows = _gradient_rows(record)
    for path, gradient in handed.items():
        assert rows[(path, "max")][0] == pytest.approx(gradient.max().item(), rel=1e-6)
        assert rows[(path, "min")][0] == pytest.approx(gradient.min().item(), rel=1e-6)
        rms = gradient.square().mean().sqrt().item()
        assert rows[(path, "rms")][0] == pytest.approx(rms, rel=1e-5)
    norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in handed.values()])).item()
    assert _model_gradient(record)["l2_norm"][0] == pytest.approx(norm, rel=1e-5)


def _train(
    layer: nn.Linear, optimizer: torch.optim.Optimizer, steps: int, after: Any = None
) -> tuple[list[SampleRecord], list[dict[str, torch.Tensor]]]:
    """``steps`` sampled steps; each step's gradients as handed to it, copied in float64.

    The copying hook is registered before the observer's, ``after`` (a step pre-hook) after it.
    """
    handed: list[dict[str, torch.Tensor]] = []

    def copy(*_: object) -> None:
        handed.append({n: p.grad.double().clone() for n, p in layer.named_parameters()})  # type: ignore[union-attr]

    optimizer.register_step_pre_hook(copy)
    sink = RecordingSink()
    with inject_observer(
        nn.Sequential(layer), sampler=AlwaysSampler(), sink=sink, optimizer=optimizer
    ) as observer:
        if after is not None:
            optimizer.register_step_pre_hook(after)
        for step in range(steps):
            observer.begin_step(step, sample=True)
            batch = torch.randn(32, 256, generator=torch.Generator().manual_seed(step))
            layer(batch).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            observer.end_step()
    return step_records(sink), handed


@pytest.mark.parametrize(
    ("make", "during"),
    [
        (lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1), True),
        (lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.1, maximize=True), True),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True), True),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, foreach=True), False),
        (lambda p: _SubclassedAdamW(p, lr=1e-3), False),
    ],
    ids=["AdamW", "Adam-maximize", "SGD-momentum", "SGD-nesterov-foreach", "AdamW-subclass"],
)
def test_gradients_are_reduced_during_a_step_that_only_reads_them(
    wait_sites: list[str], make: Any, during: bool
) -> None:
    """Where the probe waits, by optimizer; the rows are the handed gradients' either way."""
    layer = _layer()
    optimizer = make(layer.parameters())
    records, handed = _train(layer, optimizer, steps=3)
    # the post-hook waits for the parameters' copies in any case
    expected = ["_after"] * 3 if during else ["_before", "_after"] * 3
    assert wait_sites == expected
    assert len(records) == 3
    for record, gradients in zip(records, handed, strict=True):
        _check_values(record, gradients)


@pytest.fixture
def adamw_writes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """AdamW made to halve its gradients in place as its step begins (a future torch, say).

    An optimizer made after this gets the step wrapped in torch's hooks as usual. A ``True``
    appended to the list makes the next step raise once it has halved them.
    """
    original = torch.optim.AdamW.step
    hooked = getattr(original, "hooked", False)
    plain = original.__wrapped__ if hooked else original  # type: ignore[attr-defined]
    raising: list[bool] = []

    def step(self: torch.optim.AdamW, closure: Any = None) -> Any:
        with torch.no_grad():
            for group in self.param_groups:
                for parameter in group["params"]:
                    if parameter.grad is not None:
                        parameter.grad.mul_(0.5)
        if raising and raising.pop():
            raise RuntimeError("the step failed")
        return plain(self, closure)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    return raising


def test_a_gradient_changed_during_the_step_loses_its_values_and_later_steps_wait(
    wait_sites: list[str], adamw_writes: list[bool]
) -> None:
    """An AdamW whose step halves its gradients: the first step's reading is not trusted.

    The first step's gradients were being reduced while the step wrote into them: their rows
    and the whole-model row have no values (``modified_in_place``), not a mix of the two. From
    then on the pre-hook waits, and the rows are those of the gradients the step was handed.
    """
    layer = _layer()
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    records, handed = _train(layer, optimizer, steps=3)
    assert wait_sites == ["_after", "_before", "_after", "_before", "_after"]
    first = _gradient_rows(records[0])
    assert first  # the rows are there, without values
    assert {reason for _, reason in first.values()} == {MODIFIED}
    assert {value for value, _ in first.values()} == {None}
    assert {reason for _, reason in _model_gradient(records[0]).values()} == {MODIFIED}
    for record, gradients in zip(records[1:], handed[1:], strict=True):
        _check_values(record, gradients)
    # the other signals of the first step kept their values
    kept = [r for r in records[0].rows if str(r.signal) in ("parameter", "update")]
    assert kept
    assert all(r.value is not None for r in kept)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_gradients_with_a_graph_changed_during_the_step_lose_the_whole_model_row_too(
    wait_sites: list[str], adamw_writes: list[bool]
) -> None:
    """``backward(create_graph=True)``: gradients that require grad, read detached.

    The whole-model row tells a changed one by the ``.grad`` tensor itself, not its detached
    alias: it has no values either.
    """
    layer = _layer()
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    sink = RecordingSink()
    with inject_observer(
        nn.Sequential(layer), sampler=AlwaysSampler(), sink=sink, optimizer=optimizer
    ) as observer:
        observer.begin_step(0, sample=True)
        layer(torch.randn(32, 256)).square().mean().backward(create_graph=True)
        assert layer.weight.grad is not None
        assert layer.weight.grad.requires_grad
        optimizer.step()
        optimizer.zero_grad()  # to None: no cycle between the parameters and their gradients
        observer.end_step()
    (record,) = step_records(sink)
    assert wait_sites == ["_after"]
    assert {reason for _, reason in _gradient_rows(record).values()} == {MODIFIED}
    assert {reason for _, reason in _model_gradient(record).values()} == {MODIFIED}


def test_a_failure_before_the_step_still_drops_what_the_step_changed(
    wait_sites: list[str], adamw_writes: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parameters' copies fail (out of memory, say) after the gradients were handed over.

    The observer warns; the gradients, reduced during a step that writes into them, still lose
    their values, and the next step waits for them in the pre-hook.
    """
    import torchinstruments_core._optimizer_probe as probe_module
    from torchinstruments_core import ObservationWarning

    before_step = probe_module.before_step  # type: ignore[attr-defined]
    failing = [True]

    def fails_once(*args: Any) -> Any:
        if failing.pop() if failing else False:
            raise RuntimeError("no memory for the copies")
        return before_step(*args)

    monkeypatch.setattr(probe_module, "before_step", fails_once)
    layer = _layer()
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    with pytest.warns(ObservationWarning, match="no memory for the copies"):
        records, handed = _train(layer, optimizer, steps=2)
    assert wait_sites == ["_after", "_before", "_after"]  # no copies: no wait but the check
    assert {reason for _, reason in _gradient_rows(records[0]).values()} == {MODIFIED}
    _check_values(records[1], handed[1])


def test_a_step_that_raises_after_changing_its_gradients_has_them_dropped(
    wait_sites: list[str], adamw_writes: list[bool]
) -> None:
    """The step raises after it halved the gradients: its post-hook never runs.

    Its record is delivered when the next step begins: the gradients reduced during it
    changed, so their rows read ``modified_in_place``; the next step waits for its gradients
    in the pre-hook and has their values.
    """
    layer = _layer()
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    sink = RecordingSink()
    handed: list[dict[str, torch.Tensor]] = []
    adamw_writes.append(True)
    with inject_observer(
        nn.Sequential(layer), sampler=AlwaysSampler(), sink=sink, optimizer=optimizer
    ) as observer:
        for step in range(2):
            observer.begin_step(step, sample=True)
            batch = torch.randn(32, 256, generator=torch.Generator().manual_seed(step))
            layer(batch).square().mean().backward()
            handed.append({n: p.grad.double().clone() for n, p in layer.named_parameters()})  # type: ignore[union-attr]
            try:
                optimizer.step()
            except RuntimeError:
                assert step == 0
            optimizer.zero_grad()
            observer.end_step()
    first, second = step_records(sink)
    assert {reason for _, reason in _gradient_rows(first).values()} == {MODIFIED}
    assert {reason for _, reason in _model_gradient(first).values()} == {MODIFIED}
    assert wait_sites == ["_close", "_before", "_after"]  # the second step waited before it
    _check_values(second, handed[1])


def test_another_hook_between_the_observer_s_two_makes_it_wait_before_the_step(
    wait_sites: list[str],
) -> None:
    """A step pre-hook after the observer's, or a post-hook before its, may write anywhere.

    It halves the gradients through ``.data``, which moves no version counter: the observer
    waits for their reductions in its pre-hook, so the rows are those of the gradients its
    pre-hook found, unmixed.
    """
    layer = _layer()
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)

    def halve(*_: object) -> None:
        for parameter in layer.parameters():
            parameter.grad.data.mul_(0.5)  # type: ignore[union-attr]

    records, handed = _train(layer, optimizer, steps=2, after=halve)
    assert wait_sites == ["_before", "_after"] * 2
    for record, gradients in zip(records, handed, strict=True):
        _check_values(record, gradients)

    wait_sites.clear()
    layer = _layer()
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    optimizer.register_step_post_hook(lambda *_: None)  # before the observer's
    records, handed = _train(layer, optimizer, steps=1)
    assert wait_sites == ["_before", "_after"]
    _check_values(records[0], handed[0])


def test_two_optimizers_each_learn_on_their_own(
    wait_sites: list[str], adamw_writes: list[bool]
) -> None:
    """An AdamW that writes into its gradients and an Adam that does not, on two layers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    writer = torch.optim.AdamW(model[0].parameters(), lr=1e-3)
    reader = torch.optim.Adam(model[2].parameters(), lr=1e-3)
    sink = RecordingSink()
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, optimizer=[writer, reader]
    ) as observer:
        for step in range(3):
            observer.begin_step(step, sample=True)
            model(torch.randn(8, 64)).square().mean().backward()
            writer.step()
            reader.step()
            writer.zero_grad()
            reader.zero_grad()
            observer.end_step()
    # step 0: both during their steps; then the writer waits before its step, the reader not
    assert wait_sites == ["_after", "_after"] + ["_before", "_after", "_after"] * 2
    reasons = {
        (record.sample_id, row.layer): row.unavailable_reason
        for record in step_records(sink)
        for row in record.rows
        if str(row.signal) == "parameter_gradient" and row.metric == "max"
    }
    assert len(reasons) == 6  # three steps of each optimizer's layer
    modified = [layer for (_, layer), reason in reasons.items() if reason == MODIFIED]
    assert modified == ["0"]  # the writer's first step only
    assert sum(reason is None for reason in reasons.values()) == 5


def test_a_plain_closure_step_reduces_during_the_step(wait_sites: list[str]) -> None:
    """``SGD.step(closure)``: the measurements begin when the closure returns, inside the step."""
    layer = _layer()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    sink = RecordingSink()
    handed: list[dict[str, torch.Tensor]] = []
    with inject_observer(
        nn.Sequential(layer), sampler=AlwaysSampler(), sink=sink, optimizer=optimizer
    ) as observer:
        for step in range(2):

            def closure() -> torch.Tensor:
                optimizer.zero_grad()
                loss = layer(torch.randn(32, 256)).square().mean()
                loss.backward()
                handed.append({n: p.grad.double().clone() for n, p in layer.named_parameters()})  # type: ignore[union-attr]
                return loss

            observer.begin_step(step, sample=True)
            optimizer.step(closure)
            observer.end_step()
    assert wait_sites == ["_after"] * 2
    for record, gradients in zip(step_records(sink), handed, strict=True):
        _check_values(record, gradients)


def test_leaves_gradients_declines_what_may_write_into_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What may write into the gradients, or write unseen, is declined.

    Fused or differentiable groups, Nesterov SGD, subclasses, other optimizers, a loss scale, a
    hyperparameter with a gradient, a process group up (a collective moves no version).
    """
    from torchinstruments_core._signals import Signal
    from torchinstruments_core._step_records import StepTensor

    layer = _layer()
    layer(torch.randn(2, 256)).sum().backward()
    assert layer.weight.grad is not None
    gradients = [StepTensor("0", Signal.PARAMETER_GRADIENT, "weight", layer.weight.grad)]
    params = list(layer.parameters())
    assert leaves_gradients(torch.optim.AdamW(params), gradients)
    assert leaves_gradients(torch.optim.RMSprop(params), gradients)
    assert not leaves_gradients(torch.optim.AdamW(params), [])
    assert not leaves_gradients(torch.optim.AdamW(params, differentiable=True), gradients)
    assert not leaves_gradients(
        torch.optim.SGD(params, lr=0.1, nesterov=True, momentum=0.9), gradients
    )
    assert not leaves_gradients(_SubclassedAdamW(params), gradients)
    assert not leaves_gradients(torch.optim.Rprop(params), gradients)  # writes into them
    assert not leaves_gradients(torch.optim.LBFGS(params), gradients)
    decayed = torch.optim.SGD(params, lr=0.1, weight_decay=torch.tensor(0.01, requires_grad=True))
    assert not leaves_gradients(decayed, gradients)
    scaled = torch.optim.AdamW(params)
    scaled.grad_scale = torch.tensor(1024.0)  # type: ignore[attr-defined]
    assert not leaves_gradients(scaled, gradients)
    if "fused" in torch.optim.AdamW.__init__.__code__.co_varnames:
        try:
            fused = torch.optim.AdamW(params, fused=True)
        except RuntimeError:  # no fused CPU kernel in this torch
            fused = None
        if fused is not None:
            assert not leaves_gradients(fused, gradients)
    import torchinstruments_core._step_tensors as step_tensors

    monkeypatch.setattr(step_tensors, "process_groups_up", lambda: True)
    assert not leaves_gradients(torch.optim.AdamW(params), gradients)


def test_lightning_demo_model_with_adamw_reduces_gradients_during_its_step(
    wait_sites: list[str], tmp_path: pathlib.Path
) -> None:
    """``BoringModel`` with AdamW under ``Trainer.fit`` (a closure): rows equal Lightning's grads.

    ``on_before_optimizer_step`` runs after the closure's backward, inside the optimizer's step,
    where the observer's "before" measurements run too: the gradients copied there are the ones
    the step uses.
    """
    import polars as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_helpers import trainer
    from torchinstruments_lightning import TelemetryMonitor

    class AdamWModel(BoringModel):
        def configure_optimizers(self) -> Any:
            return [torch.optim.AdamW(self.parameters(), lr=1e-3)], []

    handed: list[dict[str, torch.Tensor]] = []

    class Copy(Callback):
        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            handed.append({n: p.grad.double().clone() for n, p in module.named_parameters()})

    monitor = TelemetryMonitor(every_n_steps=1, output_dir=tmp_path / "run", log_to_loggers=False)
    fit = trainer(tmp_path, callbacks=[monitor, Copy()], logger=False, max_steps=3)
    fit.fit(AdamWModel())
    assert wait_sites == ["_after"] * 3
    assert monitor.run_directory is not None
    history = pl.read_parquet(monitor.run_directory / "history.parquet")
    rows = history.filter(pl.col("signal") == "parameter_gradient")
    assert len(handed) == 3
    for step, gradients in enumerate(handed):
        at = rows.filter(pl.col("step") == step)
        for name, gradient in gradients.items():
            layer, _, path = name.rpartition(".")
            found = {
                metric: value
                for metric, value in at.filter(
                    (pl.col("layer") == layer) & (pl.col("tensor_path") == path)
                )
                .select("metric", "value")
                .iter_rows()
            }
            assert found["max"] == pytest.approx(gradient.max().item(), rel=1e-6)
            assert found["min"] == pytest.approx(gradient.min().item(), rel=1e-6)


def test_accelerate_s_prepared_adamw_reduces_gradients_during_its_step(
    wait_sites: list[str], tmp_path: pathlib.Path
) -> None:
    """Accelerate's prepared AdamW: its gradients are reduced during the step.

    ``Accelerator.prepare``'s optimizer wrapper adds no hook of its own between the observer's;
    the rows (in the run directory's history) are those of the gradients
    ``accelerator.backward`` left.
    """
    import polars as pl
    from accelerate import Accelerator

    from torchinstruments_accelerate import TelemetryTracker

    tracker = TelemetryTracker(every_n_steps=1, output_dir=tmp_path / "run")
    accelerator = Accelerator(log_with=[tracker], cpu=True)
    accelerator.init_trackers("gradients")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    tracker.watch(model, accelerator=accelerator, optimizer=optimizer)
    handed: list[dict[str, torch.Tensor]] = []
    for step in range(3):
        batch = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        accelerator.backward(model(batch).square().mean())
        handed.append({n: p.grad.double().clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    accelerator.end_training()
    assert wait_sites == ["_after"] * 3
    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    rows = history.filter((pl.col("signal") == "parameter_gradient") & (pl.col("metric") == "max"))
    found = {
        (step, f"{layer}.{path}"): value
        for step, layer, path, value in rows.select(
            "step", "layer", "tensor_path", "value"
        ).iter_rows()
    }
    for step, gradients in enumerate(handed):
        for name, gradient in gradients.items():
            assert found[(step, name)] == pytest.approx(gradient.max().item(), rel=1e-6)
