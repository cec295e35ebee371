"""The stage registry: `@stage` fills STAGES; third-party stages come through an entry point."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import polars as pl

from pipeline.errors import CtxReplayError

ENTRY_POINT_GROUP = "ctxreplay.stages"


@dataclass(frozen=True, slots=True)
class StageResult:
    """What a stage returns: the new blocks and one decision row per changed block."""

    blocks: pl.LazyFrame
    decisions: pl.LazyFrame


@dataclass(frozen=True, slots=True)
class StageContext:
    """Facts about the run a stage may read (never I/O, clock or randomness).

    `count_tokens` maps a Series of texts to a Series of token counts (cached, versioned).
    """

    target: str = "anthropic"
    window_tokens: int = 200_000
    count_tokens: Callable[[pl.Series], pl.Series] | None = None
    token_counter_version: str = "chars4-v1"
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


StageFn = Callable[[pl.LazyFrame, Any, pl.LazyFrame, StageContext], StageResult]


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    version: int
    params: type
    fn: StageFn
    doc: str
    module: str


STAGES: dict[str, Stage] = {}


class UnknownStage(CtxReplayError, KeyError):
    """No stage of that name is registered (a KeyError too, for callers that look names up)."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name, self.known = name, known
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        self.message = f"Unknown stage '{name}'.{hint} Known stages: {', '.join(sorted(known)) or 'none'}"
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


def stage(name: str, *, version: int, params: type) -> Callable[[StageFn], StageFn]:
    """Register a stage function under `name`; refuses duplicates."""
    if not dataclasses.is_dataclass(params):
        raise TypeError(f"stage '{name}': params must be a dataclass, got {params!r}")

    def register(fn: StageFn) -> StageFn:
        if name in STAGES and STAGES[name].fn is not fn:
            raise ValueError(f"stage '{name}' is already registered by {STAGES[name].module}")
        STAGES[name] = Stage(name, version, params, fn, (fn.__doc__ or "").strip(), fn.__module__)
        return fn

    return register


_loaded = False


def load_stages() -> dict[str, Stage]:
    """Import the built-in stages and the entry-point plugins once; return the registry."""
    global _loaded
    if not _loaded:
        import stages  # noqa: F401  (registers the built-ins)

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            ep.load()
        _loaded = True
    return STAGES


def get_stage(name: str) -> Stage:
    registry = load_stages()
    if name not in registry:
        raise UnknownStage(name, list(registry))
    return registry[name]


def params_doc(params: type) -> list[dict[str, Any]]:
    """Each params field with its type, default and the docstring line under it."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    try:
        tree = ast.parse(inspect.getsource(params))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr) \
                    and isinstance(getattr(b, "value", None), ast.Constant) and isinstance(b.value.value, str):
                docs[a.target.id] = b.value.value.strip()
    except (OSError, TypeError, SyntaxError, IndexError):
        pass
    out = []
    for f in dataclasses.fields(params):
        default: Any = f.default
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        out.append({"name": f.name, "type": str(f.type), "default": default, "doc": docs.get(f.name, "")})
    return out
