"""The request store: every call's request, kept once per distinct message, rebuilt on demand.

A run writes two files (schemas/messages.py):
- `messages.parquet`: each distinct wire message, and each distinct envelope (the request's other
  keys: model, system, ...), once: sha256, kind, role, content blocks, estimated tokens and its
  canonical JSON bytes;
- `call_messages.parquet`: which message holds which place (`slot`) of a thread's requests over
  which calls `[first_call, last_call)`, and which envelope; one row per stretch of calls, like
  the block versions of blocks.parquet.

Both grow with what changes, not with calls × messages (consecutive requests share almost every
message: a list per call would be quadratic in the session's length). Call k's request is the
messages whose rows hold call k, by slot: `{"<list_key>":[` + their canonical JSON joined by `,`
+ `],` + the envelope's without its opening `{` (`]}` for an empty envelope). That is byte for
byte the JSON whose sha256 is the call's `request_sha256` in calls.parquet, with no stage or
target code run again.

`call_message_frame` gives, for call k, each message's sha256, role, tokens and running token
count; `iter_call_lists` walks a thread's calls in order (what a prompt-cache simulator needs). A
call's `prompt_tokens` is `REQUEST_OVERHEAD_TOKENS + envelope tokens + sum over its messages of
(tokens + MESSAGE_OVERHEAD_TOKENS)`.
"""

from __future__ import annotations

import bisect
import os
import tempfile
from array import array
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from ctxreplay.errors import StoreError, did_you_mean
from ctxreplay.pipeline.assembly.replay import (
    ENVELOPE_SLOT,
    MESSAGE_OVERHEAD_TOKENS,
    MessageStore,
    SpanLog,
    request_bytes,
)
from ctxreplay.schemas.messages import CALL_MESSAGES, MESSAGES

MESSAGES_FILE = "messages.parquet"
CALL_MESSAGES_FILE = "call_messages.parquet"


def _int32(a: array) -> pa.Array:  # type: ignore[type-arg]
    return pa.Array.from_buffers(pa.int32(), len(a), [None, pa.py_buffer(a)])


def store_tables(store: MessageStore, spans: SpanLog, target: str, list_key: str) -> tuple[pa.Table, pa.Table]:
    """(messages, call_messages) tables, call_messages sorted by thread, slot and first call. Its
    repeated strings are dictionary-encoded in memory and on disk (they read back as strings).
    A message of the store that no stretch holds (a version that lived for no call: made and
    replaced before the next call) is left out: messages.parquet is what the requests hold, so a
    re-run that reuses a group's messages by its call_messages rows writes what a fresh run writes."""
    import pyarrow.compute as pc  # imported when used: a warm run never needs it (~40 ms)
    messages = pa.Table.from_arrays(
        [pa.array(store.sha256, pa.string()), pa.array(store.kind, pa.string()), pa.array(store.role, pa.string()),
         pa.array(store.n_blocks, pa.int32()), pa.array(store.tokens, pa.int64()),
         pa.array(store.data, pa.binary())],
        schema=MESSAGES)
    n = len(spans)
    held = pc.unique(_int32(spans.id))
    if len(held) < messages.num_rows:
        messages = messages.take(held.take(pc.sort_indices(held)))  # in the store's order
    thread = _int32(spans.thread)
    raw_slot = pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(spans.slot)])
    slot = pc.if_else(pc.equal(raw_slot, ENVELOPE_SLOT), pa.scalar(None, pa.int64()), raw_slot)

    def per_thread(i: int) -> pa.Array:
        return pa.DictionaryArray.from_arrays(thread, pa.array([t[i] for t in spans.threads], pa.string()))

    zeros = pa.array([0] * n, pa.int32())
    table = pa.table({
        "session_id": per_thread(0), "thread_id": per_thread(1), "thread_key": per_thread(2),
        "slot": slot, "first_call": _int32(spans.first), "last_call": _int32(spans.last),
        "sha256": pa.DictionaryArray.from_arrays(_int32(spans.id), pa.array(store.sha256, pa.string())),
        "target": pa.DictionaryArray.from_arrays(zeros, pa.array([target])),
        "list_key": pa.DictionaryArray.from_arrays(zeros, pa.array([list_key])),
    })
    order = pc.sort_indices(pa.table({"t": thread, "s": raw_slot, "f": table.column("first_call")}),
                            sort_keys=[("t", "ascending"), ("s", "ascending"), ("f", "ascending")])
    table = table.take(order)
    _check_fields(table, CALL_MESSAGES)
    return messages, table


