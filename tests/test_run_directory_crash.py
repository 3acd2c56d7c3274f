"""Crashes and several processes: a real SIGKILL, and real ranks writing their own folders."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import polars as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from torchinstruments_core import AlwaysSampler, inject_observer
from torchinstruments_core._exceptions import RunDirectoryExistsError
from torchinstruments_core.reducers import DEFAULT_METRICS
from torchinstruments_core.run_directory import RunDirectorySink

TRAIN_FOREVER = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from torchinstruments_core import AlwaysSampler, inject_observer
    from torchinstruments_core.run_directory import RunDirectorySink

    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    sink = RunDirectorySink(sys.argv[1], chunk_rows=200, flush_seconds=0.05)
    inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    while True:
        model(torch.randn(32, 16)).sum().backward()
    """
)


@pytest.mark.slow
def test_sigkill_mid_run_leaves_every_completed_chunk_readable(tmp_path: pathlib.Path) -> None:
    """A training process killed with SIGKILL leaves chunks that scan_parquet reads whole."""
    run = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-c", TRAIN_FOREVER, str(run)])
    try:
        deadline = time.monotonic() + 120
        while len(list((run / "history.parts").glob("history-*.parquet"))) < 5:
            assert time.monotonic() < deadline, "no chunks were written"
            assert process.poll() is None, "the training process died by itself"
            time.sleep(0.05)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    history = pl.scan_parquet(run / "history.parts" / "history-*.parquet").collect()
    samples = pl.scan_parquet(run / "history.parts" / "samples-*.parquet").collect()
    rows_per_sample = 3 * 2 * len(DEFAULT_METRICS)
    assert history["sample_id"].n_unique() >= 5  # at least one sample per chunk
    assert history.height % rows_per_sample == 0
    per_sample = history.group_by("sample_id").len()
    assert set(per_sample["len"]) == {rows_per_sample}
    assert set(samples["sample_id"]) >= set(history["sample_id"])
    assert (run / "result.json").exists()  # the catalog, written at open


def _rank_worker(rank: int, folder: str, policy: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    observer = inject_observer(
        model,
        sampler=AlwaysSampler(),
        output_dir=pathlib.Path(folder) / "stats",
        rank_policy=policy,
    )
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2
    )
    try:
        for _ in range(2 + rank):  # the ranks take different numbers of samples
            model(torch.randn(3, 4)).sum().backward()
        observer.remove()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_rank_policies_write_one_folder_per_rank_or_only_rank0(tmp_path: pathlib.Path) -> None:
    """'all': rank-000/ and rank-001/, each its own samples; 'rank0': rank 0's files only."""
    for policy in ("all", "rank0"):
        folder = tmp_path / policy
        folder.mkdir()
        mp.spawn(_rank_worker, args=(str(folder), policy), nprocs=2, join=True)  # type: ignore[attr-defined]
    per_rank = {
        p.parent.name: pl.read_parquet(p)
        for p in (tmp_path / "all" / "stats").glob("rank-*/history.parquet")
    }
    assert sorted(per_rank) == ["rank-000", "rank-001"]
    assert per_rank["rank-000"]["sample_id"].n_unique() == 2
    assert per_rank["rank-001"]["sample_id"].n_unique() == 3
    assert per_rank["rank-001"]["rank"].unique().to_list() == [1]
    combined = pl.scan_parquet(tmp_path / "all" / "stats" / "rank-*" / "history.parquet").collect()
    assert sorted(combined["rank"].unique()) == [0, 1]
    only = tmp_path / "rank0" / "stats"
    assert pl.read_parquet(only / "history.parquet")["rank"].unique().to_list() == [0]
    assert not list(only.glob("rank-*"))


def test_a_rank_refuses_a_folder_that_already_exists(tmp_path: pathlib.Path) -> None:
    """Under rank_policy='all' a rank folder that exists already is refused, not reused."""
    from torchinstruments_core import RunInfo
    from torchinstruments_core._exceptions import RunDirectoryExistsError

    sink = RunDirectorySink(tmp_path / "other")
    run = RunInfo("r", 1, 2, "all", "Net", "AlwaysSampler()", (), ())
    (tmp_path / "other" / "rank-001").mkdir(parents=True)
    with pytest.raises(RunDirectoryExistsError, match="rank-001"):
        sink.open(run)


def test_a_rank_injects_beside_the_folders_other_ranks_already_made(tmp_path: pathlib.Path) -> None:
    """Under torch.distributed, another rank's rank-NNN/ does not stop this rank's injection.

    A rank that reaches ``inject_observer`` after another rank of the same run took its first
    sample finds that rank's folder in ``output_dir``; it still writes its own ``rank-NNN/``.
    Without a process group such a folder is an old run, refused at injection.
    """
    sibling = tmp_path / "run" / "rank-001" / "history.parts"
    sibling.mkdir(parents=True)
    with pytest.raises(RunDirectoryExistsError, match="rank-001"):
        inject_observer(nn.Linear(2, 2), output_dir=tmp_path / "run", rank_policy="all")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    try:
        model = nn.Linear(2, 2)
        with inject_observer(
            model, output_dir=tmp_path / "run", rank_policy="all", sampler=AlwaysSampler()
        ):
            model(torch.ones(1, 2)).sum().backward()
    finally:
        dist.destroy_process_group()
    assert pl.read_parquet(tmp_path / "run" / "rank-000" / "history.parquet")[
        "rank"
    ].unique().to_list() == [0]
    assert sibling.is_dir()
