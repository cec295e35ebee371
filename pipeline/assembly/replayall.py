"""Replay every thread of a batch: the calls table, the violations of the validated requests and the
request store's tables (the batch runner calls it once per batch, after the stages)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from ctxreplay.pipeline.assembly.replay import (
    ROW_COLUMNS,
    MessageStore,
    SpanLog,
    replay_thread,
    thread_calls,
    thread_key,
    thread_rows,
)
from ctxreplay.pipeline.assembly.store import store_tables
from ctxreplay.pipeline.core.progress import Progress
from ctxreplay.pipeline.core.tokens import TokenCounter, row_tokens
from ctxreplay.pipeline.targets import Violation, get_target
from ctxreplay.schemas.calls import CALLS
from ctxreplay.schemas.check import polars_schema


def replay_all(blocks: pl.DataFrame, skeleton: pl.DataFrame, target_name: str, counter: TokenCounter, *,
               all_calls: bool, validate: bool, out_dir: Path | None,
               progress: Progress | None = None,
               counts: dict[tuple[str, str], int] | None = None) -> tuple[pl.DataFrame, list[Violation], dict[str, Any]]:
    """Replay every thread: the calls frame (CALLS), the violations of the validated requests (the
    pending ones; every call with all_calls) and stats, whose `store_tables` are the request store
    (messages.parquet, call_messages.parquet: every call's request, a branch's inherited calls too;
    see pipeline/assembly/store.py). `counts` (calls per thread, inherited ones included) lets a branch walk
    its shared history's calls without reporting them. Under out_dir it writes requests/ (the
    pending request of each thread; with all_calls every reported call's, as JSONL)."""
    target = get_target(target_name)
    calls_by_thread = thread_calls(skeleton, counts)
    blocks = blocks.with_columns(_tok=row_tokens(blocks, counter))
    req_dir = out_dir / "requests" if out_dir else None
    if req_dir:
        req_dir.mkdir(parents=True, exist_ok=True)
    store = MessageStore()
    spans = SpanLog()
    rows_out: list[dict[str, Any]] = []
    violations: list[Violation] = []
    threads = 0
    for (sid, tid), part in thread_rows(blocks):
        threads += 1
        key = thread_key(sid, tid)
        calls = calls_by_thread.get((sid, tid), [])
        rows = part.select(ROW_COLUMNS).to_dicts()
        toks = part.get_column("_tok").to_list()
        spans.begin_thread(sid, tid, key)
        reported = [c.reported for c in calls]
        with contextlib.ExitStack() as stack:
            jsonl = stack.enter_context(open(req_dir / f"{key}.jsonl", "wb")) if (req_dir and all_calls) else None
            for res in replay_thread(rows, toks, calls, target, store=store, spans=spans,
                                     materialize=lambda k, pending, rep=reported: pending or (all_calls and rep[k])):
                if not res.is_pending and not calls[res.call].reported:
                    continue  # an inherited call: its own thread reports it
                rows_out.append({
                    "session_id": sid, "thread_id": tid, "thread_key": key, "call": res.call,
                    "is_pending": res.is_pending, "awaits_user": res.awaits_user, "timestamp": res.timestamp,
                    "model": res.model, "request_sha256": res.request_sha256, "n_messages": res.n_messages,
                    "prompt_tokens": res.prompt_tokens, "prefix_break_message": res.prefix_break_message,
                })
                if res.request is not None:
                    if validate:
                        violations.extend(target.validate(res.request, thread_key=key, call=res.call,
                                                          awaits_user=res.awaits_user))
                    if jsonl is not None:
                        assert res.request_json is not None
                        jsonl.write(b'{"call":%d,"request":%s}\n' % (res.call, res.request_json))
                    if res.is_pending and req_dir:
                        (req_dir / f"{key}.json").write_bytes(
                            orjson.dumps(res.request, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n")
        if progress and threads % 20 == 0:
            progress(f"replayed {threads} threads")
    # what the transcript recorded about each call (its answer), by one join on the call skeleton
    recorded = skeleton.select(
        "session_id", "thread_id", "call", "message_id", "request_id",
        recorded_input_tokens="usage_input", recorded_output_tokens="usage_output",
        recorded_cache_read_tokens="usage_cache_read", recorded_cache_write_tokens="usage_cache_write",
        recorded_cache_write_5m_tokens="usage_cache_write_5m", recorded_cache_write_1h_tokens="usage_cache_write_1h",
        recorded_miss_reason="cache_miss_reason", recorded_missed_tokens="cache_missed_tokens")
    replayed = pl.DataFrame(rows_out, schema={k: v for k, v in polars_schema(CALLS).items() if k not in recorded.columns
                                              or k in ("session_id", "thread_id", "call")})
    calls_df = replayed.join(recorded, on=["session_id", "thread_id", "call"], how="left").select(CALLS.names)
    n_messages = sum(k == "message" for k in store.kind)
    stats = {"threads": threads, "request_store": {
        "messages": n_messages, "envelopes": len(store) - n_messages, "call_message_rows": len(spans),
        "bytes": sum(map(len, store.data)), "token_conflicts": store.token_conflicts},
        "store_tables": store_tables(store, spans, target.name, target.list_key)}
    return calls_df, violations, stats
