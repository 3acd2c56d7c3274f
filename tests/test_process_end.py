"""Observers meet the end of their process: exit without removal, launchers, fork, SIGTERM.

The process-level cases run in fresh interpreters (a fork of the test process would inherit
pytest's threads and polars' state), each bounded by a timeout so that a hang fails the test.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments_core import AlwaysSampler, inject_observer
from torchinstruments_core.testing import RecordingSink

TESTS = pathlib.Path(__file__).parent


def _run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter (tests/ importable), failing on a hang."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(TESTS))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=TESTS,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _complete_run(folder: pathlib.Path) -> pl.DataFrame:
    """The history of a finalized run folder (result.json says complete, no chunks left)."""
    assert json.loads((folder / "result.json").read_text())["status"] == "complete"
    assert not (folder / "history.parts").exists()
    return pl.read_parquet(folder / "history.parquet")


SPAWN = """
import sys
import torch
import torch.multiprocessing as mp
from torch import nn
from torchinstruments_core import AlwaysSampler, inject_observer

def worker(rank, folder):
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2
    )
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    inject_observer(
        model, sampler=AlwaysSampler(), output_dir=f"{folder}/stats", rank_policy="all",
        run_id="launch",
    )
    torch.distributed.barrier()  # both hold their sinks before either creates its rank folder
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
    # no remove_observer: the process just returns, as most training scripts do

if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1],), nprocs=2, join=True)
"""


@pytest.mark.slow
def test_spawned_ranks_that_never_remove_their_observer_are_finalized(
    tmp_path: pathlib.Path,
) -> None:
    """torch.multiprocessing.spawn children skip atexit: every rank's run is finalized anyway."""
    script = tmp_path / "spawn_run.py"
    script.write_text(textwrap.dedent(SPAWN))
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        history = _complete_run(tmp_path / "stats" / f"rank-{rank:03d}")
        assert history["sample_id"].unique().sort().to_list() == [0, 1, 2]
        assert history["rank"].unique().to_list() == [rank]


DEBUG_LAUNCHER = """
import os, sys
import torch._dynamo, torch.distributed.tensor
from accelerate import Accelerator, debug_launcher
from accelerate_helpers import Regressor, loader
import torch
from torchinstruments_accelerate import TelemetryTracker

def run(root):
    telemetry = TelemetryTracker(every_n_steps=2, rank_policy="all")
    accelerator = Accelerator(log_with=[telemetry], project_dir=root)
    accelerator.init_trackers("exp")
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader(batches=8))
    telemetry.watch(model, accelerator=accelerator)
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.end_training()  # finishes trackers on the main process only

os.environ["OMP_NUM_THREADS"] = "1"
debug_launcher(run, args=(sys.argv[1],), num_processes=2)
"""


@pytest.mark.slow
def test_debug_launcher_rank_all_without_finish_keeps_every_rank(tmp_path: pathlib.Path) -> None:
    """Under debug_launcher, the process that end_training() never reaches is finalized too."""
    done = _run(DEBUG_LAUNCHER, str(tmp_path))
    assert done.returncode == 0, done.stderr
    telemetry = tmp_path / "telemetry"
    assert sorted(p.name for p in telemetry.glob("rank-*")) == ["rank-000", "rank-001"]
    for rank in (0, 1):
        history = _complete_run(telemetry / f"rank-{rank:03d}")
        assert history["rank"].unique().to_list() == [rank]
        assert history.height > 0


FORK_EXIT = """
import os, sys, json
import torch
from torch import nn
from torchinstruments_core import AlwaysSampler, inject_observer

folder = sys.argv[1]
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
observer = inject_observer(model, sampler=AlwaysSampler(), output_dir=folder)
for _ in range(2):
    model(torch.randn(2, 4)).sum().backward()
child = os.fork()
if child == 0:
    model(torch.randn(2, 4)).sum().backward()  # the child uses the model, then exits normally
    sys.exit(0)
_, status = os.waitpid(child, 0)
assert os.waitstatus_to_exitcode(status) == 0
for _ in range(2):
    model(torch.randn(2, 4)).sum().backward()
observer.remove()
"""


@pytest.mark.slow
def test_a_forked_child_that_exits_normally_leaves_the_parents_run_alone(
    tmp_path: pathlib.Path,
) -> None:
    """Only the process that created a run finalizes it: the parent keeps all 4 of its samples."""
    done = _run(FORK_EXIT, str(tmp_path / "stats"))
    assert done.returncode == 0, done.stderr
    history = _complete_run(tmp_path / "stats")
    assert history["sample_id"].unique().sort().to_list() == [0, 1, 2, 3]


