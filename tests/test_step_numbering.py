"""StepNumbering and HoldingSink: an adapter's steps take the numbers of the user's own logging."""

from __future__ import annotations

import pytest

from torchinstruments_core import ObservationError, ObservationWarning, SampleRecord
from torchinstruments_core._config import ErrorPolicy
from torchinstruments_core._numbering import MAX_HELD_SAMPLES
from torchinstruments_core.adapter import HoldingSink, StepNumbering
from torchinstruments_core.testing import RecordingSink


class Loop:
    """Drives a numbering the way a training loop does: forwards, optimizer steps, logs."""

    def __init__(
        self, sink: RecordingSink | None = None, policy: ErrorPolicy = ErrorPolicy.WARN
    ) -> None:
        self.forwards = 0
        self.numbering = StepNumbering(lambda: self.forwards)
        self.sink = sink or RecordingSink()
        self.holding = HoldingSink(self.sink, self.numbering, error_policy=policy)

    def forward(self) -> None:
        self.forwards += 1

    def sample(self) -> None:
        """A sample of the current step reaches the sink (as at the end of its backward)."""
        step = self.numbering.step
        self.holding.write(record(sample_id=len(self.sink.samples) + 100 * step, step=step))

    def optimizer_step(self) -> None:
        self.numbering.stepped()
        self.holding.release()

    def log(self, step: int) -> None:
        self.numbering.logged(step)
        self.holding.release()

    def delivered(self) -> list[tuple[int | None, int | None]]:
        return [(s.step, s.optimizer_step) for s in self.sink.samples]


def record(*, sample_id: int = 0, step: int | None) -> SampleRecord:
    return SampleRecord("run", 0, sample_id, step, 0.0, False, 1.0, (), ())


@pytest.mark.parametrize("position", ["before", "after"])
@pytest.mark.parametrize("first", [0, 1, 1000])
def test_a_step_takes_the_number_its_log_gives_it_before_or_after_the_optimizer_step(
    position: str, first: int
) -> None:
    """Logging before or after optimizer.step, from any first number: step s is logged s+first."""
    loop = Loop()
    for s in range(4):
        loop.forward()
        loop.sample()
        if position == "before":
            loop.log(first + s)
        loop.optimizer_step()
        if position == "after":
            loop.log(first + s)
    assert loop.delivered() == [(first + s, s) for s in range(4)]


def test_a_sample_is_held_until_its_number_is_known() -> None:
    """Logging after the step: nothing leaves at the step's end, everything at its log."""
    loop = Loop()
    loop.forward()
    loop.sample()
    loop.optimizer_step()
    assert loop.delivered() == []
    loop.log(7)
    assert loop.delivered() == [(7, 0)]


def test_without_a_log_a_window_closes_at_the_next_forward() -> None:
    """With no log, a step's samples leave (at its count) once a later step has begun."""
    loop = Loop()
    loop.forward()
    loop.sample()
    loop.optimizer_step()
    loop.forward()
    assert loop.delivered() == []  # the numbering learns of forwards at its next event
    loop.optimizer_step()
    assert loop.delivered() == [(0, 0)]


def test_a_sample_arriving_after_its_window_closed_keeps_the_number_of_the_close() -> None:
    """A late sample of an unlogged step counts on from the log before its window closed.

    Its transfer was still in flight when the window closed; a later log does not move it.
    """
    loop = Loop()
    loop.log(50)  # before any forward: step 0 is 50 unless it logs
    loop.forward()
    loop.optimizer_step()
    loop.forward()
    loop.log(7)  # step 1
    loop.holding.write(record(step=0))
    assert loop.delivered() == [(50, 0)]


def test_unlogged_steps_count_on_from_the_last_log_and_the_first_log_wins() -> None:
    """Steps without a log count on from the last one; a second log in a window is ignored.

    A log before any forward numbers step 0 until step 0 logs itself. Step 1 logs 11 and then
    an epoch number (3): 11 stands. Steps 2 and 3 log nothing: 12, 13. Step 4 logs 40.
    """
    loop = Loop()
    loop.log(500)
    for logs in [[10], [11, 3], [], [], [40]]:
        loop.forward()
        loop.sample()
        loop.optimizer_step()
        for u in logs:
            loop.log(u)
    loop.holding.close()
    assert loop.delivered() == [(10, 0), (11, 1), (12, 2), (13, 3), (40, 4)]
    assert loop.sink.closed


