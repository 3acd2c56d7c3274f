"""Map a trainer's loggers to the core's routing targets."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from torchinstruments_core.routing import ScalarTarget, SummaryWriterTarget, WandbRunTarget

if TYPE_CHECKING:
    from collections.abc import Iterable

    from lightning.pytorch.loggers import Logger

    from torchinstruments_core.routing import Target

# WandbLogger logs the trainer's step under this key; our rows use it too, so they line up.
WANDB_STEP_KEY = "trainer/global_step"


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
