"""Reading a run's outputs for inspection: the threads of a run, prefixes of thread keys and
session ids, and the `ctxreplay threads` table.

Every command that takes a thread or a session (`request`, `why`, `ledger`, `threads`) resolves
what the user typed here, against the run OUT shows (OUT/current, resolved once):

- a thread key (`<session_id>` for a main thread, `<session_id>--<thread_id>` otherwise) or any
  unique prefix of one; a prefix of one session's id alone means that session's main thread;
- `SESSION/THREAD`, each part a prefix (`5f0c1d2e/agent`), the short form `ledger` prints;
- an ambiguous prefix is refused (exit 2) with the candidates listed.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from ctxreplay.errors import AmbiguousRef, CtxReplayError, UnknownRef, did_you_mean
from ctxreplay.pipeline.core.constants import POLARS_ENGINE
from ctxreplay.pipeline.core.outdir import read_summary, resolve_run
from ctxreplay.pipeline.core.termtext import shown
from ctxreplay.pipeline.core.words import plural

SHOW_CANDIDATES = 8


@dataclass(frozen=True)
class ThreadRef:
    key: str
    session_id: str
    thread_id: str

    @property
    def short(self) -> str:
        return f"{self.session_id[:8]}/{self.thread_id}"


def thread_kind(thread_id: str, source_format: str | None = None, is_sidechain: bool = False) -> str:
    """What a thread is, from the loaders' naming (README, "Threads"): main, subagent, compaction
    agent, branch (a rewind's abandoned path, or a subagent's), sidechain (inline, Claude Code 1.0),
    request (a single request file)."""
    if source_format and source_format.endswith("_request"):
        return "request"
    if thread_id == "main":
        return "main"
    if thread_id.startswith("sidechain-"):
        return "sidechain branch" if "-branch-" in thread_id else "sidechain"
    if thread_id.startswith("branch-"):
        return "branch"
    if thread_id.startswith("agent-acompact-"):
        return "compaction agent"
    if thread_id.startswith("agent-"):
        return "subagent branch" if "-branch-" in thread_id else "subagent"
    # a transcript file whose name is not its session's: the loader names the thread after the file
    return "subagent" if is_sidechain else "main"


class RunView:
    """One published run of OUT, resolved once so that every file read comes from the same run."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.run_dir = resolve_run(out_dir)
        self.memo: dict[Any, Any] = {}  # what readers computed from this run (it never changes)

    def path(self, name: str) -> Path:
        p = self.run_dir / name
        if not p.exists():
            raise CtxReplayError(f"{self.out_dir}: the run has no {name}; re-run `ctxreplay run ... --out "
                                 f"{self.out_dir}` with this version of ctxreplay")
        return p

    @cached_property
    def summary(self) -> dict[str, Any]:
        return read_summary(self.run_dir)

    @property
    def target(self) -> str:
        return str(self.summary.get("target") or "anthropic")

    @cached_property
    def calls(self) -> pl.DataFrame:
        return pl.read_parquet(self.path("calls.parquet"))

    @cached_property
    def decisions(self) -> pl.DataFrame:
        return pl.read_parquet(self.path("decisions.parquet"))

    @cached_property
    def threads(self) -> list[ThreadRef]:
        df = self.calls.select("thread_key", "session_id", "thread_id").unique().sort("thread_key")
        return [ThreadRef(k, s, t) for k, s, t in df.iter_rows()]

    @cached_property
    def sessions(self) -> list[str]:
        return sorted({t.session_id for t in self.threads})

    def thread(self, ref: str) -> ThreadRef:
        return resolve_thread(ref, self.threads, where=str(self.out_dir))

    def session(self, ref: str) -> str:
        return resolve_session(ref, self.sessions, where=str(self.out_dir))


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:SHOW_CANDIDATES])
    return shown + (f" and {len(items) - SHOW_CANDIDATES} more" if len(items) > SHOW_CANDIDATES else "")


def resolve_session(ref: str, sessions: list[str], *, where: str) -> str:
    """The one session id equal to `ref` or starting with it."""
    if ref in sessions:
        return ref
    hits = [s for s in sessions if s.startswith(ref)]
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise AmbiguousRef(f"session '{ref}' is ambiguous in {where}: it starts {plural(len(hits), 'session id')} "
                           f"({_listing(hits)}); give more of the id", hits)
    hint = did_you_mean(ref, sessions)
    raise UnknownRef(f"no session '{ref}' in {where}.{hint} Sessions: {_listing(sessions) or 'none'}")


