"""The CPU's reduction worker: same values as inline, bounded copies, errors on the caller.

``background_reductions=True`` forces the worker on (by default it is on only where torch's
threads leave a core free, which this 2-core machine's default of 2 threads does not).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import inspect
import os
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import floats
from torchinstruments_core import (
    AlwaysSampler,
    ConfigurationError,
    ObservationError,
    ObservationWarning,
    Observer,
    RecordKind,
    inject_observer,
)
from torchinstruments_core import _background as background
from torchinstruments_core._background import ReductionWorker
from torchinstruments_core._failures import FailureReport
from torchinstruments_core._measure import Measurer
from torchinstruments_core._measurement import reduced
from torchinstruments_core._native_worker import NativeWorker, ProfileJob
from torchinstruments_core._probe import OutputProbe
from torchinstruments_core._records import Signal
from torchinstruments_core._sample import Sample, Site
from torchinstruments_core.reducers import HistogramReducer, PreparedTensor, default_reducers
from torchinstruments_core.testing import RecordingSink

if TYPE_CHECKING:
    from collections.abc import Callable


def _model() -> nn.Module:
    torch.manual_seed(0)
    # the ReLU changes the first Linear's output in place once its hook has returned
    return nn.Sequential(
        nn.Linear(64, 512), nn.ReLU(inplace=True), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 8)
    )


def _records(background_reductions: bool, **options: Any) -> RecordingSink:
    model = _model()
    sink = RecordingSink()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with inject_observer(
        model,
        sampler=AlwaysSampler(),
        sink=sink,
        optimizer=optimizer,
        background_reductions=background_reductions,
        **options,
    ) as observer:
        for step in range(3):
            observer.begin_step(step, sample=True)
            model(torch.randn(256, 64, generator=torch.Generator().manual_seed(step))).pow(
                2
            ).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            observer.end_step()
            assert len(sink.samples) == 2 * (step + 1)  # delivered at end_step, as inline
    return sink


def test_the_worker_gives_the_values_of_inline_reduction_bit_for_bit() -> None:
    """Rows, histograms and step records are identical, in-place changes after the hook too."""
    inline, worker = _records(False), _records(True)
    assert [r.rows for r in worker.samples] == [r.rows for r in inline.samples]
    assert [r.histograms for r in worker.samples] == [r.histograms for r in inline.samples]
    # the Linear's output was measured before the in-place ReLU cut its negative entries
    forward, step = (r.sample_id for r in worker.samples[-2:])
    assert (worker.value("0", "output", "min", sample_id=forward) or 0.0) < 0
    assert worker.value("1", "output", "min", sample_id=forward) == 0
    ratio = worker.value("0", "update", "update_to_weight", sample_id=step, tensor_path="weight")
    assert ratio is not None
    assert ratio > 0


def _sampled_steps(
    steps: int, ended: Callable[[ReductionWorker], None], *, backward: bool = True
) -> ReductionWorker:
    """Sample ``steps`` forward (and ``backward``) passes of ``_model`` on the worker.

    ``ended(worker)`` is called after each step; the observer is removed on return.
    """
    model = _model()
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=RecordingSink(), background_reductions=True
    ) as observer:
        worker = observer._config.measurer._worker
        for step in range(steps):
            observer.begin_step(step, sample=True)
            with torch.set_grad_enabled(backward):
                loss = model(torch.randn(256, 64)).sum()
            if backward:
                loss.backward()
            observer.end_step()
            ended(worker)
    return worker


def _held_at_each_copy(monkeypatch: Any, *, floor: int, slow_s: float = 0.0) -> list[int]:
    """Bytes held once each copy is taken, over one sampled step of ``_model``.

    The widest activation is 512 KiB. Asserts that every copy is freed and nothing is held at
    the end.

    The worker's budget has ``floor``; with ``slow_s`` each job first sleeps that long, so that
    the hooks hand tensors over faster than the worker reduces them.
    """
    held: list[int] = []
    copies: list[weakref.ref[torch.Tensor]] = []
    submit, fill = ReductionWorker.submit, Measurer._fill

    def watched(self: ReductionWorker, nbytes: int, make: Any, **options: Any) -> int | None:
        def make_and_watch() -> Any:
            made = make()
            copies.append(weakref.ref(inspect.getclosurevars(made[0]).nonlocals["copy"]))
            held.append(self._held)
            return made

        return submit(self, nbytes, make_and_watch, **options)

    def slow_fill(self: Measurer, *args: Any) -> None:
        if self.on_worker_thread():
            time.sleep(slow_s)
        fill(self, *args)

    def ended(worker: ReductionWorker) -> None:
        assert worker._held == 0  # end_step waited for the worker

    monkeypatch.setattr(ReductionWorker, "submit", watched)
    monkeypatch.setattr(Measurer, "_fill", slow_fill)
    monkeypatch.setattr(background, "BUDGET_FLOOR", floor)
    _sampled_steps(1, ended)
    assert len(held) == 10  # 5 outputs and 5 output gradients, each through the worker
    assert all(copy() is None for copy in copies)  # every copy freed once reduced
    return held


def test_copies_waiting_for_the_worker_never_pass_the_largest_tensor(monkeypatch: Any) -> None:
    """Without a floor the bytes handed over and not yet reduced stay within the largest copy."""
    held = _held_at_each_copy(monkeypatch, floor=0, slow_s=0.01)
    assert max(held) <= 256 * 512 * 4  # the widest activation and its gradient, float32 bytes


def test_copies_waiting_for_the_worker_may_fill_the_floor_and_never_pass_it(
    monkeypatch: Any,
) -> None:
    """With a 1.5 MiB floor a slow worker lets up to three 512 KiB copies wait, never more."""
    floor = 3 * 256 * 512 * 4
    held = _held_at_each_copy(monkeypatch, floor=floor, slow_s=0.01)
    assert max(held) <= floor
    assert max(held) > 256 * 512 * 4  # more than one copy waited: the hooks did not


def _copy_buffers(monkeypatch: Any, *, floor: int, steps: int) -> list[set[int]]:
    """The buffers (their ``id``) each forward-only sample of ``_model`` copied into (5 a step).

    Only outputs, and all of them: gradients are read without a copy (``shared``), and so are
    outputs once a forward showed them unchanged, which ``end_forward`` is kept from learning.

    Every buffer is kept alive here, so a new one can never take an earlier one's place: the
    same ``id`` in two steps is a reused spare. Each copy first waits for the worker, so that
    how far it lags cannot change how many buffers a step takes. Asserts at each copy that the
    spares fit the floor and, with the bytes held, the budget.
    """
    used: list[set[int]] = []
    alive: list[torch.Tensor] = []
    buffer = ReductionWorker.buffer

    def watched(self: ReductionWorker, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.wait()  # the earlier jobs' buffers are spare: as many buffers in every step
        made = buffer(self, numel, dtype)
        assert self._spares.bytes <= floor
        assert self._held + self._spares.bytes <= self._budget
        alive.append(made)
        used[-1].add(id(made))
        return made

    def ended(worker: ReductionWorker) -> None:
        assert worker._spares.bytes <= floor  # what stays between samples
        used.append(set())

    monkeypatch.setattr(ReductionWorker, "buffer", watched)
    monkeypatch.setattr(background, "BUDGET_FLOOR", floor)
    monkeypatch.setattr(OutputProbe, "end_forward", lambda _probe, sample, **_: None)
    used.append(set())
    worker = _sampled_steps(steps, ended, backward=False)
    assert not worker._spares.bytes  # removal frees them
    return used[:-1]


def test_later_copies_reuse_the_buffers_of_finished_jobs(monkeypatch: Any) -> None:
    """With room for every copy of a step as spares, the next steps copy into the same buffers."""
    used = _copy_buffers(monkeypatch, floor=8 * 2**20, steps=3)
    assert used[1] == used[0]
    assert used[2] == used[0]


def test_spare_buffers_stay_within_the_floor_and_with_the_copies_within_the_budget(
    monkeypatch: Any,
) -> None:
    """A 1 MiB floor keeps at most two 512 KiB spares; some copies still reuse one."""
    used = _copy_buffers(monkeypatch, floor=2**20, steps=2)
    assert used[1] & used[0]


def test_no_spare_is_kept_past_the_floor_even_where_the_budget_has_room(
    monkeypatch: Any,
) -> None:
    """A 256 KiB floor under a 512 KiB budget (the largest copy): no 512 KiB spare is kept."""
    used = _copy_buffers(monkeypatch, floor=2**18, steps=2)
    assert not used[1] & used[0]


def test_a_failing_reducer_warns_on_the_training_thread(monkeypatch: Any) -> None:
    """A reducer raising on the worker gives its reason, and one warning in the caller's thread."""
    reported_in: list[threading.Thread] = []
    failed = FailureReport.failed

    def watched(self: FailureReport, *args: Any) -> None:
        reported_in.append(threading.current_thread())
        failed(self, *args)

    monkeypatch.setattr(FailureReport, "failed", watched)
    model = nn.Sequential(nn.Linear(4, 4))
    sink = RecordingSink()
    with _failing_observer(model, sink) as observer:
        observer.begin_step(0, sample=True)
        loss = model(torch.randn(2, 4)).sum()
        with pytest.warns(ObservationWarning, match="reducer broke") as caught:
            loss.backward()  # the sample closes, waits for the worker: the failure is told here
        assert len(caught) == 1  # one warning per cause
        observer.end_step()
    assert reported_in == [threading.main_thread()] * 2  # the output and its gradient
    rows = [r for r in sink.rows if r.metric == "boom"]
    assert rows
    assert all(r.value is None for r in rows)
    assert all("RuntimeError: reducer broke" in (r.unavailable_reason or "") for r in rows)
    assert sink.value("0", "output", "mean") is not None


class _Failing:
    """A reducer that always raises."""

    metrics = ("boom",)

    def reduce(self, prepared: Any) -> torch.Tensor:
        raise RuntimeError("reducer broke")


def _failing_observer(model: nn.Module, sink: RecordingSink) -> Observer:
    """Every sampled tensor of ``model`` through the worker, with a reducer that raises."""
    return inject_observer(
        model,
        sampler=AlwaysSampler(),
        sink=sink,
        reducers=[*default_reducers(), _Failing()],
        background_reductions=True,
    )