def _check_fields(table: pa.Table, declared: pa.Schema) -> None:
    """The table's columns and value types are the declared ones (dictionary encoding aside)."""
    got = [(f.name, f.type.value_type if pa.types.is_dictionary(f.type) else f.type) for f in table.schema]
    want = [(f.name, f.type) for f in declared]
    if got != want:
        raise AssertionError(f"{declared.metadata[b'name'].decode()}: columns {got} != declared {want}")
    for f in declared:
        if not f.nullable and table.column(f.name).null_count:
            raise AssertionError(f"{declared.metadata[b'name'].decode()}: nulls in not-null column {f.name}")


def write_store(out_dir: Path, messages: pa.Table, call_messages: pa.Table) -> None:
    """Write both files into out_dir (each through a temporary file and a rename)."""
    _write(out_dir / MESSAGES_FILE, messages)
    # without the Arrow schema in the file, the dictionary-encoded columns read back as strings
    _write(out_dir / CALL_MESSAGES_FILE, call_messages, store_schema=False)


def _write(path: Path, table: pa.Table, **kw: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression="zstd", compression_level=1, **kw)  # as the runner's outputs
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ------------------------------------------------------------------------------------ reading


def run_dir(out_dir: Path) -> Path:
    """The directory of the run OUT shows (OUT/current), resolved once so that every file read
    comes from one run; or out_dir itself when it holds a store of its own."""
    from ctxreplay.pipeline.core.outdir import CURRENT, resolve_run

    if not (out_dir / CURRENT).is_symlink() and (out_dir / CALL_MESSAGES_FILE).is_file():
        return out_dir
    return resolve_run(out_dir)


def _need(run: Path, name: str) -> Path:
    """run/name, or an error that says which run lacks it and what to do (`run` is a run directory;
    the advice names the OUT it belongs to)."""
    path = run / name
    if not path.is_file():
        out = run.parent.parent if run.parent.name == ".runs" else run
        raise StoreError(f"{out}: the run shown there has no {name} (made before the request store existed, "
                         f"or damaged); run `ctxreplay run ... --out {out}` again")
    return path


def read_call_messages(out_dir: Path, key: str | None = None) -> pl.DataFrame:
    """call_messages.parquet (of one thread when key is given; a missing thread is an error that
    names the closest one). `out_dir` is a run directory (see run_dir)."""
    path = _need(out_dir, CALL_MESSAGES_FILE)
    if key is None:
        return pl.read_parquet(path)
    rows = pl.from_arrow(pq.read_table(path, filters=[("thread_key", "=", key)]))
    assert isinstance(rows, pl.DataFrame)
    if rows.height == 0:
        keys = sorted(set(pq.read_table(path, columns=["thread_key"]).column("thread_key").to_pylist()))
        hint = did_you_mean(key, keys)
        raise StoreError(f"{out_dir}: no thread '{key}'.{hint} Threads: {', '.join(keys[:10])}"
                         f"{' ...' if len(keys) > 10 else ''}")
    return rows


def _at_call(rows: pl.DataFrame, key: str, call: int | None) -> tuple[int, pl.DataFrame]:
    """(k, the rows that hold call k); call None: the pending call."""
    pending = int(rows.get_column("last_call").max()) - 1  # type: ignore[arg-type]
    k = pending if call is None else call
    if not 0 <= k <= pending:
        raise StoreError(f"thread '{key}' has calls 0..{pending} ({pending} is the pending call); got --call {call}")
    return k, rows.filter((pl.col("first_call") <= k) & (pl.col("last_call") > k)).sort("slot", nulls_last=True)


def _messages(out_dir: Path, shas: list[str]) -> dict[str, bytes]:
    t = pq.read_table(_need(out_dir, MESSAGES_FILE), columns=["sha256", "canonical_json"],
                      filters=[("sha256", "in", sorted(set(shas)))])
    return dict(zip(t.column("sha256").to_pylist(), t.column("canonical_json").to_pylist(), strict=True))


def request_json(out_dir: Path, key: str, call: int | None = None, target: str | None = None) -> bytes:
    """The canonical JSON of one call's request (call None: the pending one), from the store of
    the run OUT shows. With another `target` than the run's, the request is shaped anew from the
    run's final blocks in that target (its sha256 is then not the one in calls.parquet)."""
    out_dir = run_dir(out_dir)
    if not (out_dir / CALL_MESSAGES_FILE).is_file() and (out_dir / "blocks.parquet").is_file():
        return _without_store(out_dir, key, call, target)  # a run made before the request store
    rows = read_call_messages(out_dir, key)
    k, held = _at_call(rows, key, call)
    _refuse_inherited(out_dir, rows, key, k)
    if target is not None and target.replace("_", "-") != rows.get_column("target")[0]:
        return _in_other_target(out_dir, key, k, target)
    shas = held.get_column("sha256").to_list()
    if held.get_column("slot").null_count() != 1:
        raise StoreError(f"{out_dir}: {CALL_MESSAGES_FILE} holds no single envelope for thread '{key}' call {k}; "
                         f"the output directory is damaged: run again")
    data = _messages(out_dir, shas)
    try:
        return request_bytes(rows.get_column("list_key")[0], [data[s] for s in shas[:-1]], data[shas[-1]])
    except KeyError as exc:
        raise StoreError(f"{out_dir}: {MESSAGES_FILE} lacks message {exc.args[0]} of thread '{key}' call {k}; "
                         f"the output directory is damaged: run again") from exc


