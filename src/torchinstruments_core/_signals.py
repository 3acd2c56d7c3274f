"""The signals, each defined once: what a row describes, and everything that follows from it.

A signal is data. Routing (which signals reach the trainer's loggers by default, and their keys),
the end-of-run summary's columns, ``index.md``'s signal table, ``result.json``'s signal catalog
and the tensor keys read this definition instead of spelling signal names out. Adding a signal is
one member of ``Signal`` plus the code that produces its rows.

Example:
    >>> Signal.OUTPUT_GRADIENT.gradient_of, Signal.OUTPUT_GRADIENT.tensor_root
    (<Signal.OUTPUT: 'output'>, 'output')
    >>> Signal.PARAMETER.kind, Signal.PARAMETER.tensor_root is None
    (<RecordKind.STEP: 'step'>, True)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import StrEnum


class RecordKind(StrEnum):
    """Which record a row belongs to; ``samples.parquet``'s ``kind`` column holds it.

    ``FORWARD``: a sample, one root forward and the backward through its graph. ``STEP``: a step
    record, one sampled optimizer step. Both take their ids from the same sequence.
    """

    FORWARD = "forward"
    STEP = "step"


@dataclass(frozen=True, slots=True)
class SignalSpec:
    """What is known about a signal besides its name.

    Attributes:
        describes: One sentence saying what the tensor is (``index.md`` shows it).
        kind: The record its rows belong to.
        tensor_root: The first part of every ``tensor_path`` of the signal (``output`` for
            ``output``, ``output.0``, ``output.logits``); ``None`` where the path is the name of a
            parameter within its module (``weight``).
        gradient_of: The value of the signal this one is the gradient of; ``None`` for values.
        routed: Whether ``LoggerRouter`` routes it unless told which signals to route.
        routed_metrics: The metrics of a layer's rows that ``LoggerRouter`` routes as scalars;
            ``None``: the router's ``scalar_metrics``.
        model_metrics: The metrics of its whole-model rows (layer ``MODEL_LAYER``) that
            ``LoggerRouter`` routes as scalars, under ``<prefix>/model/<signal>/<metric>``.
        summary_label: Its short name in the columns of ``summarize_run``; ``None``: not shown.
        paths: The fixed ``tensor_path`` values of a signal that measures a module call rather
            than a tensor (``forward``, ``backward``); empty for the others.
    """

    describes: str
    kind: RecordKind = RecordKind.FORWARD
    tensor_root: str | None = None
    gradient_of: str | None = None
    routed: bool = True
    routed_metrics: tuple[str, ...] | None = None
    model_metrics: tuple[str, ...] = ()
    summary_label: str | None = None
    paths: tuple[str, ...] = ()


class Signal(StrEnum):
    """What a row describes; the value is what the ``signal`` column holds (never renamed)."""

    _value_: str
    spec: SignalSpec

    # ``Signal("output")`` looks a member up and never reaches ``__new__``: only the member
    # definitions below pass a spec.
    def __new__(cls, value: str, spec: SignalSpec | None = None) -> Signal:
        if spec is None:
            raise TypeError(f"the signal {value!r} needs a SignalSpec")
        member = str.__new__(cls, value)
        member._value_ = value
        member.spec = spec
        return member

    OUTPUT = (
        "output",
        SignalSpec(
            "The tensors a module's forward returned.",
            tensor_root="output",
            summary_label="output",
        ),
    )
    OUTPUT_GRADIENT = (
        "output_gradient",
        SignalSpec(
            "The gradient flowing back into a module's output in the backward, unscaled under "
            "fp16 loss scaling.",
            tensor_root="output",
            gradient_of="output",
            summary_label="grad",
        ),
    )
    INPUT = (
        "input",
        SignalSpec(
            "The tensors passed to a module's forward, positional and keyword (`input.0`, "
            "`input.x`).",
            tensor_root="input",
            routed=False,
        ),
    )
    INPUT_GRADIENT = (
        "input_gradient",
        SignalSpec(
            "The gradient flowing back into a module's input tensors in the backward, unscaled "
            "under fp16 loss scaling.",
            tensor_root="input",
            gradient_of="input",
            routed=False,
        ),
    )
    TIME = (
        "time",
        SignalSpec(
            "Opt-in (`profile=True`): the time of a module call's forward and of its backward "
            "(`tensor_path` `forward`, `backward`; metric `ms`), inclusive of the modules it "
            "calls; CUDA events on a GPU, `time.perf_counter` on the CPU. The backward runs from "
            "the gradient reaching the call's outputs to the last gradient reaching its inputs.",
            routed=False,
            paths=("forward", "backward"),
        ),
    )
    MEMORY = (
        "memory",
        SignalSpec(
            "Opt-in (`profile=True`, CUDA only): the CUDA allocator's allocated memory over a "
            "module call's forward and its backward (`tensor_path` `forward`, `backward`), "
            "inclusive of the modules it calls: `allocated_delta_mib` is allocated at the end "
            "minus at the start, `peak_delta_mib` the peak within the call minus at the start, "
            "in MiB.",
            routed=False,
            paths=("forward", "backward"),
        ),
    )
    PARAMETER = (
        "parameter",
        SignalSpec(
            "A parameter of the module, as the optimizer step found it.",
            kind=RecordKind.STEP,
            routed=False,
        ),
    )
    PARAMETER_GRADIENT = (
        "parameter_gradient",
        SignalSpec(
            "The gradient the optimizer step used: after unscaling and clipping, summed over the "
            "step's micro-batches.",
            kind=RecordKind.STEP,
            gradient_of="parameter",
            routed_metrics=("rms",),
            model_metrics=("l2_norm", "nonfinite_count", "zero_count"),
        ),
    )
    UPDATE = (
        "update",
        SignalSpec(
            "The change of a parameter over the optimizer step (after minus before); its "
            "`update_to_weight` is rms(update) / rms(parameter before the step).",
            kind=RecordKind.STEP,
            routed_metrics=("update_to_weight",),
            model_metrics=("l2_norm",),
        ),
    )
    OPTIMIZER_STATE = (
        "optimizer_state",
        SignalSpec(
            "A state tensor the optimizer holds for a parameter after the step "
            "(`weight.exp_avg`, `weight.exp_avg_sq`).",
            kind=RecordKind.STEP,
            routed=False,
        ),
    )

    @property
    def kind(self) -> RecordKind:
        """The record its rows belong to."""
        return self.spec.kind

    @property
    def describes(self) -> str:
        """One sentence saying what the tensor is."""
        return self.spec.describes

    @property
    def tensor_root(self) -> str | None:
        """The first part of its tensor paths; ``None``: the path is a parameter's name."""
        return self.spec.tensor_root

    @property
    def gradient_of(self) -> Signal | None:
        """The signal this one is the gradient of, if any."""
        return None if self.spec.gradient_of is None else Signal(self.spec.gradient_of)

    @property
    def gradient(self) -> Signal | None:
        """The signal that is this one's gradient, if one is defined."""
        return _gradients().get(self)


