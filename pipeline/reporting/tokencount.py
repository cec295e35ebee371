"""One token count of a usage record, as `report` reads it in every format: a whole number of tokens,
0 for anything else (a missing field, a string, a negative or non-finite number; a positive float is
truncated). Standard library only, like the rest of `report`'s readers."""

from __future__ import annotations

import math
from typing import Any


def token_count(v: Any) -> int:
    if type(v) is int:
        return max(v, 0)
    if isinstance(v, float) and math.isfinite(v) and v > 0:
        return int(v)
    return 0
