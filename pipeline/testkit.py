"""Helpers for stage tests and golden cases (also for third-party stage authors).

`make_blocks` builds a blocks frame from a short message-level description, so tests state only
what matters; `run_stage` runs one registered stage with params given as a dict.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

import polars as pl

from pipeline.blockops import empty_decisions
from pipeline.loaders.base import Block, Compaction, Message, Thread, json_text, threads_to_blocks
from pipeline.registry import StageContext, StageResult, get_stage
from pipeline.spec import resolve_params
from schemas.check import check_frame
from schemas.blocks import BLOCKS
from schemas.decisions import STAGE_DECISION

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

# Columns shown in golden files and in compact test comparisons.
VIEW = [
    "session_id", "thread_id", "entry_id", "order_key", "role", "block_pos", "part_pos", "first_call",
    "last_call", "block_type", "part_type", "text", "signature", "tool_use_id", "tool_name", "tool_input",
    "is_error", "image_media_type", "image_width", "image_height", "origin",
]


def _block(b: Mapping[str, Any]) -> Block:
    b = dict(b)
    if "tool_input" in b and not isinstance(b["tool_input"], str) and b["tool_input"] is not None:
        b["tool_input"] = json_text(b["tool_input"])
    if "type" in b:
        b["block_type"] = b.pop("type")
    return Block(**b)


def make_thread(messages: Iterable[Mapping[str, Any]], *, session_id: str = "s1", thread_id: str = "main",
                compactions: Iterable[tuple[int, int]] = ()) -> Thread:
    """Messages as dicts: role, blocks (list of Block fields; `type` = block_type) or text, and any
    Message field (timestamp may be seconds after T0)."""
    msgs = []
    for i, m in enumerate(messages):
        m = dict(m)
        blocks = [_block(b) for b in m.pop("blocks", [])]
        if "text" in m:
            blocks.insert(0, Block("text", text=m.pop("text")))
        ts = m.pop("timestamp", i)
        if isinstance(ts, (int, float)):
            ts = T0 + timedelta(seconds=ts)
        entry_id = m.pop("entry_id", f"e{i:04d}")
        msgs.append(Message(entry_id=entry_id, role=m.pop("role"), blocks=blocks, source_file="test.jsonl",
                            source_line=i + 1, raw_line="{}", timestamp=ts, **m))
    return Thread(session_id, thread_id, "test", "test.jsonl", msgs,
                  [Compaction(at, keep) for at, keep in compactions])


def make_blocks(messages: Iterable[Mapping[str, Any]], **kw: Any) -> pl.LazyFrame:
    return pl.from_arrow(threads_to_blocks([make_thread(messages, **kw)])).lazy()  # type: ignore[union-attr]


def run_stage(name: str, blocks: pl.LazyFrame, params: Mapping[str, Any] | None = None, *,
              ledger: pl.LazyFrame | None = None, ctx: StageContext | None = None) -> StageResult:
    """Run one stage and check both outputs against their schemas."""
    st = get_stage(name)
    p = resolve_params(st, dict(params or {}), where=f"test ({name})")
    res = st.fn(blocks, p, ledger if ledger is not None else empty_decisions(), ctx or StageContext())
    check_frame(res.blocks, BLOCKS, where=f"after stage '{name}'")
    check_frame(res.decisions, STAGE_DECISION, where=f"decisions of stage '{name}'")
    return res


def view(blocks: pl.LazyFrame | pl.DataFrame) -> pl.DataFrame:
    df = blocks.collect() if isinstance(blocks, pl.LazyFrame) else blocks
    return df.select(VIEW).sort(["session_id", "thread_id", "order_key", "block_pos", "part_pos", "first_call"])


def visible(blocks: pl.LazyFrame | pl.DataFrame, call: int) -> pl.DataFrame:
    """The block versions that call `call` sees, in order."""
    df = blocks.collect() if isinstance(blocks, pl.LazyFrame) else blocks
    return view(df.filter((pl.col("first_call") <= call) & (pl.col("last_call").is_null() | (pl.col("last_call") > call))))
