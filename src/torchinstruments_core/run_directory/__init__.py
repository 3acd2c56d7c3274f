"""The run directory: Parquet history, result.json, index.md and TensorBoard histograms."""

from torchinstruments_core.run_directory._escape import escape_text, markdown_cell, markdown_code
from torchinstruments_core.run_directory._folders import (
    RunFolder,
    fresh_folder,
    resumed_folder,
    safe_name,
)
from torchinstruments_core.run_directory._index import QUERIES, QUERY_PRELUDE
from torchinstruments_core.run_directory._layout import RunLayout, existing_run, next_free_folder
from torchinstruments_core.run_directory._read import scan_samples
from torchinstruments_core.run_directory._repair import repair
from torchinstruments_core.run_directory._state import RunState, RunStatus, inspect_run
from torchinstruments_core.run_directory._summary import summarize_run
from torchinstruments_core.run_directory._tables import history_schema, samples_schema
from torchinstruments_core.run_directory.sink import RunDirectorySink

__all__ = [
    "QUERIES",
    "QUERY_PRELUDE",
    "RunDirectorySink",
    "RunFolder",
    "RunLayout",
    "RunState",
    "RunStatus",
    "escape_text",
    "existing_run",
    "fresh_folder",
    "history_schema",
    "inspect_run",
    "markdown_cell",
    "markdown_code",
    "next_free_folder",
    "repair",
    "resumed_folder",
    "safe_name",
    "samples_schema",
    "scan_samples",
    "summarize_run",
]
