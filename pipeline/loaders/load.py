"""What `ctxreplay.pipeline.loaders` gives (see its docstring): `load_paths`, `LoadResult`,
`discover` (the files under PATHS) and the format detection, kept out of the package's
`__init__` so that importing the package stays light."""

from __future__ import annotations

import base64
import hashlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from ctxreplay.errors import InputError
from ctxreplay.pipeline.loaders import claude_code, codex, gemini_cli, openclaw, request
from ctxreplay.pipeline.loaders.base import (
    FileLoad,
    QuarantineRow,
    Thread,
    decode_line,
    displayable,
    file_load,
    nonblank_lines,
    parse_document,
    parse_json_line,
    path_str,
    threads_to_blocks,
    too_long_row,
)
from ctxreplay.pipeline.loaders.inputs import (
    Lines,
    head,
    list_files,
    max_line_bytes,
    open_input,
    raw_lines,
    read_document,
    read_lines,
    unreadable,
)
from ctxreplay.schemas.blocks import BLOCKS
from ctxreplay.schemas.check import empty_table

# loaders of one file each, tried in this order before Claude Code; each exposes
# sniff(first_objects, path) and load(path)
FILE_LOADERS = (openclaw, codex, gemini_cli)


@dataclass
class LoadResult:
    blocks: pa.Table
    loads: list[FileLoad]
    skipped: list[dict[str, str]] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    threads: int = 0
    # the same accounting per input file (a Claude Code session's own counts go to its first file),
    # so a caller that loads several session groups at once can split it by group
    stats_by_file: dict[str, dict[str, int]] = field(default_factory=dict)
    threads_by_file: dict[str, int] = field(default_factory=dict)

    @property
    def quarantine(self) -> list[QuarantineRow]:
        return [q for ld in self.loads for q in ld.quarantine]


def is_transcript_name(p: Path) -> bool:
    n = p.name
    return n.endswith((".jsonl", ".json")) or ".jsonl.deleted." in n or ".jsonl.reset." in n


NOT_A_TRANSCRIPT = "not a transcript file name (*.jsonl, *.jsonl.deleted.*, *.jsonl.reset.*, *.json)"


def _missing(p: Path) -> InputError:
    return InputError(f"{path_str(p)}: no such file or directory. Pass transcript files or directories "
                      f"(e.g. ~/.claude/projects, ~/.openclaw/agents)")


def discover(paths: list[Path], *, follow_links: bool | None = None,
             listed: bool = False) -> tuple[list[Path], list[dict[str, str]]]:
    """Files to load (sorted, unique) and the files skipped with the reason: in directories, names
    that are not transcripts, symbolic links out of the directory given (unless `follow_links`; None:
    `inputs.FOLLOW_LINKS`, the commands' --follow-links), FIFOs and devices (loaders/inputs.py).
    `listed`: the paths are files a discover listed before (a batch of a run): one gone since, or no
    longer a regular file, is skipped with the reason instead of stopping the run."""
    out, skipped = list_files([Path(p) for p in paths], lambda name: is_transcript_name(Path(name)),
                              follow_links=follow_links, listed=listed, unwanted=NOT_A_TRANSCRIPT, missing=_missing)
    seen: set[Path] = set()
    uniq = []
    for f in out:
        r = f.resolve()
        if r not in seen:
            seen.add(r)
            uniq.append(f)
    return uniq, skipped


def _first_objects(path: Path, limit: int = 5, scan: int = 200) -> list[Any]:
    """The first JSON values of a file, one per non-blank line (None for a line that does not parse),
    up to `limit` values that parse, within the first `scan` non-blank lines (so a file whose first
    lines are broken is still recognised).

    Raises OSError when the file cannot be read."""
    objs: list[Any] = []
    parsed_n = 0
    with open_input(path) as fh:
        for n, raw in enumerate(raw_lines(fh)):  # a line over the limit is not read: None, as one that does not parse
            if raw is None:
                objs.append(None)
                if len(objs) >= scan:
                    break
                continue
            if not raw.strip():
                continue
            text, _ = decode_line(raw.rstrip(b"\n"))
            if n == 0:
                text = text.removeprefix("\ufeff")
            if not text.strip():
                continue  # blank once decoded (no-break spaces, ...): not a line, as in every loader
            parsed = parse_json_line(text)
            ok = bool(parsed.objs) and not parsed.error
            objs.append(parsed.objs[0] if ok else None)
            parsed_n += ok
            if parsed_n >= limit or len(objs) >= scan:
                break
    return objs


