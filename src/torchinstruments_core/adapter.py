"""The adapter contract: what a trainer adapter does, and the pieces of the core it does it with.

An adapter only translates: trainer events to ``Observer`` calls, the trainer's step to the
core's, the trainer's loggers to routing targets. It holds no hooks, statistics, file formats or
private trainer attributes, so a new one (Fabric, the Transformers ``Trainer``) is one small file
(``tests/test_adapter_contract.py`` holds a complete one for a plain loop). It must:

1. Take the shared options. The adapter is a dataclass that inherits ``TelemetryOptions``
   (``@dataclass(eq=False)``, which keeps the identity hashing trainers rely on to hold
   callbacks in sets) and adds only its own fields; its docstring says "plus every option of
   ``TelemetryOptions``". The options are checked when it is built.
2. Agree on the run. When training starts, every process calls ``agree_on_run`` with the
   trainer's broadcast: the main process draws the run id and chooses the folder
   (``run_folder`` names it, never over an earlier run), and every process gets both.
3. Honour ``rank_policy``. Only where ``observes(main=...)``: build ``sink(folder, targets)``,
   with the trainer's loggers mapped to routing targets (``SummaryWriterTarget``,
   ``WandbRunTarget``, ``ScalarTarget`` of ``torchinstruments_core.routing``) on the main
   process only, and ``inject`` the model with ``optimizers=`` every optimizer of the trainer
   (the optimizer step signals; a torch optimizer or a wrapper with a public ``optimizer``).
4. Map the trainer's events. ``begin_step(step, sample=watch.begin_step(step))`` before a
   step's first forward, ``end_step()`` once its optimizer step is done, where ``watch`` is
   the run's ``nonfinite_watch(targets)``, passed to ``sink(..., watch=watch)``: it samples
   the steps after a non-finite loss or sample densely. Give it the step's loss
   (``check_loss``, or ``check_logged`` for logged values) and call ``act()`` after the step:
   true asks the trainer to stop (``on_nonfinite="stop"``), and under ``"raise"`` it raises
   ``NonFiniteError``. A step that is not one call of the
   model (Lightning's ``training_step`` calls submodules) opens its sample with
   ``open_sample(step)`` and ends the forward with ``finish_forward()``. An adapter that never
   sees the loop counts optimizer steps with ``OptimizerClock``, which also hands each of the
   trainer's optimizers to ``Observer.watch_optimizer`` (``on_optimizer``): the ones given
   (``check_optimizers`` checks an ``optimizer=`` argument), else the one it finds; an adapter
   that is given the optimizer (Transformers' callback events) watches it itself. Such an
   adapter also follows a loop that calls the model's parts and never the model
   (``PartCalls``). Under fp16, pass ``gradient_scale(scaler, device)`` to
   ``set_gradient_scale``.
5. Number the steps as the user does. When the trainer's step is not the number the user logs
   under (the adapter counts optimizer steps itself), put a ``HoldingSink`` with a
   ``StepNumbering`` in front of the sink, and tell the numbering of each step and each log.
6. End the run. ``remove()`` the observer when training ends and on an exception: the samples
   still on their way are delivered and the run directory is finalized.
"""

from torchinstruments_core._clock import OptimizerClock
from torchinstruments_core._config import ErrorPolicy, NonFinitePolicy, RankPolicy
from torchinstruments_core._inject import new_run_id
from torchinstruments_core._numbering import HoldingSink, StepNumbering
from torchinstruments_core._optimizer_probe import check_optimizers
from torchinstruments_core._options import (
    TelemetryOptions,
    TriggeredSchedule,
    loss_scale_reader,
    run_folder,
)
from torchinstruments_core._parts import PartCalls
from torchinstruments_core._watch import NonFiniteWatch
from torchinstruments_core.run_directory import RunFolder

__all__ = [
    "ErrorPolicy",
    "HoldingSink",
    "NonFinitePolicy",
    "NonFiniteWatch",
    "OptimizerClock",
    "PartCalls",
    "RankPolicy",
    "RunFolder",
    "StepNumbering",
    "TelemetryOptions",
    "TriggeredSchedule",
    "check_optimizers",
    "loss_scale_reader",
    "new_run_id",
    "run_folder",
]
