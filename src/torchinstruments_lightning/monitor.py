"""``TelemetryMonitor``: per-layer activation and gradient telemetry for a Lightning ``Trainer``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from torchinstruments_core.adapter import RunFolder, TelemetryOptions, run_folder
from torchinstruments_lightning._loggers import (
    has_tensorboard,
    logger_targets,
    logging_step,
    run_name,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from torchinstruments_core import Observer
    from torchinstruments_core.adapter import NonFiniteWatch


@dataclass(eq=False, kw_only=True)
class TelemetryMonitor(Callback, TelemetryOptions):
    r"""Samples per-layer statistics of outputs and output gradients every ``every_n_steps`` steps.

    Steps are the ones Lightning logs at, the x-axis of ``self.log`` and of its loggers
    (``_loggers.logging_step``): with one optimizer, ``trainer.global_step`` during a training
    batch and one less in the validation after it; with several optimizers, or under manual
    optimization, Lightning's count of batches (``global_step`` counts optimizer steps). The
    forwards and backwards of every ``every_n_steps``-th step (0, n, 2n …) are sampled, every
    micro-batch of it under ``accumulate_grad_batches`` (one sample each), and every row
    carries that step as its ``step``, so the telemetry lines up with the losses it is logged
    beside. Validation, test and predict batches are sampled only when asked, as forward-only
    samples at the step their own metrics are logged at; the sanity check never is, and none of
    them shifts the training schedule. Under manual optimization each forward and backward of a
    sampled step's ``training_step`` is a sample of its own at that step (a GAN's generator
    phase, then its discriminator phase): after each ``manual_backward`` the next selected module
    to run, if any, starts another sample. Every sample starts at the first selected module that
    runs: a sampled batch that runs none (``training_step`` returned ``None``,
    ``on_train_batch_start`` returned -1, a validation batch that returned or raised before its
    forward) leaves no sample.

    Hooks are placed on the ``LightningModule`` when fitting starts (or a sampled validate, test or
    predict run starts) and removed on teardown and on an exception (``KeyboardInterrupt``
    included); the run directory is finalized each time. Under ``16-mixed`` the gradients are
    recorded divided by the GradScaler's current scale, i.e. unscaled, as the optimizer sees them
    (``unscale_gradients=False`` records them scaled); ``bf16-mixed`` needs no scaling.

    Optimizer step signals: every optimizer in ``trainer.optimizers`` is watched
    (``Observer.watch_optimizer``), so the optimizer step of each sampled step is recorded at
    that step in a step record: the parameters before it, the gradients it used
    (after accumulation over ``accumulate_grad_batches``, unscaling under ``16-mixed`` and
    ``gradient_clip_val`` clipping), the update with ``update_to_weight``, the optimizer's state
    and the whole-model gradient and update norms (``step_signals`` chooses which). A sampled
    step whose optimizer step the fp16 GradScaler skips has only a note in ``samples.parquet``.
    Under manual optimization a sampled batch that steps no optimizer (gradients accumulated by
    hand) has the first optimizer step after it recorded at its step, unless another sampled
    batch comes first (then that batch's step is the one recorded); such a batch is never
    noted skipped, a GradScaler's skip under manual optimization neither.

    Non-finite values: the loss a ``training_step`` returns (``outputs["loss"]``, or the
    tensor itself) is checked at each batch end without waiting for the device and read at the
    next batch start; a non-finite loss at step ``s`` has steps ``s + 1`` …
    ``s + sample_after_nonfinite`` sampled. A sampled step with NaN or Inf values is named in
    the log and the loggers when it is delivered (on the CPU at its own batch end), and the same
    batch end acts on it: ``on_nonfinite="stop"`` sets ``trainer.should_stop`` (the fit ends
    after that batch), ``"raise"`` raises ``NonFiniteError`` from ``on_train_batch_end``, which
    ends the fit; the run directory is finalized either way.

    Logged metrics:
        The keys of ``TelemetryOptions``, into ``trainer.loggers`` on global rank 0 at the
        step above: histograms to TensorBoardLogger (raw histograms) and
        WandbLogger (``wandb.Histogram``, with ``trainer/global_step``), scalars to every logger
        (CSV, MLflow …); the non-finite message as text to TensorBoardLogger and WandbLogger.
        The run directory holds no ``tensorboard/`` when a TensorBoardLogger
        already holds the same histograms and scalars (see ``directory_tensorboard``).

    Runs and folders:
        Each fit (each sampled validate, test or predict run too) is a run with a new ``run_id``,
        so ``(run_id, rank, sample_id)`` is a unique key of the long table across all folders,
        even when one callback fits twice or a fit resumes from an earlier checkpoint. The run
        directory (or ``output_dir``) is named after the run, by the first logger's version
        (TensorBoardLogger, CSVLogger: ``version_3``; WandbLogger, MLFlowLogger: the run id),
        else the ``run_id``:

        - ``<trainer.log_dir>/telemetry/`` where the log dir already is the run's own
          (TensorBoardLogger, CSVLogger: ``.../version_3/telemetry/``);
        - ``<trainer.log_dir>/telemetry/<name>/`` where runs share it (WandbLogger: ``save_dir``;
          no logger: ``default_root_dir``), e.g. ``./telemetry/3fa9x2k1/``;
        - with ``-<run_id>`` appended where that folder already holds a run (a fresh run is
          never taken for a resumed one).

        A fit resumed from a checkpoint (``ckpt_path``) continues the checkpoint's sample ids and
        step axis under a new ``run_id``, in ``<that folder>-resumed-<k>/`` (the first run's
        ``<name>``, kept in the checkpoint), beside the first run's when the log dir is the same.
        Global rank 0 logs the folder chosen (INFO); nothing is ever overwritten. A checkpoint
        holds the last fit's run, also when saved during or after a sampled validate, test or
        predict run (``trainer.save_checkpoint`` after ``trainer.test``): a fit resumed from it
        continues the fit, never the evaluation.

    It takes every option of ``TelemetryOptions`` (``every_n_steps`` also positionally), plus
    the ones below.

    Args:
        directory_tensorboard: Also write TensorBoard event files into the run directory's
            ``tensorboard/``. ``None`` (default): only when no TensorBoardLogger receives the
            routing (``log_to_loggers`` off, or none among ``trainer.loggers``), so that
            ``tensorboard --logdir <version dir>`` shows each tag once.
        sample_validation: Also sample validation batches (forward only).
        sample_test: Also sample test batches.
        sample_predict: Also sample predict batches.

    Example::

        trainer = Trainer(callbacks=[TelemetryMonitor(every_n_steps=50)],
                          logger=TensorBoardLogger("logs"))
    """

    every_n_steps: int = field(default=50, kw_only=False)  # TelemetryMonitor(50) as before
    directory_tensorboard: bool | None = None
    sample_validation: bool = False
    sample_test: bool = False
    sample_predict: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._observer: Observer | None = None
        self._watch: NonFiniteWatch | None = None
        self._run_directory: Path | None = None
        self._sampled_step: int | None = None  # the step of the batch being sampled, if any
        self._phase = 1  # which forward and backward of its training_step (manual optimization)
        # Under manual optimization, trainer.global_step (its optimizer steps) as the last
        # sampled batch began, while no optimizer has stepped since (gradients accumulated by
        # hand): that batch's step window stays open for the step its gradients go into.
        self._steps_at_sample: int | None = None
        self._stage: TrainerFn | None = None  # the stage attached in, until it ends
        # The state a checkpoint saves now (the last fit's run), and the one restored for the
        # next attach.
        self._state: dict[str, Any] = {}
        self._restored: dict[str, Any] | None = None
        # Whether this fit restored a checkpoint (not a tuner's own), and whether the one being
        # restored now is a tuner's (``on_load_checkpoint``, before ``load_state_dict``).
        self._checkpoint_restored = False
        self._tuner_restore = False

    @property
    def observer(self) -> Observer | None:
        """The core observer while attached (``None`` before fitting and on unobserved ranks)."""
        return self._observer

    @property
    def run_directory(self) -> Path | None:
        """The current or last run's directory (``None`` before it, or without one).

        Under ``strategy="ddp_spawn"`` (and ``ddp_fork``, ``ddp_notebook``) the callback attaches
        in the processes Lightning starts, and Lightning hands none of a callback's state back
        to the process that called ``fit``: there it stays ``None``. Global rank 0 logs the
        folder (INFO): ``output_dir``, if given and free, else as "Runs and folders" says.
        """
        return self._run_directory

    # Attached at the start of the stage, not in setup: a checkpoint's callback state (sample ids
    # to continue) is restored between the two.
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attach(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.sample_validation:
            self._attach(trainer, pl_module)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.sample_test:
            self._attach(trainer, pl_module)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.sample_predict:
            self._attach(trainer, pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach()
        if stage != "fit" and self._checkpoint_restored:
            # what validate(ckpt_path=...) restored is no later fit's to resume (a state given
            # with load_state_dict before a fit still is)
            self._restored = None

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._detach()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        observer = self._observer
        if observer is None:
            return
        step = logging_step(trainer)
        sampled = self._watch is not None and self._watch.begin_step(step)
        self._sampled_step = step if sampled else None
        self._phase = 1  # the forward and backward of a training_step under way
        if sampled:
            self._open_training_sample(observer, trainer, pl_module, step)
        elif not self._awaits_optimizer_step(trainer):
            observer.begin_step(step, sample=False)

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any
    ) -> None:
        if self._observer is None:
            return
        self._observer.finish_forward()
        step = self._sampled_step
        if step is not None and pl_module.automatic_optimization:
            # the step's forward is done: an LBFGS closure's re-evaluations stay unsampled
            self._observer.begin_step(step, sample=False)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Manual optimization may run more forwards and backwards in the same training_step (a
        # GAN's discriminator after its generator): each is a sample of the batch's step. Under
        # automatic optimization the step's forward is done (an LBFGS closure's re-evaluations
        # stay unsampled). Lazy: the sample starts at the next selected module, if one runs.
        step = self._sampled_step
        if self._observer is not None and step is not None and not pl_module.automatic_optimization:
            self._phase += 1  # its keys go apart: a critic's gradient differs from phase to phase
            self._observer.open_sample(step, lazy=True, scope=f"phase_{self._phase}")

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._observer is not None and self._watch is not None:
            self._watch.check_loss(outputs.get("loss") if isinstance(outputs, dict) else outputs)
            self._observer.finish_forward()
            self._observer.end_step()
            self._sampled_step = None
            if self._watch.act():  # on_nonfinite="stop"; "raise" raises here and ends the fit
                trainer.should_stop = True

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # on_train_batch_start returned -1: the epoch ended before the sampled batch's end
        if self._observer is not None and self._sampled_step is not None:
            self._observer.finish_forward()
            self._observer.end_step()
            self._sampled_step = None

    @override
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.sample_validation and not trainer.sanity_checking:
            self._open_forward_only(trainer)

    @override
    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._finish_forward_only()

    @override
    def on_test_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.sample_test:
            self._open_forward_only(trainer)

    @override
    def on_test_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._finish_forward_only()

    @override
    def on_predict_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.sample_predict:
            self._open_forward_only(trainer)

    @override
    def on_predict_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._finish_forward_only()

    @override
    def state_dict(self) -> dict[str, Any]:
        # Only a fit's run goes on from a checkpoint: a sampled test, validate or predict run is
        # a run of its own, and a checkpoint saved during or after it holds the last fit's.
        if self._observer is not None and self._stage == TrainerFn.FITTING:
            self._state["next_sample_id"] = self._observer.next_sample_id
        return dict(self._state)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # before the stage restores its checkpoint, if it has one
        self._checkpoint_restored = self._tuner_restore = False

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._tuner_restore = _tuner_checkpoint(trainer.ckpt_path)
        self._checkpoint_restored = self._checkpoint_restored or not self._tuner_restore

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._tuner_restore:  # what this callback held when the tuner saved, moments ago
            self._tuner_restore = False
            return
        self._restored = dict(state_dict)
        self._state = dict(state_dict)

    def _open_training_sample(
        self, observer: Observer, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int
    ) -> None:
        """Open the sample of a sampled training batch, started by its first selected module.

        The step, not the root forward, is the sampling unit: a training_step may call only
        submodules, so the sample is opened explicitly; lazily, so that a batch that runs no
        forward (``training_step`` returned ``None``, ``on_train_batch_start`` returned -1)
        leaves no sample. Under automatic optimization the step is announced sampled, which
        opens its optimizer step window now: the optimizer's closure runs the forward only
        after the optimizer's step has begun.
        """
        automatic = pl_module.automatic_optimization
        # by hand, a batch may step no optimizer: not a skipped step (``_awaits_optimizer_step``)
        observer.begin_step(step, sample=automatic, note_unstepped=automatic)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        observer.set_gradient_scale(self.gradient_scale(scaler, pl_module.device))
        observer.open_sample(step, lazy=True)
        if not automatic:
            self._steps_at_sample = trainer.global_step

    def _awaits_optimizer_step(self, trainer: pl.Trainer) -> bool:
        """Whether the last sampled batch's gradients still wait for an optimizer step.

        Under manual optimization a batch may step no optimizer (gradients accumulated by hand
        over several batches); until one steps, the batches after it announce no step of their
        own, so that the sampled batch's step window stays open and the optimizer step its
        gradients go into is recorded, at its step. ``global_step`` counts optimizer steps there.
        """
        if self._steps_at_sample == trainer.global_step:
            return True
        self._steps_at_sample = None
        return False

    def _open_forward_only(self, trainer: pl.Trainer) -> None:
        if self._observer is not None:
            self._observer.set_gradient_scale(None)
            # lazily: a batch that raises or returns before its forward leaves no sample
            self._observer.open_sample(logging_step(trainer), lazy=True)

    def _finish_forward_only(self) -> None:
        if self._observer is not None:
            self._observer.finish_forward()
            self._observer.flush()

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._stage is not None:  # a validation inside the fit: the fit's run goes on
            return
        self._stage = trainer.state.fn
        resume = self._resume(trainer)
        # Collective calls (log_dir, broadcast, barrier): every rank takes part before any rank
        # decides not to observe.
        root = Path((trainer.log_dir if self.write_directory else None) or trainer.default_root_dir)
        folder, run_id = self.agree_on_run(
            trainer.strategy.broadcast,
            main=trainer.is_global_zero,
            choose=lambda run_id: self._choose_folder(trainer, root, run_id, resume),
        )
        self._run_directory = folder.path if folder is not None else None
        first = _first_sample_id(resume)
        if self.observes(main=trainer.is_global_zero):
            self._inject(trainer, pl_module, folder, run_id, first)
        if self._stage == TrainerFn.FITTING:
            self._state = {"next_sample_id": first, "run_id": run_id}
            if folder is not None:
                self._state["run_name"] = folder.name
        if folder is not None:
            rank_zero_info(f"TelemetryMonitor: {_describe(run_id, resume)} {folder.path.resolve()}")
        # Every rank holds its sink before any creates its rank-NNN/ folder (at its first
        # sample); a sink built later would take that folder for an older run's.
        trainer.strategy.barrier("torchinstruments-attach")

    def _resume(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        """The checkpoint's state when this fit resumes one (``{}`` if it holds none of ours)."""
        restored, self._restored = self._restored, None
        # A tuner callback (LearningRateFinder, BatchSizeFinder) restores a checkpoint of its own
        # as fitting starts, which leaves trainer.ckpt_path set: not a resume.
        restoring = self._checkpoint_restored or (
            trainer.ckpt_path is not None and not _tuner_checkpoint(trainer.ckpt_path)
        )
        # Only a fit restores callback state; validate(ckpt_path=...) resumes no run.
        if trainer.state.fn == TrainerFn.FITTING and (restored or restoring):
            return restored or {}
        return None

    def _choose_folder(
        self, trainer: pl.Trainer, log_dir: Path, run_id: str, resume: dict[str, Any] | None
    ) -> RunFolder:
        """The rule of "Runs and folders" in the class docstring."""
        name = run_name(trainer.loggers)
        resumed = resume is not None
        if self.output_dir is None and name is not None and log_dir.name == name:
            # The log dir is the run's own (.../version_3/telemetry); the name goes with the state.
            folder = run_folder(log_dir / "telemetry", run_id, resumed=resumed)
            return RunFolder(folder.path, name)
        if self.output_dir is not None:
            base = Path(self.output_dir)
        else:
            base = log_dir / "telemetry" / str((resume or {}).get("run_name") or name or run_id)
        return run_folder(base, run_id, resumed=resumed)

    def _inject(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        folder: RunFolder | None,
        run_id: str,
        first_sample_id: int,
    ) -> None:
        routes = self.routes(main=trainer.is_global_zero)
        targets = logger_targets(trainer.loggers) if routes else []
        tensorboard = self.directory_tensorboard
        if tensorboard is None:
            tensorboard = not (self.log_to_loggers and has_tensorboard(trainer.loggers))
        self._watch = self.nonfinite_watch(targets)
        sink = self.sink(folder, targets, tensorboard=tensorboard, watch=self._watch)
        self._observer = self.inject(
            pl_module,
            sink=sink,
            run_id=run_id,
            first_sample_id=first_sample_id,
            optimizers=trainer.optimizers,  # all of them; empty outside fitting
        )
        self._observer.begin_step(logging_step(trainer), sample=False)

    def _detach(self) -> None:
        observer, self._observer = self._observer, None
        fitting, self._stage = self._stage == TrainerFn.FITTING, None
        self._steps_at_sample = None
        if observer is not None:
            if fitting:
                self._state["next_sample_id"] = observer.next_sample_id
            observer.remove()


def _describe(run_id: str, resume: dict[str, Any] | None) -> str:
    if resume is None:
        return f"new run {run_id}, run directory"
    earlier = resume.get("run_id")
    continues = f" continuing run {earlier}" if earlier else ""
    first = _first_sample_id(resume)
    return f"resumed run {run_id}{continues} from sample {first}, run directory"


def _first_sample_id(resume: dict[str, Any] | None) -> int:
    """Where a resumed run's sample ids continue (older checkpoints call it ``samples_taken``)."""
    if resume is None:
        return 0
    return int(resume.get("next_sample_id", resume.get("samples_taken", 0)))


_TUNER_CHECKPOINTS = (".lr_find_", ".scale_batch_size_")
"""How the checkpoints of Lightning's tuner (``lr_find``, ``scale_batch_size``) are named: each
saves one as it starts and restores it when done (``lightning.pytorch.tuner``)."""


def _tuner_checkpoint(path: object) -> bool:
    """Whether ``path`` is one of the checkpoints Lightning's tuner saves and restores itself."""
    return path is not None and Path(str(path)).name.startswith(_TUNER_CHECKPOINTS)
