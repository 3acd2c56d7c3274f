"""The optimizer step signals in a plain loop, against float64 copies taken by the test.

The test's own step hooks (registered before the observer's) copy the parameters before the
update, and the gradients, the parameters after it and the optimizer's state after it; every
recorded value is checked against statistics of those copies.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from optimizer_helpers import (
    MODEL,
    Reference,
    adam_ratio,
    assert_matches,
    closure_for,
    count_summed_gradients,
    float64_mlp,
    one_adam_step,
    parameter_names,
    split,
    stats,
    step_records,
    train,
    values_of,
)
from torchinstruments_core import (
    AlwaysSampler,
    ConfigurationError,
    EveryNForwardsSampler,
    RecordKind,
    SampleRecord,
    inject_observer,
)
from torchinstruments_core.reducers import _native
from torchinstruments_core.testing import RecordingSink


def _check_parameters(record: SampleRecord, reference: Any) -> None:
    rows = values_of(record)
    for name, before in reference.before.items():
        layer, path = split(name)
        assert_matches(rows, layer, "parameter", path, stats(before), rel=1e-9)
        assert_matches(
            rows, layer, "parameter_gradient", path, stats(reference.gradient[name]), rel=1e-9
        )
        update = reference.after[name] - before
        assert_matches(rows, layer, "update", path, stats(update), rel=1e-6)
        ratio = update.square().mean().sqrt() / before.square().mean().sqrt()
        assert rows[(layer, "update", path, "update_to_weight")] == pytest.approx(ratio.item())


def _check_wholefloat64_mlp(record: SampleRecord, reference: Any) -> None:
    rows = values_of(record)
    gradients = list(reference.gradient.values())
    holders = [torch.zeros_like(g, requires_grad=True) for g in gradients]
    for holder, gradient in zip(holders, gradients, strict=True):
        holder.grad = gradient.clone()
    total = torch.nn.utils.clip_grad_norm_(holders, max_norm=float("inf"))
    assert rows[(MODEL, "parameter_gradient", "*", "l2_norm")] == pytest.approx(total.item())
    zeros = sum(int((g == 0).sum()) for g in gradients)
    assert rows[(MODEL, "parameter_gradient", "*", "zero_count")] == zeros
    assert rows[(MODEL, "parameter_gradient", "*", "nonfinite_count")] == 0
    updates = [reference.after[n] - reference.before[n] for n in reference.before]
    update_norm = torch.linalg.vector_norm(torch.cat([u.reshape(-1) for u in updates]))
    assert rows[(MODEL, "update", "*", "l2_norm")] == pytest.approx(update_norm.item())


def test_sgd_rows_match_float64_copies() -> None:
    """SGD with momentum: every step row equals float64 statistics of the test's copies.

    Parameter, gradient, update, update_to_weight, momentum buffer and the whole-model rows.
    """
    model = float64_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    reference = Reference(optimizer, parameter_names(model))
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
        train(model, [optimizer], steps=3)
    records = step_records(sink)
    assert len(records) == len(reference.steps) == 3
    for record, copies in zip(records, reference.steps, strict=True):
        _check_parameters(record, copies)
        _check_wholefloat64_mlp(record, copies)
        rows = values_of(record)
        for name, state in copies.state.items():
            layer, path = split(name)
            momentum = stats(state["momentum_buffer"])
            assert_matches(
                rows, layer, "optimizer_state", f"{path}.momentum_buffer", momentum, rel=1e-9
            )


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.Adam(p, lr=0.01),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    ],
    ids=["Adam", "AdamW", "Adam-amsgrad"],
)
def test_adam_family_moments_and_ratio_match_float64_copies(make: Any) -> None:
    """Adam, AdamW, amsgrad Adam: the moments and rms(g / sqrt(v_hat)) match float64 copies.

    The ratio sits on the exp_avg_sq row and uses the max moment under amsgrad.
    """
    model = float64_mlp()
    optimizer = make(model.parameters())
    amsgrad = optimizer.param_groups[0]["amsgrad"]
    reference = Reference(optimizer, parameter_names(model))
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
        train(model, [optimizer], steps=3)
    records = step_records(sink)
    assert len(records) == 3
    for record, copies in zip(records, reference.steps, strict=True):
        _check_parameters(record, copies)
        rows = values_of(record)
        for name, state in copies.state.items():
            layer, path = split(name)
            for key in ("exp_avg", "exp_avg_sq"):
                expected = stats(state[key])
                assert_matches(rows, layer, "optimizer_state", f"{path}.{key}", expected, rel=1e-9)
            second = state["max_exp_avg_sq"] if amsgrad else state["exp_avg_sq"]
            ratio = adam_ratio(copies.gradient[name], second, copies.step[name], beta2=0.999)
            row = (layer, "optimizer_state", f"{path}.exp_avg_sq", "gradient_rms_ratio")
            assert rows[row] == pytest.approx(ratio, rel=1e-9)


def test_each_optimizer_has_its_own_record_with_its_own_parameters() -> None:
    """Two optimizers: one record per optimizer step, with the rows of its own parameters.

    The whole-model gradient norm of each record covers the parameters that optimizer steps.
    """
    model = float64_mlp()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    last = torch.optim.Adam(model[2].parameters(), lr=0.01)
    references = [Reference(first, parameter_names(model)), Reference(last, parameter_names(model))]
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=[first, last]):
        train(model, [first, last], steps=2)
    records = step_records(sink)
    assert len(records) == 4
    for index, record in enumerate(records):
        copies = references[index % 2].steps[index // 2]
        layers = {row.layer for row in record.rows}
        assert layers == {"0" if index % 2 == 0 else "2", MODEL}
        _check_parameters(record, copies)
        _check_wholefloat64_mlp(record, copies)


def test_only_the_step_after_a_sampled_forward_is_recorded() -> None:
    """Only the step after a sampled forward is recorded; the others run no extra operator.

    Every third forward is sampled; the unsampled optimizer steps dispatch exactly the operators
    of an unobserved optimizer's steps.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            self.calls += 1
            return func(*args, **(kwargs or {}))

    def counted_steps(observed: bool) -> list[int]:
        model = float64_mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        sink = RecordingSink()
        arguments: dict[str, Any] = {"optimizer": optimizer} if observed else {}
        counts = []
        with inject_observer(model, sampler=EveryNForwardsSampler(3), sink=sink, **arguments):
            for index in range(6):
                model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
                with Count() as count:
                    optimizer.step()
                counts.append(count.calls)
                optimizer.zero_grad()
                del index
        assert len(step_records(sink)) == (2 if observed else 0)
        return counts

    observed, bare = counted_steps(True), counted_steps(False)
    unsampled = [1, 2, 4, 5]
    assert [observed[i] for i in unsampled] == [bare[i] for i in unsampled]
    assert observed[0] > bare[0]
    assert observed[3] > bare[3]


