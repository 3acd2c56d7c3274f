"""Hygiene for every test: environment restored, no process group left, no thread leaked."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """Tests that set RANK, WORLD_SIZE or MASTER_PORT must not leak them into the next test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _destroy_process_group() -> Iterator[None]:
    """A test that initialized torch.distributed leaves no process group behind."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    """Every non-daemon thread a test starts has ended by the time it returns."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
    assert not leaked, f"threads leaked by the test: {leaked}"


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Each test sees the same random numbers, whatever ran before it."""
    torch.manual_seed(0)


@pytest.fixture
def without_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU reductions go through numpy and torch, as in a build without the C extension.

    ``reducers/_native.py`` reads ``KERNELS`` at every call, and a ``Measurer`` plans its fused
    path when it is made: so this holds for everything the test makes after it starts.
    """
    from torchinstruments_core.reducers import _native

    monkeypatch.setattr(_native, "KERNELS", None)


@pytest.fixture(params=["kernels", "numpy"])
def reduction_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test once with the compiled CPU kernels and once through numpy and torch.

    A module opts in with ``pytestmark = pytest.mark.usefixtures("reduction_path")``; the
    kernels' run is skipped where the extension was not built.
    """
    from torchinstruments_core.reducers import _native

    if request.param == "numpy":
        monkeypatch.setattr(_native, "KERNELS", None)
    elif _native.KERNELS is None:  # not built, or switched off by ``without_kernels``
        pytest.skip("runs without the compiled kernels only")
    return str(request.param)
