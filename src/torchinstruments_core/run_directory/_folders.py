"""Which folder an adapter's run goes to: named after its run, ``-resumed-<k>`` only if resumed.

A fresh run never takes a name that says "resumed": ``<parent>/<name>`` when free, else
``<parent>/<name>-<run_id>``. Only a run restored from a checkpoint of an earlier one takes the
first free ``<parent>/<name>-resumed-<k>``, beside that run's folder. An adapter chooses on rank 0
and broadcasts the result, so every rank writes under the same folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchinstruments_core.run_directory._layout import existing_run

if TYPE_CHECKING:
    from pathlib import Path


@dataclass(frozen=True, slots=True)
class RunFolder:
    """A run's folder and the name its resumed runs are named after (kept in the checkpoint)."""

    path: Path
    name: str


def fresh_folder(parent: Path, name: str, run_id: str) -> RunFolder:
    """``parent/name``, or ``parent/<name>-<run_id>`` when another run already holds it."""
    path = parent / name
    if existing_run(path) is not None:
        path = parent / f"{name}-{run_id}"
    return RunFolder(path, path.name)


def resumed_folder(parent: Path, name: str) -> RunFolder:
    """The first ``parent/<name>-resumed-<k>`` (k = 1, 2 …) that holds no run."""
    k = 1
    while existing_run(parent / f"{name}-resumed-{k}") is not None:
        k += 1
    return RunFolder(parent / f"{name}-resumed-{k}", name)


def safe_name(version: object) -> str | None:
    """A logger's version as one folder name: ``3`` gives ``version_3``; ``None`` or ``""`` none."""
    if version is None or version == "":
        return None
    if isinstance(version, int):
        return f"version_{version}"
    return str(version).replace("/", "_").replace("\\", "_")