def test_error_policy_raise_reduces_inline() -> None:
    """Under ``error_policy="raise"`` the worker is off, so a failure raises in the hook."""
    model = nn.Sequential(nn.Linear(4, 4))
    with inject_observer(
        model,
        sampler=AlwaysSampler(),
        sink=RecordingSink(),
        reducers=[*default_reducers(), _Failing()],
        error_policy="raise",
        background_reductions=True,
    ) as observer:
        assert observer._config.measurer.background is False
        with pytest.raises(ObservationError, match="reducer broke"):
            model(torch.randn(2, 4))  # the output's hook


class _FailingDuring:
    """A reducer that raises while handling an error raised where its input was in scope."""

    metrics = ("boom",)

    def reduce(self, prepared: Any) -> torch.Tensor:
        try:
            self._inner(prepared.values)
        except ValueError:
            raise RuntimeError("reducer broke") from None  # __context__ keeps the inner one
        return prepared.values[:1]

    @staticmethod
    def _inner(values: torch.Tensor) -> None:
        raise ValueError(f"cannot reduce {values.numel()} entries")


@pytest.mark.parametrize("failing", [_Failing, _FailingDuring])
def test_a_failing_reducer_frees_its_copy_without_garbage_collection(
    monkeypatch: Any, failing: type
) -> None:
    """A reducer's error keeps no frame, nor does any it was raised during.

    So no copy outlives its job (gc off here).
    """
    monkeypatch.setattr(background, "BUDGET_FLOOR", 0)  # no spare buffers kept either
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))
    copies: list[weakref.ref[torch.Tensor]] = []
    job = Measurer._job

    def watched(self: Measurer, *args: Any, **kwargs: Any) -> Any:
        made = job(self, *args, **kwargs)
        copies.append(weakref.ref(inspect.getclosurevars(made[0]).nonlocals["copy"]))
        return made

    gc.disable()
    try:
        with (
            pytest.MonkeyPatch.context() as patch,
            warnings.catch_warnings(),
            inject_observer(
                model,
                sampler=AlwaysSampler(),
                sink=RecordingSink(),
                reducers=[*default_reducers(), failing()],
                background_reductions=True,
            ) as observer,
        ):
            warnings.simplefilter("ignore", ObservationWarning)
            patch.setattr(Measurer, "_job", watched)
            observer.begin_step(0, sample=True)
            model(torch.randn(64, 256)).sum().backward()
            observer.end_step()
            assert len(copies) == 8
            assert [copy() for copy in copies] == [None] * 8
    finally:
        gc.enable()


def test_inline_reduction_waits_for_the_worker_so_values_stay_the_same() -> None:
    """Switching to inline with jobs queued: the draws stay in order, the values the same."""
    # sizes all different, so each draws its own positions; large first ones keep the worker
    # busy when the switch comes
    sizes = [2_000_000, 2_000_001, 2_000_002, 20_000, 20_001, 20_002]
    tensors = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in sizes]

    def quartiles(switch_at: int | None) -> list[list[float]]:
        measurer = Measurer(
            default_reducers(), HistogramReducer(), background=switch_at is not None
        )
        found = []
        for index, tensor in enumerate(tensors):
            if index == switch_at:
                measurer.background = False  # as when torch.set_num_threads changes mid-run
            measurement = measurer.measure(tensor, with_histogram=False)
            found.append(measurement)
        for measurement in found:
            measurement.settle()
        measurer.close()
        return [
            [float(v) for r in m.results if r.values is not None for v in floats(r.values)]
            for m in found
        ]

    assert quartiles(3) == quartiles(None)


def test_a_warning_made_an_error_still_delivers_the_sample() -> None:
    """A deferred report that raises (warnings as errors) comes after the sample is queued."""
    model = nn.Sequential(nn.Linear(4, 4))
    sink = RecordingSink()
    with _failing_observer(model, sink) as observer:
        loss = model(torch.randn(2, 4)).sum()
        with warnings.catch_warnings():
            warnings.simplefilter("error", ObservationWarning)
            with pytest.raises(ObservationWarning, match="reducer broke"):
                loss.backward()
        observer.flush()
    assert len(sink.samples) == 1
    assert sink.value("0", "output", "mean") is not None


def test_a_reducer_failing_on_a_dropped_measurement_is_still_reported() -> None:
    """A late gradient for a closed sample is dropped, and its reducer's failure still told."""
    measurer = Measurer([*default_reducers(), _Failing()], HistogramReducer(), background=True)
    sample = Sample(0, 0, 0.0, None)
    sample.closed = True
    measurement = measurer.measure(torch.randn(64), with_histogram=False)
    told: list[str] = []
    measurement.then(lambda m: told.extend(str(e) for e in m.errors))
    sample.add(Site("0", 0, Signal.OUTPUT_GRADIENT, "output"), measurement)
    assert told == ["reducer broke"]
    measurer.close()


def test_the_source_dtype_reaches_reducers_on_the_worker() -> None:
    """A bfloat16 tensor copied to float32 for the worker still says it was bfloat16."""
    seen: list[torch.dtype] = []

    class Dtype:
        metrics = ("dtype_seen",)

        def reduce(self, prepared: Any) -> torch.Tensor:
            seen.append(prepared.source_dtype)
            return torch.zeros(1)

    measurer = Measurer([Dtype()], HistogramReducer(), background=True)
    measurer.measure(torch.randn(8, dtype=torch.bfloat16), with_histogram=False).settle()
    measurer.close()
    assert seen == [torch.bfloat16]


def test_background_reductions_is_checked() -> None:
    """Anything but None, True or False is refused, naming the argument."""
    with pytest.raises(ConfigurationError, match="background_reductions='yes'"):
        inject_observer(nn.Linear(2, 2), sink=RecordingSink(), background_reductions="yes")  # type: ignore[arg-type]


def test_by_default_the_worker_runs_only_where_a_core_is_free(monkeypatch: Any) -> None:
    """``None`` follows ``torch.get_num_threads()`` against the cores the process may use.

    The threads are read once a sample (at the first tensor after ``new_sample``), not at
    every tensor: a change shows from the next sample on.
    """
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1, 2, 3}, raising=False)
    background._cores.cache_clear()
    monkeypatch.setattr(background, "_cores", functools.cache(background._cores.__wrapped__))
    measurer = Measurer(default_reducers(), HistogramReducer())
    tensor = torch.randn(8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert not measurer._in_background(tensor, None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert not measurer._in_background(tensor, None)  # the same sample: read at its start
    measurer.new_sample()
    assert measurer._in_background(tensor, None)
    assert not Measurer(default_reducers(), HistogramReducer(), background=False)._in_background(
        tensor, None
    )
    assert not measurer._in_background(torch.randn(8, device="meta"), None)


def _submits_per_step(
    monkeypatch: Any,
    model: nn.Module,
    batch: torch.Tensor,
    optimizer: torch.optim.Optimizer | None = None,
    **options: Any,
) -> tuple[list[int], RecordingSink, list[int]]:
    """Jobs handed to the worker in each of three sampled steps, a core free (``None``).

    Also those handed to the kernels' queue (``NativeWorker``, each ``ProfileJob`` started), in
    the third list. With ``optimizer`` each step ends with its step, recorded.
    """
    import torchinstruments_core._measure as measure_module

    monkeypatch.setattr(measure_module, "free_core", lambda: True)
    counts: list[int] = []
    native: list[int] = []
    submit = ReductionWorker.submit
    start = ProfileJob.start

    def counted(self: ReductionWorker, *args: Any, **kwargs: Any) -> int | None:
        counts[-1] += 1
        return submit(self, *args, **kwargs)

    def counted_native(job: ProfileJob, queue: object | None) -> int | None:
        native[-1] += 1  # every job handed to the kernels' queue starts once
        return start(job, queue)

    monkeypatch.setattr(ReductionWorker, "submit", counted)
    monkeypatch.setattr(ProfileJob, "start", counted_native)
    sink = RecordingSink()
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, optimizer=optimizer, **options
    ) as observer:
        for step in range(3):
            counts.append(0)
            native.append(0)
            observer.begin_step(step, sample=True)
            model(batch).pow(2).mean().backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad()
            observer.end_step()
    return counts, sink, native


def test_a_small_sample_goes_to_the_kernels_queue_from_the_next_sample_on(
    monkeypatch: Any,
) -> None:
    """A forward sample of at most ``SMALL_SAMPLE_ENTRIES`` entries makes ``None`` leave the worker.

    The next samples' tensors go to the kernels' queue, or are reduced in the hooks without
    one. The first sample goes to the worker (nothing is known yet); the next ones, of the same
    small model, do not, and give the same values. ``True`` keeps them off the hooks: on the
    queue where there is one, else on the worker.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    batch = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    queue = NativeWorker.available()
    counts, sink, native = _submits_per_step(monkeypatch, model, batch)
    assert counts[0] > 0
    assert counts[1:] == [0, 0]
    assert native == ([0, counts[0], counts[0]] if queue else [0, 0, 0])
    forced, forced_sink, forced_native = _submits_per_step(
        monkeypatch, model, batch, background_reductions=True
    )
    assert forced[0] == counts[0]
    if queue:
        assert forced[1:] == [0, 0]
        assert forced_native == [0, forced[0], forced[0]]
    else:
        assert forced[1:] == [forced[0]] * 2
    hooks, hooks_sink, hooks_native = _submits_per_step(
        monkeypatch, model, batch, background_reductions=False
    )
    assert hooks == hooks_native == [0, 0, 0]
    for other in (forced_sink, hooks_sink):  # worker, queue and hooks: the same values
        assert [s.rows for s in sink.samples] == [s.rows for s in other.samples]
        assert [s.histograms for s in sink.samples] == [s.histograms for s in other.samples]


class _RaisesOnce(nn.Module):
    """Returns its input, after raising in its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.failed:
            self.failed = True
            raise RuntimeError("the first forward fails")
        return x


def test_a_sample_on_the_kernels_queue_holds_none_of_its_outputs(monkeypatch: Any) -> None:
    """The queue copies every tensor, so its samples keep no output alive for the forward.

    A sample on the Python worker holds its outputs until the forward ends, to learn which
    ones later samples may read in place (``OutputProbe._measure_output``). A forward that
    raised teaches nothing, so the next sample would hold them again; on the queue that tells
    nothing, and it holds none. Its values are the hooks'.
    """
    import torchinstruments_core._measure as measure_module
    import torchinstruments_core._probe as probe_module

    if not NativeWorker.available():
        pytest.skip("the kernels have no queue here")
    monkeypatch.setattr(measure_module, "free_core", lambda: True)
    held: list[int] = []
    hold = probe_module._hold

    def counted(sample: Sample, tensor: torch.Tensor) -> object:
        held[-1] += 1
        return hold(sample, tensor)

    monkeypatch.setattr(probe_module, "_hold", counted)
    batch = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    sinks = []
    for background_reductions in (None, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), _RaisesOnce())
        sinks.append(RecordingSink())
        held.clear()
        with inject_observer(
            model,
            sampler=AlwaysSampler(),
            sink=sinks[-1],
            background_reductions=background_reductions,
        ) as observer:
            for step in range(3):
                held.append(0)
                observer.begin_step(step, sample=True)
                with contextlib.suppress(RuntimeError):
                    model(batch).pow(2).mean().backward()
                observer.end_step()
        if background_reductions is None:
            assert held[0] > 0  # on the worker (nothing is known yet)
            assert held[1:] == [0, 0]  # on the queue
    assert [s.rows for s in sinks[0].samples] == [s.rows for s in sinks[1].samples]


