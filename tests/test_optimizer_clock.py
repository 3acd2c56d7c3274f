"""OptimizerClock: the optimizer steps of one model, counted with torch alone."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from torchinstruments_core import ObservationWarning, RecordKind, inject_observer
from torchinstruments_core.adapter import OptimizerClock
from torchinstruments_core.testing import RecordingSink


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: int = 1) -> None:
    for _ in range(micro_batches):
        model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _recording_clock(
    model: nn.Module,
) -> tuple[OptimizerClock, list[None], list[torch.optim.Optimizer]]:
    """A clock on ``model`` that keeps its ticks and the optimizers handed to ``on_optimizer``."""
    ticks: list[None] = []
    handed: list[torch.optim.Optimizer] = []
    clock = OptimizerClock(model, lambda: ticks.append(None), on_optimizer=handed.append)
    return clock, ticks, handed


def test_a_plain_loop_ticks_once_per_optimizer_step() -> None:
    """One tick per optimizer step, whatever the number of accumulated micro-batches."""
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ticks: list[None] = []
    clock = OptimizerClock(model, lambda: ticks.append(None))
    for micro_batches in (1, 3, 2):
        _step(model, optimizer, micro_batches)
    clock.remove()
    _step(model, optimizer)  # after remove(): not counted
    clock.remove()  # again: nothing to do
    assert len(ticks) == 3


def test_an_optimizer_that_trains_another_model_is_ignored() -> None:
    """Only the optimizer of the watched model's parameters ticks, even when another steps first."""
    model, other = nn.Linear(4, 1), nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other_optimizer = torch.optim.Adam(other.parameters(), lr=0.1)
    ticks: list[None] = []
    clock = OptimizerClock(model, lambda: ticks.append(None))
    for _ in range(2):
        for _ in range(3):  # before the watched optimizer, and more often
            _step(other, other_optimizer)
        _step(model, optimizer)
    clock.remove()
    assert len(ticks) == 2


def test_a_step_the_grad_scaler_skips_is_not_counted() -> None:
    """An fp16 overflow (inf gradients) makes GradScaler skip the optimizer step: no tick."""
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    ticks: list[None] = []
    clock = OptimizerClock(model, lambda: ticks.append(None))
    for factor in (1.0, float("inf"), 1.0):
        scaler.scale(model(torch.randn(2, 4)).sum() * factor).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    clock.remove()
    assert len(ticks) == 2
    assert scaler.get_scale() < 2.0**10  # the overflow did happen: the scale backed off


def test_the_clock_does_not_keep_the_model_alive() -> None:
    """The clock holds the model weakly: a deleted model is collected, and no step counts then."""
    model = nn.Linear(4, 1)
    reference = weakref.ref(model)
    ticks: list[None] = []
    clock = OptimizerClock(model, lambda: ticks.append(None))
    del model
    gc.collect()
    assert reference() is None
    other = nn.Linear(4, 1)
    _step(other, torch.optim.SGD(other.parameters(), lr=0.1))
    clock.remove()
    assert ticks == []


class Pair(nn.Module):
    """Two parts trained by two optimizers, as a GAN's generator and discriminator."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _pair_step(model: Pair, optimizers: list[torch.optim.Optimizer]) -> None:
    for optimizer in optimizers:
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_followed_optimizers_tick_once_each_of_them_stepped() -> None:
    """Told two optimizers (wrapped ones too), one tick per loop iteration stepping both.

    Each goes to ``on_optimizer`` at once, unwrapped; the order they step in does not matter,
    and one stepping twice before the other does not tick twice.
    """
    model = Pair()
    first = torch.optim.SGD(model.first.parameters(), lr=0.1)
    second = torch.optim.Adam(model.second.parameters(), lr=0.1)
    clock, ticks, handed = _recording_clock(model)
    clock.follow([first, _Wrapper(second)])
    assert handed == [first, second]
    _pair_step(model, [first, second])
    _pair_step(model, [second, first])
    _pair_step(model, [first, first, second])
    clock.remove()
    assert len(ticks) == 3


def test_a_found_optimizer_is_handed_over_before_its_first_step_runs() -> None:
    """The optimizer found is handed over before its first step's update runs.

    From that step's pre-hook: a step hook registered there already runs in that first step.
    """
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    seen: list[bool] = []

    def watch(found: torch.optim.Optimizer) -> None:
        assert found is optimizer
        assert torch.equal(model.weight, before)  # the update has not run yet
        found.register_step_pre_hook(lambda *_: seen.append(True))

    clock = OptimizerClock(model, lambda: None, on_optimizer=watch)
    _step(model, optimizer)
    _step(model, optimizer)
    clock.remove()
    assert seen == [True, True]


def test_a_second_optimizer_found_is_not_followed_and_warns() -> None:
    """Without ``follow``, a second optimizer of the model warns once and is not followed."""
    model = Pair()
    first = torch.optim.SGD(model.first.parameters(), lr=0.1)
    second = torch.optim.SGD(model.second.parameters(), lr=0.1)
    clock, ticks, handed = _recording_clock(model)
    with pytest.warns(ObservationWarning, match=r"second optimizer \(SGD\).*optimizer=\[\.\.\.\]"):
        _pair_step(model, [first, second])
    _pair_step(model, [first, second])  # no second warning (filterwarnings=error)
    clock.remove()
    assert (handed, len(ticks)) == ([first], 2)


class _Wrapper:
    """A wrapper with a public ``optimizer`` attribute, as Accelerate's and Fabric's."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


