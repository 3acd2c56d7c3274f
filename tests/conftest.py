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
