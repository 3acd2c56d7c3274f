"""``TelemetryCallback``: per-layer telemetry in a Transformers ``Trainer``."""

from __future__ import annotations

import gc
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from transformers.integrations.integration_utils import (
    INTEGRATION_TO_CALLBACK,
    TensorBoardCallback,
    WandbCallback,
)
from transformers.trainer_callback import CallbackHandler, TrainerCallback, TrainerControl
from typing_extensions import override

from torchinstruments_core import ObservationWarning
from torchinstruments_core.adapter import RunFolder, TelemetryOptions, run_folder
from torchinstruments_core.routing import ScalarTarget, SummaryWriterTarget, WandbRunTarget

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import TrainerState, TrainingArguments

    from torchinstruments_core import Observer
    from torchinstruments_core.adapter import NonFiniteWatch
    from torchinstruments_core.routing import Target

log = logging.getLogger(__name__)

# WandbCallback logs the Trainer's step under this key; our rows use it too, so they line up.
WANDB_STEP_KEY = "train/global_step"
# What a CallbackHandler hands each event from its own attributes, all set before
# on_train_begin; the dataloader is a new one in each train().
HANDED = ("model", "optimizer", "lr_scheduler", "train_dataloader")


@dataclass(eq=False, kw_only=True)
class TelemetryCallback(TrainerCallback, TelemetryOptions):
    """Samples per-layer statistics of outputs and output gradients every ``every_n_steps`` steps.

    Pass it in ``Trainer(callbacks=[...])``. Each optimizer step is numbered as the Trainer logs
    its loss: by ``state.global_step`` once the optimizer has stepped (the first step is 1). The
    first step and every step whose number is a multiple of ``every_n_steps`` (n, 2n …) are
    sampled, so with ``logging_steps`` a divisor of ``every_n_steps`` the telemetry sits at the
    steps of the Trainer's own ``train/loss`` logs, in every logger. One sample per micro-batch
    under ``gradient_accumulation_steps``, with ``gradient_checkpointing``, ``bf16`` and ``fp16``
    alike. A non-finite sample or logged loss is handled as ``on_nonfinite`` says ("stop" sets
    ``control.should_training_stop``) and the following steps are sampled densely. Under
    ``fp16`` the gradients are recorded divided by the loss scale (``unscale_gradients``).

    Optimizers: the Trainer's optimizer (the ``optimizer`` its callback events pass; the torch
    optimizer inside Accelerate's wrapper) is watched when training starts, so each optimizer
    step of a sampled step is also recorded (the optimizer step signals: parameters, the
    gradients the optimizer uses, updates, optimizer state) under the same ``global_step`` as
    that step's samples and the Trainer's ``train/loss``.

    Hooks are placed on the model when training starts and removed when it ends, which
    finalizes the run directory. The Trainer has no hook for an exception: the hooks then stay
    until the next ``train()`` and the run directory is finalized when the process ends.

    Logged metrics:
        The keys of ``TelemetryOptions``, on the main process, into the integrations that
        ``report_to`` enabled: histograms and scalars to TensorBoard (the
        ``TensorBoardCallback``'s writer) and W&B (the run, with ``train/global_step``),
        scalars to the other integrations (their ``on_log``). The optimizer step's keys (the
        focus layers' ``…/parameter_gradient/<parameter>/rms`` and
        ``…/update/<parameter>/update_to_weight``, ``<prefix>/model/parameter_gradient/l2_norm``,
        ``…/nonfinite_count``, ``…/zero_count`` and ``<prefix>/model/update/l2_norm``) are at the
        same step. The run directory holds no
        ``tensorboard/`` when TensorBoard receives the routing. Several Trainers may share the
        model and the callback (training phases, an earlier Trainer still referenced): each
        ``train()`` routes into the integrations of the Trainer running it, found as the one
        whose callback handler hands the event its model, optimizer, scheduler and dataloader
        (where several do, it warns, ``ObservationWarning``, and routes nothing).

    Runs and folders:
        Each ``train()`` is a run with a new ``run_id`` (a resumed one too), so
        ``(run_id, rank, sample_id)`` is unique across folders. The run directory is
        ``<args.output_dir>/telemetry`` (or ``output_dir``); ``-<run_id>`` is appended when that
        folder already holds a run, and a run resumed from a checkpoint writes
        ``telemetry-resumed-<k>``. Nothing is overwritten; the main process logs the folder.

    It takes every option of ``TelemetryOptions`` by keyword.

    Example::

        trainer = Trainer(model, args, train_dataset=data,
                          callbacks=[TelemetryCallback(every_n_steps=50)])
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        self._observer: Observer | None = None
        self._run_directory: Path | None = None
        self._routed: CallbackHandler | None = None  # whose integrations receive the samples
        self._args: TrainingArguments | None = None
        self._watch: NonFiniteWatch | None = None

    @property
    def observer(self) -> Observer | None:
        """The core observer while training (``None`` otherwise and on unobserved ranks)."""
        return self._observer

    @property
    def run_directory(self) -> Path | None:
        """The current or last run's directory (``None`` before it, or without one)."""
        return self._run_directory

    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._detach()  # a train() that raised left its hooks
        main = state.is_world_process_zero
        resumed = state.global_step > 0
        folder, run_id = self.agree_on_run(
            _broadcast if self.rank_policy == "all" else _local,
            main=main,
            choose=lambda run_id: self._choose_folder(args, run_id, resumed=resumed),
        )
        self._run_directory = folder.path if folder is not None else None
        if self.observes(main=main):
            observer = self._inject(args, kwargs, folder, run_id, routes=self.routes(main=main))
            optimizer = kwargs.get("optimizer")
            scaler = getattr(optimizer, "scaler", None)  # Accelerate's fp16 scaler
            observer.set_gradient_scale(self.gradient_scale(scaler, args.device))
            if optimizer is not None:
                observer.watch_optimizer(optimizer)
        if folder is not None and main:
            log.info("TelemetryCallback: run %s, run directory %s", run_id, folder.path)
        if self.rank_policy == "all" and dist.is_available() and dist.is_initialized():
            # Every rank holds its sink before any creates its rank-NNN/ (at its first sample).
            dist.barrier()

    @override
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._observer is not None and self._watch is not None:
            # Numbered as the Trainer logs it (after the optimizer step): the first step, and
            # every one whose logged step is a multiple of n, like logging_steps' loss logs.
            step = state.global_step + 1
            sampled = self._watch.begin_step(step) or step == 1
            self._observer.begin_step(step, sample=sampled)

    @override
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._observer is None:
            return
        self._observer.end_step()
        if self._watch is not None and self._watch.act():  # on_nonfinite: "raise" raises here
            control.should_training_stop = True
        if control.should_training_stop or state.global_step >= state.max_steps:
            # The last samples reach the loggers now: TensorBoard closes its writer first.
            self._observer.flush()

    @override
    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if self._watch is not None and logs:
            self._watch.check_logged(logs)  # a non-finite loss samples the next steps densely

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._detach()

    def _inject(
        self,
        args: TrainingArguments,
        event: dict[str, Any],
        folder: RunFolder | None,
        run_id: str,
        *,
        routes: bool,
    ) -> Observer:
        self._routed = _handler_calling(self, event, folder) if routes else None
        self._args = args
        callbacks = self._routed.callbacks if self._routed is not None else []
        tensorboard = not any(isinstance(cb, TensorBoardCallback) for cb in callbacks)
        targets: Callable[[], list[Target]] | list[Target] = self._targets if routes else []
        self._watch = self.nonfinite_watch(targets)
        sink = self.sink(folder, targets, tensorboard=tensorboard, watch=self._watch)
        self._observer = self.inject(event["model"], sink=sink, run_id=run_id)
        return self._observer

    def _targets(self) -> list[Target]:
        # Looked up at each write: a writer opens at train begin and closes at train end.
        if self._routed is None or self._args is None:
            return []
        return integration_targets(self._routed.callbacks, self._args)

    def _detach(self) -> None:
        self._routed = None
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.remove()

    def _choose_folder(self, args: TrainingArguments, run_id: str, *, resumed: bool) -> RunFolder:
        base = Path(self.output_dir or Path(str(args.output_dir)) / "telemetry")
        return run_folder(base.absolute(), run_id, resumed=resumed)


