"""The anchor of `ctxreplay report --sim OUT`'s estimates: the identity simulation of OUT's calls.

The anchored estimate (pipeline/cost/estimate.py) of a call under a pipeline P is `recorded +
(sim under P − sim under identity)`; a run keeps P's simulation only (`calls.parquet`'s `sim_*`
columns), not identity's, which needs identity's own requests. Where the anchor comes from, in
this order (docs/report.md says the same for users):

1. OUT's run is identity (no stage): its own simulation; the estimate is the recorded usage.
2. `--anchor DIR`: an identity run of the same input files (`ctxreplay run --preset identity`, or a
   run `compare --keep` kept), checked to be identity, of OUT's target and token counter, over
   the same files with the same content (the manifests' sha256 of each file).
3. Otherwise an identity run of OUT's input files into a temporary directory, as `compare` runs its
   anchor, with OUT's target, token counter and line limit; it must find every file as the run
   read it (same content), else there is no anchor.

Without one (or with `--raw`) the view shows the raw simulation and says why.

Why not in the run itself: keeping identity's simulation beside every run of another pipeline
means an identity replay and a second simulation in each run, and a second request store kept in
OUT for re-runs to reuse; measured on the corpus and a generated tree (docs/cache-simulation.md,
"The anchor of `report --sim`"), the report-time run costs about what the run cost, once per view,
and nothing when the view has an anchor already.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from ctxreplay.errors import CtxReplayError, InputError


@dataclass
class Anchor:
    """Where the estimates' anchor came from: `calls` (the identity run's calls, None without an
    anchor), `source` ("self", "dir", "run" or "none") and a note for the view."""

    calls: pl.DataFrame | None
    source: str
    note: str
    seconds: float = 0.0


def is_identity_run(summary: dict[str, Any]) -> bool:
    """The run had no stage: its requests are the sessions as recorded."""
    return not ((summary.get("versions") or {}).get("stages"))


def _manifest(run_dir: Path) -> dict[str, Any]:
    from ctxreplay.pipeline.batch.manifest import MANIFEST_FILE

    try:
        doc = orjson.loads((run_dir / MANIFEST_FILE).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _files(manifest: dict[str, Any]) -> dict[str, str | None]:
    """Every input file of a run's manifest: path -> sha256 of its content."""
    return {f["path"]: f.get("fp") for g in manifest.get("groups") or [] for f in g.get("files") or []}


def _first_difference(a: dict[str, str | None], b: dict[str, str | None]) -> str | None:
    """The first file (by path) that is not in both with the same content, or None."""
    for p in sorted(set(a) | set(b)):
        if p not in a or p not in b or a[p] is None or a[p] != b[p]:
            return p
    return None


def resolve(out: Path, run_dir: Path, calls: pl.DataFrame, summary: dict[str, Any], anchor_dir: Path | None,
            progress: Callable[[str], None] | None = None) -> Anchor:
    """The anchor of OUT's estimates (see the module docstring). A `--anchor DIR` that cannot be
    OUT's anchor is an InputError; an identity run that cannot be made gives no anchor (`none`)."""
    if is_identity_run(summary):
        return Anchor(calls, "self", "the run is identity: the estimate is its recorded usage")
    mine = _manifest(run_dir)
    if anchor_dir is not None:
        return _given(out, mine, summary, anchor_dir)
    return _identity_run(mine, summary, progress)


def _given(out: Path, mine: dict[str, Any], summary: dict[str, Any], anchor_dir: Path) -> Anchor:
    from ctxreplay.pipeline.cost.breaks import load_run

    a_calls, a_summary, a_run = load_run(anchor_dir)
    fix = (f"pass the --out of `ctxreplay run <the same inputs> --preset identity` (or a run `ctxreplay compare "
           f"--keep` kept), or leave --anchor out and an identity run of {out}'s inputs is made")
    if not is_identity_run(a_summary):
        raise InputError(f"--anchor {anchor_dir}: its run is pipeline {a_summary.get('pipeline')!r}, with stages "
                         f"({', '.join(sorted((a_summary.get('versions') or {}).get('stages') or {}))}); the anchor "
                         f"is the sessions as recorded: {fix}")
    theirs = _manifest(Path(a_run))
    for key in ("target", "token_counter"):
        x, y = (mine.get("config") or {}).get(key), (theirs.get("config") or {}).get(key)
        if x != y:
            raise InputError(f"--anchor {anchor_dir}: its {key} is {y!r}, {out}'s {x!r}; the anchor must replay "
                             f"with the same: {fix}")
    diff = _first_difference(_files(mine), _files(theirs))
    if diff is not None:
        raise InputError(f"--anchor {anchor_dir}: it did not read the same input files as {out} (first: {diff}, "
                         f"missing from one or with other content): {fix}")
    return Anchor(a_calls, "dir", f"the identity run in {anchor_dir}")


def _identity_run(mine: dict[str, Any], summary: dict[str, Any],
                  progress: Callable[[str], None] | None) -> Anchor:
    from ctxreplay.pipeline.batch.runner import RunOptions, run
    from ctxreplay.pipeline.loaders.inputs import MAX_LINE_BYTES
    from ctxreplay.pipeline.staging.spec import load_spec

    files = _files(mine)
    conf = mine.get("config") or {}
    if not files:
        return Anchor(None, "none", "no anchor: the run's manifest lists no input file")
    missing = next((p for p in sorted(files) if not Path(p).is_file()), None)
    if missing is not None:
        return Anchor(None, "none", f"no anchor: the run's input {missing} is gone (pass --anchor DIR, an identity "
                                    f"run of the same inputs)")
    if progress is not None:
        progress(f"running identity over the run's {len(files):,} input file(s), the anchor of the estimates")
    t0 = time.perf_counter()
    token = MAX_LINE_BYTES.set(conf["max_line_bytes"]) if isinstance(conf.get("max_line_bytes"), int) else None
    try:
        with tempfile.TemporaryDirectory(prefix="ctxreplay-anchor-") as tmp:
            out = Path(tmp) / "identity"
            opts = RunOptions(out_dir=out, target=conf.get("target") or summary.get("target"),
                              token_counter=conf.get("token_counter") or RunOptions.token_counter)
            res = run([Path(p) for p in sorted(files)], load_spec(preset="identity"), opts)
            from ctxreplay.pipeline.assembly.store import run_dir

            diff = _first_difference(files, _files(_manifest(run_dir(out))))
            calls = res.calls
    except CtxReplayError as exc:
        return Anchor(None, "none", f"no anchor: the identity run of the run's inputs failed ({exc})")
    finally:
        if token is not None:
            MAX_LINE_BYTES.reset(token)
    secs = time.perf_counter() - t0
    if diff is not None:
        return Anchor(None, "none", f"no anchor: {diff} changed since the run read it (run again, or pass "
                                    f"--anchor DIR)", secs)
    return Anchor(calls, "run", f"an identity run of the run's {len(files):,} input file(s) (took {secs:.1f} s)", secs)


__all__ = ["Anchor", "is_identity_run", "resolve"]
