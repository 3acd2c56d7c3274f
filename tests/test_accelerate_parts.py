"""TelemetryTracker on a loop that calls the parts of the watched model, never the model itself.

A GAN kept in one module, as such loops keep it: the loop calls ``gan.G`` and ``gan.D`` and
steps one optimizer for each. A real Accelerate loop on the CPU with the TensorBoard tracker;
the run directory read with polars, the events with EventAccumulator.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import polars as pl
import pytest
import torch
from torch import nn

from accelerate_helpers import (
    Regressor,
    events,
    hooks,
    loader,
    reset_accelerate_state,
    tensorboard_accelerator,
    train,
)
from torchinstruments_accelerate import TelemetryTracker


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Each test builds its Accelerator from scratch; Accelerate's state is process-wide."""
    reset_accelerate_state()
    yield
    reset_accelerate_state()


class GAN(nn.Module):
    """A generator and a discriminator kept together; the loop calls them, never ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _gan_loop(tmp_path: pathlib.Path, *, batches: int, log: str) -> TelemetryTracker:
    """Every third step sampled; the loop logs ``step=100 + i`` before or after the steps."""
    torch.manual_seed(0)
    telemetry = TelemetryTracker(every_n_steps=3, max_focus_layers=2)
    accelerator = tensorboard_accelerator(tmp_path, telemetry, 1)
    gan = GAN()
    generator = torch.optim.Adam(gan.G.parameters(), lr=1e-3)
    discriminator = torch.optim.Adam(gan.D.parameters(), lr=1e-3)
    gan, generator, discriminator = accelerator.prepare(gan, generator, discriminator)
    telemetry.watch(gan, accelerator=accelerator, optimizer=[discriminator, generator])
    for i in range(batches):
        x, z = torch.randn(8, 8), torch.randn(8, 4)
        fake = gan.G(z)
        real_loss = nn.functional.softplus(-gan.D(x)).mean()
        d_loss = real_loss + nn.functional.softplus(gan.D(fake.detach())).mean()
        if log == "before":
            accelerator.log({"d_loss": d_loss.item()}, step=100 + i)
        discriminator.zero_grad()
        accelerator.backward(d_loss)
        discriminator.step()
        g_loss = nn.functional.softplus(-gan.D(fake)).mean()
        generator.zero_grad()
        accelerator.backward(g_loss)
        generator.step()
        if log == "after":
            accelerator.log({"d_loss": d_loss.item()}, step=100 + i)
    accelerator.end_training()
    assert hooks(gan) == 0
    return telemetry


@pytest.mark.parametrize("log", ["before", "after"])
def test_a_loop_calling_the_model_s_parts_samples_them_at_the_logged_steps(
    tmp_path: pathlib.Path, log: str
) -> None:
    """Each call of a part in a sampled step is a sample; everything lands at the logged step.

    The sampled steps 0, 3 and 6 are logged as 100, 103 and 106: the parts' samples (each call
    of G or D: four a step) and both optimizers' step records are there, in the run directory
    and in TensorBoard, beside the loop's own ``d_loss``. The calls whose output a backward
    reaches have output gradients.
    """
    telemetry = _gan_loop(tmp_path, batches=7, log=log)
    assert telemetry.run_directory is not None
    run = telemetry.run_directory
    frame = pl.read_parquet(run / "samples.parquet")
    sampled = [100, 103, 106]
    forwards = frame.filter(pl.col("kind") == "forward")
    assert sorted(set(forwards["step"])) == sampled
    assert forwards.group_by("step").len().sort("step")["len"].to_list() == [4, 4, 4]
    assert forwards["optimizer_step"].to_list() == [k for k in (0, 3, 6) for _ in range(4)]
    steps = frame.filter(pl.col("kind") == "step")
    assert steps["step"].to_list() == [s for s in sampled for _ in range(2)]
    history = pl.read_parquet(run / "history.parquet")
    layers = set(history.filter(pl.col("signal") == "output_gradient")["layer"])
    assert {"G.0", "G.2", "D.0", "D.2"} <= layers
    logged = events(tmp_path / "exp")
    losses = {event.step for event in logged.Scalars("d_loss")}
    assert set(sampled) <= losses
    tag = "telemetry/D.2/output/rms"
    assert sorted({event.step for event in logged.Scalars(tag)}) == sampled


def test_the_parts_hooks_go_once_the_model_s_own_forward_runs(tmp_path: pathlib.Path) -> None:
    """A loop calling the model itself leaves only the observer's hooks after its first step.

    Its parts' hooks cost nothing from then on, and the samples are the model's forwards.
    """
    telemetry = TelemetryTracker(every_n_steps=2, output_dir=tmp_path / "run")
    accelerator = tensorboard_accelerator(tmp_path, telemetry, 1)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader(64))
    unobserved = hooks(model)
    telemetry.watch(model, accelerator=accelerator)
    parts = sum(len(m._forward_pre_hooks) for m in model.children())
    assert parts == len(list(model.children())) > 0
    train(accelerator, model, optimizer, data, steps=1)
    assert sum(len(m._forward_pre_hooks) for m in model.children()) == 0
    train(accelerator, model, optimizer, data, steps=3)
    accelerator.end_training()
    assert hooks(model) == unobserved
    assert telemetry.run_directory is not None
    forwards = pl.read_parquet(telemetry.run_directory / "samples.parquet").filter(
        pl.col("kind") == "forward"
    )
    assert forwards["step"].to_list() == [0, 2]


class _Wrapper(nn.Module):
    """A wrapper keeping the model under ``module``, as ``DistributedDataParallel`` does."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