def integration_targets(callbacks: list[TrainerCallback], args: TrainingArguments) -> list[Target]:
    """TensorBoard and W&B take histograms and scalars; the other integrations scalars."""
    others = tuple(INTEGRATION_TO_CALLBACK.values())
    targets: list[Target] = []
    for callback in callbacks:
        if isinstance(callback, TensorBoardCallback):
            if callback.tb_writer is not None:
                targets.append(SummaryWriterTarget(callback.tb_writer))
        elif isinstance(callback, WandbCallback):
            import wandb  # present: WandbCallback imports it

            if wandb.run is not None:
                targets.append(WandbRunTarget(wandb.run, step_key=WANDB_STEP_KEY))
        elif isinstance(callback, others):
            targets.append(ScalarTarget(_on_log(callback, args)))
    return targets


def _on_log(
    callback: TrainerCallback, args: TrainingArguments
) -> Callable[[dict[str, float], int], Any]:
    """An integration's ``on_log``, at the sample's step instead of the Trainer's current one."""
    from transformers import TrainerState

    def log_metrics(metrics: dict[str, float], step: int) -> Any:
        return callback.on_log(args, TrainerState(global_step=step), TrainerControl(), logs=metrics)

    return log_metrics


def _handler_calling(
    callback: TelemetryCallback, event: dict[str, Any], folder: RunFolder | None
) -> CallbackHandler | None:
    """The Trainer's ``CallbackHandler`` that hands ``callback`` this ``event``.

    Callbacks are not given the Trainer nor each other, so the garbage collector's list of
    objects is searched, once per ``train()``, for the handler holding ``callback`` and each
    object of ``HANDED`` the event carries: an earlier Trainer on the same model and callback,
    still referenced, holds another dataloader. ``None``, with a warning, when several match.
    """
    found = [
        candidate
        for candidate in gc.get_objects()
        if type(candidate) is CallbackHandler
        and any(cb is callback for cb in candidate.callbacks)
        and all(getattr(candidate, name, None) is event.get(name) for name in HANDED)
    ]
    if len(found) > 1:
        warnings.warn(_ambiguous(len(found), folder), ObservationWarning, stacklevel=2)
    return found[0] if len(found) == 1 else None


def _ambiguous(handlers: int, folder: RunFolder | None) -> str:
    """The warning of ``on_train_begin`` when several Trainers hand it the same objects."""
    where = f"writing the run directory to {folder.path}" if folder else "writing no run directory"
    return (
        f"TelemetryCallback: {handlers} Trainers hold this callback with the same model, "
        "optimizer, lr_scheduler and train_dataloader, so the one training is unknown: nothing "
        f"is routed into the report_to integrations; {where} (with its own tensorboard/)."
    )


def _broadcast(value: Any) -> Any:
    """The main process's ``value`` on every process (a collective where one is running)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _local(value: Any) -> Any:
    return value
