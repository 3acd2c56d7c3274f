"""TensorBoard event files for the focus layers: histograms and a few scalars.

Tags: ``histogram/<layer>/<signal>`` (a call other than the first adds ``/call_<k>``, a tensor
inside a nested output its path: ``histogram/encoder.0/output/output.1``); scalars
``scalar/<layer>/<signal>/rms`` and ``.../nonfinite_fraction`` for the same tensors, and
``telemetry/collection_duration_ms``. The step is the trainer's step when there is one, else the
sample id.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchinstruments_core._exceptions import MissingDependencyError
from torchinstruments_core.routing import SummaryWriterTarget, tensor_key

if TYPE_CHECKING:
    from pathlib import Path

    from torchinstruments_core._records import HistogramRecord, SampleRecord

_SCALARS = ("rms", "nonfinite_fraction")


class TensorBoardHistograms:
    """Writes each sample's histograms (and the focus layers' scalars) to an event file."""

    describes = "TensorBoard histograms"

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._target: SummaryWriterTarget | None = None

    def __call__(self, sample: SampleRecord) -> None:
        """Write the histograms and scalars of one sample."""
        histograms = {"histogram/" + _key(h): h for h in sample.histograms}
        focus = {_key(h) for h in sample.histograms}
        scalars = {"telemetry/collection_duration_ms": sample.collection_duration_ms}
        for row in sample.rows:
            key = tensor_key(row.layer, row.call_index, row.signal, row.tensor_path)
            if row.metric in _SCALARS and row.value is not None and key in focus:
                scalars[f"scalar/{key}/{row.metric}"] = row.value
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


def _key(record: HistogramRecord) -> str:
    return tensor_key(record.layer, record.call_index, record.signal, record.tensor_path)
