"""Helpers shared by the CI-regression tests (snapshot, diff, the pytest plugin): the policy they
change between runs (tombstone's `keep_recent`), as a spec template and as a file."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

# sanitize, pairing and a tombstone that fires on the samples; `keep_recent` is what a test changes
POLICY = """\
[pipeline]
name = "policy"

[[stage]]
use = "sanitize"

[[stage]]
use = "pairing"

[[stage]]
use = "tombstone"
trigger_tokens = 50
min_result_chars = 0
clear_at_least_tokens = 0
keep_recent = {keep_recent}
"""


def write_policy(d: Path, keep_recent: int = 2) -> Path:
    """The policy with this `keep_recent`, written as `d/policy-<keep_recent>.toml`."""
    p = d / f"policy-{keep_recent}.toml"
    p.write_text(POLICY.format(keep_recent=keep_recent))
    return p


def rebuild_every_call(g: Any) -> int:
    """Rebuild every call's request of goldens (a snapshot.Golden) from their lists, messages and
    texts, and check its sha256 against calls.jsonl (and the pending one against pending.json);
    returns the number of calls rebuilt."""
    from ctxreplay.pipeline.assembly.replay import request_bytes
    from ctxreplay.pipeline.core.blockops import canonical_json
    from ctxreplay.pipeline.regress.snapshot import read_table

    rebuilt = 0
    for key, info in g.threads.items():
        lists = {k: (shas, env) for k, shas, env in g.call_lists(key)}
        calls = read_table(g.thread_dir(key) / "calls.jsonl")
        assert [c["call"] for c in calls] == list(range(info["first_call"], info["pending_call"] + 1))
        for c in calls:
            shas, env = lists[c["call"]]
            assert env and len(shas) == c["n_messages"]
            data = request_bytes(g.list_key, [g.message(s, key) for s in shas], g.message(env, key))
            assert hashlib.sha256(data).hexdigest() == c["request_sha256"], (key, c["call"])
            rebuilt += 1
        # the pending request: the pending call's request, its texts put back
        assert canonical_json(g.pending_request(key)) == data
    return rebuilt