FORKED_WORKERS = """
import sys
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchinstruments_core import AlwaysSampler, inject_observer

teacher = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

class Distilled(Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, index):
        x = torch.randn(4)
        return x, teacher(x).detach()  # every worker calls the observed model

observer = inject_observer(teacher, sampler=AlwaysSampler(), output_dir=sys.argv[1])
teacher(torch.randn(1, 4)).sum().backward()
loader = DataLoader(
    Distilled(), batch_size=2, num_workers=2, multiprocessing_context="fork", timeout=60
)
assert sum(1 for _ in loader) == 200
observer.remove()
print("done")
"""


@pytest.mark.slow
def test_forked_dataloader_workers_that_call_the_model_never_hang(tmp_path: pathlib.Path) -> None:
    """A forked worker calling the observed model 200 times finishes; its calls are not samples."""
    done = _run(FORKED_WORKERS, str(tmp_path / "stats"), timeout=180)
    assert done.returncode == 0, done.stderr
    assert "done" in done.stdout
    history = _complete_run(tmp_path / "stats")
    assert history["sample_id"].unique().to_list() == [0]


SIGTERM = """
import os, signal, sys, time
import torch
from torch import nn
from torchinstruments_core import AlwaysSampler, inject_observer

if sys.argv[2] == "chained":
    def earlier(signum, frame):
        print("earlier handler ran", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, earlier)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
inject_observer(model, sampler=AlwaysSampler(), output_dir=sys.argv[1])
for _ in range(5):
    model(torch.randn(2, 4)).sum().backward()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
print("survived SIGTERM", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("previous", ["default", "chained"])
def test_sigterm_finalizes_the_run_then_does_what_it_did_before(
    tmp_path: pathlib.Path, previous: str
) -> None:
    """SIGTERM: every sample reaches history.parquet, then the process ends as it would have.

    That is, by the handler installed before the observer's, or by the default action.
    """
    done = _run(SIGTERM, str(tmp_path / "stats"), previous, timeout=120)
    if previous == "default":
        assert done.returncode == -signal.SIGTERM, done.stderr
    else:
        assert done.returncode == 3, done.stderr
        assert "earlier handler ran" in done.stdout
    assert "survived" not in done.stdout
    history = _complete_run(tmp_path / "stats")
    assert history["sample_id"].unique().sort().to_list() == [0, 1, 2, 3, 4]


FORK_DURING_A_HAND_OVER = """
import os, signal, threading, time
from torch import nn
from torchinstruments_core import _process, inject_observer
from torchinstruments_core.testing import RecordingSink
inject_observer(nn.Linear(2, 2), sink=RecordingSink())  # installs the SIGTERM handler
children = []

def fork():  # a thread forks while the main thread hands a sample over
    pid = os.fork()
    if pid == 0:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(20)  # a SIGTERM held off for a hand-over the child never finishes
        os._exit(7)
    children.append(pid)

with _process.handing_over():
    thread = threading.Thread(target=fork)
    thread.start()
    thread.join()
    _, status = os.waitpid(children[0], 0)
print("signal", os.WTERMSIG(status) if os.WIFSIGNALED(status) else None, flush=True)
"""


def test_a_child_forked_during_a_hand_over_on_another_thread_still_ends_on_sigterm() -> None:
    """A SIGTERM is held off only for a hand-over its process will finish.

    A child forked by another thread while the main thread hands a sample to its sink has none
    of the frames that would end that hand-over: its SIGTERM ends it at once.
    """
    done = _run(FORK_DURING_A_HAND_OVER, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"signal {int(signal.SIGTERM)}" in done.stdout, done.stdout


SIGTERM_WHILE_FINALIZING = """
import os, signal, sys, torch
from torch import nn
from torchinstruments_core import AlwaysSampler, inject_observer
from torchinstruments_core.run_directory import RunDirectorySink
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
observer = inject_observer(model, sampler=AlwaysSampler(), sink=RunDirectorySink(sys.argv[1]))
for _ in range(3):
    model(torch.randn(8, 4)).square().mean().backward()
close = RunDirectorySink.close

def interrupted(sink):  # the scheduler's SIGTERM as the run is being finalized
    os.kill(os.getpid(), signal.SIGTERM)
    signal.getsignal(signal.SIGTERM)  # a call: Python runs the handler here, at the latest
    close(sink)

