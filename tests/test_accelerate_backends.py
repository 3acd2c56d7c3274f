"""TelemetryTracker into a real offline W&B run, and in two real processes (gloo, CPU)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import polars as pl
import pytest

from accelerate_helpers import events, reset_accelerate_state, samples, setup, train
from torchinstruments_accelerate import TelemetryTracker
from torchinstruments_core._signals import MODEL_LAYER
from wandb_records import history_rows


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Each test builds its Accelerator from scratch; Accelerate's state is process-wide."""
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def test_wandb_offline_run_holds_histograms_at_the_sampled_steps(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The .wandb file holds our histograms in the rows of the user's loss of the sampled steps.

    The loop logs step k + 1 after optimizer step k: the sampled steps 0, 3, 6 are W&B's 1, 4, 7.
    """
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    telemetry = TelemetryTracker(every_n_steps=3)
    accelerator, model, optimizer, data = setup(tmp_path, telemetry, log_with=["wandb", telemetry])
    train(accelerator, model, optimizer, data, steps=7, user_step=0)
    accelerator.end_training()
    wandb.teardown()  # without it the offline file holds only its header
    rows = history_rows(tmp_path)
    key = "telemetry/net.0/output/histogram"
    ours = [r for r in rows if f"{key}/_type" in r]
    assert [r["_step"] for r in ours] == [1, 4, 7]
    assert all(r[f"{key}/_type"] == "histogram" for r in ours)
    assert sum(ours[0][f"{key}/values"]) == 4 * 8  # batch 4 x 8 features
    assert all(r["telemetry/net.2/output_gradient/rms"] > 0 for r in ours)
    assert all("loss" in r for r in ours)


# Forked processes deadlock in polars once the parent has used it (other tests have), so the
# launcher runs in a fresh interpreter. It imports what prepare() and the optimizer import
# lazily, once, before the fork: each process would spend seconds on it.
LAUNCH = textwrap.dedent(
    """
    import os, sys
    import torch._dynamo, torch.distributed.tensor
    from accelerate import debug_launcher
    from accelerate_helpers import two_process_run

    os.environ["OMP_NUM_THREADS"] = "1"  # else Accelerate warns in each process
    for policy in ("all", "rank0"):
        debug_launcher(two_process_run, args=(f"{sys.argv[1]}/{policy}", policy), num_processes=2)
    """
)


@pytest.mark.slow
def test_two_processes_one_directory_per_rank_or_only_rank0(tmp_path: pathlib.Path) -> None:
    """'all': a directory per rank; 'rank0': rank 0's only. TensorBoard gets rank 0's samples.

    The main process logs step k + 1 after step k: its samples of steps 0, 2, 4 are 1, 3, 5. The
    other process sees no log and keeps the tracker's count; optimizer_step is the same on both.
    Each rank records the optimizer steps of its sampled steps, with the same global gradient
    norm (DDP averaged the gradients), and TensorBoard gets rank 0's at 1, 3, 5.
    """
    subprocess.run(
        [sys.executable, "-W", "error", "-c", LAUNCH, str(tmp_path)],
        cwd=pathlib.Path(__file__).parent,
        check=True,
        timeout=300,
    )
    for policy in ("all", "rank0"):
        telemetry = tmp_path / policy / "telemetry"
        if policy == "all":
            assert sorted(p.name for p in telemetry.glob("rank-*")) == ["rank-000", "rank-001"]
            for rank, steps in ((0, [1, 3, 5]), (1, [0, 2, 4])):
                frame = samples(telemetry / f"rank-{rank:03d}")
                assert frame["step"].to_list() == steps
                assert frame["optimizer_step"].to_list() == [0, 2, 4]
            for rank in (0, 1):
                records = samples(telemetry / f"rank-{rank:03d}", kind="step")
                assert records["optimizer_step"].to_list() == [0, 2, 4]
            frame = pl.scan_parquet(telemetry / "rank-*" / "history.parquet").collect()
            assert sorted(frame["rank"].unique()) == [0, 1]
            norms = frame.filter((pl.col("layer") == MODEL_LAYER) & (pl.col("metric") == "l2_norm"))
            by_rank = [  # DDP averaged the gradients: every rank's step used the same ones
                norms.filter((pl.col("rank") == r) & (pl.col("signal") == "parameter_gradient"))
                .sort("step")["value"]
                .to_list()
                for r in (0, 1)
            ]
            assert len(by_rank[0]) == 3
            assert by_rank[0] == pytest.approx(by_rank[1], rel=1e-6)
        else:
            assert not list(telemetry.glob("rank-*"))
            assert samples(telemetry)["step"].to_list() == [1, 3, 5]
            frame = pl.read_parquet(telemetry / "history.parquet")
            assert frame["rank"].unique().to_list() == [0]
        assert set(frame["layer"]) == {"net.0", "net.1", "net.2", MODEL_LAYER}  # no "module."
        tensorboard = events(tmp_path / policy / "exp")
        histograms = tensorboard.Histograms("telemetry/net.2/output_gradient/histogram")
        assert [e.step for e in histograms] == [1, 3, 5]
        assert [e.step for e in tensorboard.Scalars("telemetry/net.0/output/rms")] == [1, 3, 5]
        norm = tensorboard.Scalars("telemetry/model/parameter_gradient/l2_norm")
        assert [e.step for e in norm] == [1, 3, 5]
