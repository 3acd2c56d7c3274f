"""The live non-finite diagnosis of the core: the first layer, the watch, the dense schedule."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import pytest
import torch

from torchinstruments_core import (
    ConfigurationError,
    NonFiniteError,
    RecordKind,
    SampleRecord,
    Signal,
    StatRow,
)
from torchinstruments_core._nonfinite import find_onset
from torchinstruments_core.adapter import (
    NonFinitePolicy,
    NonFiniteWatch,
    TelemetryOptions,
    TriggeredSchedule,
)
from torchinstruments_core.routing import log_event


def _row(layer: str, signal: Signal, fraction: float | None, call: int = 0) -> StatRow:
    reason = None if fraction is not None else "reducer_error"
    return StatRow(layer, call, signal, "output", "nonfinite_fraction", fraction, reason)


def _record(*rows: StatRow, step: int = 7, kind: RecordKind = RecordKind.FORWARD) -> SampleRecord:
    std = StatRow("a", 0, Signal.OUTPUT, "output", "std", 1.0, None)  # not a fraction: ignored
    return SampleRecord("r", 0, 3, step, 0.0, False, 0.0, (std, *rows), (), kind=kind)


class _Recorder:
    """A target taking scalars and text, remembering each call."""

    def __init__(self) -> None:
        self.scalars: list[tuple[dict[str, float], int]] = []
        self.texts: list[tuple[str, str, int]] = []

    def log(self, scalars: Any, histograms: Any, step: int) -> None:
        self.scalars.append((dict(scalars), step))

    def log_text(self, key: str, text: str, step: int) -> None:
        self.texts.append((key, text, step))


def test_first_layer_in_execution_order_started_there() -> None:
    """The first non-finite tensor in execution order (the rows' order) of each pass is named.

    It started there since the tensor before it was finite.
    """
    record = _record(
        _row("embed", Signal.OUTPUT, 0.0),
        _row("attn", Signal.OUTPUT, 0.25),
        _row("head", Signal.OUTPUT, 1.0),
        _row("head", Signal.OUTPUT_GRADIENT, 0.0),
        _row("attn", Signal.OUTPUT_GRADIENT, 0.5),
        _row("embed", Signal.OUTPUT_GRADIENT, 1.0),
    )
    onset = find_onset(record)
    assert onset is not None
    assert onset.forward is not None
    assert (onset.forward.layer, onset.forward.fraction, onset.forward.started) == (
        "attn",
        0.25,
        True,
    )
    assert onset.backward is not None
    assert (onset.backward.layer, onset.backward.started) == ("attn", True)
    message = onset.message()
    assert "step 7" in message
    assert "forward: first at 'attn' output, 25% non-finite (started there" in message
    assert "backward: first at 'attn' output_gradient, 50% non-finite (started there" in message


def test_first_observed_tensor_of_a_pass_has_no_known_origin() -> None:
    """A pass's first tensor has no observed input: ``started`` is ``None``, the message says so.

    A call other than the first is named with its index.
    """
    record = _record(
        _row("fc", Signal.OUTPUT, 1.0),
        _row("fc", Signal.OUTPUT, 1.0, call=1),
        _row("fc", Signal.OUTPUT_GRADIENT, 1.0, call=1),
    )
    onset = find_onset(record)
    assert onset is not None
    assert onset.forward is not None
    assert onset.backward is not None
    assert onset.forward.started is None
    assert (onset.backward.call_index, onset.backward.started) == (1, None)
    assert "its input is not observed" in onset.message()
    assert "'fc' call 1 output_gradient" in onset.message()


def test_passed_on_when_the_previous_tensor_was_already_non_finite() -> None:
    """A tensor is passed on when the tensor before it in execution order was non-finite."""
    from torchinstruments_core._nonfinite import NonFiniteTensor

    passed = NonFiniteTensor("fc2", 0, Signal.OUTPUT, "output", 1.0, started=False)
    assert "passed on: its input was already non-finite" in passed.describe()


def test_finite_records_and_step_records_have_no_onset() -> None:
    """All fractions zero (or unavailable) give no onset; a step record is never read."""
    finite = _record(_row("a", Signal.OUTPUT, 0.0), _row("b", Signal.OUTPUT, None))
    assert find_onset(finite) is None
    step_record = _record(_row("a", Signal.OUTPUT, 1.0), kind=RecordKind.STEP)
    assert find_onset(step_record) is None


def test_triggered_schedule_samples_the_window_after_the_trigger() -> None:
    """A trigger at s samples s+1 … s+dense_steps only; a later trigger extends the window.

    ``dense_steps=0`` never samples more than the regular steps.
    """
    schedule = TriggeredSchedule(every_n_steps=10, dense_steps=3)
    assert schedule.trigger(12) == 15
    assert [s for s in range(25) if schedule.is_sampled(s)] == [0, 10, 13, 14, 15, 20]
    assert schedule.trigger(14) == 17
    assert [s for s in range(12, 19) if schedule.is_sampled(s)] == [13, 14, 15, 16, 17]
    off = TriggeredSchedule(every_n_steps=10, dense_steps=0)
    assert off.trigger(12) is None
    assert [s for s in range(25) if off.is_sampled(s)] == [0, 10, 20]


@pytest.mark.parametrize(
    ("argument", "value"),
    [("on_nonfinite", "halt"), ("sample_after_nonfinite", -1), ("sample_after_nonfinite", 1.5)],
)
def test_options_reject_bad_nonfinite_settings(argument: str, value: Any) -> None:
    """A bad choice raises at once, naming the argument and the value."""
    with pytest.raises(ConfigurationError, match=argument):
        TelemetryOptions(**{argument: value})


def _watch(policy: str, dense: int = 4, targets: Any = ()) -> NonFiniteWatch:
    schedule = TriggeredSchedule(every_n_steps=10, dense_steps=dense)
    return NonFiniteWatch(schedule, policy=NonFinitePolicy(policy), targets=targets, owner="Test")


def test_watch_reports_an_episode_once_and_routes_it(caplog: pytest.LogCaptureFixture) -> None:
    """An episode's first non-finite sample is logged, routed and samples densely, once.

    A WARNING names the layers; the targets get the text and the onset scalar at its step; the
    next non-finite samples of the episode do none of it, until a finite sample ends it.
    """
    target = _Recorder()
    watch = _watch("warn", targets=[target])
    bad = (_row("a", Signal.OUTPUT, 0.0), _row("b", Signal.OUTPUT, 1.0))
    with caplog.at_level(logging.INFO, logger="torchinstruments"):
        watch.write(_record(*bad, step=20))
        watch.write(_record(*bad, step=21))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "Test: non-finite values at step 20" in warnings[0].getMessage()
    assert "'b' output" in warnings[0].getMessage()
    assert any("sampling every step until step 24" in r.getMessage() for r in caplog.records)
    assert target.scalars == [({"telemetry/nonfinite_onset": 1.0}, 20)]
    assert [(key, step) for key, _, step in target.texts] == [("telemetry/nonfinite", 20)]
    assert watch.act() is False  # warn: nothing to do, and the onset is handled
    watch.write(_record(_row("b", Signal.OUTPUT, 0.0), step=22))
    watch.write(_record(*bad, step=23))
    assert [o.step for o in watch.onsets] == [20, 23]


def test_an_episode_spans_steps_with_a_non_finite_sample_among_finite_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Several samples a step (a GAN's phases): the step is non-finite if one of them is.

    A critic phase non-finite at every step, after a finite generator phase, is one episode,
    reported once; it ends with a step whose samples are all finite.
    """
    watch = _watch("warn")
    bad, good = _row("critic", Signal.OUTPUT, 1.0), _row("critic", Signal.OUTPUT, 0.0)
    with caplog.at_level(logging.WARNING, logger="torchinstruments"):
        for step in (20, 21, 22):
            watch.write(_record(good, step=step))
            watch.write(_record(bad, step=step))
        watch.write(_record(good, step=23))
        watch.write(_record(good, step=23))
        watch.write(_record(good, step=24))
        watch.write(_record(bad, step=24))
    assert [o.step for o in watch.onsets] == [20, 24]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_steps_are_told_apart_by_the_adapters_count_where_the_user_repeats_a_number() -> None:
    """Accelerate numbers steps as the loop logs them (``step=epoch`` repeats a number).

    Its own count (``optimizer_step``) tells the steps apart: a finite step between two
    non-finite ones ends the first episode, so the second one is reported.
    """
    watch = _watch("warn")
    bad, good = _row("a", Signal.OUTPUT, 1.0), _row("a", Signal.OUTPUT, 0.0)
    for count, row in enumerate((bad, good, bad)):
        record = dataclasses.replace(_record(row, step=3), optimizer_step=count)
        watch.write(record)
    assert len(watch.onsets) == 2


def test_watch_stop_and_raise_act_once() -> None:
    """``stop`` answers true once after an onset; ``raise`` raises ``NonFiniteError``.

    The error names the step and the layer and carries the onset.
    """
    bad = _record(_row("b", Signal.OUTPUT, 1.0), step=5)
    stop = _watch("stop")
    assert stop.act() is False
    stop.write(bad)
    assert stop.act() is True
    assert stop.act() is False
    fail = _watch("raise")
    fail.write(bad)
    with pytest.raises(NonFiniteError, match=r"step 5.*'b' output") as raised:
        fail.act()
    assert raised.value.onset is not None
    assert raised.value.onset.forward is not None


def test_ignore_reports_nothing_but_still_samples_densely() -> None:
    """``ignore`` logs and routes nothing and never stops, but the dense window still opens."""
    target = _Recorder()
    watch = _watch("ignore", targets=[target])
    watch.write(_record(_row("b", Signal.OUTPUT, 1.0), step=5))
    assert (target.scalars, target.texts, watch.onsets, watch.act()) == ([], [], [], False)
    assert watch.schedule.is_sampled(6)


@pytest.mark.parametrize(
    "loss", [float("nan"), torch.tensor(float("inf")), torch.tensor([float("nan")])]
)
def test_a_non_finite_loss_samples_the_following_steps(loss: Any) -> None:
    """A non-finite loss at step 3 (a float, a one-element tensor) samples steps 4 … 3+dense.

    A tensor's check is read at step 4's start; a finite loss leaves the schedule as it is.
    """
    watch = _watch("warn", dense=2)
    assert watch.begin_step(3) is False
    watch.check_loss(loss)
    assert [watch.begin_step(s) for s in (4, 5, 6)] == [True, True, False]
    calm = _watch("warn", dense=2)
    calm.begin_step(3)
    calm.check_loss(torch.tensor(1.0))
    assert calm.begin_step(4) is False


def test_a_lasting_non_finite_loss_triggers_once() -> None:
    """A loss that stays NaN opens one window; finite again, then NaN, opens another."""
    watch = _watch("warn", dense=2)  # every 10th step sampled regularly
    nan = float("nan")
    losses = dict(enumerate([1.0, 1.0, nan, nan, nan, nan, nan, 1.0, 1.0, nan, 1.0, 1.0], 1))
    sampled = []
    for step, loss in losses.items():
        if watch.begin_step(step):
            sampled.append(step)
        watch.check_loss(loss)
    # NaN from step 3 to 7 opens 4, 5 once; NaN at 10 (a regular step) opens 11, 12
    assert sampled == [4, 5, 10, 11, 12]


def test_a_cpu_loss_is_read_at_once_without_a_tensor_op() -> None:
    """A CPU loss's one value is read in ``check_loss``: no ``isfinite`` tensor, nothing pending.

    Its non-finite value samples the next steps as a float's does; a loss that requires grad
    and a one-element loss of another shape are read alike.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    watch = _watch("warn", dense=2)
    weight = torch.tensor([2.0], requires_grad=True)
    watch.begin_step(3)
    loss = (weight * float("nan")).sum()
    with Ops() as ops:
        watch.check_loss(loss)
    assert ops.names == ["aten._local_scalar_dense"]
    assert watch._loss is None
    assert [watch.begin_step(s) for s in (4, 5, 6)] == [True, True, False]
    watch.check_loss(torch.tensor(1.0))  # finite again: the episode ends
    watch.begin_step(7)
    watch.check_loss(torch.tensor([[float("inf")]]))
    assert watch._loss is None
    assert watch.begin_step(8) is True


def test_check_logged_reads_only_loss_keys() -> None:
    """Only values under a key containing ``loss`` (any case) are checked."""
    watch = _watch("warn", dense=1)
    watch.begin_step(0)
    watch.check_logged({"lr": float("nan"), "accuracy": torch.tensor(float("nan"))})
    assert watch.begin_step(1) is False
    watch.check_logged({"train/Loss": torch.tensor(float("nan"))})
    assert watch.begin_step(2) is True


def test_log_event_gives_scalar_only_targets_the_onset() -> None:
    """A target without ``log_text`` gets the onset scalar; one with it gets the text too."""
    from torchinstruments_core.routing import ScalarTarget

    calls: list[tuple[dict[str, float], int]] = []
    text = _Recorder()
    log_event([ScalarTarget(lambda m, s: calls.append((m, s))), text], "p/nonfinite", "msg", 9)
    assert calls == [({"p/nonfinite_onset": 1.0}, 9)]
    assert text.texts == [("p/nonfinite", "msg", 9)]


def test_unsampled_step_cost_is_small() -> None:
    """The watch's work on an unsampled CPU step stays far below a millisecond.

    That is ``begin_step`` and ``check_loss`` of a 0-dim loss.
    """
    watch = _watch("warn")
    loss = torch.tensor(0.5)
    rounds = 2000
    started = time.perf_counter()
    for step in range(1, rounds + 1):
        watch.begin_step(step * 10 + 1)
        watch.check_loss(loss)
    per_step = (time.perf_counter() - started) / rounds
    assert per_step < 200e-6, per_step
