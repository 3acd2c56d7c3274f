"""The run directory's TensorBoard event file: SummaryWriter's records, its own checksum."""

from __future__ import annotations

import itertools
import pathlib
from typing import Any

import numpy as np
import pytest

from torchinstruments_core._records import HistogramRecord
from torchinstruments_core._signals import Signal
from torchinstruments_core.routing import SummaryWriterTarget
from torchinstruments_core.run_directory._crc32c import crc32cs, masked_crc32cs
from torchinstruments_core.run_directory._event_file import EventFile


def _messages() -> list[bytes]:
    rng = np.random.default_rng(5)
    lengths = [*range(700), 1024, 1131, 5000, 70_000]
    return [rng.integers(0, 256, length, dtype=np.uint8).tobytes() for length in lengths]


@pytest.mark.usefixtures("reduction_path")
def test_crc32c_is_tensorboards_at_every_length() -> None:
    """Masked CRC-32C equals TensorBoard's byte loop, for messages of 0 to 70,000 bytes.

    In C (the compiled kernels) and in numpy, computed together (blocks of 256 bytes, messages
    padded in front) and one at a time; the unmasked value of the standard check string is the
    standard one.
    """
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    messages = _messages()
    expected = [masked_crc32c(message) for message in messages]
    assert masked_crc32cs(messages) == expected
    assert [masked_crc32cs([message])[0] for message in messages[::13]] == expected[::13]
    assert crc32cs([b"123456789"]) == [0xE3069283]


def _histogram(seed: int, bins: int) -> HistogramRecord:
    rng = np.random.default_rng(seed)
    edges = np.sort(rng.standard_normal(bins + 1))
    counts = rng.integers(0, 1000, bins).astype(float)
    edge_values, count_values = tuple(edges.tolist()), tuple(counts.tolist())
    return HistogramRecord("layer", 0, Signal.OUTPUT, "", edge_values, count_values, 0)


def _write(writer: Any) -> None:
    """Three steps of scalars, histograms (64 and 1,000 bins) and a text through the target."""
    target = SummaryWriterTarget(writer)
    for step in range(3):
        scalars = {"telemetry/a/output/rms": 0.5 + step, "telemetry/nonfinite_tensors": 2}
        histograms = {
            "telemetry/a/output/histogram": _histogram(step, 64),
            "telemetry/b/output/histogram": _histogram(step + 10, 1000),
        }
        target.log(scalars, histograms, step * 10)
        writer.flush()
    target.log_text("telemetry/events", "a <b>non-finite</b> onset", 20)
    writer.close()


def _events(folder: pathlib.Path) -> list[Any]:
    """The events of the folder's one file as written, read by TensorBoard (checking each CRC)."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    (path,) = folder.glob("events.out.tfevents.*")
    events = [Event.FromString(record) for record in RawEventFileLoader(str(path)).Load()]
    for event in events:
        event.wall_time = 0
    return events


def test_event_file_holds_the_values_summary_writer_writes(tmp_path: pathlib.Path) -> None:
    """Through ``SummaryWriterTarget``, an EventFile and a SummaryWriter write the same values.

    Scalars, histograms and text, at the same steps and in the same order, byte for byte; the
    values added at one step share one event (the target gives torch's ``SummaryWriter`` a
    call's values as one event too). The first event is the file version, naming this module
    as the writer. The file is named like TensorBoard's.
    """
    from torch.utils.tensorboard import SummaryWriter

    _write(EventFile(tmp_path / "ours"))
    _write(SummaryWriter(log_dir=str(tmp_path / "theirs")))
    ours, theirs = _events(tmp_path / "ours"), _events(tmp_path / "theirs")
    assert ours[0].file_version == theirs[0].file_version == "brain.Event:2"
    assert ours[0].source_metadata.writer == "torchinstruments_core.run_directory._event_file"
    assert len(theirs) == 1 + 3 + 1
    assert [event.step for event in ours[1:]] == [0, 10, 20, 20]  # the text came after a flush

    def values(events: list[Any]) -> list[tuple[int, bytes]]:
        return [(e.step, v.SerializeToString()) for e in events[1:] for v in e.summary.value]

    assert values(ours) == values(theirs)


def test_every_value_of_a_shared_event_reaches_tensorboard(tmp_path: pathlib.Path) -> None:
    """TensorBoard's reader gives each scalar and histogram of one event, at its step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventFile(tmp_path)
    target = SummaryWriterTarget(events)
    for step in (3, 4):
        scalars = {"a/rms": 1.0 + step, "b/rms": 2.0 + step}
        target.log(scalars, {"a/histogram": _histogram(step, 64)}, step)
    events.close()
    assert [event.step for event in _events(tmp_path)[1:]] == [3, 4]
    accumulator = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "histograms": 0})
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("a/rms")] == [(3, 4.0), (4, 5.0)]
    assert [(e.step, e.value) for e in accumulator.Scalars("b/rms")] == [(3, 5.0), (4, 6.0)]
    histograms = accumulator.Histograms("a/histogram")
    assert [h.step for h in histograms] == [3, 4]
    expected = [sum(_histogram(step, 64).counts) for step in (3, 4)]
    assert [h.histogram_value.num for h in histograms] == expected


