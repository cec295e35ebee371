"""The manifest of a run (OUT/manifest.json) and what a re-run reuses from it (issue 10, point 2).

The manifest records, per input file, its size, mtime and the sha256 of all of its bytes (issue 23,
item 10: an edit in place that keeps the size, and the mtime, is a changed file; the loader hashes
the bytes it reads, so a run that loads a file takes its hash from there and reads it once), and,
when the file had settled, its inode and ctime (`sig`, see `settled`): a re-run that finds the same
size, mtime, inode and ctime takes the recorded hash instead of reading the file again. The ctime
is what an edit in place cannot keep: every write and every `utime` sets it to the clock's now, and
no call sets it back. The manifest also records,
per session group (pipeline/batch/batches.py) its files, its sessions (which locate its rows in every
output: blocks, decisions, calls, call_messages; its quarantined lines by file; its requests/ by
thread key) and the accounting the summary sums (file loads, loader stats, threads, violations,
decisions per stage). `call_facts.parquet` keeps the per-call facts of the recorded sessions that
the prompt-cache simulation needs (it runs over every call of the run, reused or not).

A re-run with the same pipeline sha256, target, token counter, replay options and ledger reuses
every group whose files are unchanged (the same paths and sizes, then the same content: each file of
such a group is read and hashed once, nothing more): their rows are copied from the previous run's outputs (the
whole files, linked, when every group is reused) and nothing of them is loaded, staged or
replayed; a group with a new, grown or changed file runs again (its frozen decisions come from the
ledger, as on any re-run); anything else in the configuration changed runs everything again.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ctxreplay.pipeline.batch.batches import Group
from ctxreplay.pipeline.loaders.base import FileLoad, QuarantineRow, path_str
from ctxreplay.pipeline.loaders.inputs import MAX_LINE_BYTES, open_input

MANIFEST_FILE = "manifest.json"
FACTS_FILE = "call_facts.parquet"
# 2: blocks and calls gained columns (the server's cache diagnosis): a run before it is not reused
# 3: `fp` is the sha256 of the whole file (2: of its size and first and last 64 KiB only)
# 4: call_facts gained `strip_from_call` (the calibration's thinking-strip evidence): a run before
#    it is not reused (its facts could not be appended to a new batch's)
# 5: call_facts gained `answer_api`, `answer_provider` (the provider's cache rules): likewise
MANIFEST_VERSION = 5


# How long before a run's stat a file's ctime must be for its stat to stand in for its bytes at the
# next run (`settled`): more than a file system's timestamp step (ext4 and xfs: a clock tick of a
# few ms; some network and older file systems: 1-2 s)
SETTLE_NS = 3_000_000_000


def settled(ctime_ns: int, now_ns: int) -> bool:
    """Whether a file whose ctime is `ctime_ns`, stat'ed at `now_ns` (the run's clock, read before
    the stat), would show any later write in its ctime. A write after the stat gets a ctime of at
    least now less one timestamp step; a file changed within SETTLE_NS of the stat might get the
    very ctime it has (a coarse clock), so its stat is not trusted and the next run reads it."""
    return ctime_ns <= now_ns - SETTLE_NS


def stat_file(path: Path, now_ns: int | None = None) -> dict[str, Any]:
    """size and mtime_ns of a listed file (no byte read), and `sig` (its inode and ctime) when it
    has settled at `now_ns` (see `settled`); {} when it is not a regular file."""
    try:
        st = os.stat(path)
    except OSError:
        return {}
    if not stat.S_ISREG(st.st_mode):
        return {}
    out: dict[str, Any] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if now_ns is not None and settled(st.st_ctime_ns, now_ns):
        out["sig"] = f"{st.st_ino}:{st.st_ctime_ns}"
    return out


def same_stat(f: dict[str, Any], old: dict[str, Any]) -> bool:
    """The file is as the previous run recorded it, by its stat alone: the same size, mtime and
    settled inode and ctime (a previous run records `sig` only for a settled file)."""
    return bool(f.get("sig")) and all(f.get(k) == old.get(k) for k in ("sig", "size", "mtime_ns"))


def content_sha256(path: Path) -> str | None:
    """The sha256 of all of a file's bytes (as the loaders' FileLoad.sha256); None when unreadable."""
    try:
        h = hashlib.sha256()
        with open_input(path) as fh:  # never a FIFO or a device
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def now_ns() -> int:
    """The clock a run reads before it stats its files (`settled`)."""
    return time.time_ns()


def group_files(group: Group, now: int | None = None) -> list[dict[str, Any]]:
    """The group's files with their sizes, mtimes and settled stats (stat'ed after the clock read
    `now`); their content hashes are added when a re-run compares them (Prior.reusable) or when the
    run loads them (with_content)."""
    return [{"path": path_str(f), **stat_file(f, now)} for f in group.files]


def with_content(files: list[dict[str, Any]], loads: list[dict[str, Any]], paths: dict[str, Path]) -> list[dict[str, Any]]:
    """A run's group files with the hash of what the loader read (its FileLoad.sha256: no second
    read) and that size; a file the loader did not hash (skipped, unreadable) is hashed here or
    left without one (never reused then)."""
    by_path = {ld["path"]: ld for ld in loads if ld.get("sha256")}
    out = []
    for f in files:
        ld = by_path.get(f["path"])
        if ld is not None:  # the stat stands for these bytes only if the loader read as many
            keep = {k: v for k, v in f.items() if k != "sig" or ld["bytes"] == f.get("size")}
            out.append({**keep, "size": ld["bytes"], "fp": ld["sha256"]})
        elif f.get("fp") or "size" not in f:  # hashed already; or not a regular file when listed
            out.append(f)
        else:
            fp = content_sha256(paths[f["path"]]) if f["path"] in paths else None
            out.append({**f, "fp": fp} if fp else {k: v for k, v in f.items() if k != "fp"})
    return out


def config(spec_sha256: str, target: str, token_counter: str, all_calls: bool, validate: bool,
           ledger: Path) -> dict[str, Any]:
    """What a previous run must share for its groups to be reused."""
    from ctxreplay.version import __version__

    return {"version": MANIFEST_VERSION, "ctxreplay": __version__, "pipeline_sha256": spec_sha256,
            "target": target, "token_counter": token_counter, "all_calls": all_calls, "validate": validate,
            "ledger": str(ledger.resolve()), "max_line_bytes": MAX_LINE_BYTES.get()}


@dataclass
class Prior:
    """The previous run of OUT and its manifest, when its configuration is this run's."""

    run_dir: Path
    groups: dict[str, dict[str, Any]]  # group key -> its record
    row_groups: dict[str, list[int]]  # output file -> the batch of each of its row groups
    cache: dict[str, Any] = field(default_factory=dict)  # what a re-run reads once of it (pipeline/batch/reuse.py)

    def reusable(self, key: str, files: list[dict[str, Any]], paths: dict[str, Path]) -> dict[str, Any] | None:
        """The previous record of this group when its files are unchanged: the same paths and
        sizes (compared first, nothing read), then the same content (each file hashed once; the
        hashes are put in `files`), or, for a file whose settled stat is the recorded one
        (`same_stat`), the recorded hash. An mtime alone does not count either way (issue 23, item 10)."""
        rec = self.groups.get(key)
        if rec is None:
            return None
        old = rec["files"]
        if [(x["path"], x.get("size")) for x in old] != [(x["path"], x.get("size")) for x in files]:
            return None
        if not all(x.get("fp") for x in old) or any(x.get("size") is None for x in files):
            return None
        for f, o in zip(files, old, strict=True):
            fp = f.get("fp") or (o["fp"] if same_stat(f, o) else content_sha256(paths[f["path"]]))
            if fp is None:
                return None
            f["fp"] = fp
            if fp != o["fp"]:
                return None
        return rec