def test_an_optimizer_found_during_a_sampled_step_records_that_step() -> None:
    """An adapter that finds its optimizer at the first step records that step (step 0).

    The step was announced sampled before any optimizer was watched; the clock hands the
    optimizer to ``watch_optimizer`` from its first step's pre-hook, and torch runs the step hooks
    registered there in that same step: the step record is there, with the gradient it used.
    """
    sink = RecordingSink()
    model = nn.Sequential(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with inject_observer(model, sink=sink) as observer:
        clock = OptimizerClock(model, lambda: None, on_optimizer=observer.watch_optimizer)
        observer.begin_step(0, sample=True)
        model(torch.randn(3, 4)).sum().backward()
        gradient = model[0].weight.grad.clone()  # type: ignore[union-attr,operator]
        optimizer.step()
        observer.begin_step(1, sample=False)
        clock.remove()
    records = [record for record in sink.samples if record.kind is RecordKind.STEP]
    assert [record.step for record in records] == [0]
    rms = sink.value("0", "parameter_gradient", "rms", tensor_path="weight")
    assert rms == pytest.approx(gradient.square().mean().sqrt().item())


class _Wrapped(torch.optim.SGD):
    """``step`` calls the one it overrides; ``fail`` makes the next call raise inside it."""

    fail = False

    def step(self, closure: object = None) -> object:  # type: ignore[override]
        return super().step(self._inner)

    def _inner(self) -> None:
        if self.fail:
            self.fail = False
            raise RuntimeError("the inner call failed")


@pytest.mark.parametrize("given", [False, True], ids=["found", "given"])
def test_a_subclass_step_calling_its_parent_s_ticks_once(given: bool) -> None:
    """Both calls' hooks run once torch has hooked ``SGD.step`` too: one tick a step.

    A call that raised inside the nested one (the loop goes on) leaves nothing behind: the
    later steps count once each.
    """
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # torch hooks ``SGD.step``
    model = nn.Linear(4, 1)
    optimizer = _Wrapped(model.parameters(), lr=0.1)
    assert getattr(torch.optim.SGD.step, "hooked", False), "both calls are hooked"
    ticks: list[None] = []
    clock = OptimizerClock(
        model, lambda: ticks.append(None), optimizers=[optimizer] if given else ()
    )
    for _ in range(3):
        _step(model, optimizer)
    assert len(ticks) == 3
    optimizer.fail = True
    with pytest.raises(RuntimeError, match="inner call failed"):
        _step(model, optimizer)
    optimizer.zero_grad()
    for _ in range(2):
        _step(model, optimizer)
    clock.remove()
    assert len(ticks) == 5


def test_step_calls_tell_the_outermost_call_by_its_frames() -> None:
    """``StepCalls`` on frames of its own: nested, left open by a call that raised, unknown."""
    import sys

    from torchinstruments_core._step_calls import StepCalls

    calls = StepCalls()
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    seen: list[tuple[str, bool]] = []

    def inner() -> None:
        frame = sys._getframe()
        seen.append(("inner enter", calls.enter(optimizer, frame)))
        seen.append(("inner leave", calls.leave(optimizer, frame)))

    def outer() -> None:
        frame = sys._getframe()
        seen.append(("outer enter", calls.enter(optimizer, frame)))
        inner()
        seen.append(("outer leave", calls.leave(optimizer, frame)))

    outer()
    assert seen == [
        ("outer enter", True),
        ("inner enter", False),
        ("inner leave", False),
        ("outer leave", True),
    ]
    assert not calls.open

    def raising() -> None:
        calls.enter(optimizer, sys._getframe())
        raise RuntimeError("the step failed")

    def kept() -> list[str]:
        return [frame.f_code.co_name for frame, _ in calls.open.values()]

    with pytest.raises(RuntimeError):
        raising()
    assert kept() == ["raising"]  # kept until a later call finds it gone
    seen.clear()
    outer()
    assert seen[0] == ("outer enter", True)
    assert seen[-1] == ("outer leave", True)
    with pytest.raises(RuntimeError):
        raising()
    assert calls.leave(optimizer, sys._getframe())  # the kept call is not running: outermost
    assert not calls.open


def test_a_step_that_raised_lets_go_of_what_its_frame_held_at_the_next_step() -> None:
    """The frame a raising step left with the clock is forgotten at any optimizer's next step.

    It held the failed attempt's optimizer, model and the caller's locals (an out-of-memory
    retry rebuilds both): once another optimizer steps, nothing keeps them alive.
    """
    import gc
    import weakref

    anchor = nn.Linear(4, 1)
    clock = OptimizerClock(anchor, lambda: None)

    def attempt() -> tuple[weakref.ref[torch.optim.Optimizer], weakref.ref[nn.Module]]:
        big = nn.Linear(64, 64)
        optimizer = torch.optim.Adam(big.parameters())
        big(torch.randn(2, 64)).sum().backward()

        def fail(*args: object) -> None:
            raise RuntimeError("out of memory")

        optimizer.register_step_pre_hook(fail)
        with pytest.raises(RuntimeError, match="out of memory"):
            optimizer.step()
        return weakref.ref(optimizer), weakref.ref(big)

    refs = attempt()
    retry = torch.optim.SGD(anchor.parameters(), lr=0.1)
    _step(anchor, retry)
    gc.collect()
    assert [ref() for ref in refs] == [None, None]
    clock.remove()


def test_a_compiled_step_reads_no_frame_and_ticks_once() -> None:
    """Under ``torch.compile`` the hooks read no frame (no graph break for it): one tick a step."""
    import warnings

    model = nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ticks: list[None] = []
    clock = OptimizerClock(model, lambda: ticks.append(None), optimizers=[optimizer])

    @torch.compile(backend="eager")
    def step() -> None:
        optimizer.step()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.randn(3, 4)).sum().backward()
            step()
            optimizer.zero_grad()
    clock.remove()
    assert len(ticks) == 3
    assert not [w for w in caught if "_getframe" in str(w.message)]
