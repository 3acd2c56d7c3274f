"""The run directory's writer process: no torch in it, and every way it can fail.

The default ``RunDirectorySink`` writes from a process of its own (``_writer_process``). These
tests start the real process: they kill it, keep it from starting, send it Ctrl-C, kill the
training process under it, and read back what is on disk with Polars.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from typing import Any

import polars as pl
import pytest
import torch

from test_run_directory_reliability import ROWS_PER_SAMPLE, Net, _train, _within
from torchinstruments_core import (
    AlwaysSampler,
    ConfigurationError,
    ObservationWarning,
    SampleRecord,
    StatRow,
    inject_observer,
)
from torchinstruments_core._records import STEP_SKIPPED, HistogramRecord, RecordKind
from torchinstruments_core._rows import RowPart, SampleRows
from torchinstruments_core._signals import Signal
from torchinstruments_core.run_directory import (
    RunDirectorySink,
    _writer,
    _writer_launch,
    _writer_pipe,
    _writer_process,
    inspect_run,
    repair,
)

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="pipes passed by descriptor")


def _can_batch() -> bool:
    """Whether a process here may make itself ``SCHED_BATCH`` (Linux, where nothing forbids it)."""
    if not hasattr(os, "SCHED_BATCH"):
        return False
    probe = "import os; os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))"
    return (
        subprocess.run([sys.executable, "-c", probe], capture_output=True, check=False).returncode
        == 0
    )


def _result(folder: pathlib.Path) -> dict[str, Any]:
    return json.loads((folder / "result.json").read_text())


def _ready(sink: RunDirectorySink) -> int:
    """Wait until the writer process has said it is ready; its id."""
    writer = sink._writer
    assert isinstance(writer, _writer_process.ProcessWriter)
    assert writer._ready.wait(timeout=60)
    assert writer._usable
    assert sink.writer_pid is not None
    return sink.writer_pid


def _train_and_remove(model: torch.nn.Module, observer: Any, steps: int, **train: Any) -> list[str]:
    """Train ``steps`` more steps and remove the observer, each within a minute; its warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _within(60, lambda: _train(model, steps, **train))
        _within(60, observer.remove)
    return [str(w.message) for w in caught if issubclass(w.category, ObservationWarning)]


def test_a_record_crosses_the_pipe_with_its_rows_as_parts() -> None:
    """``decode(encode(record))`` equals the record; its rows stay columns (no ``StatRow``s)."""
    part = RowPart("layer", 0, Signal.OUTPUT, "output", ("mean", "std"), [1.0, None], [None, "x"])
    record = SampleRecord("r", 0, 3, 7, 1.5, False, 2.0, SampleRows([part]), ())
    again = _writer_pipe.decode(_writer_pipe.encode(record))
    assert isinstance(again.rows, SampleRows)
    assert again.rows._rows is None  # not made into rows on the way
    assert again == record
    plain = SampleRecord(
        "r", 0, 4, None, 1.5, True, 2.0, (StatRow(*part[:4], "mean", 1.0, None),), ()
    )
    assert _writer_pipe.decode(_writer_pipe.encode(plain)) == plain


def test_every_field_of_a_record_crosses_the_pipe_with_its_type() -> None:
    """Histograms, kind, note, scope and the optimizer step come back equal, enums as enums.

    ``encode`` sends plain tuples; the names it passes as they are, with the three it rebuilds,
    are every field of ``SampleRecord`` (a field added later must be added there too).
    """
    names = {field.name for field in dataclasses.fields(SampleRecord)}
    assert {*_writer_pipe._SCALAR_NAMES, "rows", "histograms", "kind"} == names
    part = RowPart("a.b", 2, Signal.OUTPUT_GRADIENT, "output.1", ("mean",), [0.5], None)
    edges, counts = (0.0, 1.0, 2.0), (3.0, 4.0)
    histogram = HistogramRecord("a.b", 2, Signal.PARAMETER, "weight", edges, counts, 1)
    record = SampleRecord(
        "run", 1, 9, 40, 1.25, False, 0.5, SampleRows([part]), (histogram,),
        optimizer_step=12, kind=RecordKind.STEP, note=STEP_SKIPPED, scope="phase_2",
    )  # fmt: skip
    again = _writer_pipe.decode(_writer_pipe.encode(record))
    assert again == record
    assert type(again.kind) is RecordKind
    assert type(again.histograms[0].signal) is Signal
    assert type(next(iter(again.rows)).signal) is Signal
    # a record made outside the engine with plain strings crosses as it was
    odd = RowPart("a", 0, "custom", "output", ("mean",), [1.0], None)  # type: ignore[arg-type]
    plain = SampleRecord("run", 0, 1, None, 1.0, True, 0.1, SampleRows([odd]), ())
    assert next(iter(_writer_pipe.decode(_writer_pipe.encode(plain)).rows)).signal == "custom"