def _refuse_inherited(out_dir: Path, rows: pl.DataFrame, key: str, k: int) -> None:
    """A branch walks the calls of the history it shares with another thread (they are in the
    store, so its requests build on them), but that thread reports them: calls.parquet has no row
    for them here, and `request` points to the thread that does."""
    path = out_dir / "calls.parquet"
    if not path.is_file():
        return
    own = pl.from_arrow(pq.read_table(path, columns=["thread_key", "call"], filters=[("thread_key", "=", key)]))
    assert isinstance(own, pl.DataFrame)
    calls = set(own.get_column("call").to_list())
    if own.height and k not in calls:
        pending = int(rows.get_column("last_call").max()) - 1  # type: ignore[arg-type]
        sid = rows.get_column("session_id")[0]
        listed = ", ".join(str(c) for c in sorted(calls) if c != pending) or "none"
        other = reporting_thread(out_dir, key, k, rows)
        out = out_dir.parent.parent if out_dir.parent.name == ".runs" else out_dir
        who = (f"thread '{other}', which reports that request (`ctxreplay request {out} {other} --call {k}`)" if other
               else f"another thread of session {sid}, which reports that request")
        raise StoreError(f"call {k} of thread '{key}' is history it shares with {who}; this thread's own calls are "
                         f"{listed} and {pending} (pending)")


def reporting_thread(out_dir: Path, key: str, k: int, rows: pl.DataFrame | None = None) -> str | None:
    """The thread that reports call k of the history `key` shares with it (a branch walks the calls
    before it parts, but another thread reports them): of the thread's session, the one with a row
    for call k in calls.parquet whose messages at k are those `key` holds at k (the envelope aside:
    an inherited call's model is not the branch's to record), else the one sharing the longest
    prefix of them. None when no other thread of the session reports call k."""
    out_dir = run_dir(out_dir)
    if rows is None:
        rows = read_call_messages(out_dir, key)
    sid = rows.get_column("session_id")[0]
    calls = pl.from_arrow(pq.read_table(_need(out_dir, "calls.parquet"), columns=["session_id", "thread_key", "call"],
                                        filters=[("session_id", "=", sid), ("call", "=", k)]))
    assert isinstance(calls, pl.DataFrame)
    others = sorted(set(calls.get_column("thread_key").to_list()) - {key})
    if not others:
        return None

    def held(r: pl.DataFrame, kk: str) -> list[str]:
        return r.filter((pl.col("first_call") <= k) & (pl.col("last_call") > k) & pl.col("slot").is_not_null()) \
            .sort("slot").get_column("sha256").to_list()

    mine = held(rows, key)
    best, best_len = None, -1
    for other in others:
        theirs = held(read_call_messages(out_dir, other), other)
        if theirs == mine:
            return other
        n = 0
        while n < min(len(mine), len(theirs)) and mine[n] == theirs[n]:
            n += 1
        if n > best_len:
            best, best_len = other, n
    return best


def _without_store(run: Path, key: str, call: int | None, target: str | None) -> bytes:
    """A run made before the request store: the request shaped from its blocks, in its target."""
    from ctxreplay.pipeline.core.outdir import read_summary

    calls = pl.read_parquet(_need(run, "calls.parquet"), columns=["thread_key", "call", "is_pending"])
    own = calls.filter(pl.col("thread_key") == key)
    if own.height == 0:
        keys = sorted(set(calls.get_column("thread_key").to_list()))
        hint = did_you_mean(key, keys)
        raise StoreError(f"{run}: no thread '{key}'.{hint} Threads: {', '.join(keys[:10])}"
                         f"{' ...' if len(keys) > 10 else ''}")
    pending = int(own.filter(pl.col("is_pending"))["call"].max() or 0)  # type: ignore[arg-type]
    k = pending if call is None else call
    if not 0 <= k <= pending:
        raise StoreError(f"thread '{key}' has calls 0..{pending} ({pending} is the pending call); got --call {call}")
    if k not in set(own.get_column("call").to_list()):
        raise StoreError(f"call {k} of thread '{key}' is history it shares with another thread, which reports "
                         f"that request")
    return _in_other_target(run, key, k, target or read_summary(run).get("target") or "anthropic")


