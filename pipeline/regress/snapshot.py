"""Golden snapshots of assembled requests, for CI regression (`ctxreplay snapshot`, `ctxreplay diff`).

A golden directory (format GOLDEN_FORMAT_VERSION) holds what a team commits next to its recorded
sessions and its context policy, laid out so that `git diff` of two snapshots shows what changed
in a few short lines:

```
GOLDEN/manifest.json                  format, ctxreplay version, target, token counter, the pipeline
                                      (name, sha256, resolved spec), every input file's sha256, and
                                      per thread its session and calls
GOLDEN/threads/<thread_key>/calls.jsonl      per call: request_sha256, prompt_tokens, n_messages,
                                             model, timestamp (sim_cost_usd when the run had it)
GOLDEN/threads/<thread_key>/lists.jsonl      how each call's list of messages differs from the
                                             previous call's: `+` inserted (at the end: pos null),
                                             `-` removed, `=` replaced at a position, `env` the
                                             envelope (model, system, tools) from that call on
GOLDEN/threads/<thread_key>/decisions.jsonl  the stage decisions the run applied to the thread
GOLDEN/threads/<thread_key>/pending.json     the pending request: one block per line (a container
                                             is spread over lines when it is wider than 120 chars)
GOLDEN/messages.jsonl                 every message some call holds that no pending request holds,
                                      one per line: [sha256, message]
GOLDEN/texts/<sha256>.txt             each long text (over 120 characters, or 3 lines and more) of a
                                      message or envelope, stored once as it is; the JSON holds
                                      {"$text": "<sha256>"} in its place
GOLDEN/.gitattributes                 `* -text`: git keeps the bytes as written (no end-of-line change)
```

So a tool result that a stage clears changes one line of pending.json (the reference to its text
becomes the short text that replaces it) and adds one line to messages.jsonl (the message as the
earlier calls still send it); the text itself stays. The `*.jsonl` tables are JSON lines whose
first line names the columns; rows are sorted by key. With lists.jsonl, the messages and the
texts, every golden call's request is rebuilt byte for byte (its sha256 is the call's
request_sha256), so `diff` can show the message and block where a call differs without replaying
the old pipeline (whose code may be gone). Every file is a pure function of the inputs' bytes,
the pipeline and the ctxreplay version: no time stamps of the run, no absolute paths, sorted keys,
file names from the safe `thread_key` and from hashes.

Goldens of format 1 (spans.jsonl, pending.json as indented canonical JSON, messages.jsonl of
canonical JSON) are still read; `diff --update` rewrites them in the current format.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from ctxreplay.errors import GoldenError, InputError, OutputError
from ctxreplay.pipeline.core.blockops import canonical_json
from ctxreplay.pipeline.core.progress import Progress
from ctxreplay.pipeline.core.seq import common_ends
from ctxreplay.version import __version__

GOLDEN_FORMAT = "ctxreplay-golden"
GOLDEN_FORMAT_VERSION = 2
READ_FORMAT_VERSIONS = (1, 2)  # 1: spans.jsonl and canonical JSON, before the texts were set apart
MANIFEST = "manifest.json"
THREADS = "threads"
MESSAGES = "messages.jsonl"
TEXTS = "texts"
GITATTRIBUTES = ".gitattributes"
CALLS_FILE = "calls.jsonl"
LISTS_FILE = "lists.jsonl"
SPANS_FILE = "spans.jsonl"  # format 1
DECISIONS_FILE = "decisions.jsonl"
PENDING_FILE = "pending.json"

CALL_COLUMNS = ["call", "request_sha256", "prompt_tokens", "n_messages", "model", "timestamp"]
SIM_COST = "sim_cost_usd"  # written by the cache simulator when present in calls.parquet
SPAN_COLUMNS = ["slot", "first_call", "last_call", "sha256"]
LIST_COLUMNS = ["call", "op", "pos", "sha256"]
TEXT_INLINE_CHARS = 120  # a longer string goes to texts/ (as does one of 3 lines or more)
TEXT_INLINE_NEWLINES = 1
PRETTY_WIDTH = 120  # pending.json: a container wider than this is spread over lines,
BLOCK_DEPTH, BLOCK_CHARS = 4, 1000  # but a block (request > list > message > content > block) up to 1000
DECISION_COLUMNS = ["from_call", "stage", "action", "reason", "cache_epoch", "is_provisional", "entry_id",
                    "block_pos", "part_pos", "tool_use_id", "before_sha256", "after_sha256"]


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
    from ctxreplay.pipeline.loaders.inputs import NotARegularFile, head

    files, _ = discover([Path(p) for p in paths])
    bases = [os.path.abspath(p) if Path(p).is_dir() else os.path.dirname(os.path.abspath(p)) for p in paths]
    root = Path(os.path.commonpath(bases)) if bases else Path.cwd()
    out: dict[str, dict[str, Any]] = {}
    key_of: dict[str, str] = {}
    for f in files:
        absolute = os.path.abspath(f)
        key = Path(os.path.relpath(absolute, root)).as_posix()
        try:
            # never a FIFO or a device; in chunks: a file may hold a line too long to read whole
            _, size, sha = head(absolute, 0)
        except (FileNotFoundError, NotARegularFile):
            continue  # gone or replaced since it was listed: the run skips it too, and says so
        except OSError as exc:
            raise InputError(f"{f}: cannot be read: {exc.strerror}. Check the path and its permissions") from exc
        out[key] = {"sha256": sha, "bytes": size}
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
    """(sha256, canonical JSON) from a format-1 messages.jsonl line, the bytes exactly as stored."""
    return line[2:66].decode(), line[68:-1]


def pending_messages(pending: bytes | dict[str, Any], list_key: str) -> dict[str, bytes]:
    """The canonical JSON of each message and of the envelope of a pending request (its canonical
    JSON, or the request itself), by sha256."""
    req = orjson.loads(pending) if isinstance(pending, bytes | bytearray) else pending
    out: dict[str, bytes] = {}
    for msg in req.get(list_key, []):
        data = canonical_json(msg)
        out[hashlib.sha256(data).hexdigest()] = data
    env = canonical_json({k: v for k, v in req.items() if k != list_key})
    out[hashlib.sha256(env).hexdigest()] = env
    return out


# ------------------------------------------------------------------------------- texts set apart

_TEXT, _DICT = "$text", "$dict"


def _text_apart(s: str) -> bool:
    return len(s) > TEXT_INLINE_CHARS or s.count("\n") > TEXT_INLINE_NEWLINES


def encode_texts(value: Any, texts: dict[str, str]) -> Any:
    """A JSON value with each long string replaced by {"$text": sha256} (the string put in
    `texts`); an object of one key starting with "$" is wrapped as {"$dict": object}, so that
    `decode_texts` gives back exactly the value."""
    if isinstance(value, str):
        if not _text_apart(value):
            return value
        sha = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
        texts[sha] = value
        return {_TEXT: sha}
    if isinstance(value, list):
        return [encode_texts(v, texts) for v in value]
    if isinstance(value, dict):
        out = {k: encode_texts(v, texts) for k, v in value.items()}
        if len(value) == 1 and next(iter(value)).startswith("$"):
            return {_DICT: out}
        return out
    return value


def decode_texts(value: Any, text: Any) -> Any:
    """The inverse of encode_texts; `text(sha256)` gives a text set apart."""
    if isinstance(value, list):
        return [decode_texts(v, text) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            (k, v), = value.items()
            if k == _TEXT and isinstance(v, str):
                return text(v)
            if k == _DICT and isinstance(v, dict):
                return {kk: decode_texts(vv, text) for kk, vv in v.items()}
        return {k: decode_texts(v, text) for k, v in value.items()}
    return value


def pretty_json(value: Any, indent: int = 0, width: int = PRETTY_WIDTH, depth: int = 0, parent: str | None = None,
                ) -> bytes:
    """JSON with sorted keys for pending.json: one block per line. Above BLOCK_DEPTH (request >
    list > message > content list > block) a container that holds containers is spread over
    lines, one of scalars only when it is wider than `width`; a block (or deeper) stays on one line
    up to BLOCK_CHARS, and so does an OpenAI Responses input item without a content list (a
    function call or its output: the Responses form of a block). Its long texts are set apart
    (encode_texts), so a line stays short and a change to a block is a change to its line."""
    compact = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    if not isinstance(value, dict | list) or not value:
        return compact
    children = value.values() if isinstance(value, dict) else value
    if depth >= BLOCK_DEPTH or (depth == 2 and parent == "input" and isinstance(value, dict)
                                and not any(isinstance(v, list) for v in children)):
        one_line = len(compact) <= BLOCK_CHARS
    else:
        one_line = not any(isinstance(v, dict | list) and v for v in children) and indent + len(compact) <= width
    if one_line:
        return compact
    pad = b" " * (indent + 2)
    if isinstance(value, dict):
        items = [pad + orjson.dumps(k) + b": " + pretty_json(value[k], indent + 2, width, depth + 1, k)
                 for k in sorted(value)]
        return b"{\n" + b",\n".join(items) + b"\n" + b" " * indent + b"}"
    items = [pad + pretty_json(v, indent + 2, width, depth + 1, parent) for v in value]
    return b"[\n" + b",\n".join(items) + b"\n" + b" " * indent + b"]"


# ------------------------------------------------------------------------------- lists of messages


def list_ops(k: int, before: list[str], after: list[str]) -> list[list[Any]]:
    """lists.jsonl rows that turn call k-1's message list into call k's: `=` a message replaced at
    a position, `-` one removed there, `+` one inserted there (pos null: at the end). The common
    head and tail are left alone, so a change in the middle of a long thread is a row or two."""
    if before == after:
        return []
    p, s = common_ends(before, after)
    a, b = before[p:len(before) - s], after[p:len(after) - s]
    rows: list[list[Any]] = []
    pos, length = p, len(before)

    def insert(sha: str) -> None:
        nonlocal pos, length
        rows.append([k, "+", None if pos == length else pos, sha])
        pos += 1
        length += 1

    def remove(sha: str) -> None:
        nonlocal length
        rows.append([k, "-", pos, sha])
        length -= 1

    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            pos += i2 - i1
            continue
        both = min(i2 - i1, j2 - j1) if tag == "replace" else 0
        for t in range(both):
            rows.append([k, "=", pos, b[j1 + t]])
            pos += 1
        for t in range(i1 + both, i2):
            remove(a[t])
        for t in range(j1 + both, j2):
            insert(b[t])
    return rows


def apply_ops(lst: list[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """Apply one call's list rows (list_ops) to the previous call's list, in place."""
    for _, op, pos, sha in rows:
        if op == "=":
            lst[pos] = sha
        elif op == "-":
            if lst[pos] != sha:
                raise GoldenError(f"lists.jsonl removes {sha[:12]} at {pos}, where {lst[pos][:12]} is")
            del lst[pos]
        elif op == "+":
            if pos is None:
                lst.append(sha)
            else:
                lst.insert(pos, sha)
        else:
            raise GoldenError(f"lists.jsonl: unknown operation {op!r}")
    return lst


def lists_rows(calls: Iterator[tuple[int, list[str], str]]) -> list[list[Any]]:
    """lists.jsonl rows of a thread from each call's (call, message sha256s, envelope sha256)."""
    rows: list[list[Any]] = []
    before: list[str] = []
    env_before = None
    for k, shas, env in calls:
        if env != env_before:
            rows.append([k, "env", None, env])
            env_before = env
        rows += list_ops(k, before, shas)
        before = shas
    return rows


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
    texts: int = 0
    kept_threads: int = 0  # diff --update --thread: threads kept from the goldens as they were

    def to_json(self) -> dict[str, Any]:
        return {"golden": str(self.golden), "threads": self.threads, "calls": self.calls, "input_files": self.files,
                "bytes": self.bytes, "messages_stored": self.messages_stored, "texts": self.texts,
                "pipeline": self.pipeline, "pipeline_sha256": self.pipeline_sha256, "target": self.target,
                "seconds": round(self.seconds, 3)}


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