def resolve_thread(ref: str, threads: list[ThreadRef], *, where: str) -> ThreadRef:
    """The one thread `ref` names (see the module docstring)."""
    by_key = {t.key: t for t in threads}
    if ref in by_key:
        return by_key[ref]
    if "/" in ref:
        s_ref, t_ref = ref.split("/", 1)
        sid = resolve_session(s_ref, sorted({t.session_id for t in threads}), where=where)
        own = [t for t in threads if t.session_id == sid]
        exact = [t for t in own if t.thread_id == t_ref]
        hits = exact or [t for t in own if t.thread_id.startswith(t_ref)]
        if len(hits) == 1:
            return hits[0]
        names = [t.thread_id for t in own]
        if hits:
            raise AmbiguousRef(f"thread '{ref}' is ambiguous in {where}: '{t_ref}' starts "
                               f"{plural(len(hits), 'thread')} of session {sid} ({_listing([t.thread_id for t in hits])}); "
                               f"give more of the thread id", [t.key for t in hits])
        raise UnknownRef(f"session {sid} in {where} has no thread '{t_ref}'; its threads: {_listing(names)}")
    hits = [t for t in threads if t.key.startswith(ref)]
    if len(hits) == 1:
        return hits[0]
    sessions = sorted({t.session_id for t in hits})
    if len(sessions) == 1 and sessions[0].startswith(ref):
        # a prefix of one session's id names that session's main thread
        main = [t for t in hits if t.thread_id == "main"]
        if main:
            return main[0]
        raise AmbiguousRef(f"thread '{ref}' is ambiguous in {where}: session {sessions[0]} has no main thread "
                           f"and {plural(len(hits), 'thread')} ({_listing([t.key for t in hits])}); give the "
                           f"thread key, or SESSION/THREAD", [t.key for t in hits])
    if hits:
        if len(sessions) > 1:
            counts = [f"{s} ({plural(sum(1 for t in hits if t.session_id == s), 'thread')})" for s in sessions]
            raise AmbiguousRef(f"thread '{ref}' is ambiguous in {where}: it starts the thread keys of "
                               f"{plural(len(sessions), 'session')}: {_listing(counts)}; give more of the key",
                               [t.key for t in hits])
        raise AmbiguousRef(f"thread '{ref}' is ambiguous in {where}: it starts {plural(len(hits), 'thread key')} "
                           f"({_listing([t.key for t in hits])}); give more of the key", [t.key for t in hits])
    keys = list(by_key)
    hint = did_you_mean(ref, keys)
    raise UnknownRef(f"no thread '{ref}' in {where}.{hint} See them with: ctxreplay threads {where}")


# ---------------------------------------------------------------------------------------- threads


def known_stages(view: RunView | None, *more: str) -> list[str]:
    """Stage names a filter may name: the registered stages, the run's (a later use of a stage is
    `name#2`) and `more`."""
    from ctxreplay.pipeline.stageapi.registry import load_stages

    names = set(load_stages()) | set(more)
    if view is not None:
        names |= set(view.summary.get("decisions", {}))
        if (view.run_dir / "decisions.parquet").is_file():
            names |= set(view.decisions.get_column("stage").unique().to_list())
    return sorted(names)


def stage_rank() -> dict[str, int]:
    """An order to list stages in: the default pipeline's (a later use of a stage is `name#2`);
    others after it. (summary.json sorts its keys, so the run's own order is not kept there.)"""
    from ctxreplay.pipeline.staging.spec import load_spec
    from ctxreplay.pipeline.staging.stagerun import position_names

    return {name: i for i, name in enumerate(position_names(load_spec(preset="default").stages))}


