"""Lines that could not be understood: kept whole, with where and why."""

from __future__ import annotations

import pyarrow as pa

QUARANTINE = pa.schema(
    [
        pa.field("file", pa.string(), nullable=False),
        pa.field("line", pa.int64(), nullable=False),  # 1-based physical line
        pa.field("raw", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
    ],
    metadata={"name": "quarantine", "version": "1"},
)
