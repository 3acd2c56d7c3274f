"""``TelemetryTracker``: per-layer activation and gradient telemetry as an Accelerate tracker."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelerate.state import PartialState
from accelerate.tracking import GeneralTracker
from accelerate.utils import broadcast_object_list
from torch import nn
from typing_extensions import override

from torchinstruments_accelerate._clock import OptimizerClock
from torchinstruments_accelerate._trackers import accelerator_holding, tracker_targets
from torchinstruments_core import ConfigurationError, ObservationWarning
from torchinstruments_core.adapter import (
    AdapterPolicies,
    HoldingSink,
    ObserveOptions,
    RoutingOptions,
    StepNumbering,
    StepSchedule,
    loss_scale_reader,
    new_run_id,
    telemetry_sink,
)
from torchinstruments_core.routing import DEFAULT_SCALAR_METRICS
from torchinstruments_core.run_directory import fresh_folder

if TYPE_CHECKING:
    import os
    from collections.abc import Callable, Sequence

    from accelerate import Accelerator

    from torchinstruments_core import Observer, Reducer, Sink
    from torchinstruments_core.routing import Target
    from torchinstruments_core.selectors import SelectorFn

log = logging.getLogger(__name__)


class TelemetryTracker(GeneralTracker):  # type: ignore[misc]
    """Samples per-layer statistics of outputs and output gradients every ``every_n_steps`` steps.

    Pass it in ``Accelerator(log_with=[...])`` beside the other trackers and call ``watch`` on the
    model (prepared or not) on every process. A tracker never sees the model, hence ``watch``; and
    it never sees the other trackers, hence ``watch(..., accelerator=accelerator)``, which routes
    into them. Without ``accelerator``, ``watch`` uses the one ``Accelerator`` that holds this
    tracker in its ``log_with``; if there is none or several, it warns (``ObservationWarning``)
    and writes only the run directory.

    Steps: the tracker counts optimizer steps itself, alike on every process (a post-hook on the
    optimizer that steps the model's parameters: under ``accelerator.accumulate`` one tick per
    gradient synchronization; a step the fp16 scaler skips is not counted). It samples every
    forward of the watched model during steps 0, n, 2n … of that count: each micro-batch of an
    accumulated step is one sample, and so is any other forward of the model in that step, such
    as an evaluation batch (a forward-only sample). Only the numbering follows the user: a sample's
    ``step`` is the number the user's ``accelerator.log(..., step=u)`` gives its optimizer step.

    - Step ``s``'s window runs from its first training forward (gradients enabled; evaluation
      under ``torch.no_grad`` does not count) to the first training forward of the next step.
      The first ``log`` with a ``step`` in that window numbers ``s``: a loop that logs before
      ``optimizer.step()`` and one that logs after it (``if accelerator.sync_gradients:
      accelerator.log(..., step=i)``) both name ``s``, 0-based, 1-based or from any offset, the
      first sampled step included. A later log in the same window does not renumber it, and a
      log at the top of the loop, before the forward, names the previous step.
    - A step whose window ends without a log counts on from the last log (``s + u - t`` for the
      last logged step ``t``); a log before the first forward (before ``watch`` too) numbers
      step 0 until step 0's own window has one. Without any ``step=`` the number is the count.
    - A step's samples wait (neither the run directory nor the trackers see them) until its
      number is known: its first log, or else the end of its window, noticed at the next
      optimizer step, log or sample, or at ``finish``. A step still waiting at ``finish`` (the
      last step, sampled and never logged) goes to the run directory only. ``samples.parquet``
      keeps the tracker's count in its ``optimizer_step`` column. Processes other than the main
      one see no ``log`` call and number their steps by the count.

    ``finish`` (which ``accelerator.end_training()`` calls on the main process) removes every hook
    and finalizes the run directory. Accelerate keeps trackers on the main process only; under
    ``rank_policy="all"`` the other processes finalize theirs when they end, under any launcher
    (a ``debug_launcher`` or ``notebook_launcher`` child too), or earlier if you call ``finish``
    there. A script that never calls it, dies of an exception or receives SIGTERM still gets a
    finalized directory, and the chunks in ``history.parts/`` are readable at any time. Under
    fp16 the gradients are recorded divided by ``accelerator.scaler``'s loss scale, as the
    optimizer sees them.

    Logged metrics:
        Into ``accelerator.trackers`` on the main process, at the step above:

        - ``<prefix>/<layer>/<signal>/<metric>``: for each focus layer (up to
          ``max_histogram_modules``, spread over the model's depth), ``signal`` ``output`` and
          ``output_gradient``, ``metric`` in ``scalar_metrics`` (default ``rms``, ``max_abs``,
          ``nonfinite_fraction``). A second call of a module adds ``/call_<k>`` after the signal,
          a tensor inside a nested output its path (``/output.0``).
        - ``<prefix>/<layer>/<signal>/histogram``: the histogram of the same tensors, to the
          TensorBoard tracker (raw histograms, its ``writer``) and the W&B tracker
          (``wandb.Histogram``, its ``run``, with W&B's ``step=``); other trackers (MLflow,
          Comet …) get the scalars only, through their ``log``.
        - ``<prefix>/nonfinite_tensors``: how many observed tensors held NaN or Inf in the sample.
        - ``<prefix>/collection_duration_ms``: host time spent observing the sample.

        Every layer's full statistics go to the run directory, by default
        ``<accelerator.logging_dir>/telemetry`` (the project directory; ``./telemetry`` when
        neither is known), ``rank-NNN/`` inside per process under ``rank_policy="all"``:
        ``history.parquet``, ``samples.parquet``, ``result.json``, ``index.md``, ``tensorboard/``.
        ``watch`` logs its absolute path at INFO on the main process.

    Args:
        run_name: Set by Accelerate when the tracker is registered by name
            (``register_tracker_class``); not used.
        logging_dir: Set by Accelerate when registered by name: the default folder's parent.
        every_n_steps: Sample every this many optimizer steps.
        output_dir: The run directory (default above). If it already holds a run (an earlier
            run in the same project directory), ``<output_dir>-<run_id>`` is used instead;
            nothing is overwritten.
        log_to_trackers: Route scalars and histograms into the accelerator's other trackers.
        write_directory: Write the run directory.
        prefix: First part of every logged key.
        scalar_metrics: Metrics routed to the trackers as scalars.
        scalar_layers: ``"focus"``, ``"all"``, or glob patterns of layer names.
        selector: Which modules are observed (default: every leaf module).
        reducers: Scalar reducers (default: the eleven metrics of ``default_reducers()``).
        histogram_selector: Which modules are the focus layers (histograms and logged scalars);
            default: modules with parameters, spread over depth, the largest always included.
        max_histogram_modules: At most this many focus layers.
        rank_policy: ``"rank0"`` observes only the main process; ``"all"`` every process, each
            writing its own ``rank-NNN/``; routing into trackers stays on the main process.
        error_policy: ``"warn"`` keeps training when observing fails; ``"raise"`` stops.
        unscale_gradients: Divide gradients by the fp16 loss scale before measuring them.

    Example::

        telemetry = TelemetryTracker(every_n_steps=50)
        accelerator = Accelerator(log_with=["tensorboard", telemetry], project_dir="runs")
        accelerator.init_trackers("exp")
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        telemetry.watch(model, accelerator=accelerator)
    """

    name = "torchinstruments"
    requires_logging_directory = True
    main_process_only = False  # finish() works wherever it is called; the rank gate is watch()'s

    def __init__(
        self,
        run_name: str | None = None,
        logging_dir: str | os.PathLike[str] | None = None,
        *,
        every_n_steps: int = 50,
        output_dir: str | os.PathLike[str] | None = None,
        log_to_trackers: bool = True,
        write_directory: bool = True,
        prefix: str = "telemetry",
        scalar_metrics: Sequence[str] = DEFAULT_SCALAR_METRICS,
        scalar_layers: str | Sequence[str] = "focus",
        selector: SelectorFn | None = None,
        reducers: Sequence[Reducer] | None = None,
        histogram_selector: SelectorFn | None = None,
        max_histogram_modules: int = 8,
        rank_policy: str = "rank0",
        error_policy: str = "warn",
        unscale_gradients: bool = True,
    ) -> None:
        super().__init__()
        if run_name is not None and not isinstance(run_name, str):
            raise ConfigurationError.invalid(
                "run_name", run_name, "a str (Accelerate's run name); pass every_n_steps by keyword"
            )
        self.schedule = StepSchedule(every_n_steps)
        self.policies = AdapterPolicies.parse(rank_policy, error_policy)
        if run_name is not None and self.policies.rank_policy == "all":
            raise ConfigurationError(
                "rank_policy='all' needs a tracker on every process, and Accelerate creates a "
                "tracker registered by name on the main process only: pass an instance in log_with"
            )
        self.routing = RoutingOptions.parse(prefix, scalar_metrics, scalar_layers)
        self.logging_dir = Path(logging_dir) if logging_dir is not None else None
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.log_to_trackers = log_to_trackers
        self.write_directory = write_directory
        self.unscale_gradients = unscale_gradients
        self.observe = ObserveOptions(selector, reducers, histogram_selector, max_histogram_modules)
        self._observer: Observer | None = None
        self._clock: OptimizerClock | None = None
        self._routed: Accelerator | None = None  # whose trackers receive the samples
        self._numbering = StepNumbering(self._training_forwards)  # also before watch()
        self._holding: HoldingSink | None = None
        self._run_directory: Path | None = None

    @property
    def tracker(self) -> Observer | None:
        """The core observer while watching (``None`` before ``watch`` and on unobserved ranks)."""
        return self._observer

    @property
    def run_directory(self) -> Path | None:
        """The run directory ``watch`` chose (``rank-NNN/`` inside under ``rank_policy="all"``).

        ``None`` before ``watch``, without ``write_directory``, and on processes that do not
        observe. It stays set after ``finish``, for reading the run.
        """
        return self._run_directory

    def watch(self, model: nn.Module, *, accelerator: Accelerator | None = None) -> Observer | None:
        """Observe ``model`` (before or after ``accelerator.prepare``). Call it on every process.

        Args:
            model: The model the training loop calls. Layer names are the original ones
                (``module.`` of DDP and similar wrapper attributes are left out).
            accelerator: Where to route scalars and histograms (its ``trackers``), the default
                folder (its ``logging_dir``) and the fp16 loss scale (its ``scaler``) come from.
                By default the one ``Accelerator`` whose ``log_with`` holds this tracker.

        Returns:
            The core observer, or ``None`` on a process that does not observe.

        Raises:
            ConfigurationError: ``model`` is not a module, or the tracker already watches one.

        Warns:
            ObservationWarning: ``accelerator`` was not given and not exactly one ``Accelerator``
                holds this tracker: nothing is routed; the message names the folder written.
        """
        if not isinstance(model, nn.Module):
            raise ConfigurationError.invalid("model", type(model).__name__, "a torch.nn.Module")
        if self._clock is not None:
            raise ConfigurationError("this tracker already watches a model; call finish() first")
        holders = 1
        if accelerator is None:
            accelerator, holders = accelerator_holding(self)
        state = PartialState()
        main = state.is_main_process
        folder, run_id = self._shared(accelerator, main=main)
        if self.policies.rank_policy == "rank0" and not main:
            return None
        if accelerator is None:
            warnings.warn(_unrouted(holders, folder), ObservationWarning, stacklevel=2)
        self._run_directory = folder
        sink = self._sink(folder, accelerator if main else None)
        self._holding = HoldingSink(sink, self._numbering, error_policy=self.policies.error_policy)
        self._observer = self.observe.inject(
            model, sink=self._holding, policies=self.policies, run_id=run_id
        )
        if self.policies.rank_policy == "all":
            # Every process holds its sink before any creates its rank-NNN/ (at its first
            # sample); a sink created later would take that folder for an older run's.
            state.wait_for_everyone()
        if self.unscale_gradients:
            # called as each sample opens: after the scaler's update() that follows a tick
            scaler = getattr(accelerator, "scaler", None)
            self._observer.set_gradient_scale(loss_scale_reader(scaler, state.device))
        self._clock = OptimizerClock(model, self._on_optimizer_step)
        self._begin()
        if folder is not None and main:
            log.info("TelemetryTracker: writing the run directory to %s", folder)
        return self._observer

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Number the optimizer step in progress ``step`` (see "Steps"); ``values`` are ignored."""
        if step is None:
            return
        self._numbering.logged(int(step))
        if self._holding is not None:
            self._holding.release()

    @override
    def finish(self) -> None:
        """Remove every hook and finalize the run directory. Safe to call again, on any process.

        Routing stops first (``end_training`` may have closed the other trackers already): a
        sample still on its way or held for its number goes to the run directory only.
        """
        clock, self._clock = self._clock, None
        if clock is not None:
            clock.remove()
        self._routed = None
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.remove()  # closes the holding sink: held samples go out, numbered
            self._holding = None
            self._numbering = StepNumbering(self._training_forwards)  # for a later watch()

    def _on_optimizer_step(self) -> None:
        if self._observer is not None and self._holding is not None:
            self._observer.end_step()
            self._numbering.stepped()
            self._holding.release()
            self._begin()

    def _begin(self) -> None:
        assert self._observer is not None
        step = self._numbering.step  # the tracker's count: the sink renumbers the samples
        self._observer.begin_step(step, sample=self.schedule.samples(step))

    def _training_forwards(self) -> int:
        return self._observer.training_forwards if self._observer is not None else 0

    def _other_trackers(self) -> list[Target]:
        # Looked up at each write, so watch() may come before init_trackers(); none after finish().
        if self._routed is None:
            return []
        return tracker_targets(t for t in self._routed.trackers if t.name != self.name)

    def _sink(self, folder: Path | None, accelerator: Accelerator | None) -> Sink:
        routed = self.log_to_trackers and accelerator is not None
        self._routed = accelerator if routed else None
        targets: Callable[[], list[Target]] | list[Target] = self._other_trackers if routed else []
        return telemetry_sink(output_dir=folder, targets=targets, routing=self.routing)

    def _shared(
        self, accelerator: Accelerator | None, *, main: bool
    ) -> tuple[Path | None, str | None]:
        """The run folder and run id the main process chose, on every process that observes."""
        folder, run_id = None, None
        if main:
            parent = accelerator.logging_dir if accelerator is not None else None
            base = self.output_dir or Path(parent or self.logging_dir or ".") / "telemetry"
            run_id = new_run_id()
            base = base.absolute()
            fresh = fresh_folder(base.parent, base.name, run_id)
            folder = fresh.path if self.write_directory else None
        if self.policies.rank_policy == "all":
            # Collective: every process takes part, and all of them write under main's folder.
            folder, run_id = broadcast_object_list([folder, run_id])
        return folder, run_id


def _unrouted(holders: int, folder: Path | None) -> str:
    """The warning of ``watch`` without an accelerator, when none or several hold the tracker."""
    found = "no Accelerator holds" if holders == 0 else f"{holders} Accelerators hold"
    where = f"writing the run directory to {folder}" if folder else "writing no run directory"
    return (
        f"TelemetryTracker.watch(model) got no accelerator and {found} this tracker in log_with: "
        "nothing is routed into the other trackers and the fp16 loss scale is not read; "
        f"{where}. Pass watch(model, accelerator=accelerator)."
    )
