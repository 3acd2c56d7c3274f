"""The run directory: Parquet history, result.json, index.md and TensorBoard histograms."""

from torchinstruments_core.run_directory._index import QUERIES, QUERY_PRELUDE
from torchinstruments_core.run_directory._layout import RunLayout
from torchinstruments_core.run_directory._tables import history_schema, samples_schema
from torchinstruments_core.run_directory.sink import RunDirectorySink

__all__ = [
    "QUERIES",
    "QUERY_PRELUDE",
    "RunDirectorySink",
    "RunLayout",
    "history_schema",
    "samples_schema",
]
