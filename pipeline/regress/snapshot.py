"""Golden snapshots of assembled requests, for CI regression (`ctxreplay snapshot`, `ctxreplay diff`).

A golden directory (format GOLDEN_FORMAT_VERSION) holds what a team commits next to its recorded
sessions and its context policy:

```
GOLDEN/manifest.json                  format, ctxreplay version, target, token counter, the pipeline
                                      (name, sha256, resolved spec), every input file's sha256, and
                                      per thread its session, calls and prompt tokens
GOLDEN/threads/<thread_key>/calls.jsonl      per call: request_sha256, prompt_tokens, n_messages,
                                             model, timestamp (sim_cost_usd when the run had it)
GOLDEN/threads/<thread_key>/spans.jsonl      which message holds which place of the thread's
                                             requests over which calls (the request store's rows)
GOLDEN/threads/<thread_key>/decisions.jsonl  the stage decisions the run applied to the thread
GOLDEN/threads/<thread_key>/pending.json     the pending request, pretty-printed canonical JSON
GOLDEN/messages.jsonl                 the canonical JSON of every message some call holds that no
                                      pending request holds (the rest is read back from pending.json)
```

The `*.jsonl` tables are JSON lines whose first line names the columns; rows are sorted by key.
With spans.jsonl and the messages, every golden call's request is rebuilt byte for byte (its
sha256 is the call's request_sha256), so `diff` can show the message and block where a call
first differs without replaying the old pipeline (whose code may be gone). Every file is a pure
function of the inputs' bytes, the pipeline and the ctxreplay version: no time stamps of the
run, no absolute paths, sorted keys, file names from the safe `thread_key`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from ctxreplay.errors import GoldenError, InputError, OutputError
from ctxreplay.pipeline.core.blockops import canonical_json
from ctxreplay.version import __version__

GOLDEN_FORMAT = "ctxreplay-golden"
GOLDEN_FORMAT_VERSION = 1
MANIFEST = "manifest.json"
THREADS = "threads"
MESSAGES = "messages.jsonl"
CALLS_FILE = "calls.jsonl"
SPANS_FILE = "spans.jsonl"
DECISIONS_FILE = "decisions.jsonl"
PENDING_FILE = "pending.json"

CALL_COLUMNS = ["call", "request_sha256", "prompt_tokens", "n_messages", "model", "timestamp"]
SIM_COST = "sim_cost_usd"  # written by the cache simulator when present in calls.parquet
SPAN_COLUMNS = ["slot", "first_call", "last_call", "sha256"]
DECISION_COLUMNS = ["from_call", "stage", "action", "reason", "cache_epoch", "is_provisional", "entry_id",
                    "block_pos", "part_pos", "tool_use_id", "before_sha256", "after_sha256"]

Progress = Callable[[str], None]


# ------------------------------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class Inputs:
    """The transcript files a replay reads: keys are paths relative to `root` (POSIX), so that a
    golden made on one machine compares with a run on another."""

    root: Path
    files: dict[str, dict[str, Any]]  # key -> {"sha256", "bytes"}
    key_of: dict[str, str]  # a path as the loaders report it (as given, or absolute) -> key


def collect_inputs(paths: Sequence[Path]) -> Inputs:
    """The files `ctxreplay run` would read under `paths`, with their sha256."""
    from ctxreplay.pipeline.loaders import discover
    from ctxreplay.pipeline.loaders.inputs import NotARegularFile, read_file

    files, _ = discover([Path(p) for p in paths])
    bases = [os.path.abspath(p) if Path(p).is_dir() else os.path.dirname(os.path.abspath(p)) for p in paths]
    root = Path(os.path.commonpath(bases)) if bases else Path.cwd()
    out: dict[str, dict[str, Any]] = {}
    key_of: dict[str, str] = {}
    for f in files:
        absolute = os.path.abspath(f)
        key = Path(os.path.relpath(absolute, root)).as_posix()
        try:
            data = read_file(absolute)  # never a FIFO or a device
        except (FileNotFoundError, NotARegularFile):
            continue  # gone or replaced since it was listed: the run skips it too, and says so
        except OSError as exc:
            raise InputError(f"{f}: cannot be read: {exc.strerror}. Check the path and its permissions") from exc
        out[key] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        key_of[str(f)] = key
        key_of[absolute] = key
    return Inputs(root, dict(sorted(out.items())), key_of)


# ------------------------------------------------------------------------------------------ replay


@dataclass
class Replay:
    """One run of the pipeline over the inputs, as snapshot and diff see it."""

    run_dir: Path
    spec: Any  # PipelineSpec, as run (for its target)
    target: str
    list_key: str
    token_counter: str
    inputs: Inputs
    calls: pl.DataFrame  # calls.parquet
    decisions: pl.DataFrame  # decisions.parquet, with thread_key
    sessions: dict[str, list[str]]  # session_id -> input keys of its files
    summary: dict[str, Any]
    seconds: float
    _spans: pl.DataFrame | None = field(default=None, repr=False)

    @property
    def spans(self) -> pl.DataFrame:
        """call_messages.parquet: the request store's rows of every thread."""
        if self._spans is None:
            from ctxreplay.pipeline.assembly.store import read_call_messages

            self._spans = read_call_messages(self.run_dir).select(
                "thread_key", "slot", "first_call", "last_call", "sha256")
        return self._spans

    def messages(self, shas: Sequence[str]) -> dict[str, bytes]:
        """Canonical JSON of the given messages (or envelopes) from the run's messages.parquet."""
        import pyarrow.parquet as pq

        from ctxreplay.pipeline.assembly.store import MESSAGES_FILE

        if not shas:
            return {}
        t = pq.read_table(self.run_dir / MESSAGES_FILE, columns=["sha256", "canonical_json"],
                          filters=[("sha256", "in", sorted(set(shas)))])
        return dict(zip(t.column("sha256").to_pylist(), t.column("canonical_json").to_pylist(), strict=True))

    def pending_json(self, key: str) -> bytes:
        return (self.run_dir / "requests" / f"{key}.json").read_bytes()


