"""Odd tensors in a real training step: statistics or a reason in every row, never an exception."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

from helpers import floats
from torchinstruments_core import AlwaysSampler, ObservationWarning, StatRow, inject_observer
from torchinstruments_core.reducers import DEFAULT_METRICS
from torchinstruments_core.testing import RecordingSink

# every test once with the compiled CPU kernels and once through numpy and torch
pytestmark = pytest.mark.usefixtures("reduction_path")

if TYPE_CHECKING:
    from collections.abc import Callable

two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")


class NoDetach(torch.Tensor):
    """A ``__torch_function__`` subclass whose ``detach`` and ``numel`` raise."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", None) in ("detach", "numel"):
            raise RuntimeError(f"{cls.__name__} refuses {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


class Refusing(torch.Tensor):
    """A wrapper subclass whose every operator raises, ``detach`` included."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Refusing:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner  # type: ignore[method-assign,assignment]  # shadows Tensor.inner

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise RuntimeError(f"{cls.__name__} refuses {func}")


class BrokenMetadata(torch.Tensor):
    """A subclass whose metadata raises when read: the observer's own code fails on it."""

    @property
    def is_nested(self) -> bool:  # type: ignore[override]
        raise RuntimeError("metadata unavailable")


def _nested(x: torch.Tensor, layout: torch.layout) -> torch.Tensor:
    with warnings.catch_warnings():  # the strided layout warns that it is a prototype
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([x[:1], x[1:]], layout=layout)


def _float4(x: torch.Tensor) -> torch.Tensor:
    dtype = getattr(torch, "float4_e2m1fn_x2", None)
    if dtype is None:
        pytest.skip("this torch has no float4_e2m1fn_x2")
    return torch.zeros(x.shape, dtype=torch.uint8).view(dtype)


# name -> (make the odd tensor from the module's input, expected reason or None, warns)
ODD: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str | None, bool]] = {
    "nested_strided": (lambda x: _nested(x, torch.strided), None, False),
    "nested_jagged": (lambda x: _nested(x, torch.jagged), None, False),
    "two_tensor": (lambda x: two_tensor.TwoTensor(x, x * 2), "tensor_subclass", False),
    "detach_raises_wrapper": (lambda x: Refusing(x), "tensor_subclass", False),
    "detach_and_numel_raise": (lambda x: x.as_subclass(NoDetach), None, False),
    "metadata_raises": (lambda x: x.as_subclass(BrokenMetadata), "reducer_error", True),
    "meta": (lambda x: torch.empty(x.shape, device="meta"), "meta_tensor", False),
    "sparse": (lambda x: x.detach().to_sparse(), "sparse_tensor", False),
    "float8_e4m3fn": (lambda x: x.to(torch.float8_e4m3fn), None, False),
    "float4_e2m1fn_x2": (_float4, "unsupported_dtype", False),
    "huge_float32": (lambda x: x * 1e37, None, False),
    "tiny_float32": (lambda x: x * 1e-40, None, False),
}


ODD_SITE = ("1", "output", "output.1")


class EmitOdd(nn.Module):
    """Returns its input and an odd tensor beside it, so the rest of the model still works."""

    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.make = make

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.make(x)


class First(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return pair[0]


def _model(make: Callable[[torch.Tensor], torch.Tensor]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), EmitOdd(make), First(), nn.Linear(3, 1))


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    return loss.detach()


def _assert_strict(rows: list[StatRow]) -> None:
    assert rows
    for row in rows:
        assert (row.value is None) == (row.unavailable_reason is not None), row
        assert row.value is None or math.isfinite(row.value), row


