"""pipeline/core/seq.py: what two sequences share at their ends (why's changed span, the goldens' list rows)."""

from __future__ import annotations

from ctxreplay.pipeline.core.seq import common_ends


def test_common_ends_of_two_sequences() -> None:
    assert common_ends("abXcd", "abYYcd") == (2, 2)
    assert common_ends("aaa", "aa") == (2, 0)          # the suffix never overlaps the prefix
    assert common_ends([1, 2, 3], [1, 2, 3]) == (3, 0)
    assert common_ends([], [1]) == (0, 0)
    assert common_ends("xab", "yab") == (0, 2)