def test_a_sample_past_the_small_size_keeps_the_worker(monkeypatch: Any) -> None:
    """A model whose sample measures more than ``SMALL_SAMPLE_ENTRIES`` entries stays on it."""
    from torchinstruments_core._measure import SMALL_SAMPLE_ENTRIES

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 4096), nn.Linear(4096, 4))
    batch = torch.randn(128, 16, generator=torch.Generator().manual_seed(1))
    assert SMALL_SAMPLE_ENTRIES < 2 * 128 * 4096  # the first output and its gradient alone
    counts, _, _ = _submits_per_step(monkeypatch, model, batch)
    assert all(count >= 4 for count in counts)


def test_a_step_records_tensors_go_to_the_kernels_queue_and_not_into_the_samples_size(
    monkeypatch: Any,
) -> None:
    """A step record's tensors take the kernels' queue, whatever the size of the samples.

    The optimizer changes a parameter as soon as it is measured, so a step's tensors are copied
    wherever they go; on the queue they are reduced without the GIL. Nor do they count toward
    the size of the next forward sample (``SMALL_SAMPLE_ENTRIES`` weighs what copying the
    activations and gradients costs the hooks): a model of a million parameters and small
    activations has its forward samples on the queue from the second on. The values are
    those of the hooks (``background_reductions=False``).
    """
    from torchinstruments_core._measure import SMALL_SAMPLE_ENTRIES

    if not NativeWorker.available():
        pytest.skip("the kernels have no queue here")

    def run(**options: Any) -> tuple[list[int], RecordingSink, list[int]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        batch = torch.randn(2, 1024, generator=torch.Generator().manual_seed(1))
        return _submits_per_step(monkeypatch, model, batch, optimizer, **options)

    counts, sink, native = run()
    assert SMALL_SAMPLE_ENTRIES < 4 * 1024 * 1024  # the weight, its gradient, update, momentum
    forward = 4  # the Linear's and the ReLU's outputs and their gradients
    assert counts[0] == forward  # the first forward sample: nothing known yet, on the worker
    assert counts[1:] == [0, 0]  # the later ones, and every step record, on the queue
    step = 8  # the weight and the bias, their gradients, updates and momentum buffers
    assert native == [step, forward + step, forward + step]
    _, hooks, hooks_native = run(background_reductions=False)
    assert hooks_native == [0, 0, 0]
    assert [s.rows for s in sink.samples] == [s.rows for s in hooks.samples]
    assert [s.histograms for s in sink.samples] == [s.histograms for s in hooks.samples]


def test_a_step_record_copies_nothing_for_its_reductions(monkeypatch: Any) -> None:
    """No tensor of a step record is copied for the reductions, and the values are the hooks'.

    The optimizer changes a parameter as soon as it is measured, but the copy its update needs
    holds the same values: the parameter is reduced from that copy, the update is formed in it
    once that reduction has run, and it and the optimizer's state, measured after the update,
    are reduced where they are (the record is delivered before the post-hook returns). The
    gradients are read where they are too, the pre-hook waiting for their reductions before
    the optimizer runs.
    """
    import torchinstruments_core._background as background_module
    import torchinstruments_core._measure as measure_module

    monkeypatch.setattr(measure_module, "free_core", lambda: True)
    weight = 512 * 512
    copied: list[int] = []
    flat_copy = background_module.flat_copy

    def counted(plain: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        if plain.numel() == weight:
            copied[-1] += 1
        return flat_copy(plain, buffer)

    monkeypatch.setattr(background_module, "flat_copy", counted)  # the queue's one-call copies
    monkeypatch.setattr(measure_module, "flat_copy", counted)  # the workers' other copies
    sinks = []
    for background_reductions in (None, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 512), nn.Tanh())
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        sinks.append(RecordingSink())
        copied.clear()
        with inject_observer(
            model,
            sampler=AlwaysSampler(),
            sink=sinks[-1],
            optimizer=optimizer,
            background_reductions=background_reductions,
        ) as observer:
            for step in range(3):
                copied.append(0)
                observer.begin_step(step, sample=True)
                model(torch.randn(2, 512, generator=torch.Generator().manual_seed(step)))
                model[0].weight.grad = torch.randn(512, 512)  # a gradient of its own: no graph
                optimizer.step()
                optimizer.zero_grad()
                observer.end_step()
        if background_reductions is None:
            assert copied == [0, 0, 0]  # neither the weight, its gradient, update nor moments
    assert [s.rows for s in sinks[0].samples] == [s.rows for s in sinks[1].samples]
    assert [s.histograms for s in sinks[0].samples] == [s.histograms for s in sinks[1].samples]


@pytest.mark.parametrize("background_reductions", [None, True])
def test_a_gradient_the_optimizer_changes_in_place_is_measured_as_it_found_it(
    monkeypatch: Any, background_reductions: bool | None
) -> None:
    """SGD with Nesterov momentum (``foreach``) adds its momentum into ``.grad`` in its step.

    The gradient is read where it is, on the kernels' queue or the Python worker: its rows are
    those of the gradient the step was handed (copied by a pre-hook that runs after the
    observer's), not a mix of it and what the optimizer wrote into it: their reductions have run
    when the optimizer's own step begins.
    """
    import torchinstruments_core._measure as measure_module

    monkeypatch.setattr(measure_module, "free_core", lambda: True)
    torch.manual_seed(0)
    layer = nn.Linear(512, 512)
    model = nn.Sequential(layer)
    optimizer = _nesterov(layer)
    sink = RecordingSink()
    handed: list[torch.Tensor] = []
    changed: list[bool] = []
    with inject_observer(
        model,
        sampler=AlwaysSampler(),
        sink=sink,
        optimizer=optimizer,
        background_reductions=background_reductions,
    ) as observer:
        pending: list[bool] = []

        def before_the_optimizer(*_: object) -> None:  # runs after the observer's pre-hook
            handed.append(_gradient(layer).double())
            record = observer._optimizers._pending[id(optimizer)].record
            gradients = [
                measurement
                for site, measurement, _ in record._measured
                if site.signal == "parameter_gradient" and site.layer == "0"
            ]
            assert len(gradients) == 2  # the weight's and the bias's
            pending.append(not all(reduced(m) for m in gradients))

        optimizer.register_step_pre_hook(before_the_optimizer)
        for step in range(3):
            observer.begin_step(step, sample=True)
            batch = torch.randn(64, 512, generator=torch.Generator().manual_seed(step))
            model(batch).square().mean().backward()
            gradient = _gradient(layer)
            version = gradient._version
            optimizer.step()
            changed.append(gradient._version != version)
            optimizer.zero_grad()
            observer.end_step()
    assert all(changed)  # the optimizer did change the gradient in place
    assert pending == [False] * 3  # the gradients' reductions had run when the optimizer began
    records = [r for r in sink.samples if r.kind is RecordKind.STEP]
    assert len(records) == 3
    for record, gradient in zip(records, handed, strict=True):
        rows = {
            r.metric: r.value
            for r in record.rows
            if r.layer == "0"
            and str(r.signal) == "parameter_gradient"
            and r.tensor_path == "weight"
        }
        assert rows["max"] == pytest.approx(gradient.max().item(), rel=1e-6)
        assert rows["min"] == pytest.approx(gradient.min().item(), rel=1e-6)
        assert rows["rms"] == pytest.approx(gradient.square().mean().sqrt().item(), rel=1e-5)


def test_the_gradients_are_waited_for_when_the_rest_of_the_pre_hook_fails(monkeypatch: Any) -> None:
    """A failure after the gradients were handed over still waits for their reductions.

    The parameters' copies fail (out of memory, say): the observer warns, and the optimizer,
    which changes the gradients in place, starts only once they are measured.
    """
    import torchinstruments_core._measure as measure_module
    import torchinstruments_core._optimizer_probe as probe_module

    def failing(*_: object) -> None:
        raise RuntimeError("no memory for the copies")

    monkeypatch.setattr(measure_module, "free_core", lambda: True)
    monkeypatch.setattr(probe_module, "before_step", failing)
    torch.manual_seed(0)
    layer = nn.Linear(512, 512)
    optimizer = _nesterov(layer)
    sink, pending = RecordingSink(), []
    with inject_observer(
        nn.Sequential(layer), sampler=AlwaysSampler(), sink=sink, optimizer=optimizer
    ) as observer:

        def before_the_optimizer(*_: object) -> None:
            record = observer._optimizers._pending[id(optimizer)].record
            pending.append([not reduced(m) for _, m, _ in record._measured])

        optimizer.register_step_pre_hook(before_the_optimizer)
        observer.begin_step(0, sample=True)
        layer(torch.randn(64, 512)).square().mean().backward()
        with pytest.warns(ObservationWarning, match="no memory for the copies"):
            optimizer.step()
        observer.end_step()
    assert pending == [[False, False]]  # the weight's and the bias's gradients, both measured
    record = next(r for r in sink.samples if r.kind is RecordKind.STEP)
    assert {str(r.signal) for r in record.rows} == {"parameter_gradient", "optimizer_state"}


def _nesterov(layer: nn.Linear) -> torch.optim.SGD:
    """SGD with Nesterov momentum, ``foreach``: its step adds the momentum into ``.grad``."""
    return torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9, nesterov=True, foreach=True)


def _gradient(layer: nn.Linear) -> torch.Tensor:
    gradient = layer.weight.grad
    assert gradient is not None
    return gradient


