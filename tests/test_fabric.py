"""FabricTelemetry in real Fabric runs: loggers read back, accumulation, resume, two ranks."""

from __future__ import annotations

import copy
import json
import pathlib
from dataclasses import fields
from typing import Any

import polars as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers.csv_logs import CSVLogger
from lightning.fabric.loggers.tensorboard import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from torchinstruments_core import ConfigurationError, inject_observer
from torchinstruments_core.adapter import TelemetryOptions
from torchinstruments_core.sinks import MultiSink
from torchinstruments_lightning import FabricTelemetry


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _fabric(telemetry: FabricTelemetry, **kwargs: Any) -> Fabric:
    return Fabric(accelerator="cpu", devices=1, callbacks=[telemetry], **kwargs)


def _train(fabric: Fabric, model: Any, optimizer: Any, steps: int, micro_batches: int = 1) -> None:
    """A plain Fabric loop: ``micro_batches`` backwards, the last one synchronizing, one step."""
    for _ in range(steps):
        for k in range(micro_batches):
            with fabric.no_backward_sync(model, enabled=k < micro_batches - 1):
                fabric.backward(model(torch.randn(4, 4)).square().mean() / micro_batches)
        optimizer.step()
        optimizer.zero_grad()


def _samples(folder: pathlib.Path, kind: str | None = "forward") -> pl.DataFrame:
    """``samples.parquet``: the forward samples (``kind=None``: the step records too)."""
    frame = pl.read_parquet(folder / "samples.parquet")
    return frame if kind is None else frame.filter(pl.col("kind") == kind)


def _events(folder: pathlib.Path | str) -> EventAccumulator:
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0})
    accumulator.Reload()
    return accumulator


def test_setup_attaches_and_the_loggers_get_the_sampled_steps(tmp_path: pathlib.Path) -> None:
    """``fabric.setup`` alone attaches; TensorBoard and CSV hold the sampled steps 0, 2, 4.

    The loop is a plain Fabric loop with no telemetry call in it. TensorBoard (read back with
    EventAccumulator) gets the focus layers' histograms and scalars at the optimizer-step count,
    the CSV logger the scalars at the same steps, and the run directory sits in the TensorBoard
    logger's version folder, without a ``tensorboard/`` of its own.
    """
    telemetry = FabricTelemetry(every_n_steps=2, max_focus_layers=2)
    tensorboard = TensorBoardLogger(tmp_path / "tb")
    csv = CSVLogger(tmp_path / "csv")
    fabric = _fabric(telemetry, loggers=[tensorboard, csv])
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _train(fabric, model, optimizer, steps=5)
    fabric.call("on_train_end")
    for logger in fabric.loggers:
        logger.finalize("success")
    run = pathlib.Path(tensorboard.log_dir) / "telemetry"
    assert telemetry.run_directory == run
    assert _samples(run)["step"].to_list() == [0, 2, 4]
    assert not (run / "tensorboard").exists()
    assert set(pl.read_parquet(run / "history.parquet")["layer"]) == {"0", "1", "2", "<model>"}
    events = _events(tensorboard.log_dir)
    for tag in ("telemetry/0/output/histogram", "telemetry/2/output_gradient/histogram"):
        assert [event.step for event in events.Histograms(tag)] == [0, 2, 4]
    assert [event.step for event in events.Scalars("telemetry/0/output/rms")] == [0, 2, 4]
    table = pl.read_csv(pathlib.Path(csv.log_dir) / "metrics.csv")
    rows = table.filter(pl.col("telemetry/2/output_gradient/rms").is_not_null())
    assert rows["step"].to_list() == [0, 2, 4]
    assert telemetry.observer is None


def test_accumulated_micro_batches_are_one_step(tmp_path: pathlib.Path) -> None:
    """Under ``no_backward_sync`` and a step every 3 micro-batches, one tick per optimizer step.

    Four optimizer steps with ``every_n_steps=2``: steps 0 and 2 are sampled, each with its three
    micro-batches as three samples, all complete (forward and backward).
    """
    telemetry = FabricTelemetry(every_n_steps=2, output_dir=tmp_path / "run")
    fabric = _fabric(telemetry)
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _train(fabric, model, optimizer, steps=4, micro_batches=3)
    telemetry.finish()
    samples = _samples(tmp_path / "run")
    assert samples["step"].to_list() == [0, 0, 0, 2, 2, 2]
    assert samples["forward_only"].to_list() == [False] * 6


