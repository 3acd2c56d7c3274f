"""A TensorBoard event file written by the calling thread, checksummed with numpy.

``torch.utils.tensorboard.SummaryWriter`` queues each serialized event for TensorBoard's writer
thread, which checksums it in a Python loop over its bytes (see ``_crc32c``): for a sample of
the CNN workload (16 histograms of 64 bins, 48 scalars) about 6 ms of CPU that holds the GIL
the training thread needs, while the run directory's writer thread waits on that thread's
ten-event queue. ``EventFile`` writes the same values itself, on the run directory's writer
thread, which is already off the training thread: the ``Summary.Value`` protos of torch's own
builders, in TensorBoard's framing (the length, its masked CRC-32C, the event, its masked
CRC-32C), in a file named as TensorBoard names its files. Where ``SummaryWriter`` makes an
event of every value, the values added one after another at the same step share one event,
as TensorFlow's merged summaries do (TensorBoard reads each value of an event alike): a
sample's scalars and histograms are one ``Summary`` and one ``Event`` with one checksum
instead of about sixty of each. The events wait for ``flush``, which checksums them together
and writes them in one call. The first event names this module as the writer. ``EventFile``
offers the part of ``SummaryWriter`` that ``routing.SummaryWriterTarget`` calls.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from torchinstruments_core.run_directory._crc32c import masked_crc32cs

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

_FILE_NUMBERS = itertools.count()
"""Tells apart the files one process opens in the same second, as TensorBoard's own counter."""


@lru_cache(maxsize=4096)
def _header(length: int) -> bytes:
    """A record's first 12 bytes: its length, and the masked CRC-32C of that (few lengths recur)."""
    encoded = struct.pack("<Q", length)
    return encoded + struct.pack("<I", masked_crc32cs([encoded])[0])


class EventFile:
    """Scalars, raw histograms and text into a new TensorBoard event file in ``folder``.

    Args:
        folder: Where the file goes; created if missing.

    Raises:
        ImportError: If tensorboard is not installed.
    """

    def __init__(self, folder: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
        from tensorboard.plugins.text import plugin_data_pb2

        self._event = event_pb2.Event
        self._proto = summary_pb2
        self._tensor = tensor_pb2.TensorProto
        self._shape = tensor_shape_pb2.TensorShapeProto
        self._text = plugin_data_pb2.TextPluginData
        folder.mkdir(parents=True, exist_ok=True)
        name = "events.out.tfevents.%010d.%s.%s.%s" % (  # noqa: UP031  TensorBoard's pattern
            time.time(),
            socket.gethostname(),
            os.getpid(),
            next(_FILE_NUMBERS),
        )
        self._file = (folder / name).open("wb")
        self._pending: list[bytes] = []
        self._values: list[Any] = []  # the values of the event still open, at ``_step``
        self._step = 0
        self._wall_time = 0.0
        source = event_pb2.SourceMetadata(writer=__name__)
        self._append(
            self._event(wall_time=time.time(), file_version="brain.Event:2", source_metadata=source)
        )
        self.flush()

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        """Write ``scalar_value`` under ``tag`` at ``global_step``, as ``SummaryWriter`` does.

        The proto of torch's ``summary.scalar`` built directly: that one first makes the value a
        numpy array, which took a third of a sample's TensorBoard time.
        """
        value = self._proto.Summary.Value(tag=tag, simple_value=float(scalar_value))
        self._add([value], global_step)

    def add_histogram_raw(
        self,
        tag: str,
        min: float,
        max: float,
        num: int,
        sum: float,
        sum_squares: float,
        bucket_limits: Sequence[float],
        bucket_counts: Sequence[float],
        global_step: int,
    ) -> None:
        """Write a histogram given by its buckets, as ``SummaryWriter.add_histogram_raw`` does."""
        histogram = self._proto.HistogramProto(
            min=min,
            max=max,
            num=num,
            sum=sum,
            sum_squares=sum_squares,
            bucket_limit=bucket_limits,
            bucket=bucket_counts,
        )
        self._add([self._proto.Summary.Value(tag=tag, histo=histogram)], global_step)

    def add_text(self, tag: str, text_string: str, global_step: int) -> None:
        """Write ``text_string`` under ``tag`` at ``global_step``, as ``SummaryWriter`` does.

        The tag gets ``SummaryWriter``'s ``/text_summary`` suffix; the value is a string tensor of
        one entry, marked for the text plugin.
        """
        plugin = self._proto.SummaryMetadata.PluginData(
            plugin_name="text", content=self._text(version=0).SerializeToString()
        )
        tensor = self._tensor(
            dtype="DT_STRING",
            string_val=[text_string.encode("utf-8")],
            tensor_shape=self._shape(dim=[self._shape.Dim(size=1)]),
        )
        value = self._proto.Summary.Value(
            tag=tag + "/text_summary",
            metadata=self._proto.SummaryMetadata(plugin_data=plugin),
            tensor=tensor,
        )
        self._add([value], global_step)

    def flush(self) -> None:
        """Write the events added since the last flush, for TensorBoard to read."""
        self._close_event()
        events, self._pending = self._pending, []
        if not events:
            return
        crcs = [struct.pack("<I", crc) for crc in masked_crc32cs(events)]
        headers = [_header(len(event)) for event in events]
        records = zip(headers, events, crcs, strict=True)
        self._file.write(b"".join(part for record in records for part in record))
        self._file.flush()

    def close(self) -> None:
        """Flush and close the file; closing again does nothing."""
        if not self._file.closed:
            self.flush()
            self._file.close()

    def _add(self, values: Sequence[Any], step: int) -> None:
        """Add ``values`` (``Summary.Value`` protos) to the open event, or to a new one at ``step``.

        The values of one step share an event until another step's arrive or ``flush`` runs.
        """
        step = int(step)
        if self._values and step != self._step:
            self._close_event()
        if not self._values:
            self._step, self._wall_time = step, time.time()
        self._values.extend(values)

    def _close_event(self) -> None:
        """Serialize the open event, if any, for the next ``flush``."""
        if self._values:
            summary = self._proto.Summary(value=self._values)
            self._values = []
            self._append(self._event(summary=summary, wall_time=self._wall_time, step=self._step))

    def _append(self, event: Any) -> None:
        self._pending.append(event.SerializeToString())