def hash_candidates(prior: Prior, files: dict[str, list[dict[str, Any]]], paths: dict[str, Path]) -> None:
    """The content hashes Prior.reusable will compare, taken beforehand on a few threads (hashlib
    lets go of the GIL while it hashes): every file of a group whose paths and sizes are those of
    the previous run, less those whose settled stat is the recorded one (they take the recorded
    hash, nothing read). A file that cannot be read gets no hash (reusable then says no)."""
    from concurrent.futures import ThreadPoolExecutor

    todo = []
    for key, fs in files.items():
        rec = prior.groups.get(key)
        if rec is None or any(x.get("size") is None for x in fs):
            continue
        if [(x["path"], x.get("size")) for x in rec["files"]] == [(x["path"], x.get("size")) for x in fs]:
            for f, o in zip(fs, rec["files"], strict=True):
                if not f.get("fp") and o.get("fp") and same_stat(f, o):
                    f["fp"] = o["fp"]
            todo.extend(f for f in fs if not f.get("fp") and f["path"] in paths)
    if len(todo) < 2:
        return
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        for f, fp in zip(todo, pool.map(lambda f: content_sha256(paths[f["path"]]), todo), strict=True):
            if fp is not None:
                f["fp"] = fp


def prior(out_dir: Path, conf: dict[str, Any]) -> tuple[Prior | None, str]:
    """The previous run to reuse groups from, or None and why not."""
    from ctxreplay.pipeline.core.outdir import CURRENT, resolve_run

    if not (out_dir / CURRENT).is_symlink():
        return None, "no previous run"
    run = resolve_run(out_dir)
    try:
        doc = orjson.loads((run / MANIFEST_FILE).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None, "the previous run has no manifest"
    if not isinstance(doc, dict) or doc.get("config") != conf:
        old = doc.get("config") if isinstance(doc, dict) else None
        changed = sorted(k for k in conf if not isinstance(old, dict) or old.get(k) != conf[k])
        return None, "changed since the previous run: " + ", ".join(changed)
    if not (run / FACTS_FILE).is_file():
        return None, "the previous run has no call facts"
    if doc.get("stage_failures"):
        return None, "plug-in stages failed in the previous run"
    return Prior(run, {g["key"]: g for g in doc.get("groups", [])}, doc.get("row_groups") or {}), ""


# -------------------------------------------------------------------------------- file loads


def load_to_dict(ld: FileLoad) -> dict[str, Any]:
    """A FileLoad's accounting (its quarantined lines are in quarantine.parquet)."""
    return {"path": ld.path, "format": ld.format, "sha256": ld.sha256, "bytes": ld.bytes, "lines": ld.lines,
            "message_lines": ld.message_lines, "other_lines": dict(ld.other_lines), "recovered": ld.recovered,
            "stats": dict(ld.stats)}


def load_from_dict(d: dict[str, Any], quarantine: list[QuarantineRow]) -> FileLoad:
    ld = FileLoad(d["path"], d["format"], d["sha256"], d["bytes"], d["lines"], d["message_lines"],
                  Counter(d["other_lines"]))
    ld.quarantine = quarantine
    ld.recovered = d["recovered"]
    ld.stats = Counter(d["stats"])
    return ld


def write_manifest(run_dir: Path, conf: dict[str, Any], groups: list[dict[str, Any]], stage_failures: int,
                   row_groups: dict[str, list[int]]) -> None:
    tmp = run_dir / f".{MANIFEST_FILE}"
    tmp.write_bytes(orjson.dumps({"config": conf, "groups": groups, "stage_failures": stage_failures,
                                  "row_groups": row_groups}, option=orjson.OPT_SORT_KEYS))
    os.replace(tmp, run_dir / MANIFEST_FILE)


__all__ = ["FACTS_FILE", "MANIFEST_FILE", "SETTLE_NS", "Prior", "config", "content_sha256", "group_files",
           "hash_candidates", "load_from_dict", "load_to_dict", "now_ns", "prior", "same_stat", "settled", "stat_file",
           "with_content", "write_manifest"]
