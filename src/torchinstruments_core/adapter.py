"""What every trainer adapter needs, written once: validation, the sink, the folder, the schedule.

An adapter maps its trainer's events to ``Observer`` calls and its loggers to routing targets;
everything else it asks from here, so that the Lightning callback and the Accelerate tracker
behave alike. An adapter that never sees the user's step (it counts optimizer steps itself) puts
a ``HoldingSink`` with a ``StepNumbering`` in front of its sink, so that its samples take the
step numbers of the user's own logging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchinstruments_core._config import (
    ErrorPolicy,
    RankPolicy,
    check_positive_int,
    parse_choice,
)
from torchinstruments_core._inject import inject_observer
from torchinstruments_core._numbering import HoldingSink as HoldingSink
from torchinstruments_core._numbering import StepNumbering as StepNumbering
from torchinstruments_core.routing import DEFAULT_SCALAR_METRICS, LoggerRouter
from torchinstruments_core.sinks import MultiSink

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from pathlib import Path

    from torch import nn

    from torchinstruments_core._observer import Observer
    from torchinstruments_core.reducers import Reducer
    from torchinstruments_core.routing import Target
    from torchinstruments_core.selectors import SelectorFn
    from torchinstruments_core.sinks import Sink

__all__ = [
    "AdapterPolicies",
    "HoldingSink",
    "ObserveOptions",
    "RoutingOptions",
    "StepNumbering",
    "StepSchedule",
    "loss_scale_reader",
    "new_run_id",
    "telemetry_sink",
]


@dataclass(frozen=True, slots=True)
class RoutingOptions:
    """What goes into the trainer's loggers (see ``LoggerRouter``)."""

    prefix: str = "telemetry"
    scalar_metrics: tuple[str, ...] = DEFAULT_SCALAR_METRICS
    scalar_layers: str | tuple[str, ...] = "focus"
    histograms: bool = True

    @classmethod
    def parse(
        cls, prefix: str, scalar_metrics: Sequence[str], scalar_layers: str | Sequence[str]
    ) -> RoutingOptions:
        """Validate the user's values now (naming the argument), not at the first sample."""
        LoggerRouter((), prefix=prefix, scalar_metrics=scalar_metrics, scalar_layers=scalar_layers)
        layers = scalar_layers if isinstance(scalar_layers, str) else tuple(scalar_layers)
        return cls(prefix, tuple(scalar_metrics), layers)


@dataclass(frozen=True, slots=True)
class ObserveOptions:
    """What an adapter observes: passed through to ``inject_observer``."""

    selector: SelectorFn | None = None
    reducers: Sequence[Reducer] | None = None
    histogram_selector: SelectorFn | None = None
    max_histogram_modules: int = 8

    def inject(
        self,
        model: nn.Module,
        *,
        sink: Sink,
        policies: AdapterPolicies,
        run_id: str | None,
        first_sample_id: int = 0,
    ) -> Observer:
        """Attach an observer to ``model`` with these options and the adapter's policies."""
        return inject_observer(
            model,
            sink=sink,
            selector=self.selector,
            reducers=self.reducers,
            histogram_selector=self.histogram_selector,
            max_histogram_modules=self.max_histogram_modules,
            rank_policy=policies.rank_policy,
            error_policy=policies.error_policy,
            run_id=run_id,
            first_sample_id=first_sample_id,
        )


@dataclass(frozen=True, slots=True)
class StepSchedule:
    """Sample every ``every_n_steps``-th optimizer step: steps 0, n, 2n and so on."""

    every_n_steps: int

    def __post_init__(self) -> None:
        check_positive_int("every_n_steps", self.every_n_steps, minimum=1)

    def samples(self, step: int) -> bool:
        """Whether optimizer step ``step`` is sampled."""
        return step % self.every_n_steps == 0


@dataclass(frozen=True, slots=True)
class AdapterPolicies:
    """The validated policies an adapter passes on to ``inject_observer``."""

    rank_policy: RankPolicy = RankPolicy.RANK0
    error_policy: ErrorPolicy = ErrorPolicy.WARN

    @classmethod
    def parse(cls, rank_policy: str, error_policy: str) -> AdapterPolicies:
        """Validate the user's strings, naming the argument and the choices on error."""
        return cls(
            parse_choice(RankPolicy, "rank_policy", rank_policy),
            parse_choice(ErrorPolicy, "error_policy", error_policy),
        )


def new_run_id() -> str:
    """A fresh run id; an adapter broadcasts one from rank 0 so that every rank shares it."""
    from torchinstruments_core._inject import new_run_id as generate

    return generate()


def telemetry_sink(
    *,
    output_dir: Path | None,
    targets: Sequence[Target] | Callable[[], Iterable[Target]],
    routing: RoutingOptions,
    tensorboard: bool = True,
) -> Sink:
    """The run directory (unless ``output_dir`` is ``None``) and the logger routing, as one sink.

    ``targets`` may be a function returning them at each write (see ``LoggerRouter``);
    ``tensorboard`` is the run directory's own ``tensorboard/`` copy (see ``RunDirectorySink``).
    """
    from torchinstruments_core.run_directory import RunDirectorySink

    sinks: list[Sink] = []
    if output_dir is not None:
        sinks.append(RunDirectorySink(output_dir, tensorboard=tensorboard))
    if targets:
        sinks.append(
            LoggerRouter(
                targets,
                prefix=routing.prefix,
                scalar_metrics=routing.scalar_metrics,
                scalar_layers=routing.scalar_layers,
                histograms=routing.histograms,
            )
        )
    return MultiSink(sinks)


def loss_scale_reader(scaler: Any, device: torch.device) -> Callable[[], torch.Tensor] | None:
    """A function that returns the fp16 loss scale as a tensor on ``device``, for gradients.

    Pass it to ``Observer.set_gradient_scale``: it is called when a sample opens and returns
    ``scaler.scale(1)``, the scale as a device tensor, through the scaler's public API. Nothing
    waits for the device (``scaler.get_scale()`` would), and the value is the one the sample's
    backward uses even when the scaler grows or backs off after the optimizer step.

    Args:
        scaler: A ``torch.amp.GradScaler`` (or the older ``torch.cuda.amp`` one), or ``None``.
        device: Where the model's gradients are.

    Returns:
        The reader, or ``None`` without an enabled scaler (bf16 and fp32 need no unscaling).
    """
    if scaler is None or not scaler.is_enabled():
        return None
    one = torch.ones((), device=device)
    return lambda: scaler.scale(one)