@contextlib.contextmanager
def replay(paths: Sequence[Path], spec: Any, *, target: str | None, token_counter: str,
           out_dir: Path | None = None, progress: Progress | None = None) -> Iterator[Replay]:
    """Run the pipeline over `paths` (through the runner's public `run`) with a fresh ledger, so the
    result depends on the inputs and the pipeline only; outputs go to `out_dir`, else to a
    temporary directory removed on exit."""
    from ctxreplay.pipeline.assembly.replay import thread_key_expr
    from ctxreplay.pipeline.batch.runner import RunOptions, run
    from ctxreplay.pipeline.targets import get_target

    inputs = collect_inputs(paths)
    with tempfile.TemporaryDirectory(prefix="ctxreplay-golden-") as tmp:
        out = out_dir if out_dir is not None else Path(tmp) / "out"
        opts = RunOptions(out_dir=out, ledger_path=Path(tmp) / "ledger.duckdb", target=target,
                          token_counter=token_counter, progress=progress)
        t0 = time.perf_counter()
        result = run(list(paths), spec, opts)
        seconds = time.perf_counter() - t0
        from ctxreplay.pipeline.core.outdir import resolve_run

        run_dir = resolve_run(out)
        calls = pl.read_parquet(run_dir / "calls.parquet")
        decisions = pl.read_parquet(run_dir / "decisions.parquet").with_columns(thread_key=thread_key_expr())
        # files the runner skipped (a JSON document that is not a request) are not inputs
        skipped = {x["file"] for x in result.summary.get("skipped_files") or []}
        if skipped:
            gone = {inputs.key_of[f] for f in skipped if f in inputs.key_of}
            inputs = Inputs(inputs.root, {k: v for k, v in inputs.files.items() if k not in gone}, inputs.key_of)
        files = result.blocks.select("session_id", "source_file").unique()
        sessions: dict[str, set[str]] = {}
        for sid, src in files.iter_rows():
            key = inputs.key_of.get(src) or inputs.key_of.get(os.path.abspath(src))
            if key is not None:
                sessions.setdefault(sid, set()).add(key)
        tname = result.summary["target"]
        yield Replay(run_dir=run_dir, spec=spec.for_target(tname), target=tname,
                     list_key=get_target(tname).list_key, token_counter=token_counter, inputs=inputs,
                     calls=calls, decisions=decisions,
                     sessions={s: sorted(v) for s, v in sorted(sessions.items())},
                     summary=result.summary, seconds=seconds)


