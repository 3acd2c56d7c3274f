"""The run directory under failure: a dying writer, a full disk, forks, kills, links, bad input."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments_core import (
    AlwaysSampler,
    ConfigurationError,
    EveryNForwardsSampler,
    ObservationWarning,
    SampleRecord,
    inject_observer,
)
from torchinstruments_core._exceptions import RunDirectoryExistsError
from torchinstruments_core.reducers import DEFAULT_METRICS
from torchinstruments_core.run_directory import (
    RunDirectorySink,
    escape_text,
    inspect_run,
    markdown_cell,
    next_free_folder,
    repair,
    samples_schema,
)

ROWS_PER_SAMPLE = 3 * 2 * len(DEFAULT_METRICS)  # Net: 3 layers that run, 2 signals


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.last = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.act(self.first(x)))


def _train(model: nn.Module, steps: int, *, pause: float = 0.0) -> None:
    for _ in range(steps):
        model(torch.randn(8, 4)).square().mean().backward()
        time.sleep(pause)


def _sink(folder: pathlib.Path, **options: object) -> RunDirectorySink:
    settings: dict[str, object] = {"chunk_rows": 1, "flush_seconds": 0.05, "tensorboard": False}
    return RunDirectorySink(folder, **(settings | options))  # type: ignore[arg-type]


def _result(folder: pathlib.Path) -> dict[str, Any]:
    return json.loads((folder / "result.json").read_text())


def _within(seconds: float, work: Callable[[], None]) -> None:
    """Run ``work`` on a daemon thread; fail (instead of hanging the suite) if it does not end."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as error:
            failure.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s: the training thread hangs"
    if failure:
        raise failure[0]


@contextlib.contextmanager
def _mounted(folder: pathlib.Path, options: str) -> Iterator[pathlib.Path]:
    """A real tmpfs at ``folder`` (skips the test where mounting is not permitted)."""
    folder.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
        capture_output=True,
        check=False,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def _fill(folder: pathlib.Path) -> pathlib.Path:
    """Fill the file system of ``folder`` to the last byte; the filler file to delete later."""
    filler = folder / "filler"
    block = b"\0" * 65536
    with open(filler, "wb", buffering=0) as handle:  # raw writes: no buffer to flush at close
        with contextlib.suppress(OSError):
            while True:
                handle.write(block)
        with contextlib.suppress(OSError):
            while True:
                handle.write(b"\0")
    return filler


# -- 1. a writer thread that dies --------------------------------------------------------------


