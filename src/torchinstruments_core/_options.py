"""``TelemetryOptions``: the options every trainer adapter takes, declared and checked once.

An adapter is a dataclass that inherits these fields and adds only its own; the methods turn the
options into what the adapter asks of the core: the schedule, the rank gate, the shared run, the
sink and the observer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchinstruments_core._config import (
    ErrorPolicy,
    NonFinitePolicy,
    RankPolicy,
    check_positive_int,
    parse_choice,
)
from torchinstruments_core._inject import _check_reducers, _selector, inject_observer, new_run_id
from torchinstruments_core._layers import DEFAULT_MAX_FOCUS_LAYERS, focus_arguments
from torchinstruments_core._optimizer_probe import DEFAULT_STEP_SIGNALS, parse_step_signals
from torchinstruments_core._watch import NonFiniteWatch
from torchinstruments_core.routing import DEFAULT_SCALAR_METRICS, LoggerRouter
from torchinstruments_core.run_directory import (
    RunDirectorySink,
    RunFolder,
    fresh_folder,
    resumed_folder,
)
from torchinstruments_core.sinks import MultiSink

if TYPE_CHECKING:
    import os
    from collections.abc import Callable, Iterable, Sequence

    from torch import nn

    from torchinstruments_core._observer import Observer
    from torchinstruments_core.reducers import Reducer
    from torchinstruments_core.routing import Target
    from torchinstruments_core.selectors import SelectorFn
    from torchinstruments_core.sinks import Sink


@dataclass(eq=False, kw_only=True)
class TelemetryOptions:
    """The options of every trainer adapter, checked in the constructor.

    Logged metrics:
        Into the trainer's loggers, on the main process, at the step of the sample (each adapter
        says which step that is and which of its loggers take histograms):

        - ``<prefix>/<layer>/<signal>/<metric>``: for each focus layer, ``signal`` ``output``
          and ``output_gradient``, ``metric`` in ``scalar_metrics``. A second call of a module
          adds ``/call_<k>`` after the signal, a tensor inside a nested output its path
          (``/output.0``).
        - ``<prefix>/<layer>/<signal>/histogram``: the histogram of the same tensors, to the
          loggers that take histograms (TensorBoard, W&B); the others get the scalars only.
        - ``<prefix>/<layer>/parameter_gradient/<parameter>/rms`` and
          ``<prefix>/<layer>/update/<parameter>/update_to_weight``: for each focus layer and
          each of its parameters (``weight``, ``bias``), at a sampled optimizer step, the rms of
          the gradient the optimizer used and rms(update) / rms(parameter before the step); the
          metrics are those the signal's definition routes (``SignalSpec.routed_metrics``), not
          ``scalar_metrics``.
        - ``<prefix>/model/parameter_gradient/l2_norm``, ``…/nonfinite_count``,
          ``…/zero_count`` and ``<prefix>/model/update/l2_norm``: over every observed parameter
          at a sampled optimizer step, the global gradient norm, how many gradient entries are
          NaN or Inf and how many are zero, and the norm of the update.
        - ``<prefix>/nonfinite_tensors``: how many observed tensors held NaN or Inf in the sample
          (``<prefix>/step/nonfinite_tensors`` for an optimizer step's tensors).
        - ``<prefix>/collection_duration_ms``: host time spent observing the sample
          (``<prefix>/step/collection_duration_ms`` for an optimizer step).
        - ``<prefix>/nonfinite_onset``: 1 at the step of a sample whose values turned
          non-finite (the first of an episode, see ``on_nonfinite``), to every logger;
          ``<prefix>/nonfinite``, the message naming the layers, as text to the loggers that
          take text (TensorBoard ``add_text``, W&B ``wandb.Html``).
        - A forward-only sample's keys (no backward reached it: a validation batch, an
          evaluation under ``torch.no_grad`` in a sampled step) have ``forward_only/`` after
          the prefix (``<prefix>/forward_only/<layer>/output/rms``,
          ``<prefix>/forward_only/nonfinite_tensors``), so that they never share a curve with
          the training samples of the same step.

        Every layer's full statistics go to the run directory (``rank-NNN/`` inside per process
        under ``rank_policy="all"``): ``history.parquet``, ``samples.parquet``, ``result.json``,
        ``index.md`` and ``tensorboard/``.

    Attributes:
        every_n_steps: Sample every this many optimizer steps: steps 0, n, 2n … of the trainer.
        output_dir: The run directory, instead of the adapter's default. If it already holds a
            run, ``<output_dir>-<run_id>`` is used instead (nothing is overwritten); a run
            resumed from a checkpoint writes ``<output_dir>-resumed-<k>``.
        write_directory: Write the run directory.
        log_to_loggers: Route scalars and histograms into the trainer's loggers (Lightning's
            ``trainer.loggers``, Accelerate's other trackers).
        prefix: First part of every logged key.
        scalar_metrics: Metrics routed to the loggers as scalars (default ``rms``,
            ``max_abs``, ``nonfinite_fraction``).
        scalar_layers: Whose scalars are routed: ``"focus"`` (the focus layers), ``"all"``, or
            glob patterns of layer names.
        selector: Which modules are observed (default: every leaf module).
        reducers: Scalar reducers (default: the metrics of ``reducers.DEFAULT_METRICS``, from
            ``default_reducers()``; add ``precision_reducers()`` for fp8/fp16/bf16 range).
        focus_selector: Which observed modules are the focus layers, whose histograms and
            scalars go to the loggers. Default: modules with parameters of their own, spread
            over the model's depth (first and last included) and always the one with the most
            parameters; parameter-free modules only when fewer have parameters, and never
            ``Flatten``, ``Identity``, dropout or pooling, whose statistics repeat the layer
            before them.
        max_focus_layers: At most this many focus layers (0: none, and no histograms).
        rank_policy: ``"rank0"`` observes only the main process (global rank 0); ``"all"``
            every process, each writing its own ``rank-NNN/``; routing into the loggers stays
            on the main process.
        error_policy: ``"warn"`` keeps training when observing fails (the values recorded as
            unavailable, one warning per cause); ``"raise"`` stops.
        on_nonfinite: What a sampled step with NaN or Inf values does: ``"warn"`` logs a
            WARNING naming its step and the first non-finite layer of the forward and of the
            backward (where it started or was passed on) and sends it to the loggers (see
            "Logged metrics"); ``"stop"`` also asks the trainer to stop; ``"raise"`` also raises
            ``NonFiniteError``; ``"ignore"`` does none of it. Reported once per episode: the
            next non-finite samples are not, until a sample is finite again.
        sample_after_nonfinite: Sample every one of the this-many steps that follow a
            non-finite loss or a non-finite sample, so the onset is recorded at full resolution
            (0: no dense sampling). The loss is checked once per step without waiting for the
            device, and read at the next step.
        unscale_gradients: Divide gradients by the fp16 loss scale before measuring them, so
            that they are the gradients the optimizer sees (bf16 and fp32 need no unscaling).
        step_signals: The optimizer step signals recorded at each sampled step's optimizer
            step (default all four: ``"parameter"``, ``"parameter_gradient"``, ``"update"``,
            ``"optimizer_state"``; see ``inject_observer``). Leave out ``"update"`` to save
            its memory (one copy of the observed parameters during the recorded step); an
            empty tuple records none.
        record_inputs: Also record each observed call's input tensors and their gradients
            (signals ``input``, ``input_gradient``; to the run directory, not the loggers), as
            ``inject_observer(record_inputs=True)``.
        profile: Also record each observed call's forward and backward time and, on CUDA, its
            memory (signals ``time``, ``memory``; to the run directory), as
            ``inject_observer(profile=True)``; on CUDA it resets the allocator's peak statistic
            in sampled steps (see the README).
        background_reductions: On the CPU, reduce sampled tensors on a worker thread while
            the model computes (``None``: where torch's threads leave a core free and samples
            are not small), as ``inject_observer(background_reductions=...)``.
        histogram_selector: Deprecated name of ``focus_selector`` (warns; ``None`` after the
            constructor).
        max_histogram_modules: Deprecated name of ``max_focus_layers`` (warns; ``None`` after
            the constructor).

    Raises:
        ConfigurationError: An option is invalid (naming it, the value and the choices), or
            given under its deprecated name and its new one.
    """

    every_n_steps: int = 50
    output_dir: str | os.PathLike[str] | None = None
    write_directory: bool = True
    log_to_loggers: bool = True
    prefix: str = "telemetry"
    scalar_metrics: Sequence[str] = DEFAULT_SCALAR_METRICS
    scalar_layers: str | Sequence[str] = "focus"
    selector: SelectorFn | None = None
    reducers: Sequence[Reducer] | None = None
    focus_selector: SelectorFn | None = None
    max_focus_layers: int = DEFAULT_MAX_FOCUS_LAYERS
    rank_policy: str = "rank0"
    error_policy: str = "warn"
    on_nonfinite: str = "warn"
    sample_after_nonfinite: int = 10
    unscale_gradients: bool = True
    step_signals: Sequence[str] = DEFAULT_STEP_SIGNALS
    record_inputs: bool = False
    profile: bool = False
    background_reductions: bool | None = None
    histogram_selector: SelectorFn | None = field(default=None, repr=False)
    max_histogram_modules: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        self.focus_selector, self.max_focus_layers = focus_arguments(
            owner,
            self.focus_selector,
            self.max_focus_layers,
            self.histogram_selector,
            self.max_histogram_modules,
        )
        self.histogram_selector = self.max_histogram_modules = None
        check_positive_int("every_n_steps", self.every_n_steps, minimum=1)
        self.rank_policy = parse_choice(RankPolicy, "rank_policy", self.rank_policy)
        self.error_policy = parse_choice(ErrorPolicy, "error_policy", self.error_policy)
        self.on_nonfinite = parse_choice(NonFinitePolicy, "on_nonfinite", self.on_nonfinite)
        check_positive_int("sample_after_nonfinite", self.sample_after_nonfinite, minimum=0)
        parse_step_signals(self.step_signals)
        self.step_signals = tuple(self.step_signals)
        _selector(self.selector)
        if self.reducers is not None:
            self.reducers = _check_reducers(self.reducers)
        self.scalar_metrics = tuple(self.scalar_metrics)
        if not isinstance(self.scalar_layers, str):
            self.scalar_layers = tuple(self.scalar_layers)
        # Checked now, naming the argument, rather than at the first sample.
        LoggerRouter(
            (),
            prefix=self.prefix,
            scalar_metrics=self.scalar_metrics,
            scalar_layers=self.scalar_layers,
        )
        if self.output_dir is not None:
            self.output_dir = Path(self.output_dir)

    def is_sampled(self, step: int) -> bool:
        """Whether the trainer's optimizer step ``step`` (0, 1, 2 …) is sampled."""
        return step % self.every_n_steps == 0

    def nonfinite_watch(
        self, targets: Sequence[Target] | Callable[[], Iterable[Target]]
    ) -> NonFiniteWatch:
        """A ``NonFiniteWatch`` with these options, reporting into ``targets``: one per run.

        Pass it to ``sink`` so that it sees every record, ask it ``begin_step(step)`` instead
        of ``is_sampled(step)``, give it the loss (``check_loss``) and call ``act()`` after the
        step (see the adapter contract).
        """
        schedule = TriggeredSchedule(self.every_n_steps, self.sample_after_nonfinite)
        return NonFiniteWatch(
            schedule,
            policy=NonFinitePolicy(self.on_nonfinite),
            targets=targets,
            prefix=self.prefix,
            owner=type(self).__name__,
        )

    def observes(self, *, main: bool) -> bool:
        """Whether this process observes: the main one (global rank 0), or all of them."""
        return main or self.rank_policy == RankPolicy.ALL

    def routes(self, *, main: bool) -> bool:
        """Whether this process routes into the trainer's loggers: the main one, if asked."""
        return main and self.log_to_loggers

    def agree_on_run(
        self, broadcast: Callable[[Any], Any], *, main: bool, choose: Callable[[str], RunFolder]
    ) -> tuple[RunFolder | None, str]:
        """The run folder and run id the main process chose, on every process that calls this.

        The main process draws the run id and asks ``choose(run_id)`` for the folder (the
        folder is ``None`` without ``write_directory``); ``broadcast`` hands both to the other
        processes, so that every rank writes under one folder with one run id.

        Args:
            broadcast: The trainer's broadcast from the main process: it takes a picklable
                value and returns the main process's value on every process (Lightning's
                ``trainer.strategy.broadcast``). A collective: every process that takes part
                must call this. The identity where only the main process observes.
            main: Whether this process is the main one (global rank 0).
            choose: The folder of a run id, e.g. ``run_folder(base, run_id)``; called on the
                main process only.

        Returns:
            The folder (``None`` without ``write_directory``) and the run id.
        """
        run_id = new_run_id()
        folder = choose(run_id) if main and self.write_directory else None
        folder, run_id = broadcast((folder, run_id))
        return folder, run_id

    def sink(
        self,
        folder: RunFolder | None,
        targets: Sequence[Target] | Callable[[], Iterable[Target]],
        *,
        tensorboard: bool = True,
        watch: NonFiniteWatch | None = None,
    ) -> Sink:
        """The run directory in ``folder`` and the routing into ``targets``, as one sink.

        Args:
            folder: The run folder, or ``None`` for no run directory.
            targets: The trainer's loggers as routing targets (``SummaryWriterTarget``,
                ``WandbRunTarget``, ``ScalarTarget``), or a function returning them at each
                write (see ``LoggerRouter``); empty where ``routes`` is false.
            tensorboard: Whether the run directory writes its own ``tensorboard/``.
            watch: The run's ``NonFiniteWatch``, which then sees every record.
        """
        sinks: list[Sink] = []
        if folder is not None:
            sinks.append(RunDirectorySink(folder.path, tensorboard=tensorboard))
        if targets:
            sinks.append(
                LoggerRouter(
                    targets,
                    prefix=self.prefix,
                    scalar_metrics=self.scalar_metrics,
                    scalar_layers=self.scalar_layers,
                )
            )
        if watch is not None:
            sinks.append(watch)
        return MultiSink(sinks)

    def inject(
        self,
        model: nn.Module,
        *,
        sink: Sink,
        run_id: str,
        first_sample_id: int = 0,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> Observer:
        """Observe ``model`` with these options (``inject_observer``), writing to ``sink``.

        ``optimizers`` are the trainer's optimizers, all of them: their sampled steps give the
        optimizer step signals (``step_signals``).
        """
        return inject_observer(
            model,
            sink=sink,
            selector=self.selector,
            reducers=self.reducers,
            focus_selector=self.focus_selector,
            max_focus_layers=self.max_focus_layers,
            rank_policy=self.rank_policy,
            error_policy=self.error_policy,
            run_id=run_id,
            first_sample_id=first_sample_id,
            optimizer=list(optimizers) or None,
            step_signals=self.step_signals,
            record_inputs=self.record_inputs,
            profile=self.profile,
            background_reductions=self.background_reductions,
        )

    def gradient_scale(
        self, scaler: Any, device: torch.device
    ) -> Callable[[], torch.Tensor] | None:
        """What to pass to ``Observer.set_gradient_scale``: ``loss_scale_reader`` or ``None``.

        ``None`` without ``unscale_gradients``, so that gradients are recorded as scaled.
        """
        return loss_scale_reader(scaler, device) if self.unscale_gradients else None


@dataclass(slots=True)
class TriggeredSchedule:
    """Every ``every_n_steps``-th step, plus every step of a dense window after a trigger.

    ``trigger(s)`` samples steps ``s + 1`` … ``s + dense_steps`` besides the regular ones (a
    window already open is extended); with ``dense_steps=0`` it does nothing. An unsampled step
    costs one modulo and two comparisons.

    Example:
        >>> schedule = TriggeredSchedule(every_n_steps=10, dense_steps=3)
        >>> schedule.trigger(4)
        7
        >>> [s for s in range(12) if schedule.is_sampled(s)]
        [0, 5, 6, 7, 10]
    """

    every_n_steps: int
    dense_steps: int
    dense_from: int = 0
    dense_until: int = -1

    def is_sampled(self, step: int) -> bool:
        """Whether the trainer's optimizer step ``step`` is sampled."""
        return step % self.every_n_steps == 0 or self.dense_from <= step <= self.dense_until

    def trigger(self, step: int) -> int | None:
        """Sample the steps after ``step`` densely; the last one so sampled (``None``: none)."""
        if self.dense_steps == 0:
            return None
        if step >= self.dense_until:  # no window open after ``step``: a new one
            self.dense_from = step + 1
        self.dense_until = max(self.dense_until, step + self.dense_steps)
        return self.dense_until


def run_folder(base: Path, run_id: str, *, resumed: bool = False) -> RunFolder:
    """The folder of a run at ``base``: ``base`` itself unless it holds an earlier run.

    A fresh run takes ``<base>-<run_id>`` when ``base`` holds a run; a run resumed from a
    checkpoint takes the first free ``<base>-resumed-<k>``. Nothing is ever overwritten.
    """
    if resumed:
        return resumed_folder(base.parent, base.name)
    return fresh_folder(base.parent, base.name, run_id)


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
