"""`ctxreplay init PRESET`: a commented pipeline spec to start from.

The spec written is the preset, every parameter spelled out with its value, type, default and
one-line doc as TOML comments, and the registered stages the preset does not use listed after it,
commented out. As written it resolves to the preset's own spec: `ctxreplay explain` gives it the
preset's sha256 (tests/test_cli_conventions.py checks every preset).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Literal, get_args, get_origin

import orjson

from ctxreplay.pipeline.stageapi.registry import Stage, load_stages, params_doc
from ctxreplay.pipeline.staging.spec import PRESET_DIR, load_spec

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


class NotToml(ValueError):
    """A value TOML cannot write (None inside a list or table)."""


def toml_value(v: Any) -> str:
    """A TOML literal for a JSON-like value (bool, int, float, str, list, tuple, dict)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        text = repr(v)
        return text if any(c in text for c in ".en") else text + ".0"
    if isinstance(v, str):
        return orjson.dumps(v).decode()  # JSON string escapes are TOML basic-string escapes
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        items = [f"{k if _BARE_KEY.match(k) else orjson.dumps(k).decode()} = {toml_value(x)}" for k, x in v.items()]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return toml_value(dataclasses.asdict(v))
    raise NotToml(f"no TOML form for {v!r}")


def describe_type(tp: Any) -> str:
    """A parameter type in words: `one of a | b`, `int`, `list of str`, `str or int`, ..."""
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + " | ".join(str(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        text = " or ".join(describe_type(a) for a in args)
        return text + (" (or unset)" if len(args) < len(get_args(tp)) else "")
    if origin in (tuple, list):
        inner = [a for a in get_args(tp) if a is not Ellipsis]
        return "list of " + (describe_type(inner[0]) if inner else "values")
    if origin is dict:
        return "table"
    if dataclasses.is_dataclass(tp):
        return "table"
    return getattr(tp, "__name__", str(tp))


def _jsonable(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        v = dataclasses.asdict(v)
    if isinstance(v, tuple | list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


def _doc_line(st: Stage) -> str:
    para = st.doc.split("\n\n")[0] if st.doc else ""
    return " ".join(para.split())


def _stage_lines(st: Stage, values: dict[str, Any], commented: bool) -> list[str]:
    hints = typing.get_type_hints(st.params)
    c = "# " if commented else ""
    out = [f"{c}# {st.name} (v{st.version}): {_doc_line(st)}", f"{c}[[stage]]", f'{c}use = "{st.name}"']
    for p in params_doc(st.params):
        name = p["name"]
        value = _jsonable(values.get(name, p["default"]))
        default = _jsonable(p["default"])
        kind = describe_type(hints.get(name, Any))
        try:
            default_text = "unset" if default is None else toml_value(default)
        except NotToml:
            default_text = repr(default)
        note = f" ({kind}; default {default_text})"
        out.append(f"{c}# {p['doc'] or name}{note}")
        if value is None:
            out.append(f"{c}# {name} =")  # unset: TOML has no null, so the key stays out
        else:
            out.append(f"{c}{name} = {toml_value(value)}")
    return out


def _preset_header(name: str) -> list[str]:
    lines = []
    for ln in (PRESET_DIR / f"{name}.toml").read_text(encoding="utf-8").splitlines():
        if not ln.startswith("#"):
            break
        lines.append(ln)
    return lines


PIPELINE_KEYS_DOC = [
    ("description", '""', "Free text about this spec (not part of its hash)."),
    ("target", '"anthropic"', ("Wire shape of the requests: anthropic, gemini, openai-chat, openai-responses "
                               "(default anthropic; `run --target` must agree).")),
    ("window_tokens", "200000", "The model's context window in tokens, a positive whole number (default 200000)."),
]


def init_spec(preset: str) -> str:
    """The commented TOML spec for `preset` (see the module docstring)."""
    from ctxreplay.version import __version__

    spec = load_spec(preset=preset)
    resolved = spec.resolved()
    out = [f"# A ctxreplay pipeline spec, written by `ctxreplay init {preset}` (ctxreplay {__version__}).",
           f"# As written it is the preset '{preset}' (`ctxreplay explain FILE` prints sha256 {spec.sha256});",
           "# every parameter is spelled out: change what you need, delete what you leave at its default.",
           "# The preset says:"]
    out += [f"#   {ln.lstrip('#').strip()}" if ln.strip("# ") else "#" for ln in _preset_header(preset)]
    out += ["", "[pipeline]", f"name = {toml_value(resolved['pipeline']['name'])}"]
    settings = {k: v for k, v in resolved["pipeline"].items() if k != "name"}
    for key, example, doc in PIPELINE_KEYS_DOC:
        out.append(f"# {doc}")
        out.append(f"{key} = {toml_value(settings[key])}" if key in settings else f"# {key} = {example}")
    for key, v in settings.items():
        if key not in {k for k, _, _ in PIPELINE_KEYS_DOC}:
            out.append(f"{key} = {toml_value(v)}")
    used = set()
    for rs, res in zip(spec.stages, resolved["stage"]):
        used.add(rs.stage.name)
        values = {k: v for k, v in res.items() if k not in ("use", "version", "encoder_version")}
        out += ["", *_stage_lines(rs.stage, values, commented=False)]
    others = [st for name, st in sorted(load_stages().items()) if name not in used]
    if others:
        out += ["", "# Stages this preset does not use; remove the leading '# ' of a block to add it",
                "# (README, 'Pipelines and context layers', gives the usual order)."]
        for st in others:
            out += ["#", *_stage_lines(st, {}, commented=True)]
    return "\n".join(out) + "\n"
