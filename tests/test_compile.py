"""``torch.compile``: a compiled model gives the eager model's statistics and compiles once.

A sampled forward runs the model's own Python (``torch.compiler.set_stance("force_eager")``), so
its module hooks fire on real tensors; an unsampled forward runs the compiled graph. Switching
between them must not recompile. The backend here counts compilations and graph calls; the
inductor test checks the real default backend once.
"""

from __future__ import annotations

import copy
import pathlib
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

from helpers import train_side_by_side, values_by_row
from torchinstruments_core import inject_observer
from torchinstruments_core.testing import RecordingSink

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = [
    pytest.mark.skipif(
        not hasattr(torch.compiler, "set_stance"),
        reason="sampled forwards run eagerly from torch 2.6",
    ),
    # dynamo's own warning when it resumes after a graph break with a non-leaf tensor
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
]


class CountingBackend:
    """A ``torch.compile`` backend that runs each graph as traced and counts compiles and calls."""

    def __init__(self) -> None:
        self.compiles = 0
        self.calls = 0

    def __call__(
        self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
    ) -> Callable[..., Any]:
        self.compiles += 1

        def run(*args: Any) -> Any:
            self.calls += 1
            return graph.forward(*args)

        return run


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("order", ["observe_the_compiled_model", "compile_the_observed_model"])
def test_compiled_model_is_observed_like_the_eager_one_without_recompiling(order: str) -> None:
    """Every statistic equals the eager model's; after the first two steps nothing compiles.

    Unsampled steps run the compiled graph (its calls grow), sampled ones are observed.
    """
    eager_model = _model()
    model = copy.deepcopy(eager_model)
    backend = CountingBackend()
    sink, eager_sink = RecordingSink(), RecordingSink()
    if order == "observe_the_compiled_model":
        compiled: nn.Module = torch.compile(model, backend=backend)  # type: ignore[assignment]
        observer = inject_observer(compiled, sink=sink)
    else:
        observer = inject_observer(model, sink=sink)
        compiled = torch.compile(model, backend=backend)  # type: ignore[assignment]
    compiles, calls = [], []
    with observer, inject_observer(eager_model, sink=eager_sink) as eager_observer:
        generator = torch.Generator().manual_seed(1)
        for step in range(8):
            x = torch.randn(8, 16, generator=generator)
            for obs, net in ((observer, compiled), (eager_observer, eager_model)):
                obs.begin_step(step, sample=step % 2 == 0)
                net(x).square().mean().backward()
                obs.end_step()
            compiles.append(backend.compiles)
            calls.append(backend.calls)
    assert compiles[1] > 0
    assert compiles[-1] == compiles[1], compiles
    unsampled_calls = [calls[i] - calls[i - 1] for i in range(3, 8, 2)]
    assert all(count > 0 for count in unsampled_calls), calls
    assert [s.step for s in sink.samples] == [0, 2, 4, 6]
    expected, observed = values_by_row(eager_sink), values_by_row(sink)
    assert observed.keys() == expected.keys()
    assert len(observed) > 100
    for key, value in expected.items():
        assert observed[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_sampler_driven_forwards_of_a_compiled_model_are_observed() -> None:
    """Without step control (a sampler decides inside the forward) statistics are still right."""
    from torchinstruments_core import EveryNForwardsSampler

    eager_model = _model()
    model = copy.deepcopy(eager_model)
    compiled: nn.Module = torch.compile(model, backend=CountingBackend())  # type: ignore[assignment]
    sink, eager_sink = RecordingSink(), RecordingSink()
    x = torch.randn(8, 16)
    with (
        inject_observer(compiled, sampler=EveryNForwardsSampler(2), sink=sink),
        inject_observer(eager_model, sampler=EveryNForwardsSampler(2), sink=eager_sink),
    ):
        for _ in range(4):
            compiled(x).sum().backward()
            eager_model(x).sum().backward()
    assert len(sink.samples) == 2
    expected = values_by_row(eager_sink)
    assert values_by_row(sink).keys() == expected.keys()
    for key, value in values_by_row(sink).items():
        assert value == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key


def test_compiled_lightning_module_is_observed(tmp_path: pathlib.Path) -> None:
    """``trainer.fit(torch.compile(module))`` is observed at the trainer's steps."""
    import polars as pl

    from lightning_helpers import Regressor, loader, telemetry_dir, trainer
    from torchinstruments_lightning import TelemetryMonitor

    module = torch.compile(Regressor(), backend=CountingBackend())
    trainer(tmp_path, max_steps=4, callbacks=[TelemetryMonitor(every_n_steps=2)]).fit(
        module,  # type: ignore[arg-type]
        loader(),
    )
    history = pl.read_parquet(telemetry_dir(tmp_path) / "history.parquet")
    assert sorted(history["step"].unique().to_list()) == [0, 2]
    assert history.filter(pl.col("value").is_null()).is_empty()
    assert {"net.0", "net.2"} <= set(history["layer"].unique().to_list())


@pytest.mark.slow
def test_inductor_compiled_model_matches_eager() -> None:
    """With the default inductor backend the statistics still equal the eager model's."""
    from torch._inductor import config

    eager_model = _model()
    compiled: nn.Module = torch.compile(copy.deepcopy(eager_model))  # type: ignore[assignment]
    sink, eager_sink = RecordingSink(), RecordingSink()
    x = torch.randn(8, 16)
    with (
        config.patch(compile_threads=1),  # no process-wide pool of compile workers left behind
        inject_observer(compiled, sink=sink) as observer,
        inject_observer(eager_model, sink=eager_sink) as eager_observer,
    ):
        pairs = [(observer, compiled), (eager_observer, eager_model)]
        train_side_by_side(pairs, x, 3, lambda step: step != 1)
    expected = values_by_row(eager_sink)
    for key, value in values_by_row(sink).items():
        assert value == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key


def test_compiled_code_runs_eagerly_only_while_a_sample_is_armed() -> None:
    """The eager stance lasts from a sampled begin_step to its end, and ends on removal too."""
    backend = CountingBackend()
    double = torch.compile(lambda t: t * 2, backend=backend)
    x = torch.ones(3)
    model = _model()
    observer = inject_observer(model, sink=RecordingSink())
    observer.begin_step(0, sample=True)
    double(x)
    assert backend.calls == 0  # forced eager: the sampled step's compiled code runs as Python
    observer.end_step()
    double(x)
    assert backend.calls == 1
    observer.begin_step(1, sample=True)
    with pytest.raises(RuntimeError):
        model(torch.ones(2, 5))  # a forward that fails halfway
    observer.begin_step(2, sample=False)  # no end_step for the failed step
    double(x)
    assert backend.calls == 2
    observer.begin_step(3, sample=True)
    observer.remove()
    double(x)
    assert backend.calls == 3


def test_two_observers_release_the_eager_stance_in_any_order() -> None:
    """The stance is held while either observer samples and ends when the last step ends."""
    backend = CountingBackend()
    double = torch.compile(lambda t: t * 2, backend=backend)
    x = torch.ones(3)
    first, second = _model(), _model()
    with (
        inject_observer(first, sink=RecordingSink()) as one,
        inject_observer(second, sink=RecordingSink()) as two,
    ):
        one.begin_step(0, sample=True)
        two.begin_step(0, sample=True)
        one.end_step()
        double(x)
        assert backend.calls == 0  # the second observer still samples
        two.end_step()
        double(x)
        assert backend.calls == 1
