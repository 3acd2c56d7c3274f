"""Which optimizer steps are recorded, what a skipped fp16 step leaves, and what a step costs.

The GradScaler path runs for real on the CPU: fp16 autocast with ``torch.amp.GradScaler("cpu")``.
Memory is measured with ``tensor_memory`` (the torch profiler's allocation events) on the CPU and
with ``torch.cuda.max_memory_allocated`` on a GPU.
"""

from __future__ import annotations

import contextlib
import pathlib
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn

from optimizer_helpers import Reference, assert_matches, split, stats, step_records, values_of
from torchinstruments_core import (
    AlwaysSampler,
    EveryNForwardsSampler,
    RecordKind,
    inject_observer,
)
from torchinstruments_core._torch_private import storage_holders
from torchinstruments_core.reducers import MomentsReducer
from torchinstruments_core.run_directory import scan_samples
from torchinstruments_core.testing import RecordingSink, tensor_memory


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _scaled_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    *,
    poison: bool = False,
    clip: float | None = None,
) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(16, 4)).float().square().mean()
    if poison:  # an overflow: the scaler finds inf gradients and skips optimizer.step()
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    if clip is not None:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()


def test_gradients_are_unscaled_and_clipped_as_the_optimizer_sees_them() -> None:
    """fp16 with a GradScaler and clipping: gradients are the unscaled, clipped ones used.

    The gradient rows and the whole-model norm match what the optimizer's step used.
    """
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    names = {id(p): name for name, p in model.named_parameters()}
    reference = Reference(optimizer, names)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
        for _ in range(2):
            _scaled_step(model, optimizer, scaler, clip=0.05)
    records = step_records(sink)
    assert len(records) == 2
    for record, copies in zip(records, reference.steps, strict=True):
        rows = values_of(record)
        for name, gradient in copies.gradient.items():
            layer, path = split(name)
            assert_matches(rows, layer, "parameter_gradient", path, stats(gradient), rel=1e-5)
        norm = rows[("<model>", "parameter_gradient", "*", "l2_norm")]
        assert norm == pytest.approx(0.05, rel=1e-4)  # clipped to max_norm, not scaled by 4096


def test_a_fused_optimizer_gradients_are_unscaled() -> None:
    """A fused AdamW that unscales inside its own step: the gradients are recorded unscaled.

    The GradScaler leaves the scale on the optimizer (``grad_scale``); the rows divide by it and
    match the gradients the fused step left unscaled in ``.grad``.
    """
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    names = {id(p): name for name, p in model.named_parameters()}
    reference = Reference(optimizer, names)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
        _scaled_step(model, optimizer, scaler)
    (record,) = [s for s in sink.samples if s.kind is RecordKind.STEP]
    rows = values_of(record)
    (copies,) = reference.steps
    for name, gradient in copies.gradient.items():
        layer, path = split(name)
        assert_matches(rows, layer, "parameter_gradient", path, stats(gradient), rel=1e-5)
    total = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in copies.gradient.values()]))
    norm = rows[("<model>", "parameter_gradient", "*", "l2_norm")]
    assert norm == pytest.approx(total.item(), rel=1e-5)