@pytest.mark.parametrize("name", list(ODD))
def test_an_odd_output_never_stops_a_training_step(name: str) -> None:
    """Under error_policy='warn' a module returning an odd tensor leaves the step as it was.

    Forward, backward and optimizer step give the loss and parameters of the same model without
    an observer; every row of the odd tensor is strict (value null exactly when a reason is
    set, never NaN) and has statistics or the expected reason; a failure inside the observer is
    an ObservationWarning, and nothing else warns.
    """
    make, reason, warns = ODD[name]
    x = torch.randn(5, 4)
    plain = _model(make)
    expected_loss = _step(plain, x)
    model = _model(make)
    sink = RecordingSink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with inject_observer(model, sampler=AlwaysSampler(), sink=sink, error_policy="warn"):
            loss = _step(model, x)
    assert torch.equal(loss, expected_loss)
    for before, after in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(before, after)
    assert [w.category for w in caught] == ([ObservationWarning] if warns else [])
    _assert_strict(sink.rows)
    odd = [row for row in sink.rows if (row.layer, row.signal, row.tensor_path) == ODD_SITE]
    assert len(odd) == len(DEFAULT_METRICS)
    if reason is None:
        assert all(row.value is not None for row in odd), odd
    else:
        assert {(row.unavailable_reason or "").split(":")[0] for row in odd} == {reason}


def test_an_odd_output_warns_as_an_observation_warning_once() -> None:
    """A tensor the observer cannot even inspect: one ObservationWarning naming the site.

    Three training steps record the reason every time and warn once.
    """
    model = _model(ODD["metadata_raises"][0])
    sink = RecordingSink()
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    pattern = r"on 1 call 0 output output\.1.*metadata"
    with pytest.warns(ObservationWarning, match=pattern) as caught:
        _steps(model, 3)
    observer.remove()
    assert len(caught) == 1
    odd = [r for r in sink.rows if (r.layer, r.signal, r.tensor_path) == ODD_SITE]
    assert len(odd) == 3 * len(DEFAULT_METRICS)
    assert {r.unavailable_reason for r in odd} == {
        "reducer_error: RuntimeError: metadata unavailable"
    }


