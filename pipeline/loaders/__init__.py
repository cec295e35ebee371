"""Find transcript files, detect each file's format, load them into one blocks table.

`load_paths(paths)` walks files and directories (recursively), detects the format of every file
(Claude Code, OpenClaw / pi, Codex rollout, single Anthropic / OpenAI chat request JSON), loads
Claude Code files session by session (a session's subagent files link into its main file), and
returns the blocks table plus the accounting of every file and every line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

from pipeline.errors import InputError
from pipeline.loaders import claude_code, codex, openclaw, request
from pipeline.loaders.base import (
    FileLoad,
    QuarantineRow,
    Thread,
    file_load,
    read_nonblank_lines,
    threads_to_blocks,
)
from schemas.blocks import BLOCKS

# loaders of one file each, tried in this order before Claude Code; each exposes
# sniff(first_objects, path) and load(path)
FILE_LOADERS = (openclaw, codex)


@dataclass
class LoadResult:
    blocks: pa.Table
    loads: list[FileLoad]
    skipped: list[dict[str, str]] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    threads: int = 0

    @property
    def quarantine(self) -> list[QuarantineRow]:
        return [q for ld in self.loads for q in ld.quarantine]


def is_transcript_name(p: Path) -> bool:
    n = p.name
    return n.endswith(".jsonl") or ".jsonl.deleted." in n or ".jsonl.reset." in n or n.endswith(".json")


def discover(paths: list[Path]) -> tuple[list[Path], list[dict[str, str]]]:
    """Files to load (sorted, unique) and the files skipped in directories with the reason."""
    out: list[Path] = []
    skipped: list[dict[str, str]] = []
    for p in paths:
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                if not f.is_file():
                    continue
                if is_transcript_name(f):
                    out.append(f)
                else:
                    skipped.append({"file": str(f), "reason": "not a transcript file name (*.jsonl, "
                                    "*.jsonl.deleted.*, *.jsonl.reset.*, *.json)"})
        elif p.is_file():
            out.append(p)
        else:
            msg = (f"{p}: no such file or directory. Pass transcript files or directories "
                   f"(e.g. ~/.claude/projects, ~/.openclaw/agents)")
            raise InputError(msg)
    seen: set[Path] = set()
    uniq = []
    for f in out:
        r = f.resolve()
        if r not in seen:
            seen.add(r)
            uniq.append(f)
    return uniq, skipped


def _first_objects(path: Path, limit: int = 5) -> list[Any]:
    objs: list[Any] = []
    try:
        with open(path, "rb") as fh:
            for raw in fh:
                if not raw.strip():
                    continue
                try:
                    objs.append(orjson.loads(raw))
                except orjson.JSONDecodeError:
                    objs.append(None)
                if len(objs) >= limit:
                    break
    except OSError as exc:
        raise InputError(f"{path}: cannot be read: {exc.strerror}. Check the path and its permissions") from exc
    return objs


def load_paths(paths: list[Path | str]) -> LoadResult:
    files, skipped = discover([Path(p) for p in paths])
    loads: list[FileLoad] = []
    threads: list[Thread] = []
    stats: dict[str, int] = {}
    cc_files: list[Path] = []
    cc_first: dict[Path, list[Any]] = {}
    for f in files:
        if f.name.endswith(".json"):
            data, lines = read_nonblank_lines(f)
            try:
                doc = orjson.loads(data)
            except orjson.JSONDecodeError:
                doc = None
            if f.name.endswith(".meta.json") and isinstance(doc, dict) and "agentType" in doc:
                load = file_load(f, "claude_code_meta", data, len(lines))
                load.other_lines["subagent_meta"] = load.lines
                loads.append(load)
                continue
            if isinstance(doc, dict) and request.sniff([doc], f):
                t, ld = request.load(f, data)
                threads.extend(t)
                loads.append(ld)
                continue
            skipped.append({"file": str(f), "reason": "a JSON document that is not a request "
                            "(no 'messages' list) nor a subagent .meta.json sidecar"})
            continue
        first = _first_objects(f)
        if not first:
            loads.append(FileLoad(str(f), "empty"))
            continue
        fmt_mod = None
        for mod in FILE_LOADERS:
            if mod.sniff(first, f):
                fmt_mod = mod
                break
        if fmt_mod is not None:
            t, ld = fmt_mod.load(f)
            threads.extend(t)
            loads.append(ld)
            continue
        if claude_code.sniff(first, f):
            cc_files.append(f)
            cc_first[f] = first
            continue
        # not a format we know: keep every line in quarantine, nothing is lost
        data = f.read_bytes()
        lines = _lines_with_content(data)
        ld = file_load(f, "unknown", data, len(lines))
        reason = ("unrecognised transcript format: not Claude Code, OpenClaw/pi, Codex rollout or a request "
                  "JSON (first line has keys " + _keys(first[0]) + ")")
        ld.quarantine = [QuarantineRow(str(f), i, raw, reason) for i, raw in lines]
        loads.append(ld)
    for group in claude_code.group_sessions(cc_files, cc_first):
        t, lds, st = claude_code.load_session(group)
        threads.extend(t)
        loads.extend(lds)
        for k, v in st.items():
            stats[k] = stats.get(k, 0) + v
    loads.sort(key=lambda ld: ld.path)
    blocks = threads_to_blocks(threads) if threads else BLOCKS.empty_table()
    return LoadResult(blocks, loads, skipped, stats, threads=len(threads))


def _lines_with_content(data: bytes) -> list[tuple[int, str]]:
    """(line number, text) of every line holding more than ASCII whitespace.

    Stricter than `read_nonblank_lines`: a line of only, say, no-break spaces is kept, so a file of
    unknown format loses nothing to its quarantine.
    """
    return [(i, ln.decode("utf-8", "surrogateescape").rstrip("\r"))
            for i, ln in enumerate(data.split(b"\n"), start=1) if ln.strip()]


def _keys(o: Any) -> str:
    if isinstance(o, dict):
        return ", ".join(sorted(map(str, o))[:8]) or "none"
    return "none (not a JSON object)"

