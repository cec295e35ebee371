"""The manifest of a run (OUT/manifest.json) and what a re-run reuses from it (issue 10, point 2).

The manifest records, per input file, its size, mtime and a content fingerprint (`.jsonl` files
only grow: their length and first and last 64 KiB; any other file: the sha256 of all of it), and
per session group (pipeline/batch/batches.py) its files, its sessions (which locate its rows in every
output: blocks, decisions, calls, call_messages; its quarantined lines by file; its requests/ by
thread key) and the accounting the summary sums (file loads, loader stats, threads, violations,
decisions per stage). `call_facts.parquet` keeps the per-call facts of the recorded sessions that
the prompt-cache simulation needs (it runs over every call of the run, reused or not).

A re-run with the same pipeline sha256, target, token counter, replay options and ledger reuses
every group whose files are unchanged: their rows are copied from the previous run's outputs (the
whole files, linked, when every group is reused) and nothing of them is loaded, staged or
replayed; a group with a new, grown or changed file runs again (its frozen decisions come from the
ledger, as on any re-run); anything else in the configuration changed runs everything again.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ctxreplay.pipeline.batch.batches import Group
from ctxreplay.pipeline.loaders.base import FileLoad, QuarantineRow, path_str
from ctxreplay.pipeline.loaders.inputs import open_input

MANIFEST_FILE = "manifest.json"
FACTS_FILE = "call_facts.parquet"
# 2: blocks and calls gained columns (the server's cache diagnosis): a run before it is not reused
MANIFEST_VERSION = 2
EDGE = 64 * 1024


def fingerprint(path: Path) -> dict[str, Any]:
    """size, mtime_ns and a content fingerprint (see the module docstring); {} when unreadable."""
    try:
        h = hashlib.sha256()
        with open_input(path) as fh:  # never a FIFO or a device
            st = os.fstat(fh.fileno())
            if path.name.endswith(".json") or st.st_size <= 2 * EDGE:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            else:
                h.update(fh.read(EDGE))
                fh.seek(st.st_size - EDGE)
                h.update(fh.read(EDGE))
        h.update(str(st.st_size).encode())
    except OSError:
        return {}
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "fp": h.hexdigest()}


def group_files(group: Group) -> list[dict[str, Any]]:
    return [{"path": path_str(f), **fingerprint(f)} for f in group.files]


def same_files(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """The same files with the same sizes and content fingerprints (an mtime alone does not count)."""
    key = [(x["path"], x.get("size"), x.get("fp")) for x in a]
    return bool(a) and all(x.get("fp") for x in a) and key == [(x["path"], x.get("size"), x.get("fp")) for x in b]


def config(spec_sha256: str, target: str, token_counter: str, all_calls: bool, validate: bool,
           ledger: Path) -> dict[str, Any]:
    """What a previous run must share for its groups to be reused."""
    from ctxreplay.version import __version__

    return {"version": MANIFEST_VERSION, "ctxreplay": __version__, "pipeline_sha256": spec_sha256,
            "target": target, "token_counter": token_counter, "all_calls": all_calls, "validate": validate,
            "ledger": str(ledger.resolve())}


@dataclass
class Prior:
    """The previous run of OUT and its manifest, when its configuration is this run's."""

    run_dir: Path
    groups: dict[str, dict[str, Any]]  # group key -> its record
    row_groups: dict[str, list[int]]  # output file -> the batch of each of its row groups
    cache: dict[str, Any] = field(default_factory=dict)  # what a re-run reads once of it (pipeline/batch/reuse.py)

    def reusable(self, key: str, files: list[dict[str, Any]]) -> dict[str, Any] | None:
        rec = self.groups.get(key)
        return rec if rec is not None and same_files(rec["files"], files) else None


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


__all__ = ["FACTS_FILE", "MANIFEST_FILE", "Prior", "config", "fingerprint", "group_files", "load_from_dict",
           "load_to_dict", "prior", "same_files", "write_manifest"]