RunDirectorySink.close = interrupted
observer.remove()
print("still running", flush=True)
"""


@pytest.mark.slow
def test_a_sigterm_while_a_run_is_finalized_ends_the_process_once_it_is_finalized(
    tmp_path: pathlib.Path,
) -> None:
    """SIGTERM during ``remove``: the run is finalized whole, then the process ends by SIGTERM."""
    done = _run(SIGTERM_WHILE_FINALIZING, str(tmp_path / "run"), timeout=120)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert "still running" not in done.stdout
    history = _complete_run(tmp_path / "run")
    assert history["sample_id"].unique().sort().to_list() == [0, 1, 2]


def test_concurrent_forwards_from_threads_are_separate_samples() -> None:
    """Two threads calling one observed model at once: each forward is its own complete sample.

    No row of one thread's forward lands in another's sample, and no sample is lost.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    inputs = {name: torch.full((8, 4), value) for name, value in (("a", 1.0), ("b", -2.0))}
    expected = {name: model[0](x).mean().item() for name, x in inputs.items()}
    sink = RecordingSink()
    rounds = 40
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def train(name: str) -> None:
        try:
            for _ in range(rounds):
                barrier.wait()
                model(inputs[name]).sum().backward()
        except BaseException as error:
            errors.append(error)
            barrier.abort()

    with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        threads = [threading.Thread(target=train, args=(name,)) for name in inputs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert not errors
    assert len(sink.samples) == 2 * rounds
    assert len({s.sample_id for s in sink.samples}) == 2 * rounds
    seen = {"a": 0, "b": 0}
    for sample in sink.samples:
        keys = [(r.layer, r.call_index, r.signal, r.tensor_path, r.metric) for r in sample.rows]
        assert len(keys) == len(set(keys)), "rows of two forwards merged into one sample"
        assert {r.call_index for r in sample.rows} == {0}
        assert not sample.forward_only
        mean = next(
            r.value for r in sample.rows if (r.layer, r.signal, r.metric) == ("0", "output", "mean")
        )
        name = min(expected, key=lambda n: abs(expected[n] - (mean or 0.0)))
        assert mean == pytest.approx(expected[name], rel=1e-6)
        seen[name] += 1
    assert seen == {"a": rounds, "b": rounds}


SIGTERM_IN_A_HOOK = """
import os, signal, sys, torch
from torch import nn
from torchinstruments_core import AlwaysSampler, _copy_buffers, _probe, inject_observer
from torchinstruments_core.run_directory import RunDirectorySink
where = sys.argv[2]
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
observer = inject_observer(
    model, sampler=AlwaysSampler(), sink=RunDirectorySink(sys.argv[1]), optimizer=optimizer
)

def step():
    model(torch.randn(8, 4)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()

for _ in range(2):
    step()
fired = []

def sigterm():  # the scheduler's SIGTERM, handled before the next call returns
    if not fired:
        fired.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
        signal.getsignal(signal.SIGTERM)

if where == "gradient hook":  # inside ``with sample.lock`` of a gradient hook
    queue_callback = _probe.queue_callback
    _probe.queue_callback = lambda callback: (sigterm(), queue_callback(callback))[1]
elif where == "copy buffers":  # inside ``with self._lock`` of CopyBuffers.lend
    free = _copy_buffers.CopyBuffers._free
    _copy_buffers.CopyBuffers._free = lambda self, *a: (sigterm(), free(self, *a))[1]
else:  # inside ``remove``, before the run's finalizing began
    detach = observer._samples.attachment.detach
    observer._samples.attachment.detach = lambda: (sigterm(), detach())[1]
    observer.remove()
step()
print("still running", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["gradient hook", "copy buffers", "remove"])
def test_a_sigterm_inside_the_observer_s_own_locks_ends_the_process_finalized(
    tmp_path: pathlib.Path, where: str
) -> None:
    """SIGTERM between two bytecodes of the observer's own code, holding its locks or removing.

    Python runs the handler on the main thread right there: in a gradient hook holding its
    sample's lock, in the optimizer's pre-hook lending a parameter's copy buffer (plain locks,
    which the handler's finalizing took again on the same thread: the process waited for
    itself until SIGKILL), or in ``remove`` before its finalizing began (the handler found
    the observer stopped and ended the process with the run unfinalized). Each time the run is
    finalized, then the process ends by SIGTERM.
    """
    done = _run(SIGTERM_IN_A_HOOK, str(tmp_path / "run"), where, timeout=120)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-2000:])
    assert "still running" not in done.stdout
    history = _complete_run(tmp_path / "run")
    assert history.height > 0
