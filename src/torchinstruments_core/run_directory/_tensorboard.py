"""TensorBoard event files for the focus layers: histograms and a few scalars.

The tags are those ``LoggerRouter`` gives a trainer's TensorBoard logger with its defaults (it
writes them: prefix ``telemetry``, the focus layers), so the same data has the same name
wherever it is written: ``telemetry/<layer>/<signal>/histogram`` (a call other than the first
adds ``/call_<k>`` after the signal, a tensor inside a nested output its path:
``telemetry/encoder.0/output/output.1/histogram``); scalars ``telemetry/<layer>/<signal>/<metric>``
for ``DEFAULT_SCALAR_METRICS`` (``rms``, ``max_abs``, ``nonfinite_fraction``) of the focus
layers, ``telemetry/nonfinite_tensors`` and ``telemetry/collection_duration_ms``. A step record's
rows name the parameter, with the metrics their signal's definition routes
(``telemetry/<layer>/parameter_gradient/weight/rms``,
``telemetry/<layer>/update/weight/update_to_weight``), its whole-model rows are
``telemetry/model/<signal>/<metric>`` (``telemetry/model/parameter_gradient/l2_norm``), its
summaries ``telemetry/step/nonfinite_tensors`` and ``…/collection_duration_ms``. The step is the
trainer's step when there is one, else the sample id.

The file is an ``_event_file.EventFile``: the values a ``SummaryWriter`` would write, one event
per step instead of one per value, written and flushed by the run directory's writer thread at
each sample, without TensorBoard's writer thread and its byte-by-byte checksum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchinstruments_core._exceptions import MissingDependencyError
from torchinstruments_core.routing import LoggerRouter, SummaryWriterTarget
from torchinstruments_core.run_directory._event_file import EventFile

if TYPE_CHECKING:
    from pathlib import Path

    from torchinstruments_core._records import RunInfo, SampleRecord

PREFIX = "telemetry"


class TensorBoardHistograms:
    """Writes each sample's histograms (and the focus layers' scalars) to an event file.

    Args:
        folder: Where the event file goes (created at the first sample).
        run: The run, whose focus layers have their scalars written.
    """

    describes = "TensorBoard histograms"

    def __init__(self, folder: Path, run: RunInfo) -> None:
        self._folder = folder
        self._target: SummaryWriterTarget | None = None
        self._router = LoggerRouter(lambda: (self._open(),), prefix=PREFIX)
        self._router.open(run)

    def __call__(self, sample: SampleRecord) -> None:
        """Write the histograms and scalars of one sample, and flush them to the file."""
        self._router.write(sample)
        if self._target is not None:
            self._target.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._target is not None:
            self._target.writer.close()
            self._target = None

    def _open(self) -> SummaryWriterTarget:
        if self._target is None:
            try:
                events = EventFile(self._folder)
            except ImportError as error:
                raise MissingDependencyError(
                    "TensorBoard histograms need the tensorboard package: pip install tensorboard"
                ) from error
            self._target = SummaryWriterTarget(events)
        return self._target
