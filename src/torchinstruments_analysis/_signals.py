"""The signal names the analysis reads, as the core writes them in ``history.parquet``.

The core defines its signals in ``torchinstruments_core._signals``; this package must not import
the core (it imports torch), so the names it needs are written once here, and a test checks them
against the core's definition.
"""

from __future__ import annotations

OUTPUT = "output"
"""A module's output (a forward sample); also the ``tensor_path`` of a whole output."""

OUTPUT_GRADIENT = "output_gradient"
"""The gradient flowing back into a module's output."""

PARAMETER = "parameter"
"""A parameter of a module at an optimizer step (a step record)."""