def _logging_writer(folder: pathlib.Path) -> Any:
    """A subclass of torch's ``SummaryWriter`` that notes the tag of each value it is given."""
    from torch.utils.tensorboard import SummaryWriter

    class LoggingWriter(SummaryWriter):
        def __init__(self, log_dir: str) -> None:
            super().__init__(log_dir=log_dir)
            self.calls: list[str] = []

        def add_scalar(self, tag: str, *args: Any, **kwargs: Any) -> None:
            self.calls.append(tag)
            super().add_scalar(tag, *args, **kwargs)

        def add_histogram_raw(self, tag: str, *args: Any, **kwargs: Any) -> None:
            self.calls.append(tag)
            super().add_histogram_raw(tag, *args, **kwargs)

    return LoggingWriter(str(folder))


def test_summary_writer_gets_a_call_s_values_as_one_event(tmp_path: pathlib.Path) -> None:
    """The SummaryWriter of torch gets one event a call, holding what it makes value by value.

    A subclass (which may do more in ``add_scalar``) is called value by value, an event each;
    both files hold the same values, byte for byte, and TensorBoard's reader gives each.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    subclass = _logging_writer(tmp_path / "subclass")
    _write(SummaryWriter(log_dir=str(tmp_path / "torch")))
    _write(subclass)
    merged, separate = _events(tmp_path / "torch"), _events(tmp_path / "subclass")
    assert [len(event.summary.value) for event in merged[1:]] == [4, 4, 4, 1]
    assert [len(event.summary.value) for event in separate[1:]] == [1] * (3 * 4 + 1)
    assert subclass.calls[:4] == [
        "telemetry/a/output/rms",
        "telemetry/nonfinite_tensors",
        "telemetry/a/output/histogram",
        "telemetry/b/output/histogram",
    ]

    def values(events: list[Any]) -> list[tuple[int, bytes]]:
        return [(e.step, v.SerializeToString()) for e in events[1:] for v in e.summary.value]

    assert values(merged) == values(separate)
    accumulator = EventAccumulator(str(tmp_path / "torch"), size_guidance={"histograms": 0})
    accumulator.Reload()
    rms = [(e.step, e.value) for e in accumulator.Scalars("telemetry/a/output/rms")]
    assert rms == [(0, 0.5), (10, 1.5), (20, 2.5)]
    histograms = accumulator.Histograms("telemetry/b/output/histogram")
    assert [h.step for h in histograms] == [0, 10, 20]
    assert [len(h.histogram_value.bucket) for h in histograms] == [1000] * 3


def test_an_empty_call_writes_no_event(tmp_path: pathlib.Path) -> None:
    """A call with neither scalars nor histograms adds nothing to torch's writer's file."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    SummaryWriterTarget(writer).log({}, {}, 3)
    writer.close()
    assert len(_events(tmp_path)) == 1  # the file version only


def test_events_are_readable_at_each_flush(tmp_path: pathlib.Path) -> None:
    """What was added is in the file after ``flush``, before ``close``; closing twice is fine."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventFile(tmp_path)
    events.add_scalar("loss", 1.5, 7)
    events.flush()
    accumulator = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("loss")] == [(7, 1.5)]
    events.close()
    events.close()


def test_a_missing_folder_is_created(tmp_path: pathlib.Path) -> None:
    """The event file's folder need not exist: it is created with its parents."""
    events = EventFile(tmp_path / "run" / "tensorboard")
    events.close()
    assert len(list((tmp_path / "run" / "tensorboard").iterdir())) == 1


@pytest.mark.parametrize("value", [0, 3, -2.5, True])
def test_scalars_are_summary_writers_for_any_number(tmp_path: pathlib.Path, value: Any) -> None:
    """A scalar proto built directly equals torch's ``summary.scalar`` for ints, floats, bools."""
    from torch.utils.tensorboard.summary import scalar

    events = EventFile(tmp_path)
    events.add_scalar("x", value, 1)
    events.close()
    assert _events(tmp_path)[1].summary == scalar("x", value)


def test_center_sums_are_those_of_a_python_loop() -> None:
    """The bin-centre sums, from numpy products and the builtin ``sum``, equal a Python loop's."""
    from torchinstruments_core.routing.targets import _center_sums

    for seed in range(20):
        record = _histogram(seed, 64 if seed % 2 else 1000)
        edges, counts = record.edges, record.counts
        centers = [(lo + hi) / 2 for lo, hi in itertools.pairwise(edges)]
        expected = (
            sum(c * x for c, x in zip(counts, centers, strict=True)),
            sum(c * x * x for c, x in zip(counts, centers, strict=True)),
        )
        assert _center_sums(record) == expected
