"""Every gradient lands on the sample and call of the forward that produced its output."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn

from helpers import mlp, rows_of
from torchinstruments_core import AlwaysSampler, Signal, inject_observer
from torchinstruments_core.testing import RecordingSink


class Twice(nn.Module):
    """Calls the same Linear twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(self.shared(x) * 3.0)


def _gradient_mean(sink: RecordingSink, sample_id: int, layer: str, call: int = 0) -> float | None:
    return sink.value(layer, "output_gradient", "mean", sample_id=sample_id, call_index=call)


def test_module_called_twice_gets_one_call_index_per_call() -> None:
    """A module called twice in one forward has call 0 and call 1, each with its own gradient."""
    model = Twice()
    sink = RecordingSink()
    x = torch.randn(5, 4)
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        first = model.shared(x)  # outside a root forward: not observed
        out = model(x)
        out.sum().backward()
    assert first is not None
    assert rows_of(sink) == [
        ("shared", 0, "output", "output"),
        ("shared", 1, "output", "output"),
        ("shared", 1, "output_gradient", "output"),
        ("shared", 0, "output_gradient", "output"),
    ]
    # d(sum)/d(out of call 1) = 1; d(sum)/d(out of call 0) = 3 * W^T 1, so means differ.
    assert _gradient_mean(sink, 0, "shared", 1) == pytest.approx(1.0)
    expected = (3.0 * model.shared.weight.sum(0)).mean().item()
    assert _gradient_mean(sink, 0, "shared", 0) == pytest.approx(expected, rel=1e-5)


def test_outstanding_forwards_then_one_backward_of_the_summed_losses() -> None:
    """Several forwards, one backward of their summed losses: each gradient finds its sample."""
    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        outs = [model(torch.randn(3, 4)) for _ in range(3)]
        assert sink.samples == []  # all three wait for their backward
        sum(out.sum() * (i + 1) for i, out in enumerate(outs)).backward()
    assert sorted(s.sample_id for s in sink.samples) == [0, 1, 2]
    for sample_id in range(3):
        assert _gradient_mean(sink, sample_id, "2") == pytest.approx(sample_id + 1.0)
    assert not any(s.forward_only for s in sink.samples)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "eval"])
def test_forward_only_samples_are_complete(mode: str) -> None:
    """Forwards under no_grad, inference_mode or eval() are complete, forward-only samples."""
    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        if mode == "no_grad":
            with torch.no_grad():
                model(torch.randn(2, 4))
        elif mode == "inference_mode":
            with torch.inference_mode():
                model(torch.randn(2, 4))
        else:
            model.eval()
            out = model(torch.randn(2, 4))
            del out  # the graph is freed without a backward
        assert len(sink.samples) == 1
    sample = sink.samples[0]
    assert sample.forward_only
    assert {row.signal for row in sample.rows} == {Signal.OUTPUT}
    assert rows_of(sink) == [
        ("0", 0, "output", "output"),
        ("1", 0, "output", "output"),
        ("2", 0, "output", "output"),
    ]
    assert all(row.value is not None for row in sample.rows)


def test_autograd_grad_is_recorded_like_backward() -> None:
    """torch.autograd.grad instead of backward() delivers the same gradient rows."""
    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        out = model(torch.randn(3, 4))
        torch.autograd.grad(out.sum() * 2.0, list(model.parameters()))
    assert _gradient_mean(sink, 0, "2") == pytest.approx(2.0)
    assert not sink.samples[0].forward_only


def test_retain_graph_records_only_the_first_backward() -> None:
    """With retain_graph=True and a second backward, the first backward's gradients are recorded."""
    model = mlp()
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        out = model(torch.randn(3, 4))
        (out.sum() * 2.0).backward(retain_graph=True)
        (out.sum() * 5.0).backward()
    assert len(sink.samples) == 1
    assert _gradient_mean(sink, 0, "2") == pytest.approx(2.0)
    gradient_rows = [
        r for r in sink.rows if r.signal is Signal.OUTPUT_GRADIENT and r.metric == "mean"
    ]
    assert len(gradient_rows) == 3


