"""The stage contract and the registry: `@stage` fills STAGES; third-party stages come through the
`ctxreplay.stages` entry point. docs/writing-a-stage.md walks through a complete plug-in.

The contract in one place:

- `Stage` (a Protocol): what a stage function is, and what it may and may not do.
- `StageContext`: every fact about the run a stage may read, declared and typed.
- `StageResult`: what a stage returns.
- `@stage(...)`: the registration, with the stage's dependencies (`requires`, `reads`) and the
  hooks the runner calls for it (`frozen` actions it re-applies from the ledger, `rebuild` of
  inserted rows, `spilled_texts`, `encoder_version`), its `quiet` check (blocks on which it decides
  nothing, proved by one small query: the runner then skips its plan), its `live` rule (what it
  decides at the new calls of a live session: ctxreplay.pipeline.stageapi.live) and its `compact`
  params (the live engine's forced compaction).

Built-in stage names belong to ctxreplay: a plug-in that registers one of them (or a name another
plug-in holds) is refused with a message naming both packages.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from typing import Any, Protocol

import polars as pl

from ctxreplay.errors import StageNameTaken, StageRegistrationError, UnknownStage
from ctxreplay.pipeline.core.constants import CHARS4_COUNTER
from ctxreplay.pipeline.stageapi.live import LiveRule

ENTRY_POINT_GROUP = "ctxreplay.stages"
CORE_PACKAGE = "ctxreplay"
CORE_MODULE_PREFIX = "ctxreplay.stages."


@dataclass(frozen=True, slots=True)
class StageResult:
    """What a stage returns: the new blocks and one decision row per changed block version."""

    blocks: pl.LazyFrame
    decisions: pl.LazyFrame


class TokenCounter(Protocol):
    """Maps a Series of texts to a Series of token counts (cached by content, versioned)."""

    def __call__(self, texts: pl.Series) -> pl.Series: ...


@dataclass(frozen=True, slots=True)
class StageRef:
    """Another stage of the pipeline, with its resolved params (see `StageContext.peer`)."""

    stage: RegisteredStage
    params: Any


@dataclass(frozen=True, slots=True)
class StageContext:
    """Every fact about the run a stage may read. Nothing else reaches a stage: no I/O, no clock,
    no randomness, no global state.

    `peers` holds the stages this stage declared in `@stage(reads=...)` that the pipeline has
    (e.g. snip dry-runs the pipeline's tombstone with its params); None when the stage runs alone
    (`ctxreplay.testkit.run_stage`), where a declared peer is the registered stage with its defaults.
    """

    target: str = "anthropic"
    """The target the requests are shaped for (`anthropic`, `openai-chat`, `openai-responses`, `gemini`)."""
    window_tokens: int = 200_000
    """The model's context window, from the spec's `[pipeline] window_tokens`."""
    count_tokens: TokenCounter | None = None
    """The run's token counter; None: the fast estimate ceil(chars / 4)."""
    token_counter_version: str = CHARS4_COUNTER
    """Name and version of `count_tokens` (part of what a token-based decision depends on)."""
    supports_images: bool = True
    """Whether the target takes image input (images turns every image into a note when it does not)."""
    peers: tuple[StageRef, ...] | None = None
    """The declared `reads` stages of the pipeline (see above)."""

    def peer(self, name: str) -> StageRef | None:
        """The pipeline's stage `name` with its params (None: not in the pipeline)."""
        if self.peers is None:
            st = get_stage(name)
            return StageRef(st, st.params())
        return next((p for p in self.peers if p.stage.name == name), None)


class Stage(Protocol):
    """A context layer: a pure function from the blocks of a batch of sessions to new blocks plus
    one decision per changed block version.

    Input:
    - `blocks`: a LazyFrame with exactly the columns and types of `ctxreplay.schemas.blocks.BLOCKS`, every
      session of the batch at once. A row is one *version* of a content block, seen by the calls
      `first_call <= k < last_call` (null last_call: open) of its thread. Never assume row order:
      sort by keys (`order_key`, `block_pos`, `part_pos`, `first_call`).
    - `params`: the stage's frozen params dataclass, defaults filled in, checked by the spec.
    - `ledger`: this stage's earlier decisions for these sessions (STAGE_DECISION columns), in this
      run's thread and call numbering. The runner has already re-applied the `frozen` actions among
      them; it appends a `conflict` row (reason `hash_mismatch` / `missing_target`) for each one it
      could not re-apply because the block changed. A stage reads this only to continue from its
      earlier decisions (e.g. to re-decide a conflicted block at the call it was decided at).
    - `ctx`: a `StageContext`.

    Output: `StageResult(blocks, decisions)`: blocks in the same schema; decisions in
    `ctxreplay.schemas.decisions.STAGE_DECISION`, one per changed block version (drop, replace, insert, ...),
    its `before_sha256` the content it replaced. Edit blocks with `ctxreplay.pipeline.stageapi.marks` (one working
    frame, `finish` writes the decisions); never overwrite the raw columns.

    Rules the runner relies on:
    - Purity: the same input gives byte-identical output; no I/O, clock, randomness or global
      state (spills are written by the runner through the `spilled_texts` hook).
    - Idempotence: running the stage on its own output decides nothing.
    - Causality: what it decides for call k depends only on the versions visible at calls <= k;
      a decision "from call k" never changes what an earlier call sees.
    - Only new decisions: frozen decisions are re-applied by the runner before the stage runs.
    """

    def __call__(self, blocks: pl.LazyFrame, params: Any, ledger: pl.LazyFrame,
                 ctx: StageContext) -> StageResult: ...


@dataclass(frozen=True, slots=True)
class Quiet:
    """A stage's "nothing to decide" check (`@stage(quiet=Quiet(check))`).

    `check(blocks, params, ctx)` returns a boolean aggregate over the blocks (an expression giving
    one value) or a plan of its own (a LazyFrame of one boolean column, every value must hold):
    True only where the stage's plan would decide nothing and change no row but what `blocks` does.
    `blocks(blocks, params, ctx)` is what the stage returns then (None: the blocks as they are, in
    the block order of `finish`); `sorted`: those blocks are in that block order too (the runner
    then hands them on as they are to a quiet position after it, instead of sorting them again).
    The runner asks the check before the stage, when the stage has no
    earlier decision in its ledger view, and skips the stage where it holds; the checks of
    consecutive positions are asked in one query. A check must be conservative: "not quiet" is
    always right (the plan runs), "quiet" must be proved (tests/test_stage_quiet.py)."""

    check: Callable[[pl.LazyFrame, Any, StageContext], pl.Expr | pl.LazyFrame]
    blocks: Callable[[pl.LazyFrame, Any, StageContext], pl.LazyFrame] | None = None
    sorted: bool = False


# (the frame types as strings: these aliases are made at import, and polars is imported at first use)
SpilledTexts = Callable[["pl.LazyFrame", "pl.LazyFrame"], "pl.LazyFrame"]
"""(blocks the stage received, its decisions) -> (sha256, text) of every spilled text to store."""
Rebuild = Callable[["pl.LazyFrame", "pl.LazyFrame", "pl.LazyFrame"], tuple["pl.LazyFrame", "pl.LazyFrame"]]
"""(blocks before re-application, blocks after, ledger view) -> (blocks with the rows the stage
inserted in earlier runs rebuilt, their decisions)."""


@dataclass(frozen=True, slots=True)
class RegisteredStage:
    """A registered stage and what the runner needs to know about it."""

    name: str
    version: int
    params: type
    fn: Stage
    doc: str
    module: str
    requires: tuple[str, ...] = ()
    """Stages that must come earlier in the pipeline (the spec checker refuses a pipeline without)."""
    reads: tuple[str, ...] = ()
    """Stages whose params this stage reads through `StageContext.peer` (anywhere in the pipeline)."""
    frozen: tuple[str, ...] = ()
    """Decision actions the runner re-applies from the ledger before the stage runs."""
    rebuild: Rebuild | None = None
    """Re-creates rows the stage inserted and froze (their place is not in the ledger)."""
    spilled_texts: SpilledTexts | None = None
    """Texts the runner writes to OUT/spill/<sha256> for the stage's `spill` decisions."""
    encoder_version: str | None = None
    """Version of an encoder the output depends on (e.g. Pillow): part of the config digest."""
    live: LiveRule | None = None
    """What the stage decides at the new calls of a live session, without a pass (None: the live
    engine runs a full pass at every step of a pipeline that holds it)."""
    compact: Callable[[Any], Any] | None = None
    """params -> the params of a forced compaction (`Engine.compact(force=True)`: the stage run
    now with its triggers at their minimum); None: the stage takes no part in one."""
    quiet: Quiet | None = None
    """Blocks on which the stage decides nothing, proved by one small query (None: its plan always runs)."""

    @property
    def is_builtin(self) -> bool:
        return self.module.startswith(CORE_MODULE_PREFIX)

    @property
    def owner(self) -> str:
        """The distribution that registered the stage (ctxreplay for the built-ins)."""
        return owner_of(self.module)[0]

    @property
    def owner_version(self) -> str | None:
        return owner_of(self.module)[1]


STAGES: dict[str, RegisteredStage] = {}


@dataclass(frozen=True, slots=True)
class PluginError:
    """An entry point of the `ctxreplay.stages` group that could not be loaded."""

    entry_point: str
    package: str
    message: str
    stage: str | None = None


PLUGIN_ERRORS: list[PluginError] = []


@cache
def _distributions() -> dict[str, list[str]]:
    from importlib.metadata import packages_distributions

    return dict(packages_distributions())


def owner_of(module: str) -> tuple[str, str | None]:
    """(distribution name, version) that provides `module`; the top-level package when no
    installed distribution does (a module on sys.path, a test)."""
    from importlib.metadata import PackageNotFoundError, version

    if module.startswith(CORE_MODULE_PREFIX) or module == "ctxreplay.stages":
        dist = CORE_PACKAGE
    else:
        top = module.split(".")[0]
        dists = _distributions().get(top) or []
        if not dists:
            return top, None
        dist = dists[0]
    try:
        return dist, version(dist)
    except PackageNotFoundError:
        if dist == CORE_PACKAGE:
            from ctxreplay.version import __version__

            return dist, __version__
        return dist, None


def _describe_owner(module: str) -> str:
    name, ver = owner_of(module)
    return f"{name} {ver} ({module})" if ver else f"{name} ({module})"


def stage(name: str, *, version: int, params: type, requires: tuple[str, ...] = (), reads: tuple[str, ...] = (),
          frozen: tuple[str, ...] = (), rebuild: Rebuild | None = None, spilled_texts: SpilledTexts | None = None,
          encoder_version: str | None = None, live: LiveRule | None = None,
          compact: Callable[[Any], Any] | None = None, quiet: Quiet | None = None) -> Callable[[Stage], Stage]:
    """Register a stage function under `name` (see `RegisteredStage` for the keywords).

    Refuses a params class that is not a dataclass, and a name that another package registered
    (built-in names belong to ctxreplay); re-registering the same function (a module reloaded)
    replaces it."""
    if not dataclasses.is_dataclass(params):
        raise StageRegistrationError(f"stage '{name}': params must be a dataclass, got {params!r}")
    if live is not None and not isinstance(live, LiveRule):
        raise StageRegistrationError(f"stage '{name}': live must be a LiveRule(start, step) "
                                     f"(ctxreplay.LiveRule), got {type(live).__name__}")
    if quiet is not None and not isinstance(quiet, Quiet):
        raise StageRegistrationError(f"stage '{name}': quiet must be a Quiet(check) (ctxreplay.Quiet), got "
                                     f"{type(quiet).__name__}")

    def register(fn: Stage) -> Stage:
        module = getattr(fn, "__module__", "") or ""
        if not module.startswith(CORE_MODULE_PREFIX):
            _load_builtin()  # built-in names are taken first, whoever imports first
        held = STAGES.get(name)
        if held is not None and held.fn is not fn and not _same_function(held, fn):
            raise StageNameTaken(name, held.module, module, held_owner=_describe_owner(held.module),
                                 wanted_owner=_describe_owner(module),
                                 built_in=held.module.startswith(CORE_MODULE_PREFIX))
        STAGES[name] = RegisteredStage(
            name, version, params, fn, (fn.__doc__ or "").strip(), module, tuple(requires), tuple(reads),
            tuple(frozen), rebuild, spilled_texts, encoder_version, live, compact, quiet)
        return fn

    return register


def _same_function(held: RegisteredStage, fn: Stage) -> bool:
    return held.module == getattr(fn, "__module__", None) and \
        getattr(held.fn, "__qualname__", None) == getattr(fn, "__qualname__", None)


_builtin_loaded = False
_plugins_loaded = False


def _load_builtin() -> None:
    global _builtin_loaded
    if not _builtin_loaded:
        _builtin_loaded = True
        importlib.import_module("ctxreplay.stages")  # registers the built-ins


def load_stages() -> dict[str, RegisteredStage]:
    """Import the built-in stages, then the entry-point plug-ins, once; return the registry.

    A plug-in that fails to load (an import error, a taken name) is left out and recorded in
    PLUGIN_ERRORS (shown by `ctxreplay stages`); it never stops a run that does not use it."""
    global _plugins_loaded
    _load_builtin()
    if not _plugins_loaded:
        _plugins_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                ep.load()
            except Exception as exc:  # noqa: BLE001  (a broken plug-in is reported, not fatal)
                package = ep.dist.name if ep.dist is not None else ep.value.split(":")[0].split(".")[0]
                first = (str(exc).strip().splitlines() or [""])[0][:300]
                PLUGIN_ERRORS.append(PluginError(ep.name, package, f"{type(exc).__name__}: {first}",
                                                 getattr(exc, "name", None) if isinstance(exc, StageNameTaken)
                                                 else None))
    return STAGES


def reload_plugins() -> dict[str, RegisteredStage]:
    """Look at the entry points again (after installing a plug-in in this process, e.g. in a test)."""
    global _plugins_loaded
    _plugins_loaded = False
    PLUGIN_ERRORS.clear()
    _distributions.cache_clear()
    return load_stages()


def get_stage(name: str) -> RegisteredStage:
    registry = load_stages()
    if name not in registry:
        broken = next((e for e in PLUGIN_ERRORS if name in (e.entry_point, e.stage)), None)
        raise UnknownStage(name, list(registry), (broken.package, broken.message) if broken else None)
    return registry[name]


def params_doc(params: type) -> list[dict[str, Any]]:
    """Each params field with its type, default and the docstring line under it."""
    import ast
    import inspect
    from itertools import pairwise

    docs: dict[str, str] = {}
    try:
        tree = ast.parse(inspect.getsource(params))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for a, b in pairwise(body):
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


# the name before the contract had one (kept for plug-ins written against it)
StageFn = Stage


def toml_value(v: Any) -> str | None:
    """A value as TOML (None: TOML has no null)."""
    import json

    if v is None:
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list | tuple):
        items = [toml_value(x) for x in v]
        return "[" + ", ".join(x for x in items if x is not None) + "]"
    if isinstance(v, dict):
        parts = [f"{k if k.replace('_', '').replace('-', '').isalnum() else json.dumps(k)} = {toml_value(x)}"
                 for k, x in v.items() if x is not None]
        return "{ " + ", ".join(parts) + " }" if parts else "{}"
    return json.dumps(str(v))


def defaults_toml(st: RegisteredStage) -> str:
    """The stage's `[[stage]]` table with every parameter at its default, each with its doc as a
    comment: valid TOML to paste into a spec (a parameter without a default value is commented out)."""
    lines = ["[[stage]]", f"use = {toml_value(st.name)}"]
    for p in params_doc(st.params):
        value = toml_value(p["default"])
        doc = f"  # {p['doc']}" if p["doc"] else ""
        lines.append(f"{p['name']} = {value}{doc}" if value is not None else f"# {p['name']} = (unset){doc}")
    return "\n".join(lines)


def describe(st: RegisteredStage) -> dict[str, Any]:
    """What `ctxreplay stages --json` says about one stage."""
    return {
        "name": st.name, "version": st.version, "owner": st.owner, "owner_version": st.owner_version,
        "builtin": st.is_builtin, "module": st.module, "doc": " ".join(st.doc.split("\n\n")[0].split()),
        "requires": list(st.requires), "reads": list(st.reads), "frozen": list(st.frozen),
        "params": params_doc(st.params), "toml": defaults_toml(st),
    }
