"""Lines that could not be understood: kept whole, with where and why.

`raw` is always displayable text: a line holding bytes that are not UTF-8 shows each of them as a
`\\xNN` escape, and its exact bytes are kept (base64) in `raw_base64`, null for every other line.
`code` is a stable short name of the reason (e.g. `invalid_utf8`, `truncated_json`, `no_type`; the
list is `ctxreplay.pipeline.loaders.base.QUARANTINE_CODES`); `reason` says it in a sentence.
A line longer than the limit (`--max-line-bytes`) is not read: `raw` holds its first 1024 bytes and
`line_bytes` its length (null for every other line, which `raw` holds whole).
"""

from __future__ import annotations

import pyarrow as pa

QUARANTINE = pa.schema(
    [
        pa.field("file", pa.string(), nullable=False),
        pa.field("line", pa.int64(), nullable=False),  # 1-based physical line
        pa.field("raw", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("code", pa.string(), nullable=False),
        pa.field("raw_base64", pa.string()),  # the exact bytes, only for lines that are not UTF-8
        pa.field("line_bytes", pa.int64()),  # the line's length, only when `raw` holds its start (line_too_long)
    ],
    metadata={"name": "quarantine", "version": "3"},
)