def test_a_skipped_step_has_a_note_and_no_rows(tmp_path: pathlib.Path) -> None:
    """A step the GradScaler skips has a record without rows, noted in samples.parquet."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with inject_observer(model, output_dir=tmp_path / "run", optimizer=optimizer) as observer:
        for step in range(3):
            observer.begin_step(step, sample=True)
            _scaled_step(model, optimizer, scaler, poison=step == 1)
            observer.end_step()
    samples = scan_samples(tmp_path / "run").filter(pl.col("kind") == "step").collect()
    assert samples.sort("step").select("step", "note", "rows").rows() == [
        (0, None, samples.filter(pl.col("step") == 0)["rows"].item()),
        (1, "optimizer_step_skipped", 0),
        (2, None, samples.filter(pl.col("step") == 2)["rows"].item()),
    ]
    assert all(rows > 0 for rows in samples.filter(pl.col("step") != 1)["rows"])
    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    step_signals = {"parameter", "parameter_gradient", "update", "optimizer_state"}
    assert history.filter(pl.col("signal").is_in(step_signals))[
        "step"
    ].unique().sort().to_list() == [0, 2]
    index = (tmp_path / "run" / "index.md").read_text()
    assert "| `note` |" in index
    assert "optimizer_step_skipped" in index


def test_runs_without_the_note_column_read_as_null(tmp_path: pathlib.Path) -> None:
    """A samples.parquet written before the ``note`` column existed reads with a null note."""
    model = _model()
    with inject_observer(model, output_dir=tmp_path / "old", sampler=AlwaysSampler()):
        model(torch.randn(2, 4)).sum().backward()
    path = tmp_path / "old" / "samples.parquet"
    pl.read_parquet(path).drop("note").write_parquet(path)
    assert scan_samples(tmp_path / "old").collect()["note"].to_list() == [None]


def test_the_update_copy_is_one_copy_of_the_parameters_kept_until_removal() -> None:
    """CPU: ``update`` costs one copy of the parameters, kept for the next recorded step.

    The first recorded step with ``update`` peaks, and ends, at most the observed parameters'
    size above one without it (the copies' buffers, ``CopyBuffers``); the next recorded step
    allocates nothing more for them; removing the observer frees them (where torch cannot
    count a storage's holders nothing is kept, and each recorded step copies afresh). An
    unsampled step allocates nothing.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Linear(256, 8))
    size = sum(p.numel() * p.element_size() for p in model.parameters())

    def step_memory(signals: tuple[str, ...], every: int) -> list[tuple[int, int]]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        sink = RecordingSink()
        sampler = EveryNForwardsSampler(every)
        found = []
        # inline reductions: the profiler does not see the reduction worker's frees
        observer = inject_observer(
            model,
            sampler=sampler,
            sink=sink,
            optimizer=optimizer,
            step_signals=signals,
            background_reductions=False,
        )
        for _ in range(2):
            model(torch.randn(4, 256)).sum().backward()
            memory = tensor_memory(optimizer.step)
            found.append((memory.peak, memory.net))
            optimizer.zero_grad(set_to_none=False)
        removal = tensor_memory(observer.remove)
        found.append((removal.peak, removal.net))
        return found

    every_signal = ("parameter", "parameter_gradient", "update", "optimizer_state")
    first, second, removal = step_memory(every_signal, every=1)
    first_without, second_without, removal_without = step_memory(
        ("parameter", "parameter_gradient", "optimizer_state"), every=1
    )
    assert size <= first[0] - first_without[0] <= size + 1024
    if storage_holders(torch.empty(0)) is None:  # this torch cannot count: nothing is kept
        assert first[1] == first_without[1] == 0
        assert size <= second[0] - second_without[0] <= size + 1024
        assert removal[1] == removal_without[1] == 0
    else:
        assert first[1] - first_without[1] == size  # kept: the buffers
        assert abs(second[0] - second_without[0]) <= 1024  # the same buffers again
        assert removal[1] - removal_without[1] == -size
    assert second[1] == second_without[1] == 0
    assert step_memory(every_signal, every=100)[1] == (0, 0)  # the first step is recorded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_update_copy_on_cuda_is_bounded_and_freed() -> None:
    """CUDA: ``update`` peaks at most one parameter copy higher and leaves nothing behind."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 8)).to(device)
    size = sum(p.numel() * p.element_size() for p in model.parameters())

    def step_peak(signals: tuple[str, ...]) -> tuple[int, int]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        sink = RecordingSink()
        with inject_observer(
            model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer, step_signals=signals
        ) as observer:
            model(torch.randn(4, 1024, device=device)).sum().backward()
            observer.flush()
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            optimizer.step()
            observer.flush()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - start
            left = torch.cuda.memory_allocated() - start
            optimizer.zero_grad()
        return peak, left

    peak, left = step_peak(("parameter", "parameter_gradient", "update", "optimizer_state"))
    peak_without, left_without = step_peak(("parameter", "parameter_gradient", "optimizer_state"))
    assert peak - peak_without <= size + 64 * 1024  # the caching allocator rounds each block
    assert left <= left_without + 4096


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.AdamW(p, lr=0.01),
        lambda p: torch.optim.AdamW(p, lr=0.01, capturable=True),
    ],
    ids=["SGD", "AdamW", "AdamW-capturable"],
)
def test_a_recorded_cuda_step_never_waits_for_the_device(make: Any) -> None:
    """On CUDA a recorded optimizer step reads nothing on the host (sync debug mode "error")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).cuda()
    optimizer = make(model.parameters())
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
        for _ in range(2):
            model(torch.randn(4, 64, device="cuda")).sum().backward()
            torch.cuda.set_sync_debug_mode("error")
            try:
                optimizer.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            optimizer.zero_grad()
    records = step_records(sink)
    assert len(records) == 2
    assert all(row.value is not None for row in records[-1].rows)


