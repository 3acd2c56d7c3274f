"""Where a run's files go, and the rule that a new run never mixes into an old one.

Rule: a run directory holds exactly one run, and a run never writes over a file it did not
create. ``output_dir`` is refused (``RunDirectoryExistsError``) when it already holds any name a
run writes (``result.json``, ``history.parquet``, ``samples.parquet``, ``history.parts``,
``index.md``, ``tensorboard``), as a file, a folder or a link (even a dangling one: a run never
follows a link inside its folder), or a ``rank-NNN`` folder. Under ``rank_policy="all"`` each
rank writes ``output_dir/rank-NNN/`` and a rank refuses a folder that exists already.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torchinstruments_core._exceptions import ConfigurationError, RunDirectoryExistsError
from torchinstruments_core.run_directory._atomic import open_temporary

if TYPE_CHECKING:
    from typing import Any

logger = logging.getLogger(__name__)

RUN_FILES = (
    "result.json",
    "history.parquet",
    "history.parts",
    "samples.parquet",
    "index.md",
    "tensorboard",
)
REPAIR_COMMAND = "python -m torchinstruments_core.run_directory repair"


@dataclass(frozen=True, slots=True)
class RunLayout:
    """The paths of one run (one rank's run under ``rank_policy="all"``)."""

    root: Path

    @property
    def parts(self) -> Path:
        """Folder of the immutable history chunks written during the run."""
        return self.root / "history.parts"

    @property
    def history(self) -> Path:
        """The compacted long table."""
        return self.root / "history.parquet"

    @property
    def samples(self) -> Path:
        """One row per sample: step, timestamp, forward_only, collection_duration_ms, rows."""
        return self.root / "samples.parquet"

    @property
    def result(self) -> Path:
        """Aggregates per layer, call, signal, tensor and metric."""
        return self.root / "result.json"

    @property
    def index(self) -> Path:
        """The human- and LLM-readable guide to the run."""
        return self.root / "index.md"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files of the focus layers."""
        return self.root / "tensorboard"

    def part(self, table: str, number: int) -> Path:
        """Path of chunk ``number`` of ``table`` (``history`` or ``samples``)."""
        return self.parts / f"{table}-{number:06d}.parquet"


def existing_run(folder: Path, *, rank_folders: bool = True) -> Path | None:
    """The first name in ``folder`` that a run would write, if any (file, folder or link).

    ``rank_folders=False`` leaves out the ``rank-NNN`` folders of a run whose every rank writes.
    """
    if not folder.is_dir():
        return None
    for name in RUN_FILES:
        if os.path.lexists(folder / name):
            return folder / name
    if not rank_folders:
        return None
    return next(iter(sorted(folder.glob("rank-[0-9][0-9][0-9]*"))), None)


def _distributed() -> bool:
    """Whether this process belongs to an initialized ``torch.distributed`` group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def next_free_folder(folder: Path) -> Path:
    """``folder`` if it holds no run, else the first ``<folder>-resumed-<k>`` that holds none.

    A folder passed over that holds an unfinished run (killed, or interrupted while finalizing)
    is logged with the command that completes it.
    """
    candidate, k = folder, 1
    while existing_run(candidate) is not None:
        if unfinished(candidate):
            logger.warning(
                "torchinstruments: %s holds an unfinished run; complete it with: %s %s",
                candidate,
                REPAIR_COMMAND,
                candidate,
            )
        candidate = folder.with_name(f"{folder.name}-resumed-{k}")
        k += 1
    return candidate


def refuse_existing(folder: Path, *, rank_folders: bool = True) -> None:
    """Raise ``RunDirectoryExistsError`` when ``folder`` holds a run or a name a run writes.

    ``rank_folders=False``: ``rank-NNN`` folders are not looked at (see ``existing_run``).
    """
    found = existing_run(folder, rank_folders=rank_folders)
    if found is None:
        return
    if found.is_symlink():
        what = f"{found.name} is a symbolic link; a run never follows a link inside its folder"
    elif found.name in ("index.md", "tensorboard") and existing_run_data(folder) is None:
        what = f"it holds {found.name}, which a run would overwrite"
    else:
        what = f"it already holds a run ({found.name} exists)"
        if unfinished(folder):
            what += f"; the run is unfinished: complete it with `{REPAIR_COMMAND} {folder}`"
    raise RunDirectoryExistsError(
        f"output_dir {str(folder)!r} cannot take a new run: {what}. A new run never overwrites "
        "or mixes into an old one: pass a new output_dir or move the old files"
    )


def existing_run_data(folder: Path) -> Path | None:
    """The first of a run's data files or folders in ``folder``, if any."""
    for name in ("result.json", "history.parquet", "history.parts", "samples.parquet"):
        if os.path.lexists(folder / name):
            return folder / name
    return None


def unfinished(folder: Path) -> bool:
    """Whether ``folder`` holds a run that was not finalized or whose finalizing was cut short."""
    from torchinstruments_core.run_directory._state import inspect_run

    try:
        return inspect_run(folder).needs_repair
    except (OSError, ValueError):
        return False


def prepare_output_dir(output_dir: Any) -> Path:
    """Check ``output_dir`` at injection and return it as an absolute path, created.

    Absolute, so a later ``os.chdir`` does not move the run; created and probed with a temporary
    file now, so a folder that cannot be created or written fails before training starts.

    Raises:
        ConfigurationError: ``output_dir`` is empty, not a path, a file, or cannot be created
            or written.
        RunDirectoryExistsError: It already holds a run, or a name a run writes.
    """
    try:
        text = os.fspath(output_dir)
    except TypeError:
        raise ConfigurationError.invalid("output_dir", output_dir, "a folder path") from None
    if not isinstance(text, str) or not text:
        raise ConfigurationError.invalid("output_dir", output_dir, "a non-empty folder path")
    folder = Path(os.path.abspath(text))
    if os.path.lexists(folder) and not folder.is_dir():
        raise ConfigurationError.invalid("output_dir", output_dir, "a folder, not a file")
    # Under torch.distributed the other ranks of this very run may have made their rank-NNN
    # folders already (rank_policy="all"); each rank refuses its own when it opens it.
    refuse_existing(folder, rank_folders=not _distributed())
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, probe = open_temporary(folder / "result.json")
        handle.close()
        probe.unlink()
    except OSError as error:
        raise ConfigurationError(
            f"output_dir={output_dir!r} cannot be created or written: "
            f"{type(error).__name__}: {error}"
        ) from error
    return folder


def layout_for(output_dir: Path, *, rank: int, per_rank: bool) -> RunLayout:
    """Create and return this process's run folder, refusing one that holds a run."""
    root = output_dir / f"rank-{rank:03d}" if per_rank else output_dir
    if per_rank:  # the parent may hold the other ranks' folders of this run, never a run's files
        refuse_existing(output_dir, rank_folders=False)
    refuse_existing(root)
    if per_rank and os.path.lexists(root):
        raise RunDirectoryExistsError(
            f"{str(root)!r} exists already; two processes have rank {rank}"
        )
    root.mkdir(parents=True, exist_ok=not per_rank)
    layout = RunLayout(root)
    try:
        layout.parts.mkdir()  # exclusive: of two processes opening one folder, one gets it
    except FileExistsError:
        raise RunDirectoryExistsError(
            f"output_dir {str(root)!r} was taken by another process between injection and the "
            "first sample"
        ) from None
    return layout
