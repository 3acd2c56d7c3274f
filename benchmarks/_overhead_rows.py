"""The rows of ``overhead.py``: one instrumentation configuration each, attached the same way.

An ``Instrument`` is attached to a built workload, told when a step begins and ends (that is where
a trainer adapter would call ``begin_step``/``end_step`` or ``wandb.log``), and torn down at the
end; ``output_bytes`` then counts what it wrote.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from torch import nn


@dataclass(frozen=True, slots=True)
class Row:
    """One configuration of a workload: which tool, how often it samples, where it writes."""

    key: str
    label: str
    tool: str  # "none", "ours", "pypi", "wandb"
    every: int | None = None  # sample every n-th step; None: never (ours) or not applicable
    sink: str = "run_directory"  # ours only: "run_directory" or "recording"


ROWS: tuple[Row, ...] = (
    Row("baseline", "uninstrumented", "none"),
    Row("ours-unsampled", "ours, unsampled steps (begin_step sample=False)", "ours", None),
    Row("ours-every-recording", "ours, every step, RecordingSink", "ours", 1, "recording"),
    Row("ours-every-rundir", "ours, every step, run directory", "ours", 1),
    Row("ours-every10-rundir", "ours, every 10 steps, run directory", "ours", 10),
    Row("pypi-every", "PyPI torchinstruments 0.10.2, every step", "pypi", 1),
    Row("pypi-every10", "PyPI torchinstruments 0.10.2, every 10 forwards", "pypi", 10),
    Row("wandb-log-only", "wandb.log(loss) only, no watch (reference)", "wandb", None),
    Row("wandb-watch-1", 'wandb.watch(log="all", log_freq=1)', "wandb", 1),
    Row("wandb-watch-10", 'wandb.watch(log="all", log_freq=10)', "wandb", 10),
)


class Instrument(Protocol):
    """What the timing loop needs from a row's instrumentation."""

    def attach(self, model: nn.Module, folder: Path) -> None: ...
    def begin(self, step: int) -> None: ...
    def end(self, step: int, loss: torch.Tensor) -> None: ...
    def sampled(self, step: int) -> bool | None: ...
    def teardown(self) -> None: ...
    def output_note(self) -> str: ...


class NoInstrument:
    """The uninstrumented baseline."""

    def attach(self, model: nn.Module, folder: Path) -> None:
        pass

    def begin(self, step: int) -> None:
        pass

    def end(self, step: int, loss: torch.Tensor) -> None:
        pass

    def sampled(self, step: int) -> bool | None:
        return False

    def teardown(self) -> None:
        pass

    def output_note(self) -> str:
        return ""


class OursInstrument:
    """torchinstruments_core, driven by step the way the trainer adapters drive it."""

    def __init__(self, every: int | None, sink: str) -> None:
        self._every = every
        self._sink_kind = sink
        self._observer: Any = None
        self._recording: Any = None

    def attach(self, model: nn.Module, folder: Path) -> None:
        from torchinstruments_core import inject_observer
        from torchinstruments_core.testing import RecordingSink

        if self._sink_kind == "recording":
            self._recording = RecordingSink()
            self._observer = inject_observer(model, sink=self._recording)
        else:
            self._observer = inject_observer(model, output_dir=folder / "run")

    def begin(self, step: int) -> None:
        self._observer.begin_step(step, sample=bool(self.sampled(step)))

    def end(self, step: int, loss: torch.Tensor) -> None:
        self._observer.end_step()

    def sampled(self, step: int) -> bool | None:
        return self._every is not None and step % self._every == 0

    def teardown(self) -> None:
        self._observer.remove()

    def output_note(self) -> str:
        if self._recording is None:
            return ""
        samples = self._recording.samples
        rows = sum(len(s.rows) for s in samples)
        return f"in memory: {len(samples)} samples, {rows:,} rows"


class PyPIInstrument:
    """PyPI ``torchinstruments`` 0.10.2 through its public API, configured like ours.

    Leaf modules (its default is every module, the root included) and 8 histogram modules (its
    default is all of them), so that it observes what ours observes.
    """

    def __init__(self, every: int) -> None:
        self._every = every
        self._model: nn.Module | None = None

    def attach(self, model: nn.Module, folder: Path) -> None:
        import torchinstruments as ti

        sampler = ti.AlwaysSampler() if self._every == 1 else ti.EveryNForwardsSampler(self._every)
        ti.inject_observer(
            model,
            sampler=sampler,
            selector=ti.leaf_modules(),
            max_focus_layers=8,
            output_dir=folder / "stats",
        )
        self._model = model

    def begin(self, step: int) -> None:
        pass

    def end(self, step: int, loss: torch.Tensor) -> None:
        pass

    def sampled(self, step: int) -> bool | None:
        # Its EveryNForwardsSampler takes the n-th, 2n-th ... root forward (1-based).
        return (step + 1) % self._every == 0

    def teardown(self) -> None:
        import torchinstruments as ti

        ti.remove_observer(self._model)

    def output_note(self) -> str:
        return ""


class WandbInstrument:
    """``wandb.watch(model, log="all", log_freq=n)`` in an offline run, the loss logged each step."""

    def __init__(self, log_freq: int | None) -> None:
        self._log_freq = log_freq
        self._run: Any = None

    def attach(self, model: nn.Module, folder: Path) -> None:
        os.environ["WANDB_SILENT"] = "true"
        import wandb

        self._run = wandb.init(mode="offline", dir=folder, project="overhead-benchmark")
        if self._log_freq is not None:
            self._run.watch(model, log="all", log_freq=self._log_freq)

    def begin(self, step: int) -> None:
        pass

    def end(self, step: int, loss: torch.Tensor) -> None:
        # watch only writes its histograms with a logged step, so a training loop logs its loss.
        self._run.log({"loss": loss.item()})

    def sampled(self, step: int) -> bool | None:
        return None  # wandb counts its own hook calls; which step logs is not ours to say

    def teardown(self) -> None:
        import wandb

        self._run.finish()
        wandb.teardown()

    def output_note(self) -> str:
        return ""


def make_instrument(row: Row) -> Instrument:
    """The instrumentation of ``row``, not yet attached."""
    if row.tool == "ours":
        return OursInstrument(row.every, row.sink)
    if row.tool == "pypi":
        return PyPIInstrument(row.every or 1)
    if row.tool == "wandb":
        return WandbInstrument(row.every)
    return NoInstrument()


def rows_by_key() -> dict[str, Row]:
    """Every row, by its key."""
    return {row.key: row for row in ROWS}
