"""Cost and cache report from recorded usage, without a replay: `ctxreplay report`.

Reads the usage every transcript records (Claude Code `message.usage`, OpenClaw / pi `usage`,
Codex `token_count` events, Gemini CLI answers' `tokens`: reporting/gemini_usage.py),
normalises it to one shape (uncached input, output, 5-minute and
1-hour cache writes, cache reads), keeps one copy of each request, prices it with
`ctxreplay.pipeline.cost.prices` and sums it by session, day, month, model or project.

One copy per request (Claude Code writes one line per content block and repeats the usage on each):
- the key is (message.id, requestId), or message.id alone without a requestId;
- a copy outside a sidechain beats a sidechain copy (`/btw` replays), which beats an
  `agent_progress` copy embedded in the parent file; among equals the largest token total wins
  (`output_tokens` is only final on the last line), and among equal totals the first one in path
  order;
- `agent_progress` copies whose request has no line of its own (the subagent's file is missing)
  are not counted by default, as in ccusage's session report; they are reported under
  `progress_only` and counted with `count_progress_copies` (ccusage's daily report counts them).
Subagent and compaction files (`<session>/subagents/*.jsonl`) belong to their session.

Speed: the files are searched as bytes for `"usage"` (Claude Code, OpenClaw) or the Codex event
names and only those lines are parsed (orjson), in worker processes when the input is large.
Nothing heavy is imported: no polars, pyarrow, DuckDB or genai-prices on a warm price cache.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, Literal

import orjson

from ctxreplay.errors import InputError
from ctxreplay.pipeline.cost.prices import (
    Modifiers,
    PriceBook,
    ccusage_long_context,
    modifiers,
    price_with,
    request_usd,
)
from ctxreplay.pipeline.loaders.inputs import CHUNK_BYTES, list_files, max_line_bytes, open_input
from ctxreplay.pipeline.reporting import gemini_usage
from ctxreplay.pipeline.reporting.tokencount import token_count

By = Literal["session", "day", "week", "month", "block", "model", "project"]
BY_CHOICES = ("session", "day", "week", "month", "block", "model", "project")
BLOCK_HOURS = 5
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
PARALLEL_MIN_BYTES = 48_000_000
_UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_CODEX_NEEDLES = (b'"token_count"', b'"turn_context"', b'"session_meta"')

# record fields (a plain tuple: millions of them must stay cheap); DAY (in --tz) and COST (USD, None when
# unpriced) are appended by `Pricer.finish`, in the process that scanned the file
KEY, PRIO, TOTAL, SESSION, PROJECT, TS, MODEL, PROVIDER, IN, OUT, CW5, CW1, CR, MODS, WEB, RECORDED, SOURCE, \
    DAY, COST = range(19)
PRIO_PROGRESS, PRIO_SIDECHAIN, PRIO_MAIN = 0, 1, 2


@dataclass(frozen=True)
class ReportOptions:
    by: By = "session"
    since: date | None = None
    until: date | None = None
    tz: str | None = None
    """IANA zone for day / month keys and --since / --until; None: the system's local zone."""
    compat: Literal["ccusage"] | None = None
    count_progress_copies: bool = False
    workers: int | None = None
    """Processes for the scan; None: the CPU count when the input is large (>= 48 MB), else 1."""
    breakdown: bool = False
    """Each row also gets `breakdown`: its sums per model (ccusage's --breakdown)."""
    since_mode: Literal["request", "session"] = "request"
    """What --since / --until cut: each request by its own day, or whole sessions by their last
    activity's day (ccusage's session report)."""
    start_of_week: str = "sunday"
    """First day of a `week` row (its key is that day's date), as ccusage's weekly report (default sunday)."""


@dataclass
class FileScan:
    """What one file contributed: its records (already one per request key) and its problems."""

    path: str
    source: str
    records: list[tuple[Any, ...]]
    usage_lines: int = 0
    bad_lines: list[dict[str, Any]] = field(default_factory=list)
    lines_too_long: int = 0  # lines over --max-line-bytes that may hold usage: not read (in bad_lines too)


@dataclass
class Report:
    by: str
    rows: list[dict[str, Any]]
    totals: dict[str, Any]
    progress_only: dict[str, Any]
    files: int
    usage_lines: int
    requests: int
    bad_lines: list[dict[str, Any]]
    warnings: list[str]
    genai_prices_version: str
    prices: str
    tz: str
    since: str | None
    until: str | None
    compat: str | None
    records: list[tuple[Any, ...]] = field(default_factory=list, repr=False)
    """The requests counted (one tuple each, fields KEY ... COST): what `--html` groups by day and model."""
    lines_too_long: int = 0
    """Lines over --max-line-bytes that may hold usage: not read (each in bad_lines too)."""
    max_line_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"by": self.by, "rows": self.rows, "totals": self.totals, "genai_prices_version": self.genai_prices_version,
                "prices": self.prices, "tz": self.tz, "since": self.since, "until": self.until, "compat": self.compat,
                "progress_only": self.progress_only, "files": self.files, "usage_lines": self.usage_lines,
                "requests": self.requests, "bad_lines": self.bad_lines, "lines_too_long": self.lines_too_long,
                "max_line_bytes": self.max_line_bytes, "warnings": self.warnings}


# ---------------------------------------------------------------------------------------------
# finding files


