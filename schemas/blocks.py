"""The blocks table: one row per content block of every message of every thread.

A row is one *version* of a block: `first_call` (inclusive) and `last_call` (exclusive, null =
open) say which calls of its thread see this version. Loaders emit one version per block; a stage
that changes a block from call k on closes the old version at k and adds a new one from k.

Key of a version: (session_id, thread_id, entry_id, block_pos, part_pos, first_call).
Raw columns (`raw_line`, `source_*`, `entry_order`, recorded usage) are never overwritten.
"""

from __future__ import annotations

import pyarrow as pa

TS = pa.timestamp("ms", tz="UTC")

BLOCKS = pa.schema(
    [
        # where it came from
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("thread_id", pa.string(), nullable=False),
        pa.field("source_format", pa.string(), nullable=False),
        pa.field("source_file", pa.string(), nullable=False),
        pa.field("source_line", pa.int64(), nullable=False),  # 1-based physical line
        # never overwritten; a view type: the blocks of one line share its bytes, so a message of N
        # blocks costs its line once, not N times (issue 23, item 5); String in polars, string on disk
        pa.field("raw_line", pa.string_view(), nullable=False),
        # message identity and order
        pa.field("entry_order", pa.int64(), nullable=False),  # message position in its thread (raw)
        pa.field("order_key", pa.int64(), nullable=False),  # working order; stages may move/insert
        pa.field("entry_id", pa.string(), nullable=False),
        pa.field("parent_id", pa.string()),
        pa.field("msg_key", pa.string(), nullable=False),  # blocks with one msg_key form one message
        pa.field("message_id", pa.string()),  # provider message id (msg_..., resp id)
        pa.field("request_id", pa.string()),
        pa.field("role", pa.string(), nullable=False),  # system | user | assistant | tool
        pa.field("is_call", pa.bool_(), nullable=False),  # assistant message that is a call of this thread
        pa.field("first_call", pa.int32(), nullable=False),  # first call whose request holds this version
        pa.field("last_call", pa.int32()),  # first call that no longer holds it (null: open)
        # the block
        pa.field("block_pos", pa.int32(), nullable=False),
        pa.field("part_pos", pa.int32(), nullable=False),  # part within a tool_result's content list
        pa.field("block_type", pa.string(), nullable=False),
        pa.field("part_type", pa.string()),  # tool_result parts: string | text | image | tool_reference | empty
        pa.field("text", pa.string()),
        pa.field("signature", pa.string()),  # thinking signature
        pa.field("tool_use_id", pa.string()),
        pa.field("tool_name", pa.string()),
        pa.field("tool_input", pa.string()),  # raw JSON text, never re-parsed into structs
        pa.field("is_error", pa.bool_()),
        pa.field("image_media_type", pa.string()),
        pa.field("image_bytes", pa.int64()),  # decoded size
        pa.field("image_width", pa.int32()),
        pa.field("image_height", pa.int32()),
        pa.field("image_data", pa.string()),  # base64, no data: prefix
        pa.field("extra_json", pa.string()),  # other keys of the block (details, cache_control, ...)
        # message metadata
        pa.field("timestamp", TS),
        pa.field("model", pa.string()),
        pa.field("provider", pa.string()),
        pa.field("api", pa.string()),
        pa.field("stop_reason", pa.string()),
        pa.field("usage_input", pa.int64()),
        pa.field("usage_output", pa.int64()),
        pa.field("usage_cache_read", pa.int64()),
        pa.field("usage_cache_write", pa.int64()),
        pa.field("usage_cache_write_5m", pa.int64()),
        pa.field("usage_cache_write_1h", pa.int64()),
        # the provider's own cache diagnosis of the request (Anthropic `diagnostics.cache_miss_reason`,
        # recorded by Claude Code 2.1.140+): its `type` as written (model_changed, system_changed,
        # tools_changed, messages_changed, previous_message_not_found, unavailable, or a later one)
        # and `cache_missed_input_tokens`; null when the answer records no diagnosis
        pa.field("cache_miss_reason", pa.string()),
        pa.field("cache_missed_tokens", pa.int64()),
        # normalised usage (sanitize §3.8; null until a pipeline normalises it): missing = 0, the
        # largest copy of a split message, u_total = their sum; usage_stale: an assistant row
        # before the latest compaction summary (its usage describes a context that is gone)
        pa.field("u_input", pa.int64()),
        pa.field("u_output", pa.int64()),
        pa.field("u_cache_read", pa.int64()),
        pa.field("u_cache_write", pa.int64()),
        pa.field("u_total", pa.int64()),
        pa.field("usage_stale", pa.bool_()),
        pa.field("is_sidechain", pa.bool_(), nullable=False),
        pa.field("is_meta", pa.bool_(), nullable=False),
        pa.field("is_compact_summary", pa.bool_(), nullable=False),
        pa.field("is_display_only", pa.bool_(), nullable=False),
        pa.field("provenance_kind", pa.string()),
        pa.field("provenance_source_session", pa.string()),
        pa.field("provenance_channel", pa.string()),
        pa.field("provenance_tool", pa.string()),
        # bookkeeping
        pa.field("content_sha256", pa.string(), nullable=False),  # sha256 of the block's canonical JSON
        pa.field("origin", pa.string(), nullable=False),  # transcript | <stage name> for inserted rows
        pa.field("cache_epoch", pa.int32(), nullable=False),
    ],
    metadata={"name": "blocks", "version": "2"},
)

KEY = ["session_id", "thread_id", "entry_id", "block_pos", "part_pos", "first_call"]

# Columns that describe the content of a block (what content_sha256 covers).
CONTENT_COLUMNS = [
    "block_type",
    "part_type",
    "text",
    "signature",
    "tool_use_id",
    "tool_name",
    "tool_input",
    "is_error",
    "image_media_type",
    "image_data",
]