def test_a_dead_writer_never_blocks_training_and_every_sample_is_counted_lost(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer killed by a Polars panic (a BaseException) never blocks the training thread.

    The death is reported once while training; close(), result.json and the warning count all
    40 samples as lost, exactly.
    """

    def panic(*_args: object, **_kwargs: object) -> None:
        raise pl.exceptions.PanicException("simulated panic in the Parquet writer")

    monkeypatch.setattr(pl.DataFrame, "write_parquet", panic)
    model = Net()
    sink = _sink(tmp_path / "run", queue_size=2, writer="thread")  # the panic is in this process
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _within(60, lambda: _train(model, 40, pause=0.01))
        monkeypatch.undo()  # the panic was transient: finalizing works again
        _within(60, observer.remove)
    messages = [str(w.message) for w in caught if issubclass(w.category, ObservationWarning)]
    assert len(messages) == 2, messages
    assert "the writer thread died" in messages[0]
    assert "PanicException" in messages[0]
    assert f"40 samples ({40 * ROWS_PER_SAMPLE} rows) were lost" in messages[1]
    result = _result(tmp_path / "run")
    assert result["status"] == "complete_with_losses"
    assert result["lost"]["samples"] == 40
    assert result["lost"]["rows"] == 40 * ROWS_PER_SAMPLE
    assert any("PanicException" in reason for reason in result["lost"]["reasons"])
    assert result["samples"]["count"] == 0  # the aggregates describe exactly the history
    assert pl.read_parquet(tmp_path / "run" / "history.parquet").height == 0
    assert sink.report is not None
    assert sink.report.losses.samples == 40


# -- 2. a full disk --------------------------------------------------------------------------


def _wait_for_chunks(folder: pathlib.Path, count: int, kind: str = "history") -> None:
    """Wait until ``count`` ``kind`` chunks are on disk (the writer process starts in a second)."""
    deadline = time.monotonic() + 60
    while len(list((folder / "history.parts").glob(f"{kind}-*.parquet"))) < count:
        assert time.monotonic() < deadline, f"{count} chunks were not written within a minute"
        time.sleep(0.02)


def _history_ids(folder: pathlib.Path) -> set[int]:
    return set(pl.read_parquet(folder / "history.parquet")["sample_id"])


def test_a_full_disk_counts_every_lost_sample_and_the_run_finalizes_when_space_returns(
    tmp_path: pathlib.Path,
) -> None:
    """On a real full tmpfs every lost sample is counted, and the run ends finalized.

    Samples are kept for a retry (bounded by chunk_rows), the rest counted exactly; when space
    returns chunks resume and the run is finalized as complete_with_losses.
    """
    with _mounted(tmp_path / "disk", "size=4m") as disk:
        model = Net()
        observer = inject_observer(model, sampler=AlwaysSampler(), sink=_sink(disk / "run"))
        _train(model, 3, pause=0.1)
        _wait_for_chunks(disk / "run", 3)
        filler = _fill(disk)
        with pytest.warns(ObservationWarning, match="No space left on device"):
            _train(model, 30, pause=0.03)
        filler.unlink()
        _train(model, 4, pause=0.1)
        with pytest.warns(ObservationWarning, match="could not close") as caught:
            observer.remove()
        written = _history_ids(disk / "run")
        lost = 37 - len(written)
        assert 0 < lost < 34  # the first 3 went through, and the last few after space returned
        assert {0, 1, 2, 33, 34, 35, 36} <= written
        result = _result(disk / "run")
        assert result["status"] == "complete_with_losses"
        assert result["lost"]["samples"] == lost
        assert result["lost"]["rows"] == lost * ROWS_PER_SAMPLE
        assert any("No space left on device" in r for r in result["lost"]["reasons"])
        assert result["samples"]["count"] == len(written)
        assert f"{lost} samples ({lost * ROWS_PER_SAMPLE} rows) were lost" in str(caught[0].message)
        assert not (disk / "run" / "history.parts").exists()
        assert not [p for p in (disk / "run").iterdir() if p.name.endswith(".tmp")]


def test_a_disk_still_full_at_exit_leaves_intact_chunks_that_repair_completes(
    tmp_path: pathlib.Path,
) -> None:
    """Finalizing on a full disk loses no chunk and leaves no temporary; repair completes it.

    The run reads as unfinished until there is space again and repair runs.
    """
    with _mounted(tmp_path / "disk", "size=4m") as disk:
        model = Net()
        observer = inject_observer(model, sampler=AlwaysSampler(), sink=_sink(disk / "run"))
        _train(model, 5, pause=0.1)
        _wait_for_chunks(disk / "run", 5)  # every sample reaches its chunk before the disk fills
        filler = _fill(disk)
        with pytest.warns(ObservationWarning, match="could not be finalized"):
            observer.remove()
        state = inspect_run(disk / "run")
        assert state.needs_repair
        assert not state.finished
        assert [p for p in (disk / "run").iterdir() if p.name.endswith(".tmp")] == []
        assert len(state.history) == 5  # the chunks are authoritative
        filler.unlink()
        (repaired,) = repair(disk / "run")
        assert repaired.status == "recovered"
        assert not repaired.needs_repair
        assert _history_ids(disk / "run") == set(range(5))
        assert _result(disk / "run")["samples"]["count"] == 5


def test_a_writer_that_dies_while_building_a_batch_counts_its_samples_lost(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A panic (a ``BaseException``) while a batch of samples' tables is built loses no count.

    The samples of the batch, the ones queued behind it and those put later are all counted.
    """
    from torchinstruments_core import StatRow
    from torchinstruments_core._signals import Signal
    from torchinstruments_core.run_directory._layout import layout_for
    from torchinstruments_core.run_directory._tables import history_frames
    from torchinstruments_core.run_directory._writer import ChunkWriter

    class Panic(BaseException):  # what a Polars panic raises
        pass

    def panicking(samples: list[SampleRecord]) -> Any:
        if any(sample.sample_id == 2 for sample in samples):
            raise Panic("polars panicked")
        return history_frames(samples)

    monkeypatch.setattr("torchinstruments_core.run_directory._writer.history_frames", panicking)
    row = StatRow("layer", 0, Signal.OUTPUT, "output", "mean", 1.0, None)
    writer = ChunkWriter(
        layout_for(tmp_path / "run", rank=0, per_rank=False),
        chunk_rows=1_000_000,
        flush_seconds=30.0,
        queue_size=8,
    )
    writer.start()
    for sample_id in range(5):
        with contextlib.suppress(OSError):  # the death is reported by a later put
            writer.put(SampleRecord("r", 0, sample_id, None, 0.0, True, 1.0, (row,) * 3, ()))
    report = writer.finish()
    assert report.died
    assert report.samples_written == 0
    assert (report.losses.samples, report.losses.rows) == (5, 15)


# -- 3. checked at injection -----------------------------------------------------------------


def test_an_output_dir_under_a_file_or_in_proc_fails_at_injection(tmp_path: pathlib.Path) -> None:
    """A folder that cannot be created raises ConfigurationError before any training step."""
    (tmp_path / "file").write_text("a file, not a folder")
    for folder in (tmp_path / "file" / "run", pathlib.Path("/proc/torchinstruments-test/run")):
        with pytest.raises(ConfigurationError, match="cannot be created or written"):
            inject_observer(Net(), output_dir=folder)
    with pytest.raises(ConfigurationError, match="a folder, not a file"):
        inject_observer(Net(), output_dir=tmp_path / "file")


def test_a_read_only_output_dir_fails_at_injection(tmp_path: pathlib.Path) -> None:
    """A read-only file system (root ignores permission bits) fails at injection, not later."""
    with _mounted(tmp_path / "readonly", "ro,size=1m") as readonly:
        for folder in (readonly, readonly / "run"):
            with pytest.raises(ConfigurationError, match="Read-only file system"):
                inject_observer(Net(), output_dir=folder)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"output_dir": ""}, "output_dir"),
        ({"output_dir": 7}, "output_dir"),
        ({"sampler": EveryNForwardsSampler}, "sampler"),
        ({"sink": RunDirectorySink}, "sink"),
        ({"run_id": 123}, "run_id"),
        ({"run_id": ""}, "run_id"),
    ],
)
def test_invalid_arguments_fail_at_injection(
    tmp_path: pathlib.Path, arguments: dict[str, object], named: str
) -> None:
    """Each invalid argument raises ConfigurationError naming it, and leaves no hook behind."""
    model = Net()
    with pytest.raises(ConfigurationError, match=named):
        inject_observer(model, **arguments)  # type: ignore[arg-type]
    assert not model._forward_hooks
    assert not model._forward_pre_hooks