def test_output_without_gradient_is_marked() -> None:
    """An output that the backward never reaches gets rows saying no_gradient, not silence."""

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 2)
            self.unused = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.used(x), self.unused(x)

    model = TwoHeads()
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        used, _ = model(torch.randn(3, 4))
        used.sum().backward()
    rows = [r for r in sink.rows if r.layer == "unused" and r.signal is Signal.OUTPUT_GRADIENT]
    assert rows
    assert {(r.value, r.unavailable_reason) for r in rows} == {(None, "no_gradient")}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.inner(x))


class CheckpointedNet(nn.Module):
    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(4, 1)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = checkpoint.checkpoint(self.block, x, use_reentrant=self.use_reentrant)
        return self.head(hidden)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_block_gives_no_phantom_or_duplicate_rows(use_reentrant: bool) -> None:
    """Recomputing a checkpointed block in the backward adds no sample and no duplicate row."""
    model = CheckpointedNet(use_reentrant)
    sink = RecordingSink()
    x = torch.randn(3, 4, requires_grad=True)
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        model(x).sum().backward()
    assert len(sink.samples) == 1
    observed = rows_of(sink)
    assert len(observed) == len(set(observed))
    assert ("block.inner", 1, "output", "output") not in observed
    assert ("block.inner", 0, "output", "output") in observed
    assert ("head", 0, "output_gradient", "output") in observed
    # Both forms record the gradients inside the block: the reentrant one from its recomputation.
    assert ("block.inner", 0, "output_gradient", "output") in observed
    # every row of the sample holds one value per metric, never two
    keys = [(r.layer, r.call_index, r.signal, r.tensor_path, r.metric) for r in sink.rows]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_around_the_observed_root(use_reentrant: bool) -> None:
    """Checkpointing the observed root itself: the recomputation is not a second sample."""
    model = mlp()
    sink = RecordingSink()
    x = torch.randn(3, 4, requires_grad=True)
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink) as observer:
        out = checkpoint.checkpoint(model, x, use_reentrant=use_reentrant)
        out.sum().backward()
        assert observer.next_sample_id == 1
    assert len(sink.samples) == 1
    observed = rows_of(sink)
    assert len(observed) == len(set(observed))
    assert all(call == 0 for _, call, _, _ in observed)


def test_inplace_op_after_module() -> None:
    """An in-place ReLU right after a Linear: forward stats are the Linear's own output."""
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(inplace=True), nn.Linear(16, 1))
    reference = nn.Sequential(nn.Linear(4, 16), nn.ReLU(inplace=True), nn.Linear(16, 1))
    reference.load_state_dict(model.state_dict())
    sink = RecordingSink()
    x = torch.randn(64, 4)
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        out = model(x)
        out.sum().backward()
    ref_out = reference(x)
    ref_out.sum().backward()
    assert torch.equal(out, ref_out)
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got.grad, expected.grad)  # type: ignore[arg-type]
    pre_activation = reference[0](x)
    assert sink.value("0", "output", "min") == pytest.approx(pre_activation.min().item())
    assert sink.value("0", "output", "min") < 0  # type: ignore[operator]  # recorded before the in-place ReLU
    grad_of_linear = (pre_activation > 0) * reference[2].weight
    assert sink.value("0", "output_gradient", "mean") == pytest.approx(
        grad_of_linear.mean().item(), abs=1e-6
    )


