"""Built-in targets: a TensorBoard ``SummaryWriter``, a W&B run, a scalar logging function.

The first two also take text (``log_text``), for events such as a non-finite onset; a target
without ``log_text`` receives only the event's scalar (see ``log_event``).
"""

from __future__ import annotations

import html
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from torchinstruments_core._exceptions import MissingDependencyError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from torchinstruments_core._records import HistogramRecord


class SummaryWriterTarget:
    """Scalars and raw histograms into a TensorBoard ``SummaryWriter`` at the given step.

    To torch's own ``SummaryWriter`` (``torch.utils.tensorboard``, what Lightning's
    ``TensorBoardLogger`` and Accelerate's tracker hold where tensorboard is installed) a call's
    values go as one event, a ``Summary`` holding each of them as ``add_scalar`` and
    ``add_histogram_raw`` would make it (TensorBoard reads each value of an event alike, as
    ``run_directory._event_file.EventFile`` writes them). Value by value, the writer made an
    event of each and queued it for its thread, which checksums every event in a Python loop
    over its bytes, holding the GIL, behind a queue of ten: a sampled step of an MNIST-sized MLP
    under Lightning (50 scalars, 22 histograms) waited about 10 ms here for that thread, on a
    step of 5 ms. The checksums are the same bytes either way; one event leaves them to the
    writer's thread while the next step runs. Any other writer (``tensorboardX``, a subclass,
    a stand-in) gets its ``add_scalar`` and ``add_histogram_raw`` called value by value.

    Args:
        writer: The trainer's writer (``TensorBoardLogger.experiment``, Accelerate's
            ``TensorBoardTracker.writer``); it is not closed here.
    """

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def log(
        self, scalars: Mapping[str, float], histograms: Mapping[str, HistogramRecord], step: int
    ) -> None:
        """Write each scalar and histogram at ``step``."""
        protos = _summary_protos(self.writer)
        if protos is not None:
            if scalars or histograms:
                summary = _summary(protos, scalars, histograms)
                self.writer._get_file_writer().add_summary(summary, step)
            return
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        for key, record in histograms.items():
            fields = _histogram_fields(record)
            self.writer.add_histogram_raw(
                key,
                min=fields["min"],
                max=fields["max"],
                num=fields["num"],
                sum=fields["sum"],
                sum_squares=fields["sum_squares"],
                bucket_limits=fields["bucket_limit"],
                bucket_counts=fields["bucket"],
                global_step=step,
            )

    def log_text(self, key: str, text: str, step: int) -> None:
        """Write ``text`` as a TensorBoard text summary at ``step`` (the TEXT tab)."""
        self.writer.add_text(key, text, step)


def _summary_protos(writer: Any) -> Any:
    """TensorBoard's ``summary_pb2`` where ``writer`` is torch's own ``SummaryWriter``, else None.

    Only that class itself: a subclass may do more in ``add_scalar``, which one event would skip.
    """
    module = sys.modules.get("torch.utils.tensorboard.writer")
    if module is None or type(writer) is not module.SummaryWriter:
        return None
    from tensorboard.compat.proto import summary_pb2

    return summary_pb2


def _summary(
    protos: Any, scalars: Mapping[str, float], histograms: Mapping[str, HistogramRecord]
) -> Any:
    """One ``Summary`` of every scalar and histogram, each value as torch's builders make it."""
    value = protos.Summary.Value
    values = [value(tag=key, simple_value=float(scalar)) for key, scalar in scalars.items()]
    for key, record in histograms.items():
        histogram = protos.HistogramProto(**_histogram_fields(record))
        values.append(value(tag=key, histo=histogram))
    return protos.Summary(value=values)


def _histogram_fields(record: HistogramRecord) -> dict[str, Any]:
    """The ``HistogramProto`` fields of ``record``, as ``add_histogram_raw`` is given them."""
    edges, counts = record.edges, record.counts
    total, squares = _center_sums(record)
    return {
        "min": edges[0],
        "max": edges[-1],
        "num": int(sum(counts)),
        "sum": total,
        "sum_squares": squares,
        "bucket_limit": list(edges[1:]),
        "bucket": list(counts),
    }


def _center_sums(record: HistogramRecord) -> tuple[float, float]:
    """The sum and the sum of squares of a histogram's entries, each taken at its bin's centre.

    TensorBoard wants them for its summary; bin centres give them within a bin. numpy forms the
    centres and products (each the same IEEE operation as in Python), the builtin ``sum`` adds
    them in its own order: the values of a Python loop, 20 times faster.
    """
    edges = np.array(record.edges, dtype=np.float64)
    centers = (edges[:-1] + edges[1:]) / 2
    weighted = np.array(record.counts, dtype=np.float64) * centers
    return sum(weighted.tolist()), sum((weighted * centers).tolist())


class WandbRunTarget:
    """Scalars and ``wandb.Histogram``s into a W&B run, in one ``log`` call per sample.

    Args:
        run: The W&B run (``WandbLogger.experiment``, Accelerate's ``WandBTracker.run``).
        step_key: Log the step as this metric (Lightning's ``"trainer/global_step"``), so rows
            line up with the trainer's own; ``None`` passes it as W&B's ``step=`` instead.
    """

    def __init__(self, run: Any, *, step_key: str | None = None) -> None:
        self.run = run
        self.step_key = step_key

    def log(
        self, scalars: Mapping[str, float], histograms: Mapping[str, HistogramRecord], step: int
    ) -> None:
        """Write one W&B history row holding the scalars and histograms of this step."""
        try:
            import wandb
        except ImportError as error:
            raise MissingDependencyError("W&B routing needs wandb: pip install wandb") from error
        data: dict[str, Any] = dict(scalars)
        for key, record in histograms.items():
            counts, edges = np.asarray(record.counts), np.asarray(record.edges)
            data[key] = wandb.Histogram(np_histogram=(counts, edges))
        if self.step_key is None:
            self.run.log(data, step=step)
        else:
            self.run.log({**data, self.step_key: step})

    def log_text(self, key: str, text: str, step: int) -> None:
        """Write ``text`` as a ``wandb.Html`` under ``key`` at ``step`` (offline runs too)."""
        try:
            import wandb
        except ImportError as error:
            raise MissingDependencyError("W&B routing needs wandb: pip install wandb") from error
        data: dict[str, Any] = {key: wandb.Html(f"<pre>{html.escape(text)}</pre>")}
        if self.step_key is None:
            self.run.log(data, step=step)
        else:
            self.run.log({**data, self.step_key: step})


class ScalarTarget:
    """Scalars into any ``log(metrics, step)`` function; histograms are left out.

    Args:
        log_metrics: E.g. a Lightning logger's ``log_metrics`` or an Accelerate tracker's ``log``.
    """

    def __init__(self, log_metrics: Callable[[dict[str, float], int], Any]) -> None:
        self.log_metrics = log_metrics

    def log(
        self, scalars: Mapping[str, float], histograms: Mapping[str, HistogramRecord], step: int
    ) -> None:
        """Write the scalars at ``step``."""
        if scalars:
            self.log_metrics(dict(scalars), step)
