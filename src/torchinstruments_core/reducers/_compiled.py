"""Loads the compiled extension (``_kernels.c``) without torch: for the run directory's writer.

``_native`` holds the calls the reductions make into the extension and imports torch; the
writer's CRC-32C (``run_directory._crc32c``) needs the extension too, also in the writer's own
process (``run_directory._writer_child``), which imports no torch.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import ModuleType

ENVIRONMENT_SWITCH = "TORCHINSTRUMENTS_NATIVE"
"""Set to ``0`` to reduce with numpy and torch although the compiled kernels are installed."""

LAYOUT = 7
"""The layout of the buffers this package hands the kernels and of the calls it makes
(``_kernels.c``'s ``KERNELS_LAYOUT``; 2: each histogram's edges follow it; 3: ``ratio_sum``;
4: the moments' second pass in ``profile``, and ``shifted_squares``; 5: ``difference_squares``;
6: ``queue_copy``, ``queue_helped``, a waiter that runs queued jobs; 7: a job its submitter
runs counted in its turn, ``queue_close`` waiting for every job). A module of another layout
is not used."""


def load() -> ModuleType | None:
    """The compiled module, or ``None`` when it is not built or ``ENVIRONMENT_SWITCH`` is ``0``.

    A module built from other sources (a failed rebuild leaves the old one in place) is not
    used either, with a warning: it would read and write buffers of another layout.
    """
    if os.environ.get(ENVIRONMENT_SWITCH, "1").strip() == "0":
        return None
    try:
        import torchinstruments_core.reducers._kernels as kernels
    except ImportError:  # built without a C compiler: numpy and torch reduce instead
        return None
    layout = getattr(kernels, "LAYOUT", 1)
    if layout != LAYOUT:
        warnings.warn(
            f"torchinstruments: the compiled kernels at {kernels.__file__} were built from other "
            f"sources (layout {layout}, this package needs {LAYOUT}); numpy and torch reduce "
            "instead, more slowly. Reinstall the package to rebuild them.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return kernels


KERNELS: ModuleType | None = load()
"""The compiled module as loaded at import, or ``None``."""