def test_a_step_that_raises_is_delivered_alone_and_never_taken_for_the_next() -> None:
    """Adam raises on a sparse gradient after updating the dense group; the loop goes on.

    The record of that step holds what was measured before it (the parameter, its gradient)
    and no update: its post-hook never ran. It is delivered at the optimizer's next step,
    whose post-hook would otherwise have taken it for its own and formed the update from the
    parameters two steps apart. Every update recorded is the update of one step, as the
    test's own hooks copied it before and after.
    """
    torch.manual_seed(0)
    linear, embedding = nn.Linear(64, 64), nn.Embedding(10, 4, sparse=True)
    model = nn.Sequential(linear)
    optimizer = torch.optim.Adam(
        [{"params": linear.parameters()}, {"params": embedding.parameters()}], lr=1e-2
    )
    names = {id(p): f"0.{n}" for n, p in linear.named_parameters()}
    names |= {id(p): f"embedding.{n}" for n, p in embedding.named_parameters()}
    reference = Reference(optimizer, names)  # registered first: copies before the observer
    sink = RecordingSink()
    raised = []
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
        for step in range(4):
            loss = model(torch.randn(8, 64)).square().mean()
            if step == 0:  # a sparse gradient: Adam raises once the dense group is updated
                loss = loss + embedding(torch.tensor([1, 2])).sum()
            loss.backward()
            try:
                optimizer.step()
            except RuntimeError as error:
                raised.append(str(error))
            optimizer.zero_grad()
    reference.remove()
    assert len(raised) == 1
    assert "sparse" in raised[0]
    records = step_records(sink)
    first = values_of(records[0])
    assert not [key for key in first if key[1] in ("update", "optimizer_state")]
    assert_matches(
        first, "0", "parameter", "weight", stats(reference.steps[0].before["0.weight"]), rel=1e-5
    )
    updates = [
        values[("0", "update", "weight", "rms")]
        for values in map(values_of, records[1:])
        if ("0", "update", "weight", "rms") in values
    ]
    assert updates  # a later step was recorded whole
    expected = [
        stats(copies.after["0.weight"] - copies.before["0.weight"])["rms"]
        for copies in reference.steps[1:]
    ]
    for got in updates:
        assert any(got == pytest.approx(value, rel=1e-4) for value in expected), (got, expected)