@dataclass
class ThreadFiles:
    """What the goldens hold of one thread, from a replay or from goldens being kept."""

    key: str
    entry: dict[str, Any]  # the manifest's: session_id, thread_id, calls, first_call, pending_call
    call_columns: list[str]
    call_rows: list[list[Any]]
    lists: list[list[Any]]  # lists.jsonl rows
    decisions: list[list[Any]]  # decisions.jsonl rows
    pending: dict[str, Any]  # the pending request


def _replay_threads(rp: Replay, keys: set[str] | None = None) -> list[ThreadFiles]:
    """The threads of a replay (those of `keys` when given), as the goldens hold them."""
    from ctxreplay.pipeline.assembly.store import iter_call_lists

    calls = rp.calls.sort("thread_key", "call")
    has_sim = SIM_COST in calls.columns
    call_cols = CALL_COLUMNS + ([SIM_COST] if has_sim else [])
    all_keys = calls.get_column("thread_key").unique().sort().to_list()
    if len(set(all_keys)) != calls.select("session_id", "thread_id").unique().height:
        raise GoldenError("two threads share one thread_key (their ids differ only in characters a file name "
                          "cannot hold); this ctxreplay cannot snapshot them apart")
    wanted = [k for k in all_keys if keys is None or k in keys]
    decisions = rp.decisions.sort("thread_key", "from_call", "stage", "entry_id", "block_pos", "part_pos", "action",
                                  nulls_last=True)
    calls_by = {k[0]: part for k, part in calls.group_by(["thread_key"], maintain_order=True)}
    dec_by = {k[0]: part for k, part in decisions.group_by(["thread_key"], maintain_order=True)}
    spans = rp.spans.filter(pl.col("thread_key").is_in(wanted)) if keys is not None else rp.spans
    per_call: dict[str, list[tuple[int, list[str], str]]] = {}
    for key, k, shas, env in iter_call_lists(spans):
        per_call.setdefault(key, []).append((k, shas, env))
    out = []
    for key in wanted:
        c = calls_by[key]
        rows = [[r[0], r[1], r[2], r[3], r[4], _ts(r[5]), *r[6:]] for r in c.select(call_cols).iter_rows()]
        dec = dec_by.get(key)
        pend = c.filter(pl.col("is_pending"))
        entry = {
            "session_id": c.get_column("session_id")[0], "thread_id": c.get_column("thread_id")[0],
            "calls": c.height, "first_call": int(c.get_column("call").min()),  # type: ignore[arg-type]
            "pending_call": int(pend.get_column("call")[0]) if pend.height else None,
        }
        out.append(ThreadFiles(key, entry, call_cols, rows, lists_rows(iter(per_call.get(key, []))),
                               [] if dec is None else [list(r) for r in dec.select(DECISION_COLUMNS).rows()],
                               orjson.loads(rp.pending_json(key))))
    return out


