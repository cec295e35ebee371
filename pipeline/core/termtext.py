"""Text from transcripts and file names, made safe to print on a terminal (issue 23, item 12).

A session id, a model name, a file name or a quarantined line is written by someone else: it can
hold `\\x1b]0;PWNED\\x07\\x1b[2J` (set the window title, clear the screen), a newline that breaks a
table, or a right-to-left override that reverses what follows. Every human-readable printer of the
command line passes what it prints through one of these two (JSON output is left alone: its encoder
escapes control characters already):

- `shown(value)`: one value (a table cell, an id in a sentence): every control character escaped,
  newlines and tabs included, so it stays on its line;
- `terminal_text(text)`: whole lines of text: the same, but the newlines and tabs that lay the
  text out are kept.

Escaped: the C0 and C1 control characters and DEL (`\\x1b`, `\\x07`, `\\x9b`, `\\n`, ...), the line
and paragraph separators U+2028 / U+2029, and the bidirectional formatting characters (U+061C,
U+200E-U+200F, U+202A-U+202E, U+2066-U+2069), as `\\n`, `\\t`, `\\r`, `\\xNN` or `\\uNNNN`.
Standard library only.
"""

from __future__ import annotations

import re
from typing import Any

_OTHERS = "\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"  # DEL, C1, separators, bidi
_ANY = re.compile(f"[\x00-\x1f{_OTHERS}]")
_BUT_LAYOUT = re.compile(f"[\x00-\x08\x0b-\x1f{_OTHERS}]")  # \t (0x09) and \n (0x0a) kept
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    named = _NAMED.get(c)
    if named is not None:
        return named
    n = ord(c)
    return f"\\x{n:02x}" if n <= 0xFF else f"\\u{n:04x}"


def shown(value: Any) -> str:
    """One value as text that cannot act on a terminal nor leave its line: every control character
    escaped (`"a\\x1b[2Jb\\n"` -> `a\\\\x1b[2Jb\\\\n`); None and other types as `str()` gives them."""
    s = value if isinstance(value, str) else str(value)
    return _ANY.sub(_escape, s) if _ANY.search(s) else s


def terminal_text(text: str) -> str:
    """Lines of text for a terminal: control characters escaped as by `shown`, except the newlines
    and tabs that lay the text out."""
    return _BUT_LAYOUT.sub(_escape, text) if _BUT_LAYOUT.search(text) else text


__all__ = ["shown", "terminal_text"]
