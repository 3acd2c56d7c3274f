r"""Names from the user's model made inert for Markdown, matplotlib and terminals.

The same escaping as ``torchinstruments_core.run_directory.escape_text`` (a backslash becomes
``\\\\``, a newline ``\\n``, ESC ``\\x1b``), kept here so the analysis package imports no torch.
"""

from __future__ import annotations

_NAMED = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_text(text: str) -> str:
    """``text`` with backslashes and non-printable characters written as Python escapes."""
    return "".join(_escape_character(c) for c in text)


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
