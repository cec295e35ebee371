"""The request store: every distinct wire message once (MESSAGES), and which message holds which
place of which call's request (CALL_MESSAGES, one row per stretch of calls). Call k's request is
rebuilt byte-identically from them: `{"<list_key>":[` + the canonical JSON of the messages whose
rows hold call k (first_call <= k < last_call), by slot, joined by `,` + `],` + its envelope's
canonical JSON without the opening `{` (or `]}` for an empty envelope); see pipeline/assembly/store.py."""

from __future__ import annotations

import pyarrow as pa

MESSAGES = pa.schema(
    [
        pa.field("sha256", pa.string(), nullable=False),  # of canonical_json (hex)
        pa.field("kind", pa.string(), nullable=False),  # "message" (a wire message) or "envelope" (a request's other keys)
        pa.field("role", pa.string()),  # wire role (user, assistant, tool, system, model, developer); null: envelope
        pa.field("n_blocks", pa.int32(), nullable=False),  # content blocks (envelope: system text blocks)
        pa.field("tokens", pa.int64(), nullable=False),  # estimated tokens of the block rows it sends, no overhead
        pa.field("canonical_json", pa.binary(), nullable=False),  # sorted keys, UTF-8, no insignificant whitespace
    ],
    metadata={"name": "messages", "version": "1"},
)

CALL_MESSAGES = pa.schema(
    [
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("thread_id", pa.string(), nullable=False),
        pa.field("thread_key", pa.string(), nullable=False),
        # the message's place in the requests: ascending = request order (negative: a target's
        # stand-in for a request with no recorded message); null: the row is the envelope's
        pa.field("slot", pa.int64()),
        pa.field("first_call", pa.int32(), nullable=False),  # first call whose request holds it there
        pa.field("last_call", pa.int32(), nullable=False),  # first call that no longer does (pending call + 1: none)
        pa.field("sha256", pa.string(), nullable=False),  # MESSAGES.sha256
        pa.field("target", pa.string(), nullable=False),  # the wire shape the run replayed for
        pa.field("list_key", pa.string(), nullable=False),  # the request's message list key ("messages", ...)
    ],
    metadata={"name": "call_messages", "version": "1"},
)