def test_a_parameter_listed_twice_is_recorded_once_with_its_own_update() -> None:
    """A 1 MiB weight listed twice in SGD's group (torch only warns) has one set of rows.

    Its copy goes to the kernels' queue where there is one (one torch thread: a free core);
    two entries made the update twice in the same buffer while its reduction read it. Each
    recorded step's rows are one per metric, and the update is the step's own.
    """
    torch.manual_seed(0)
    linear = nn.Linear(512, 512)
    model = nn.Sequential(linear)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        optimizer = torch.optim.SGD([linear.weight, linear.weight, linear.bias], lr=0.1)
    reference = Reference(optimizer, {id(p): f"0.{n}" for n, p in linear.named_parameters()})
    sink = RecordingSink()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
            for _ in range(3):
                model(torch.randn(8, 512)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    reference.remove()
    records = step_records(sink)
    assert len(records) == 3
    for record, copies in zip(records, reference.steps, strict=True):
        keys = [(r.layer, str(r.signal), r.tensor_path, r.metric) for r in record.rows]
        assert len(keys) == len(set(keys))
        rows = values_of(record)
        update = copies.after["0.weight"] - copies.before["0.weight"]
        assert_matches(rows, "0", "update", "weight", stats(update), rel=1e-4)
        assert_matches(rows, "0", "parameter", "weight", stats(copies.before["0.weight"]), rel=1e-5)


class _FirstEntry:
    """A custom reducer whose value is a view of what it is handed: its first entry."""

    metrics = ("first",)

    def reduce(self, tensor: Any) -> torch.Tensor:
        return tensor.values.reshape(-1)[:1]


class _FirstEntryMoments(MomentsReducer):
    """A subclass of a built-in reducer, which may return what a built-in one never does."""

    metrics = ("first",)

    def reduce(self, tensor: Any) -> torch.Tensor:
        return tensor.values.reshape(-1)[:1]


@pytest.mark.parametrize("reducer", [_FirstEntry, _FirstEntryMoments])
@pytest.mark.parametrize("background", [False, True])
def test_a_reducer_s_view_of_a_tensor_read_in_place_keeps_what_it_saw(
    background: bool, reducer: type
) -> None:
    """A reducer returning a slice of its input, on step tensors read where they are.

    SGD with Nesterov momentum (``foreach``) adds its momentum into ``.grad`` during its step,
    and each update is formed in the copy its parameter's rows were measured from: a view
    read when the record is delivered saw the changed values. The recorded first entries are
    those the optimizer was handed, as the test's own pre-hook read them. A subclass of a
    built-in reducer is checked as any reducer not built in.
    """
    torch.manual_seed(0)
    linear = nn.Linear(64, 64)
    model = nn.Sequential(linear)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, nesterov=True, foreach=True
    )
    handed: list[tuple[float, float]] = []

    def pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        gradient = linear.weight.grad
        assert gradient is not None
        handed.append((gradient.reshape(-1)[0].item(), linear.weight.reshape(-1)[0].item()))

    optimizer.register_step_pre_hook(pre)  # before the observer's
    sink = RecordingSink()
    with inject_observer(
        model,
        sampler=AlwaysSampler(),
        sink=sink,
        optimizer=optimizer,
        reducers=[reducer()],
        background_reductions=background,
    ):
        for _ in range(2):
            model(torch.randn(8, 64)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    records = step_records(sink)
    assert len(records) == 2
    for record, (gradient, parameter) in zip(records, handed, strict=True):
        rows = values_of(record)
        assert rows[("0", "parameter_gradient", "weight", "first")] == pytest.approx(gradient)
        assert rows[("0", "parameter", "weight", "first")] == pytest.approx(parameter)


class _Projected(torch.optim.SGD):
    """A subclass whose ``step`` calls the one it overrides, then halves every parameter.

    Once an ``SGD`` exists, torch has hooked ``SGD.step`` as well as this class's: each step
    runs both calls' hooks, nested. ``fail_at`` makes that step raise after the update.
    """

    def __init__(self, *args: Any, fail_at: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_at, self.calls = fail_at, 0

    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        with torch.no_grad():
            for group in self.param_groups:
                for parameter in group["params"]:
                    parameter.mul_(0.5)
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise RuntimeError("failed after the update")
        return loss


def _projected_loop(
    *, closure: bool, fail_at: int | None = None, steps: int = 3
) -> tuple[RecordingSink, list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]]:
    """Steps of ``_Projected``, each parameter's values before and after its outer call."""
    torch.manual_seed(0)
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # torch hooks ``SGD.step`` too
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = _Projected(model.parameters(), lr=0.1, momentum=0.9, fail_at=fail_at)
    assert getattr(torch.optim.SGD.step, "hooked", False), "both steps are hooked"
    seen = []
    sink = RecordingSink()
    with inject_observer(model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer):
        for _ in range(steps):
            x = torch.randn(8, 16)

            def loss(x: torch.Tensor = x) -> torch.Tensor:
                optimizer.zero_grad()
                value = model(x).square().mean()
                value.backward()
                return value

            if not closure:
                loss()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            with contextlib.suppress(RuntimeError):  # ``fail_at``'s, the loop survives it
                optimizer.step(loss if closure else None)
            seen.append((before, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return sink, seen


@pytest.mark.parametrize("closure", [False, True], ids=["plain", "closure"])
def test_a_subclass_step_calling_the_step_it_overrides_is_one_record(closure: bool) -> None:
    """The nested call's hooks do nothing: one record a step, of the outer call.

    Its update is the whole change (the parent's update, then the halving); its parameters
    are those before it, its state the momentum after it. With a closure the forward runs
    inside the step, through both calls: each step is recorded all the same.
    """
    sink, seen = _projected_loop(closure=closure, steps=4)
    records = step_records(sink)
    assert len(records) == 4
    for record, (before, after) in zip(records, seen, strict=True):
        rows = values_of(record)
        assert {key[1] for key in rows} == {
            "parameter",
            "parameter_gradient",
            "update",
            "optimizer_state",
        }
        for name in ("0.weight", "2.bias"):
            layer, path = split(name)
            assert_matches(rows, layer, "parameter", path, stats(before[name]), rel=1e-5)
            update = stats(after[name] - before[name])
            assert_matches(rows, layer, "update", path, update, rel=1e-4)


def test_a_nested_step_that_raises_is_delivered_and_the_later_steps_are_whole() -> None:
    """The outer call raises after the nested one returned: its record has what came before.

    It is delivered at the next step, whose forward it takes (a plain loop); the step after
    that is recorded whole again.
    """
    sink, seen = _projected_loop(closure=False, fail_at=1, steps=4)
    records = step_records(sink)
    signals = [{str(row.signal) for row in record.rows} for record in records]
    assert signals == [
        {"parameter", "parameter_gradient", "update", "optimizer_state"},
        {"parameter", "parameter_gradient"},
        {"parameter", "parameter_gradient", "update", "optimizer_state"},
    ]
    before, after = seen[3]
    rows = values_of(records[2])
    assert_matches(
        rows, "0", "update", "weight", stats(after["0.weight"] - before["0.weight"]), rel=1e-4
    )
