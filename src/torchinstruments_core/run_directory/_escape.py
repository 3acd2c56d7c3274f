r"""Names from the model, made safe for Markdown and for terminals.

A layer name comes from the user's model (a ``ModuleDict`` key may hold a newline, a ``|``, a
backtick, or an escape sequence that recolours a terminal). Every name written into ``index.md``
(and printed by a command line) goes through these functions, so it stays on one line, inside its
table cell, and inert in a terminal. The escaping is Python's: a backslash becomes ``\\``, a
newline ``\n``, ESC ``\x1b``, so the original name can be read back unambiguously.
"""

from __future__ import annotations

# One escaper for the whole distribution: it lives in the analysis package, which imports no
# torch (its command line must not), and the core writes names exactly as that package reads them.
from torchinstruments_analysis._escape import escape_text

__all__ = ["escape_text", "markdown_cell", "markdown_code"]


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