def test_switching_between_the_hooks_and_the_worker_keeps_the_values(monkeypatch: Any) -> None:
    """Samples that alternate in size switch between the two, with the values of either alone.

    Tensors past 8,192 entries draw their quartiles' subsample: a sample reduced in the hooks
    while the previous one's jobs are still queued waits for them before drawing. Two samples
    share each backward, an in-place ReLU follows the first layer, and the optimizer's step
    records are measured too.
    """
    import torchinstruments_core._measure as measure_module

    monkeypatch.setattr(measure_module, "free_core", lambda: True)
    batches = [64, 2048, 64, 64, 2048, 2048, 64, 128]

    def run(background_reductions: bool | None) -> tuple[RecordingSink, list[int]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(inplace=True), nn.Linear(256, 256))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(1)
        sink, submitted = RecordingSink(), []
        with inject_observer(
            model,
            sampler=AlwaysSampler(),
            sink=sink,
            optimizer=optimizer,
            background_reductions=background_reductions,
        ) as observer:
            worker = observer._config.measurer._worker
            for step, batch in enumerate(batches):
                before = worker._submitted
                observer.begin_step(step, sample=True)
                first = model(torch.randn(batch, 64, generator=generator))
                second = model(torch.randn(batch, 64, generator=generator))
                (first.pow(2).mean() + second.pow(2).mean()).backward()
                optimizer.step()
                optimizer.zero_grad()
                observer.end_step()
                submitted.append(worker._submitted - before)
        return sink, submitted

    inline, never = run(False)
    assert never == [0] * len(batches)
    for choice in (None, True):
        sink, submitted = run(choice)
        assert [s.rows for s in sink.samples] == [s.rows for s in inline.samples]
        assert [s.histograms for s in sink.samples] == [s.histograms for s in inline.samples]
        if choice is None:  # some steps in the hooks, some on the worker
            assert 0 in submitted
            assert max(submitted) > 0


def test_the_size_of_a_sample_decides_only_at_the_start_of_the_next_forward_sample() -> None:
    """``new_sample(forward=True)`` decides from what was measured since the last one started.

    A step record's ``new_sample()`` neither decides nor forgets; a step record's own tensors
    (``step=True``) do not count, any other tensor does.
    """
    measurer = Measurer(default_reducers(), HistogramReducer())
    decisions = []
    measurer.measure(torch.randn(1000), with_histogram=False)
    measurer.new_sample(forward=True)
    decisions.append(measurer._small)  # small: in the hooks
    measurer.measure(torch.randn(1000), with_histogram=False)
    measurer.measure(torch.randn(2**19), with_histogram=False, step=True)
    measurer.new_sample()  # a step record closing
    measurer.measure(torch.randn(2**19), with_histogram=False)
    decisions.append(measurer._small)  # decided at forward starts only
    measurer.new_sample(forward=True)
    decisions.append(measurer._small)  # 1,000 + 2**19 entries since the last forward start
    measurer.new_sample(forward=True)
    decisions.append(measurer._small)  # nothing measured on the CPU: keep the worker
    measurer.close()
    assert decisions == [True, True, False, False]


def test_the_worker_runs_jobs_in_order_and_survives_a_failing_job() -> None:
    """FIFO order, ``wait`` returns when all ran, a raising job does not stop the thread."""
    worker = ReductionWorker()
    ran: list[int] = []
    threads: set[str] = set()

    def job(number: int) -> Any:
        def run() -> None:
            threads.add(threading.current_thread().name)
            if number == 3:
                raise RuntimeError("a stray error")
            ran.append(number)

        return run, None

    for number in range(8):
        worker.submit(16, functools.partial(job, number))
    worker.wait()
    assert ran == [0, 1, 2, 4, 5, 6, 7]
    assert threads == {"torchinstruments-reductions"}
    worker.close()
    worker.submit(16, lambda: job(9))  # closed: runs in the caller, at once
    assert ran[-1] == 9


def test_a_job_that_cannot_be_made_gives_its_room_back() -> None:
    """If making the job raises (in the hook), the reservation is released and nothing hangs."""
    worker = ReductionWorker()

    def broken() -> Any:
        raise MemoryError("no room for the copy")

    with pytest.raises(MemoryError):
        worker.submit(1 << 20, broken)
    worker.wait()  # returns: nothing is held
    worker.submit(1 << 20, lambda: (lambda: None, None))
    worker.wait()
    worker.close()


def test_removing_the_observer_stops_the_worker_thread() -> None:
    """No reduction thread outlives its observer."""
    model = nn.Sequential(nn.Linear(4, 4))
    observer = inject_observer(
        model, sampler=AlwaysSampler(), sink=RecordingSink(), background_reductions=True
    )
    model(torch.randn(2, 4)).sum().backward()
    thread = observer._config.measurer._worker._thread
    assert thread is not None
    assert thread.is_alive()
    observer.remove()
    assert not thread.is_alive()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(2, 4)).sum().backward()  # removed: nothing observes, nothing warns


def test_a_graph_freed_on_the_worker_closes_its_sample_at_the_next_safe_point() -> None:
    """Garbage collection on the worker defers the close: that thread never waits for a lock."""
    model = nn.Sequential(nn.Linear(4, 4))
    sink = RecordingSink()
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, background_reductions=True
    ) as observer:
        observer.begin_step(0, sample=True)
        loss = model(torch.randn(2, 4)).sum()  # kept: no backward, the graph stays alive
        lifecycle = observer._samples
        (sample,) = lifecycle._pending.values()
        worker = observer._config.measurer._worker
        worker.submit(0, lambda: (lambda: lifecycle._on_graph_released(sample), None))  # as gc
        worker.wait()
        assert sample.sample_id in lifecycle._pending  # not closed on the worker
        observer.end_step()  # a safe point: closed and delivered here
        assert sample.sample_id not in lifecycle._pending
        assert [r.sample_id for r in sink.samples] == [sample.sample_id]
        assert sink.value("0", "output", "mean") is not None
        del loss


def test_the_adapters_options_pass_background_reductions_through() -> None:
    """``TelemetryOptions`` (every adapter's options) hands the choice to ``inject_observer``."""
    from torchinstruments_core.adapter import TelemetryOptions

    for choice in (None, True, False):
        options = TelemetryOptions(background_reductions=choice)
        observer = options.inject(nn.Linear(2, 2), sink=RecordingSink(), run_id="run")
        try:
            assert observer._config.measurer.background is choice
        finally:
            observer.remove()


def test_a_copy_that_fails_gives_a_reason_and_never_raises(monkeypatch: Any) -> None:
    """Out of memory for the copy: the rows say ``reducer_error``, the step goes on."""
    measurer = Measurer(default_reducers(), HistogramReducer(), background=True)

    def no_memory(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(Measurer, "_job", no_memory)
    measurement = measurer.measure(torch.randn(16), with_histogram=False)
    assert measurement.reason is not None
    assert measurement.reason.startswith("reducer_error: RuntimeError: DefaultCPUAllocator")
    assert measurement.worker is None
    measurer.wait()  # nothing held back
    measurer.close()


def test_a_job_submitted_while_the_worker_closes_runs_in_the_caller() -> None:
    """Removal from another thread between reservation and queueing: nothing waits forever."""
    worker = ReductionWorker()
    worker.submit(8, lambda: (lambda: None, None))  # the thread runs
    ran: list[str] = []

    def make() -> Any:
        worker.close()  # as remove() in another thread, while this hook copies
        return lambda: ran.append(threading.current_thread().name), None

    assert worker.submit(8, make) is None
    assert ran == [threading.main_thread().name]
    worker.wait()
    assert worker._held == 0


def test_closing_in_a_forked_child_never_takes_the_lock() -> None:
    """In a child made by fork the parent's worker may have held the lock: close skips it."""
    worker = ReductionWorker()
    worker._pid = -1  # as seen from a child made by fork
    with worker._condition:  # held, as the parent's worker may have held it at the fork
        done = threading.Event()

        def close() -> None:
            worker.close()
            done.set()

        closer = threading.Thread(target=close)
        closer.start()
        assert done.wait(5)
        closer.join()


class _First:
    """A reducer whose result is a view of its input, as the Reducer protocol allows."""

    metrics = ("first",)

    def reduce(self, prepared: Any) -> torch.Tensor:
        return prepared.values[:1]


def test_a_result_that_views_its_copy_keeps_its_value_when_the_buffer_is_reused() -> None:
    """Three same-sized outputs share one reused buffer; each keeps its own first entry."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    sink = RecordingSink()
    x = torch.randn(4, 8)
    with torch.no_grad():
        outputs = [model[0](x)]
        outputs += [model[1](outputs[0])]
        outputs += [model[2](outputs[1])]
    with inject_observer(
        model,
        sampler=AlwaysSampler(),
        sink=sink,
        reducers=[*default_reducers(), _First()],
        background_reductions=True,
    ) as observer:
        observer.begin_step(0, sample=True)
        model(x)
        observer.end_step()
    recorded = [sink.value(str(i), "output", "first") for i in range(3)]
    assert recorded == [output[0, 0].item() for output in outputs]


def test_a_copy_without_a_buffer_still_frees_spares_to_stay_within_the_budget() -> None:
    """A scaled tensor is its own copy (no ``buffer`` call): held and spare bytes still fit."""
    gate = threading.Event()

    class Gate:
        metrics = ("gate",)

        def reduce(self, prepared: Any) -> torch.Tensor:
            gate.wait()
            return torch.zeros(1, dtype=prepared.values.dtype)

    measurer = Measurer([*default_reducers(), Gate()], HistogramReducer(), background=True)
    worker = measurer._worker
    for _ in range(2):  # two 4 MiB copies, both held: two 4 MiB spares fill the 8 MiB floor
        measurer.measure(torch.randn(2**20), with_histogram=False)
    gate.set()
    measurer.wait()
    assert worker._spares.bytes == 8 * 2**20
    gate.clear()  # the next job stays on the worker: its 8 MiB are held meanwhile
    measurer.measure(torch.randn(2 * 2**20), with_histogram=False, scale=2.0)
    try:
        assert worker._held == 8 * 2**20
        assert worker._held + worker._spares.bytes <= worker._budget
    finally:
        gate.set()
        measurer.wait()
        measurer.close()


def test_a_forked_child_copies_without_the_lock_and_keeps_no_spares() -> None:
    """In a child made by fork the parent's worker may have held the lock: hooks never wait."""
    measurer = Measurer(default_reducers(), HistogramReducer(), background=True)
    worker = measurer._worker
    measurer.measure(torch.randn(64), with_histogram=False)
    measurer.wait()
    assert worker._spares.bytes  # inherited by a child
    worker._pid = -1  # as seen from a child made by fork
    locked, release, done = threading.Event(), threading.Event(), threading.Event()

    def parent_worker() -> None:  # the parent's worker thread, inside the lock at the fork
        with worker._condition:
            locked.set()
            release.wait()

    holder = threading.Thread(target=parent_worker)
    holder.start()
    locked.wait()

    def hook() -> None:
        measurement = measurer.measure(torch.randn(64), with_histogram=True)
        assert measurement.reason is None
        measurer.close()
        done.set()

    child = threading.Thread(target=hook)
    child.start()
    try:
        assert done.wait(5)
        assert not worker._spares.bytes
    finally:
        release.set()
        holder.join()
        child.join()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_made_by_fork_knows_it_is_one_without_asking_the_system() -> None:
    """The hot paths compare ``_background._current_pid``, kept current by ``os.register_at_fork``.

    In a real child of a parent whose worker thread runs, a job handed over runs at once in
    the child (no ticket) and waiting returns, as ``os.getpid`` told before.
    """
    worker = ReductionWorker(floor=0, wake_bytes=0)
    ran: list[str] = []
    assert worker.submit(8, lambda: (lambda: ran.append("parent"), None)) is not None
    worker.wait()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanup
        try:
            ticket = worker.submit(8, lambda: (lambda: ran.append("child"), None))
            worker.wait()
            verdict = (
                background._current_pid == os.getpid() and ticket is None and ran[-1] == "child"
            )
            os.write(write, b"ok" if verdict else b"no")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 2)
    os.close(read)
    os.waitpid(pid, 0)
    worker.close()
    assert answer == b"ok"
    assert background._current_pid == os.getpid()
    assert ran == ["parent"]