def is_transcript_name(name: str) -> bool:
    return name.endswith(".jsonl") or ".jsonl.deleted." in name or ".jsonl.reset." in name \
        or gemini_usage.is_session_name(name)


def discover(paths: Iterable[Path], skipped: list[dict[str, str]] | None = None) -> list[str]:
    """Transcript files under `paths` (recursive), sorted, each once. Symbolic links out of a directory
    given (unless --follow-links), FIFOs and devices are not read (loaders/inputs.py, as for `run`):
    they go to `skipped` with the reason."""
    found, skips = list_files(paths, is_transcript_name, missing=lambda p: InputError(
        f"{p}: no such file or directory. Pass transcript files or directories (e.g. ~/.claude/projects, "
        f"~/.openclaw/agents)"))
    if skipped is not None:
        skipped.extend(skips)
    out = [str(f) for f in found]
    seen: set[tuple[int, int]] = set()
    uniq = []
    for f in sorted(out):
        try:
            st = os.stat(f)
        except OSError:
            uniq.append(f)          # scan_file reports it as unreadable
            continue
        ident = (st.st_dev, st.st_ino)   # the same file reached twice (overlapping PATHS, links) counts once
        if ident not in seen:
            seen.add(ident)
            uniq.append(f)
    return uniq


# ---------------------------------------------------------------------------------------------
# scanning one file




def _first_object(data: Any, limit: int | None = None) -> Any:
    """The first non-blank line's JSON object (None when it does not parse, or when it is longer than
    `limit` bytes: not read); reads nothing past it."""
    limit = max_line_bytes(limit)
    pos = 0
    n = len(data)
    while pos < n:
        end = data.find(b"\n", pos)
        if end == -1:
            end = n
        if end - pos > limit:
            return None if not _blank(data, pos, end) else _first_object_after(data, end, limit)
        raw = data[pos:end]
        if raw.strip():
            try:
                return orjson.loads(raw)
            except orjson.JSONDecodeError:
                return None
        pos = end + 1
    return None


def _first_object_after(data: Any, end: int, limit: int) -> Any:
    return _first_object(memoryview(data)[end + 1:], limit) if isinstance(data, bytes) else \
        _first_object(data[end + 1:end + 1 + 2 * limit], limit)


def _blank(data: Any, s: int, e: int) -> bool:
    """Whether data[s:e] is nothing but whitespace, read a chunk at a time (never copied whole)."""
    return all(not bytes(data[i:min(i + CHUNK_BYTES, e)]).strip() for i in range(s, e, CHUNK_BYTES))


def _line_no(data: Any, pos: int) -> int:
    """The 1-based number of the line that starts at `pos` (line breaks counted a chunk at a time)."""
    return 1 + sum(bytes(data[i:min(i + CHUNK_BYTES, pos)]).count(b"\n") for i in range(0, pos, CHUNK_BYTES))


def too_long(path: str, data: Any, s: int, e: int, limit: int, what: str = "a line") -> dict[str, Any]:
    """The bad_lines entry of a line (or .json document) over --max-line-bytes: not read, its length
    and first 200 bytes said."""
    return {"file": path, "line": _line_no(data, s),
            "reason": f"{what} of {e - s:,} bytes, over the limit of {limit:,} bytes (--max-line-bytes): not read",
            "raw": bytes(data[s:s + 200]).decode("utf-8", "replace")}


def _loads_line(line: bytes) -> list[Any]:
    """The JSON object(s) on one line; a line with two objects back to back (a lost newline) gives both."""
    try:
        return [orjson.loads(line)]
    except orjson.JSONDecodeError:
        import json

        text = line.decode("utf-8", "replace").strip()
        dec = json.JSONDecoder()
        objs, i = [], 0
        while i < len(text):
            obj, i = dec.raw_decode(text, i)   # raises ValueError on garbage: caught by the caller
            objs.append(obj)
            while i < len(text) and text[i].isspace():
                i += 1
        return objs


def _bad(path: str, data: bytes, start: int, line: bytes, exc: Exception) -> dict[str, Any]:
    return {"file": path, "line": _line_no(data, start),
            "reason": f"not valid JSON: {exc}"[:200], "raw": line[:200].decode("utf-8", "replace")}


def _claude_ids(path: str) -> tuple[str | None, str]:
    """(session id from the path, project) for a Claude Code file; None when the path does not say."""
    parts = path.replace("\\", "/").split("/")
    name = parts[-1]
    if len(parts) >= 4 and parts[-2] == "subagents":
        return parts[-3], parts[-4]
    stem = name.split(".jsonl")[0]
    project = parts[-2] if len(parts) >= 2 else ""
    return (stem if _UUID_RE.match(stem) else None), project


def _keep(best: dict[Any, tuple[Any, ...]], rec: tuple[Any, ...], keyless: list[tuple[Any, ...]]) -> None:
    k = rec[KEY]
    if k is None:
        keyless.append(rec)
        return
    old = best.get(k)
    if old is None or (rec[PRIO], rec[TOTAL]) > (old[PRIO], old[TOTAL]):
        best[k] = rec


_PLAIN = (None, "standard", "default", "", "global", "not_available")


