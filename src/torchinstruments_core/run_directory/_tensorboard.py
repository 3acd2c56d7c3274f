"""TensorBoard event files for the focus layers: histograms and a few scalars.

Tags: ``histogram/<layer>/<signal>`` for the whole output of the first call; a call index other
than 0 adds ``/call_<k>`` and a tensor inside a nested output adds its path
(``histogram/encoder.0/output/output.1``). Scalars: ``scalar/<layer>/<signal>/rms`` and
``.../nonfinite_fraction`` for the same tensors, and ``telemetry/collection_duration_ms``. The step
is the trainer's step when there is one, else the sample id.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from torchinstruments_core._exceptions import MissingDependencyError

if TYPE_CHECKING:
    from pathlib import Path

    from torch.utils.tensorboard import SummaryWriter

    from torchinstruments_core._records import HistogramRecord, SampleRecord

_SCALARS = ("rms", "nonfinite_fraction")


def tensor_key(layer: str, call_index: int, signal: str, tensor_path: str) -> str:
    """``<layer>/<signal>`` plus ``/call_<k>`` and ``/<tensor_path>`` where they are not default."""
    key = f"{layer}/{signal}"
    if call_index:
        key += f"/call_{call_index}"
    if tensor_path != "output":
        key += f"/{tensor_path}"
    return key


class TensorBoardHistograms:
    """Writes each sample's histograms (and the focus layers' scalars) to an event file."""

    describes = "TensorBoard histograms"

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._writer: SummaryWriter | None = None

    def __call__(self, sample: SampleRecord) -> None:
        """Write the histograms and scalars of one sample."""
        writer = self._open()
        step = sample.step if sample.step is not None else sample.sample_id
        focus: set[str] = set()
        for histogram in sample.histograms:
            key = tensor_key(
                histogram.layer, histogram.call_index, histogram.signal, histogram.tensor_path
            )
            focus.add(key)
            _add_histogram(writer, "histogram/" + key, histogram, step)
        for row in sample.rows:
            if row.metric in _SCALARS and row.value is not None:
                key = tensor_key(row.layer, row.call_index, row.signal, row.tensor_path)
                if key in focus:
                    writer.add_scalar(f"scalar/{key}/{row.metric}", row.value, step)
        writer.add_scalar("telemetry/collection_duration_ms", sample.collection_duration_ms, step)

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _open(self) -> SummaryWriter:
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise MissingDependencyError(
                    "TensorBoard histograms need the tensorboard package: pip install tensorboard"
                ) from error
            self._writer = SummaryWriter(log_dir=str(self._folder))
        return self._writer


def _add_histogram(writer: SummaryWriter, tag: str, record: HistogramRecord, step: int) -> None:
    edges, counts = record.edges, record.counts
    centers = [(lo + hi) / 2 for lo, hi in itertools.pairwise(edges)]
    writer.add_histogram_raw(
        tag,
        min=edges[0],
        max=edges[-1],
        num=int(sum(counts)),
        # TensorBoard wants the sums for its summary; bin centres give them to within a bin.
        sum=sum(c * x for c, x in zip(counts, centers, strict=True)),
        sum_squares=sum(c * x * x for c, x in zip(counts, centers, strict=True)),
        bucket_limits=list(edges[1:]),
        bucket_counts=list(counts),
        global_step=step,
    )
