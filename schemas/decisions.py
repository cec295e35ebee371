"""The ledger's decision row: from call `from_call` on, a block was replaced / dropped / inserted."""

from __future__ import annotations

import pyarrow as pa

# What a stage returns (the runner adds spec_sha256, stage, stage_version, seq).
STAGE_DECISION = pa.schema(
    [
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("thread_id", pa.string(), nullable=False),
        pa.field("entry_id", pa.string(), nullable=False),
        pa.field("block_pos", pa.int32(), nullable=False),
        pa.field("part_pos", pa.int32(), nullable=False),
        pa.field("tool_use_id", pa.string()),
        pa.field("from_call", pa.int32(), nullable=False),
        # replace | drop | insert | move | annotate | move_envelope | truncate | spill | snip |
        # tombstone | clear_input | conflict | violation
        pa.field("action", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("before_sha256", pa.string()),
        pa.field("after_sha256", pa.string()),
        pa.field("before_len", pa.int64()),
        pa.field("after_len", pa.int64()),
        pa.field("replacement", pa.string()),  # canonical JSON of the new block (null for drop)
        pa.field("cache_epoch", pa.int32(), nullable=False),
    ],
    metadata={"name": "stage_decision", "version": "1"},
)

DECISIONS = pa.schema(
    [
        pa.field("spec_sha256", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("stage", pa.string(), nullable=False),
        pa.field("stage_version", pa.int32(), nullable=False),
        pa.field("config_digest", pa.string(), nullable=False),  # sha256 of the stage's resolved params
        *STAGE_DECISION,
    ],
    metadata={"name": "decisions", "version": "1"},
)

DECISION_KEY = ["session_id", "thread_id", "entry_id", "block_pos", "part_pos", "from_call", "action"]
