"""A Fenwick tree (binary indexed tree): prefix sums with point updates, O(log n) each. The
forward scans of tombstone and auto_compact keep running token totals in one."""

from __future__ import annotations


class Fenwick:
    """Prefix sums with point updates (non-negative values), O(log n) each."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0] * (n + 1)

    def add(self, i: int, v: int) -> None:
        i += 1
        while i <= self.n:
            self.tree[i] += v
            i += i & -i

    def prefix(self, i: int) -> int:
        """Sum of items 0..i-1."""
        total = 0
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total

    def lower_bound(self, target: int) -> int:
        """The smallest i with prefix(i) >= target (n + 1 when there is none)."""
        if target <= 0:
            return 0
        pos, rem, step = 0, target, 1 << self.n.bit_length()
        while step:
            nxt = pos + step
            if nxt <= self.n and self.tree[nxt] < rem:
                pos, rem = nxt, rem - self.tree[nxt]
            step >>= 1
        return pos + 1
