"""``StepWindow``: which optimizer steps are recorded, and which sampled steps had none."""

from __future__ import annotations

from torchinstruments_core._step_window import StepWindow


def _watching() -> StepWindow:
    window = StepWindow()
    window.watching = True
    return window


def test_nothing_opens_until_an_optimizer_is_watched() -> None:
    """Without a watched optimizer a sample opens no window and no step is claimed."""
    window = StepWindow()
    assert window.sampled(0) is None
    assert not window.open
    assert not window.claim(object())


def test_each_optimizer_is_claimed_once_per_window() -> None:
    """In one window each optimizer's first step is claimed; its next step closes the window."""
    window, first, second = _watching(), object(), object()
    window.sampled(None)
    assert window.claim(first)
    assert window.claim(second)
    assert not window.claim(first)  # the next iteration's step: not sampled
    assert not window.open
    assert not window.claim(second)


def test_micro_batches_of_one_step_share_its_window() -> None:
    """Samples of the same trainer step share its window, before its optimizer step and after.

    After it: the next phase of a manual-optimization step (a GAN's critic, then a metric
    module after the last step). Each optimizer's first step is recorded once, a second one
    closes the window, and no second window of the step is noted as skipped.
    """
    window, generator, critic = _watching(), object(), object()
    window.sampled(3)
    assert window.sampled(3) is None  # the second micro-batch
    assert window.claim(generator)
    assert window.step == 3
    assert window.sampled(3) is None  # the critic's phase: the same window
    assert window.claim(critic)
    assert window.sampled(3) is None  # a module after the last step: still the same
    assert not window.claim(critic)  # the critic's second step: not recorded
    assert window.sampled(3) is None  # the critic's third phase: still the same window
    assert not window.claim(critic)  # nor its third
    assert window.step == 3
    assert window.announced(4) is None  # it stepped: nothing to note
    assert not window.open


def test_a_plain_loop_sample_after_the_optimizer_step_opens_a_new_window() -> None:
    """Without step numbers, a training sample after the step is the next iteration's."""
    window, optimizer = _watching(), object()
    window.sampled(None)
    assert window.claim(optimizer)
    assert window.sampled(None) is None
    assert window.claim(optimizer)  # a new window: its first step again


def test_a_step_without_an_optimizer_step_is_reported_once_the_next_begins() -> None:
    """A sampled step whose window closes unstepped is returned, by a new step or sample alike."""
    window, optimizer = _watching(), object()
    window.sampled(5)
    assert window.announced(5) is None  # the same step goes on
    assert window.announced(6) == 5
    window.sampled(6)
    assert window.sampled(7) == 6
    assert window.claim(optimizer)
    assert window.announced(8) is None  # it stepped


def test_a_plain_loop_window_is_never_reported_and_removal_reports_nothing() -> None:
    """Without step numbers there is nothing to note; ``close`` notes nothing either."""
    window = _watching()
    window.sampled(None)
    assert window.sampled(None) is None
    window.close()
    assert not window.open
    window.sampled(2)
    window.close()
    assert window.announced(3) is None
