"""Tests of the redact_secrets stage, written with ctxreplay's ctxreplay.testkit.

Run from a ctxreplay checkout with the package importable:
    PYTHONPATH=examples/redact-secrets/src pytest examples/redact-secrets/tests
(`--update-goldens` is a ctxreplay test option; here, set UPDATE_GOLDENS=1 to rewrite the expected files.)
"""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl
import pytest
import redact_secrets  # noqa: F401  (registers the stage)

from ctxreplay.errors import SpecError
from ctxreplay.testkit import check_golden, make_blocks, run_stage

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("case", sorted(p for p in GOLDEN.iterdir() if p.is_dir()), ids=lambda p: p.name)
def test_golden(case: Path) -> None:
    check_golden(case, "redact_secrets", update=bool(os.environ.get("UPDATE_GOLDENS")))


def _texts(msgs: list[dict], params: dict | None = None) -> list[str]:
    res = run_stage("redact_secrets", make_blocks(msgs), params or {})
    return res.blocks.collect().sort("order_key")["text"].to_list()


def test_each_kind_is_masked_with_its_name() -> None:
    texts = _texts([{"role": "user", "text": "a AIzaSyA-abcdefghijklmnopqrstuvwxyz01234 b"},
                    {"role": "user", "text": "Authorization: Bearer abcdefghijklmnopqrstuvwxyz.0123"},
                    {"role": "user", "text": "slack xoxb-1234567890-abcdefghij"}])
    assert texts == ["a [REDACTED google-api-key] b", "Authorization: [REDACTED bearer-token]",
                     "slack [REDACTED slack-token]"]


def test_kinds_and_switches_are_honoured() -> None:
    msg = [{"role": "user", "text": "sk-proj-AbCdEfGhIjKlMnOpQrStUvWx0123 and password=hunter2hunter2"}]
    only = "sk-proj-AbCdEfGhIjKlMnOpQrStUvWx0123 and password=[REDACTED assignment]"
    assert _texts(msg, {"kinds": ["assignment"]}) == [only]
    assert _texts(msg, {"user_text": False}) == [msg[0]["text"]]


def test_short_values_are_not_secrets() -> None:
    assert _texts([{"role": "user", "text": "password=short token: abc"}]) == ["password=short token: abc"]


def test_a_second_run_decides_nothing() -> None:
    res = run_stage("redact_secrets", make_blocks([{"role": "user", "text": "key sk-ant-abcdefghijklmnopqrstuvwx"}]))
    again = run_stage("redact_secrets", res.blocks)
    assert again.decisions.collect().height == 0
    assert res.decisions.collect().select("action", "reason").rows() == [("replace", "secret")]


def test_unknown_kind_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match="unknown kind"):
        run_stage("redact_secrets", make_blocks([{"role": "user", "text": "hi"}]), {"kinds": ["ssh-key"]})


def test_blocks_without_text_are_left_alone() -> None:
    res = run_stage("redact_secrets", make_blocks([{"role": "user", "blocks": [
        {"type": "image", "image_media_type": "image/png", "image_data": "iVBORw0KGgo="}]}]))
    assert res.decisions.collect().height == 0
    assert res.blocks.collect().filter(pl.col("block_type") == "image").height == 1
