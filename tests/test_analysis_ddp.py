"""The analysis commands on a real two-process run: DDP over gloo, every rank writing its folder.

Rank 1 is fed inputs ``SCALE`` times larger than rank 0's from the start (its first layer's
output disagrees), and from sample ``HEALTHY`` on its blowup layer ``2`` multiplies its output
by inf (rank 1 goes non-finite first; the averaged gradients carry it to rank 0 a step later).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from analysis_runs import Blowup, blowup_model
from torchinstruments_analysis.cli import main
from torchinstruments_core import EveryNForwardsSampler, inject_observer

pytestmark = pytest.mark.slow

HEALTHY = 4
STEPS = 6
SCALE = 100.0


def _worker(rank: int, folder: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2
    )
    try:
        net = blowup_model()
        model = DistributedDataParallel(net)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        sampler = EveryNForwardsSampler(1)
        output = Path(folder) / "run"
        with inject_observer(model, sampler=sampler, rank_policy="all", output_dir=output):
            for step in range(STEPS):
                blowup = net[2]
                assert isinstance(blowup, Blowup)
                blowup.armed = rank == 1 and step >= HEALTHY
                torch.manual_seed(step)
                x = torch.randn(16, 4) * (SCALE if rank == 1 else 1.0)
                loss = model(x).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(str(folder),), nprocs=2, join=True)  # type: ignore[attr-defined]
    return folder / "run"


def _rows(
    arguments: list[str], capsys: pytest.CaptureFixture[str], status: int
) -> list[dict[str, Any]]:
    assert main([*arguments, "--json"]) == status
    return json.loads(capsys.readouterr().out)["rows"]


def test_each_rank_wrote_its_own_finished_folder(run: Path) -> None:
    """rank_policy='all' under DDP: rank-000/ and rank-001/, each with its compacted history."""
    assert sorted(p.name for p in run.glob("rank-*")) == ["rank-000", "rank-001"]
    for folder in run.glob("rank-*"):
        assert (folder / "history.parquet").is_file()
        assert json.loads((folder / "result.json").read_text())["status"] == "complete"


def test_ranks_command_names_rank_1_on_the_first_layer(run: Path, capsys) -> None:
    """``torchinstruments ranks``: layer 0's output rms is about SCALE times higher on rank 1."""
    rows = _rows(["ranks", str(run)], capsys, 0)
    first = next(r for r in rows if (r["layer"], r["signal"]) == ("0", "output"))
    assert (first["rank_high"], first["rank_low"], first["ranks"]) == (1, 0, 2)
    assert first["max_ratio"] > SCALE / 2


def test_findings_name_the_disagreeing_rank_and_where_nan_started(run: Path, capsys) -> None:
    """``findings``: layer 0's ranks disagree (rank 1 high); NaN started in layer 2 on rank 1."""
    rows = _rows(["findings", str(run)], capsys, 1)
    disagree = [r for r in rows if r["rule"] == "rank_disagreement"]
    first = next(r for r in disagree if (r["layer"], r["signal"]) == ("0", "output"))
    assert first["sample_id"] == 0
    assert "on rank 1 is" in first["message"]
    assert "that on rank 0" in first["message"]
    onsets = [r for r in rows if r["rule"] == "nonfinite_onset"]
    origin = next(r for r in onsets if "first non-finite values of the run" in r["message"])
    assert (origin["layer"], origin["signal"], origin["sample_id"]) == ("2", "output", HEALTHY)
    assert "rank 1" in origin["message"]


def test_first_nonfinite_names_rank_1_before_rank_0(run: Path, capsys) -> None:
    """``first-nonfinite``: rank 1 at sample HEALTHY in layer 2; rank 0 only a step later."""
    rows = _rows(["first-nonfinite", str(run)], capsys, 1)
    forward = {r["rank"]: r for r in rows if r["direction"] == "forward"}
    assert (forward[1]["layer"], forward[1]["sample_id"], forward[1]["started"]) == (
        "2",
        HEALTHY,
        True,
    )
    assert all(r["sample_id"] > HEALTHY for r in rows if r["rank"] == 0)


def test_summary_keeps_the_ranks_apart(run: Path, capsys) -> None:
    """``summary`` on the two-rank run: one row per rank and layer, never averaged together."""
    rows = _rows(["summary", str(run), "--layers", "0"], capsys, 0)
    by_rank = {r["rank"]: r for r in rows}
    assert sorted(by_rank) == [0, 1]
    assert by_rank[1]["output_rms"] > SCALE / 2 * by_rank[0]["output_rms"]