def test_preparing_a_tensor_never_waits_for_another_being_prepared(monkeypatch: Any) -> None:
    """No lock is shared between ``PreparedTensor``s.

    ``functools.cached_property`` on Python 3.11 holds one per property: a hook waited for the
    worker's tensor, and a child made by fork forever for one the parent's worker computed.
    """
    from torchinstruments_core.reducers import base
    from torchinstruments_core.reducers._host import summarize

    inside, release = threading.Event(), threading.Event()

    def slow(values: torch.Tensor) -> Any:
        if threading.current_thread().name == "worker":
            inside.set()
            release.wait()
        return summarize(values)

    monkeypatch.setattr(base, "summarize", slow)
    generator = torch.Generator().manual_seed(0)
    other = threading.Thread(
        target=lambda: PreparedTensor(torch.randn(64), generator).n_finite, name="worker"
    )
    found: list[float] = []
    hook = threading.Thread(
        target=lambda: found.append(PreparedTensor(torch.ones(64), generator).n_finite.item())
    )
    other.start()
    assert inside.wait(5)
    hook.start()
    hook.join(5)
    waited = hook.is_alive()
    release.set()
    other.join()
    hook.join()
    assert not waited
    assert found == [64]


def test_a_lazily_negated_tensor_gives_the_same_values_on_the_worker_and_in_the_hook() -> None:
    """``z.conj().imag`` has the negative bit set and no numpy view: it is resolved first."""
    z = torch.complex(
        torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0)),
        torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(1)),
    )
    negated = z.conj().imag
    assert negated.is_neg()
    measured = []
    for on_worker in (False, True):
        measurer = Measurer(default_reducers(), HistogramReducer(), background=on_worker)
        measurement = measurer.measure(negated, with_histogram=True)
        assert measurement.settle() is None
        measurer.close()
        assert measurement.reason is None
        assert measurement.errors == []
        assert measurement.histogram is not None
        measured.append(
            [floats(r.values) for r in measurement.results if r.values is not None]
            + [floats(measurement.histogram)]
        )
    assert measured[0] == measured[1]
    reference = Measurer(default_reducers(), HistogramReducer(), background=False)
    plain = reference.measure(negated.clone(), with_histogram=True)
    assert [floats(r.values) for r in plain.results if r.values is not None] == measured[0][:-1]


def test_a_spare_is_reused_only_for_a_copy_of_its_dtype() -> None:
    """A float32 spare is not handed out for a float64 copy of the same number of entries."""
    worker = ReductionWorker()
    spare = worker.buffer(16, torch.float32)
    worker.submit(64, lambda: ((lambda: None), spare))
    worker.wait()
    assert worker._spares.bytes == spare.numel() * spare.element_size()
    wide = worker.buffer(16, torch.float64)
    assert wide.dtype == torch.float64
    assert wide is not spare
    assert worker.buffer(16, torch.float32) is spare
    worker.close()


def test_closing_with_jobs_queued_keeps_no_spare_buffer() -> None:
    """Jobs that finish while the worker closes give their buffers back to nobody."""
    worker = ReductionWorker()
    gate = threading.Event()

    def held_at_the_gate() -> None:
        gate.wait()

    worker.submit(64, lambda: (held_at_the_gate, worker.buffer(16, torch.float32)))
    closer = threading.Thread(target=worker.close)
    closer.start()
    while not worker._closed:
        time.sleep(0.001)
    gate.set()
    closer.join()
    assert worker._finished == 1
    assert not worker._spares.bytes


def test_the_worker_reads_each_gradient_itself_not_a_copy(monkeypatch: Any) -> None:
    """A gradient handed to a hook reaches the reducers as that tensor's own memory."""
    reduced: set[int] = set()
    fill = Measurer._fill

    def watched(self: Measurer, plain: torch.Tensor, *args: Any) -> None:
        reduced.add(plain.data_ptr())
        fill(self, plain, *args)

    monkeypatch.setattr(Measurer, "_fill", watched)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    gradients: list[torch.Tensor] = []

    def keep_gradient(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        output.register_hook(gradients.append)

    for layer in model:
        layer.register_forward_hook(keep_gradient)
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=RecordingSink(), background_reductions=True
    ) as observer:
        observer.begin_step(0, sample=True)
        model(torch.randn(32, 16)).square().mean().backward()
        observer.end_step()
    assert len(gradients) == 3
    assert {grad.data_ptr() for grad in gradients} <= reduced


class _HalveInPlace(torch.autograd.Function):
    """Identity forward; its backward halves ``grad_output`` in place and passes it on."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.mul_(0.5)


class _Halving(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _HalveInPlace.apply(x)


def _observed(
    model: nn.Module, background_reductions: bool, run: Callable[[Observer], None]
) -> RecordingSink:
    """What ``run(observer)`` records of ``model``, every step sampled."""
    sink = RecordingSink()
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, background_reductions=background_reductions
    ) as observer:
        run(observer)
    return sink


def _halving_records(background_reductions: bool) -> RecordingSink:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), _Halving(), nn.Linear(32, 2))

    def run(observer: Observer) -> None:
        for step in range(3):
            observer.begin_step(step, sample=True)
            inputs = torch.randn(64, 8, generator=torch.Generator().manual_seed(step))
            model(inputs).square().mean().backward()
            observer.end_step()

    return _observed(model, background_reductions, run)


def test_a_gradient_changed_in_place_is_dropped_once_then_copied() -> None:
    """A custom backward that scales its ``grad_output`` in place never mixes into the values.

    The worker reads gradients without a copy; the ``_Halving`` module's output gradient
    changes in place right after its hook, so the first sample has no values for it
    (``modified_in_place``) and later samples copy it: their values are those of inline
    reduction, the gradient as the hook saw it.
    """
    worker, inline = _halving_records(True), _halving_records(False)
    first = worker.samples[0]
    changed = [r for r in first.rows if (r.layer, r.signal) == ("1", "output_gradient")]
    assert changed
    assert {(r.value, r.unavailable_reason) for r in changed} == {(None, "modified_in_place")}
    assert not [h for h in first.histograms if (h.layer, h.signal) == ("1", "output_gradient")]
    unchanged = [r for r in first.rows if (r.layer, r.signal) != ("1", "output_gradient")]
    assert unchanged == [r for r in inline.samples[0].rows if r in unchanged]
    assert len(unchanged) == len(inline.samples[0].rows) - len(changed)
    assert [s.rows for s in worker.samples[1:]] == [s.rows for s in inline.samples[1:]]
    assert worker.value("1", "output_gradient", "mean") is not None


def test_shared_gradients_are_let_go_once_reduced() -> None:
    """The worker keeps no gradient past its reduction: the next hook or the sample lets go."""
    measurer = Measurer(default_reducers(), HistogramReducer(), background=True)
    try:
        gradient = torch.randn(1000)
        first = measurer.measure(gradient, with_histogram=False, shared=True)
        held = [first.shared is not None]
        measurer.wait()
        measurer.measure(torch.randn(10), with_histogram=False)  # the next hook
        held.append(first.shared is not None)
        assert held == [True, False]
        assert first.reason is None
        assert first.settle() is None
        assert first.results[0].values is not None
        alive = weakref.ref(gradient)
        del gradient
        gc.collect()
        assert alive() is None
    finally:
        measurer.close()


def test_a_shared_tensor_changed_before_the_sample_settles_has_no_values() -> None:
    """An in-place change after the hand-over drops the values, whenever the worker read it."""
    measurer = Measurer(default_reducers(), HistogramReducer(), background=True)
    try:
        gradient = torch.randn(1000)
        measurement = measurer.measure(gradient, with_histogram=True, shared=True)
        gradient.mul_(2)
        assert measurement.settle() is None
        assert measurement.reason == "modified_in_place"
        assert measurement.results == []
        assert (measurement.histogram, measurement.n_finite) == (None, None)
        assert measurement.shared is None
    finally:
        measurer.close()


def _values(measurement: Any) -> list[Any]:
    assert measurement.settle() is None
    assert measurement.reason is None
    return [
        floats(measurement.n_finite),
        *[floats(result.values) for result in measurement.results],
        floats(measurement.histogram),
    ]


def _hook_copies(monkeypatch: Any) -> list[int]:
    """The sizes of the copies the hooks make into the worker's buffers, as they are made."""
    copies: list[int] = []
    buffer = ReductionWorker.buffer

    def counted(self: ReductionWorker, numel: int, dtype: torch.dtype) -> torch.Tensor:
        copies.append(numel)
        return buffer(self, numel, dtype)

    monkeypatch.setattr(ReductionWorker, "buffer", counted)
    return copies


