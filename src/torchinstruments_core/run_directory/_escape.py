r"""Names from the model, made safe for Markdown and for terminals.

A layer name comes from the user's model (a ``ModuleDict`` key may hold a newline, a ``|``, a
backtick, or an escape sequence that recolours a terminal). Every name written into ``index.md``
(and printed by a command line) goes through these functions, so it stays on one line, inside its
table cell, and inert in a terminal. The escaping is Python's: a backslash becomes ``\\``, a
newline ``\n``, ESC ``\x1b``, so the original name can be read back unambiguously.
"""

from __future__ import annotations

_NAMED = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_text(text: str) -> str:
    r"""``text`` with backslashes and every non-printable character written as an escape.

    Control characters (ESC included), line and paragraph separators, and invisible format
    characters (such as the bidirectional overrides) become ``\xNN``, ``\uNNNN`` or
    ``\UNNNNNNNN``; printable characters, including non-ASCII letters, stay as they are.
    """
    return "".join(_escape_character(character) for character in text)


def markdown_code(text: str) -> str:
    """``text`` escaped and set as a Markdown code span, whatever backticks it holds."""
    escaped = escape_text(text)
    longest = run = 0
    for character in escaped:
        run = run + 1 if character == "`" else 0
        longest = max(longest, run)
    fence = "`" * (longest + 1)
    padding = " " if escaped.startswith("`") or escaped.endswith("`") else ""
    return f"{fence}{padding}{escaped}{padding}{fence}"


def markdown_cell(text: str, *, code: bool = True) -> str:
    r"""``text`` as the content of one Markdown table cell: one line, ``|`` escaped.

    Args:
        text: Any string (a layer name, a class name).
        code: Set it as a code span (GitHub-flavoured Markdown still needs ``\|`` inside one).
    """
    cell = markdown_code(text) if code else escape_text(text)
    return cell.replace("|", "\\|")


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
