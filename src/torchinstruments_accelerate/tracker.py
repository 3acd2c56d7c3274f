"""``TelemetryTracker``: per-layer activation and gradient telemetry as an Accelerate tracker."""

from __future__ import annotations

import logging
import warnings
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelerate.state import PartialState
from accelerate.tracking import GeneralTracker
from accelerate.utils import broadcast_object_list
from torch import nn
from typing_extensions import override

from torchinstruments_accelerate._trackers import (
    accelerator_holding,
    has_tensorboard,
    lacks,
    tracker_targets,
)
from torchinstruments_core import ConfigurationError, ObservationWarning
from torchinstruments_core._deprecation import renamed_argument
from torchinstruments_core.adapter import (
    ErrorPolicy,
    HoldingSink,
    OptimizerClock,
    PartCalls,
    StepNumbering,
    TelemetryOptions,
    check_optimizers,
    run_folder,
)

if TYPE_CHECKING:
    import os
    from collections.abc import Callable, Sequence

    import torch
    from accelerate import Accelerator

    from torchinstruments_core import Observer, Sink
    from torchinstruments_core.adapter import NonFiniteWatch, RunFolder
    from torchinstruments_core.routing import Target

log = logging.getLogger(__name__)


@dataclass(eq=False)
class TelemetryTracker(GeneralTracker, TelemetryOptions):  # type: ignore[misc]
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

    Optimizers: each optimizer step of a sampled step is also recorded (the optimizer step
    signals: parameters, the gradients the optimizer uses, updates, optimizer state), numbered
    like that step's samples. ``watch(..., optimizer=...)`` names the optimizers (the ones
    ``accelerator.prepare`` returned, or the torch ones inside); with several, a step ends once
    each of them has stepped. Without it, the tracker (which never sees the loop, and reads no
    private ``Accelerator`` attribute) finds the optimizer as torch steps it: the first whose
    step updates one of the model's parameters, through torch's global optimizer step hooks,
    before its first step runs. A second optimizer found that way warns
    (``ObservationWarning``) and is neither recorded nor counted: pass every one to ``watch``.

    Non-finite values: a value the loop logs (``accelerator.log``) under a key containing
    ``loss`` (any case), a float or a one-element tensor, is checked without waiting for the
    device (a tensor's check is read at the next optimizer step); when it is NaN or Inf the
    optimizer steps after the one in progress are sampled, ``sample_after_nonfinite`` of them. A
    sampled step with NaN or Inf values is named in the log and the other trackers when it is
    delivered (at its ``log`` or the next optimizer step, see above), and that call acts on it:
    ``on_nonfinite="stop"`` sets ``should_stop`` for the loop to read, ``"raise"`` raises
    ``NonFiniteError`` out of ``accelerator.log`` or ``optimizer.step()``.

    ``finish`` (which ``accelerator.end_training()`` calls on the main process) removes every hook
    and finalizes the run directory. Accelerate keeps trackers on the main process only; under
    ``rank_policy="all"`` the other processes finalize theirs when they end, under any launcher
    (a ``debug_launcher`` or ``notebook_launcher`` child too), or earlier if you call ``finish``
    there. A script that never calls it, dies of an exception or receives SIGTERM still gets a
    finalized directory, and the chunks in ``history.parts/`` are readable at any time. Under
    fp16 the gradients are recorded divided by ``accelerator.scaler``'s loss scale, as the
    optimizer sees them.

    Logged metrics:
        The keys of ``TelemetryOptions``, into ``accelerator.trackers`` on the main process at
        the step above: histograms to the TensorBoard tracker (raw histograms, its ``writer``)
        and the W&B tracker (``wandb.Histogram``, its ``run``, with W&B's ``step=``), scalars to
        every tracker (MLflow, Comet … through their ``log``); the non-finite message as text
        to the TensorBoard and W&B trackers. The optimizer step's keys (the focus layers'
        ``…/parameter_gradient/<parameter>/rms`` and ``…/update/<parameter>/update_to_weight``,
        ``<prefix>/model/parameter_gradient/l2_norm``, ``…/nonfinite_count``, ``…/zero_count``
        and ``<prefix>/model/update/l2_norm``) are at the same step as the samples, the step of
        the user's loss. The run directory is by default
        ``<accelerator.logging_dir>/telemetry`` (the project directory; ``./telemetry`` when
        neither is known); ``watch`` logs its absolute path at INFO on the main process. It
        has no ``tensorboard/`` of its own where a TensorBoard tracker gets the routing (one in
        ``log_with``: ``tensorboard --logdir <project_dir>`` shows each tag once); the other
        processes under ``rank_policy="all"``, and a run with ``log_to_loggers=False``, write it.

    It takes every option of ``TelemetryOptions`` by keyword (``log_to_loggers`` routes into
    the accelerator's other trackers), plus the ones below.

    Args:
        run_name: Set by Accelerate when the tracker is registered by name
            (``register_tracker_class``); not used.
        logging_dir: Set by Accelerate when registered by name: the default folder's parent.
        log_to_trackers: Deprecated name of ``log_to_loggers`` (warns; ``None`` after the
            constructor).

    Example::

        telemetry = TelemetryTracker(every_n_steps=50)
        accelerator = Accelerator(log_with=["tensorboard", telemetry], project_dir="runs")
        accelerator.init_trackers("exp")
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        telemetry.watch(model, accelerator=accelerator, optimizer=optimizer)
    """

    name = "torchinstruments"
    requires_logging_directory = True
    main_process_only = False  # finish() works wherever it is called; the rank gate is watch()'s

    run_name: str | None = None
    logging_dir: str | os.PathLike[str] | None = None
    _: KW_ONLY
    log_to_trackers: bool | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        GeneralTracker.__init__(self)
        if self.run_name is not None and not isinstance(self.run_name, str):
            raise ConfigurationError.invalid(
                "run_name",
                self.run_name,
                "a str (Accelerate's run name); pass every_n_steps by keyword",
            )
        self.log_to_loggers = renamed_argument(
            "TelemetryTracker",
            "log_to_loggers",
            self.log_to_loggers,
            "log_to_trackers",
            self.log_to_trackers,
            True,
        )
        self.log_to_trackers = None
        super().__post_init__()
        if self.run_name is not None and self.rank_policy == "all":
            raise ConfigurationError(
                "rank_policy='all' needs a tracker on every process, and Accelerate creates a "
                "tracker registered by name on the main process only: pass an instance in log_with"
            )
        self._observer: Observer | None = None
        self._clock: OptimizerClock | None = None
        self._parts: PartCalls | None = None  # a loop calling the model's parts (``_parts``)
        self._sampling: int | None = None  # the step in progress, if sampled
        self._routed: Accelerator | None = None  # whose trackers receive the samples
        self._numbering = StepNumbering(self._training_forwards)  # also before watch()
        self._holding: HoldingSink | None = None
        self._watch: NonFiniteWatch | None = None
        self._should_stop = False
        self._run_directory: Path | None = None

    @property
    def tracker(self) -> Observer | None:
        """The core observer while watching (``None`` before ``watch`` and on unobserved ranks)."""
        return self._observer

    @property
    def should_stop(self) -> bool:
        """Whether ``on_nonfinite="stop"`` asks the loop to stop (a sample went non-finite).

        Read-only; set at the optimizer step or ``log`` that follows the sample's delivery and
        reset by ``watch``. A loop checks it: ``if telemetry.should_stop: break``.
        """
        return self._should_stop

    @property
    def run_directory(self) -> Path | None:
        """The run directory ``watch`` chose (``rank-NNN/`` inside under ``rank_policy="all"``).

        ``None`` before ``watch``, without ``write_directory``, and on processes that do not
        observe. It stays set after ``finish``, for reading the run.
        """
        return self._run_directory

    def watch(
        self,
        model: nn.Module,
        *,
        accelerator: Accelerator | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    ) -> Observer | None:
        """Observe ``model`` (before or after ``accelerator.prepare``). Call it on every process.

        Args:
            model: The model the training loop calls. Layer names are the original ones
                (``module.`` of DDP and similar wrapper attributes are left out).
            accelerator: Where to route scalars and histograms (its ``trackers``), the default
                folder (its ``logging_dir``) and the fp16 loss scale (its ``scaler``) come from.
                By default the one ``Accelerator`` whose ``log_with`` holds this tracker.
            optimizer: The optimizer, or all of them, that train ``model`` (prepared or not):
                their steps are counted and recorded. By default the first optimizer found
                stepping one of the model's parameters (see "Optimizers").

        Returns:
            The core observer, or ``None`` on a process that does not observe.

        Raises:
            ConfigurationError: ``model`` is not a module, ``optimizer`` not an optimizer (or
                a sequence of them), or the tracker already watches a model.

        Warns:
            ObservationWarning: ``accelerator`` was not given and not exactly one ``Accelerator``
                holds this tracker: nothing is routed; the message names the folder written.
        """
        if not isinstance(model, nn.Module):
            raise ConfigurationError.invalid("model", type(model).__name__, "a torch.nn.Module")
        optimizers = () if optimizer is None else check_optimizers(optimizer)
        if self._clock is not None:
            raise ConfigurationError("this tracker already watches a model; call finish() first")
        holders = 1
        given = accelerator
        if accelerator is None:
            accelerator, holders = accelerator_holding(self)
        state = PartialState()
        main = state.is_main_process
        folder, run_id = self.agree_on_run(
            # A collective only where every process observes (and so calls watch).
            _broadcast if self.rank_policy == "all" else _local,
            main=main,
            choose=lambda run_id: self._choose_folder(accelerator, run_id),
        )
        if not self.observes(main=main):
            return None
        self._run_directory = folder.path if folder is not None else None
        if accelerator is None:
            warnings.warn(_unrouted(holders, self._run_directory), ObservationWarning, stacklevel=2)
        elif given is not None and lacks(given, self):
            warnings.warn(_not_held(self._run_directory), ObservationWarning, stacklevel=2)
        self._should_stop = False
        sink = self._sink(folder, accelerator if self.routes(main=main) else None)
        self._holding = HoldingSink(
            sink, self._numbering, error_policy=ErrorPolicy(self.error_policy)
        )
        self._observer = self.inject(model, sink=self._holding, run_id=run_id)
        if self.rank_policy == "all":
            # Every process holds its sink before any creates its rank-NNN/ (at its first
            # sample); a sink created later would take that folder for an older run's.
            state.wait_for_everyone()
        # read as each sample opens: after the scaler's update() that follows a tick
        scaler = getattr(accelerator, "scaler", None)
        self._observer.set_gradient_scale(self.gradient_scale(scaler, state.device))
        self._clock = OptimizerClock(
            model,
            self._on_optimizer_step,
            on_optimizer=self._observer.watch_optimizer,
            optimizers=optimizers,
        )
        self._parts = PartCalls.of(self._observer, model, lambda: self._sampling)  # (``_parts``)
        self._begin()
        if folder is not None and main:
            log.info("TelemetryTracker: writing the run directory to %s", folder.path)
        return self._observer

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Number the step in progress ``step`` (see "Steps"); check the losses in ``values``.

        Raises:
            NonFiniteError: Under ``on_nonfinite="raise"``, when a sample released here (or
                delivered since the last optimizer step) held non-finite values.
        """
        if self._watch is not None:
            self._watch.check_logged(values)
        if step is not None:
            self._numbering.logged(int(step))
            if self._holding is not None:
                self._holding.release()
        self._act()

    @override
    def finish(self) -> None:
        """Remove every hook and finalize the run directory. Safe to call again, on any process.

        Routing stops first (``end_training`` may have closed the other trackers already): a
        sample still on its way or held for its number goes to the run directory only.
        """
        clock, self._clock = self._clock, None
        if clock is not None:
            clock.remove()
        parts, self._parts = self._parts, None
        if parts is not None:
            parts.remove()
        self._routed = None
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.remove()  # closes the holding sink: held samples go out, numbered
            self._holding = None
            self._watch = None
            self._numbering = StepNumbering(self._training_forwards)  # for a later watch()

    def _on_optimizer_step(self) -> None:
        if self._observer is not None and self._holding is not None:
            self._observer.end_step()
            self._numbering.stepped()
            self._holding.release()
            self._begin()
            self._act()

    def _begin(self) -> None:
        assert self._observer is not None
        assert self._watch is not None
        step = self._numbering.step  # the tracker's count: the sink renumbers the samples
        sample = self._watch.begin_step(step)
        self._sampling = step if sample else None
        self._observer.begin_step(step, sample=sample)

    def _act(self) -> None:
        if self._watch is not None and self._watch.act():
            self._should_stop = True

    def _training_forwards(self) -> int:
        # the model's own, or its parts' where the loop calls them (``_parts``)
        parts = self._parts.count if self._parts is not None else 0
        return parts + (self._observer.training_forwards if self._observer is not None else 0)

    def _other_trackers(self) -> list[Target]:
        # Looked up at each write, so watch() may come before init_trackers(); none after finish().
        if self._routed is None:
            return []
        return tracker_targets(t for t in self._routed.trackers if t.name != self.name)

    def _sink(self, folder: RunFolder | None, routed: Accelerator | None) -> Sink:
        self._routed = routed
        targets: Callable[[], list[Target]] | list[Target] = self._other_trackers if routed else []
        self._watch = self.nonfinite_watch(targets)
        # no tensorboard/ of the run directory's own where a TensorBoard tracker gets the same
        # tags: ``tensorboard --logdir <project_dir>`` would show each of them twice
        tensorboard = routed is None or not has_tensorboard(routed)
        return self.sink(folder, targets, tensorboard=tensorboard, watch=self._watch)

    def _choose_folder(self, accelerator: Accelerator | None, run_id: str) -> RunFolder:
        """``output_dir``, else ``telemetry`` in the accelerator's logging dir, ours, or ``.``."""
        if self.output_dir is not None:
            base = Path(self.output_dir)
        else:
            parent = accelerator.logging_dir if accelerator is not None else None
            base = Path(parent or self.logging_dir or ".") / "telemetry"
        return run_folder(base.absolute(), run_id)


def _broadcast(value: Any) -> Any:
    """The main process's ``value`` on every process (Accelerate's collective)."""
    return broadcast_object_list([value])[0]


def _local(value: Any) -> Any:
    return value


def _not_held(folder: Path | None) -> str:
    """The warning of ``watch(model, accelerator=...)`` when its ``log_with`` lacks the tracker."""
    where = f"writing the run directory to {folder}" if folder else "writing no run directory"
    return (
        "TelemetryTracker.watch(model, accelerator=...): that Accelerator's log_with does not "
        "hold this tracker, so accelerator.log never reaches it and end_training() does not "
        "finish it: its steps keep the tracker's own count (0, 1, 2 ...) instead of your "
        "step= numbers, and the run closes at finish() or when the process ends; "
        f"{where}. Pass it in Accelerator(log_with=[..., telemetry])."
    )


def _unrouted(holders: int, folder: Path | None) -> str:
    """The warning of ``watch`` without an accelerator, when none or several hold the tracker."""
    found = "no Accelerator holds" if holders == 0 else f"{holders} Accelerators hold"
    where = f"writing the run directory to {folder}" if folder else "writing no run directory"
    return (
        f"TelemetryTracker.watch(model) got no accelerator and {found} this tracker in log_with: "
        "nothing is routed into the other trackers and the fp16 loss scale is not read; "
        f"{where}. Pass watch(model, accelerator=accelerator)."
    )
