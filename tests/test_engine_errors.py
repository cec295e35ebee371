"""What reaches an engine's (or a library) caller is a CtxReplayError (issue 21, item 5): a plug-in
target that breaks the request contract or a bad calibration mode is refused in one paragraph
naming the fix, and an exception that is a bug comes out as an internal error with its traceback in
a file, as the CLI reports it, never a raw ValueError or AssertionError."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay import Engine
from ctxreplay.errors import CheckFailed, InputError, SimError, TargetError
from ctxreplay.pipeline.assembly.replay import MessageStore, stand_in_messages
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.targets import TARGETS, get_target
from tests.cckit import CCSession

SID = "3f1d2c4b-5a6e-4f70-8a9b-0c1d2e3f4a5b"


def _session() -> CCSession:
    s = CCSession(SID, datetime(2026, 5, 1, 8, 0, tzinfo=UTC))
    s.user("list the files")
    s.tool_call(1, "Bash", 200)
    s.answer(2, "done")
    s.user("thanks")
    return s


class _Wrapped:
    """A plug-in target: Anthropic's shape with one thing changed."""

    name = "probe"

    def __init__(self) -> None:
        self._inner = get_target("anthropic")

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


class _EnvelopeFirst(_Wrapped):
    name = "probe-envelope"

    def envelope(self, model: str | None, system: list[Any]) -> dict[str, Any]:
        return {"b_first": True, **self._inner.envelope(model, system)}


class _LongStandIn(_Wrapped):
    name = "probe-stand-in"

    def empty_messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": f"hello {i}"} for i in range(5)]


@pytest.fixture
def probe_targets() -> Iterator[None]:
    for t in (_EnvelopeFirst(), _LongStandIn()):
        TARGETS[t.name] = t  # type: ignore[assignment]
    try:
        yield
    finally:
        TARGETS.pop(_EnvelopeFirst.name, None)
        TARGETS.pop(_LongStandIn.name, None)


def test_a_target_whose_envelope_key_sorts_first_is_refused_through_the_engine(tmp_path: Path,
                                                                                probe_targets: None) -> None:
    with Engine.open("identity", tmp_path / "ledger.duckdb", target=_EnvelopeFirst.name,
                     token_counter=CHARS4_COUNTER) as eng:
        eng.ingest(SID, _session().entries)
        with pytest.raises(TargetError) as err:
            eng.assemble(SID)
    msg = str(err.value)
    assert msg.startswith("target probe-envelope: its envelope() returns the key 'b_first', which does not sort "
                          "after the message list's key 'messages'")
    assert "Rename the key in the target's envelope() so that it sorts after 'messages'" in msg
    assert "\n" not in msg


def test_a_target_with_more_than_four_stand_in_messages_is_refused(probe_targets: None) -> None:
    with pytest.raises(TargetError, match=r"^target probe-stand-in: its empty_messages\(\) returns 5 messages .* "
                                          r"Return at most 4 messages"):
        stand_in_messages(get_target(_LongStandIn.name), MessageStore())
    assert len(stand_in_messages(get_target("anthropic"), MessageStore())) == 1


def test_an_unknown_calibration_mode_is_a_sim_error() -> None:
    from ctxreplay.pipeline.cost import calibrate

    with pytest.raises(SimError, match=r"^calibration mode 'threads' is neither 'thread' .* pass mode='thread' or "
                                       r"mode='family'$"):
        calibrate.fit(pl.DataFrame(), pl.DataFrame(), mode="threads")


def test_a_bug_inside_the_engine_is_an_internal_error_with_its_traceback_in_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ctxreplay.pipeline.engine import engine_replay

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("incremental request hash mismatch at call 1")

    monkeypatch.setattr(engine_replay.LiveThread, "update", broken)
    with Engine.open("identity", tmp_path / "ledger.duckdb", token_counter=CHARS4_COUNTER) as eng:
        eng.ingest(SID, _session().entries)
        with pytest.raises(CheckFailed) as err:
            eng.assemble(SID)
    e = err.value
    assert str(e).startswith("internal error in Engine.assemble (AssertionError: incremental request hash mismatch "
                             "at call 1): this is a bug in ctxreplay; the traceback was written to ")
    assert isinstance(e.__cause__, AssertionError)
    path = e.traceback_file  # type: ignore[attr-defined]
    try:
        assert "AssertionError: incremental request hash mismatch" in Path(path).read_text()
    finally:
        Path(path).unlink()


def test_a_caller_mistake_is_an_input_error_not_an_internal_error(tmp_path: Path) -> None:
    with Engine.open("identity", tmp_path / "ledger.duckdb", token_counter=CHARS4_COUNTER) as eng:
        with pytest.raises(InputError, match=r"^ingest\('s1'\): entries must be an iterable of transcript lines"):
            eng.ingest("s1", 5)  # type: ignore[arg-type]
        eng.ingest(SID, [json.dumps(e) for e in _session().entries])
        assert eng.assemble(SID).call == 2