def load_paths(paths: list[Path | str], *, timings: dict[str, float] | None = None, listed: bool = False,
               follow_links: bool | None = None, open_sidechains: bool = False) -> LoadResult:
    """Load every transcript under `paths` (files or directories) into one blocks table.

    `timings`: when given, seconds per phase of the Claude Code loader are added to it (benchmarks).
    `listed`, `follow_links`: as for `discover` (a run's batches are `listed`: a file gone or replaced
    since the run listed it is skipped with the reason, and the run goes on).
    `open_sidechains`: keep a Claude Code inline sidechain that awaits its first answer as a thread
    of no call (`claude_code.load_sessions`; the live engine's loads).
    """
    files, skipped = discover([Path(p) for p in paths], follow_links=follow_links, listed=listed)
    loads: list[FileLoad] = []
    per_file: list[tuple[FileLoad, list[Thread]]] = []  # files loaded one by one (not Claude Code)
    stats: Counter[str] = Counter()
    cc_files: list[Path] = []
    cc_first: dict[Path, list[Any]] = {}
    for f in files:
        try:
            if f.name.endswith(".json"):
                data = read_document(f)  # one JSON document, read whole: the line limit applies to the file
                if data is None:
                    loads.append(_document_too_big(f))
                    continue
                doc, _, bad_bytes = parse_document(data)
                if f.name.endswith(".meta.json") and isinstance(doc, dict) and "agentType" in doc:
                    load = request.counted_load(f, "claude_code_meta", data)
                    load.other_lines["subagent_meta"] = load.lines
                    loads.append(load)
                    continue
                if gemini_cli.sniff_document(doc, data):  # before request: it has a 'messages' list too
                    t, ld = gemini_cli.load(f, data)
                    per_file.append((ld, t))
                    loads.append(ld)
                    continue
                if isinstance(doc, dict) and request.sniff([doc], f):
                    t, ld = request.load(f, data)
                    per_file.append((ld, t))
                    loads.append(ld)
                    continue
                if doc is None:
                    why = ("an empty .json file" if not data.strip() else "a .json file that does not parse as "
                           "one JSON document" + (" (it holds bytes that are not UTF-8)" if bad_bytes else ""))
                else:
                    why = "a JSON document that is not a request (no 'messages' list) nor a subagent .meta.json sidecar"
                skipped.append({"file": path_str(f), "reason": why})
                continue
            first = _first_objects(f)
            if not first:
                loads.append(FileLoad(path_str(f), "empty"))
                continue
            fmt_mod = None
            for mod in FILE_LOADERS:
                if mod.sniff(first, f):
                    fmt_mod = mod
                    break
            if fmt_mod is not None:
                t, ld = fmt_mod.load(f)
                per_file.append((ld, t))
                loads.append(ld)
                continue
            if claude_code.sniff(first, f):
                cc_files.append(f)
                cc_first[f] = first
                continue
            loads.append(_unknown_format(f, read_lines(f), first))
        except OSError as exc:
            skipped.append(unreadable(f, exc))
    groups = claude_code.group_sessions(cc_files, cc_first)
    # the first values of each file are for telling formats and sessions apart: let go of them before
    # the files are read (a first line of 200 MB stayed parsed through the whole load)
    cc_first.clear()
    first = []
    by_file: defaultdict[str, Counter[str]] = defaultdict(Counter)
    cc_load = claude_code.load_sessions(groups, skipped, timings, open_sidechains=open_sidechains)
    cc_threads = cc_load.threads
    loads.extend(cc_load.loads)
    for group, st in zip(groups, cc_load.stats, strict=True):
        stats.update(st)
        by_file[path_str(group.files[0])].update(st)
    # Gemini CLI copies of a session (a resumed .json beside its .jsonl) are found by message id
    is_gemini = [ld.format in (gemini_cli.FORMAT, gemini_cli.FORMAT_JSON) for ld, _ in per_file]
    other_threads = _dedupe_sessions([p for p, g in zip(per_file, is_gemini, strict=True) if not g]) + \
        gemini_cli.merge_copies([p for p, g in zip(per_file, is_gemini, strict=True) if g])
    threads: list[Any] = [*other_threads, *cc_threads]
    _unique_thread_ids(threads, loads)
    for ld in loads:
        stats.update(ld.stats)
        by_file[ld.path].update(ld.stats)
    loads.sort(key=lambda ld: ld.path)
    notes: list[dict[str, Any]] = []
    # the other formats' rows first, then Claude Code's
    parts = [threads_to_blocks(other_threads, notes)] if other_threads else []
    if cc_threads:
        parts.append(cc_load.blocks(cc_threads, notes))
    blocks = pa.concat_tables(parts) if len(parts) > 1 else parts[0] if parts else empty_table(BLOCKS)
    if notes:
        by_path = {ld.path: ld for ld in loads}
        seen: set[tuple[Any, ...]] = set()
        for n in notes:
            key = (n["file"], n["line"], n["note"])
            if key not in seen and n["file"] in by_path:
                seen.add(key)
                by_path[n["file"]].recovered.append(n)
                stats["fields_coerced"] += 1
                by_file[n["file"]]["fields_coerced"] += 1
    return LoadResult(blocks, loads, skipped, dict(stats), threads=len(threads),
                      stats_by_file={k: dict(v) for k, v in by_file.items()},
                      threads_by_file=dict(Counter(t.source_file for t in threads)))