def _claude_record(o: dict[str, Any], session: str, project: str, compat: bool) -> tuple[Any, ...] | None:
    """One Claude Code line (an assistant entry or an agent_progress copy of one) → a record, or None."""
    t = o.get("type")
    if t == "assistant":
        m = o.get("message")
        prio = PRIO_SIDECHAIN if o.get("isSidechain") else PRIO_MAIN
        rid = o.get("requestId")
        ts = o.get("timestamp")
        recorded = o.get("costUSD") if compat else None
    elif t == "progress":
        d = o.get("data")
        if not isinstance(d, dict) or d.get("type") != "agent_progress":
            return None
        inner = d.get("message")
        if not isinstance(inner, dict) or inner.get("type") != "assistant":
            return None
        m = inner.get("message")
        prio = PRIO_PROGRESS
        rid = inner.get("requestId")
        ts = inner.get("timestamp") or o.get("timestamp")
        recorded = None
    else:
        return None
    if type(m) is not dict:
        return None
    u = m.get("usage")
    if type(u) is not dict:
        return None
    # the common case (plain non-negative ints) without a function call per field
    inp = u.get("input_tokens")
    inp = inp if type(inp) is int and inp >= 0 else token_count(inp)
    out = u.get("output_tokens")
    out = out if type(out) is int and out >= 0 else token_count(out)
    cc = u.get("cache_creation_input_tokens")
    cc = cc if type(cc) is int and cc >= 0 else token_count(cc)
    cr = u.get("cache_read_input_tokens")
    cr = cr if type(cr) is int and cr >= 0 else token_count(cr)
    split = u.get("cache_creation")
    if type(split) is dict:
        cw1 = split.get("ephemeral_1h_input_tokens")
        cw1 = cw1 if type(cw1) is int and cw1 >= 0 else token_count(cw1)
        cw5 = split.get("ephemeral_5m_input_tokens")
        cw5 = cw5 if type(cw5) is int and cw5 >= 0 else token_count(cw5)
        if cw5 + cw1 < cc:            # an older or partial split: the rest was a default (5-minute) write
            cw5 = cc - cw1
    else:
        cw5, cw1 = cc, 0
    web = 0
    if not compat:                    # ccusage does not price web searches
        stu = u.get("server_tool_use")
        if type(stu) is dict:
            web = token_count(stu.get("web_search_requests"))
    total = inp + out + cw5 + cw1 + cr
    if total == 0 and web == 0:
        return None
    mid = m.get("id")
    key = (mid, rid) if type(mid) is str and mid else None
    sp, st, geo = u.get("speed"), u.get("service_tier"), u.get("inference_geo")
    mods = () if sp in _PLAIN and st in _PLAIN and geo in _PLAIN else \
        modifiers(speed=sp, service_tier=st, inference_geo=geo)
    model = m.get("model")
    if type(model) is not str or not model:
        model = "unknown"
    if recorded is not None:
        recorded = float(recorded) if type(recorded) in (int, float) else None
    return (key, prio, total, session, project, ts if type(ts) is str else "", model, None,
            inp, out, cw5, cw1, cr, mods, web, recorded, "claude-code")


def lines_holding(data: bytes, needle: bytes, limit: int | None = None,
                  long: list[tuple[int, int]] | None = None) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of every line of `data` that holds `needle`, each once, in order: the scanners
    read only the lines that can hold usage (a search for the needle, not a split of the file). A
    line longer than `limit` bytes (default: --max-line-bytes) is not copied out: its (start, end)
    goes to `long` instead."""
    limit = max_line_bytes(limit)
    find, rfind = data.find, data.rfind
    pos = find(needle)
    while pos != -1:
        s = rfind(b"\n", 0, pos) + 1
        e = find(b"\n", pos)
        if e == -1:
            e = len(data)
        if e - s > limit:
            if long is not None:
                long.append((s, e))
        else:
            yield s, data[s:e]
        pos = find(needle, e)


def lines_of(data: Any, limit: int, long: list[tuple[int, int]]) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of every line of `data`, in order, but those over `limit` bytes, whose (start,
    end) go to `long` (blank ones aside): no copy of the whole file, nor of a line over the limit."""
    n, s = len(data), 0
    while s <= n:
        e = data.find(b"\n", s)
        if e == -1:
            e = n
        if e - s > limit:
            if not _blank(data, s, e):
                long.append((s, e))
        else:
            yield s, data[s:e]
        s = e + 1