def test_removal_leaves_no_hook_and_no_reference() -> None:
    """Removal leaves the optimizer no hook and no reference; its steps record nothing."""
    import gc
    import weakref

    model = float64_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = RecordingSink()
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer)
    observer.watch_optimizer(optimizer)  # a second watch adds nothing
    assert (
        len(optimizer._optimizer_step_pre_hooks) == len(optimizer._optimizer_step_post_hooks) == 1
    )
    observer.remove()
    assert not optimizer._optimizer_step_pre_hooks
    assert not optimizer._optimizer_step_post_hooks
    train(model, [optimizer], steps=1)
    assert sink.samples == []
    alive = weakref.ref(optimizer)
    del optimizer
    gc.collect()
    assert alive() is None


def test_step_signals_choose_the_rows() -> None:
    """``step_signals`` records only the signals named (the whole-model rows go with them)."""
    record = one_adam_step(step_signals=["parameter_gradient"])
    assert {str(r.signal) for r in record.rows} == {"parameter_gradient"}
    assert {r.layer for r in record.rows} == {"0", "2", MODEL}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"step_signals": ["output"]},
            r"step_signals=\['output'\].*'parameter', 'parameter_gradient'",
        ),
        ({"optimizer": "adam"}, r"optimizer='adam'.*torch.optim.Optimizer"),
        ({"optimizer": [object]}, r"optimizer=<class 'object'>.*torch.optim.Optimizer"),
    ],
)
def test_bad_step_arguments_fail_naming_argument_value_and_choices(
    arguments: dict[str, Any], message: str
) -> None:
    """A bad ``step_signals`` or ``optimizer`` fails at once, naming it, value and choices."""
    with pytest.raises(ConfigurationError, match=message):
        inject_observer(float64_mlp(), sink=RecordingSink(), **arguments)


