"""The `ctxreplay` command line: the click group and the run / inspection commands (`cli`), the
regression commands (`cli_regress`), the cost commands (`cli_report`), and what they share
(`clicommon`).

Importing it (before pyarrow is) makes Arrow's allocator give freed memory back to the system at once
(`MIMALLOC_PURGE_DELAY=0`, unless the environment sets it; worker processes inherit it): a command's
peak memory then follows what it holds, not what it held a moment ago (issue 23, item 6: a run
reading a 200 MB tool result peaked at 1.38 and 1.50 GB without it, 1.36 GB with it;
bench/bench_memory.py)."""

import os

os.environ.setdefault("MIMALLOC_PURGE_DELAY", "0")
