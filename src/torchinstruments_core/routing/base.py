"""The target extension point: where routed scalars and histograms are written.

A target is one destination the trainer already has: a TensorBoard ``SummaryWriter``, a W&B run,
or anything that takes a dict of scalars (a CSV or MLflow logger, an Accelerate tracker).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torchinstruments_core._records import HistogramRecord


@runtime_checkable
class Target(Protocol):
    """Receives the scalars and histograms of one sample, at one step."""

    def log(
        self, scalars: Mapping[str, float], histograms: Mapping[str, HistogramRecord], step: int
    ) -> None:
        """Write ``scalars`` and ``histograms`` (by key) at ``step``."""
        ...


def tensor_key(layer: str, call_index: int, signal: str, tensor_path: str) -> str:
    """``<layer>/<signal>``, plus ``/call_<k>`` and ``/<tensor_path>`` where not the default.

    Example:
        >>> tensor_key("encoder.0", 0, "output", "output")
        'encoder.0/output'
        >>> tensor_key("attn", 1, "output_gradient", "output.0")
        'attn/output_gradient/call_1/output.0'
    """
    key = f"{layer}/{signal}"
    if call_index:
        key += f"/call_{call_index}"
    if tensor_path != "output":
        key += f"/{tensor_path}"
    return key
