"""Fingerprints of every corpus output, per preset and thread, to prove a refactor changed nothing.

For each pipeline (the shipped presets and the `stress` spec that makes layers 5-6 fire), the
corpus is replayed with the tiktoken counter and, per thread, three digests are kept:
- `requests`: sha256 over the thread's calls in order (call, request_sha256, prompt_tokens,
  n_messages, prefix_break_message);
- `decisions`: sha256 over the decisions the run applied to the thread, sorted by key;
- `blocks` (identity only): sha256 over the thread's loaded block rows, every column (file paths
  relative to the corpus), sorted by key.
plus, per pipeline, a digest of the ledger's decision rows in seq order.

    python tests/corpus_fingerprint.py [--only PRESET ...]   # rewrite tests/golden/corpus_fingerprints.json

The test `tests/test_corpus_fingerprint.py` compares a fresh run with the committed file and names
the threads that differ.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson
import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GOLDEN = ROOT / "tests" / "golden" / "corpus_fingerprints.json"
CORPUS = ROOT.parent / "shared" / "corpus"
PRESETS = ("identity", "minimal", "default", "claude-code", "openclaw", "context-editing", "stress")

DECISION_COLS = ["stage", "session_id", "thread_id", "entry_id", "block_pos", "part_pos", "from_call", "action",
                 "reason", "before_sha256", "after_sha256", "before_len", "after_len", "cache_epoch",
                 "is_provisional"]
CALL_COLS = ["call", "request_sha256", "prompt_tokens", "n_messages", "prefix_break_message"]


def _digest(rows: list[Any]) -> str:
    h = hashlib.sha256()
    for r in rows:
        h.update(orjson.dumps(r, option=orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_DATETIME, default=str))
        h.update(b"\n")
    return h.hexdigest()


def _per_thread(df: pl.DataFrame, cols: list[str], sort: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    if df.height == 0:
        return out
    df = df.sort(["session_id", "thread_id", *sort])
    for (sid, tid), part in df.group_by(["session_id", "thread_id"], maintain_order=True):
        out[f"{sid}/{tid}"] = _digest(part.select(cols).rows())
    return out


def spec_for(preset: str) -> Any:
    from ctxreplay.pipeline.staging.spec import load_spec, parse_spec

    if preset == "stress":
        from tests.test_properties_layers_5_6 import STRESS_SPEC

        return parse_spec(STRESS_SPEC, source="stress-5-6")
    return load_spec(preset=preset)


def fingerprint(preset: str, corpus: Path = CORPUS) -> dict[str, Any]:
    """Replay the corpus under one pipeline and digest its outputs per thread."""
    import duckdb

    from ctxreplay.pipeline.batch.runner import RunOptions, run

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        res = run([corpus], spec_for(preset), RunOptions(out_dir=out))
        calls = pl.read_parquet(out / "calls.parquet")
        decisions = pl.read_parquet(out / "decisions.parquet")
        doc: dict[str, Any] = {
            "calls": calls.height,
            "decisions": decisions.height,
            "requests": _per_thread(calls, CALL_COLS, ["call"]),
            "thread_decisions": _per_thread(decisions, DECISION_COLS,
                                            ["stage", "entry_id", "block_pos", "part_pos", "from_call", "action"]),
        }
        con = duckdb.connect(str(res.summary["ledger"]), read_only=True)
        try:
            rows = con.sql("SELECT * EXCLUDE (spec_sha256) FROM decisions ORDER BY seq").fetchall()
        finally:
            con.close()
        doc["ledger"] = _digest([list(r) for r in rows])
        if preset == "identity":
            # file paths relative to the corpus: the digest must not depend on where the checkout is
            # (as given to the run, or resolved: ../shared may be a link)
            blocks = pl.read_parquet(out / "blocks.parquet").with_columns(
                pl.col("source_file").str.strip_prefix(str(corpus) + "/")
                .str.strip_prefix(str(corpus.resolve()) + "/"))
            doc["blocks"] = _per_thread(blocks, blocks.columns,
                                        ["entry_id", "block_pos", "part_pos", "first_call"])
    return doc


def diff(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Human-readable differences between two fingerprints of one pipeline."""
    out: list[str] = []
    for key in ("calls", "decisions", "ledger"):
        if expected.get(key) != actual.get(key):
            out.append(f"{key}: {expected.get(key)} -> {actual.get(key)}")
    for key in ("requests", "thread_decisions", "blocks"):
        e, a = expected.get(key, {}), actual.get(key, {})
        for t in sorted(set(e) | set(a)):
            if e.get(t) != a.get(t):
                what = "new" if t not in e else "gone" if t not in a else "differs"
                out.append(f"{key}: thread {t} {what}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="only these pipelines (others kept from the file)")
    args = ap.parse_args()
    doc = orjson.loads(GOLDEN.read_bytes()) if GOLDEN.is_file() else {}
    for p in args.only or PRESETS:
        print(f"fingerprinting {p} ...", file=sys.stderr)
        new = fingerprint(p)
        if p in doc:
            for line in diff(doc[p], new):
                print(f"  {p}: {line}", file=sys.stderr)
        doc[p] = new
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_bytes(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)


if __name__ == "__main__":
    main()
