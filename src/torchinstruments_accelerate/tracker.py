"""``TelemetryTracker``: per-layer activation and gradient telemetry as an Accelerate tracker."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelerate.state import PartialState  # type: ignore[import-untyped]
from accelerate.tracking import GeneralTracker  # type: ignore[import-untyped]
from accelerate.utils import broadcast_object_list  # type: ignore[import-untyped]
from torch import nn
from typing_extensions import override

from torchinstruments_accelerate._clock import OptimizerClock
from torchinstruments_accelerate._trackers import tracker_targets
from torchinstruments_core import ConfigurationError
from torchinstruments_core.adapter import (
    AdapterPolicies,
    ObserveOptions,
    RoutingOptions,
    StepSchedule,
    loss_scale_reader,
    new_run_id,
    telemetry_sink,
)
from torchinstruments_core.routing import DEFAULT_SCALAR_METRICS
from torchinstruments_core.run_directory import next_free_folder

if TYPE_CHECKING:
    import os
    from collections.abc import Callable, Sequence

    from accelerate import Accelerator  # type: ignore[import-untyped]

    from torchinstruments_core import Observer, Reducer, Sink
    from torchinstruments_core.routing import Target
    from torchinstruments_core.selectors import SelectorFn

log = logging.getLogger(__name__)


class TelemetryTracker(GeneralTracker):  # type: ignore[misc]
    """Samples per-layer statistics of outputs and output gradients every ``every_n_steps`` steps.

    Pass it in ``Accelerator(log_with=[...])`` beside the other trackers and call ``watch`` on the
    model (prepared or not) on every process. A tracker never sees the model, hence ``watch``; and
    it never sees the other trackers, hence ``watch(..., accelerator=accelerator)``, which routes
    into them. Without ``accelerator`` only the run directory is written.

    Steps: the tracker counts optimizer steps itself, alike on every process (a post-hook on the
    optimizer that steps the model's parameters: under ``accelerator.accumulate`` one tick per
    gradient synchronization; a step the fp16 scaler skips is not counted). It samples every
    forward of the watched model during steps 0, n, 2n …: each micro-batch of an accumulated step
    is one sample, and so is any other forward of the model in that step, such as an evaluation
    batch (a forward-only sample). A sample's ``step`` is that count unless, on the main process,
    ``accelerator.log(..., step=u)`` says otherwise: ``u`` then numbers the optimizer step in
    progress (the first step, when logged before ``watch``; the next one, ``u + 1``, when a
    forward of the current step was sampled already) and later steps count on from there. The
    schedule does not move, and the other processes keep the plain count.

    ``finish`` (which ``accelerator.end_training()`` calls on the main process) removes every hook
    and finalizes the run directory; call it yourself on the other processes under
    ``rank_policy="all"`` (Accelerate keeps trackers on the main process only). A script that
    never calls it, or dies of an exception, still gets a finalized directory at interpreter exit,
    and the chunks in ``history.parts/`` are readable at any time. Under fp16 the gradients are
    recorded divided by ``accelerator.scaler``'s loss scale, as the optimizer sees them.

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

    Args:
        run_name: Set by Accelerate when the tracker is registered by name
            (``register_tracker_class``); not used.
        logging_dir: Set by Accelerate when registered by name: the default folder's parent.
        every_n_steps: Sample every this many optimizer steps.
        output_dir: The run directory (default above). If it already holds a run,
            ``<output_dir>-resumed-<k>`` is used instead; nothing is overwritten.
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
        self._steps = 0  # optimizer steps taken since watch()
        self._offset = 0  # the user's step minus ours, from accelerator.log(..., step=)
        self._samples_at_begin = 0
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

        Returns:
            The core observer, or ``None`` on a process that does not observe.

        Raises:
            ConfigurationError: ``model`` is not a module, or the tracker already watches one.
        """
        if not isinstance(model, nn.Module):
            raise ConfigurationError.invalid("model", type(model).__name__, "a torch.nn.Module")
        if self._clock is not None:
            raise ConfigurationError("this tracker already watches a model; call finish() first")
        state = PartialState()
        main = state.is_main_process
        folder, run_id = self._shared(accelerator, main=main)
        if self.policies.rank_policy == "rank0" and not main:
            return None
        self._run_directory = folder
        self._observer = self.observe.inject(
            model,
            sink=self._sink(folder, accelerator if main else None),
            policies=self.policies,
            run_id=run_id,
        )
        if self.policies.rank_policy == "all":
            # Every process holds its sink before any creates its rank-NNN/ (at its first
            # sample); a sink created later would take that folder for an older run's.
            state.wait_for_everyone()
        if self.unscale_gradients:
            # called as each sample opens: after the scaler's update() that follows a tick
            scaler = getattr(accelerator, "scaler", None)
            self._observer.set_gradient_scale(loss_scale_reader(scaler, state.device))
        self._steps = 0
        self._clock = OptimizerClock(model, self._on_optimizer_step)
        self._begin()
        if folder is not None and main:
            log.info("TelemetryTracker: writing the run directory to %s", folder)
        return self._observer

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Follow the user's ``step`` if given (see "Steps"); ``values`` are for other trackers."""
        if step is None:
            return
        if self._observer is None:
            self._offset = int(step)  # before watch(): its first step is the user's
            return
        self._offset = int(step) - self._steps
        if self._observer.samples_taken == self._samples_at_begin:
            self._begin()  # no forward of this step sampled yet: renumber it

    @override
    def finish(self) -> None:
        """Remove every hook and finalize the run directory. Safe to call again, on any process.

        Routing stops first (``end_training`` may have closed the other trackers already): a
        sample still on its way goes to the run directory only.
        """
        clock, self._clock = self._clock, None
        if clock is not None:
            clock.remove()
        self._routed = None
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.remove()

    def _on_optimizer_step(self) -> None:
        if self._observer is not None:
            self._observer.end_step()
            self._steps += 1
            self._begin()

    def _begin(self) -> None:
        assert self._observer is not None
        sampled = self.schedule.samples(self._steps)
        self._observer.begin_step(self._steps + self._offset, sample=sampled)
        self._samples_at_begin = self._observer.samples_taken

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
            folder = next_free_folder(base) if self.write_directory else None
            run_id = new_run_id()
        if self.policies.rank_policy == "all":
            # Collective: every process takes part, and all of them write under main's folder.
            folder, run_id = broadcast_object_list([folder, run_id])
        return folder, run_id
