"""One row per call (model request) of every thread."""

from __future__ import annotations

import pyarrow as pa

from ctxreplay.schemas.blocks import TS

CALLS = pa.schema(
    [
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("thread_id", pa.string(), nullable=False),
        pa.field("thread_key", pa.string(), nullable=False),
        pa.field("call", pa.int32(), nullable=False),  # 0-based
        pa.field("is_pending", pa.bool_(), nullable=False),
        # the pending request ends with the assistant's answer: the thread awaits the user's next
        # message, and a trailing assistant message is what a resumed session carries, not a prefill
        pa.field("awaits_user", pa.bool_(), nullable=False),
        pa.field("timestamp", TS),  # time of the row that starts the request (pending: last row)
        pa.field("model", pa.string()),
        pa.field("message_id", pa.string()),  # the answer's provider message id (null for pending)
        pa.field("request_id", pa.string()),
        pa.field("request_sha256", pa.string(), nullable=False),
        pa.field("n_messages", pa.int32(), nullable=False),
        pa.field("prompt_tokens", pa.int64(), nullable=False),
        pa.field("prefix_break_message", pa.int32()),  # first message index that differs from the previous call
        pa.field("recorded_input_tokens", pa.int64()),
        pa.field("recorded_output_tokens", pa.int64()),
        pa.field("recorded_cache_read_tokens", pa.int64()),
        pa.field("recorded_cache_write_tokens", pa.int64()),
        pa.field("recorded_cache_write_5m_tokens", pa.int64()),
        pa.field("recorded_cache_write_1h_tokens", pa.int64()),
        # the server's own diagnosis of why the request did not reuse the previous one's cache
        # (Anthropic `diagnostics.cache_miss_reason.type`, unknown later types kept as written) and
        # the tokens it says were missed; null where the answer records none
        pa.field("recorded_miss_reason", pa.string()),
        pa.field("recorded_missed_tokens", pa.int64()),
        # cost and prompt cache (pipeline/cost/cachesim.py, pipeline/cost/calibrate.py, pipeline/cost/breaks.py);
        # null for the pending call; costs null where the model has no price
        pa.field("preamble_tokens", pa.int64()),  # calibrated tokens the transcript does not hold (system, tools, injected)
        pa.field("calibrated_prompt_tokens", pa.int64()),  # preamble + ratio × prompt_tokens: the provider's count
        pa.field("sim_cache_read_tokens", pa.int64()),
        pa.field("sim_cache_write_5m_tokens", pa.int64()),
        pa.field("sim_cache_write_1h_tokens", pa.int64()),
        pa.field("sim_input_tokens", pa.int64()),  # uncached prompt tokens (Anthropic's meaning)
        pa.field("sim_cost_usd", pa.float64()),  # simulated usage + recorded output, priced
        pa.field("recorded_cost_usd", pa.float64()),  # recorded usage, priced with the same price book
        pa.field("sim_break_cause", pa.string()),  # why the simulated read fell short of the previous prefix
        pa.field("sim_break_detail", pa.string()),
        pa.field("sim_break_tokens", pa.int64()),  # tokens re-written instead of read
        pa.field("sim_break_cost_usd", pa.float64()),  # what the break added to the call's cost
        pa.field("recorded_break_cause", pa.string()),  # the same for the recorded usage (the server's diagnosis where recorded)
        pa.field("recorded_break_inferred_cause", pa.string()),  # our own inference of it, without the server's diagnosis
        pa.field("recorded_break_detail", pa.string()),
        pa.field("recorded_break_tokens", pa.int64()),
        pa.field("recorded_break_cost_usd", pa.float64()),
        # a simulated auto-compaction's own summarisation request, sent before this call (stage
        # auto_compact): the history it reads, the summary it writes; null where there is none
        pa.field("sim_summary_cache_read_tokens", pa.int64()),
        pa.field("sim_summary_cache_write_tokens", pa.int64()),
        pa.field("sim_summary_input_tokens", pa.int64()),
        pa.field("sim_summary_output_tokens", pa.int64()),
        pa.field("sim_summary_cost_usd", pa.float64()),
    ],
    metadata={"name": "calls", "version": "5"},
)