def test_a_closure_is_measured_after_it_ran() -> None:
    """``optimizer.step(closure)``: the gradients are the closure's, measured after it ran.

    The parameters are those before the update.
    """
    model = float64_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = Reference(optimizer, parameter_names(model))
    sink = RecordingSink()
    closure = closure_for(model, optimizer)
    with inject_observer(model, sink=sink, optimizer=optimizer) as observer:
        for step in range(2):
            observer.begin_step(step, sample=True)
            optimizer.step(closure)
            observer.end_step()
    records = step_records(sink)
    assert [r.step for r in records] == [0, 1]
    for record, copies in zip(records, reference.steps, strict=True):
        _check_parameters(record, copies)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_whole_model_row_counts_non_finite_and_zero_gradient_entries(dtype: torch.dtype) -> None:
    """A NaN, an infinity and zeros the optimizer is handed show in the whole-model row.

    The loop puts them in the gradients between the backward and the step; the row's counts
    are torch's of the gradients the optimizer used.
    """
    torch.manual_seed(0)
    first, last = nn.Linear(4, 8), nn.Linear(8, 3)
    model = nn.Sequential(first, nn.Tanh(), last).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    reference = Reference(optimizer, parameter_names(model))
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
        model(torch.randn(16, 4, dtype=dtype)).square().mean().backward()
        assert first.weight.grad is not None
        assert last.bias.grad is not None
        first.weight.grad.view(-1)[:3] = torch.tensor([math.nan, 0.0, 0.0])
        last.bias.grad.view(-1)[:3] = torch.tensor([math.inf, -0.0, -0.0])
        optimizer.step()
    (record,) = step_records(sink)
    gradients = list(reference.steps[0].gradient.values())
    rows = values_of(record)
    assert rows[(MODEL, "parameter_gradient", "*", "nonfinite_count")] == 2
    zeros = sum(int((g == 0).sum()) for g in gradients)
    assert zeros >= 4
    assert rows[(MODEL, "parameter_gradient", "*", "zero_count")] == zeros


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ],
    ids=["AdamW", "Adam-amsgrad", "SGD-momentum"],
)
def test_step_rows_off_the_hooks_equal_those_in_them(make: Any) -> None:
    """Reduced on the workers, every step row is what the hooks give, and matches float64 copies.

    Off the hooks (``background_reductions=True``) a parameter is reduced from the copy its
    update is then formed in, and the update and the optimizer's state where they are; three
    steps, each checked against the test's float64 copies.
    """
    records = {}
    for background_reductions in (True, False):
        model = float64_mlp()
        records[background_reductions] = _checked_steps(
            model, make(model.parameters()), 3, background_reductions=background_reductions
        )
    assert [r.rows for r in records[True]] == [r.rows for r in records[False]]
    assert [r.histograms for r in records[True]] == [r.histograms for r in records[False]]


@pytest.mark.parametrize("background_reductions", [True, False])
def test_parameters_of_one_shape_keep_copies_of_their_own(background_reductions: bool) -> None:
    """Parameters of one dtype and shape each get their own copy, step after step.

    The copies' memory is kept from one recorded step to the next (``CopyBuffers``, one buffer
    per dtype and shape while it is free): three weights and three biases of one shape, five
    AdamW steps, every parameter and update row against the test's float64 copies.
    """
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3)
    ).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    records = _checked_steps(model, optimizer, 5, background_reductions=background_reductions)
    assert len(records) == 5


def _checked_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    *,
    background_reductions: bool,
) -> list[SampleRecord]:
    """``steps`` recorded steps, each one's parameter and update rows checked; the records."""
    recorded = _recorded(model, optimizer, steps, background_reductions=background_reductions)
    for record, copies in recorded:
        _check_parameters(record, copies)
    return [record for record, _ in recorded]


