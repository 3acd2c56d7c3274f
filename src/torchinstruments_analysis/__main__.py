"""``python -m torchinstruments_analysis``: the ``torchinstruments`` command line."""

import sys

from torchinstruments_analysis.cli import main

sys.exit(main())