def test_watch_serves_setup_module_and_refuses_a_second_model(tmp_path: pathlib.Path) -> None:
    """``watch`` attaches where ``setup`` does not call the hook; a second watch raises."""
    telemetry = FabricTelemetry(every_n_steps=1, output_dir=tmp_path / "run")
    fabric = _fabric(telemetry)
    model = fabric.setup_module(_model())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    assert telemetry.observer is None  # setup_module calls no hook
    assert telemetry.watch(model, fabric) is telemetry.observer
    with pytest.raises(ConfigurationError, match="already watches"):
        telemetry.watch(model, fabric)
    _train(fabric, model, optimizer, steps=2)
    telemetry.finish()
    telemetry.finish()  # again: nothing left to do
    assert _samples(tmp_path / "run")["step"].to_list() == [0, 1]


def _resumable_run(root: pathlib.Path, steps: int, *, load: str | None) -> FabricTelemetry:
    """One process's run: set up, optionally load ``root/ckpt`` (before or after setup), save."""
    telemetry = FabricTelemetry(every_n_steps=2, output_dir=root / "run")
    fabric = _fabric(telemetry)
    model = _model()
    raw_optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if load == "before setup":
        telemetry.load_state_dict(fabric.load(root / "ckpt")["telemetry"])
    model, optimizer = fabric.setup(model, raw_optimizer)
    state = {"model": model, "optimizer": optimizer}
    if load == "after setup":
        telemetry.load_state_dict(fabric.load(root / "ckpt", state)["telemetry"])
    _train(fabric, model, optimizer, steps=steps)
    fabric.save(root / "ckpt", {**state, "telemetry": telemetry.state_dict()})
    telemetry.finish()
    return telemetry


@pytest.mark.parametrize("load", ["after setup", "before setup"])
def test_a_resumed_run_continues_sample_ids_and_steps(tmp_path: pathlib.Path, load: str) -> None:
    """A run restored with ``fabric.load`` continues where the checkpoint stopped.

    Four steps, saved, then four more in a new Fabric: the second run samples steps 4 and 6,
    its ids (forward samples and step records, one sequence) going on from the first run's,
    under a new run id in a folder of its own, so no ``(run_id, rank, sample_id)`` repeats and
    the step axis runs on.
    """
    first = _resumable_run(tmp_path, 4, load=None)
    second = _resumable_run(tmp_path, 4, load=load)
    assert first.run_directory is not None
    assert second.run_directory is not None
    assert second.run_directory != first.run_directory
    both = pl.concat([_samples(first.run_directory, None), _samples(second.run_directory, None)])
    assert both.filter(pl.col("kind") == "forward")["step"].to_list() == [0, 2, 4, 6]
    assert both["sample_id"].to_list() == list(range(8))  # each sampled step: forward, step
    assert both["run_id"].n_unique() == 2
    assert not both.select("run_id", "rank", "sample_id").is_duplicated().any()


def test_loading_after_a_sample_raises(tmp_path: pathlib.Path) -> None:
    """A state loaded once samples were taken would repeat ids: it is refused, naming why."""
    telemetry = FabricTelemetry(every_n_steps=1, output_dir=tmp_path / "run")
    fabric = _fabric(telemetry)
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _train(fabric, model, optimizer, steps=1)
    with pytest.raises(ConfigurationError, match="after a record was taken"):
        telemetry.load_state_dict({"step": 5, "next_sample_id": 9})
    telemetry.finish()


def test_continue_from_numbers_the_first_record() -> None:
    """``Observer.continue_from``: the first record takes the id given; never after a record."""
    model = _model()
    observer = inject_observer(model, sink=MultiSink([]), interval=1)
    with pytest.raises(ConfigurationError, match="next_sample_id=-1"):
        observer.continue_from(-1)
    observer.continue_from(7)
    observer.continue_from(5)  # still before the first record: the last word counts
    model(torch.randn(2, 4)).sum().backward()
    assert observer.next_sample_id == 6
    with pytest.raises(ConfigurationError, match="after a record was taken"):
        observer.continue_from(0)
    observer.remove()


def test_the_options_are_the_shared_ones() -> None:
    """FabricTelemetry adds no option of its own and checks the shared ones when built."""
    assert {f.name for f in fields(FabricTelemetry)} == {f.name for f in fields(TelemetryOptions)}
    assert FabricTelemetry(10).every_n_steps == 10
    with pytest.raises(ConfigurationError, match="rank_policy='some'"):
        FabricTelemetry(rank_policy="some")


def _ddp_train(fabric: Fabric) -> None:
    """Each rank: set up (the telemetry attaches), four steps, finish, end the process group.

    The rank ends its gloo process group itself, as a careful script does: Fabric leaves a gloo
    group (not an NCCL one) to interpreter exit, where gloo's worker thread may still be freeing
    the last all-reduce, needs the GIL of a finalizing interpreter and aborts the process
    ("terminate called without an active exception"; torch 2.15, Python 3.11, 7 runs in 22
    without any telemetry attached).
    """
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _train(fabric, model, optimizer, steps=4)
    fabric.call("on_train_end")
    for logger in fabric.loggers:
        logger.finalize("success")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["all", "rank0"])
