r"""Layer names made safe for a terminal: one line, inert, and unambiguous inside a table.

A layer name comes from the user's model (a ``ModuleDict`` key may hold a newline, a ``|`` or an
escape sequence that recolours a terminal). The escaping is the core's
(``torchinstruments_core.run_directory.escape_text``), written again here because importing
the core imports torch, which the command line must not wait for: a backslash becomes ``\\``, a
newline ``\n``, ESC ``\x1b``, and ``|`` becomes ``\|`` so a plain-text table keeps its columns.

Example:
    >>> print(escape_name("blocks.0|attn\n\x1b[31m"))
    blocks.0\|attn\n\x1b[31m
"""

from __future__ import annotations

_NAMED = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_text(text: str) -> str:
    r"""``text`` with backslashes and every non-printable character written as an escape.

    Control characters (ESC included), line and paragraph separators, and invisible format
    characters (such as the bidirectional overrides) become ``\xNN``, ``\uNNNN`` or
    ``\UNNNNNNNN``; printable characters, including non-ASCII letters, stay as they are. The
    core's ``run_directory.escape_text`` is this function.
    """
    return "".join(_escape_character(character) for character in text)


def escape_name(text: str) -> str:
    r"""``escape_text`` that also writes ``|`` as ``\|``, for a cell of a plain-text table."""
    return escape_text(text).replace("|", "\\|")


def _escape_character(character: str) -> str:
    if character in _NAMED:
        return _NAMED[character]
    if character.isprintable():
        return character
    point = ord(character)
    if point < 0x100:
        return f"\\x{point:02x}"
    if point < 0x10000:
        return f"\\u{point:04x}"
    return f"\\U{point:08x}"