def _scan_claude(path: str, data: bytes, compat: bool, limit: int) -> FileScan:
    sid, project = _claude_ids(path)
    scan = FileScan(path, "claude-code", [])
    long: list[tuple[int, int]] = []
    best: dict[Any, tuple[Any, ...]] = {}
    keyless: list[tuple[Any, ...]] = []
    # every Anthropic usage object has output_tokens: a long needle finds the lines fastest
    needle = b'"output_tokens"'
    loads = orjson.loads
    pending: list[dict[str, Any]] = []    # objects read before the session id is known (flat agent files)
    for s, line in lines_holding(data, needle, limit, long):
        if compat and b'"usage":{' not in line:   # ccusage reads only lines with these exact bytes
            continue
        try:
            objs = [loads(line)]
        except orjson.JSONDecodeError:
            try:
                objs = _loads_line(line)
            except ValueError as exc:
                scan.bad_lines.append(_bad(path, data, s, line, exc))
                continue
        scan.usage_lines += 1
        for o in objs:
            if type(o) is not dict:
                continue
            if sid is None:
                got = o.get("sessionId")
                if isinstance(got, str) and got:
                    sid = got
                else:
                    pending.append(o)
                    continue
            rec = _claude_record(o, sid, project, compat)
            if rec is None:
                continue
            k = rec[0]
            if k is None:
                keyless.append(rec)
                continue
            old = best.get(k)
            if old is None or (rec[1], rec[2]) > (old[1], old[2]):
                best[k] = rec
    # a line cut short before its output_tokens (`{"type":"assistant","message":{"usage":{"input_tokens":5`)
    # still held usage: it goes to bad_lines, never dropped silently
    for s, line in lines_holding(data, b'"usage"', limit, long):
        if needle in line:
            continue                      # read above
        try:
            _loads_line(line)
        except ValueError as exc:
            scan.bad_lines.append(_bad(path, data, s, line, exc))
    _take_long(scan, data, sorted(set(long)), limit)
    if pending:
        sid = sid or Path(path).name.split(".jsonl")[0]
        for o in pending:
            rec = _claude_record(o, sid, project, compat)
            if rec is not None:
                _keep(best, rec, keyless)
    scan.records = [*best.values(), *keyless]
    return scan