def _recorded(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, **options: Any
) -> list[tuple[SampleRecord, Any]]:
    """``steps`` steps of ``train``, every one recorded: each record with the test's copies."""
    reference = Reference(optimizer, parameter_names(model))
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer, **options):
        train(model, [optimizer], steps=steps)
    records = step_records(sink)
    assert len(records) == len(reference.steps) == steps
    return list(zip(records, reference.steps, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_step_rows_match_float64_copies() -> None:
    """On CUDA, every step row of an AdamW step matches the test's float64 copies.

    The parameter is reduced from the copy its update is then formed in, on the same stream:
    the reductions read it before the update is written into it.
    """
    model = float64_mlp().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    reference = Reference(optimizer, parameter_names(model))
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
        for index in range(3):
            torch.manual_seed(100 + index)
            batch = torch.randn(16, 4, dtype=torch.float64, device="cuda")
            model(batch).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    records = step_records(sink)
    assert len(records) == 3
    for record, copies in zip(records, reference.steps, strict=True):
        _check_parameters(record, copies)


@pytest.mark.skipif(not _native.QUEUE, reason="the kernels have no queue here")
def test_the_whole_model_row_takes_each_observed_gradient_s_own_reduction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An observed gradient or weight that the kernels' queue reduced makes no second pass.

    A gradient's sum of squares and zeros for the whole-model row, and a weight's norm before
    the step for ``update_to_weight``, come from its own reduction (``Measurement.summary``);
    the gradient of an unobserved module is summed for the row alone. The row still holds
    ``clip_grad_norm_``'s norm and torch's zero count of every gradient the optimizer used,
    and ``update_to_weight`` the ratio of the test's copies.
    """
    from torchinstruments_core import by_name

    summed = count_summed_gradients(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    recorded = _recorded(model, optimizer, 2, selector=by_name("0"), background_reductions=True)
    assert sorted(summed) == [3, 3, 24, 24]  # the unobserved Linear(8, 3), each step
    for record, copies in recorded:
        rows = values_of(record)
        gradients = list(copies.gradient.values())
        every = torch.cat([g.reshape(-1) for g in gradients])
        norm = rows[(MODEL, "parameter_gradient", "*", "l2_norm")]
        assert norm == pytest.approx(torch.linalg.vector_norm(every).item(), rel=1e-6)
        zeros = int((every == 0).sum())
        assert rows[(MODEL, "parameter_gradient", "*", "zero_count")] == zeros
        assert rows[(MODEL, "parameter_gradient", "*", "nonfinite_count")] == 0
        for name in ("weight", "bias"):
            before = copies.before[f"0.{name}"]
            update = copies.after[f"0.{name}"] - before
            ratio = update.square().mean().sqrt() / before.square().mean().sqrt()
            assert rows[("0", "update", name, "update_to_weight")] == pytest.approx(ratio.item())


def _float32_records(steps: int) -> tuple[list[SampleRecord], Reference]:
    """``steps`` recorded AdamW steps of a seeded float32 model with a channels_last conv."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    model[0].to(memory_format=torch.channels_last)  # a strided weight: torch forms its update
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    reference = Reference(optimizer, parameter_names(model))
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
        for index in range(steps):
            torch.manual_seed(100 + index)
            model(torch.randn(16, 3, 8, 8)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return step_records(sink), reference


@pytest.mark.skipif(_native.KERNELS is None, reason="the kernels are not built here")
def test_float32_updates_formed_by_the_kernels_equal_torch_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernels form each dense CPU update and its norm in one pass: torch's rows.

    A float32 model under AdamW, three recorded steps, observed twice: as it is, and with
    ``differs_here`` answering no (torch's ``sub`` and ``norm`` for every update). The updates'
    statistics and histograms are the same, bit for bit; ``update_to_weight`` and the whole
    update's norm agree to float32's rounding (the kernels sum the squares in float64) and
    match the test's float64 copies. The kernels formed every update but the channels_last
    conv weight's (strided: torch's).
    """
    formed: list[int] = []
    difference_squares = _native.difference_squares

    def counted(after: torch.Tensor, before: torch.Tensor) -> float:
        formed.append(before.numel())
        return difference_squares(after, before)

    monkeypatch.setattr(_native, "difference_squares", counted)
    kernels, reference = _float32_records(3)
    assert sorted(formed) == sorted([4, 144 * 5, 5] * 3)  # not the conv weight's 108
    monkeypatch.setattr(_native, "differs_here", lambda after, before: False)
    formed.clear()
    torch_records, _ = _float32_records(3)
    assert formed == []
    for ours, theirs, copies in zip(kernels, torch_records, reference.steps, strict=True):
        assert ours.histograms == theirs.histograms
        mine, other = values_of(ours), values_of(theirs)
        assert mine.keys() == other.keys()
        for key, value in mine.items():
            derived = key[3] == "update_to_weight" or (key[0] == MODEL and key[3] == "l2_norm")
            if key[1] == "update" and derived:
                assert value == pytest.approx(other[key], rel=2e-7), key
            else:
                assert value == other[key], key
        for name, before in copies.before.items():
            layer, path = split(name)
            update = copies.after[name] - before
            ratio = update.square().mean().sqrt() / before.square().mean().sqrt()
            got = mine[(layer, "update", path, "update_to_weight")]
            assert got == pytest.approx(ratio.item(), rel=1e-5)
        updates = [copies.after[n] - copies.before[n] for n in copies.before]
        total = torch.linalg.vector_norm(torch.cat([u.reshape(-1) for u in updates])).item()
        assert mine[(MODEL, "update", "*", "l2_norm")] == pytest.approx(total, rel=1e-5)


@pytest.mark.parametrize("optimizer_kind", ["SGD", "SparseAdam"])
def test_a_sparse_gradient_counts_in_the_whole_model_row(optimizer_kind: str) -> None:
    """A sparse embedding's gradient: its stored values and its unstored zeros count.

    The norm is ``clip_grad_norm_``'s over the same gradients (repeated indices summed), the
    zero count that of the dense gradients; the embedding's own rows stay unavailable
    (``sparse_tensor``). SparseAdam steps the embedding alone: its row is the embedding's.
    """
    torch.manual_seed(0)
    embedding = nn.Embedding(50, 16, sparse=True)
    model = nn.Sequential(embedding, nn.Flatten(), nn.Linear(48, 1))
    if optimizer_kind == "SGD":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        stepped = list(model.parameters())
    else:
        optimizer = torch.optim.SparseAdam(embedding.parameters(), lr=0.01)
        stepped = list(embedding.parameters())
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
        model(torch.tensor([[1, 2, 2], [3, 1, 4]])).square().mean().backward()
        gradients = [p.grad.to_dense() for p in stepped if p.grad is not None]
        expected = float(torch.nn.utils.clip_grad_norm_(stepped, math.inf))
        optimizer.step()
    (record,) = step_records(sink)
    rows = values_of(record)
    assert rows[(MODEL, "parameter_gradient", "*", "l2_norm")] == pytest.approx(expected, rel=1e-6)
    zeros = sum(int((g == 0).sum()) for g in gradients)
    assert zeros > 16 * 40  # the rows of the indices not looked up
    assert rows[(MODEL, "parameter_gradient", "*", "zero_count")] == zeros
    assert rows[(MODEL, "parameter_gradient", "*", "nonfinite_count")] == 0
    assert rows[("0", "parameter_gradient", "weight", "rms")] is None
    reasons = {
        (r.layer, r.tensor_path): r.unavailable_reason
        for r in record.rows
        if str(r.signal) == "parameter_gradient" and r.metric == "rms"
    }
    assert reasons[("0", "weight")] == "sparse_tensor"


class _Scaled(nn.Module):
    """A leaf module: a weight and a learnable 0-d scale (as CLIP's ``logit_scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight * self.scale


@pytest.mark.parametrize(
    ("make", "kept"),
    [
        (lambda p: torch.optim.Adam(p, lr=0.01), {"exp_avg", "exp_avg_sq"}),
        (lambda p: torch.optim.NAdam(p, lr=0.01), {"exp_avg", "exp_avg_sq"}),
        (lambda p: torch.optim.ASGD(p, lr=0.01), {"ax"}),
    ],
    ids=["Adam", "NAdam", "ASGD"],
)
def test_a_0d_parameter_s_state_rows_leave_its_scalar_counters_out(
    make: Any, kept: set[str]
) -> None:
    """A 0-d parameter's state rows are its moments only, as any other parameter's.

    It shares its shape with the optimizer's ``step`` (and NAdam's ``mu_product``, ASGD's
    ``eta`` and ``mu``), which are left out all the same.
    """
    model = nn.Sequential(_Scaled())
    optimizer = make(model.parameters())
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
        for _ in range(2):
            model(torch.randn(8, 4)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for record in step_records(sink):
        paths = {r.tensor_path for r in record.rows if str(r.signal) == "optimizer_state"}
        assert {p.removeprefix("scale.") for p in paths if p.startswith("scale.")} == kept
        assert {p.removeprefix("weight.") for p in paths if p.startswith("weight.")} == kept


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.LBFGS(p, lr=0.1, max_iter=1),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ],
    ids=["LBFGS", "SGD"],
)
def test_a_plain_loop_s_closure_step_records_its_own_sampled_forward(make: Any) -> None:
    """``optimizer.step(closure)`` in a plain loop: the forward runs inside the step.

    The steps whose closure ran a sampled forward are the ones recorded (every other forward
    sampled: steps 0, 2, 4), each with the parameters it started from, not the next step
    with a forward that was not its own.
    """
    model = float64_mlp()
    optimizer = make(model.parameters())
    reference = Reference(optimizer, parameter_names(model))
    sink = RecordingSink()
    closure = closure_for(model, optimizer)
    with inject_observer(model, sampler=EveryNForwardsSampler(2), sink=sink, optimizer=optimizer):
        for _ in range(6):
            optimizer.step(closure)
    records = step_records(sink)
    forwards = [s for s in sink.samples if s.kind is not RecordKind.STEP]
    assert len(forwards) == 3
    assert len(records) == 3
    for record, copies in zip(records, reference.steps[0::2], strict=True):
        _check_parameters(record, copies)
