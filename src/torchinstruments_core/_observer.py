"""The observer: decides which forwards are samples, measures them and hands them to the sink.

Life of a sample: the root pre-hook asks the sampler (or the adapter's step plan) whether this root
forward is sampled; if so the per-module hooks are armed, each selected module's outputs are
reduced on their device and gradient hooks are placed on them. The sample closes when the first
backward that reaches it completes, when autograd frees its graph without a backward, when its
step ends, or at ``flush``/removal, whichever comes first. Then its values cross to the host in one
transfer and the sink receives the ``SampleRecord``.

``Observer`` is the facade; each job is a part of its own, with one reason to change:

- ``_plan.StepPlan``: which root forwards are samples (the sampler, or the adapter's steps).
- ``_rank_gate.RankGate``: whether this rank observes at all.
- ``_lifecycle.SampleLifecycle``: opening, tracking and closing samples; the hooks' arming.
- ``_probe.OutputProbe``: measuring outputs, matching gradients (checkpoint recomputation too).
- ``_step_records.StepRecorder``: measuring an optimizer step's tensors into a step record.
- ``_step_window.StepWindow``: which optimizer steps are recorded.
- ``_optimizer_probe.OptimizerProbe``: the watched optimizers' step hooks and what they measure.
- ``_scale.GradientScaleReader``: the loss scale the recorded gradients are divided by.
- ``_delivery.DeliveryQueue``: transfers in flight, delivered to the sink in closing order.
- ``_sink_session.SinkSession``: the sink opened once, written, closed, each call guarded.
- ``_failures.FailureReport``: the error policy (warn once per cause, or raise).
- ``_process``: removal at process exit and SIGTERM, inertness after ``fork``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from torchinstruments_core import _process
from torchinstruments_core._config import check_positive_int
from torchinstruments_core._exceptions import ConfigurationError
from torchinstruments_core._failures import FailureReport
from torchinstruments_core._lifecycle import SampleLifecycle
from torchinstruments_core._observer_config import ObserverConfig
from torchinstruments_core._optimizer_probe import OptimizerProbe, check_optimizers
from torchinstruments_core._plan import StepPlan
from torchinstruments_core._rank_gate import RankGate
from torchinstruments_core._records import RunInfo
from torchinstruments_core._registry import forget
from torchinstruments_core._scale import GradientScaleReader
from torchinstruments_core._sharded import holds_shards
from torchinstruments_core._sink_session import SinkSession
from torchinstruments_core._step_window import StepWindow

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from torch import nn

    from torchinstruments_core._layers import Layer
    from torchinstruments_core._scale import GradientScale
    from torchinstruments_core._step_records import StepTensor

__all__ = ["Observer", "ObserverConfig"]


class Observer:
    """Observes one model. Create it with ``inject_observer``; remove it with ``remove``.

    Usable as a context manager: leaving the ``with`` block removes it.
    """

    def __init__(self, model: nn.Module, config: ObserverConfig) -> None:
        self._model: nn.Module | None = model
        self._model_class = type(model).__qualname__
        self._config = config
        self._first_sample_id = config.first_sample_id
        self._layers: list[Layer] = config.layers
        failures = FailureReport(config.error_policy)
        self._gate = RankGate(config.rank_policy)
        self._plan = StepPlan(config.sampler)
        self._scale = GradientScaleReader(failures)
        self._sink = SinkSession(config.sink, failures, self._run_info)
        self._samples = SampleLifecycle(
            model,
            config,
            plan=self._plan,
            gate=self._gate,
            scale=self._scale,
            sink=self._sink,
            failures=failures,
        )
        self._optimizers = OptimizerProbe(
            self._samples, StepWindow(), failures, config.step_signals, config.measurer
        )

    # -- public surface ----------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        """Identifier of this run (generated per process unless ``run_id`` was given)."""
        return self._config.run_id

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Clean names of the observed modules, in model order."""
        return tuple(layer.name for layer in self._layers)

    @property
    def focus_layer_names(self) -> tuple[str, ...]:
        """The focus layers: their tensors also get histograms, and adapters route their scalars."""
        return tuple(layer.name for layer in self._layers if layer.histogram)

    @property
    def histogram_layer_names(self) -> tuple[str, ...]:
        """Deprecated name of ``focus_layer_names`` (warns)."""
        message = "Observer.histogram_layer_names is deprecated; use Observer.focus_layer_names"
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return self.focus_layer_names

    @property
    def attached(self) -> bool:
        """Whether hooks are in place (``False`` after removal and on ranks that do not observe)."""
        return not self._samples.removed and self._gate.enabled

    @property
    def next_sample_id(self) -> int:
        """The id of the next record (samples and step records so far plus ``first_sample_id``)."""
        return self._samples.next_sample_id

    @property
    def samples_taken(self) -> int:
        """Deprecated name of ``next_sample_id`` (warns)."""
        warnings.warn(
            "Observer.samples_taken is deprecated; use Observer.next_sample_id",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.next_sample_id

    def continue_from(self, next_sample_id: int) -> None:
        """Give the first record the id ``next_sample_id``, as ``first_sample_id`` would have.

        For an adapter that learns that its run resumes an earlier one only after it attached
        (Fabric restores a checkpoint after ``fabric.setup``). Only before the first record.

        Raises:
            ConfigurationError: ``next_sample_id`` is negative, or a record was already taken.
        """
        first = check_positive_int("next_sample_id", next_sample_id, minimum=0)
        if self._samples.next_sample_id != self._first_sample_id:
            raise ConfigurationError(
                "continue_from() after a record was taken would repeat or skip sample ids; "
                "call it before the first sampled forward"
            )
        self._samples.next_sample_id = self._first_sample_id = first

    @property
    def training_forwards(self) -> int:
        """Root forwards run so far with gradients enabled (an evaluation under no_grad is not)."""
        return self._samples.training_forwards

    def begin_step(self, step: int, *, sample: bool, note_unstepped: bool = True) -> None:
        """Announce that the coming root forwards belong to trainer step ``step``.

        Every root forward until ``end_step`` is sampled when ``sample`` is true (all micro-batches
        of an accumulated step), and none is otherwise. Once an adapter calls this, the sampler is
        no longer consulted: forwards outside ``begin_step``/``end_step`` are not sampled.

        The watched optimizers' steps inside a sampled step are recorded (``watch_optimizer``).
        A sampled step arms the per-module hooks now, before its first forward, and keeps them
        until ``end_step``: a compiled model then runs the whole step as plain Python (see
        ``force_eager``) instead of compiling a variant of its graph with the hooks in it.

        ``note_unstepped``: whether this step, if sampled and ended before any watched optimizer
        stepped, has a step record noted ``optimizer_step_skipped`` (the fp16 GradScaler skipped
        ``optimizer.step()``). ``False`` where a step without one is the loop's own doing
        (gradients accumulated by hand under Lightning's manual optimization).
        """
        self._plan.begin(step, sample=sample)
        self._optimizers.announced(step, sample=sample, note_unstepped=note_unstepped)
        if sample:
            self._samples.arm_for_step()
        else:
            self._samples.update_arming()  # a sampled step that never saw its end_step

    def open_sample(
        self, step: int | None = None, *, lazy: bool = False, scope: str | None = None
    ) -> bool:
        """Start a sample now, without waiting for a root forward.

        For trainers whose step is not a call of the observed module (a LightningModule's
        ``training_step`` calls its submodules): every selected module called until
        ``finish_forward`` belongs to this sample, and the gradients flowing back into their
        outputs are matched to it as usual.

        Args:
            step: The step the sample belongs to.
            lazy: Start the sample only when the first selected module runs (in this thread)
                before ``finish_forward``; if none runs, there is no sample: nothing is
                delivered and no sample id is taken. For a sample opened in case more of a step
                follows (a second forward and backward under manual optimization). Without it
                a sample in which nothing selected ran is delivered with no rows, which says
                that the step was sampled and nothing selected ran.
            scope: Where the loggers put this sample's keys under their prefix
                (``SampleRecord.scope``): ``"phase_2"`` routes them as
                ``<prefix>/phase_2/<layer>/...``, apart from the step's first sample. ``None``
                (the default): the prefix itself.

        Returns:
            Whether a sample was opened, or is waiting for its first module with ``lazy``
            (``False`` on a rank that does not observe, or after removal).
        """
        return self._samples.open(step, lazy=lazy, scope=scope)

    def finish_forward(self) -> None:
        """End the forward part of the sample opened with ``open_sample``.

        It then waits for its backward, or closes at once when no output can receive a gradient.
        """
        self._samples.finish_explicit()

    def set_gradient_scale(self, scale: GradientScale) -> None:
        """Report gradients divided by ``scale`` in the samples opened from now on.

        Under fp16 mixed precision the loss is multiplied by a loss scale before the backward,
        so every gradient is too; an adapter passes the scaler's scale so that the recorded
        gradients are the unscaled ones. ``None`` (the default) records them as they are.

        Args:
            scale: A number; a one-element tensor, on any device, that the gradients are divided
                by on their device, so nothing waits for the device to read it (a GPU scaler's
                scale is such a tensor: ``scaler.scale(torch.ones((), device=device))``); a
                function returning either (or ``None``), called when each sample opens, so it
                sees the scale of that step's backward even if the scaler changes it after this
                call; or ``None``.

        Raises:
            ConfigurationError: If ``scale`` is a number that is not finite and positive, or of
                another type.
        """
        self._scale.set(scale)

    def end_step(self) -> None:
        """Announce that the current step has ended: its samples close and go to the sink.

        Until the next ``begin_step`` no root forward is sampled.
        """
        step = self._plan.end()
        self._samples.update_arming()
        if step is not None:
            self._samples.close_step(step)

    def record_step(self, step: int | None, tensors: Iterable[StepTensor]) -> int | None:
        """Record the tensors of one optimizer step (parameters and what belongs to them).

        Each ``StepTensor`` is reduced on its device like a sample's tensor; the step record
        takes the next id of the samples' sequence and reaches the sink (run directory, logger
        routing) as a ``SampleRecord`` of kind ``RecordKind.STEP``, its rows under the module
        owning each parameter, ``tensor_path`` the parameter's name, ``call_index`` 0.

        Args:
            step: The trainer step the optimizer step belongs to (``None`` without a trainer).
            tensors: What to measure, each with a signal of kind ``RecordKind.STEP``.

        Returns:
            The record's id; ``None`` on a rank that does not observe, or after removal.
        """
        return self._samples.record_step(step, tensors)

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Record the sampled steps of ``optimizer``: the optimizer step signals.

        Hooks ``optimizer``'s own step pre- and post-hook (public torch API), removed with the
        observer; a second call does nothing; several optimizers each get step records. Under
        an adapter each watched optimizer's first step inside a sampled trainer step is
        recorded at that step; in a plain loop its first step after a sampled forward. A
        sampled trainer step without an optimizer step (the fp16 GradScaler skipped it) gets a
        record without rows, noted ``optimizer_step_skipped``. The rows are described in the
        README ("Optimizer step signals"). A wrapper with a public ``optimizer`` attribute
        (Accelerate's) is unwrapped.

        Sharded parameters (``DTensor``, FSDP's ``fully_shard``) are measured whole: every rank
        reduces its shard and one collective per recorded step combines them (``_sharded``).
        So on a rank that does not observe (``rank_policy="rank0"``) the optimizer is watched
        too: its sampled steps join the collective and write nothing. Every rank must then
        sample the same steps (a step-based sampler, or an adapter's ``begin_step``).

        Raises:
            ConfigurationError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        """
        (checked,) = check_optimizers([optimizer])
        if self._samples.removed or self._model is None:
            return
        if not self._gate.enabled:
            if not holds_shards(checked):
                return
            # a rank that does not observe follows the sampled steps to join their collectives:
            # the root hooks only (no module is ever armed here), placed once
            if not self._optimizers.watching:
                self._samples.attachment.attach()
        self._optimizers.watch(checked, self._model, self._layers)

    def flush(self) -> None:
        """Close every open sample and wait until the sink has received all of them."""
        self._samples.flush()

    def remove(self) -> None:
        """Remove every hook, deliver every sample and close the sink. Safe to call again."""
        # a SIGTERM meanwhile ends the process once the run is finalized: from the first step,
        # since the handler's own removal of this observer does nothing once it is stopped
        with _process.handing_over():
            self._optimizers.remove()
            if not self._samples.stop():
                return
            self._samples.attachment.detach()
            _process.unregister(self)
            self._samples.cut_short()  # a forward cut short (an exception) keeps what it measured
            try:
                if self._gate.enabled:
                    try:
                        self.flush()
                    finally:  # the sink is closed (its files finalized) even if delivery raised
                        self._sink.close()
            finally:
                self._config.measurer.close()  # stops the reduction worker's thread
                self._release_references()

    def __enter__(self) -> Observer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "attached" if self.attached else "removed"
        return f"Observer({self._model_class}, layers={len(self._layers)}, {state})"

    # -- attachment and the process's end -----------------------------------------------------

    def _attach(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self._gate.resolve()
        if self._gate.enabled:
            self._samples.attachment.attach()
            # A script that never removes its observer still gets a finalized run directory,
            # at exit (a multiprocessing child's too) or on SIGTERM.
            _process.register(self)

    def become_inert(self) -> None:
        """Stop observing for good, in a child process that ``fork`` made (see ``_process``).

        The child inherits this observer's hooks and open samples but not the sink's writer
        thread: it samples nothing, delivers nothing and never finalizes the parent's run.
        """
        self._gate.close_for_good()
        self._samples.abandon()

    def _release_references(self) -> None:
        _process.unregister(self)
        self._config.measurer.new_sample()  # drop the cached subsample positions
        if self._model is not None:
            forget(self._model, self)
        self._model = None
        self._layers = []
        self._samples.release()

    def _run_info(self) -> RunInfo:
        rank = self._gate.resolve()
        return RunInfo(
            run_id=self._config.run_id,
            rank=rank.rank,
            world_size=rank.world_size,
            rank_policy=str(self._config.rank_policy),
            model_class=self._model_class,
            sampling_policy=self._plan.policy,
            layers=tuple(layer.info() for layer in self._layers),
            metrics=self._config.measurer.metrics,
        )