MODEL_LAYER = "<model>"
"""The ``layer`` of a step record's whole-model rows (global gradient and update norms)."""

ALL_PARAMETERS = "*"
"""The ``tensor_path`` of the whole-model rows: every observed parameter together."""

MODEL_KEY = "model"
"""What stands for ``MODEL_LAYER`` in a logged key (``telemetry/model/update/l2_norm``).

Keys hold neither ``<`` nor ``*``. It cannot collide with a layer named ``model``: a layer's
step keys always name the parameter (``telemetry/model/update/weight/update_to_weight``).
"""


@functools.cache
def _gradients() -> dict[Signal, Signal]:
    # looked up for every observed output of a sampled forward: built once
    return {Signal(s.spec.gradient_of): s for s in Signal if s.spec.gradient_of is not None}


def signals_of(kind: RecordKind) -> tuple[Signal, ...]:
    """The signals whose rows belong to records of ``kind``, in definition order."""
    return tuple(signal for signal in Signal if signal.kind is kind)


def routed_by_default() -> tuple[Signal, ...]:
    """The signals ``LoggerRouter`` routes unless told which."""
    return tuple(signal for signal in Signal if signal.spec.routed)


def fixed_root(signal: Signal) -> str:
    """The tensor-path root of a signal measured on module tensors (outputs, inputs).

    Raises:
        ValueError: The signal's paths are parameter names, with no common root.
    """
    if signal.tensor_root is None:
        raise ValueError(f"the tensor paths of {signal} are parameter names, with no root")
    return signal.tensor_root


def tensor_root_of(signal: str) -> str | None:
    """The tensor-path root of ``signal``; ``None`` for a parameter's signal or an unknown name."""
    try:
        return Signal(signal).tensor_root
    except ValueError:
        return None
