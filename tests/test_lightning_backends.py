"""TelemetryMonitor into a real offline W&B run, and under real two-process DDP (gloo, CPU)."""

from __future__ import annotations

import logging
import os
import pathlib
from contextlib import nullcontext
from typing import Any

import polars as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger

from lightning_helpers import Regressor, loader, trainer
from torchinstruments_lightning import TelemetryMonitor
from wandb_records import history_rows


def test_wandb_offline_run_holds_histograms_at_the_sampled_steps(tmp_path: pathlib.Path) -> None:
    """The .wandb file of an offline run holds our histograms, keyed to trainer/global_step."""
    import wandb

    os.environ["WANDB_SILENT"] = "true"
    logger = WandbLogger(project="telemetry-test", save_dir=str(tmp_path), offline=True)
    trainer(
        tmp_path, max_steps=7, logger=logger, callbacks=[TelemetryMonitor(every_n_steps=3)]
    ).fit(Regressor(), loader())
    wandb.finish()
    wandb.teardown()  # without it the offline file holds only its header
    rows = history_rows(tmp_path)
    key = "telemetry/net.0/output/histogram"
    ours = [r for r in rows if f"{key}/_type" in r]
    assert [r["trainer/global_step"] for r in ours] == [0, 3, 6]
    assert all(r[f"{key}/_type"] == "histogram" for r in ours)
    assert sum(ours[0][f"{key}/values"]) == 4 * 8  # batch 4 x 8 features
    assert all(r["telemetry/net.2/output_gradient/rms"] > 0 for r in ours)


def test_fresh_wandb_runs_sharing_a_directory_get_folders_named_after_them(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two fresh fits into one save_dir: telemetry/<W&B run id>/ each; a resume: -resumed-1.

    Each folder is logged on rank 0 with its absolute path.
    """
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    caplog.set_level(logging.INFO)
    run_ids = []
    for number in range(3):
        logger = WandbLogger(project="telemetry-test", save_dir=str(tmp_path), offline=True)
        saver = ModelCheckpoint(
            dirpath=tmp_path / f"ckpt{number}", save_top_k=-1, every_n_train_steps=2
        )
        resume: dict[str, Any] = (
            {"ckpt_path": tmp_path / "ckpt0" / "epoch=0-step=2.ckpt"} if number == 2 else {}
        )
        # The resumed fit checkpoints elsewhere, which Lightning points out.
        said = pytest.warns(UserWarning, match="dirpath has changed") if resume else nullcontext()
        fit = trainer(
            tmp_path,
            max_steps=4,
            logger=logger,
            callbacks=[TelemetryMonitor(every_n_steps=2), saver],
        )
        with said:
            fit.fit(Regressor(), loader(), **resume)
        run_ids.append(logger.experiment.id)
        wandb.finish()
    wandb.teardown()
    first, second, _ = run_ids
    telemetry = tmp_path / "telemetry"
    expected = [first, f"{first}-resumed-1", second]
    assert sorted(p.name for p in telemetry.iterdir()) == sorted(expected)
    for name in expected:
        assert (telemetry / name / "history.parquet").exists()
        assert any(str((telemetry / name).resolve()) in r.getMessage() for r in caplog.records)
    resumed = pl.read_parquet(telemetry / f"{first}-resumed-1" / "samples.parquet")
    # the forward sample and the step record of step 2 (step 0's took ids 0 and 1)
    assert resumed.select("sample_id", "step").rows() == [(2, 2), (3, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["all", "rank0"])
def test_ddp_spawn_two_processes(tmp_path: pathlib.Path, policy: str) -> None:
    """'all': one directory per rank; 'rank0': only rank 0's. Names carry no wrapper prefix.

    The spawned processes attach; the launching process's callback never does, and Lightning
    hands no callback state back to it (the documented limit).
    """
    monitor = TelemetryMonitor(every_n_steps=2, rank_policy=policy)
    fit = trainer(
        tmp_path, max_steps=4, devices=2, strategy="ddp_spawn", callbacks=[monitor], logger=False
    )
    fit.fit(Regressor(), loader())
    assert (monitor.run_directory, monitor.observer, monitor.state_dict()) == (None, None, {})
    (telemetry,) = (tmp_path / "telemetry").iterdir()  # no logger: named after the run id
    if policy == "all":
        ranks = sorted(p.name for p in telemetry.glob("rank-*"))
        assert ranks == ["rank-000", "rank-001"]
        frame = pl.scan_parquet(telemetry / "rank-*" / "history.parquet").collect()
        assert sorted(frame["rank"].unique()) == [0, 1]
    else:
        assert not list(telemetry.glob("rank-*"))
        frame = pl.read_parquet(telemetry / "history.parquet")
        assert frame["rank"].unique().to_list() == [0]
    assert set(frame["layer"]) == {"net.0", "net.1", "net.2", "<model>"}  # <model>: step rows
    assert frame["run_id"].unique().to_list() == [telemetry.name]  # the ranks share rank 0's
    assert sorted(frame["step"].unique()) == [0, 2]
