"""Helpers shared by the CI-regression tests (snapshot, diff, the pytest plugin): the policy they
change between runs (tombstone's `keep_recent`), as a spec template and as a file."""

from __future__ import annotations

from pathlib import Path

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