def test_the_writer_is_a_process_without_torch_and_writes_the_same_run(
    tmp_path: pathlib.Path,
) -> None:
    """The default sink's writer: another process, niced, batch, without torch; a complete run.

    Its history, samples, aggregates and TensorBoard file are those a writer thread writes.
    """
    runs = {}
    for kind in ("process", "thread"):
        torch.manual_seed(0)
        model = Net()
        sink = RunDirectorySink(tmp_path / kind, writer=kind, chunk_rows=50)
        observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
        torch.manual_seed(1)
        _train(model, 12)
        if kind == "process":
            pid = _ready(sink)
            assert pid != os.getpid()
            niceness = os.getpriority(os.PRIO_PROCESS, 0)
            assert os.getpriority(os.PRIO_PROCESS, pid) == min(niceness + 10, 19)
            if _can_batch():  # Linux: a batch process, never preempting on wake
                assert os.sched_getscheduler(pid) == os.SCHED_BATCH
            maps = pathlib.Path(f"/proc/{pid}/maps")
            if maps.exists():
                assert "libtorch" not in maps.read_text()
        else:
            assert sink.writer_pid is None
        observer.remove()
        assert sink.writer_pid is None
        runs[kind] = tmp_path / kind
    for table in ("history.parquet", "samples.parquet"):
        drop = ["run_id", "timestamp", "collection_duration_ms"]
        frames = [pl.read_parquet(runs[k] / table).drop(drop, strict=False) for k in runs]
        assert frames[0].height > 0
        assert frames[0].equals(frames[1])
    results = [_result(runs[k]) for k in runs]
    assert results[0]["status"] == results[1]["status"] == "complete"
    assert results[0]["samples"]["count"] == results[1]["samples"]["count"] == 12
    assert results[0]["signals"] == results[1]["signals"]
    events = [sorted((runs[k] / "tensorboard").iterdir()) for k in runs]
    assert len(events[0]) == len(events[1]) == 1
    assert events[0][0].stat().st_size == events[1][0].stat().st_size > 0


def test_a_killed_writer_process_never_blocks_training_and_every_unwritten_sample_counts(
    tmp_path: pathlib.Path,
) -> None:
    """SIGKILL to the writer: training goes on unblocked, every unwritten sample counts.

    The death is reported once; the samples it had not written, and every later one, are
    counted as lost, exactly. The run is finalized from the chunks it wrote, whose aggregates
    are read back from disk.
    """
    model = Net()
    sink = RunDirectorySink(tmp_path / "run", chunk_rows=1, flush_seconds=0.05, queue_size=2)
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    _train(model, 5)
    pid = _ready(sink)
    deadline = time.monotonic() + 30
    while len(list((tmp_path / "run" / "history.parts").glob("history*.parquet"))) < 5:
        assert time.monotonic() < deadline, "the first five samples were never written"
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    messages = _train_and_remove(model, observer, 35, pause=0.01)
    assert len(messages) == 2, messages
    assert "writer process" in messages[0]
    assert "killed by SIGKILL" in messages[0]
    result = _result(tmp_path / "run")
    written = pl.read_parquet(tmp_path / "run" / "samples.parquet").height
    assert written >= 5
    lost = 40 - written
    assert result["status"] == "complete_with_losses"
    assert result["lost"]["samples"] == lost
    assert result["lost"]["rows"] == lost * ROWS_PER_SAMPLE
    assert f"{lost} samples ({lost * ROWS_PER_SAMPLE} rows) were lost" in messages[1]
    assert result["samples"]["count"] == written  # rebuilt from the chunks on disk
    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    assert history.height == written * ROWS_PER_SAMPLE
    assert sink.report is not None
    assert sink.report.died


