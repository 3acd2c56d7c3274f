"""watch(): a live view of a run still being written, naming findings as they appear."""

from __future__ import annotations

import io
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from analysis_helpers import model
from torchinstruments_analysis.read import open_run
from torchinstruments_analysis.watch import watch
from torchinstruments_core import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments_core.run_directory import RunDirectorySink

HEALTHY = 4


def _step(net: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(64, 16)
    loss = (net(x) - x.sum(dim=1, keepdim=True) / 8).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _wait_for_records(path: Path, count: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if open_run(path).samples.collect().height >= count:
                return
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"{count} records never reached {path}")


def _watch_while_a_fault_starts(tmp_path: Path, out: io.StringIO):
    """Watch a run twice while relu2's units die between the two refreshes.

    Four healthy samples are on disk; during the first refresh interval fc2's bias drops by
    100 and two more samples are written, so the second refresh sees the dead units.
    """
    torch.manual_seed(0)
    net = model(("relu2", nn.ReLU()))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    path = tmp_path / "run"
    sink = RunDirectorySink(path, chunk_rows=1, flush_seconds=0.05, tensorboard=False)
    inject_observer(net, sampler=EveryNForwardsSampler(1), sink=sink)
    try:
        for _ in range(HEALTHY):
            _step(net, optimizer)
        _wait_for_records(path, HEALTHY)

        def break_it() -> None:
            time.sleep(0.2)
            with torch.no_grad():
                net.get_submodule("fc2").bias.sub_(100.0)  # type: ignore[operator]
            for _ in range(2):
                _step(net, optimizer)
            _wait_for_records(path, HEALTHY + 2)

        thread = threading.Thread(target=break_it)
        thread.start()
        try:
            found = watch(path, interval=2.5, iterations=2, file=out)
        finally:
            thread.join()
        assert not open_run(path).complete  # read while still being written
    finally:
        remove_observer(net)
    return found


def test_watch_names_a_finding_when_it_appears(tmp_path) -> None:
    """With rich: the second refresh prints the new dead-units finding once, above the view."""
    pytest.importorskip("rich")
    out = io.StringIO()
    found = _watch_while_a_fault_starts(tmp_path, out)
    assert found is not None
    assert ("dead_units", "relu2") in found.select("rule", "layer").rows()
    text = out.getvalue()
    assert text.count("new: [dead_units]") == 1
    assert "running" in text


def test_watch_without_rich_prints_plain_lines(tmp_path, monkeypatch) -> None:
    """Without rich: one status line per refresh (no finding, then the new one) in order."""
    monkeypatch.setitem(sys.modules, "rich.live", None)
    out = io.StringIO()
    _watch_while_a_fault_starts(tmp_path, out)
    lines = out.getvalue().splitlines()
    status = [line for line in lines if line.startswith("[")]
    assert len(status) == 2
    assert f"running, {HEALTHY} records" in status[0]
    assert status[0].endswith(", 0 findings")
    assert f"running, {HEALTHY + 2} records" in status[1]
    new = [line for line in lines if "new: [dead_units]" in line]
    assert len(new) == 1
    assert lines.index(new[0]) > lines.index(status[1])


def test_watch_waits_for_a_run_without_chunks(tmp_path) -> None:
    """A folder with no chunk yet is shown as waiting, and watch returns no findings."""
    out = io.StringIO()
    assert watch(tmp_path / "not_yet", interval=0.01, iterations=1, file=out) is None
    assert "waiting for the first chunk" in " ".join(out.getvalue().split())


@pytest.mark.parametrize(("interval", "iterations"), [(0.0, 1), (1.0, 0)])
def test_watch_refuses_bad_arguments(tmp_path, interval, iterations) -> None:
    """A non-positive interval or fewer than one iteration fails at once, naming it."""
    with pytest.raises(ValueError, match=r"^(interval|iterations)="):
        watch(tmp_path, interval=interval, iterations=iterations)