def _in_other_target(run: Path, key: str, k: int, target_name: str) -> bytes:
    """Call k's request shaped in another target than the run's: the thread's final blocks replayed
    (the stages are not run again; their decisions are in the blocks)."""
    from ctxreplay.pipeline.assembly.replay import CallInfo, replay_thread, thread_key_expr, thread_rows
    from ctxreplay.pipeline.targets import get_target

    target = get_target(target_name)
    blocks = pl.read_parquet(_need(run, "blocks.parquet")).filter(thread_key_expr() == key)
    calls = pl.read_parquet(_need(run, "calls.parquet")).filter(pl.col("thread_key") == key)
    models = dict(zip(calls["call"].to_list(), calls["model"].to_list(), strict=True))
    n = int(calls.filter(pl.col("is_pending"))["call"].max() or 0)  # type: ignore[arg-type]
    infos = [CallInfo(c, models.get(c), reported=c in models) for c in range(n)]
    (_, part), = list(thread_rows(blocks))
    rows = part.drop("raw_line").to_dicts()  # not a message's line once per block (issue 23, item 5)
    for res in replay_thread(rows, [0] * len(rows), infos, target, materialize=lambda kk, p: kk == k):
        if res.call == k:
            assert res.request_json is not None
            return res.request_json
    raise StoreError(f"thread '{key}': call {k} not found")


def request(out_dir: Path, key: str, call: int | None = None, target: str | None = None) -> dict[str, Any]:
    """One call's request as a dict (see request_json)."""
    return orjson.loads(request_json(out_dir, key, call, target))


def iter_call_lists(rows: pl.DataFrame) -> Iterator[tuple[str, int, list[str], str]]:
    """(thread_key, call, message sha256 in order, envelope sha256) of every call, thread by
    thread and call by call, from call_messages rows: a walk over the rows' starts and ends (each
    call's list is materialised, so the walk costs what the lists hold, and the rows no more)."""
    starts: dict[tuple[str, int], list[tuple[int | None, str]]] = defaultdict(list)
    ends: dict[tuple[str, int], list[int | None]] = defaultdict(list)
    pending: dict[str, int] = {}
    for key, slot, first, last, sha in rows.select("thread_key", "slot", "first_call", "last_call", "sha256").iter_rows():
        starts[(key, first)].append((slot, sha))
        ends[(key, last)].append(slot)
        pending[key] = max(pending.get(key, 0), last - 1)
    for key in sorted(pending):
        slots: list[int] = []
        sha_at: dict[int, str] = {}
        env = ""
        for k in range(pending[key] + 1):
            for slot in ends.get((key, k), ()):
                if slot is not None:
                    del slots[bisect.bisect_left(slots, slot)]
                    del sha_at[slot]
            for slot, sha in starts.get((key, k), ()):
                if slot is None:
                    env = sha
                else:
                    bisect.insort(slots, slot)
                    sha_at[slot] = sha
            yield key, k, [sha_at[s] for s in slots], env


def iter_request_json(out_dir: Path) -> Iterator[tuple[str, int, bytes]]:
    """(thread_key, call, canonical JSON) of every call of a run (a branch's inherited calls too),
    rebuilt from the store of the run OUT shows."""
    out_dir = run_dir(out_dir)
    rows = read_call_messages(out_dir)
    msgs = pq.read_table(_need(out_dir, MESSAGES_FILE), columns=["sha256", "canonical_json"])
    data = dict(zip(msgs.column("sha256").to_pylist(), msgs.column("canonical_json").to_pylist(), strict=True))
    list_key = rows.get_column("list_key")[0] if rows.height else "messages"
    for key, k, shas, env in iter_call_lists(rows):
        yield key, k, request_bytes(list_key, [data[s] for s in shas], data[env])


def call_message_frame(out_dir: Path, key: str, call: int | None = None) -> pl.DataFrame:
    """Call k's messages in request order: position, sha256, role, n_blocks, tokens and cum_tokens
    (the tokens of messages 0..position, each with its MESSAGE_OVERHEAD_TOKENS)."""
    out_dir = run_dir(out_dir)
    _, held = _at_call(read_call_messages(out_dir, key), key, call)
    order = held.filter(pl.col("slot").is_not_null()).select("sha256").with_row_index("position")
    info = pl.read_parquet(_need(out_dir, MESSAGES_FILE), columns=["sha256", "role", "n_blocks", "tokens"])
    return order.join(info, on="sha256", how="left").sort("position").with_columns(
        cum_tokens=(pl.col("tokens") + MESSAGE_OVERHEAD_TOKENS).cum_sum())