@pytest.mark.parametrize("kind", ["strided", "bfloat16"])
def test_a_strided_or_narrow_tensor_read_in_place_is_flattened_on_the_worker(
    monkeypatch: Any, kind: str
) -> None:
    """No copy in the hook: the worker makes the flat float32 tensor, with inline's values.

    A change in place after the hand-over still drops the values (``modified_in_place``).
    """
    base = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    tensor = base.t() if kind == "strided" else base.to(torch.bfloat16)
    inline = Measurer(default_reducers(), HistogramReducer(), background=False)
    expected = _values(inline.measure(tensor, with_histogram=True, shared=True))
    copies = _hook_copies(monkeypatch)
    measurer = Measurer(default_reducers(), HistogramReducer(), background=True)
    try:
        measurement = measurer.measure(tensor, with_histogram=True, shared=True)
        assert measurement.shared is not None
        assert _values(measurement) == expected
        changed = measurer.measure(tensor, with_histogram=True, shared=True)
        tensor.mul_(2)
        assert changed.settle() is None
        assert changed.reason == "modified_in_place"
    finally:
        measurer.close()
    assert copies == []


@pytest.mark.parametrize("view", ["last token", "first rows"])
def test_a_slice_of_a_larger_tensor_is_copied_not_held(monkeypatch: Any, view: str) -> None:
    """Holding a slice would keep its whole base alive, past what the byte budget counts.

    A last-token slice (strided) or the first rows (contiguous) of a 4 MiB activation is copied
    in the hook: the worker holds 4 KiB, not 4 MiB.
    """
    base = torch.randn(32, 128, 256)
    tensor = base[:, -1, :] if view == "last token" else base[:4].reshape(-1)[:1024]
    copies = _hook_copies(monkeypatch)
    measurer = Measurer(default_reducers(), HistogramReducer(), background=True)
    try:
        measurement = measurer.measure(tensor, with_histogram=False, shared=True)
        assert measurement.shared is None
        assert measurement.settle() is None
        assert measurement.reason is None
    finally:
        measurer.close()
    assert copies == [tensor.numel()]


def test_a_result_viewing_the_workers_float32_copy_keeps_only_itself() -> None:
    """A custom reducer's slice of a converted tensor does not keep the whole copy alive."""

    class First:
        metrics = ("first",)

        def reduce(self, prepared: PreparedTensor) -> torch.Tensor:
            return prepared.values[:1]

    tensor = torch.randn(1 << 20).to(torch.bfloat16)
    measurer = Measurer([First()], HistogramReducer(), background=True)
    try:
        measurement = measurer.measure(tensor, with_histogram=False, shared=True)
        assert measurement.settle() is None
        (result,) = measurement.results
        assert isinstance(result.values, torch.Tensor)  # a custom reducer's: no kernels
        assert result.values.untyped_storage().nbytes() == 4
        assert result.values.item() == tensor[0].float().item()
    finally:
        measurer.close()


def test_strided_and_bfloat16_tensors_give_the_values_of_inline_reduction() -> None:
    """A model in bfloat16 whose outputs are transposed: the worker's rows are inline's."""

    class Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).transpose(0, 1)

    def records(background_reductions: bool) -> RecordingSink:
        torch.manual_seed(0)
        model = nn.Sequential(Transposed(), nn.GELU()).to(torch.bfloat16)

        def run(observer: Observer) -> None:
            for step in range(3):
                observer.begin_step(step, sample=True)
                inputs = torch.randn(64, 16, generator=torch.Generator().manual_seed(step))
                model(inputs.to(torch.bfloat16)).float().square().mean().backward()
                observer.end_step()

        return _observed(model, background_reductions, run)

    worker, inline = records(True), records(False)
    assert [s.rows for s in worker.samples] == [s.rows for s in inline.samples]
    assert [s.histograms for s in worker.samples] == [s.histograms for s in inline.samples]
    assert all(row.value is not None for sample in worker.samples for row in sample.rows)


def test_outputs_are_shared_once_a_forward_left_them_unchanged(monkeypatch: Any) -> None:
    """The first sample copies every output; later ones only the one changed in place after.

    ``_model``'s in-place ReLU changes the first Linear's output once its hook has returned:
    that output stays copied, the others are read where they lie from the second sample on.
    """
    reduced: list[set[int]] = []
    copied: list[list[int]] = []
    fill, buffer = Measurer._fill, ReductionWorker.buffer

    def watched_fill(self: Measurer, plain: torch.Tensor, *args: Any) -> None:
        reduced[-1].add(plain.data_ptr())
        fill(self, plain, *args)

    def watched_buffer(self: ReductionWorker, numel: int, dtype: torch.dtype) -> torch.Tensor:
        copied[-1].append(numel)
        return buffer(self, numel, dtype)

    monkeypatch.setattr(Measurer, "_fill", watched_fill)
    monkeypatch.setattr(ReductionWorker, "buffer", watched_buffer)
    model = _model()
    outputs: list[dict[str, torch.Tensor]] = []  # kept alive: no later tensor takes their memory
    for name, layer in model.named_children():
        layer.register_forward_hook(
            lambda _m, _i, out, name=name: outputs[-1].__setitem__(name, out)
        )
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=RecordingSink(), background_reductions=True
    ) as observer:
        for step in range(3):
            reduced.append(set())
            copied.append([])
            outputs.append({})
            observer.begin_step(step, sample=True)
            model(torch.randn(256, 64)).sum().backward()
            observer.end_step()
    read_in_place = [
        {name for name, tensor in out.items() if tensor.data_ptr() in red}
        for out, red in zip(outputs, reduced, strict=True)
    ]
    assert read_in_place[0] == set()
    # "0" is the ReLU's output too ("1"), which is read where it lies: the same memory
    assert read_in_place[1] == read_in_place[2] == {"0", "1", "2", "3", "4"}
    # the loss's gradient is expanded (not contiguous): flattened on the worker, never copied
    # in the hook; output "0" is copied every time
    widest, loss = 256 * 512, 256 * 8
    assert sorted(copied[0]) == [loss, widest, widest, widest, widest]
    assert sorted(copied[1]) == sorted(copied[2]) == [widest]


def _changed_after_forward(background_reductions: bool) -> RecordingSink:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))

    def run(observer: Observer) -> None:
        for step in range(3):
            observer.begin_step(step, sample=True)
            output = model(torch.randn(64, 8, generator=torch.Generator().manual_seed(step)))
            output.add_(1)  # after the forward: the last Linear's output changes in place
            output.square().mean().backward()
            observer.end_step()

    return _observed(model, background_reductions, run)


def test_an_output_changed_after_the_forward_is_dropped_once_then_copied(
    monkeypatch: Any,
) -> None:
    """An output a forward left unchanged is shared; changed later, its values are dropped once.

    Only the sample that read it without a copy loses them (``modified_in_place``); the others
    have the values of inline reduction, the output as its hook saw it. The Python worker's
    (the kernels' queue, which would take these small samples, copies every tensor).
    """
    monkeypatch.setattr(NativeWorker, "available", staticmethod(lambda: False))
    worker, inline = _changed_after_forward(True), _changed_after_forward(False)

    def changed(row: Any) -> bool:
        return (row.layer, row.signal) == ("2", "output")

    for index, (got, want) in enumerate(zip(worker.samples, inline.samples, strict=True)):
        if index == 1:
            dropped = [r for r in got.rows if changed(r)]
            assert dropped
            assert {(r.value, r.unavailable_reason) for r in dropped} == {
                (None, "modified_in_place")
            }
            assert [r for r in got.rows if not changed(r)] == [
                r for r in want.rows if not changed(r)
            ]
        else:
            assert got.rows == want.rows, index
    assert worker.value("2", "output", "mean") == inline.value("2", "output", "mean")


def test_an_inference_mode_forward_is_reduced_from_copies() -> None:
    """Inference tensors have no version to check: every sample copies them, same values."""

    def records(background_reductions: bool) -> RecordingSink:
        model = _model()

        def run(observer: Observer) -> None:
            for step in range(2):
                observer.begin_step(step, sample=True)
                with torch.inference_mode():
                    model(torch.randn(256, 64, generator=torch.Generator().manual_seed(step)))
                observer.end_step()

        return _observed(model, background_reductions, run)

    worker, inline = records(True), records(False)
    assert [s.rows for s in worker.samples] == [s.rows for s in inline.samples]
    assert all(r.unavailable_reason is None for r in worker.rows)


def test_only_tensors_whose_changes_move_their_version_are_shared(tmp_path: Any) -> None:
    """Plain tensors are; nested, inference and subclass tensors, and all under a group, not.

    ``Measurer`` reads whether a group is up at the first shared tensor of each sample.
    """
    from torchinstruments_core._measurement import shareable

    assert shareable(torch.randn(3))
    jagged = [torch.randn(2), torch.randn(3)]
    assert not shareable(torch.nested.nested_tensor(jagged, layout=torch.jagged))
    with torch.inference_mode():
        assert not shareable(torch.randn(3))

    class Marked(torch.Tensor):
        pass

    assert not shareable(torch.randn(3).as_subclass(Marked))
    measurer = Measurer(default_reducers(), HistogramReducer(), background=True)
    before = measurer.measure(torch.randn(100), with_histogram=False, shared=True)
    assert before.shared is not None
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        assert not shareable(torch.randn(3))
        # a measurer reads the groups once a sample: from the next one on, nothing is shared
        measurer.new_sample()
        after = measurer.measure(torch.randn(100), with_histogram=False, shared=True)
        assert after.shared is None
        assert before.settle() is None
        assert after.settle() is None
    finally:
        measurer.close()
        torch.distributed.destroy_process_group()


def test_a_hook_lets_go_only_what_its_own_thread_handed_over() -> None:
    """Another thread may be inside an in-place op on its tensor: only its own hook checks it."""
    measurer = Measurer(default_reducers(), HistogramReducer(), background=True)
    try:
        handed: list[Any] = []
        other = threading.Thread(
            target=lambda: handed.append(
                measurer.measure(torch.randn(100), with_histogram=False, shared=True)
            )
        )
        other.start()
        other.join()
        measurer.wait()
        mine = measurer.measure(torch.randn(100), with_histogram=False, shared=True)
        measurer.wait()
        measurer.measure(torch.randn(10), with_histogram=False)  # this thread's next hook
        assert mine.shared is None
        assert handed[0].shared is not None  # waits for its own thread, or the sample's close
        assert handed[0].settle() is None
        assert handed[0].shared is None
        assert handed[0].reason is None
    finally:
        measurer.close()


def test_dropped_values_take_their_reducers_errors_with_them() -> None:
    """A reducer that chokes on entries changing under it reports nothing: the values are gone."""
    measurer = Measurer([_Failing()], HistogramReducer(), background=True)
    try:
        gradient = torch.randn(100)
        measurement = measurer.measure(gradient, with_histogram=False, shared=True)
        measurer.wait()
        assert measurement.errors  # the reducer failed while reading it
        gradient.add_(1)
        assert measurement.settle() is None
        assert measurement.reason == "modified_in_place"
        assert measurement.errors == []
    finally:
        measurer.close()


