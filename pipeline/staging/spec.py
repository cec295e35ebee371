"""The declarative pipeline spec (TOML): read, validate before any data is read, resolve, hash.

```toml
[pipeline]
name = "default"

[[stage]]
use = "sanitize"
thinking_policy = "keep_signed"
```
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
import types
import typing
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from ctxreplay.errors import SpecError, did_you_mean
from ctxreplay.pipeline.core.blockops import canonical_json, sha256_hex
from ctxreplay.pipeline.stageapi.registry import RegisteredStage, UnknownStage, get_stage

# the shipped presets (ctxreplay.data, the repository's data/pipelines/), read through importlib.resources
PRESET_DIR = files("ctxreplay.data") / "pipelines"
PIPELINE_KEYS = {"name", "description", "target", "window_tokens"}
DEFAULT_TARGET = "anthropic"
DEFAULT_WINDOW_TOKENS = 200_000


STAGE_KEYS = ("use", "time_budget_seconds")  # keys of a [[stage]] table that are not the stage's params


@dataclass(frozen=True)
class ResolvedStage:
    stage: RegisteredStage
    params: Any  # the stage's frozen params dataclass
    time_budget_seconds: float | None = None
    """A plug-in's time budget per run (None: the default); not part of the spec's hash: it decides
    nothing, it only stops a stage that runs too long."""

    @property
    def params_dict(self) -> dict[str, Any]:
        """The params as JSON values. A field declared with `metadata={"digest_omit_default": True}`
        is left out while it holds its default: a new param whose default keeps the old output
        keeps the old spec hash and config digest (the ledger's namespace) too."""
        d = dataclasses.asdict(self.params)
        for f in dataclasses.fields(self.params):
            if f.metadata.get("digest_omit_default") and d.get(f.name) == f.default:
                d.pop(f.name, None)
        return _jsonable(d)

    @functools.cached_property
    def config_digest(self) -> str:
        """sha256 of what decides the stage's output: name, version, params, and the version of any
        encoder it depends on (the registration's `encoder_version`, e.g. Pillow for images), so an
        upgrade is an explicit new namespace, never a silent re-decision."""
        return sha256_hex(canonical_json({"stage": self.stage.name, "version": self.stage.version,
                                          "params": self.params_dict,
                                          "encoder": _encoder(self).get("encoder_version")}))


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    source: str  # file path or preset:<name>
    stages: tuple[ResolvedStage, ...]
    settings: dict[str, Any]

    @property
    def target(self) -> str | None:
        """The spec's `[pipeline] target`, when it sets one."""
        t = self.settings.get("target")
        return str(t).replace("_", "-") if t is not None else None

    @property
    def window_tokens(self) -> int:
        return int(self.settings.get("window_tokens", DEFAULT_WINDOW_TOKENS))

    def for_target(self, target: str) -> PipelineSpec:
        """This spec as run for `target`. Stages decide per target (sanitize, pairing), so a run for
        another target than the default gets its own ledger namespace: the target is written into
        the settings (and the hash) unless the spec already says it or it is the default."""
        target = target.replace("_", "-")
        if self.target is not None:
            if self.target != target:
                raise SpecError(f"{self.source} sets [pipeline] target = '{self.target}', but --target is "
                                f"'{target}': drop --target to use the spec's target, or change the spec")
            return self
        if target == DEFAULT_TARGET:
            return self
        return dataclasses.replace(self, settings={**self.settings, "target": target})

    def resolved(self) -> dict[str, Any]:
        """The resolved spec, defaults filled in (what the hash covers)."""
        return {
            "pipeline": {"name": self.name, **self.settings},
            "stage": [{"use": s.stage.name, "version": s.stage.version, **s.params_dict, **_encoder(s)}
                      for s in self.stages],
        }

    @functools.cached_property
    def sha256(self) -> str:
        """The hash of `resolved()` (once per spec: a spec never changes)."""
        return sha256_hex(canonical_json(self.resolved()))


def _encoder(rs: ResolvedStage) -> dict[str, Any]:
    enc = rs.stage.encoder_version
    return {"encoder_version": enc} if enc else {}


def _jsonable(v: Any) -> Any:
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


def _type_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check a TOML value against a params field type; returns (ok, converted value)."""
    origin = get_origin(tp)
    if tp is Any:
        return True, value
    if origin is Literal:
        return value in get_args(tp), value
    if origin in (typing.Union, types.UnionType):
        for a in get_args(tp):
            if a is type(None) and value is None:
                return True, None
            ok, conv = _type_ok(value, a)
            if ok:
                return True, conv
        return False, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if origin in (tuple, list) or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return False, value
        args = get_args(tp)
        inner = args[0] if args else Any
        conv = []
        for x in value:
            ok, c = _type_ok(x, inner)
            if not ok:
                return False, value
            conv.append(c)
        return True, tuple(conv) if (origin is tuple or tp is tuple) else conv
    if origin is dict or tp is dict:
        return isinstance(value, dict), value
    return isinstance(value, tp) if isinstance(tp, type) else True, value


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def resolve_params(st: RegisteredStage, raw: dict[str, Any], *, where: str) -> Any:
    """Validate `raw` against the stage's params dataclass and build it (defaults filled in)."""
    hints = typing.get_type_hints(st.params)
    fields = {f.name: f for f in dataclasses.fields(st.params)}
    names = list(fields)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            hint = did_you_mean(key, names)
            msg = f"{where}: unknown parameter '{key}'.{hint} Parameters: {', '.join(names) or 'none'}"
            raise SpecError(msg)
        tp = hints.get(key, Any)
        ok, conv = _type_ok(value, tp)
        if not ok:
            if get_origin(tp) is Literal:
                opts = ", ".join(str(a) for a in get_args(tp))
                msg = f"{where}: {key} must be one of {opts}; got {value!r}"
            else:
                msg = f"{where}: {key} must be {_describe(tp)}; got {value!r} ({type(value).__name__})"
            raise SpecError(msg)
        kwargs[key] = conv
    try:
        params = st.params(**kwargs)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"{where}: {exc}") from exc
    validate = getattr(params, "validate", None)
    if callable(validate):
        try:
            validate()
        except ValueError as exc:
            raise SpecError(f"{where}: {exc}") from exc
    return params