# ------------------------------------------------------------------------------------- JSON tables


def _dumps_row(row: Sequence[Any]) -> bytes:
    return orjson.dumps(list(row))


def _table_bytes(columns: list[str], rows: Iterator[Sequence[Any]] | list[Sequence[Any]]) -> bytes:
    return b"\n".join([_dumps_row(columns), *(_dumps_row(r) for r in rows)]) + b"\n"


def read_table(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines table (first line: the column names) as dicts."""
    lines = path.read_bytes().splitlines()
    if not lines:
        return []
    cols = orjson.loads(lines[0])
    return [dict(zip(cols, orjson.loads(x), strict=True)) for x in lines[1:] if x]


def _ts(v: Any) -> str | None:
    if v is None:
        return None
    return v.strftime("%Y-%m-%dT%H:%M:%S.") + f"{v.microsecond // 1000:03d}Z"


def _messages_line(sha: str, data: bytes) -> bytes:
    return b'["' + sha.encode() + b'",' + data + b"]"


def parse_messages_line(line: bytes) -> tuple[str, bytes]:
    """(sha256, canonical JSON) from a messages.jsonl line, the bytes exactly as stored."""
    return line[2:66].decode(), line[68:-1]


def pending_messages(pending: bytes, list_key: str) -> dict[str, bytes]:
    """The canonical JSON of each message and of the envelope of a pending request file, by sha256."""
    req = orjson.loads(pending)
    out: dict[str, bytes] = {}
    for msg in req.get(list_key, []):
        data = canonical_json(msg)
        out[hashlib.sha256(data).hexdigest()] = data
    env = canonical_json({k: v for k, v in req.items() if k != list_key})
    out[hashlib.sha256(env).hexdigest()] = env
    return out


# ------------------------------------------------------------------------------------------ writing


@dataclass
class SnapshotStats:
    golden: Path
    threads: int
    calls: int
    files: int
    bytes: int
    messages_stored: int
    pipeline: str
    pipeline_sha256: str
    target: str
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"golden": str(self.golden), "threads": self.threads, "calls": self.calls, "input_files": self.files,
                "bytes": self.bytes, "messages_stored": self.messages_stored, "pipeline": self.pipeline,
                "pipeline_sha256": self.pipeline_sha256, "target": self.target, "seconds": round(self.seconds, 3)}


def check_golden_dir(golden: Path) -> None:
    """Refuse to write over something that is not a golden directory (a file, or a directory with
    files of its own): writing replaces the whole directory."""
    if golden.exists() and not golden.is_dir():
        raise GoldenError(f"--golden {golden} is a file, not a directory: pass a directory for the goldens")
    if golden.is_dir() and not (golden / MANIFEST).is_file() and any(golden.iterdir()):
        raise GoldenError(f"--golden {golden} holds files but no {MANIFEST}: it is not a ctxreplay golden directory, "
                          f"and writing goldens replaces the whole directory. Pass a new or empty directory")


def golden_lock(golden: Path) -> Any:
    """The lock of a golden directory (a RunLock, pipeline/core/outdir.py): two runs writing one
    --golden at once would each replace the other's goldens, so the second fails at once naming
    the first. The lock file sits beside the directory (which is swapped whole) while it is held."""
    from ctxreplay.pipeline.core.outdir import RunLock

    g = Path(golden).absolute()
    try:
        g.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create the golden directory {golden}: {exc.strerror}; pass a --golden "
                          f"you can write to") from exc
    return RunLock(g.parent / f".{g.name}.lock", f"the golden directory {golden}", instead="another --golden",
                   remove=True)


def spec_source(spec: Any) -> str:
    """The spec's source without the machine's paths: `preset:<name>` or the file's name."""
    src = str(spec.source)
    return src if src.startswith("preset:") else Path(src).name


def write_golden(rp: Replay, golden: Path) -> SnapshotStats:
    """Write the goldens of a replay into `golden`, replacing what was there all at once (the new
    directory is written beside it and swapped in)."""
    check_golden_dir(golden)
    golden = Path(golden)
    parent = golden.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f".{golden.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}"
        tmp.mkdir()
    except OSError as exc:
        raise OutputError(f"cannot create the golden directory {golden}: {exc.strerror}; pass a --golden "
                          f"you can write to") from exc
    try:
        stats = _write_into(rp, tmp, golden)
        old = parent / f".{golden.name}.old-{os.getpid()}-{secrets.token_hex(3)}"
        if golden.exists():
            os.rename(golden, old)
        os.rename(tmp, golden)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        raise OutputError(f"cannot write the goldens in {golden}: {exc.strerror or exc}; the previous goldens "
                          f"are kept") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return stats


def _write_into(rp: Replay, d: Path, golden: Path) -> SnapshotStats:
    calls = rp.calls.sort("thread_key", "call")
    has_sim = SIM_COST in calls.columns
    call_cols = CALL_COLUMNS + ([SIM_COST] if has_sim else [])
    spans = rp.spans.with_columns(
        slot=pl.col("slot").rank("dense").over("thread_key").cast(pl.Int64) - 1,
    ).sort("thread_key", pl.col("slot").fill_null(-1), "first_call")
    decisions = rp.decisions.sort("thread_key", "from_call", "stage", "entry_id", "block_pos", "part_pos", "action",
                                  nulls_last=True)
    keys = calls.get_column("thread_key").unique().sort().to_list()
    if len(set(keys)) != calls.select("session_id", "thread_id").unique().height:
        raise GoldenError("two threads share one thread_key (their ids differ only in characters a file name "
                          "cannot hold); this ctxreplay cannot snapshot them apart")
    calls_by = {k[0]: part for k, part in calls.group_by(["thread_key"], maintain_order=True)}
    spans_by = {k[0]: part for k, part in spans.group_by(["thread_key"], maintain_order=True)}
    dec_by = {k[0]: part for k, part in decisions.group_by(["thread_key"], maintain_order=True)}
    (d / THREADS).mkdir()
    recovered: set[str] = set()
    threads: dict[str, Any] = {}
    for key in keys:
        td = d / THREADS / key
        td.mkdir()
        c = calls_by[key]
        rows = [[r[0], r[1], r[2], r[3], r[4], _ts(r[5]), *r[6:]] for r in c.select(call_cols).iter_rows()]
        (td / CALLS_FILE).write_bytes(_table_bytes(call_cols, rows))
        s = spans_by.get(key)
        (td / SPANS_FILE).write_bytes(_table_bytes(SPAN_COLUMNS, [] if s is None else s.select(SPAN_COLUMNS).rows()))
        dec = dec_by.get(key)
        (td / DECISIONS_FILE).write_bytes(_table_bytes(
            DECISION_COLUMNS, [] if dec is None else dec.select(DECISION_COLUMNS).rows()))
        pending = rp.pending_json(key)
        (td / PENDING_FILE).write_bytes(pending)
        recovered.update(pending_messages(pending, rp.list_key))
        pend = c.filter(pl.col("is_pending"))
        sid, tid = c.get_column("session_id")[0], c.get_column("thread_id")[0]
        threads[key] = {
            "session_id": sid, "thread_id": tid, "calls": c.height,
            "first_call": int(c.get_column("call").min()),  # type: ignore[arg-type]
            "pending_call": int(pend.get_column("call")[0]) if pend.height else None,
            "prompt_tokens": int(c.get_column("prompt_tokens").sum()),
        }
        if has_sim:
            threads[key][SIM_COST] = c.get_column(SIM_COST).sum()
    needed = set(rp.spans.get_column("sha256").unique().to_list())
    extra = sorted(needed - recovered)
    data = rp.messages(extra)
    missing = [s for s in extra if s not in data]
    if missing:
        raise GoldenError(f"{rp.run_dir}: messages.parquet lacks {len(missing)} of the messages its "
                          f"call_messages.parquet names (first {missing[0]}); the run's outputs are damaged: run again")
    (d / MESSAGES).write_bytes(b"".join(_messages_line(s, data[s]) + b"\n" for s in extra))
    manifest = {
        "format": GOLDEN_FORMAT,
        "format_version": GOLDEN_FORMAT_VERSION,
        "ctxreplay_version": __version__,
        "target": rp.target,
        "list_key": rp.list_key,
        "token_counter": rp.token_counter,
        "pipeline": {"name": rp.spec.name, "sha256": rp.spec.sha256, "source": spec_source(rp.spec),
                     "resolved": rp.spec.resolved()},
        "inputs": {"files": rp.inputs.files},
        "sessions": rp.sessions,
        "threads": threads,
        "totals": {"threads": len(threads), "calls": calls.height,
                   "prompt_tokens": int(calls.get_column("prompt_tokens").sum()) if calls.height else 0,
                   "messages_stored": len(extra)},
    }
    (d / MANIFEST).write_bytes(orjson.dumps(manifest, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n")
    size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    return SnapshotStats(golden=golden, threads=len(threads), calls=calls.height, files=len(rp.inputs.files),
                         bytes=size, messages_stored=len(extra), pipeline=rp.spec.name,
                         pipeline_sha256=rp.spec.sha256, target=rp.target)


def snapshot(paths: Sequence[Path], spec: Any, golden: Path, *, target: str | None = None,
             token_counter: str | None = None, progress: Progress | None = None) -> SnapshotStats:
    """Replay `paths` with `spec` and write the goldens into `golden`."""
    from ctxreplay.pipeline.core.tokens import TIKTOKEN_COUNTER

    check_golden_dir(golden)
    t0 = time.perf_counter()
    with golden_lock(golden), replay(paths, spec, target=target, token_counter=token_counter or TIKTOKEN_COUNTER,
                                     progress=progress) as rp:
        stats = write_golden(rp, golden)
    stats.seconds = time.perf_counter() - t0
    return stats


# ------------------------------------------------------------------------------------------ reading


class Golden:
    """A golden directory, read lazily: the manifest at once, a thread's files when asked."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        man = self.path / MANIFEST
        if not man.is_file():
            what = "does not exist" if not self.path.exists() else f"has no {MANIFEST}"
            raise GoldenError(f"no goldens: {self.path} {what}. Write them with `ctxreplay snapshot PATH ... --golden "
                              f"{self.path}` (or `ctxreplay diff PATH ... --golden {self.path} --update`)")
        try:
            doc = orjson.loads(man.read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise GoldenError(f"{man}: cannot be read as JSON ({exc}); rewrite the goldens with "
                              f"`ctxreplay diff PATH ... --golden {self.path} --update`") from exc
        if not isinstance(doc, dict) or doc.get("format") != GOLDEN_FORMAT:
            raise GoldenError(f"{man} is not a ctxreplay golden manifest (no \"format\": \"{GOLDEN_FORMAT}\"); rewrite "
                              f"the goldens with `ctxreplay diff PATH ... --golden {self.path} --update`")
        version = doc.get("format_version")
        if version != GOLDEN_FORMAT_VERSION:
            raise GoldenError(
                f"{self.path} holds ctxreplay goldens of format {version} (written by ctxreplay "
                f"{doc.get('ctxreplay_version', '?')}); this ctxreplay ({__version__}) reads format "
                f"{GOLDEN_FORMAT_VERSION}. Rewrite them with `ctxreplay diff PATH ... --golden {self.path} --update` "
                f"(review the changes it reports first), or run the ctxreplay version that wrote them")
        self.manifest: dict[str, Any] = doc
        self._messages: dict[str, bytes] | None = None
        self._pending_loaded: set[str] = set()
        self._store: dict[str, bytes] = {}

    @property
    def target(self) -> str:
        return str(self.manifest["target"])

    @property
    def list_key(self) -> str:
        return str(self.manifest["list_key"])

    @property
    def threads(self) -> dict[str, dict[str, Any]]:
        return dict(self.manifest["threads"])

    def thread_dir(self, key: str) -> Path:
        return self.path / THREADS / key

    def calls_frame(self) -> pl.DataFrame:
        """Every thread's calls: thread_key, call, request_sha256, prompt_tokens, n_messages, model,
        timestamp (string), sim_cost_usd (null when the golden run had none)."""
        rows: list[dict[str, Any]] = []
        for key in sorted(self.threads):
            path = self.thread_dir(key) / CALLS_FILE
            try:
                for r in read_table(path):
                    rows.append({"thread_key": key, **r})
            except (OSError, orjson.JSONDecodeError, ValueError) as exc:
                raise GoldenError(f"{path}: cannot be read ({exc}); the golden directory is damaged: rewrite it "
                                  f"with `ctxreplay diff PATH ... --golden {self.path} --update`") from exc
        schema = {"thread_key": pl.String, "call": pl.Int32, "request_sha256": pl.String, "prompt_tokens": pl.Int64,
                  "n_messages": pl.Int32, "model": pl.String, "timestamp": pl.String, SIM_COST: pl.Float64}
        return pl.DataFrame([{c: r.get(c) for c in schema} for r in rows], schema=schema)

    def spans(self, key: str) -> list[dict[str, Any]]:
        return read_table(self.thread_dir(key) / SPANS_FILE)

    def decisions(self, key: str) -> list[dict[str, Any]]:
        path = self.thread_dir(key) / DECISIONS_FILE
        return read_table(path) if path.is_file() else []

    def pending_json(self, key: str) -> bytes:
        return (self.thread_dir(key) / PENDING_FILE).read_bytes()

    def message(self, sha: str, hint: str | None = None) -> bytes | None:
        """A golden message's (or envelope's) canonical JSON: from messages.jsonl or a pending request
        (the thread `hint` first, then the others)."""
        if sha in self._store:
            return self._store[sha]
        if self._messages is None:
            self._messages = {}
            path = self.path / MESSAGES
            if path.is_file():
                for line in path.read_bytes().splitlines():
                    if line:
                        s, data = parse_messages_line(line)
                        self._messages[s] = data
        if sha in self._messages:
            return self._messages[sha]
        order = ([hint] if hint else []) + sorted(self.threads)
        for key in order:
            if key in self._pending_loaded or not (self.thread_dir(key) / PENDING_FILE).is_file():
                continue
            self._pending_loaded.add(key)
            self._store.update(pending_messages(self.pending_json(key), self.list_key))
            if sha in self._store:
                return self._store[sha]
        return None


def spans_at(rows: Sequence[dict[str, Any]], k: int) -> tuple[list[str], str | None]:
    """(message sha256 in request order, envelope sha256) of call k, from spans rows."""
    held = [r for r in rows if r["first_call"] <= k < r["last_call"]]
    msgs = sorted((r for r in held if r["slot"] is not None), key=lambda r: r["slot"])
    env = next((r["sha256"] for r in held if r["slot"] is None), None)
    return [r["sha256"] for r in msgs], env


__all__ = ["GOLDEN_FORMAT_VERSION", "Golden", "GoldenError", "Inputs", "Replay", "SnapshotStats",
           "collect_inputs", "golden_lock", "replay", "snapshot", "spans_at", "write_golden"]
