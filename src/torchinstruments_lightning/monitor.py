"""``TelemetryMonitor``: per-layer activation and gradient telemetry for a Lightning ``Trainer``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

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
from torchinstruments_core.run_directory import RunFolder, fresh_folder, resumed_folder
from torchinstruments_lightning._loggers import has_tensorboard, logger_targets, run_name

if TYPE_CHECKING:
    from collections.abc import Sequence

    import lightning.pytorch as pl

    from torchinstruments_core import Observer, Reducer
    from torchinstruments_core.selectors import SelectorFn


class TelemetryMonitor(Callback):
    r"""Samples per-layer statistics of outputs and output gradients every ``every_n_steps`` steps.

    The forwards and backwards of every ``every_n_steps``-th optimizer step
    (``trainer.global_step`` 0, n, 2n …) are sampled, every micro-batch of it under
    ``accumulate_grad_batches`` (one sample each), and every row carries ``trainer.global_step``
    as its ``step``. Validation, test and predict batches are sampled only when asked, as
    forward-only samples at the current global step; the sanity check never is, and none of them
    shifts the training schedule. Manual optimization works the same way.

    Hooks are placed on the ``LightningModule`` when fitting starts (or a sampled validate, test or
    predict run starts) and removed on teardown and on an exception (``KeyboardInterrupt``
    included); the run directory is finalized each time. Under ``16-mixed`` the gradients are
    recorded divided by the GradScaler's current scale, i.e. unscaled, as the optimizer sees them
    (``unscale_gradients=False`` records them scaled); ``bf16-mixed`` needs no scaling.

    Logged metrics:
        Into ``trainer.loggers`` on global rank 0, at ``trainer.global_step``:

        - ``<prefix>/<layer>/<signal>/<metric>``: for each focus layer (up to
          ``max_histogram_modules``, see ``histogram_selector``), ``signal`` ``output`` and
          ``output_gradient``, ``metric`` in ``scalar_metrics`` (default ``rms``, ``max_abs``,
          ``nonfinite_fraction``). A second call of a module adds ``/call_<k>`` after the signal,
          a tensor inside a nested output its path (``/output.0``).
        - ``<prefix>/<layer>/<signal>/histogram``: the histogram of the same tensors, to
          TensorBoardLogger (raw histograms) and WandbLogger (``wandb.Histogram``, with
          ``trainer/global_step``); other loggers (CSV, MLflow …) get the scalars only.
        - ``<prefix>/nonfinite_tensors``: how many observed tensors held NaN or Inf in the sample.
        - ``<prefix>/collection_duration_ms``: host time spent observing the sample.

        Every layer's full statistics go to the run directory (``rank-NNN/`` per rank under
        ``rank_policy="all"``): ``history.parquet``, ``samples.parquet``, ``result.json``,
        ``index.md``, and ``tensorboard/`` unless a TensorBoardLogger already holds the same
        histograms and scalars (see ``directory_tensorboard``).

    Runs and folders:
        Each fit (each sampled validate, test or predict run too) is a run with a new ``run_id``,
        so ``(run_id, rank, sample_id)`` is a unique key of the long table across all folders,
        even when one callback fits twice or a fit resumes from an earlier checkpoint. The run
        directory is named after the run, by the first logger's version (TensorBoardLogger,
        CSVLogger: ``version_3``; WandbLogger, MLFlowLogger: the run id), else the ``run_id``:

        - ``<trainer.log_dir>/telemetry/`` where the log dir already is the run's own
          (TensorBoardLogger, CSVLogger: ``.../version_3/telemetry/``);
        - ``<trainer.log_dir>/telemetry/<name>/`` where runs share it (WandbLogger: ``save_dir``;
          no logger: ``default_root_dir``), e.g. ``./telemetry/3fa9x2k1/``;
        - with ``-<run_id>`` appended where that folder already holds a run (a fresh run is
          never taken for a resumed one).

        A fit resumed from a checkpoint (``ckpt_path``) continues the checkpoint's sample ids and
        step axis under a new ``run_id``, in ``<that folder>-resumed-<k>/`` (the first run's
        ``<name>``, kept in the checkpoint), beside the first run's when the log dir is the same.
        Global rank 0 logs the folder chosen (INFO); nothing is ever overwritten.

    Args:
        every_n_steps: Sample every this many optimizer steps.
        output_dir: The run directory, instead of one named after the run (see "Runs and
            folders"). If it already holds a run, ``<output_dir>-<run_id>`` is used instead; a
            resumed fit writes ``<output_dir>-resumed-<k>``.
        log_to_loggers: Route scalars and histograms into ``trainer.loggers``.
        write_directory: Write the run directory.
        directory_tensorboard: Also write TensorBoard event files into the run directory's
            ``tensorboard/``. ``None`` (default): only when no TensorBoardLogger receives the
            routing (``log_to_loggers`` off, or none among ``trainer.loggers``), so that
            ``tensorboard --logdir <version dir>`` shows each tag once.
        prefix: First part of every logged key.
        scalar_metrics: Metrics routed to the loggers as scalars.
        scalar_layers: ``"focus"``, ``"all"``, or glob patterns of layer names.
        selector: Which modules are observed (default: every leaf module).
        reducers: Scalar reducers (default: the eleven metrics of ``default_reducers()``).
        histogram_selector: Which modules are the focus layers (histograms and logged scalars).
            Default: modules with parameters of their own, spread over the model's depth (first
            and last included) and always the one with the most parameters; parameter-free
            modules only when fewer have parameters, and never ``Flatten``, ``Identity``,
            dropout or pooling, whose statistics repeat the layer before them.
        max_histogram_modules: At most this many focus layers.
        rank_policy: ``"rank0"`` observes only global rank 0; ``"all"`` every rank, each writing
            its own ``rank-NNN/``; routing into loggers stays on rank 0.
        error_policy: ``"warn"`` keeps training when observing fails; ``"raise"`` stops.
        sample_validation: Also sample validation batches (forward only).
        sample_test: Also sample test batches.
        sample_predict: Also sample predict batches.
        unscale_gradients: Divide gradients by the fp16 loss scale before measuring them.

    Example::

        trainer = Trainer(callbacks=[TelemetryMonitor(every_n_steps=50)],
                          logger=TensorBoardLogger("logs"))
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        *,
        output_dir: str | Path | None = None,
        log_to_loggers: bool = True,
        write_directory: bool = True,
        directory_tensorboard: bool | None = None,
        prefix: str = "telemetry",
        scalar_metrics: Sequence[str] = DEFAULT_SCALAR_METRICS,
        scalar_layers: str | Sequence[str] = "focus",
        selector: SelectorFn | None = None,
        reducers: Sequence[Reducer] | None = None,
        histogram_selector: SelectorFn | None = None,
        max_histogram_modules: int = 8,
        rank_policy: str = "rank0",
        error_policy: str = "warn",
        sample_validation: bool = False,
        sample_test: bool = False,
        sample_predict: bool = False,
        unscale_gradients: bool = True,
    ) -> None:
        self.schedule = StepSchedule(every_n_steps)
        self.policies = AdapterPolicies.parse(rank_policy, error_policy)
        self.routing = RoutingOptions.parse(prefix, scalar_metrics, scalar_layers)
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.log_to_loggers = log_to_loggers
        self.write_directory = write_directory
        self.directory_tensorboard = directory_tensorboard
        self.sampled_stages = {
            "validate": sample_validation,
            "test": sample_test,
            "predict": sample_predict,
        }
        self.unscale_gradients = unscale_gradients
        self.observe = ObserveOptions(selector, reducers, histogram_selector, max_histogram_modules)
        self._observer: Observer | None = None
        self._run_directory: Path | None = None
        # The state a checkpoint saves now, and the one restored for the next attach.
        self._state: dict[str, Any] = {}
        self._restored: dict[str, Any] | None = None

    @property
    def observer(self) -> Observer | None:
        """The core observer while attached (``None`` before fitting and on unobserved ranks)."""
        return self._observer

    @property
    def run_directory(self) -> Path | None:
        """The current or last run's directory (``None`` before it, or without one)."""
        return self._run_directory

    # Attached at the start of the stage, not in setup: a checkpoint's callback state (sample ids
    # to continue) is restored between the two.
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attach(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.sampled_stages["validate"]:
            self._attach(trainer, pl_module)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.sampled_stages["test"]:
            self._attach(trainer, pl_module)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.sampled_stages["predict"]:
            self._attach(trainer, pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._detach()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._observer is None:
            return
        step = trainer.global_step
        # The step, not the root forward, is the sampling unit: a training_step may call only
        # submodules, so samples are opened explicitly and root forwards never sample by themselves.
        self._observer.begin_step(step, sample=False)
        if self.schedule.samples(step):
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            reader = loss_scale_reader(scaler, pl_module.device) if self.unscale_gradients else None
            self._observer.set_gradient_scale(reader)
            self._observer.open_sample(step)

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any
    ) -> None:
        if self._observer is not None:
            self._observer.finish_forward()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._observer is not None:
            self._observer.finish_forward()
            self._observer.end_step()

    @override
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.sampled_stages["validate"] and not trainer.sanity_checking:
            self._open_forward_only(trainer)

    @override
    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._finish_forward_only()

    @override
    def on_test_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.sampled_stages["test"]:
            self._open_forward_only(trainer)

    @override
    def on_test_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._finish_forward_only()

    @override
    def on_predict_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.sampled_stages["predict"]:
            self._open_forward_only(trainer)

    @override
    def on_predict_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._finish_forward_only()

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._observer is not None:
            self._state["samples_taken"] = self._observer.samples_taken
        return dict(self._state)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)
        self._state = dict(state_dict)

    def _open_forward_only(self, trainer: pl.Trainer) -> None:
        if self._observer is not None:
            self._observer.set_gradient_scale(None)
            self._observer.open_sample(trainer.global_step)

    def _finish_forward_only(self) -> None:
        if self._observer is not None:
            self._observer.finish_forward()
            self._observer.flush()

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._observer is not None:
            return
        resume = self._resume(trainer)
        # Collective calls (log_dir, broadcast, barrier): every rank takes part before any rank
        # decides not to observe.
        log_dir = trainer.log_dir if self.write_directory else None
        folder, run_id = None, new_run_id()
        if self.write_directory and trainer.is_global_zero:
            root = Path(log_dir or trainer.default_root_dir)
            folder = self._choose_folder(trainer, root, run_id, resume)
        folder, run_id = trainer.strategy.broadcast((folder, run_id))
        self._run_directory = folder.path if folder is not None else None
        first = int(resume.get("samples_taken", 0)) if resume is not None else 0
        if self.policies.rank_policy == "all" or trainer.is_global_zero:
            self._inject(trainer, pl_module, folder, run_id, first)
        self._state = {"samples_taken": first, "run_id": run_id}
        if folder is not None:
            self._state["run_name"] = folder.name
            rank_zero_info(f"TelemetryMonitor: {_describe(run_id, resume)} {folder.path.resolve()}")
        # Every rank holds its sink before any creates its rank-NNN/ folder (at its first
        # sample); a sink built later would take that folder for an older run's.
        trainer.strategy.barrier("torchinstruments-attach")

    def _resume(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        """The checkpoint's state when this fit resumes one (``{}`` if it holds none of ours)."""
        restored, self._restored = self._restored, None
        # Only a fit restores callback state; validate(ckpt_path=...) resumes no run.
        if trainer.state.fn == TrainerFn.FITTING and (restored or trainer.ckpt_path):
            return restored or {}
        return None

    def _choose_folder(
        self, trainer: pl.Trainer, log_dir: Path, run_id: str, resume: dict[str, Any] | None
    ) -> RunFolder:
        """The rule of "Runs and folders" in the class docstring."""
        name = run_name(trainer.loggers)
        if self.output_dir is None and name is not None and log_dir.name == name:
            # The log dir is the run's own (.../version_3/telemetry); the name goes with the state.
            folder = self._folder_in(log_dir / "telemetry", run_id, resume)
            return RunFolder(folder.path, name)
        base = self.output_dir or log_dir / "telemetry" / str(
            (resume or {}).get("run_name") or name or run_id
        )
        return self._folder_in(base, run_id, resume)

    @staticmethod
    def _folder_in(base: Path, run_id: str, resume: dict[str, Any] | None) -> RunFolder:
        if resume is not None:
            return resumed_folder(base.parent, base.name)
        return fresh_folder(base.parent, base.name, run_id)

    def _inject(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        folder: RunFolder | None,
        run_id: str,
        first_sample_id: int,
    ) -> None:
        targets = (
            logger_targets(trainer.loggers)
            if self.log_to_loggers and trainer.is_global_zero
            else []
        )
        tensorboard = self.directory_tensorboard
        if tensorboard is None:
            tensorboard = not (self.log_to_loggers and has_tensorboard(trainer.loggers))
        sink = telemetry_sink(
            output_dir=folder.path if folder else None,
            targets=targets,
            routing=self.routing,
            tensorboard=tensorboard,
        )
        self._observer = self.observe.inject(
            pl_module,
            sink=sink,
            policies=self.policies,
            run_id=run_id,
            first_sample_id=first_sample_id,
        )
        self._observer.begin_step(trainer.global_step, sample=False)

    def _detach(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            self._state["samples_taken"] = observer.samples_taken
            observer.remove()


def _describe(run_id: str, resume: dict[str, Any] | None) -> str:
    if resume is None:
        return f"new run {run_id}, run directory"
    earlier = resume.get("run_id")
    continues = f" continuing run {earlier}" if earlier else ""
    first = int(resume.get("samples_taken", 0))
    return f"resumed run {run_id}{continues} from sample {first}, run directory"
