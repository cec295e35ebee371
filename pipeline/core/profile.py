"""Counting the polars plans a piece of code runs (`ctxreplay run --profile`, bench/bench_pass.py).

Every plan polars runs goes through the `collect` of one of its query engines
(`polars.lazyframe.engine`): a LazyFrame's collect, and each eager DataFrame operation (an eager
`select`, `filter`, `join` is a small lazy plan collected at once). While `counting()` is active
those methods count their calls; outside it nothing is patched and nothing is counted. What a
count says: how many times polars planned and ran a query, each with a fixed cost (~0.1 to 1 ms
on a small input) whatever its size; it is the figure a pipeline pass pays per stage.

Counting is per process (a `--jobs` worker counts its own batches) and counts the queries of the
thread that began counting (the stages run on one thread). A query run inside another (an eager
Series operation in a Python function an expression maps, as the token counter's, on polars'
threads or on this one) is part of that query's cost and not counted apart: how many such calls
there are, and which of them find a text already counted, depends on how polars schedules the
expression's parts over its threads, and a count that changed from run to run would say nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

_count = 0
_depth = 0
_saved: list[tuple[type, Callable[..., Any]]] = []
_thread: int | None = None  # the thread whose queries are counted
_inside = False  # a counted query is running (a query run inside it is part of it)


def _engines() -> list[type]:
    try:
        from polars.lazyframe import engine
    except ImportError:  # another polars layout: nothing to count
        return []
    return [v for v in vars(engine).values() if isinstance(v, type) and "collect" in vars(v)]


@contextlib.contextmanager
def counting() -> Iterator[None]:
    """Count every polars collect this thread runs while active (nested uses share one count)."""
    global _depth, _thread, _inside
    if _depth == 0:
        _inside = False
        _thread = threading.get_ident()
        for cls in _engines():
            orig = vars(cls)["collect"]

            def counted(self: Any, *a: Any, _orig: Callable[..., Any] = orig, **k: Any) -> Any:
                global _count, _inside
                if _inside or threading.get_ident() != _thread:  # inside a query, or another thread's
                    return _orig(self, *a, **k)
                _count += 1
                _inside = True
                try:
                    return _orig(self, *a, **k)
                finally:
                    _inside = False

            _saved.append((cls, orig))
            cls.collect = counted  # type: ignore[attr-defined]
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            for cls, orig in reversed(_saved):
                cls.collect = orig  # type: ignore[attr-defined]
            _saved.clear()


def active() -> bool:
    """Whether collects are being counted."""
    return _depth > 0


def collects() -> int:
    """The collects counted so far in this process (compare two readings)."""
    return _count