def test_capture_direct_forwards_observes_forward_calls_and_restores_them() -> None:
    """With capture_direct_forwards, module.forward(x) calls are observed; removal restores them."""

    class Direct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b.forward(self.a.forward(x))  # bypasses module(x) and its hooks

    model = Direct()
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, capture_direct_forwards=True):
        model.forward(torch.randn(3, 4)).sum().backward()
        model(torch.randn(3, 4)).sum().backward()
    assert [s.sample_id for s in sink.samples] == [0, 1]
    assert (
        rows_of(sink, 0)
        == rows_of(sink, 1)
        == [
            ("a", 0, "output", "output"),
            ("b", 0, "output", "output"),
            ("b", 0, "output_gradient", "output"),
            ("a", 0, "output_gradient", "output"),
        ]
    )
    for name, module in model.named_modules():
        assert "forward" not in module.__dict__
        assert dict(module.__dict__) == before[name]
    without = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=without):
        model(torch.randn(3, 4))
    assert rows_of(without) == []  # the default (hooks only) cannot see direct calls


def test_gradients_of_nested_outputs_follow_their_paths() -> None:
    """Gradients of tensors inside a tuple output are matched to their own tensor_path."""

    class Split(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2.0, x * 3.0

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.split = Split()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = self.split(self.lin(x))
            return a.sum() * 5.0 + b.sum() * 7.0

    model = Net()
    sink = RecordingSink()
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, selector=lambda n, m: n == "split"
    ):
        model(torch.randn(2, 4)).backward()
    assert sink.value("split", "output_gradient", "mean", tensor_path="output.0") == pytest.approx(
        5.0
    )
    assert sink.value("split", "output_gradient", "mean", tensor_path="output.1") == pytest.approx(
        7.0
    )


class TwiceBlock(nn.Module):
    """A block that calls one module twice: call 0 and call 1 must each get their gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.inner(self.act(x)))


class SegmentedNet(nn.Module):
    """Two checkpointed segments and an optional head outside them."""

    def __init__(self, mode: str | None, head: bool) -> None:
        super().__init__()
        self.first, self.second = TwiceBlock(), TwiceBlock()
        self.head = nn.Linear(4, 1) if head else None
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in (self.first, self.second):
            if self.mode is None:
                x = block(x)
            else:
                x = checkpoint.checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return self.head(x) if self.head is not None else x


def _gradient_values(mode: str | None, head: bool) -> dict[tuple[str, int, str], float | None]:
    torch.manual_seed(0)
    model = SegmentedNet(mode, head)
    sink = RecordingSink()
    x = torch.randn(8, 4, requires_grad=True)
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        model(x).square().sum().backward()
    assert len(sink.samples) == 1
    assert not sink.samples[0].forward_only
    rows = [r for r in sink.rows if r.signal == "output_gradient"]
    keys = [(r.layer, r.call_index, r.metric) for r in rows]
    assert len(keys) == len(set(keys)), "a gradient recorded twice"
    return {(r.layer, r.call_index, r.metric): r.value for r in rows}


@pytest.mark.parametrize("head", [True, False])
def test_reentrant_checkpointing_records_the_gradients_of_the_first_computation(
    head: bool,
) -> None:
    """use_reentrant=True: each call in the segments gets its gradient as if not checkpointed.

    Matched by module and call_index, also when no observed module lies outside the segments.
    """
    plain = _gradient_values(None, head)
    reentrant = _gradient_values("reentrant", head)
    assert set(reentrant) == set(plain)
    assert ("first.act", 1, "rms") in plain
    for key, value in plain.items():
        assert value is not None
        assert reentrant[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert _gradient_values("non-reentrant", head) == pytest.approx(plain, rel=1e-5, abs=1e-7)


def test_reentrant_checkpoint_never_backpropagated_says_no_gradient() -> None:
    """A segment whose output the loss does not use is never recomputed: its rows say so."""

    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            checkpoint.checkpoint(self.unused, x, use_reentrant=True)
            return self.used(x)

    model, sink = Unused(), RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    rows = [r for r in sink.rows if r.signal == "output_gradient" and r.layer == "unused"]
    assert rows
    assert {(r.value, r.unavailable_reason) for r in rows} == {(None, "no_gradient")}
