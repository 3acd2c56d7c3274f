"""Opening run folders for analysis: finished, per rank, live (chunks only), and missing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import torch

from analysis_runs import blowup_model, run_step, train, write_rank_folders
from torchinstruments_analysis import RunNotFoundError, open_run, open_runs
from torchinstruments_core import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments_core.run_directory import RunDirectorySink


def test_a_finished_run_reads_history_parquet_with_layers_in_execution_order(tmp_path):
    """A finished run is complete, reads history.parquet lazily, and lists layers forward."""
    train(blowup_model(), tmp_path / "run", healthy=3)
    run = open_run(tmp_path / "run")
    assert run.complete
    assert run.status == "complete"
    assert isinstance(run.history, pl.LazyFrame)
    assert run.layers == ("0", "1", "2", "3", "4")
    expected = pl.read_parquet(tmp_path / "run" / "history.parquet")
    assert run.history.collect().equals(expected)
    assert run.samples.collect()["sample_id"].to_list() == [0, 1, 2]


class _Reversed(torch.nn.Module):
    """Defines ``late`` before ``early`` but runs ``early`` first."""

    def __init__(self):
        super().__init__()
        self.late = torch.nn.Linear(4, 4)
        self.early = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.late(self.early(x))


def test_execution_order_comes_from_result_json_not_from_model_order(tmp_path):
    """Layers are listed in the order the forward ran them, which is not the model's order."""
    model = _Reversed()
    with inject_observer(model, sampler=EveryNForwardsSampler(1), output_dir=tmp_path / "r"):
        model(torch.randn(2, 4)).sum().backward()
    result = json.loads((tmp_path / "r" / "result.json").read_text())
    assert [layer["name"] for layer in result["layers"]] == ["early", "late"]
    assert open_run(tmp_path / "r").layers == ("early", "late")


def test_a_live_run_takes_execution_order_from_its_first_sample(tmp_path):
    """While running, result.json lists the model's order; the chunks give the forward's."""
    model = _Reversed()
    sink = RunDirectorySink(tmp_path / "live", flush_seconds=0.1, tensorboard=False)
    observer = inject_observer(model, sampler=EveryNForwardsSampler(1), sink=sink)
    try:
        model(torch.randn(2, 4)).sum().backward()
        observer.flush()
        _chunks_of(tmp_path / "live", samples=1)
        result = json.loads((tmp_path / "live" / "result.json").read_text())
        assert [layer["name"] for layer in result["layers"]] == ["late", "early"]
        assert open_run(tmp_path / "live").layers == ("early", "late")
    finally:
        remove_observer(observer)


def test_a_live_run_reads_its_chunks_and_says_it_is_not_complete(tmp_path):
    """While the observer is attached only history.parts/ exists: its chunks are read."""
    model = blowup_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = RunDirectorySink(tmp_path / "live", flush_seconds=0.1, tensorboard=False)
    observer = inject_observer(model, sampler=EveryNForwardsSampler(1), sink=sink)
    try:
        for _ in range(3):
            run_step(model, optimizer)
        observer.flush()
        chunks = _chunks_of(tmp_path / "live", samples=3)
        assert not (tmp_path / "live" / "history.parquet").exists()
        run = open_run(tmp_path / "live")
        assert not run.complete
        assert run.status == "running"
        assert run.history.select("sample_id").unique().collect().height == 3
        assert run.layers == ("0", "1", "2", "3", "4")
        assert run.history.collect().height == pl.read_parquet(chunks).height
    finally:
        remove_observer(observer)
    assert open_run(tmp_path / "live").complete


def _chunks_of(folder, *, samples, seconds=20.0):
    """The history chunks, once the writer (flushing every 0.1 s) has written ``samples``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        chunks = sorted((folder / "history.parts").glob("history-*.parquet"))
        if chunks and pl.read_parquet(chunks)["sample_id"].n_unique() >= samples:
            return chunks
        time.sleep(0.05)
    raise AssertionError(f"the writer wrote no chunk of {samples} samples in {seconds} s")


def test_a_folder_of_rank_folders_reads_every_rank(tmp_path):
    """rank-NNN/ folders are read together, told apart by the rank column."""
    write_rank_folders(tmp_path, {0: [1.0, 1.0], 1: [1.0, 2.0]}, ["a", "b"])
    run = open_run(tmp_path)
    assert run.complete
    assert [folder.folder.name for folder in run.folders] == ["rank-000", "rank-001"]
    assert sorted(run.history.select("rank").unique().collect()["rank"]) == [0, 1]
    assert run.layers == ("a", "b")


def test_a_rank_that_is_not_finished_makes_the_run_incomplete(tmp_path):
    """One unfinished rank is enough for complete to be false and status to name it."""
    write_rank_folders(tmp_path, {0: [1.0], 1: [1.0]}, ["a"])
    (tmp_path / "rank-001" / "result.json").write_text('{"status": "running", "layers": []}')
    run = open_run(tmp_path)
    assert not run.complete
    assert run.status == "running"


def test_a_folder_without_a_run_is_refused(tmp_path):
    """open_run names the folder when it holds neither history nor rank folders."""
    with pytest.raises(RunNotFoundError, match="holds no run"):
        open_run(tmp_path)
    with pytest.raises(RunNotFoundError, match="not a folder"):
        open_run(tmp_path / "missing")


def test_open_runs_opens_both(tmp_path):
    """open_runs gives the two runs in the order given."""
    write_rank_folders(tmp_path / "a", {0: [1.0]}, ["x"])
    write_rank_folders(tmp_path / "b", {0: [2.0]}, ["x"])
    a, b = open_runs(tmp_path / "a", tmp_path / "b")
    assert (a.path.name, b.path.name) == ("a", "b")


def test_the_package_exports_a_sorted_surface_that_resolves():
    """Every name in __all__ loads (lazily) and the list is sorted."""
    import torchinstruments_analysis

    names = torchinstruments_analysis.__all__
    assert names == sorted(names)
    for name in names:
        assert getattr(torchinstruments_analysis, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = torchinstruments_analysis.nothing


@pytest.mark.slow
def test_a_killed_run_is_read_from_its_chunks(tmp_path):
    """A process that dies without finalizing leaves chunks: they are read, complete is false."""
    code = f"""
import os, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
import torch
from analysis_runs import blowup_model, run_step
from torchinstruments_core import EveryNForwardsSampler, inject_observer
from torchinstruments_core.run_directory import RunDirectorySink
model = blowup_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
sink = RunDirectorySink({str(tmp_path / "killed")!r}, flush_seconds=0.1, tensorboard=False)
observer = inject_observer(model, sampler=EveryNForwardsSampler(1), sink=sink)
for _ in range(4):
    run_step(model, optimizer)
observer.flush()
parts = {str(tmp_path / "killed" / "history.parts")!r}
deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # the writer flushes every 0.1 s; wait for all 4 samples
    import polars as pl
    chunks = sorted(os.path.join(parts, n) for n in os.listdir(parts) if n.startswith("history-"))
    if chunks and pl.read_parquet(chunks)["sample_id"].n_unique() == 4:
        break
    time.sleep(0.05)
os._exit(0)  # no finalization: what a kill leaves
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert not (tmp_path / "killed" / "history.parquet").exists()
    run = open_run(tmp_path / "killed")
    assert not run.complete
    assert run.status == "running"
    assert run.history.select("sample_id").unique().collect().height == 4
    assert run.layers == ("0", "1", "2", "3", "4")
