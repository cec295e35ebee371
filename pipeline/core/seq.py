"""What two sequences share at their ends (standard library only)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def common_ends(a: Sequence[Any], b: Sequence[Any]) -> tuple[int, int]:
    """(p, s): `a` and `b` share their first p items and, after those, their last s items
    (p + s never exceeds the shorter one's length): what lies between is what changed."""
    n = min(len(a), len(b))
    p = 0
    while p < n and a[p] == b[p]:
        p += 1
    s = 0
    while s < n - p and a[-1 - s] == b[-1 - s]:
        s += 1
    return p, s
