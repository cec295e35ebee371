"""Polars imported at its first use, not at `import polars` (the command line only).

A re-run that finds every input unchanged copies the previous run's outputs and never computes a
frame; importing polars was 0.12-0.2 s of its 0.8-0.9 s. `defer("polars")` puts a stand-in module
in `sys.modules`: `import polars as pl` binds it at no cost, and the first attribute anyone reads
from it (`pl.col`, `pl.DataFrame`, a submodule's import) imports polars for real and copies its
namespace into the stand-in, so that every later `pl.<name>` is a plain module attribute.

Only the `ctxreplay` command installs it (ctxreplay/entry.py), before anything imports polars; a
program that imports ctxreplay as a library gets the real module as usual. It stays correct
however polars is reached first: the import runs once, under a lock, on whichever thread reads
first; a module that imported polars before `defer` ran keeps the real module (defer does nothing
then). importlib.util.LazyLoader does not serve here: on Python 3.11 the import system reads the
module's `__spec__` on every later `import polars`, and that read alone runs the import.

Standard library only: the entry point imports this before click, polars and our modules.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from typing import Any

_lock = threading.RLock()


class Deferred(types.ModuleType):
    """The stand-in: a module whose every attribute but its spec and name imports the real one."""

    def __getattr__(self, name: str) -> Any:
        return getattr(load(self), name)


def load(stand_in: Deferred) -> types.ModuleType:
    """The real module (imported now if it is not yet), its namespace copied into `stand_in`."""
    name = stand_in.__name__
    with _lock:
        real = stand_in.__dict__.get("__deferred_real__")
        if real is None:
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]
            try:
                real = importlib.import_module(name)
            except BaseException:
                sys.modules.setdefault(name, stand_in)
                raise
            stand_in.__dict__.update(real.__dict__)
            stand_in.__dict__["__deferred_real__"] = real
        return real


def defer(name: str) -> bool:
    """Put a stand-in for the top-level module `name` in sys.modules, unless it is imported already
    or cannot be found (then `import name` fails as it would). Whether one was put."""
    if name in sys.modules or "." in name:
        return False
    spec = importlib.util.find_spec(name)
    if spec is None:
        return False
    stand_in = Deferred(name)
    stand_in.__spec__ = spec
    stand_in.__file__ = spec.origin
    stand_in.__loader__ = spec.loader
    sys.modules[name] = stand_in
    return True


def is_loaded(name: str) -> bool:
    """Whether the module `name` has been imported for real (not only deferred)."""
    mod = sys.modules.get(name)
    return mod is not None and (not isinstance(mod, Deferred) or "__deferred_real__" in mod.__dict__)


__all__ = ["Deferred", "defer", "is_loaded", "load"]