def _kept_threads(g: Golden, keys: Sequence[str]) -> list[ThreadFiles]:
    """Threads of existing goldens (any format read), to write again as they were."""
    out = []
    for key in keys:
        entry = {k: g.threads[key].get(k) for k in ("session_id", "thread_id", "calls", "first_call", "pending_call")}
        path = g.thread_dir(key) / CALLS_FILE
        lines = path.read_bytes().splitlines()
        cols = orjson.loads(lines[0]) if lines else list(CALL_COLUMNS)
        rows = [orjson.loads(x) for x in lines[1:] if x]
        decs = [[d.get(c) for c in DECISION_COLUMNS] for d in g.decisions(key)]
        out.append(ThreadFiles(key, entry, cols, rows, lists_rows(g.call_lists(key)), decs, g.pending_request(key)))
    return out


def write_golden(rp: Replay, golden: Path, *, only: set[str] | None = None, keep: Golden | None = None
                 ) -> SnapshotStats:
    """Write the goldens of a replay into `golden`, replacing what was there all at once (the new
    directory is written beside it and swapped in). With `only` (thread keys) and `keep` (the
    goldens there): the replay's threads of `only`, and the threads of `keep` outside `only` as
    they were (`diff --update --thread`)."""
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
        stats = _write_into(rp, tmp, golden, only, keep)
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


