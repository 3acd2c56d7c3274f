"""``profile=True``: time (and, on CUDA, memory) of each module call's forward and backward."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from helpers import mlp
from torchinstruments_core import AlwaysSampler, Signal, inject_observer
from torchinstruments_core._profile import Overhead, Stamp
from torchinstruments_core.testing import RecordingSink

SLEEP_S = 0.02


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return grad


class Slow(nn.Module):
    """Sleeps in its forward and in its backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return _SlowBackward.apply(x)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fast = nn.Linear(8, 8)
        self.slow = Slow()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.slow(self.fast(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.outer = Outer()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.outer(x))


def _times(sink: RecordingSink, path: str) -> dict[tuple[str, int], float | None]:
    return {
        (r.layer, r.call_index): r.value
        for r in sink.rows
        if r.signal is Signal.TIME and r.tensor_path == path
    }


def _named(*names: str) -> Any:
    return lambda name, module: name in names


def test_every_call_gets_a_positive_forward_and_backward_time() -> None:
    """Each observed call, a module called twice included, has one ``ms`` row per direction."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    shared = model[0]

    def twice(x: torch.Tensor) -> torch.Tensor:
        return model[1](shared(shared(x)))

    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, profile=True):
        model.forward = twice  # type: ignore[method-assign]
        model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    for path in ("forward", "backward"):
        times = _times(sink, path)
        assert set(times) == {("0", 0), ("0", 1), ("1", 0)}
        assert all(value is not None and value > 0 for value in times.values())
    assert {r.metric for r in sink.rows if r.signal is Signal.TIME} == {"ms"}
    assert not [r for r in sink.rows if r.signal is Signal.MEMORY]  # CUDA only


def test_a_parent_time_includes_its_children() -> None:
    """Inclusive times: a parent's forward and backward take at least its children's sum.

    A child that sleeps 20 ms in each direction is timed at 20 ms or more.
    """
    model = Net()
    selector = _named("outer", "outer.fast", "outer.slow", "head")
    sink = RecordingSink()
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, selector=selector, profile=True
    ):
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    for path in ("forward", "backward"):
        times = _times(sink, path)
        outer, fast, slow = (times[(name, 0)] for name in ("outer", "outer.fast", "outer.slow"))
        assert outer is not None
        assert fast is not None
        assert slow is not None
        assert slow >= SLEEP_S * 1000
        assert outer >= fast + slow


def test_the_observer_s_own_work_is_left_out() -> None:
    """The intervals of the observer's work inside a window are subtracted, those outside not."""

    def at(seq: int, seconds: float) -> Stamp:
        return Stamp(seq, seconds)

    overhead = Overhead(
        [(at(1, 1.0), at(2, 1.5)), (at(4, 3.0), at(5, 3.25)), (at(7, 9.0), at(8, 10.0))]
    )
    assert overhead.within(at(0, 0.0), at(6, 5.0)) == pytest.approx(750.0)
    assert overhead.within(at(2, 1.5), at(4, 3.0)) == 0.0  # its own edges are not inside
    assert overhead.within(at(3, 2.0), at(9, 11.0)) == pytest.approx(1250.0)


def test_the_first_layer_without_input_gradient_says_why_its_backward_is_missing() -> None:
    """A call none of whose inputs takes a gradient has no end of backward: ``no_gradient``."""
    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, profile=True):
        model(torch.randn(3, 4)).sum().backward()
    first = [r for r in sink.rows if r.signal is Signal.TIME and r.layer == "0"]
    assert {(r.tensor_path, r.unavailable_reason) for r in first} == {
        ("forward", None),
        ("backward", "no_gradient"),
    }


def test_a_forward_only_sample_has_forward_times_only() -> None:
    """Under ``no_grad`` no backward runs: ``time`` rows say ``forward`` only."""
    model = mlp()
    sink = RecordingSink()
    with (
        inject_observer(model, sampler=AlwaysSampler(), sink=sink, profile=True),
        torch.no_grad(),
    ):
        model(torch.randn(3, 4))
    paths = {r.tensor_path for r in sink.rows if r.signal is Signal.TIME}
    assert paths == {"forward"}


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Grow(nn.Module):
    """Allocates a 4 MiB temporary and returns a 1 MiB tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        temporary = torch.ones(2**20, device=x.device) * x.sum()  # 4 MiB in float32
        return temporary[: 2**18].clone()  # 1 MiB


@needs_cuda
def test_memory_rows_on_cuda_give_the_allocated_change_and_the_peak() -> None:
    """On CUDA a call's ``memory`` rows hold its allocated change and its peak, inclusive.

    The call keeps 1 MiB and peaks at least 4 MiB (its temporary) above its start; its parent
    shows the same.
    """
    device = torch.device("cuda")
    model = nn.Sequential(nn.Sequential(Grow()), nn.Identity()).to(device)
    sink = RecordingSink()
    selector = _named("0", "0.0")
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, selector=selector, profile=True
    ):
        model(torch.ones(8, device=device))
    values = {
        (r.layer, r.tensor_path, r.metric): r.value for r in sink.rows if r.signal is Signal.MEMORY
    }
    for layer in ("0", "0.0"):
        assert values[(layer, "forward", "allocated_delta_mib")] == pytest.approx(1.0, abs=0.1)
        assert values[(layer, "forward", "peak_delta_mib")] >= 4.0  # type: ignore[operator]
    times = _times(sink, "forward")
    assert all(value is not None and value > 0 for value in times.values())


@needs_cuda
def test_a_profiled_sampled_step_never_synchronizes() -> None:
    """With ``record_inputs`` and ``profile`` a sampled step runs under sync debug "error".

    Its times are read once the sample's transfer has landed.
    """
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(device)
    sink = RecordingSink()
    x = torch.randn(16, 32, device=device, requires_grad=True)
    with inject_observer(model, sink=sink, record_inputs=True, profile=True) as observer:
        for step in range(4):
            observer.begin_step(step, sample=True)
            torch.cuda.set_sync_debug_mode("error" if step == 3 else "default")
            try:
                model(x).square().mean().backward()
                observer.end_step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        observer.flush()
    last = sink.samples[-1]
    times = [r for r in last.rows if r.signal is Signal.TIME and r.tensor_path == "backward"]
    assert times
    assert all(r.value is not None and r.value > 0 for r in times)
    assert [r for r in last.rows if r.signal is Signal.MEMORY]
