"""The suite's version, in one place: the core, both adapters and ``index.md`` read it from here.

The version is written once, in ``pyproject.toml``; an installed copy (editable installs
included) carries it in its metadata. A source tree put on ``sys.path`` without installing
(``PYTHONPATH=src``) has no metadata, so the version comes from that tree's ``pyproject.toml``.
"""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DISTRIBUTION = "torchinstruments-suite"
"""The distribution's name on an index (``torchinstruments`` on PyPI is another project)."""

UNKNOWN = "0+unknown"
"""The version when neither metadata nor a ``pyproject.toml`` of this distribution is found."""

_SOURCE_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def source_tree_version(pyproject: Path) -> str | None:
    """The version in ``pyproject``, when it exists and describes this distribution."""
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    found = project.get("version")
    return found if project.get("name") == DISTRIBUTION and isinstance(found, str) else None


def find_version(pyproject: Path = _SOURCE_PYPROJECT) -> str:
    """The installed distribution's version, else the source tree's, else ``UNKNOWN``."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return source_tree_version(pyproject) or UNKNOWN


__version__ = find_version()
