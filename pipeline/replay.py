"""Replay: assemble each call's request from the final blocks, hash it, measure it — in linear time.

Call k of a thread sees the block versions with first_call <= k < last_call. Between consecutive
calls only the rows that start or end there change, almost always by appending, so the replay
keeps the visible rows, the logical messages, the wire messages and the running sha256 state
after each wire message, and redoes only the tail that changed. The canonical JSON of a request
puts its message list first (its key sorts first), so `sha256(request)` is the saved state of the
unchanged prefix, updated with the new tail and the envelope. Materialising every request is
quadratic in size; by default only the pending request is built, any other on demand.
"""

from __future__ import annotations

import bisect
import hashlib
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import polars as pl

from pipeline.blockops import canonical_json, sort_blocks
from pipeline.targets import LogicalMessage, Target

MESSAGE_OVERHEAD_TOKENS = 3
REQUEST_OVERHEAD_TOKENS = 3

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")

ROW_COLUMNS = [
    "msg_key", "role", "block_pos", "part_pos", "block_type", "part_type", "text", "signature",
    "tool_use_id", "tool_name", "tool_input", "is_error", "image_media_type", "image_data", "extra_json",
    "first_call", "last_call", "timestamp",
]


KEY_MAX = 200  # bytes of a key's readable part: `requests/<key>.jsonl` stays under 255 bytes
_PLAIN_SESSION = re.compile(r"[a-z0-9][a-z0-9._-]*")
_PLAIN_THREAD = re.compile(r"[a-z0-9][a-z0-9._-]*")