def parse_spec(text: str, *, source: str) -> PipelineSpec:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: not valid TOML: {exc}") from exc
    unknown_top = [k for k in doc if k not in ("pipeline", "stage")]
    if unknown_top:
        hint = did_you_mean(unknown_top[0], ["pipeline", "stage"])
        raise SpecError(f"{source}: unknown table '{unknown_top[0]}'.{hint} A spec has [pipeline] and [[stage]] tables")
    head = doc.get("pipeline", {})
    if not isinstance(head, dict):
        raise SpecError(f"{source}: [pipeline] must be a table")
    for k in head:
        if k not in PIPELINE_KEYS:
            hint = did_you_mean(k, sorted(PIPELINE_KEYS))
            raise SpecError(f"{source} [pipeline]: unknown key '{k}'.{hint} Keys: {', '.join(sorted(PIPELINE_KEYS))}")
    _check_settings(head, source)
    raw_stages = doc.get("stage", [])
    if not isinstance(raw_stages, list):
        raise SpecError(f"{source}: 'stage' must be an array of tables: write [[stage]], not [stage]")
    resolved = tuple(_resolve_stage(raw, i, source) for i, raw in enumerate(raw_stages, start=1))
    check_requires(resolved, source)
    name = str(head.get("name", Path(source).stem))
    settings = {k: v for k, v in head.items() if k not in ("name", "description")}
    return PipelineSpec(name=name, source=source, stages=resolved, settings=settings)


def _resolve_stage(raw: Any, i: int, source: str) -> ResolvedStage:
    """One [[stage]] table: its stage, its params, its time budget."""
    if not isinstance(raw, dict) or "use" not in raw:
        raise SpecError(f"{source} [[stage]] #{i}: missing 'use' (the stage name), e.g. use = \"sanitize\"")
    raw = dict(raw)
    name = raw.pop("use")
    budget = raw.pop("time_budget_seconds", None)
    try:
        st = get_stage(str(name))
    except UnknownStage as exc:
        raise SpecError(f"{source} [[stage]] #{i}: {exc.message}") from exc
    where = f"{source} [[stage]] #{i} ({name})"
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int | float) or budget <= 0:
            raise SpecError(f"{where}: time_budget_seconds must be a positive number of seconds; got {budget!r}")
        if st.is_builtin:
            raise SpecError(f"{where}: time_budget_seconds applies to plug-in stages only (built-in stages run "
                            f"in-process, without a budget); remove it")
    return ResolvedStage(st, resolve_params(st, raw, where=where), float(budget) if budget is not None else None)


def check_requires(stages: tuple[ResolvedStage, ...], source: str) -> None:
    """Each stage's `requires` must come earlier in the pipeline."""
    for i, rs in enumerate(stages, start=1):
        before = {s.stage.name for s in stages[: i - 1]}
        for need in rs.stage.requires:
            if need not in before:
                raise SpecError(
                    f"{source} [[stage]] #{i} ({rs.stage.name}): needs stage '{need}' earlier in the pipeline, "
                    f"and there is none before it. Add a [[stage]] with use = \"{need}\" before #{i}")


def _check_settings(head: dict[str, Any], source: str) -> None:
    """The [pipeline] keys' types and ranges, checked before any data is read."""
    where = f"{source} [pipeline]"
    for key in ("name", "description"):
        if key in head and not isinstance(head[key], str):
            raise SpecError(f"{where}: {key} must be a string; got {head[key]!r} ({type(head[key]).__name__})")
    if "window_tokens" in head:
        w = head["window_tokens"]
        if not isinstance(w, int) or isinstance(w, bool) or w <= 0:
            raise SpecError(f"{where}: window_tokens must be a positive whole number of tokens "
                            f"(the model's context window, e.g. 200000); got {w!r} ({type(w).__name__})")
    if "target" in head:
        from ctxreplay.pipeline.targets import target_names

        t, names = head["target"], target_names()
        if not isinstance(t, str) or t.replace("_", "-") not in names:
            hint = did_you_mean(str(t), names)
            raise SpecError(f"{where}: target must be one of {', '.join(names)}; got {t!r}.{hint}")


def preset_names() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in PRESET_DIR.iterdir() if p.name.endswith(".toml"))


def load_spec(path: str | Path | None = None, *, preset: str | None = None) -> PipelineSpec:
    """Load a spec file, or a shipped preset (data/pipelines/; default: `default`)."""
    if path is not None and preset is not None:
        raise SpecError("give either --pipeline or --preset, not both")
    if path is None:
        name = preset or "default"
        p = PRESET_DIR / f"{name}.toml"
        if not p.is_file():
            names = preset_names()
            hint = did_you_mean(name, names)
            raise SpecError(f"unknown preset '{name}'.{hint} Presets: {', '.join(names)}")
        return parse_spec(p.read_text(encoding="utf-8"), source=f"preset:{name}")
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"{p}: pipeline spec not found; pass a TOML file or use --preset NAME ({', '.join(preset_names())})")
    return parse_spec(p.read_text(encoding="utf-8"), source=str(p))