def _record_paths(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count how the samples leave once the writer is ready: written, begun, or queued.

    ``written``: all of the message by the training thread; ``begun``: what the pipe took, the
    rest left to the sender; ``queued``: none of it. Samples put before the writer process is
    ready are queued by design and not counted. The training thread's own writes to the pipe
    tell the first two apart.
    """
    paths = {"written": 0, "begun": 0, "queued": 0, "largest": 0}
    write_now = _writer_process.ProcessWriter._write_now
    write = os.write
    direct = threading.local()

    def counted(self: _writer_process.ProcessWriter, parcel: Any) -> bool:
        if not self._ready.is_set():
            return write_now(self, parcel)
        paths["largest"] = max(paths["largest"], len(parcel.payload))
        direct.active = True
        try:
            written = write_now(self, parcel)
        finally:
            direct.active = False
        paths["queued"] += not written
        return written

    def watched(fd: int, data: Any) -> int:
        count = write(fd, data)
        if getattr(direct, "active", False):
            paths["written" if count == len(data) else "begun"] += 1
        return count

    monkeypatch.setattr(_writer_process.ProcessWriter, "_write_now", counted)
    monkeypatch.setattr(os, "write", watched)  # the module's ``os.write`` is this one
    return paths


def _one_page_pipe(sink: RunDirectorySink) -> int:
    """The size of the pipe to the writer process; skips where it cannot be made one page."""
    fcntl = pytest.importorskip("fcntl")
    writer = sink._writer
    assert isinstance(writer, _writer_process.ProcessWriter)
    assert writer._to_writer is not None
    if not hasattr(fcntl, "F_GETPIPE_SZ"):
        pytest.skip("the pipe's size cannot be read here")
    size = int(fcntl.fcntl(writer._to_writer, fcntl.F_GETPIPE_SZ))
    if size > 4096:
        pytest.skip(f"a pipe holds at least {size} bytes here (pages larger than 4 KiB)")
    return size


def _caught_up(sink: RunDirectorySink) -> None:
    """Wait until the sender has written everything queued and the writer has read all of it."""
    writer = sink._writer
    assert isinstance(writer, _writer_process.ProcessWriter)
    deadline = time.monotonic() + 30
    while True:
        with writer._pipe_lock, writer._count_lock:
            if not writer._queued and writer._carry is None and not _unread(writer._to_writer):
                return
        assert time.monotonic() < deadline, "the sender or the writer never caught up"
        time.sleep(0.01)


def _five_layers() -> torch.nn.Module:
    """A model whose every sample's message to the writer passes a page (a one-page pipe)."""
    return torch.nn.Sequential(
        torch.nn.Linear(4, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 2),
    )


def _unread(pipe: int | None) -> int:
    """Bytes in ``pipe`` that its reader has not read yet (0 where that cannot be asked)."""
    if pipe is None or sys.platform != "linux":
        return 0
    import array
    import fcntl
    import termios

    count = array.array("i", [0])
    fcntl.ioctl(pipe, termios.FIONREAD, count)
    return count[0]


def test_the_training_thread_writes_samples_to_the_pipe_and_the_sender_keeps_their_order(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Samples go to the pipe from the training thread where it has room, in order with the rest.

    With a one-page pipe every sample's message is larger than the pipe: the training thread
    writes what fits and leaves the rest to the sender, and samples that come meanwhile are
    queued behind it. The run is the one a writer thread writes, sample for sample.
    """
    monkeypatch.setattr(_writer_launch, "PIPE_BYTES", 4096)  # the least a pipe holds
    paths = _record_paths(monkeypatch)
    runs = {}
    for kind in ("process", "thread"):
        torch.manual_seed(0)
        model = _five_layers()
        sink = RunDirectorySink(tmp_path / kind, writer=kind, chunk_rows=50)
        observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
        torch.manual_seed(1)
        _train(model, 1)  # opens the run
        if kind == "process":
            _ready(sink)  # from here on the training thread may write
            pipe = _one_page_pipe(sink)
        for step in range(39):
            _train(model, 1)
            if kind == "process" and step % 8 == 7:  # the next message finds the pipe empty
                _caught_up(sink)
        observer.remove()
        runs[kind] = tmp_path / kind
    assert paths["largest"] > pipe  # every message larger than the pipe
    assert paths["begun"] > 0  # written in part by the training thread, the rest by the sender
    assert paths["queued"] > 0  # behind a message the sender was finishing
    assert paths["written"] + paths["begun"] + paths["queued"] == 39
    for table in ("history.parquet", "samples.parquet"):
        drop = ["run_id", "timestamp", "collection_duration_ms"]
        frames = [pl.read_parquet(runs[k] / table).drop(drop, strict=False) for k in runs]
        assert frames[0].height > 0
        assert frames[0].equals(frames[1])
    assert _result(runs["process"])["status"] == "complete"
    assert _result(runs["process"])["samples"]["count"] == 40


def test_a_carried_rest_that_finds_the_queue_full_is_written_before_the_next_item(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rest of a direct write is written by the sender even where its marker was refused.

    ``_write_now`` leaves what the pipe did not take to the sender and queues a marker that
    wakes it; where the queue is full (another thread filled it meanwhile) the marker is
    dropped, and the sender writes the rest before the next item it takes: the next sample, or
    the finish. Here every marker is refused: no message is cut, and the run is whole.
    """
    monkeypatch.setattr(_writer_launch, "PIPE_BYTES", 4096)
    paths = _record_paths(monkeypatch)
    torch.manual_seed(0)
    model = _five_layers()
    sink = RunDirectorySink(tmp_path / "run", chunk_rows=50)
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    torch.manual_seed(1)
    _train(model, 1)  # opens the run
    _ready(sink)
    _one_page_pipe(sink)
    writer = sink._writer
    assert isinstance(writer, _writer_process.ProcessWriter)
    put_nowait = writer._queue.put_nowait
    refused = []

    def full_for_markers(item: object) -> None:
        if item is _writer_process._CARRY:
            refused.append(item)
            raise queue.Full
        put_nowait(item)

    monkeypatch.setattr(writer._queue, "put_nowait", full_for_markers)
    for _ in range(20):
        _train(model, 1)
        # the sender idle and the pipe read: the next message is begun by the training thread,
        # or, behind a rest left there, queued for the sender, which writes the rest first
        deadline = time.monotonic() + 30
        while True:
            with writer._count_lock:
                idle = not writer._queued and not _unread(writer._to_writer)
            if idle:
                break
            assert time.monotonic() < deadline, "the sender or the writer never caught up"
            time.sleep(0.01)
    # every other message begun by the training thread, each one's marker refused: a refused
    # marker left counted as queued would have stopped every direct write after the first
    assert paths["begun"] >= 5
    assert len(refused) == paths["begun"]
    observer.remove()
    result = _result(tmp_path / "run")
    assert result["status"] == "complete"
    assert result["samples"]["count"] == 21
    assert result["lost"]["samples"] == 0
    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    assert history["sample_id"].unique().len() == 21


def test_a_full_pipe_never_makes_the_training_thread_wait_for_the_writer(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer process that stops reading (SIGSTOP) leaves the samples queued, not waited on.

    The training thread writes only what the pipe takes at once (the first sample after the
    stop, in part); with the pipe full, samples queue for the sender until the writer reads
    again, and then every one of them is written.
    """
    monkeypatch.setattr(_writer_launch, "PIPE_BYTES", 4096)
    paths = _record_paths(monkeypatch)
    model = Net()
    sink = RunDirectorySink(tmp_path / "run", chunk_rows=1, flush_seconds=0.05, queue_size=64)
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    _train(model, 1)  # opens the run
    pid = _ready(sink)
    _one_page_pipe(sink)
    _caught_up(sink)
    os.kill(pid, signal.SIGSTOP)
    try:
        _within(60, lambda: _train(model, 19))  # far more than a stopped pipe holds
    finally:
        os.kill(pid, signal.SIGCONT)
    assert paths["begun"] + paths["written"] > 0  # the training thread wrote to the pipe
    assert paths["queued"] > 0  # and queued what it could not write at once
    _within(60, observer.remove)
    result = _result(tmp_path / "run")
    assert result["status"] == "complete"
    assert result["samples"]["count"] == 20
    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    assert history.height == 20 * ROWS_PER_SAMPLE
    assert history["sample_id"].unique().len() == 20


def test_a_write_interrupted_by_ctrl_c_closes_the_pipe_and_counts_what_it_cost(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt as a sample's write returns: the stream is never read past it.

    Part of the message may be in the pipe with the rest unrecorded, so nothing may follow it:
    the pipe is closed, the writer process writes what it holds and exits, training goes on
    unblocked, and the interrupted sample and every later one are counted as lost.
    """
    model, observer, _, writer = _opened(tmp_path)
    write, training = os.write, threading.get_ident()
    interrupt = [True]
    pipe = writer._to_writer

    def cut(fd: int, data: Any) -> int:
        if threading.get_ident() != training or fd != pipe or not interrupt:
            return write(fd, data)
        interrupt.clear()
        write(fd, bytes(data[: len(data) // 2]))
        raise KeyboardInterrupt  # as Python raises it once the call returns

    monkeypatch.setattr(os, "write", cut)
    with pytest.raises(KeyboardInterrupt):
        _train(model, 1)
    assert not interrupt  # it was the training thread's own write
    messages = _train_and_remove(model, observer, 3)
    assert any("interrupted" in message for message in messages), messages
    result = _result(tmp_path / "run")
    assert result["status"] == "complete_with_losses"
    assert result["samples"]["count"] == 4  # every sample before the interrupted one
    assert result["lost"]["samples"] == 4
    assert result["lost"]["rows"] == 4 * ROWS_PER_SAMPLE
    history = pl.read_parquet(tmp_path / "run" / "history.parquet")
    assert history.height == 4 * ROWS_PER_SAMPLE


_SIGTERM_IN_A_WRITE = """
import os, signal, sys, time, torch
from torch import nn
from torchinstruments_core import AlwaysSampler, inject_observer
from torchinstruments_core.run_directory import RunDirectorySink, _writer_process
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
sink = RunDirectorySink(sys.argv[1])
inject_observer(model, sampler=AlwaysSampler(), sink=sink)
step = lambda: model(torch.randn(8, 4)).square().mean().backward()
step()
assert sink._writer._ready.wait(60) and sink._writer._usable
frame = _writer_process.sample_message

def interrupted(payload):  # in the middle of a sample's write, the pipe held
    if _writer_process.threading.current_thread() is _writer_process.threading.main_thread():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.getsignal(signal.SIGTERM)  # a call: Python runs the handler here, at the latest
    return frame(payload)

for _ in range(3):
    step()
deadline = time.monotonic() + 60
while True:  # until the sender has caught up: the next sample is written from here
    with sink._writer._pipe_lock, sink._writer._count_lock:
        if not sink._writer._queued and sink._writer._carry is None:
            break
    assert time.monotonic() < deadline, "the sender never caught up"
    time.sleep(0.01)
_writer_process.sample_message = interrupted
step()
print("still running", flush=True)
"""


def test_a_sigterm_in_the_middle_of_a_sample_s_write_finalizes_the_run_once_it_is_written(
    tmp_path: pathlib.Path,
) -> None:
    """A SIGTERM while the training thread writes a sample to the pipe: no hang, nothing lost.

    The handler's finalizing waits for the end of the hand-over (it would otherwise wait for
    the pipe the interrupted write holds), then the process ends as SIGTERM ends it, and the
    run holds every sample, the interrupted one included.
    """
    script = tmp_path / "train.py"
    script.write_text(_SIGTERM_IN_A_WRITE)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert "still running" not in done.stdout  # ended by the SIGTERM, at the end of the write
    result = _result(tmp_path / "run")
    assert result["status"] == "complete"
    assert result["samples"]["count"] == 5


@pytest.mark.parametrize("failure", ["no interpreter", "exits at once", "fails to set up"])
def test_a_writer_process_that_cannot_start_hands_the_run_to_a_thread(
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    failure: str,
) -> None:
    """No usable process: a warning in the log, a thread writes, and nothing is lost."""
    if failure == "no interpreter":
        monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    elif failure == "exits at once":
        monkeypatch.setattr(_writer_launch, "BOOT", "import sys; sys.exit(3)")
    else:  # the process starts, but opening the writer raises there
        broken = "import torchinstruments_core.run_directory._writer_child as w\nw._open = None\n"
        monkeypatch.setattr(
            _writer_launch, "BOOT", _writer_launch.BOOT.replace("serve(", broken + "serve(")
        )
    model = Net()
    sink = RunDirectorySink(tmp_path / "run", chunk_rows=1, flush_seconds=0.05)
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    with caplog.at_level(logging.WARNING, logger="torchinstruments_core"):
        _train(model, 6)
        observer.remove()
    assert any("could not start" in r.getMessage() for r in caplog.records)
    result = _result(tmp_path / "run")
    assert result["status"] == "complete"
    assert result["samples"]["count"] == 6
    assert pl.read_parquet(tmp_path / "run" / "history.parquet").height == 6 * ROWS_PER_SAMPLE
    assert len(list((tmp_path / "run" / "tensorboard").iterdir())) == 1


def test_ctrl_c_and_sigterm_leave_the_writer_process_to_the_training_process(
    tmp_path: pathlib.Path,
) -> None:
    """SIGINT and SIGTERM (a Ctrl-C, a scheduler) do not stop the writer: the run closes whole."""
    model = Net()
    sink = RunDirectorySink(tmp_path / "run")
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    _train(model, 3)
    pid = _ready(sink)
    os.kill(pid, signal.SIGINT)
    os.kill(pid, signal.SIGTERM)
    _train(model, 3)
    observer.remove()
    assert _result(tmp_path / "run")["status"] == "complete"
    assert _result(tmp_path / "run")["samples"]["count"] == 6


_KILLED_TRAINING = """
import os, signal, sys, time, torch
from torch import nn
from torchinstruments_core import AlwaysSampler, inject_observer
from torchinstruments_core.run_directory import RunDirectorySink
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
sink = RunDirectorySink(sys.argv[1], flush_seconds=3600)  # nothing reaches disk on its own
inject_observer(model, sampler=AlwaysSampler(), sink=sink)
for _ in range(7):
    model(torch.randn(8, 4)).square().mean().backward()
worker = os.fork()  # a DataLoader worker's way: it outlives the kill below by a minute
if worker == 0:
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)  # the test reads the output until every copy of it is closed
    os.dup2(quiet, 2)
    time.sleep(60)
    os._exit(0)
print(sink.writer_pid, worker, flush=True)
time.sleep(1.0)  # the samples cross the pipe
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_killed_training_process_leaves_its_last_samples_on_disk_for_repair(
    tmp_path: pathlib.Path,
) -> None:
    """A training process killed with its samples in the writer's memory leaves them on disk.

    The writer process reads the end of its pipe, writes them as a last chunk and exits, and
    repair completes the run. A process forked from the training process (a ``DataLoader``
    worker) that lives on holds no copy of the pipe that would keep the writer waiting.
    """
    run = tmp_path / "run"
    killed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_TRAINING), str(run)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    pid, worker = map(int, killed.stdout.split()[:2])
    try:
        deadline = time.monotonic() + 30
        while _running(pid):
            assert time.monotonic() < deadline, "the writer process outlived its run"
            time.sleep(0.05)
        assert _running(worker)  # it did live on
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
    while _running(worker):  # it holds a copy of the folder's lock (any fork does) until it ends
        time.sleep(0.05)
    state = inspect_run(run)
    assert state.needs_repair
    assert len(state.history) == 1  # one last chunk
    (repaired,) = repair(run)
    assert repaired.status == "recovered"
    assert pl.read_parquet(run / "samples.parquet")["sample_id"].to_list() == list(range(7))


def _running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie no one has reaped yet has exited)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_the_writer_can_be_chosen_and_a_wrong_choice_fails_at_once(tmp_path: pathlib.Path) -> None:
    """``writer="thread"`` starts no process; any other name is a ``ConfigurationError``."""
    with pytest.raises(ConfigurationError, match="writer"):
        RunDirectorySink(tmp_path / "bad", writer="subprocess")
    model = Net()
    sink = RunDirectorySink(tmp_path / "run", writer="thread")
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    _train(model, 2)
    assert sink.writer_pid is None
    observer.remove()
    assert _result(tmp_path / "run")["samples"]["count"] == 2


def test_a_writer_process_that_hangs_at_start_is_replaced_by_a_thread(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that never says it is ready is killed after the start timeout.

    A thread writes the run instead, and nothing is lost.
    """
    monkeypatch.setattr(_writer_process, "_READY_SECONDS", 1.0)
    monkeypatch.setattr(_writer_launch, "BOOT", "import time; time.sleep(300)")
    model = Net()
    sink = RunDirectorySink(tmp_path / "run", chunk_rows=1, flush_seconds=0.05, queue_size=2)
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    _within(60, lambda: _train(model, 6, pause=0.05))
    writer = sink._writer
    assert isinstance(writer, _writer_process.ProcessWriter)
    process = writer._process
    _within(60, observer.remove)
    assert process is not None
    assert process.returncode == -signal.SIGKILL
    result = _result(tmp_path / "run")
    assert result["status"] == "complete"
    assert result["samples"]["count"] == 6


def test_no_writer_at_all_never_blocks_training_and_counts_every_sample_lost(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither the process nor the fallback thread can start: training goes on, all is counted."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))

    def no_thread(self: RunDirectorySink) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(RunDirectorySink, "_thread_writer", no_thread)
    model = Net()
    sink = RunDirectorySink(tmp_path / "run", queue_size=2)
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    messages = _train_and_remove(model, observer, 10)
    assert any("can't start new thread" in message for message in messages), messages
    assert f"10 samples ({10 * ROWS_PER_SAMPLE} rows) were lost" in messages[-1]
    assert _result(tmp_path / "run")["lost"]["samples"] == 10


def test_a_path_object_on_sys_path_does_not_keep_the_process_from_starting(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sys.path`` entries that are ``pathlib.Path`` objects reach the process as text."""
    monkeypatch.setattr(sys, "path", [*sys.path, tmp_path / "elsewhere"])
    model = Net()
    sink = RunDirectorySink(tmp_path / "run")
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    _train(model, 2)
    assert _ready(sink) != os.getpid()
    observer.remove()
    assert _result(tmp_path / "run")["samples"]["count"] == 2


def _opened(tmp_path: pathlib.Path) -> tuple[Net, Any, RunDirectorySink, Any]:
    """A sampled model whose run's writer process is ready, four samples written."""
    model = Net()
    sink = RunDirectorySink(tmp_path / "run", chunk_rows=1, flush_seconds=0.05)
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    _train(model, 1)  # opens the run
    _ready(sink)
    _train(model, 3)
    _caught_up(sink)
    writer = sink._writer
    assert isinstance(writer, _writer_process.ProcessWriter)
    return model, observer, sink, writer


def test_a_writer_process_dying_as_the_run_closes_never_hangs_the_close(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process dies after ``finish`` queued its stop, before the sender took it.

    The replies thread, finding the pipe's end, empties the queue of the samples lost with the
    process; the stop went with them, and the sender, which ``finish`` waits for, waited for
    an item forever (2 closes in 120 where the process was killed just before). Here the
    replies thread marks the process dead at that very instant (the interpreter's switch
    interval held long, so the sender does not run in between): the close returns, the
    process counted as died, every sample before its death on disk.
    """
    _, observer, sink, writer = _opened(tmp_path)
    entered, release = threading.Event(), threading.Event()
    status = _writer_launch.exit_status

    def held(process: Any) -> str:  # the replies thread, about to mark the process dead
        entered.set()
        release.wait(60)
        return status(process)

    monkeypatch.setattr(_writer_process, "exit_status", held)
    os.kill(writer.pid, signal.SIGKILL)
    assert entered.wait(30)
    enqueue = _writer.enqueue

    def stop_then_dead(items: Any, item: object, alive: Any) -> bool:
        queued = enqueue(items, item, alive)
        if item is _writer_process._STOP:
            writer._mark_dead()  # what the replies thread does next
            release.set()
        return bool(queued)

    monkeypatch.setattr(_writer_process, "enqueue", stop_then_dead)
    caught: list[str] = []

    def close() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            observer.remove()
        caught.extend(str(warning.message) for warning in seen)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(100)
    try:
        closer = threading.Thread(target=close, daemon=True)
        closer.start()
        closer.join(60)
    finally:
        sys.setswitchinterval(interval)
        release.set()
    assert not closer.is_alive(), "the close waited for a sender that never stops"
    assert sink.report is not None
    assert sink.report.died
    result = _result(tmp_path / "run")
    lost = result["lost"]["samples"]
    assert result["samples"]["count"] + lost == 4  # each written, or counted as lost
    assert any("killed by SIGKILL" in message for message in caught), caught


def test_ctrl_c_before_a_sample_reaches_the_pipe_counts_it_lost_and_the_run_goes_on(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt in ``put`` before any byte of the sample is written, caught.

    The sample was never written nor queued: it is counted as lost, with its reason, where it
    vanished (the run said complete, nothing lost); the pipe stays open and the samples after
    it are written by the training thread itself, as before.
    """
    model, observer, _, writer = _opened(tmp_path)
    set_blocking, training = os.set_blocking, threading.get_ident()
    interrupt = [True]

    def interrupted(fd: int, blocking: bool) -> None:
        set_blocking(fd, blocking)
        if interrupt and not blocking and threading.get_ident() == training:
            interrupt.clear()
            raise KeyboardInterrupt  # as Python raises it once the call returns

    monkeypatch.setattr(os, "set_blocking", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _train(model, 1)
    monkeypatch.setattr(os, "set_blocking", set_blocking)
    assert not interrupt
    assert writer._to_writer is not None  # nothing of it reached the pipe: still open
    paths = _record_paths(monkeypatch)
    messages = _train_and_remove(model, observer, 3)
    assert paths["queued"] == 0  # written by the training thread, as before the interrupt
    assert paths["written"] + paths["begun"] == 3
    result = _result(tmp_path / "run")
    assert result["status"] == "complete_with_losses"
    assert result["samples"]["count"] == 7
    assert result["lost"]["samples"] == 1
    assert result["lost"]["rows"] == ROWS_PER_SAMPLE
    assert any("interrupted" in message for message in messages), messages


def test_ctrl_c_while_a_sample_waits_for_room_counts_it_lost_and_keeps_the_count(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt while ``put`` waits for room on the sender's queue (writer behind).

    The sample never reached the queue: it is counted as lost, and the count of queued items
    goes back to zero, so that the training thread writes the later samples itself again
    (left at one, every later sample went through the sender thread).
    """
    model, observer, _, writer = _opened(tmp_path)
    enqueue = _writer.enqueue
    interrupt = [True]

    def full(self: Any, parcel: Any) -> bool:
        return False  # the pipe had no room: the sample is queued

    def waiting(items: Any, item: object, alive: Any) -> bool:
        if interrupt and item is not _writer_process._STOP and item is not _writer_process._CARRY:
            interrupt.clear()
            raise KeyboardInterrupt  # Ctrl-C while it waits for room
        return bool(enqueue(items, item, alive))

    monkeypatch.setattr(_writer_process.ProcessWriter, "_write_now", full)
    monkeypatch.setattr(_writer_process, "enqueue", waiting)
    with pytest.raises(KeyboardInterrupt):
        _train(model, 1)
    monkeypatch.undo()
    assert not interrupt
    assert writer._queued == 0
    paths = _record_paths(monkeypatch)
    messages = _train_and_remove(model, observer, 3)
    assert paths["queued"] == 0
    result = _result(tmp_path / "run")
    assert result["samples"]["count"] == 7
    assert result["lost"]["samples"] == 1
    assert any("interrupted" in message for message in messages), messages


def test_ctrl_c_while_the_writer_thread_is_behind_counts_the_sample_lost(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``writer="thread"``: a KeyboardInterrupt while ``put`` waits for room on its queue.

    The sample never got on the queue: it is counted as lost (reason: interrupted) where it
    vanished, and the run goes on.
    """
    model = Net()
    sink = RunDirectorySink(tmp_path / "run", chunk_rows=1, flush_seconds=0.05, writer="thread")
    observer = inject_observer(model, sampler=AlwaysSampler(), sink=sink)
    _train(model, 4)
    enqueue = _writer.enqueue
    interrupt = [True]

    def waiting(items: Any, item: object, alive: Any) -> bool:
        if interrupt and isinstance(item, SampleRecord):
            interrupt.clear()
            raise KeyboardInterrupt  # Ctrl-C while it waits for room
        return bool(enqueue(items, item, alive))

    monkeypatch.setattr(_writer, "enqueue", waiting)
    with pytest.raises(KeyboardInterrupt):
        _train(model, 1)
    monkeypatch.undo()
    messages = _train_and_remove(model, observer, 3)
    result = _result(tmp_path / "run")
    assert result["samples"]["count"] == 7
    assert result["lost"]["samples"] == 1
    assert any("interrupted" in message for message in messages), messages