def _document_too_big(f: Path) -> FileLoad:
    """A .json file bigger than the line limit: not read (one `line_too_long` row, its first bytes)."""
    first, size, sha = head(f)
    ld = FileLoad(path_str(f), "unknown", sha256=sha, bytes=size, lines=1)
    ld.stats["lines_too_long"] += 1
    ld.quarantine.append(too_long_row(ld.path, 1, size, first, max_line_bytes(), document=True))
    return ld


def _unknown_format(f: Path, src: Lines, first: list[Any]) -> FileLoad:
    """A file of no known format: every non-blank line quarantined (exact bytes kept when not UTF-8);
    a line that is not JSON at all gets the parse error's code, the others `unknown_format` (a line
    over the limit, never read, `line_too_long`)."""
    lines = list(nonblank_lines(src.data))
    ld = file_load(f, "unknown", src, len(lines))
    reason = ("unrecognised transcript format: not Claude Code, OpenClaw/pi, Codex rollout or a request "
              "JSON (first line has keys " + _keys(next((o for o in first if o is not None), None)) + ")")
    spath = ld.path
    for i, exact in lines:
        raw = exact.rstrip(b"\r")  # (read and shown without a CRLF's \r; raw_base64 keeps the line's every byte)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            ld.quarantine.append(QuarantineRow(
                spath, i, displayable(raw), "bytes that are not UTF-8 in a file of no known transcript format; "
                "the exact bytes are kept in raw_base64", "invalid_utf8", base64.b64encode(exact).decode("ascii")))
            continue
        text = raw.decode("utf-8")
        parsed = parse_json_line(text.removeprefix("\ufeff") if i == 1 else text)
        if not parsed.objs and parsed.error:  # not JSON at all: say why, as for any other file
            ld.quarantine.append(QuarantineRow(spath, i, text, parsed.error[1], parsed.error[0]))
        else:
            ld.quarantine.append(QuarantineRow(spath, i, text, reason, "unknown_format"))
    return ld