@pytest.mark.parametrize("wrap", ["module", "compiled"])
def test_part_calls_are_found_through_wrappers(wrap: str) -> None:
    """The parts are the wrapped model's children; the unwrapped model's own call is one too.

    Calls with gradients enabled count, calls under ``no_grad`` do not; in a sampled step each
    call opens a sample and finishes its forward; removed, the hooks are gone.
    """
    from torchinstruments_core.adapter import PartCalls

    gan = GAN()
    wrapped = _Wrapper(gan) if wrap == "module" else torch.compile(gan)
    assert isinstance(wrapped, nn.Module)
    opened: list[int] = []
    finished: list[None] = []
    step: list[int | None] = [None]
    parts = PartCalls(
        wrapped, lambda: 0, lambda: step[0], opened.append, lambda: finished.append(None)
    )
    gan.G(torch.randn(2, 4))
    with torch.no_grad():
        gan.D(torch.randn(2, 8))
    step[0] = 7
    gan.D(gan.G(torch.randn(2, 4)))
    assert parts.count == 3
    assert parts.called == ["G", "D"]
    assert opened == [7, 7]
    assert len(finished) == 2
    parts.remove()
    gan.G(torch.randn(2, 4))
    assert parts.count == 3
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in gan.modules())


class _Codec(nn.Module):
    """Parts that are themselves observed layers: the loop calls ``dec(relu(enc(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.dec = nn.Linear(8, 4)


def test_parts_that_are_observed_layers_have_their_own_rows(tmp_path: pathlib.Path) -> None:
    """A part that is a leaf (an observed layer) is measured in the sample its call opened."""
    telemetry = TelemetryTracker(every_n_steps=2, output_dir=tmp_path / "run")
    accelerator = tensorboard_accelerator(tmp_path, telemetry, 1)
    codec = _Codec()
    optimizer = torch.optim.SGD(codec.parameters(), lr=0.1)
    codec, optimizer = accelerator.prepare(codec, optimizer)
    telemetry.watch(codec, accelerator=accelerator)
    for _ in range(3):
        x = torch.randn(8, 4)
        loss = (codec.dec(torch.relu(codec.enc(x))) - x).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.end_training()
    assert telemetry.run_directory is not None
    history = pl.read_parquet(telemetry.run_directory / "history.parquet")
    forward = history.filter(pl.col("signal").is_in(["output", "output_gradient"]))
    found = forward.select("step", "layer", "signal").unique().sort("step", "layer", "signal")
    assert found.rows() == [
        (step, layer, signal)
        for step in (0, 2)
        for layer in ("dec", "enc")
        for signal in ("output", "output_gradient")
    ]


def test_part_calls_in_the_backward_and_in_other_threads(tmp_path: pathlib.Path) -> None:
    """A checkpointed part's recomputation in the backward is no call; threads count apart.

    ``torch.utils.checkpoint`` runs G again in the backward: neither counted nor sampled. An
    actor thread blocked inside a part's call (under ``no_grad``) does not hide the training
    thread's calls, which are counted and sampled in the thread that made them.
    """
    import threading

    from torchinstruments_core.adapter import PartCalls

    gan = GAN()
    opened: list[tuple[int, str]] = []
    finished: list[str] = []
    step: list[int | None] = [3]
    parts = PartCalls(
        gan,
        lambda: 0,
        lambda: step[0],
        lambda s: opened.append((s, threading.current_thread().name)),
        lambda: finished.append(threading.current_thread().name),
    )
    z = torch.randn(2, 4)
    fake = torch.utils.checkpoint.checkpoint(gan.G, z, use_reentrant=False)
    gan.D(fake).sum().backward()
    assert parts.count == 2
    assert len(opened) == len(finished) == 2
    inside, release = threading.Event(), threading.Event()

    def waiting(module: nn.Module, args: object) -> None:
        if threading.current_thread().name == "actor":
            inside.set()
            release.wait(timeout=30)

    hold = gan.D.register_forward_pre_hook(waiting)
    try:

        def act() -> None:
            with torch.no_grad():
                gan.D(torch.randn(2, 8))

        actor = threading.Thread(target=act, name="actor")
        actor.start()
        assert inside.wait(timeout=30)
        gan.D(gan.G(z))
        release.set()
        actor.join(timeout=30)
    finally:
        hold.remove()
        release.set()
    assert parts.count == 4
    assert opened[2:] == [(3, "MainThread"), (3, "MainThread")]
    assert finished[2:] == ["MainThread", "MainThread"]
    parts.remove()