def _steps(model: nn.Module, count: int) -> None:
    for _ in range(count):
        _step(model, torch.randn(5, 4))


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_nested_tensor_is_measured_over_its_components(layout: torch.layout) -> None:
    """A nested tensor's statistics are those of all its components' entries together."""
    components = [torch.randn(2, 3), torch.randn(5, 3) * 4 + 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        value = torch.nested.nested_tensor(components, layout=layout)
    rows = _observe(value)
    entries = torch.cat([c.reshape(-1) for c in components]).double()
    assert rows["mean"] == pytest.approx(entries.mean().item(), rel=1e-6)
    assert rows["std"] == pytest.approx(entries.std(unbiased=False).item(), rel=1e-6)
    assert rows["max_abs"] == pytest.approx(entries.abs().max().item(), rel=1e-6)
    assert rows["p50"] == pytest.approx(entries.quantile(0.5).item(), rel=1e-6)


def test_a_narrowed_jagged_tensor_is_measured_without_its_holes() -> None:
    """A non-contiguous jagged tensor (with holes in its buffer) counts only its components."""
    base = torch.arange(12.0).reshape(2, 6)
    value = torch.nested.narrow(
        base, 1, torch.tensor([0, 2]), torch.tensor([2, 3]), layout=torch.jagged
    )
    rows = _observe(value)
    entries = torch.tensor([0.0, 1.0, 8.0, 9.0, 10.0])
    assert rows["mean"] == pytest.approx(entries.mean().item())
    assert rows["max"] == 10.0


class Wrap(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return two_tensor.TwoTensor(x, x * 2)


def test_a_wrapper_subclass_through_forward_and_backward() -> None:
    """A model whose middle module outputs a TwoTensor trains as without an observer.

    Its output and output_gradient rows say tensor_subclass (before, the backward raised on
    ``.tolist()``), with no warning; the model's output and gradients are bit-identical.
    """
    x = torch.randn(6, 3)

    def run(observe: bool) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]], RecordingSink]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), Wrap(), nn.Linear(3, 2))
        sink = RecordingSink()
        observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink) if observe else None
        out = model(x)
        out.sum().backward()
        if observer is not None:
            observer.remove()
        return out.detach(), [_parts(p.grad) for p in model.parameters()], sink

    expected_out, expected_grads, _ = run(observe=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, grads, sink = run(observe=True)
    assert all(map(torch.equal, _parts(out), _parts(expected_out)))
    for got, want in zip(grads, expected_grads, strict=True):
        assert len(got) == len(want)
        assert all(map(torch.equal, got, want))
    _assert_strict(sink.rows)
    wrapped = {(str(r.signal), r.unavailable_reason) for r in sink.rows if r.layer == "1"}
    assert wrapped == {("output", "tensor_subclass"), ("output_gradient", "tensor_subclass")}
    assert all(r.value is not None for r in sink.rows if (r.layer, r.signal) == ("0", "output"))


def _parts(tensor: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The plain tensors inside a TwoTensor, a plain tensor alone, nothing for ``None``."""
    if tensor is None:
        return ()
    if isinstance(tensor, two_tensor.TwoTensor):
        return (tensor.a.clone(), tensor.b.clone())
    return (tensor.clone(),)


def _observe(value: torch.Tensor) -> dict[str, float | None]:
    class Emit(nn.Module):
        def forward(self, _: torch.Tensor) -> torch.Tensor:
            return value

    model = Emit()
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        model(torch.zeros(1))
    _assert_strict(sink.rows)
    return {row.metric: row.value for row in sink.rows}


class RequiresGradRaises(torch.Tensor):
    """A subclass whose ``requires_grad`` cannot be read from Python."""

    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        raise RuntimeError("requires_grad is not readable here")


class Unwalkable(dict):  # type: ignore[type-arg]
    """A mapping output whose items cannot be listed."""

    def items(self):
        raise RuntimeError("items() refused")


class OddOutputs(nn.Module):
    """Returns what ``kind`` asks for beside a plain tensor the next layer uses."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        if self.kind == "requires_grad":
            return x.as_subclass(RequiresGradRaises)
        return Unwalkable(hidden=x)


class OddNet(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.first, self.odd, self.last = nn.Linear(4, 4), OddOutputs(kind), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.odd(self.first(x))
        hidden = out["hidden"] if isinstance(out, dict) else out.as_subclass(torch.Tensor)
        return self.last(hidden)


@pytest.mark.parametrize("kind", ["requires_grad", "unwalkable"])
def test_an_output_the_observer_cannot_walk_never_breaks_training(kind: str) -> None:
    """Reading an output's structure or autograd state raises: one warning, training goes on."""
    torch.manual_seed(0)
    model = OddNet(kind)
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        with pytest.warns(ObservationWarning, match="observing the output of odd failed"):
            model(torch.randn(3, 4)).sum().backward()
        model(torch.randn(3, 4)).sum().backward()  # warned once per cause
    assert len(sink.samples) == 2
    assert sink.value("last", "output_gradient", "mean", sample_id=1) == 1.0


@pytest.mark.parametrize("path", ["hooks", "worker", "queue"])
def test_an_efficient_zero_tensor_is_measured_as_the_zeros_it_stands_for(path: str) -> None:
    """Autograd's memoryless zero tensor (address 0) gives the statistics of zeros.

    It used to raise in the hook (its storage cannot be read), and the compiled kernels would
    have read address 0. A small sample's tensors go to the kernels' queue (``queue``, where
    there is one), copied there: the copy holds the zeros.
    """
    from torchinstruments_core._measure import Measurer
    from torchinstruments_core.reducers import HistogramReducer, default_reducers

    zero = torch._efficientzerotensor(1000)
    background = path != "hooks"
    measurer = Measurer(default_reducers(), HistogramReducer(bins=8), background=background)
    if path == "queue":
        measurer.new_sample()
        measurer._small = True  # as after a small forward sample
    try:
        measured = measurer.measure(zero, with_histogram=True)
        assert measured.settle() is None
        assert measured.reason is None
        values = [value for result in measured.results for value in _values(result.values)]
        assert values[:6] == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]  # mean, std, min, max, zero, nonfinite
        assert measured.histogram is not None
        assert sum(floats(measured.histogram)[3:11]) == 1000
    finally:
        measurer.close()


def _values(values: torch.Tensor | list[float] | None) -> list[float]:
    return floats(values)