def _short_hash(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def file_mark(path: str, line: int, digest: bytes | None = None) -> str:
    """What a `~<hash>` suffix telling apart two files that claim one session is made of: the file's
    name, a line number and (when known) that line's digest, never the file's directory, so the same
    files give the same ids wherever they live (a checkout elsewhere, CI; issue 23, item 11). A line,
    not the whole file: the suffix stays when the file grows."""
    return _short_hash(f"{Path(path).name}\0{line}\0{digest.hex() if digest else ''}")


def _dedupe_sessions(per_file: list[tuple[FileLoad, list[Thread]]]) -> list[Thread]:
    """Threads of the files loaded one by one, each session read once.

    Files whose threads share a session id (a backup copy of a session file, an older prefix of
    it) are compared line by line: the file with the most understood lines is replayed; another
    whose every understood line it already holds is a copy, and its lines that were read already
    count as `duplicate_entry` other lines (its threads are dropped); one with lines of its own is
    kept apart as session `<id>~<hash>` (of its name and first line of its own: `file_mark`) and
    reported.
    """
    groups: dict[str, list[tuple[FileLoad, list[Thread]]]] = {}
    for ld, ths in per_file:
        if ths:
            groups.setdefault(ths[0].session_id, []).append((ld, ths))
    for sid, members in groups.items():
        if len(members) < 2:
            continue
        members.sort(key=lambda m: (-(m[0].lines - m[0].quarantined_lines), m[0].path))
        primary = members[0][0]
        seen = set(primary.digests.values())
        for ld, ths in members[1:]:
            q_lines = {q.line for q in ld.quarantine}
            understood = [ln for ln in sorted(ld.digests) if ln not in q_lines]
            own = [ln for ln in understood if ld.digests[ln] not in seen]
            if own or not ld.digests:
                new_sid = f"{sid}~{file_mark(ld.path, own[0], ld.digests[own[0]]) if own else file_mark(ld.path, 0)}"
                for t in ths:
                    t.session_id = new_sid
                ld.stats["session_copies_kept_apart"] += 1
                line = own[0] if own else 1
                ld.recovered.append({"file": ld.path, "line": line, "note": (
                    f"session {sid!r} is also in {primary.path} but this file holds other lines (first: line "
                    f"{line}); replayed apart as session {new_sid!r}")})
                seen.update(ld.digests.values())
                continue
            dup = {ln for ln, d in ld.digests.items() if d in seen}
            ld.message_lines = 0
            ld.other_lines = Counter({"duplicate_entry": len(dup)})
            ld.quarantine = [q for q in ld.quarantine if q.line not in dup]
            ld.recovered = [r for r in ld.recovered if r.get("line") not in dup]
            ld.stats["duplicate_entries"] += len(dup)
            ld.stats["duplicate_session_files"] += 1
            ld.recovered.append({"file": ld.path, "line": min(dup), "note": (
                f"a copy of session {sid!r} (read from {primary.path}): its {len(dup)} line(s) counted as "
                "duplicate_entry, not replayed twice")})
            ld.check()
            ths.clear()
    return [t for _, ths in per_file for t in ths]


def _unique_thread_ids(threads: list[Thread], loads: list[FileLoad]) -> None:
    """Two threads never share (session id, thread id): a later one gets a `~<hash>` suffix (seen
    when files of different formats, or differing copies, claim the same session), of its file's
    name and the line of its first message (`file_mark`) and a count."""
    by_path = {ld.path: ld for ld in loads}
    taken: set[tuple[str, str]] = set()
    for t in threads:
        key = (t.session_id, t.thread_id)
        if key not in taken:
            taken.add(key)
            continue
        n = 0
        new = t.thread_id
        mark = file_mark(t.source_file, t.messages[0].source_line if t.messages else 0)
        while (t.session_id, new) in taken:
            n += 1
            new = f"{t.thread_id}~{_short_hash(f'{mark}#{n}')}"
        taken.add((t.session_id, new))
        ld = by_path.get(t.source_file)
        if ld is not None:
            ld.stats["thread_ids_made_unique"] += 1
            ld.recovered.append({"file": t.source_file, "line": t.messages[0].source_line if t.messages else 0,
                                 "note": f"thread {t.thread_id!r} of session {t.session_id!r} already exists "
                                         f"(another file claims the same session); replayed as {new!r}"})
        t.thread_id = new


def _keys(o: Any) -> str:
    if isinstance(o, dict):
        return ", ".join(sorted(map(str, o))[:8]) or "none"
    return "none (not a JSON object)"
