"""Starting the run directory's writer process: its command line, its pipes, how it ended.

The writer process imports no torch (nor the engine): ``python -c`` with the training process's
``sys.path`` loads this package's folders without their ``__init__`` modules, which import torch
(``BOOT``). Its samples come down one pipe and its replies go up another, both passed by
descriptor (``launch``); ``_writer_process`` talks to it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import BinaryIO

PIPE_BYTES = 1 << 20  # a pipe this large takes a few samples before a write waits (Linux)
_PACKAGES = (
    "torchinstruments_core",
    "torchinstruments_core.reducers",
    "torchinstruments_core.run_directory",
)
"""Packages whose ``__init__`` imports torch (directly or through the sink): loaded as bare
folders in the writer process."""

BOOT = """\
import sys, json, types
sys.path[:] = json.loads(sys.argv[1])
for name, folder in json.loads(sys.argv[2]).items():
    package = types.ModuleType(name)
    package.__path__ = [folder]
    sys.modules[name] = package
from torchinstruments_core.run_directory._writer_child import serve
serve(int(sys.argv[3]), int(sys.argv[4]))
"""


def launch() -> tuple[subprocess.Popen[bytes], int, BinaryIO]:
    """Start the writer process; the process, the pipe down to it and the stream up from it.

    Raises:
        ValueError: No interpreter to start (``sys.executable`` empty, a frozen application).
        OSError: The pipes or the process could not be made (nothing is left open then).
    """
    if not sys.executable or getattr(sys, "frozen", False):
        raise ValueError("no Python interpreter to start (sys.executable is not one)")
    path = [os.path.abspath(entry) for entry in map(_text, sys.path) if entry is not None]
    folders = {name: _folder(name) for name in _PACKAGES}
    command = [
        sys.executable,
        "-c",
        BOOT,
        _json(path),
        _json({name: folder for name, folder in folders.items() if folder is not None}),
    ]
    down_read, down_write = os.pipe()
    up_read, up_write = os.pipe()
    with contextlib.suppress(AttributeError, OSError):  # Linux only; a bigger buffer
        import fcntl

        fcntl.fcntl(down_write, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    command += [str(down_read), str(up_write)]
    try:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, pass_fds=(down_read, up_write)
        )
    except BaseException:
        for fd in (down_read, down_write, up_read, up_write):
            os.close(fd)
        raise
    try:
        os.close(down_read)
        os.close(up_write)
        # written unbuffered: a fork has no bytes of it to flush; the reader thread closes it
        return process, down_write, open(up_read, "rb")
    except BaseException:  # nothing may be left running or open without an owner
        process.kill()
        process.wait()
        for fd in (down_read, up_write, down_write, up_read):
            with contextlib.suppress(OSError):
                os.close(fd)
        raise


def _folder(name: str) -> str | None:
    module = sys.modules.get(name)
    paths = getattr(module, "__path__", None)
    return None if not paths else os.path.abspath(str(next(iter(paths))))


def _text(entry: object) -> str | None:
    """A ``sys.path`` entry as text (an ``os.PathLike`` too); ``None`` for anything else."""
    if isinstance(entry, str | os.PathLike):
        return os.fsdecode(entry)
    return None


def _json(value: object) -> str:
    import json

    return json.dumps(value)


def exit_status(process: subprocess.Popen[bytes] | None) -> str:
    if process is None:
        return "it did not start"
    try:
        code = process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return "its pipe closed"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