def test_two_processes(tmp_path: pathlib.Path, policy: str) -> None:
    """Two gloo processes: ``"all"`` writes rank-000/ and rank-001/, ``"rank0"`` rank 0 only.

    Both ranks share rank 0's run id and folder; TensorBoard (on rank 0) gets steps 0 and 2.
    """
    telemetry = FabricTelemetry(every_n_steps=2, rank_policy=policy, max_focus_layers=1)
    tensorboard = TensorBoardLogger(tmp_path / "tb")
    fabric = Fabric(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        callbacks=[telemetry],
        loggers=[tensorboard],
    )
    fabric.launch(_ddp_train)
    (log_dir,) = (tmp_path / "tb" / "lightning_logs").iterdir()
    run = log_dir / "telemetry"
    if policy == "all":
        assert sorted(p.name for p in run.glob("rank-*")) == ["rank-000", "rank-001"]
        frame = pl.scan_parquet(run / "rank-*" / "samples.parquet").collect()
        assert sorted(frame["rank"].unique()) == [0, 1]
    else:
        assert not list(run.glob("rank-*"))
        frame = _samples(run)
        assert frame["rank"].unique().to_list() == [0]
    assert frame["run_id"].n_unique() == 1
    assert sorted(frame["step"].unique()) == [0, 2]
    assert set(pl.scan_parquet(run / "**" / "history.parquet").collect()["layer"]) == {
        "0",
        "1",
        "2",
        "<model>",
    }
    histograms = _events(log_dir).Histograms("telemetry/0/output/histogram")
    assert [event.step for event in histograms] == [0, 2]


def _ddp_train_without_finish(fabric: Fabric) -> None:
    """Each rank: four steps, the gloo group ended; no ``on_train_end``, no ``finish``."""
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _train(fabric, model, optimizer, steps=4)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ranks_that_end_their_group_without_finish_are_finalized(tmp_path: pathlib.Path) -> None:
    """A spawned function that ends with ``destroy_process_group()`` alone leaves whole runs.

    What the README advises for ``ddp_spawn`` on gloo: the runs are finalized on the way out
    of each process, which needs no process group, so both ranks' folders are complete.
    """
    telemetry = FabricTelemetry(every_n_steps=2, rank_policy="all", output_dir=tmp_path / "run")
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn", callbacks=[telemetry])
    fabric.launch(_ddp_train_without_finish)
    folders = sorted((tmp_path / "run").glob("rank-*"))
    assert [folder.name for folder in folders] == ["rank-000", "rank-001"]
    for rank, folder in enumerate(folders):
        assert json.loads((folder / "result.json").read_text())["status"] == "complete"
        assert not (folder / "history.parts").exists()
        samples = _samples(folder)
        assert samples["step"].to_list() == [0, 2]
        assert samples["rank"].unique().to_list() == [rank]


def test_the_spawn_launcher_hands_the_function_the_telemetry_itself() -> None:
    """Fabric's CPU spawn launcher deep-copies dataclass arguments: ours comes back as it is.

    ``fabric.launch(train, telemetry)`` runs ``train`` on what
    ``_disable_module_memory_sharing`` returns (Lightning's own function, here called as the
    launcher calls it); a copy would be a handle that no ``fabric.setup`` ever attaches.
    """
    from lightning.fabric.strategies.launchers.multiprocessing import (
        _disable_module_memory_sharing,
    )

    telemetry = FabricTelemetry(every_n_steps=2)
    (args, _kwargs) = _disable_module_memory_sharing(((_model(), telemetry), {}))
    assert args[1] is telemetry
    assert copy.deepcopy({"telemetry": telemetry})["telemetry"] is telemetry


def _ddp_train_two_optimizers(fabric: Fabric, telemetry: FabricTelemetry) -> None:
    """Each rank: the telemetry it is handed watches two optimizers, four steps, finish."""
    model = _model()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[2].parameters(), lr=0.1)
    model, first, second = fabric.setup(model, first, second)
    telemetry.watch_optimizers(first, second)  # raised on a copy that nothing attached
    assert (telemetry.observer is not None) == fabric.is_global_zero  # rank_policy="rank0"
    for _ in range(4):
        fabric.backward(model(torch.randn(4, 4)).square().mean())
        telemetry.check_loss(torch.tensor(1.0))
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
    telemetry.finish()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_a_spawned_function_uses_the_telemetry_it_is_handed(tmp_path: pathlib.Path) -> None:
    """``fabric.launch(train, telemetry)`` under ``ddp_spawn``: the argument is the callback.

    ``watch_optimizers`` and ``finish`` called on the argument act on the attached telemetry:
    the run has both optimizers' step records and is finalized.
    """
    telemetry = FabricTelemetry(every_n_steps=2, output_dir=tmp_path / "run")
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn", callbacks=[telemetry])
    # as people write it; Fabric types the function as taking the Fabric alone
    fabric.launch(_ddp_train_two_optimizers, telemetry)  # type: ignore[arg-type]
    run = tmp_path / "run"
    assert json.loads((run / "result.json").read_text())["status"] == "complete"
    assert _samples(run)["step"].to_list() == [0, 2]
    records = _samples(run, kind="step")
    assert records["step"].to_list() == [0, 0, 2, 2]  # one record per optimizer step
    history = pl.read_parquet(run / "history.parquet")
    updates = history.filter(pl.col("signal") == "update", pl.col("layer") != "<model>")
    assert updates["layer"].unique().sort().to_list() == ["0", "2"]  # both optimizers' layers