def test_two_observers_never_share_a_folder(tmp_path: pathlib.Path) -> None:
    """A second observer given the same empty folder is refused; the first keeps every sample."""
    first, second = Net(), Net()
    observer = inject_observer(first, sampler=AlwaysSampler(), output_dir=tmp_path / "run")
    with pytest.raises(RunDirectoryExistsError, match="two observers never share a folder"):
        inject_observer(second, sampler=AlwaysSampler(), output_dir=tmp_path / "run")
    _train(first, 3)
    observer.remove()
    assert _history_ids(tmp_path / "run") == {0, 1, 2}


def test_a_failed_injection_gives_its_folder_back(tmp_path: pathlib.Path) -> None:
    """An injection refused after claiming its folder gives it back for a later observer."""
    model = Net()
    observer = inject_observer(model, output_dir=tmp_path / "a")
    with pytest.raises(Exception, match="already has an observer"):
        inject_observer(model, output_dir=tmp_path / "b")
    observer.remove()
    inject_observer(Net(), output_dir=tmp_path / "b").remove()


def test_a_users_index_md_is_never_overwritten(tmp_path: pathlib.Path) -> None:
    """A folder holding a file the run would write (index.md) is refused at injection."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "index.md").write_text("# my notes\n")
    with pytest.raises(RunDirectoryExistsError, match=r"index\.md, which a run would overwrite"):
        inject_observer(Net(), output_dir=tmp_path / "run")
    assert (tmp_path / "run" / "index.md").read_text() == "# my notes\n"


# -- 4. a relative output_dir ----------------------------------------------------------------


def test_a_relative_output_dir_survives_a_change_of_working_directory(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """output_dir is resolved at injection: samples after os.chdir land in the same run."""
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    model = Net()
    observer = inject_observer(model, sampler=AlwaysSampler(), output_dir="relative")
    _train(model, 2)
    os.chdir(tmp_path / "elsewhere")
    _train(model, 3, pause=0.01)
    observer.remove()
    assert _history_ids(tmp_path / "relative") == set(range(5))
    assert not (tmp_path / "elsewhere" / "relative").exists()


# -- 5. a forked child -----------------------------------------------------------------------


def _snapshot(folder: pathlib.Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


def _exit_code(pid: int, *, timeout: float) -> int:
    """The exit code of child ``pid``; a child still alive after ``timeout`` is killed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child was still running after {timeout} s")