def _ts(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, _dt.datetime):
        return v.astimezone(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    return str(v)


def threads_table(view: RunView, session: str | None = None) -> list[dict[str, Any]]:
    """One row per thread of the run (optionally one session's), sorted by session then thread."""
    calls = view.calls
    if session is not None:
        calls = calls.filter(pl.col("session_id") == session)
    blocks = (pl.scan_parquet(view.path("blocks.parquet"))
              .select("session_id", "thread_id", "source_format", "is_sidechain")
              .group_by("session_id", "thread_id")
              .agg(pl.col("source_format").first(), pl.col("is_sidechain").any())
              .collect(engine=POLARS_ENGINE))
    own = calls.filter(~pl.col("is_pending"))
    per = (calls.group_by("session_id", "thread_id", "thread_key")
           .agg(first_time=pl.col("timestamp").min(), last_time=pl.col("timestamp").max(),
                pending_call=pl.col("call").filter(pl.col("is_pending")).first(),
                last_prompt_tokens=pl.col("prompt_tokens").filter(pl.col("is_pending")).first())
           .join(own.group_by("session_id", "thread_id")
                 .agg(calls=pl.len(), first_own_call=pl.col("call").min(),
                      models=pl.col("model").drop_nulls().unique().sort()),
                 on=["session_id", "thread_id"], how="left")
           .join(blocks, on=["session_id", "thread_id"], how="left")
           .sort("session_id", "thread_id"))
    dec = view.decisions.group_by("session_id", "thread_id", "stage").agg(
        n=pl.len(), provisional=pl.col("is_provisional").sum())
    stage_order = stage_rank()
    by_thread: dict[tuple[str, str], dict[str, dict[str, int]]] = {}
    for sid, tid, st, n, prov in dec.sort("stage").iter_rows():
        by_thread.setdefault((sid, tid), {})[st] = {"count": int(n), "provisional": int(prov)}
    out = []
    for r in per.iter_rows(named=True):
        stages = by_thread.get((r["session_id"], r["thread_id"]), {})
        stages = dict(sorted(stages.items(), key=lambda kv: (stage_order.get(kv[0], len(stage_order)), kv[0])))
        out.append({
            "session_id": r["session_id"], "thread_id": r["thread_id"], "thread_key": r["thread_key"],
            "kind": thread_kind(r["thread_id"], r["source_format"], bool(r["is_sidechain"])),
            "source_format": r["source_format"],
            "calls": int(r["calls"] or 0),
            "first_own_call": r["first_own_call"], "pending_call": r["pending_call"],
            "models": list(r["models"] or []),
            "first_time": _ts(r["first_time"]), "last_time": _ts(r["last_time"]),
            "last_prompt_tokens": r["last_prompt_tokens"],
            "decisions": sum(v["count"] for v in stages.values()),
            "provisional_decisions": sum(v["provisional"] for v in stages.values()),
            "decisions_by_stage": {k: v["count"] for k, v in stages.items()},
            "violations": None,
        })
    _add_violations(view, out)
    return out


def _add_violations(view: RunView, rows: list[dict[str, Any]]) -> None:
    """Rule violations of the target in each thread's pending request (what `run` validates by
    default): the run's requests/<thread_key>.json, else the request assembled again."""
    from ctxreplay.pipeline.targets import get_target

    target = get_target(view.target)
    calls = view.calls
    awaits = dict(calls.filter(pl.col("is_pending")).select("thread_key", "awaits_user").iter_rows()) \
        if "awaits_user" in calls.columns else {}
    for r in rows:
        path = view.run_dir / "requests" / f"{r['thread_key']}.json"
        try:
            req = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            from ctxreplay.pipeline.assembly.store import request as assemble_call

            req = assemble_call(view.run_dir, r["thread_key"], None, view.target)
        found = target.validate(req, thread_key=r["thread_key"], call=int(r["pending_call"] or 0),
                                awaits_user=bool(awaits.get(r["thread_key"])))
        r["violations"] = len(found)
        r["violations_by_rule"] = {}
        for v in found:
            r["violations_by_rule"][v.rule] = r["violations_by_rule"].get(v.rule, 0) + 1


def _short_time(iso: str | None) -> str:
    return iso[:16].replace("T", " ") if iso else "-"


def render_threads(rows: list[dict[str, Any]], view: RunView) -> str:
    """One line per thread: aligned columns, the thread as SESSION/THREAD (what every command takes)."""
    prefix = session_prefixes(view.sessions)
    head = ["THREAD", "KIND", "CALLS", "MODELS", "FIRST (UTC)", "LAST (UTC)", "PROMPT", "DECISIONS", "VIOLATIONS"]
    table = [head]
    for r in rows:
        calls = str(r["calls"])
        if r["calls"] and r["first_own_call"]:
            last = r["pending_call"] - 1
            calls += f" ({r['first_own_call']})" if last == r["first_own_call"] else f" ({r['first_own_call']}-{last})"
        dec = ", ".join(f"{k} {v}" for k, v in r["decisions_by_stage"].items()) or "-"
        if r["provisional_decisions"]:
            dec += f" ({r['provisional_decisions']} provisional)"
        table.append([f"{prefix[r['session_id']]}/{r['thread_id']}", r["kind"], calls,
                      ", ".join(r["models"]) or "-", _short_time(r["first_time"]), _short_time(r["last_time"]),
                      f"{r['last_prompt_tokens']:,}" if r["last_prompt_tokens"] is not None else "-", dec,
                      str(r["violations"]) if r["violations"] is not None else "-"])
    table = [[shown(c) for c in row] for row in table]  # ids and model names from transcripts: one line each
    right = {2, 6, 8}
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = []
    for row in table:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def session_prefixes(sessions: list[str], least: int = 8) -> dict[str, str]:
    """The shortest prefix (at least `least` characters) that names each session alone; a short id
    (a request file's name) stays whole."""
    out = {}
    ordered = sorted(sessions)
    for i, s in enumerate(ordered):
        if len(s) <= 24:
            out[s] = s
            continue
        n = least
        for other in (ordered[i - 1] if i else None, ordered[i + 1] if i + 1 < len(ordered) else None):
            if other is None:
                continue
            common = 0
            while common < min(len(s), len(other)) and s[common] == other[common]:
                common += 1
            n = max(n, common + 1)
        out[s] = s[:n]
    return out
