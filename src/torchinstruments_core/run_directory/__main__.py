"""The one-line repair: ``python -m torchinstruments_core.run_directory repair PATH [PATH ...]``.

Completes each run that crashed, was killed, or could not be finalized (see
``torchinstruments_core.run_directory.repair``, the function, for what it does). Prints one line
per run; exits with status 1 if any run could not be repaired.

This module is the command line only (a ``__main__``, so that no submodule shadows the function
``torchinstruments_core.run_directory.repair``): from Python, call that function.
"""

from __future__ import annotations

import argparse
import sys

from torchinstruments_core.run_directory._escape import escape_text
from torchinstruments_core.run_directory._repair import repair


def main(argv: list[str] | None = None) -> int:
    """Repair each folder named in ``argv``; the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m torchinstruments_core.run_directory",
        description="Complete run directories that crashed, were killed or were not finalized.",
    )
    parser.add_argument("command", choices=["repair"], help="what to do: repair")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="a run folder (or its parent)")
    failed = False
    for path in parser.parse_args(argv).paths:
        try:
            states = repair(path)
        except Exception as error:  # one bad folder must not stop the others
            print(f"{escape_text(path)}: not repaired: {error}", file=sys.stderr)
            failed = True
            continue
        for state in states:
            print(f"{escape_text(str(state.folder))}: {state.status}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