def test_a_log_before_any_forward_numbers_step_zero_when_it_logs_nothing() -> None:
    """A resumed run that logs its first step before training and nothing in step 0."""
    loop = Loop()
    loop.log(1000)
    for _ in range(2):
        loop.forward()
        loop.sample()
        loop.optimizer_step()
    loop.holding.close()
    assert loop.delivered() == [(1000, 0), (1001, 1)]


def test_close_releases_what_is_held_and_samples_without_a_step_pass_unchanged() -> None:
    """At close the open window is numbered as it stands; a step-less sample is not renumbered."""
    loop = Loop()
    loop.holding.write(record(step=None))
    loop.forward()
    loop.sample()
    assert loop.delivered() == [(None, None)]
    loop.holding.close()
    assert loop.delivered() == [(None, None), (0, 0)]


def test_without_training_forwards_at_most_a_bounded_number_of_samples_wait() -> None:
    """Forwards under no_grad open no window; the samples still leave once too many wait."""
    loop = Loop()
    for _ in range(MAX_HELD_SAMPLES):
        loop.sample()
    assert loop.delivered() == []
    loop.sample()
    assert loop.delivered() == [(0, 0)] * (MAX_HELD_SAMPLES + 1)


class FailingSink(RecordingSink):
    def write(self, sample: SampleRecord) -> None:
        raise OSError("disk full")


@pytest.mark.parametrize("policy", [ErrorPolicy.WARN, ErrorPolicy.RAISE])
def test_a_failing_sink_during_release_follows_the_error_policy(policy: ErrorPolicy) -> None:
    """release() runs inside the user's log call: it warns once, or raises ObservationError."""
    loop = Loop(FailingSink(), policy)
    loop.forward()
    loop.sample()
    if policy is ErrorPolicy.RAISE:
        with pytest.raises(ObservationError, match=r"FailingSink could not write.*disk full"):
            loop.log(5)
    else:
        with pytest.warns(ObservationWarning, match="disk full"):
            loop.log(5)
        loop.optimizer_step()
        loop.forward()
        loop.sample()  # held: step 1 has no number yet
        loop.log(6)  # warned once: not again (filterwarnings=error would fail the test)


class PickySink(RecordingSink):
    """Takes every sample but the ones listed: those it refuses, as a finished W&B run does."""

    def __init__(self, refused: set[int]) -> None:
        super().__init__()
        self.refused = refused

    def write(self, sample: SampleRecord) -> None:
        if sample.sample_id in self.refused:
            raise RuntimeError(f"refused sample {sample.sample_id}")
        super().write(sample)


def test_a_sample_the_sink_refuses_at_close_does_not_hold_back_the_ones_after_it() -> None:
    """Every held sample is passed on at close; the refusals are raised once all have gone."""
    sink = PickySink({0, 1})
    loop = Loop(sink)
    loop.forward()
    for sample_id in range(4):
        loop.holding.write(record(sample_id=sample_id, step=0))
    with pytest.raises(ExceptionGroup) as raised:
        loop.holding.close()
    assert [s.sample_id for s in sink.samples] == [2, 3]
    assert sorted(str(e) for e in raised.value.exceptions) == [
        "refused sample 0",
        "refused sample 1",
    ]
    assert sink.closed


def test_with_a_multi_sink_the_run_directory_keeps_what_a_failing_logger_refuses() -> None:
    """Before a MultiSink: a logger failing at close costs the other sink nothing."""
    from torchinstruments_core.sinks import MultiSink

    kept, logger = RecordingSink(), FailingSink()
    numbering = StepNumbering(lambda: 1)
    holding = HoldingSink(MultiSink([kept, logger]), numbering)
    for sample_id in range(3):
        holding.write(record(sample_id=sample_id, step=0))
    with pytest.raises(ExceptionGroup):
        holding.close()
    assert [s.sample_id for s in kept.samples] == [0, 1, 2]
