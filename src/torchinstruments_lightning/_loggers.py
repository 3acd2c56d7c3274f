"""Map a trainer's loggers to the core's routing targets and to the run's name.

Lightning's loggers derive from Fabric's (``lightning.fabric.loggers``), so one mapping serves the
``Trainer`` and ``Fabric``: TensorBoardLogger is Fabric's class, the base of the Trainer's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.fabric.loggers.tensorboard import TensorBoardLogger
from lightning.pytorch.loggers import WandbLogger

from torchinstruments_core.routing import ScalarTarget, SummaryWriterTarget, WandbRunTarget
from torchinstruments_core.run_directory import safe_name

if TYPE_CHECKING:
    from collections.abc import Iterable

    import lightning.pytorch as pl
    from lightning.fabric.loggers.logger import Logger

    from torchinstruments_core.routing import Target

# WandbLogger logs the trainer's step under this key; our rows use it too, so they line up.
WANDB_STEP_KEY = "trainer/global_step"


def logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning's own logging uses now: ``self.log``'s, and its loggers' x-axis.

    Lightning logs at its count of training batches that stepped (the fit loop's
    ``_batches_that_stepped``; ``WandbLogger`` calls it ``trainer/global_step``): with one
    optimizer that is ``trainer.global_step`` during a training batch and one less while
    validation runs after it (before the count moves); with several optimizers, or under
    manual optimization, it counts batches where ``global_step`` counts optimizer steps. The
    attribute is private (``tests/test_lightning.py`` pins it): without it, ``global_step``.
    """
    stepped = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", None)
    return trainer.global_step if stepped is None else int(stepped)


def logger_targets(loggers: Iterable[Logger]) -> list[Target]:
    """TensorBoard and W&B loggers take histograms and scalars; any other logger scalars."""
    targets: list[Target] = []
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            targets.append(SummaryWriterTarget(logger.experiment))
        elif isinstance(logger, WandbLogger):
            targets.append(WandbRunTarget(logger.experiment, step_key=WANDB_STEP_KEY))
        else:
            targets.append(ScalarTarget(logger.log_metrics))
    return targets


def has_tensorboard(loggers: Iterable[Logger]) -> bool:
    """Whether a TensorBoardLogger is among ``loggers``."""
    return any(isinstance(logger, TensorBoardLogger) for logger in loggers)


def run_name(loggers: Iterable[Logger]) -> str | None:
    """The first logger's name for this run: its version (``version_3``) or the W&B run id.

    Call on global rank 0 only: elsewhere a WandbLogger's experiment is a stand-in.
    """
    for logger in loggers:
        # WandbLogger.version is None until its run starts, which may be after fit start.
        version = logger.experiment.id if isinstance(logger, WandbLogger) else logger.version
        name = safe_name(version)
        if name is not None:
            return name
    return None
