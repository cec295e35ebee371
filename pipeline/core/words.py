"""Counts in words: "1 line", "2 lines", "1,234 sessions". Standard library only (the runner and
every command use it)."""

from __future__ import annotations

_IRREGULAR = {"match": "matches", "is": "are", "was": "were", "has": "have", "entry": "entries",
              "directory": "directories", "copy": "copies", "namespace": "namespaces"}


def plural(n: int, word: str, many: str | None = None) -> str:
    """`n` and `word`, in the plural unless n is 1, with thousands separators: plural(1, "line")
    -> "1 line", plural(1234, "line") -> "1,234 lines"."""
    return f"{n:,} {word if n == 1 else (many or _IRREGULAR.get(word) or word + 's')}"


def noun(n: int, word: str, many: str | None = None) -> str:
    """The word alone, singular or plural for `n` (for "N <adjective> <noun>" phrases)."""
    return word if n == 1 else (many or _IRREGULAR.get(word) or word + "s")
