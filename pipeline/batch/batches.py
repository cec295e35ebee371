"""Session groups and batches: the unit of work of a run (issue 10, point 1).

A **session group** is every input file that can tie into one session: a Claude Code session's
main file, its subagent files and their `.meta.json` sidecars, backup copies of a session, and
any other file claiming the same session id. The loaders read a group as they would read it among
all the files (`load_paths` over the group's files gives the group's part of a load of
everything), because what ties files together is found here the way the loaders find it: the
session id in a file's name (its last uuid), `sessionId` / a session header's `id` in its first
JSON values, a `subagents/` folder's parent, the file's stem. Files sharing any of these land in
one group (union-find), so a group can be larger than a session but never splits one.

Groups are packed in a stable order (by their first path) into **batches** of at most
`batch_bytes` input bytes (a group larger than that is a batch of its own); the runner loads,
stages, replays and writes one batch at a time, so memory grows with the batch, not the corpus.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctxreplay.pipeline.loaders import discover
from ctxreplay.pipeline.loaders.base import decode_line, parse_json_line, path_str, session_id_from_name
from ctxreplay.pipeline.loaders.inputs import open_input, raw_lines

# a batch's load, stages and replay take about 20x its input bytes at their peak (measured on the 190 MB
# tree: 64 MiB batches peaked at 1.3-1.5 GB, 16 MiB ones at 0.6-0.65 GB for some 8 % more CPU)
DEFAULT_BATCH_BYTES = 16 * 1024 * 1024


@dataclass
class Group:
    """The files of one session group (sorted paths) and their total size in bytes."""

    files: list[Path]
    bytes: int = 0

    @property
    def key(self) -> str:
        """A stable name: the group's first path."""
        return path_str(self.files[0])


@dataclass
class Batch:
    index: int
    groups: list[Group] = field(default_factory=list)

    @property
    def files(self) -> list[Path]:
        return [f for g in self.groups for f in g.files]

    @property
    def bytes(self) -> int:
        return sum(g.bytes for g in self.groups)


def first_values(path: Path, limit: int = 5, scan: int = 200) -> list[Any]:
    """The first JSON values of a file (up to `limit` that parse, within `scan` non-blank lines);
    an unreadable file gives none (the loader reports it)."""
    objs: list[Any] = []
    try:
        with open_input(path) as fh:  # never a FIFO or a device
            for n, raw in enumerate(raw_lines(fh)):  # a line over the limit is not read (None)
                if raw is None:
                    if n >= scan:
                        break
                    continue
                if not raw.strip():
                    continue
                text, _ = decode_line(raw.rstrip(b"\n"))
                text = text.removeprefix("\ufeff") if n == 0 else text
                if not text.strip():
                    continue
                parsed = parse_json_line(text)
                objs.extend(o for o in parsed.objs if isinstance(o, dict))
                if len(objs) >= limit or n >= scan:
                    break
    except OSError:
        return []
    return objs


def session_keys(path: Path) -> set[str]:
    """Every session id a loader could give this file (see the module docstring)."""
    keys = {path_str(path.stem), path_str(path.name).split(".jsonl")[0].split(".json")[0]}
    for sid in (session_id_from_name(path), session_id_from_name(path, lowercase_only=True)):
        if sid:
            keys.add(sid)
    if path.parent.name == "subagents":
        keys.add(path_str(path.parent.parent.name))
    if path.name.endswith(".json"):
        return keys  # a request or sidecar: its name is its session
    for o in first_values(path):
        for v in (o.get("sessionId"), o.get("id") if o.get("type") in ("session", "session_meta") else None):
            if isinstance(v, str) and v:
                keys.add(v)
        p = o.get("payload")
        if o.get("type") == "session_meta" and isinstance(p, dict) and isinstance(p.get("id"), str) and p["id"]:
            keys.add(p["id"])
    return keys


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def session_groups(files: Iterable[Path]) -> list[Group]:
    """The files' session groups, sorted by their first path (each group's files sorted)."""
    files = list(files)
    parent = list(range(len(files)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, f in enumerate(files):
        for k in session_keys(f):
            j = owner.setdefault(k, i)
            if j != i:
                a, b = find(i), find(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    members: dict[int, list[Path]] = {}
    for i, f in enumerate(files):
        members.setdefault(find(i), []).append(f)
    groups = [Group(sorted(fs, key=path_str)) for fs in members.values()]
    for g in groups:
        g.bytes = sum(_size(f) for f in g.files)
    return sorted(groups, key=lambda g: g.key)


def pack(groups: list[Group], batch_bytes: int) -> list[Batch]:
    """Groups in order into batches of at most batch_bytes (a larger group alone)."""
    batches: list[Batch] = []
    cur = Batch(0)
    for g in groups:
        if cur.groups and cur.bytes + g.bytes > batch_bytes:
            batches.append(cur)
            cur = Batch(len(batches))
        cur.groups.append(g)
    if cur.groups:
        batches.append(cur)
    return batches


def plan(paths: list[Path], batch_bytes: int = DEFAULT_BATCH_BYTES, *,
         follow_links: bool | None = None) -> tuple[list[Batch], list[dict[str, str]]]:
    """The batches of a run over these paths, and the files skipped while walking directories
    (`follow_links`: as for `loaders.discover`)."""
    files, skipped = discover(paths, follow_links=follow_links)
    return pack(session_groups(files), batch_bytes), skipped


__all__ = ["DEFAULT_BATCH_BYTES", "Batch", "Group", "pack", "plan", "session_groups", "session_keys"]