def test_a_forked_child_never_touches_the_parents_run(tmp_path: pathlib.Path) -> None:
    """A forked child that writes to and closes the sink touches no file of the parent's run.

    The parent then finishes its run with every sample, status complete.
    """
    model = Net()
    sink = _sink(tmp_path / "run")
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    _train(model, 3, pause=0.1)
    for kind in ("history", "samples"):  # every sample's chunk (one each), not a fixed sleep
        _wait_for_chunks(tmp_path / "run", 3, kind)
    before = _snapshot(tmp_path / "run")
    record = SampleRecord("r", 0, 99, None, 0.0, True, 1.0, (), ())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads, 3.12+
        pid = os.fork()
    if pid == 0:  # the child: write and close the inherited sink, then leave at once
        code = 1
        try:
            sink.write(record)
            sink.close()
            code = 0
        finally:
            os._exit(code)
    assert _exit_code(pid, timeout=60) == 0
    assert _snapshot(tmp_path / "run") == before
    assert _result(tmp_path / "run")["status"] == "running"
    _train(model, 2)
    observer.remove()
    assert _history_ids(tmp_path / "run") == set(range(5))
    assert _result(tmp_path / "run")["status"] == "complete"


# -- 6. a kill while finalizing, and repair --------------------------------------------------

KILLED_WHILE_FINALIZING = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time, torch
    from torch import nn
    from torchinstruments_core import AlwaysSampler, inject_observer
    from torchinstruments_core.run_directory import RunDirectorySink

    folder, point = sys.argv[1], sys.argv[2]
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    sink = RunDirectorySink(folder, chunk_rows=66, flush_seconds=0.05, tensorboard=False)
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    for _ in range(6):
        model(torch.randn(8, 4)).sum().backward()

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    real_replace, real_unlink = os.replace, pathlib.Path.unlink
    def replace(source, target):
        if os.path.basename(target) == point:  # the temporary is complete, not yet renamed
            die()
        real_replace(source, target)
    removed = []
    def unlink(path, missing_ok=False):
        if point == "history.parts" and path.parent.name == "history.parts":
            removed.append(path)
            if len(removed) == 3:  # half of the chunks removed
                die()
        real_unlink(path, missing_ok=missing_ok)
    os.replace, pathlib.Path.unlink = replace, unlink
    observer.remove()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["history.parquet", "samples.parquet", "history.parts"])