def _rollout_records(background_reductions: bool, monkeypatch: Any) -> RecordingSink:
    """Four forwards of a policy on one numpy buffer that the loop refills, then one backward.

    The buffer is written through numpy, which never moves a tensor's version; each reduction
    waits 2 ms, so that the worker reads after the next refill if it reads the buffer itself.
    """
    fill = Measurer._fill

    def slow(self: Measurer, *args: Any) -> None:
        time.sleep(0.002)
        fill(self, *args)

    monkeypatch.setattr(Measurer, "_fill", slow)
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Flatten(), nn.Linear(12, 4))
    observations = torch.zeros(2, 3, 4).numpy()

    def run(observer: Observer) -> None:
        for update in range(2):
            observer.begin_step(update, sample=True)
            losses = []
            for step in range(4):
                observations[:] = 4 * update + step  # the environment's next observation
                losses.append(policy(torch.from_numpy(observations)).square().mean())
            torch.stack(losses).sum().backward()
            observer.end_step()

    return _observed(policy, background_reductions, run)


def test_views_of_what_autograd_did_not_compute_are_always_copied(monkeypatch: Any) -> None:
    """A view of a numpy buffer that the loop refills is copied: its values are the hook's."""
    worker = _rollout_records(True, monkeypatch)
    inline = _rollout_records(False, monkeypatch)
    assert [s.rows for s in worker.samples] == [s.rows for s in inline.samples]
    samples = sorted(worker.samples, key=lambda sample: sample.sample_id)
    means = [worker.value("0", "output", "mean", sample_id=s.sample_id) for s in samples]
    assert means == [float(n) for n in range(8)]  # each forward's own observation


def test_only_what_autograd_computed_is_read_without_a_copy() -> None:
    """Outputs autograd made, and views of them; not views of inputs, buffers or parameters."""
    from torchinstruments_core._probe import _computed

    leaf = torch.randn(4, 3)
    weight = nn.Parameter(torch.randn(4, 3))
    activation = (leaf * 2).requires_grad_()
    made = weight * 2
    assert _computed(made)
    assert _computed(made.view(-1))
    assert _computed(made.relu_())
    assert not _computed(leaf.view(-1))
    assert not _computed(activation)  # a leaf: nothing computed it
    assert not _computed(weight.view(-1))
    running_mean = nn.BatchNorm1d(3).running_mean
    assert running_mean is not None
    assert not _computed(running_mean)
    with torch.no_grad():
        assert not _computed(weight * 2)


def test_a_change_found_at_a_hook_makes_the_next_open_sample_copy(monkeypatch: Any) -> None:
    """With several samples open, only the one read when the change was found loses values.

    Each forward's output changes in place after the forward; the second sample shares it,
    and the third sample's first hook finds the change and copies from then on. The Python
    worker's (the kernels' queue, which would take these small samples, copies every tensor).
    """
    monkeypatch.setattr(NativeWorker, "available", staticmethod(lambda: False))

    def records(background_reductions: bool) -> RecordingSink:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))

        def run(observer: Observer) -> None:
            observer.begin_step(0, sample=True)
            losses = []
            for forward in range(4):
                output = model(torch.randn(64, 8, generator=torch.Generator().manual_seed(forward)))
                output.add_(1)
                losses.append(output.square().mean())
                observer._config.measurer.wait()  # the worker is done before the next forward
            torch.stack(losses).sum().backward()
            observer.end_step()

        return _observed(model, background_reductions, run)

    worker, inline = records(True), records(False)
    by_forward = [sorted(sink.samples, key=lambda s: s.sample_id) for sink in (worker, inline)]
    reasons = [
        {r.unavailable_reason for r in s.rows if (r.layer, r.signal) == ("2", "output")}
        for s in by_forward[0]
    ]
    assert reasons == [{None}, {"modified_in_place"}, {None}, {None}]
    for index in (0, 2, 3):
        assert by_forward[0][index].rows == by_forward[1][index].rows


class _BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock``: in-place ReLUs and ``out += identity``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def _resnet_like() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        _BasicBlock(16),
        _BasicBlock(16),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    images = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return model, lambda: model(images).logsumexp(1).mean()


def _gpt2() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, lambda: model(input_ids=tokens, labels=tokens).loss


@pytest.mark.parametrize("build", [_resnet_like, _gpt2], ids=["resnet-block", "hf-gpt2"])
def test_models_of_others_give_the_same_values_with_tensors_read_in_place(
    build: Callable[[], tuple[nn.Module, Callable[[], torch.Tensor]]], monkeypatch: Any
) -> None:
    """A ResNet's in-place patterns and Hugging Face's GPT-2: worker and hooks agree, no drop.

    From the second sample on the worker reads gradients and the outputs the first forward
    left unchanged where they lie; the others (under an in-place ReLU, ``out +=``) stay copied.
    """

    def records(background_reductions: bool) -> RecordingSink:
        torch.manual_seed(0)
        model, loss = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def run(observer: Observer) -> None:
            for step in range(3):
                observer.begin_step(step, sample=True)
                loss().backward()
                optimizer.step()
                optimizer.zero_grad()
                observer.end_step()

        return _observed(model, background_reductions, run)

    shared: list[bool] = []
    job = Measurer._job

    def watched(
        self: Measurer, plain: torch.Tensor, measurement: Any, *args: Any, **kw: Any
    ) -> Any:
        made = job(self, plain, measurement, *args, **kw)
        shared.append(measurement.shared is not None)
        return made

    monkeypatch.setattr(Measurer, "_job", watched)
    worker, inline = records(True), records(False)
    assert any(shared)  # gradients, and outputs after the first sample, read in place
    assert not all(shared)  # the first sample's outputs, and those changed in place, copied
    assert [s.rows for s in worker.samples] == [s.rows for s in inline.samples]
    assert [s.histograms for s in worker.samples] == [s.histograms for s in inline.samples]
    assert {r.unavailable_reason for r in worker.rows} == {None}


def _ran_within(seconds: float, done: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.005)
    return done()


def test_small_jobs_wait_for_a_kick_or_a_waiter_and_large_ones_wake_the_worker() -> None:
    """Below ``wake_bytes`` queued, an idle worker sleeps on; ``kick`` and ``wait`` wake it."""
    worker = ReductionWorker(wake_bytes=1000)
    ran: list[str] = []

    def job(name: str) -> Any:
        return (lambda: ran.append(name)), None

    worker.submit(16, functools.partial(job, "first"))  # starts the thread, which runs it
    worker.wait()
    ticket = worker.submit(16, functools.partial(job, "small"))
    assert not _ran_within(0.2, lambda: worker.done(ticket))  # 16 of 1000 bytes: no wake
    worker.kick()
    assert _ran_within(5, lambda: worker.done(ticket))
    worker.submit(16, functools.partial(job, "asleep"))
    worker.wait()  # wakes the worker for it instead of waiting forever
    assert ran == ["first", "small", "asleep"]
    ticket = worker.submit(1000, functools.partial(job, "large"))  # reaches wake_bytes
    assert _ran_within(5, lambda: worker.done(ticket))
    small = [worker.submit(400, functools.partial(job, f"part {n}")) for n in range(3)]
    assert _ran_within(5, lambda: worker.done(small[-1]))  # together they pass wake_bytes
    worker.close()


def test_a_job_that_holds_nothing_reserves_no_room_but_still_wakes_the_worker() -> None:
    """``held=False`` (a tensor read in place): none of the budget, its bytes still wake.

    A job holding the whole budget blocks on an event; a second job that holds it too would
    wait for room, one that holds nothing is queued at once, and its bytes wake the worker
    as a copy's would.
    """
    worker = ReductionWorker(floor=0, wake_bytes=1000)
    release, ran = threading.Event(), []

    def blocked() -> None:
        release.wait(5)

    worker.submit(1000, lambda: (blocked, None))  # holds the budget
    started = time.perf_counter()
    ticket = worker.submit(1000, lambda: ((lambda: ran.append("read")), None), held=False)
    assert time.perf_counter() - started < 1  # queued without waiting for room
    assert not worker.done(ticket)
    release.set()
    assert _ran_within(5, lambda: worker.done(ticket))  # woken by its 1000 bytes: no wait()
    assert ran == ["read"]
    assert worker._held == 0
    worker.close()


def test_a_hook_waiting_for_room_wakes_the_worker_for_the_jobs_that_hold_it() -> None:
    """The room a hook waits for is held by jobs too small to wake the worker: no deadlock."""
    worker = ReductionWorker(floor=0, wake_bytes=10**9)
    worker.submit(100, lambda: ((lambda: None), None))
    worker.wait()
    worker.submit(100, lambda: ((lambda: None), None))  # holds the whole budget, asleep
    submitted = threading.Event()

    def hook() -> None:
        worker.submit(100, lambda: ((lambda: None), None))  # waits for the room
        submitted.set()

    thread = threading.Thread(target=hook, daemon=True)
    thread.start()
    assert submitted.wait(5), "the hook waited for room the sleeping worker never gave back"
    worker.wait()
    worker.close()


def test_the_end_of_a_sampled_forward_starts_the_worker_on_its_outputs(monkeypatch: Any) -> None:
    """Outputs too small to wake the worker are reduced during the backward, not after it.

    Without the kernels' queue, which would take the second sample (a small one).
    """
    monkeypatch.setattr(NativeWorker, "available", staticmethod(lambda: False))
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    observer = inject_observer(model, sink=RecordingSink(), background_reductions=True)
    worker = observer._config.measurer._worker
    for step in range(2):  # the first starts the thread, which then runs what it finds queued
        observer.begin_step(step, sample=True)
        before = worker._submitted
        loss = model(torch.randn(4, 8)).sum()
        assert worker._submitted == before + 3  # three outputs, 128 bytes each: no wake
        assert _ran_within(5, lambda: worker.done(worker._submitted))  # kicked as it ended
        loss.backward()
        observer.end_step()
    observer.remove()


