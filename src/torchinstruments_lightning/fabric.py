"""``FabricTelemetry``: per-layer activation and gradient telemetry for Lightning Fabric."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric import is_wrapped
from torch import nn

from torchinstruments_core import ConfigurationError
from torchinstruments_core.adapter import (
    OptimizerClock,
    PartCalls,
    RunFolder,
    TelemetryOptions,
    check_optimizers,
    run_folder,
)
from torchinstruments_lightning._loggers import has_tensorboard, logger_targets

if TYPE_CHECKING:
    from collections.abc import Sequence

    from lightning.fabric import Fabric
    from torch.optim import Optimizer

    from torchinstruments_core import Observer
    from torchinstruments_core.adapter import NonFiniteWatch

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class FabricTelemetry(TelemetryOptions):
    """Samples per-layer statistics of outputs and output gradients every ``every_n_steps`` steps.

    Pass it in ``Fabric(callbacks=[...])``: ``fabric.setup(model, optimizer)`` calls its
    ``on_after_setup`` on every process, which watches that model (the first one set up). After
    ``fabric.setup_module`` (which calls no hook), or under a Fabric release whose ``setup`` does
    not call this hook (2.6.6 does), call ``watch(model, fabric)`` on every process instead. The
    training loop stays as it is.

    Steps: the optimizer steps are counted from the optimizer itself (the core's
    ``OptimizerClock``), alike on every process: one tick per ``optimizer.step()``, so under
    gradient accumulation (``fabric.no_backward_sync``) one per synchronization; a step the fp16
    scaler skips is not counted. Every forward of the model during steps 0, n, 2n … of that count
    is sampled (each micro-batch one sample; an evaluation forward in that step a forward-only
    one) and its rows carry that count as ``step``. Fabric passes no step to its callbacks, so
    log your own scalars under the same count (``fabric.log(..., step=optimizer_steps)``,
    counted from 0 before the step) to line them up.

    Optimizers: each optimizer step of a sampled step is also recorded (the optimizer step
    signals: parameters, the gradients the optimizer uses, updates, optimizer state), numbered
    like that step's samples. With one optimizer nothing is to be done: the first optimizer whose
    step updates one of the model's parameters is found as torch steps it (torch's global
    optimizer step hooks, before its first step runs; Fabric's ``on_after_setup`` is not given
    the optimizers). With several, hand over what ``fabric.setup`` returned:
    ``telemetry.watch_optimizers(optimizer_g, optimizer_d)`` (or ``watch(model, fabric,
    optimizer=[...])``) before the first step; a step then ends once each of them has stepped.
    A second optimizer found without it warns (``ObservationWarning``) and is neither recorded
    nor counted.

    Processes: ``rank_policy`` as in ``TelemetryOptions``; the run id and folder are rank 0's,
    handed to the others with ``fabric.broadcast``. Finalizing: ``finish()`` (or
    ``fabric.call("on_train_end")``) removes every hook and finalizes the run directory; a
    process that never calls it finalizes at its end, on an exception or SIGTERM too. Under
    ``16-mixed`` the gradients are recorded divided by the loss scale, as the optimizer sees them.

    Non-finite values: a sampled step holding NaN or Inf is named in the log and the loggers
    and the next steps are sampled densely (``on_nonfinite``, ``sample_after_nonfinite``);
    ``"stop"`` sets ``should_stop`` for the loop to read, ``"raise"`` raises ``NonFiniteError``
    from the optimizer step. A non-finite loss triggers dense sampling only when handed over
    with ``check_loss(loss)``: Fabric shows callbacks no loss.

    Resuming: save ``telemetry.state_dict()`` with the checkpoint and hand it to
    ``load_state_dict`` before the first step, before or after ``fabric.setup`` (not the
    telemetry itself: it is a handle on hooks and files, never copied; ``copy.deepcopy``
    returns it as it is).
    The resumed run continues the saved sample ids and step count under a new ``run_id``, in a
    folder of its own, so ``(run_id, rank, sample_id)`` stays unique. Without it, a watch after
    ``finish()`` (a new ``Fabric`` for the next fold) is a new run counted from step 0 and
    sample id 0, with ``should_stop`` false again.

    Logged metrics:
        The keys of ``TelemetryOptions``, into ``fabric.loggers`` on global rank 0 at the step
        above: histograms and scalars to TensorBoardLogger (its ``experiment``), scalars to every
        other logger (CSVLogger …, through ``log_metrics``); the optimizer step's keys (the
        focus layers' ``…/parameter_gradient/<parameter>/rms`` and
        ``…/update/<parameter>/update_to_weight``, ``<prefix>/model/parameter_gradient/l2_norm``,
        ``…/nonfinite_count``, ``…/zero_count`` and ``<prefix>/model/update/l2_norm``) at the
        same step as the samples. The run directory is ``output_dir``,
        else ``telemetry/`` in the first logger's ``log_dir`` (``version_3/telemetry``), else
        ``./telemetry``, with ``-<run_id>`` appended where that folder holds a run; it has no
        ``tensorboard/`` when a TensorBoardLogger receives the same histograms. Rank 0 logs
        its absolute path at INFO.

    It takes every option of ``TelemetryOptions`` (``every_n_steps`` also positionally).

    Example::

        telemetry = FabricTelemetry(every_n_steps=50)
        fabric = Fabric(callbacks=[telemetry], loggers=[TensorBoardLogger("logs")])
        model, optimizer = fabric.setup(model, optimizer)  # watched from here on
        fabric.save(path, {"model": model, "telemetry": telemetry.state_dict()})
        # resuming, after fabric.setup:
        telemetry.load_state_dict(fabric.load(path, {"model": model})["telemetry"])
    """

    every_n_steps: int = field(default=50, kw_only=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._observer: Observer | None = None
        self._clock: OptimizerClock | None = None
        self._watch: NonFiniteWatch | None = None
        self._should_stop = False
        self._watching = False  # on every process, also where nothing is observed
        self._run_directory: Path | None = None
        self._step = 0
        self._next_sample_id = 0
        self._resumes = False  # whether the next watch continues the count load_state_dict gave
        self._parts: PartCalls | None = None  # a loop calling the model's parts
        self._sampling: int | None = None  # the step in progress, if sampled

    def __deepcopy__(self, memo: dict[int, object]) -> FabricTelemetry:
        """The telemetry itself: a copy would be a second, unattached handle on the same run.

        Fabric's ``ddp_spawn`` launcher on the CPU deep-copies the dataclasses among the
        arguments of ``fabric.launch(train, telemetry)`` (to unshare the modules' memory), so
        ``train`` would otherwise get a copy that no ``fabric.setup`` attaches, while the one
        in ``Fabric(callbacks=[...])`` observes: ``watch_optimizers`` on the copy raised, and
        ``check_loss``, ``should_stop``, ``state_dict`` and ``finish`` acted on nothing.
        """
        memo[id(self)] = self
        return self

    @property
    def observer(self) -> Observer | None:
        """The core observer while watching (``None`` before, after, and on unobserved ranks)."""
        return self._observer

    @property
    def run_directory(self) -> Path | None:
        """The run folder (``rank-NNN/`` inside under ``rank_policy="all"``), kept after finish."""
        return self._run_directory

    def on_after_setup(self, fabric: Fabric, module: nn.Module) -> None:
        """Fabric's hook at the end of ``fabric.setup``: watch the first model set up."""
        if not self._watching:
            self.watch(module, fabric)

    def on_train_end(self) -> None:
        """``fabric.call("on_train_end")``: ``finish``."""
        self.finish()

    def watch(
        self,
        model: nn.Module,
        fabric: Fabric,
        *,
        optimizer: Optimizer | Sequence[Optimizer] | None = None,
    ) -> Observer | None:
        """Observe ``model`` (set up by ``fabric`` or not). A collective: call on every process.

        Args:
            model: The model the loop calls.
            fabric: The ``Fabric`` it is set up with.
            optimizer: The optimizer, or all of them, that train ``model`` (as ``fabric.setup``
                returned them, or the torch ones): their steps are counted and recorded. By
                default the first optimizer found stepping one of its parameters.

        Returns:
            The core observer, or ``None`` on a process that does not observe.

        Raises:
            ConfigurationError: ``model`` is not a module, ``optimizer`` not an optimizer (or
                a sequence of them), or a model is watched already.
        """
        if not isinstance(model, nn.Module):
            raise ConfigurationError.invalid("model", type(model).__name__, "a torch.nn.Module")
        optimizers = () if optimizer is None else check_optimizers(optimizer)
        if self._watching:
            raise ConfigurationError("this FabricTelemetry already watches a model; finish() first")
        self._watching = True
        self._should_stop = False
        if not self._resumes:  # each watch counts from 0, unless it continues a loaded state
            self._step = self._next_sample_id = 0
        self._resumes = False
        main = fabric.is_global_zero
        folder, run_id = self.agree_on_run(
            fabric.broadcast, main=main, choose=lambda run_id: self._choose_folder(fabric, run_id)
        )
        if self.observes(main=main):
            self._run_directory = folder.path if folder is not None else None
            self._inject(_original(model), fabric, folder, run_id, optimizers)
        if folder is not None and main:
            log.info("FabricTelemetry: writing the run directory to %s", folder.path)
        if self.rank_policy == "all":
            # Every process holds its sink before any creates its rank-NNN/ (at its first
            # sample); a sink created later would take that folder for an older run's.
            fabric.barrier("torchinstruments-watch")
        return self._observer

    def watch_optimizers(self, *optimizers: Optimizer) -> None:
        """Count and record the steps of these optimizers, the ones ``fabric.setup`` returned.

        For a loop with several optimizers, after the ``fabric.setup`` that watched the model
        and before the first step, on every process: a step then ends once each of them has
        stepped, instead of at each step of the first one found.

        Raises:
            ConfigurationError: Nothing is watched yet, or an argument is not an optimizer.
        """
        checked = check_optimizers(list(optimizers))
        if not self._watching:
            raise ConfigurationError("watch_optimizers() needs a watched model: fabric.setup first")
        if self._clock is not None:
            self._clock.follow(checked)

    def finish(self) -> None:
        """Remove every hook and finalize the run directory. Safe to call again.

        ``state_dict`` still holds the finished run's count; a later ``watch`` (a new fold, a new
        ``Fabric``) counts steps and sample ids from 0 again, unless ``load_state_dict`` is
        given a saved state before it.
        """
        clock, self._clock = self._clock, None
        if clock is not None:
            clock.remove()
        parts, self._parts = self._parts, None
        if parts is not None:
            parts.remove()
        observer, self._observer = self._observer, None
        if observer is not None:
            self._next_sample_id = observer.next_sample_id
            observer.remove()
        self._watching = False

    def state_dict(self) -> dict[str, Any]:
        """What ``fabric.save`` keeps: the step count and the next sample id."""
        if self._observer is not None:
            self._next_sample_id = self._observer.next_sample_id
        return {"step": self._step, "next_sample_id": self._next_sample_id}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue a saved run (``fabric.load``), before its first sampled forward.

        Given before ``watch`` (or ``fabric.setup``), it is the count that watch continues.
        """
        self._step = int(state_dict["step"])
        self._next_sample_id = int(state_dict["next_sample_id"])
        self._resumes = not self._watching
        if self._observer is not None:
            self._observer.continue_from(self._next_sample_id)
            self._begin()

    def _inject(
        self,
        model: nn.Module,
        fabric: Fabric,
        folder: RunFolder | None,
        run_id: str,
        optimizers: Sequence[Optimizer],
    ) -> None:
        targets = logger_targets(fabric.loggers) if self.routes(main=fabric.is_global_zero) else []
        tensorboard = not (self.log_to_loggers and has_tensorboard(fabric.loggers))
        self._watch = self.nonfinite_watch(targets)
        self._observer = self.inject(
            model,
            sink=self.sink(folder, targets, tensorboard=tensorboard, watch=self._watch),
            run_id=run_id,
            first_sample_id=self._next_sample_id,
        )
        scaler = getattr(fabric.strategy.precision, "scaler", None)
        self._observer.set_gradient_scale(self.gradient_scale(scaler, fabric.device))
        self._clock = OptimizerClock(
            model,
            self._on_optimizer_step,
            on_optimizer=self._observer.watch_optimizer,
            optimizers=optimizers,
        )
        # a loop that calls the model's parts (``gan.G(z)``)
        self._parts = PartCalls.of(self._observer, model, lambda: self._sampling)
        self._begin()

    def _on_optimizer_step(self) -> None:
        if self._observer is not None:
            self._observer.end_step()
            self._step += 1
            self._begin()
            if self._watch is not None and self._watch.act():  # "raise" raises from step()
                self._should_stop = True

    def _begin(self) -> None:
        assert self._observer is not None
        sampled = self._watch.begin_step(self._step) if self._watch else self.is_sampled(self._step)
        self._sampling = self._step if sampled else None
        self._observer.begin_step(self._step, sample=sampled)

    @property
    def should_stop(self) -> bool:
        """Whether a non-finite step asked the loop to stop (``on_nonfinite="stop"``)."""
        return self._should_stop

    def check_loss(self, loss: Any) -> None:
        """Hand the step's loss over: a non-finite one samples the next steps densely.

        Fabric shows callbacks no loss; call this after ``fabric.backward(loss)`` if you want
        the loss to trigger dense sampling (nothing waits for the device).
        """
        if self._watch is not None:
            self._watch.check_loss(loss)

    def _choose_folder(self, fabric: Fabric, run_id: str) -> RunFolder:
        """``output_dir``, else ``telemetry`` in the first logger's ``log_dir`` or in ``.``."""
        if self.output_dir is not None:
            base = Path(self.output_dir)
        else:
            log_dir = next((lg.log_dir for lg in fabric.loggers if lg.log_dir), None)
            base = Path(log_dir or ".") / "telemetry"
        return run_folder(base.absolute(), run_id)


def _original(model: nn.Module) -> nn.Module:
    """The model as the user built it (``fabric.setup`` returns it wrapped, in ``.module``)."""
    inner = model.module if is_wrapped(model) else model
    assert isinstance(inner, nn.Module)
    return inner