def test_a_kill_while_finalizing_is_recognized_and_repaired_in_one_line(
    tmp_path: pathlib.Path, point: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A SIGKILL anywhere in finalizing is recognized, and the one-line repair completes it.

    Killed before the history's rename, before the samples' rename, or halfway through removing
    the chunks: the folder reads as needing repair, a new injection says how, and
    `python -m torchinstruments_core.run_directory repair` completes it with every row.
    """
    run = tmp_path / "run"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WHILE_FINALIZING, str(run), point], check=False
    )
    assert killed.returncode == -signal.SIGKILL
    state = inspect_run(run)
    assert state.needs_repair
    if point == "history.parts":
        assert state.status == "complete"  # committed: the compacted files are authoritative
        assert state.history == (run / "history.parquet",)
    else:
        assert state.status == "running"
        assert len(state.history) == 6  # the chunks are authoritative
        assert any(p.name.endswith(".tmp") for p in state.leftovers)  # the orphan temporary
    with pytest.raises(RunDirectoryExistsError, match="repair"):
        inject_observer(Net(), output_dir=run)
    with caplog.at_level("WARNING"):
        assert next_free_folder(run) == tmp_path / "run-resumed-1"
    assert "unfinished run" in caplog.text

    command = [sys.executable, "-m", "torchinstruments_core.run_directory", "repair", str(run)]
    repaired = subprocess.run(command, capture_output=True, text=True, check=False)
    assert repaired.returncode == 0, repaired.stderr
    assert repaired.stderr == ""
    state = inspect_run(run)
    assert not state.needs_repair
    assert state.status == ("complete" if point == "history.parts" else "recovered")
    assert sorted(p.name for p in run.iterdir()) == [
        "history.parquet",
        "index.md",
        "result.json",
        "samples.parquet",
    ]
    history = pl.read_parquet(run / "history.parquet")
    assert history.group_by("sample_id").len().sort("sample_id").rows() == [
        (i, ROWS_PER_SAMPLE) for i in range(6)
    ]
    result = _result(run)
    assert result["samples"]["count"] == 6
    assert result["layers"][0]["measurements"][0]["metrics"]["std"]["count"] == 6
    if point != "history.parts":
        assert result["lost"]["samples"] is None  # after a crash the unwritten are unknown


def test_repair_refuses_a_run_that_a_live_process_writes(tmp_path: pathlib.Path) -> None:
    """A running run (its folder locked by its writer) is never 'repaired' under its feet."""
    model = Net()
    with inject_observer(model, sampler=AlwaysSampler(), output_dir=tmp_path / "run"):
        _train(model, 1)
        assert inspect_run(tmp_path / "run").live
        assert not inspect_run(tmp_path / "run").needs_repair
        with pytest.raises(OSError, match="live process"):
            repair(tmp_path / "run")
    assert _result(tmp_path / "run")["status"] == "complete"


# -- 7. links --------------------------------------------------------------------------------


def test_a_link_planted_at_a_temporary_name_is_never_followed(tmp_path: pathlib.Path) -> None:
    """Links planted at the temporary names one can predict leave their targets untouched."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    model = Net()
    observer = inject_observer(model, sampler=AlwaysSampler(), output_dir=tmp_path / "run")
    _train(model, 2)
    pid = os.getpid()
    for name in ("history.parquet", "samples.parquet", "result.json", "index.md"):
        (tmp_path / "run" / f".{name}.{pid}.tmp").symlink_to(victim)
    observer.remove()
    assert victim.read_text() == "precious"
    assert _history_ids(tmp_path / "run") == {0, 1}


@pytest.mark.parametrize("name", ["tensorboard", "history.parts", "result.json"])
def test_links_inside_a_run_folder_are_refused(tmp_path: pathlib.Path, name: str) -> None:
    """A link (even dangling) where the run writes is refused at injection."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / name).symlink_to(tmp_path / "nowhere" if name != "tensorboard" else outside)
    with pytest.raises(RunDirectoryExistsError, match="symbolic link"):
        inject_observer(Net(), output_dir=tmp_path / "run")
    assert list(outside.iterdir()) == []


def test_a_symlinked_output_dir_chosen_by_the_user_is_fine(tmp_path: pathlib.Path) -> None:
    """The run folder itself may be a link the user made; the run lands in its target."""
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    model = Net()
    with inject_observer(model, sampler=AlwaysSampler(), output_dir=tmp_path / "link"):
        _train(model, 1)
    assert _history_ids(tmp_path / "target") == {0}


# -- 8. names from the model -----------------------------------------------------------------

HOSTILE = {"a\nb": nn.Linear(2, 2), "x|y": nn.ReLU(), "tick`s": nn.Tanh(), "\x1b[31mred": nn.Tanh()}


def test_layer_names_cannot_break_index_md_or_a_terminal(tmp_path: pathlib.Path) -> None:
    """Newlines, pipes, backticks and ESC in module names are escaped in index.md.

    The catalog keeps one row per module with four cells, and no control character remains.
    """

    class Hostile(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleDict(HOSTILE)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks.values():
                x = block(x)
            return x

    inject_observer(Hostile(), output_dir=tmp_path / "run").remove()  # the catalog is tested
    index = (tmp_path / "run" / "index.md").read_text()
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", index)
    section = index.split("## Observed modules")[1].split("##")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == len(HOSTILE)
    for row in rows:
        assert len(re.split(r"(?<!\\)\|", row)) == 6  # 4 cells between 5 unescaped pipes
    assert r"`blocks.a\nb`" in index
    assert r"`blocks.x\|y`" in index
    assert r"``blocks.tick`s``" in index
    assert r"`blocks.\x1b[31mred`" in index


def test_the_escaping_functions_are_unambiguous() -> None:
    """Backslashes are escaped too, so an escaped name maps back to exactly one name."""
    assert escape_text("a\\nb") != escape_text("a\nb")
    assert escape_text("é\u202ex") == "é\\u202ex"  # a bidirectional override, made visible
    assert markdown_cell("`x`") == "`` `x` ``"
    assert markdown_cell("a|b", code=False) == "a\\|b"


# -- 9. permissions, the samples table, the duration median ----------------------------------


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640)])
def test_every_file_honours_the_umask(tmp_path: pathlib.Path, umask: int, mode: int) -> None:
    """result.json and index.md get the same umask-derived mode as the Parquet files."""
    previous = os.umask(umask)
    try:
        model = Net()
        with inject_observer(model, sampler=AlwaysSampler(), output_dir=tmp_path / "run"):
            _train(model, 1)
    finally:
        os.umask(previous)
    for name in ("result.json", "index.md", "history.parquet", "samples.parquet"):
        assert (tmp_path / "run" / name).stat().st_mode & 0o777 == mode, name


def test_index_md_describes_every_column_of_samples_parquet(tmp_path: pathlib.Path) -> None:
    """index.md's samples table lists each column of samples.parquet with a meaning."""
    with inject_observer(Net(), output_dir=tmp_path / "run"):
        pass
    index = (tmp_path / "run" / "index.md").read_text()
    section = index.split("## Schema of samples.parquet")[1].split("\n## ")[0]
    for column in samples_schema():
        (row,) = [line for line in section.splitlines() if line.startswith(f"| `{column}` |")]
        assert row.rstrip(" |").split("|")[-1].strip(), f"{column} has no meaning"
    assert "| `rows` | Int64 | how many rows of history.parquet the sample has |" in section


def test_result_json_reports_the_median_collection_time(tmp_path: pathlib.Path) -> None:
    """The median (not dominated by the first sample's warm-up) is in result.json and index.md."""
    model = Net()
    with inject_observer(model, sampler=AlwaysSampler(), output_dir=tmp_path / "run"):
        _train(model, 7)
    durations = pl.read_parquet(tmp_path / "run" / "samples.parquet")["collection_duration_ms"]
    summary = _result(tmp_path / "run")["samples"]["collection_duration_ms"]
    assert summary["median"] == pytest.approx(float(np.median(durations.to_numpy())))
    assert summary["mean"] == pytest.approx(durations.mean())
    assert "median" in (tmp_path / "run" / "index.md").read_text()


def test_losses_name_the_errno_once_however_often_it_hits() -> None:
    """A cause that hits every chunk is one reason, not one per temporary file name."""
    from torchinstruments_core.run_directory._writer import cause

    first = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/run/.a.1.tmp")
    second = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/run/.a.2.tmp")
    assert cause(first) == cause(second) == "OSError: [Errno 28] No space left on device"