def _iso_from_ms(v: Any) -> str:
    if isinstance(v, int | float) and not isinstance(v, bool):
        return datetime.fromtimestamp(v / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    return ""


def _scan_pi(path: str, data: bytes, header: dict[str, Any], limit: int) -> FileScan:
    """OpenClaw / pi: `usage = {input, output, cacheRead, cacheWrite, totalTokens, cost}` per message."""
    scan = FileScan(path, "openclaw", [])
    long: list[tuple[int, int]] = []
    parts = path.replace("\\", "/").split("/")
    # the file name is the session id (`<uuid>.jsonl`, `.jsonl.deleted.<ts>`); the header id may differ
    m = re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", parts[-1])
    sid = m.group(0) if m else header.get("id") if isinstance(header.get("id"), str) and header.get("id") \
        else parts[-1].split(".jsonl")[0]
    if len(parts) >= 4 and parts[-2] == "sessions" and parts[-4] == "agents":
        project = parts[-3]
    else:
        cwd = header.get("cwd")
        project = cwd if isinstance(cwd, str) and cwd else (parts[-2] if len(parts) >= 2 else "")
    best: dict[Any, tuple[Any, ...]] = {}
    keyless: list[tuple[Any, ...]] = []
    for s, line in lines_holding(data, b'"usage"', limit, long):
        try:
            objs = _loads_line(line)
        except ValueError as exc:
            scan.bad_lines.append(_bad(path, data, s, line, exc))
            continue
        scan.usage_lines += 1
        for o in objs:
            if not isinstance(o, dict) or o.get("type") != "message":
                continue
            msg = o.get("message")
            if not isinstance(msg, dict) or msg.get("role") != "assistant":
                continue
            u = msg.get("usage")
            if not isinstance(u, dict):
                continue
            inp, out, cr, cw = token_count(u.get("input")), token_count(u.get("output")), token_count(u.get("cacheRead")), \
                token_count(u.get("cacheWrite"))
            if inp + out + cr + cw == 0:
                continue
            model = msg.get("model") if isinstance(msg.get("model"), str) and msg.get("model") else "unknown"
            provider = msg.get("provider") if isinstance(msg.get("provider"), str) else None
            ts = o.get("timestamp") if isinstance(o.get("timestamp"), str) else _iso_from_ms(msg.get("timestamp"))
            # content key: a forked session's copy of the same message dedupes, distinct requests never collide
            key = ("pi", msg.get("timestamp"), provider, model, inp, out, cr, cw)
            # the `cost` OpenClaw records comes from its own table (0 for models it does not know): not used
            rec = (key, PRIO_MAIN, inp + out + cr + cw, sid, project, ts, model, provider, inp, out, cw, 0, cr, (), 0,
                   None, "openclaw")
            _keep(best, rec, keyless)
    _take_long(scan, data, long, limit)
    scan.records = [*best.values(), *keyless]
    return scan


def _take_long(scan: FileScan, data: Any, long: list[tuple[int, int]], limit: int) -> None:
    """Lines over the limit that may hold usage: in bad_lines (`too_long`), counted in lines_too_long."""
    for s, e in long:
        scan.bad_lines.append(too_long(scan.path, data, s, e, limit))
    scan.lines_too_long += len(long)


def _scan_codex(path: str, data: Any, limit: int) -> FileScan:
    """Codex rollout: `token_count` events, input includes the cached tokens; model from `turn_context`."""
    scan = FileScan(path, "codex", [])
    sid = Path(path).name.split(".jsonl")[0]
    m = re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", sid)
    sid = m.group(0) if m else sid
    project = ""
    provider: str | None = "openai"
    model = "unknown"
    last_total: Any = None
    best: dict[Any, tuple[Any, ...]] = {}
    keyless: list[tuple[Any, ...]] = []
    long: list[tuple[int, int]] = []
    for s, line in lines_of(data, limit, long):
        if not any(n in line for n in _CODEX_NEEDLES):
            continue
        try:
            objs = _loads_line(line)
        except ValueError as exc:
            scan.bad_lines.append(_bad(path, data, s, line, exc))
            continue
        for o in objs:
            if not isinstance(o, dict):
                continue
            p = o.get("payload")
            if not isinstance(p, dict):
                continue
            t = o.get("type")
            if t == "session_meta":
                sid = p.get("id") if isinstance(p.get("id"), str) else sid
                project = p.get("cwd") if isinstance(p.get("cwd"), str) else project
                provider = p.get("model_provider") if isinstance(p.get("model_provider"), str) else provider
                if isinstance(p.get("model"), str):
                    model = p["model"]
            elif t == "turn_context":
                if isinstance(p.get("model"), str) and p["model"]:
                    model = p["model"]
            elif t == "event_msg" and p.get("type") == "token_count":
                scan.usage_lines += 1
                info = p.get("info")
                if not isinstance(info, dict):
                    continue
                total = info.get("total_token_usage")
                last = info.get("last_token_usage")
                if total is not None and total == last_total:
                    continue                 # the same totals again: a repeated event, not a request
                if not isinstance(last, dict):
                    if isinstance(total, dict) and isinstance(last_total, dict):
                        last = {k: token_count(total.get(k)) - token_count(last_total.get(k)) for k in total}
                    elif isinstance(total, dict):
                        last = total
                    else:
                        continue
                last_total = total
                cached = token_count(last.get("cached_input_tokens"))
                written = token_count(last.get("cache_write_tokens"))
                inp = max(token_count(last.get("input_tokens")) - cached - written, 0)
                out = token_count(last.get("output_tokens"))
                if inp + out + cached + written == 0:
                    continue
                ts = o.get("timestamp") if isinstance(o.get("timestamp"), str) else ""
                key = ("codex", ts, orjson.dumps(total, option=orjson.OPT_SORT_KEYS) if total else None)
                rec = (key, PRIO_MAIN, inp + out + cached + written, sid, project, ts, model, provider,
                       inp, out, written, 0, cached, (), 0, None, "codex")
                _keep(best, rec, keyless)
    _take_long(scan, data, [(s, e) for s, e in long if any(data.find(n, s, e) != -1 for n in _CODEX_NEEDLES)], limit)
    scan.records = [*best.values(), *keyless]
    return scan


def scan_file(path: str, compat: bool = False, limit: int | None = None) -> FileScan:
    """Read one transcript file and return its usage records (one per request key)."""
    try:
        with open_input(path) as fh:  # never a FIFO or a device
            size = os.fstat(fh.fileno()).st_size
            # a map, not a copy: only the lines that hold usage are ever copied out
            data: Any = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except (OSError, ValueError) as exc:
        reason = f"cannot be read: {getattr(exc, 'strerror', None) or exc}"
        return FileScan(path, "unreadable", [], bad_lines=[{"file": path, "line": 0, "reason": reason, "raw": ""}])
    try:
        return _scan_data(path, data, compat, max_line_bytes(limit))
    finally:
        if size:
            data.close()


def _scan_data(path: str, data: Any, compat: bool, limit: int) -> FileScan:
    first = _first_object(data, limit)
    if first is None and not data[:4096].strip() and _blank(data, 0, len(data)):
        return FileScan(path, "empty", [])
    if gemini_usage.is_header(first) or (first is None and gemini_usage.is_document(data)):
        scan = FileScan(path, gemini_usage.SOURCE, [])
        if gemini_usage.is_document(data) and len(data) > limit:  # read whole: the limit is the document's
            scan.bad_lines.append(too_long(path, data, 0, len(data), limit, "a JSON document"))
            scan.lines_too_long += 1
            return scan
        long: list[tuple[int, int]] = []
        scan.records, scan.bad_lines, scan.usage_lines = gemini_usage.scan(path, data, lambda d: lines_of(d, limit, long))
        _take_long(scan, data, long, limit)
        return scan
    if isinstance(first, dict):
        if first.get("type") == "session" and "payload" not in first:
            return _scan_pi(path, data, first, limit)
        if isinstance(first.get("payload"), dict) and first.get("type") in (
                "session_meta", "turn_context", "response_item", "event_msg", "compacted"):
            return _scan_codex(path, data, limit)
    return _scan_claude(path, data, compat, limit)


_PRICER: Pricer | None = None   # set by scan_files before forking: workers inherit it


def _scan_many(args: tuple[list[str], bool, int]) -> tuple[list[FileScan], dict[str, Any] | None]:
    """Scan (and, with a pricer, price) files; returns the scans and the price lookups this process made."""
    files, compat, limit = args
    scans = [scan_file(f, compat, limit) for f in files]
    pricer = _PRICER
    if pricer is None:
        return scans, None
    for sc in scans:
        sc.records = pricer.finish(sc.records)
    return scans, pricer.book.export_lookups()


def scan_files(files: list[str], *, compat: bool = False, workers: int | None = None,
               pricer: Pricer | None = None) -> list[FileScan]:
    """Scan files, in worker processes (fork) when the input is large; results in `files` order.

    With a `pricer`, every record also gets its day and cost (fields DAY and COST), computed where
    the file was scanned; lookups the workers make reach `pricer.book` (and its disk cache).
    """
    global _PRICER
    limit = max_line_bytes()  # the command's --max-line-bytes, handed to the workers
    sizes = []
    for f in files:
        try:
            sizes.append(os.path.getsize(f))
        except OSError:
            sizes.append(0)
    n = workers if workers is not None else (os.cpu_count() or 1) if sum(sizes) >= PARALLEL_MIN_BYTES else 1
    n = max(1, min(n, len(files)))
    _PRICER = pricer
    try:
        if n == 1:
            return _scan_many((files, compat, limit))[0]
        import multiprocessing as mp

        try:
            ctx = mp.get_context("fork")
        except ValueError:   # no fork on this platform: one process
            return _scan_many((files, compat, limit))[0]
        bins: list[list[str]] = [[] for _ in range(n)]
        load = [0] * n
        for size, f in sorted(zip(sizes, files, strict=True), reverse=True):
            i = load.index(min(load))
            bins[i].append(f)
            load[i] += size
        # n - 1 children and this process share the bins: one fork and one result transfer fewer
        with ctx.Pool(n - 1) as pool:
            pending = pool.map_async(_scan_many, [(b, compat, limit) for b in bins[1:]], chunksize=1)
            parts = [_scan_many((bins[0], compat, limit)), *pending.get()]
    finally:
        _PRICER = None
    if pricer is not None:
        for _, lookups in parts[1:]:
            if lookups:
                pricer.book.import_lookups(lookups)
    by_path = {sc.path: sc for part, _ in parts for sc in part}
    return [by_path[f] for f in files]


# ---------------------------------------------------------------------------------------------
# de-duplication, pricing, grouping


def dedupe(scans: list[FileScan]) -> list[tuple[Any, ...]]:
    """One record per request key across files: highest priority, then largest total, then first in path order.

    Each file's records are already one per key; keys shared by several files are rare, so files
    are merged a dict at a time and only the shared keys are compared one by one.
    """
    best: dict[Any, tuple[Any, ...]] = {}
    keyless: list[tuple[Any, ...]] = []
    for sc in scans:
        d = {r[KEY]: r for r in sc.records if r[KEY] is not None}
        if len(d) != len(sc.records):
            keyless.extend(r for r in sc.records if r[KEY] is None)
        shared = best.keys() & d.keys()
        if not shared:
            best.update(d)
            continue
        for k in shared:
            old, new = best[k], d.pop(k)
            if (new[PRIO], new[TOTAL]) > (old[PRIO], old[TOTAL]):
                best[k] = new
        best.update(d)
    return [*best.values(), *keyless]


def _zone(tz: str | None) -> Any:
    if tz is None or tz == "local":
        return None
    if tz.upper() == "UTC":
        return UTC
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InputError(f"--tz {tz!r}: not a time zone name; use an IANA name such as UTC or Europe/Paris") from exc


def local_day_fn(tz: str | None) -> Callable[[str], str]:
    """ISO timestamp → 'YYYY-MM-DD' in `tz` (None: the system zone), memoised per minute."""
    zone = _zone(tz)
    memo: dict[str, str] = {}

    def day(ts: str) -> str:
        k = ts[:16] if ts.endswith("Z") else ts
        got = memo.get(k)
        if got is None:
            try:
                dt = datetime.fromisoformat(ts)
            except ValueError:
                got = "unknown"
            else:
                if dt.tzinfo is None:
                    dt = dt.replace(tzinfo=UTC)
                got = dt.astimezone(zone).strftime("%Y-%m-%d")
            memo[k] = got
        return got

    return day


def hit_rate(inp: int, cw5: int, cw1: int, cr: int) -> float | None:
    """cache_read / (input + cache_write_5m + cache_write_1h + cache_read): the share of prompt tokens
    served from the cache; None when there were no prompt tokens."""
    prompt = inp + cw5 + cw1 + cr
    return cr / prompt if prompt else None


_N_SUMS = 8   # input, output, cache_write_5m, cache_write_1h, cache_read, cost, requests, unpriced requests


class _Acc:
    """Sums of one row: a list for the hot loop, turned into the row dict once."""

    __slots__ = ("first", "last", "models", "project", "source", "sums", "unpriced")

    def __init__(self, project: str = "", source: str = "") -> None:
        self.sums: list[Any] = [0, 0, 0, 0, 0, 0.0, 0, 0]
        self.models: set[str] = set()
        self.unpriced: set[str] = set()
        self.first = self.last = ""
        self.project, self.source = project, source

    def add(self, rec: tuple[Any, ...], cost: float | None) -> None:
        s = self.sums
        s[0] += rec[IN]
        s[1] += rec[OUT]
        s[2] += rec[CW5]
        s[3] += rec[CW1]
        s[4] += rec[CR]
        s[6] += 1
        self.models.add(rec[MODEL])
        if cost is None:
            self.unpriced.add(rec[MODEL])
            s[7] += 1
        else:
            s[5] += cost
        ts = rec[TS]
        if ts and (not self.first or ts < self.first):
            self.first = ts
        self.last = max(self.last, ts)

    def merge(self, other: _Acc) -> None:
        for i in range(_N_SUMS):
            self.sums[i] += other.sums[i]
        self.models |= other.models
        self.unpriced |= other.unpriced
        if other.first and (not self.first or other.first < self.first):
            self.first = other.first
        self.last = max(self.last, other.last)

    def row(self, key: str | None) -> dict[str, Any]:
        inp, out, cw5, cw1, cr, cost, n, unpriced_n = self.sums
        d: dict[str, Any] = {} if key is None else {"key": key}
        d.update({"input_tokens": inp, "output_tokens": out, "cache_write_5m_tokens": cw5,
                  "cache_write_1h_tokens": cw1, "cache_read_tokens": cr, "cost_usd": cost,
                  "cache_hit_rate": hit_rate(inp, cw5, cw1, cr),
                  "models": sorted(self.models), "unpriced_models": sorted(self.unpriced), "requests": n,
                  "unpriced_requests": unpriced_n,
                  "first_activity": self.first or None, "last_activity": self.last or None})
        return d


def _parse_day(text: str | date | None, flag: str) -> date | None:
    if text is None or isinstance(text, date):
        return text
    t = text.strip()
    for fmt in ("%Y%m%d", "%Y-%m-%d"):
        try:
            return datetime.strptime(t, fmt).date()
        except ValueError:
            pass
    raise InputError(f"{flag} {text!r}: write a date as YYYYMMDD or YYYY-MM-DD (e.g. 20260210)")


class Pricer:
    """Day (in a time zone) and cost of records: `finish(records)` appends DAY and COST to each."""

    def __init__(self, book: PriceBook, *, tz: str | None = None, compat: bool = False):
        self.book = book
        self.day_of = local_day_fn(tz)
        # compat: ccusage's long-context tiers (Sonnet 4 / 4.5 only), each usage category split at
        # the threshold; else the provider's tiers and rule (the whole request at the tier)
        self.tier_rule: Any = "category" if compat else "request"
        self.compat = compat
        self._rates: dict[tuple[str, Any, str, Modifiers], Any] = {}

    def rates_of(self, r: tuple[Any, ...]) -> Any:
        ts = r[TS]
        k = (r[MODEL], r[PROVIDER], ts[:10] if ts.endswith("Z") else ts or "1970-01-01", r[MODS])
        rates = self._rates.get(k, False)
        if rates is False:
            rates = self.book.rates(r[MODEL], ts or "1970-01-01", r[MODS], r[PROVIDER])
            if rates is not None and self.compat:
                rates = ccusage_long_context(rates)
            if not self.book.time_of_day(r[MODEL], r[PROVIDER]):   # DeepSeek's off-peak prices: per minute
                self._rates[k] = rates
        return rates

    def cost_of(self, r: tuple[Any, ...]) -> float | None:
        if r[RECORDED] is not None:           # compat: ccusage prefers a line's own costUSD
            return r[RECORDED]
        rates = self.rates_of(r)
        if rates is None:
            return None
        if rates.per_request or r[WEB] or (rates.tiers and self.tier_rule == "category"):
            return price_with(rates, r[IN], r[OUT], r[CW5], r[CW1], r[CR], web_search_requests=r[WEB],
                              tier_rule=self.tier_rule).total_usd
        # the provider's rule (the whole request at its tier): price_with's total, without its Price
        usd = request_usd((r[IN], r[OUT], r[CW5], r[CW1], r[CR]), rates.base, rates.tiers)
        return usd[0] + usd[1] + usd[2] + usd[3] + usd[4]

    def finish(self, records: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        day_of, cost_of = self.day_of, self.cost_of
        return [(*r, day_of(r[TS]) if r[TS] else "unknown", cost_of(r)) for r in records]


def build_report(paths: list[Path], book: PriceBook, opts: ReportOptions) -> Report:
    """Scan, keep one copy per request, price and group; the result of `ctxreplay report`."""
    if opts.by not in BY_CHOICES:
        raise InputError(f"--by {opts.by!r}: choose one of {', '.join(BY_CHOICES)}")
    compat = opts.compat == "ccusage"
    skipped: list[dict[str, str]] = []
    files = discover(paths, skipped)
    scans = scan_files(files, compat=compat, workers=opts.workers, pricer=Pricer(book, tz=opts.tz, compat=compat))
    # ccusage's session report ignores agent_progress copies; its daily report counts them
    if compat and opts.by == "session":
        for sc in scans:
            sc.records = [r for r in sc.records if r[PRIO] != PRIO_PROGRESS]
    kept = dedupe(scans)
    count_copies = opts.count_progress_copies or (compat and opts.by != "session")
    progress_only = [r for r in kept if r[PRIO] == PRIO_PROGRESS]
    if not count_copies:
        kept = [r for r in kept if r[PRIO] != PRIO_PROGRESS]
    since, until = opts.since, opts.until
    if since or until:
        lo = since.isoformat() if since else ""
        hi = until.isoformat() if until else "9999"

        def inside(r: tuple[Any, ...]) -> bool:
            return r[DAY] != "unknown" and lo <= r[DAY] <= hi
        if opts.since_mode == "session":
            # ccusage's session report: whole sessions, those whose last activity falls on a day in the range
            last: dict[str, tuple[Any, ...]] = {}
            for r in (*kept, *progress_only):
                old = last.get(r[SESSION])
                if old is None or r[TS] > old[TS]:
                    last[r[SESSION]] = r
            chosen = {sid for sid, r in last.items() if inside(r)}
            kept = [r for r in kept if r[SESSION] in chosen]
            progress_only = [r for r in progress_only if r[SESSION] in chosen]
        else:
            kept = [r for r in kept if inside(r)]
            progress_only = [r for r in progress_only if inside(r)]
    by = opts.by
    field_of = {"session": SESSION, "day": DAY, "model": MODEL, "project": PROJECT, "month": DAY, "week": DAY, "block": TS}[by]
    week_of = _week_fn(opts.start_of_week)
    blocks = _blocks(kept, opts.tz) if by == "block" else {}
    groups: dict[str, _Acc] = {}
    per_model: dict[str, dict[str, _Acc]] = {}
    for i, r in enumerate(kept):
        g = r[DAY][:7] if by == "month" else week_of(r[DAY]) if by == "week" else \
            blocks[i][0] if by == "block" else r[field_of]
        acc = groups.get(g)
        if acc is None:
            acc = groups[g] = _Acc(r[PROJECT], r[SOURCE])
        acc.add(r, r[COST])
        if opts.breakdown:
            subs_of = per_model.setdefault(g, {})
            sub = subs_of.get(r[MODEL])
            if sub is None:
                sub = subs_of[r[MODEL]] = _Acc()
            sub.add(r, r[COST])
    totals = _Acc()
    for acc in groups.values():
        totals.merge(acc)
    po = _Acc()
    for r in progress_only:
        po.add(r, r[COST])
    rows = []
    for g, acc in groups.items():
        row = acc.row(g)
        if by == "session":
            row["project"] = acc.project
            row["source"] = acc.source
        if by == "block":
            row.update(blocks["info"][g])
        if opts.breakdown:
            subs = [{"model": m, **sub.row(None)} for m, sub in per_model.get(g, {}).items()]
            row["breakdown"] = sorted(subs, key=lambda x: (-x["cost_usd"], x["model"]))
        rows.append(row)
    if by == "session":
        rows.sort(key=lambda x: (x["last_activity"] or "", x["key"]))
    elif by == "model":
        rows.sort(key=lambda x: (-x["cost_usd"], x["key"]))
    else:
        rows.sort(key=lambda x: (x.get("block_start") or "", x["key"]))
    book.save()
    progress = po.row(None)
    progress["counted"] = count_copies
    progress["sessions"] = sorted({r[SESSION] for r in progress_only})
    return Report(
        by=by, rows=rows, totals=totals.row(None), progress_only=progress, files=len(files),
        usage_lines=sum(s.usage_lines for s in scans), requests=len(kept),
        bad_lines=[{"file": x["file"], "line": 0, "reason": x["reason"], "raw": ""} for x in skipped]
        + [b for s in scans for b in s.bad_lines], warnings=list(book.warnings),
        lines_too_long=sum(s.lines_too_long for s in scans), max_line_bytes=max_line_bytes(),
        genai_prices_version=book.genai_prices_version, prices=book.source,
        tz=opts.tz or "local", since=since.isoformat() if since else None,
        until=until.isoformat() if until else None, compat=opts.compat, records=kept)


parse_day = _parse_day


def _blocks(records: list[tuple[Any, ...]], tz: str | None) -> dict[Any, Any]:
    """ccusage's 5-hour billing blocks over all the records, in time order: a block starts at the hour
    (UTC) of its first request and takes every request until one comes more than 5 hours after the
    block's start or after the previous request. Returns {index in records: (key,)} and "info":
    {key: block_start, block_end (ISO, UTC), active (the block's end is still ahead and its last request
    less than 5 hours ago)}; the key is the start in `tz` ("YYYY-MM-DD HH:MM")."""
    from datetime import timedelta

    zone = _zone(tz)
    span = timedelta(hours=BLOCK_HOURS)
    now = datetime.now(UTC)
    timed: list[tuple[datetime, int]] = []
    out: dict[Any, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    for i, r in enumerate(records):
        try:
            dt = datetime.fromisoformat(r[TS]) if r[TS] else None
        except ValueError:
            dt = None
        if dt is None:
            out[i] = ("unknown",)
            info["unknown"] = {"block_start": None, "block_end": None, "active": False}
            continue
        timed.append((dt if dt.tzinfo else dt.replace(tzinfo=UTC), i))
    timed.sort()

    def iso(d: datetime) -> str:
        return d.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"

    start = last = None
    key = ""
    for dt, i in timed:
        if start is None or dt - start > span or dt - last > span:
            if start is not None:
                info[key]["active"] = now - last < span and now < start + span
            start = dt.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
            key = start.astimezone(zone).strftime("%Y-%m-%d %H:%M")
            info[key] = {"block_start": iso(start), "block_end": iso(start + span), "active": False}
        last = dt
        out[i] = (key,)
    if start is not None and last is not None:
        info[key]["active"] = now - last < span and now < start + span
    out["info"] = info
    return out


def _week_fn(start: str) -> Callable[[str], str]:
    """'YYYY-MM-DD' → the date of the first day of its week (weeks starting on `start`), memoised."""
    from datetime import timedelta

    if start not in WEEKDAYS:
        raise InputError(f"--start-of-week {start!r}: choose one of {', '.join(WEEKDAYS)}")
    first = WEEKDAYS.index(start)
    memo: dict[str, str] = {}

    def week(day: str) -> str:
        got = memo.get(day)
        if got is None:
            try:
                d = date.fromisoformat(day)
            except ValueError:
                got = "unknown"
            else:
                got = (d - timedelta(days=(d.weekday() - first) % 7)).isoformat()
            memo[day] = got
        return got

    return week