def thread_key(session_id: str, thread_id: str) -> str:
    """The thread's name in outputs and file names (`requests/<key>.json`).

    Plain ids give `<session_id>` for a main thread, else `<session_id>--<thread_id>`. Any other
    id (characters outside `[a-z0-9._-]`, uppercase, a `--` inside the session id, a leading dot
    or dash, an empty or very long id: `..`, `a/b`, a NUL, 300 bytes) gives the readable form with
    every character outside `[A-Za-z0-9._-]` replaced by `_`, cut to KEY_MAX characters, then `~`
    and 16 hex digits of the sha256 of the two ids. So a key is always a safe file name under 255
    bytes, and two threads never share one (not even on a case-insensitive file system): plain
    keys hold no `~` and decode back to their ids, the others carry the ids' hash."""
    readable = session_id if thread_id == "main" else f"{session_id}--{thread_id}"
    if (len(readable) <= KEY_MAX and _PLAIN_SESSION.fullmatch(session_id) and "--" not in session_id
            and (thread_id == "main" or _PLAIN_THREAD.fullmatch(thread_id))):
        return readable
    digest = hashlib.sha256(f"{session_id}\0{thread_id}".encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{_UNSAFE.sub('_', readable)[:KEY_MAX]}~{digest}"


def _thread_keys(s: pl.Series) -> pl.Series:
    ids = s.struct.unnest()
    uniq = ids.unique()
    keys = [None if a is None or b is None else thread_key(a, b)
            for a, b in zip(uniq.get_column("session_id").to_list(), uniq.get_column("thread_id").to_list())]
    uniq = uniq.with_columns(_key=pl.Series(keys, dtype=pl.String))
    return ids.join(uniq, on=["session_id", "thread_id"], how="left", nulls_equal=True,
                    maintain_order="left").get_column("_key")


def thread_key_expr() -> pl.Expr:
    """thread_key as a column expression (over session_id, thread_id; one Python call per thread)."""
    return pl.struct("session_id", "thread_id").map_batches(_thread_keys, return_dtype=pl.String,
                                                            is_elementwise=True)


@dataclass
class CallInfo:
    """What the replay needs of recorded call k: its index and the model it asked."""

    call: int
    model: str | None = None


@dataclass
class CallResult:
    call: int
    is_pending: bool
    request_sha256: str
    n_messages: int
    prompt_tokens: int
    prefix_break_message: int | None
    timestamp: Any
    model: str | None
    request: dict[str, Any] | None  # materialised when asked for


def _envelope_bytes(env: dict[str, Any], list_key: str) -> bytes:
    for k in env:
        if k <= list_key:
            raise ValueError(f"target envelope key '{k}' must sort after the list key '{list_key}'")
    if not env:
        return b"]}"
    return b"]," + canonical_json(env)[1:]


def replay_thread(
    rows: list[dict[str, Any]],
    tokens: list[int],
    calls: list[CallInfo],
    target: Target,
    *,
    materialize: Callable[[int, bool], bool] = lambda k, pending: pending,
    only_call: int | None = None,
) -> Iterator[CallResult]:
    """Yield one CallResult per call 0..n (n = pending) of one thread.

    `rows` are the thread's block versions sorted by (order_key, block_pos, part_pos, first_call);
    `tokens[i]` is row i's token estimate; `calls[k]` what was recorded for call k.
    """
    n_calls = len(calls)
    add_at: dict[int, list[int]] = defaultdict(list)
    rem_at: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        fc, lc = r["first_call"], r["last_call"]
        if lc is not None and lc <= fc:
            continue
        add_at[fc].append(i)
        if lc is not None:
            rem_at[lc].append(i)
    list_key = target.list_key
    split_system = target.splits_system()
    vis: list[int] = []
    logical: list[LogicalMessage] = []
    log_first: list[int] = []  # position in `vis` where each logical message starts
    system_rows: list[int] = []
    wire: list[tuple[int, bytes, dict[str, Any]]] = []  # (first logical index, canonical bytes, message)
    wire_first: list[int] = []  # wire[j][0], kept alongside for bisect
    states = [hashlib.sha256(b'{"' + list_key.encode() + b'":[')]
    tok_sum = 0
    last_ts = None
    for k in range(n_calls + 1):
        added = sorted(add_at.get(k, ()))
        removed = rem_at.get(k, ())
        tok_sum += sum(tokens[i] for i in added) - sum(tokens[i] for i in removed)
        sys_added = [i for i in added if split_system and rows[i]["role"] == "system"]
        if split_system:
            added = [i for i in added if rows[i]["role"] != "system"]
        rem_sys = {i for i in removed if split_system and rows[i]["role"] == "system"}
        if rem_sys or sys_added:
            system_rows = sorted([i for i in system_rows if i not in rem_sys] + sys_added)
        removed_set = {i for i in removed if i not in rem_sys}
        change_pos: int | None = None
        if removed_set or (added and vis and added[0] < vis[-1]):
            lo = min(list(removed_set) + added)
            p = bisect.bisect_left(vis, lo)
            tail = sorted([i for i in vis[p:] if i not in removed_set] + added)
            vis = vis[:p] + tail
            change_pos = p
        elif added:
            change_pos = len(vis)
            vis.extend(added)
        prefix_break: int | None = None
        if change_pos is not None:
            li = max(bisect.bisect_right(log_first, change_pos) - 1, 0) if logical else 0
            # a row appended to the last message (same msg_key) belongs to it: rebuild from there
            start_vis = log_first[li] if logical else 0
            del logical[li:]
            del log_first[li:]
            for pos in range(start_vis, len(vis)):
                r = rows[vis[pos]]
                if logical and logical[-1].msg_key == r["msg_key"] and log_first[-1] >= start_vis:
                    logical[-1].rows.append(r)
                else:
                    logical.append(LogicalMessage(r["role"], [r], r["msg_key"]))
                    log_first.append(pos)
            # wire messages: redo from the one holding logical message li-1 (it may merge with li)
            a = max(li - 1, 0)
            wj = max(bisect.bisect_right(wire_first, a) - 1, 0) if wire else 0
            old_tail = wire[wj:]
            shape_from = old_tail[0][0] if old_tail else 0
            del wire[wj:]
            del wire_first[wj:]
            del states[wj + 1:]
            new = target.shape(logical, shape_from) if shape_from < len(logical) else []
            for j, (first, msg) in enumerate(new):
                b = canonical_json(msg)
                idx = wj + j
                if prefix_break is None and idx < wj + len(old_tail) and old_tail[j][1] != b:
                    prefix_break = idx
                h = states[-1].copy()
                h.update((b"," if idx > 0 else b"") + b)
                states.append(h)
                wire.append((first, b, msg))
                wire_first.append(first)
            if prefix_break is None and len(old_tail) > len(new):
                prefix_break = wj + len(new)
        if vis:
            ts = rows[vis[-1]]["timestamp"]
            last_ts = ts if ts is not None else last_ts
        if only_call is not None and k != only_call:
            continue
        info = calls[k] if k < n_calls else None
        model = info.model if info else (calls[-1].model if calls else None)
        system = _system_messages(rows, system_rows) if split_system else []
        env = target.envelope(model, system)
        stand_in: list[dict[str, Any]] = []
        if not wire:
            # nothing recorded before this call (a history that starts with the assistant): the
            # target's stand-in turn keeps the request valid
            stand_in = target.empty_messages()
            h = states[0].copy()
            h.update(b",".join(canonical_json(m) for m in stand_in))
        else:
            h = states[-1].copy()
        h.update(_envelope_bytes(env, list_key))
        request = None
        if materialize(k, k == n_calls):
            request = {list_key: [w[2] for w in wire] or stand_in, **env}
            full = hashlib.sha256(canonical_json(request)).hexdigest()
            if full != h.hexdigest():  # the incremental hash must equal the full one
                raise AssertionError(f"incremental request hash mismatch at call {k}")
        yield CallResult(
            call=k,
            is_pending=k == n_calls,
            request_sha256=h.hexdigest(),
            n_messages=len(wire) or len(stand_in),
            prompt_tokens=tok_sum + MESSAGE_OVERHEAD_TOKENS * (len(wire) or len(stand_in)) + REQUEST_OVERHEAD_TOKENS,
            prefix_break_message=prefix_break,
            timestamp=last_ts,
            model=model,
            request=request,
        )


def _system_messages(rows: list[dict[str, Any]], idx: list[int]) -> list[LogicalMessage]:
    out: list[LogicalMessage] = []
    for i in idx:
        r = rows[i]
        if out and out[-1].msg_key == r["msg_key"]:
            out[-1].rows.append(r)
        else:
            out.append(LogicalMessage("system", [r], r["msg_key"]))
    return out


def call_skeleton(blocks: pl.DataFrame) -> pl.DataFrame:
    """One row per recorded call (assistant message with is_call), from the loaded blocks."""
    return (
        blocks.filter(pl.col("is_call"))
        .group_by("session_id", "thread_id", "msg_key")
        .agg(
            call=(pl.col("first_call").min() - 1).cast(pl.Int32),
            model=pl.col("model").first(),
            message_id=pl.col("message_id").first(),
            request_id=pl.col("request_id").first(),
            usage_input=pl.col("usage_input").first(),
            usage_output=pl.col("usage_output").first(),
            usage_cache_read=pl.col("usage_cache_read").first(),
            usage_cache_write=pl.col("usage_cache_write").first(),
            usage_cache_write_5m=pl.col("usage_cache_write_5m").first(),
            usage_cache_write_1h=pl.col("usage_cache_write_1h").first(),
        )
        .sort("session_id", "thread_id", "call")
    )


def thread_calls(skeleton: pl.DataFrame) -> dict[tuple[str, str], list[CallInfo]]:
    out: dict[tuple[str, str], list[CallInfo]] = defaultdict(list)
    for sid, tid, call, model in skeleton.select("session_id", "thread_id", "call", "model").iter_rows():
        out[(sid, tid)].append(CallInfo(call, model))
    for key, lst in out.items():
        lst.sort(key=lambda c: c.call)
        if [c.call for c in lst] != list(range(len(lst))):
            raise AssertionError(f"calls of thread {key} are not numbered 0..n-1: {[c.call for c in lst][:10]}")
    return out


def thread_rows(blocks: pl.DataFrame) -> Iterator[tuple[tuple[str, str], pl.DataFrame]]:
    """The blocks of each thread, sorted for replay (stable across runs: keys only)."""
    df = sort_blocks(blocks.lazy()).collect()
    for key, part in df.group_by(["session_id", "thread_id"], maintain_order=True):
        yield (str(key[0]), str(key[1])), part
