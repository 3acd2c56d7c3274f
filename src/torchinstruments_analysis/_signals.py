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

PARAMETER_GRADIENT = "parameter_gradient"
"""The gradient an optimizer step used (after unscaling and clipping)."""

UPDATE = "update"
"""The change of a parameter over an optimizer step."""

OPTIMIZER_STATE = "optimizer_state"
"""A state tensor of the optimizer (Adam's moments)."""

INPUT = "input"
"""A module's input tensors (a forward sample)."""

INPUT_GRADIENT = "input_gradient"
"""The gradient flowing back into a module's inputs."""

TIME = "time"
"""A module call's forward and backward time (opt-in ``profile=True``)."""

MEMORY = "memory"
"""A module call's CUDA allocated-memory change and peak (opt-in ``profile=True``)."""

MODEL_LAYER = "<model>"
"""The ``layer`` of the whole-model rows of a step record (global norms)."""

BIAS = "bias"
"""How a bias parameter's name ends: its ratios are left out where weights are meant.

Biases often start at zero (``LayerNorm``, many initializations), so their update-to-weight
ratio is infinite, then near 1, on a healthy run: it says nothing about the learning rate.
"""