def test_a_non_finite_step_is_named_sampled_densely_and_stops_the_loop(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NaN from optimizer step 3 on: the warning names layer ``0`` and the loop stops.

    Under ``on_nonfinite="stop"`` ``should_stop`` turns true after the sampled step 3.
    """
    telemetry = FabricTelemetry(
        every_n_steps=3, on_nonfinite="stop", sample_after_nonfinite=2, output_dir=tmp_path / "run"
    )
    fabric = _fabric(telemetry)
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    steps = 0
    with caplog.at_level("WARNING", logger="torchinstruments"):
        while not telemetry.should_stop and steps < 8:
            x = torch.randn(4, 4) * (float("nan") if steps >= 3 else 1.0)
            loss = model(x).square().mean()
            fabric.backward(loss)
            telemetry.check_loss(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    fabric.call("on_train_end")
    assert steps == 4  # step 3 was sampled, held NaN, and the loop stopped after it
    assert _samples(tmp_path / "run")["step"].to_list() == [0, 3]
    assert any("first at '0' output" in r.getMessage() for r in caplog.records)


def test_a_non_finite_loss_samples_the_next_steps_densely(tmp_path: pathlib.Path) -> None:
    """A loss handed over with ``check_loss`` turns NaN at step 1: steps 2 and 3 are sampled."""
    telemetry = FabricTelemetry(
        every_n_steps=10, sample_after_nonfinite=2, output_dir=tmp_path / "r"
    )
    fabric = _fabric(telemetry)
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    for step in range(5):
        loss = model(torch.randn(4, 4)).square().mean()
        fabric.backward(loss)
        telemetry.check_loss(loss * float("nan") if step == 1 else loss)
        optimizer.step()
        optimizer.zero_grad()
    fabric.call("on_train_end")
    assert _samples(tmp_path / "r")["step"].to_list() == [0, 2, 3]


class _GAN(nn.Module):
    """A generator and a discriminator kept together; the loop calls them, never ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def test_a_loop_calling_the_model_s_parts_is_sampled_through_them(tmp_path: pathlib.Path) -> None:
    """``gan.G(z)`` and ``gan.D(x)`` through the model ``fabric.setup`` returned.

    Each call of a part in a sampled step (0, 3, 6) is a sample, four a step, with output
    gradients where a backward reaches them; both optimizers' steps are recorded there. The
    parts' hooks go with the run.
    """
    torch.manual_seed(0)
    telemetry = FabricTelemetry(every_n_steps=3, output_dir=tmp_path / "run")
    fabric = _fabric(telemetry)
    gan = _GAN()
    generator = torch.optim.Adam(gan.G.parameters(), lr=1e-3)
    discriminator = torch.optim.Adam(gan.D.parameters(), lr=1e-3)
    model, generator, discriminator = fabric.setup(gan, generator, discriminator)
    telemetry.watch_optimizers(discriminator, generator)
    for _ in range(7):
        x, z = torch.randn(8, 8), torch.randn(8, 4)
        fake = model.G(z)
        real = nn.functional.softplus(-model.D(x)).mean()
        d_loss = real + nn.functional.softplus(model.D(fake.detach())).mean()
        discriminator.zero_grad()
        fabric.backward(d_loss)
        discriminator.step()
        generator.zero_grad()
        fabric.backward(nn.functional.softplus(-model.D(fake)).mean())
        generator.step()
    fabric.call("on_train_end")
    run = tmp_path / "run"
    forwards = _samples(run)
    assert forwards.group_by("step").len().sort("step").rows() == [(0, 4), (3, 4), (6, 4)]
    assert _samples(run, "step")["step"].to_list() == [0, 0, 3, 3, 6, 6]
    history = pl.read_parquet(run / "history.parquet")
    layers = set(history.filter(pl.col("signal") == "output_gradient")["layer"])
    assert {"G.0", "G.2", "D.0", "D.2"} <= layers
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in gan.modules())