def _write_into(rp: Replay, d: Path, golden: Path, only: set[str] | None, keep: Golden | None) -> SnapshotStats:
    threads = _replay_threads(rp, only)
    from_replay = {t.key for t in threads}
    kept: list[ThreadFiles] = []
    if keep is not None:
        kept = _kept_threads(keep, [k for k in sorted(keep.threads) if only is None or k not in only])
    threads = sorted(threads + kept, key=lambda t: t.key)
    texts: dict[str, str] = {}
    (d / THREADS).mkdir()
    recovered: set[str] = set()
    needed: set[str] = set()
    for t in threads:
        td = d / THREADS / t.key
        td.mkdir()
        (td / CALLS_FILE).write_bytes(_table_bytes(t.call_columns, t.call_rows))
        (td / LISTS_FILE).write_bytes(_table_bytes(LIST_COLUMNS, t.lists))
        (td / DECISIONS_FILE).write_bytes(_table_bytes(DECISION_COLUMNS, t.decisions))
        (td / PENDING_FILE).write_bytes(pretty_json(encode_texts(t.pending, texts)) + b"\n")
        recovered.update(pending_messages(t.pending, rp.list_key))
        needed.update(r[3] for r in t.lists)
    extra = sorted(needed - recovered)
    data = rp.messages(extra)
    if keep is not None:  # a kept thread's messages this run does not hold
        for s in extra:
            if s not in data:
                m = keep.message(s)
                if m is not None:
                    data[s] = m
    missing = [s for s in extra if s not in data]
    if missing:
        raise GoldenError(f"{rp.run_dir}: messages.parquet lacks {len(missing)} of the messages its "
                          f"call_messages.parquet names (first {missing[0]}); the run's outputs are damaged: run again")
    lines = [orjson.dumps([s, encode_texts(orjson.loads(data[s]), texts)], option=orjson.OPT_SORT_KEYS) + b"\n"
             for s in extra]
    (d / MESSAGES).write_bytes(b"".join(lines))
    if texts:
        (d / TEXTS).mkdir()
        for sha, text in texts.items():
            (d / TEXTS / f"{sha}.txt").write_bytes(text.encode("utf-8", "surrogatepass"))
    (d / GITATTRIBUTES).write_bytes(b"# ctxreplay goldens: bytes as written (texts/ hold texts exactly)\n* -text\n")
    inputs, sessions = dict(rp.inputs.files), dict(rp.sessions)
    if keep is not None:  # the kept threads' sessions and their files as the goldens had them
        inputs, sessions = _merged_inputs(rp, keep, {t.entry["session_id"] for t in threads if t.key in from_replay},
                                          {t.entry["session_id"] for t in kept})
    n_calls = sum(len(t.call_rows) for t in threads)
    manifest = {
        "format": GOLDEN_FORMAT,
        "format_version": GOLDEN_FORMAT_VERSION,
        "ctxreplay_version": __version__,
        "target": rp.target,
        "list_key": rp.list_key,
        "token_counter": rp.token_counter,
        "pipeline": {"name": rp.spec.name, "sha256": rp.spec.sha256, "source": spec_source(rp.spec),
                     "resolved": rp.spec.resolved()},
        "inputs": {"files": inputs},
        "sessions": sessions,
        "threads": {t.key: t.entry for t in threads},
        "totals": {"threads": len(threads), "calls": n_calls},
    }
    (d / MANIFEST).write_bytes(orjson.dumps(manifest, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n")
    size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    return SnapshotStats(golden=golden, threads=len(threads), calls=n_calls, files=len(inputs),
                         bytes=size, messages_stored=len(extra), pipeline=rp.spec.name,
                         pipeline_sha256=rp.spec.sha256, target=rp.target, texts=len(texts), kept_threads=len(kept))


def _merged_inputs(rp: Replay, keep: Golden, new_sessions: set[str], kept_sessions: set[str]
                   ) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Input files and sessions of goldens that take some threads from a replay and keep others:
    a session of a replayed thread as this run read it, a session of a kept thread as the goldens
    had it, and a file of neither (one no thread came from) as this run read it."""
    old_files = keep.manifest["inputs"]["files"]
    old_sessions = keep.manifest.get("sessions", {})
    sessions: dict[str, list[str]] = {}
    for sid in kept_sessions - new_sessions:
        if sid in old_sessions:
            sessions[sid] = list(old_sessions[sid])
    for sid in new_sessions:
        if sid in rp.sessions:
            sessions[sid] = list(rp.sessions[sid])
    old_of = {f for sid in kept_sessions - new_sessions for f in old_sessions.get(sid, [])}
    files = {f: v for f, v in rp.inputs.files.items() if f not in old_of}
    files.update({f: old_files[f] for f in old_of if f in old_files})
    return dict(sorted(files.items())), dict(sorted(sessions.items()))


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
        if version not in READ_FORMAT_VERSIONS:
            raise GoldenError(
                f"{self.path} holds ctxreplay goldens of format {version} (written by ctxreplay "
                f"{doc.get('ctxreplay_version', '?')}); this ctxreplay ({__version__}) reads formats "
                f"{', '.join(map(str, READ_FORMAT_VERSIONS))}. Re-snapshot: rewrite them with `ctxreplay diff PATH ... "
                f"--golden {self.path} --update` (review the changes it reports first), or run the ctxreplay version "
                f"that wrote them")
        self.manifest: dict[str, Any] = doc
        self.version: int = int(version)
        self._messages: dict[str, bytes] | None = None
        self._pending_loaded: set[str] = set()
        self._store: dict[str, bytes] = {}
        self._texts: dict[str, str] = {}

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

    def _damaged(self, what: str) -> GoldenError:
        return GoldenError(f"{what}; the golden directory is damaged or was edited by hand: rewrite it with "
                           f"`ctxreplay diff PATH ... --golden {self.path} --update`")

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
                raise self._damaged(f"{path}: cannot be read ({exc})") from exc
        schema = {"thread_key": pl.String, "call": pl.Int32, "request_sha256": pl.String, "prompt_tokens": pl.Int64,
                  "n_messages": pl.Int32, "model": pl.String, "timestamp": pl.String, SIM_COST: pl.Float64}
        return pl.DataFrame([{c: r.get(c) for c in schema} for r in rows], schema=schema)

    def spans(self, key: str) -> list[dict[str, Any]]:
        """Format 1: the store's rows of a thread (spans.jsonl)."""
        return read_table(self.thread_dir(key) / SPANS_FILE)

    def decisions(self, key: str) -> list[dict[str, Any]]:
        path = self.thread_dir(key) / DECISIONS_FILE
        return read_table(path) if path.is_file() else []

    def pending_json(self, key: str) -> bytes:
        """The pending request's file as it is on disk."""
        return (self.thread_dir(key) / PENDING_FILE).read_bytes()

    def text(self, sha: str) -> str:
        """A text set apart in texts/ (format 2)."""
        if sha not in self._texts:
            path = self.path / TEXTS / f"{sha}.txt"
            try:
                text = path.read_bytes().decode("utf-8", "surrogatepass")
            except (OSError, UnicodeDecodeError) as exc:
                raise self._damaged(f"{path}: cannot be read ({exc})") from exc
            if hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest() != sha:
                raise self._damaged(f"{path} does not hold the text its name is the sha256 of (end-of-line "
                                    f"conversion by git? the golden directory's .gitattributes turns it off)")
            self._texts[sha] = text
        return self._texts[sha]

    def pending_request(self, key: str) -> dict[str, Any]:
        """The pending request, as sent (texts put back)."""
        req = orjson.loads(self.pending_json(key))
        return decode_texts(req, self.text) if self.version >= 2 else req  # type: ignore[no-any-return]

    def call_lists(self, key: str) -> Iterator[tuple[int, list[str], str]]:
        """(call, message sha256s in request order, envelope sha256) of each call of a thread, from
        call 0 (a branch's calls before it parts included)."""
        if self.version < 2:
            rows = self.spans(key)
            last = max((r["last_call"] for r in rows), default=0)
            for k in range(last):
                shas, env = spans_at(rows, k)
                yield k, shas, env or ""
            return
        lines = (self.thread_dir(key) / LISTS_FILE).read_bytes().splitlines()
        by_call: dict[int, list[list[Any]]] = {}
        for x in lines[1:]:
            if x:
                row = orjson.loads(x)
                by_call.setdefault(row[0], []).append(row)
        pending = self.threads[key].get("pending_call")
        last = pending if pending is not None else max(by_call, default=-1)
        lst: list[str] = []
        env = ""
        for k in range(last + 1):
            rows = by_call.get(k, [])
            for r in rows:
                if r[1] == "env":
                    env = r[3]
            apply_ops(lst, [r for r in rows if r[1] != "env"])
            yield k, list(lst), env

    def call_list(self, key: str, k: int) -> tuple[list[str], str | None]:
        """(message sha256s in request order, envelope sha256) of call k of a thread."""
        if self.version < 2:
            return spans_at(self.spans(key), k)
        for kk, shas, env in self.call_lists(key):
            if kk == k:
                return shas, env or None
        return [], None

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
                    if not line:
                        continue
                    if self.version < 2:
                        s, data = parse_messages_line(line)
                    else:
                        s, enc = orjson.loads(line)
                        data = canonical_json(decode_texts(enc, self.text))
                        if hashlib.sha256(data).hexdigest() != s:
                            raise self._damaged(f"{path}: message {s[:12]} does not hash to its sha256")
                    self._messages[s] = data
        if sha in self._messages:
            return self._messages[sha]
        order = ([hint] if hint else []) + sorted(self.threads)
        for key in order:
            if key in self._pending_loaded or not (self.thread_dir(key) / PENDING_FILE).is_file():
                continue
            self._pending_loaded.add(key)
            self._store.update(pending_messages(self.pending_request(key), self.list_key))
            if sha in self._store:
                return self._store[sha]
        return None


def spans_at(rows: Sequence[dict[str, Any]], k: int) -> tuple[list[str], str | None]:
    """(message sha256 in request order, envelope sha256) of call k, from format-1 spans rows."""
    held = [r for r in rows if r["first_call"] <= k < r["last_call"]]
    msgs = sorted((r for r in held if r["slot"] is not None), key=lambda r: r["slot"])
    env = next((r["sha256"] for r in held if r["slot"] is None), None)
    return [r["sha256"] for r in msgs], env


__all__ = ["GOLDEN_FORMAT_VERSION", "Golden", "GoldenError", "Inputs", "Replay", "SnapshotStats",
           "collect_inputs", "decode_texts", "encode_texts", "golden_lock", "list_ops", "pretty_json", "replay",
           "snapshot", "spans_at", "write_golden"]
