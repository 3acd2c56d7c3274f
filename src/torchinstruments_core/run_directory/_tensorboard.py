"""TensorBoard event files for the focus layers: histograms and a few scalars.

Tags are those ``LoggerRouter`` gives a trainer's TensorBoard logger, with prefix ``telemetry``,
so the same data has the same name wherever it is written:
``telemetry/<layer>/<signal>/histogram`` (a call other than the first adds ``/call_<k>`` after
the signal, a tensor inside a nested output its path: ``telemetry/encoder.0/output/output.1/
histogram``); scalars ``telemetry/<layer>/<signal>/<metric>`` for ``DEFAULT_SCALAR_METRICS``
(``rms``, ``max_abs``, ``nonfinite_fraction``) of the focus layers, ``telemetry/nonfinite_tensors``
and ``telemetry/collection_duration_ms``. The step is the trainer's step when there is one, else
the sample id. A step record's rows follow the same rules (``telemetry/<layer>/parameter/weight/
rms``); its summaries are ``telemetry/step/nonfinite_tensors`` and ``…/collection_duration_ms``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchinstruments_core._exceptions import MissingDependencyError
from torchinstruments_core._signals import routed_by_default
from torchinstruments_core.routing import DEFAULT_SCALAR_METRICS, SummaryWriterTarget, tensor_key
from torchinstruments_core.routing.base import summary_scalars

if TYPE_CHECKING:
    from pathlib import Path

    from torchinstruments_core._records import HistogramRecord, SampleRecord, StatRow

PREFIX = "telemetry"


class TensorBoardHistograms:
    """Writes each sample's histograms (and the focus layers' scalars) to an event file."""

    describes = "TensorBoard histograms"

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._target: SummaryWriterTarget | None = None

    def __call__(self, sample: SampleRecord) -> None:
        """Write the histograms and scalars of one sample."""
        signals = routed_by_default()
        histograms = {
            f"{PREFIX}/{_key(h)}/histogram": h for h in sample.histograms if h.signal in signals
        }
        focus = {h.layer for h in sample.histograms}
        scalars = {
            f"{PREFIX}/{_key(row)}/{row.metric}": row.value
            for row in sample.rows
            if row.layer in focus
            and row.metric in DEFAULT_SCALAR_METRICS
            and row.value is not None
            and row.signal in signals
        }
        scalars |= summary_scalars(sample, PREFIX)
        step = sample.step if sample.step is not None else sample.sample_id
        self._open().log(scalars, histograms, step)

    def close(self) -> None:
        """Flush and close the event file."""
        if self._target is not None:
            self._target.writer.close()
            self._target = None

    def _open(self) -> SummaryWriterTarget:
        if self._target is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise MissingDependencyError(
                    "TensorBoard histograms need the tensorboard package: pip install tensorboard"
                ) from error
            self._target = SummaryWriterTarget(SummaryWriter(log_dir=str(self._folder)))
        return self._target


def _key(item: StatRow | HistogramRecord) -> str:
    return tensor_key(item.layer, item.call_index, item.signal, item.tensor_path)