def test_gradient_hooks_share_one_eager_wrapper_made_once_per_observer() -> None:
    """Wrapping the hook for ``torch.compile`` per output cost every output ~10 us a sample."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    seen: list[object] = []
    with inject_observer(model, sink=RecordingSink()) as observer:
        for step in range(2):
            observer.begin_step(step, sample=True)
            output = model(torch.randn(4, 8))
            seen.extend(hook._on_gradient for hook in output._backward_hooks.values())
            output.sum().backward()
            observer.end_step()
    assert len(seen) == 2
    assert seen[0] is seen[1]
    assert getattr(seen[0], "_torchdynamo_disable", False)  # still kept out of compiled graphs


def _copies_per_sample(monkeypatch: Any, model: nn.Module, steps: int) -> list[list[int]]:
    """The sizes of the copies each sampled step made for the worker (its ``buffer`` calls).

    Without the kernels' queue, which would take these small samples and copies every tensor.
    """
    copied: list[list[int]] = []
    buffer = ReductionWorker.buffer

    def watched(self: ReductionWorker, numel: int, dtype: torch.dtype) -> torch.Tensor:
        copied[-1].append(numel)
        return buffer(self, numel, dtype)

    monkeypatch.setattr(ReductionWorker, "buffer", watched)
    monkeypatch.setattr(NativeWorker, "available", staticmethod(lambda: False))
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=RecordingSink(), background_reductions=True
    ) as observer:
        for step in range(steps):
            copied.append([])
            observer.begin_step(step, sample=True)
            model(torch.randn(32, 16)).square().sum().backward()
            observer.end_step()
    return copied


def test_an_output_the_model_frees_during_the_forward_is_learned_and_read_in_place(
    monkeypatch: Any,
) -> None:
    """A Linear's output, freed once the (saving) Tanh has read it, stops being copied."""
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8))
    copied = _copies_per_sample(monkeypatch, model, 3)
    assert sorted(copied[0]) == [32 * 8, 32 * 64, 32 * 64]  # each output once, to learn
    assert copied[1] == copied[2] == []


def test_outputs_past_the_bytes_a_sample_may_hold_are_learned_in_later_samples(
    monkeypatch: Any,
) -> None:
    """Holding outputs until their forward ends is bounded; what did not fit is held later."""
    from torchinstruments_core import _probe

    held: list[int] = []
    hold = _probe._hold

    def watched(sample: Sample, tensor: torch.Tensor) -> Any:
        made = hold(sample, tensor)
        held.append(sample.held_bytes)
        return made

    monkeypatch.setattr(_probe, "_hold", watched)
    monkeypatch.setattr(_probe, "LEARN_BYTES", 32 * 64 * 4)  # one hidden output in float32
    # the first two outputs are freed during the forward; only one fits in the bytes held
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    copied = _copies_per_sample(monkeypatch, model, 4)
    assert max(held) <= 32 * 64 * 4
    assert len(copied[0]) == 4
    assert copied[1] == [32 * 64]  # the second output, not held and freed: copied, held now
    assert copied[2] == copied[3] == []


def test_a_small_job_queued_while_a_hook_waits_for_room_wakes_the_worker() -> None:
    """Room held by a job still being made: once it is queued, small as it is, it runs."""
    worker = ReductionWorker(floor=0, wake_bytes=10**9)
    worker.submit(100, lambda: ((lambda: None), None))  # starts the thread
    worker.wait()
    making, got_room = threading.Event(), threading.Event()
    release = threading.Event()

    def slow_copy() -> Any:
        making.set()
        release.wait(5)  # the hook of thread A still copying, its room reserved
        return (lambda: None), None

    a = threading.Thread(target=worker.submit, args=(100, slow_copy), daemon=True)
    a.start()
    assert making.wait(5)

    def hook_b() -> None:
        worker.submit(100, lambda: ((lambda: None), None))  # waits for A's room
        got_room.set()

    b = threading.Thread(target=hook_b, daemon=True)
    b.start()
    time.sleep(0.1)  # B is waiting now
    release.set()  # A queues a job far below wake_bytes
    assert got_room.wait(5), "the job B waited for slept on the worker"
    worker.wait()
    worker.close()


def test_callers_waiting_together_do_not_wake_each_other_while_a_job_runs() -> None:
    """Two threads in ``wait`` sleep until the job ends, instead of notifying each other."""
    worker = ReductionWorker()
    calls: collections.Counter[str] = collections.Counter()
    wait = worker._condition.wait

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[threading.current_thread().name] += 1
        return wait(*args, **kwargs)

    worker._condition.wait = counted  # type: ignore[method-assign]
    started = threading.Event()

    def long_job() -> Any:
        def run() -> None:
            started.set()
            time.sleep(0.5)

        return run, None

    worker.submit(2**21, long_job)
    assert started.wait(5)
    waiters = [threading.Thread(target=worker.wait, name=f"waiter {n}") for n in range(2)]
    for thread in waiters:
        thread.start()
    for thread in waiters:
        thread.join(5)
    assert sum(calls.values()) <= 4  # one wait each, and a spurious wake at most
    worker.close()


class _FailsOnce(nn.Module):
    """Raises after its Linear's hook the first time; later changes that output in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.fail = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.lin(x)
        if self.fail:
            self.fail = False
            raise RuntimeError("a bad batch")
        hidden.relu_()
        return hidden.sum()


def test_a_forward_that_raised_teaches_nothing_about_its_outputs() -> None:
    """The in-place change it did not reach is seen by the next forward, and nothing is dropped."""
    torch.manual_seed(0)
    model = _FailsOnce()
    sink = RecordingSink()
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, background_reductions=True
    ) as observer:
        with pytest.raises(RuntimeError, match="a bad batch"):
            model(torch.randn(8, 16))
        for _ in range(3):
            model(torch.randn(8, 16)).backward()
        observer.flush()
    reasons = {r.unavailable_reason for r in sink.rows if (r.layer, r.signal) == ("lin", "output")}
    assert reasons == {None}


class _Table(nn.Module):
    """Returns its parameter, or a view of it: autograd makes the gradient ``weight.grad``."""

    def __init__(self, *, view: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 8))
        self.view = view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.view(16, 8) if self.view else self.weight


class _Bias(nn.Module):
    """Adds a parameter of the input's shape: the output's gradient is the bias's, unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class _WithTable(nn.Module):
    def __init__(self, *, view: bool) -> None:
        super().__init__()
        self.table = _Table(view=view)
        self.bias = _Bias()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.bias(x) * self.table(x))


def _changed_after_backward(
    background_reductions: bool, *, view: bool
) -> tuple[RecordingSink, int]:
    """One step whose loop changes the parameters' gradients in place before end_step.

    Through ``clip_grad_norm_`` (torch's in-place ops) and through ``.data`` (which no version
    counter sees). Returns the records and how many samples were delivered before end_step.
    """
    torch.manual_seed(0)
    model = _WithTable(view=view)
    sink = RecordingSink()
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, background_reductions=background_reductions
    ) as observer:
        observer.begin_step(0, sample=True)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        model(x).pow(2).sum().backward()
        delivered = len(sink.samples)
        nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        for parameter in model.parameters():
            assert parameter.grad is not None
            parameter.grad.data.mul_(0.5)
        observer.end_step()
    return sink, delivered


@pytest.mark.parametrize("view", [False, True], ids=["parameter", "view"])
def test_gradients_changed_after_the_backward_keep_the_values_the_hook_saw(view: bool) -> None:
    """The loop's clipping and ``.data`` writes after the backward change nothing recorded.

    The table's output gradient (its parameter, or a view of it) and the bias's become the
    parameters' ``.grad`` as they are, read in place by the worker: the sample settles at the
    end of the backward, before the loop goes on, so its values are those of inline reduction.
    """
    worker, delivered = _changed_after_backward(True, view=view)
    inline, _ = _changed_after_backward(False, view=view)
    assert delivered == 1
    assert {r.unavailable_reason for r in worker.rows} == {None}
    assert [s.rows for s in worker.samples] == [s.rows for s in inline.samples]


def test_without_a_trainer_step_a_sample_settles_at_the_end_of_its_backward() -> None:
    """With no end_step to come, the end of the backward waits for the worker and delivers."""
    model = _model()
    sink = RecordingSink()
    with inject_observer(
        model, sampler=AlwaysSampler(), sink=sink, background_reductions=True
    ) as observer:
        model(torch.randn(8, 64)).sum().backward()
        assert len(sink.samples) == 1
        assert sink.value("2", "output_gradient", "mean") is not None
        worker = observer._config.measurer._worker
        assert worker._finished == worker._submitted


def test_a_sample_opened_for_a_step_settles_at_the_end_of_its_backward() -> None:
    """``open_sample(step)`` without ``begin_step`` and ``end_step``: delivered as it closes."""
    model = _model()
    sink = RecordingSink()

    class _Never:
        def should_sample(self, forward_index: int) -> bool:
            return False

    with inject_observer(
        model, sampler=_Never(), sink=sink, background_reductions=True
    ) as observer:
        observer.open_sample(step=7)
        output = model(torch.randn(8, 64))
        observer.finish_forward()
        output.sum().backward()
        assert len(sink.samples) == 1
        assert sink.samples[0].step == 7


class _RecordedOps(TorchDispatchMode):
    """The torch operations dispatched on this thread while active (the mode is thread-local)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[object] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _settled_values(measurement: Any) -> list[list[float]]:
    assert measurement.settle() is None
    measurement.let_go()
    assert measurement.reason is None
    return [floats(result.values) for result in measurement.results] + [
        floats(measurement.histogram)
    ]


def test_the_hook_hands_a_shared_tensor_to_the_worker_without_a_torch_operation() -> None:
    """A gradient reaches the worker with no torch call in the hook, an output with one (detach).

    The values are the inline ones.

    Each torch call releases the GIL, and while the worker reduces, taking it back costs the
    hook 5-15 us a call (``benchmarks/gil_handoff.py``).
    """
    gradient = torch.randn(64, 48, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(48, 48, requires_grad=True)
    output = gradient @ weight
    inline = Measurer(default_reducers(), HistogramReducer(), background=False)
    expected = [
        _settled_values(inline.measure(tensor, with_histogram=True))
        for tensor in (gradient, output)
    ]
    measurer = Measurer(default_reducers(), HistogramReducer(), background=True)
    try:
        with _RecordedOps() as on_gradient:
            from_gradient = measurer.measure(gradient, with_histogram=True, shared=True)
        with _RecordedOps() as on_output:
            from_output = measurer.measure(output, with_histogram=True, shared=True)
        assert from_gradient.worker is not None  # on the worker's path, shared
        assert from_gradient.shared is not None
        assert on_gradient.ops == []
        assert on_output.ops == [torch.ops.aten.detach.default]
        assert [_settled_values(from_gradient), _settled_values(from_output)] == expected
    finally:
        measurer.close()
        inline.close()
