"""`ctxreplay threads` and thread / session prefixes everywhere (issue 13, point 2)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from ctxreplay.pipeline.inspection.threads import (
    AmbiguousRef,
    ThreadRef,
    UnknownRef,
    resolve_session,
    resolve_thread,
    thread_kind,
)
from tests.inspectkit import SAMPLES, SYN_SID, cli, one_error_line, write_session

THREAD_KEYS = {"session_id", "thread_id", "thread_key", "kind", "source_format", "calls", "first_own_call",
               "pending_call", "models", "first_time", "last_time", "last_prompt_tokens", "decisions",
               "provisional_decisions", "decisions_by_stage", "violations", "violations_by_rule"}
CC = "5f0c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f"
OC = "7d3f9a2e-1b4c-4e8a-9f60-2c5d8e1a4b37"


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    o = tmp_path_factory.mktemp("threads") / "o"
    assert cli("run", SAMPLES, "--out", o, "-q", "--fast-tokens").exit_code == 0
    return o


def test_one_line_per_thread(out: Path) -> None:
    r = cli("threads", out)
    assert r.exit_code == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["THREAD", "KIND", "CALLS", "MODELS", "FIRST", "(UTC)", "LAST", "(UTC)", "PROMPT",
                                "DECISIONS", "VIOLATIONS"]
    assert len(lines) == 1 + 8 + 1
    assert lines[-1] == "8 threads, 6 sessions, 28 own calls + 8 pending"
    rows = {ln.split()[0]: ln for ln in lines[1:-1]}
    assert set(rows) == {"019a7c21/main", "3b8e2f41/main", "5f0c1d2e/agent-a1b2c3d", "5f0c1d2e/main",
                         "7d3f9a2e/branch-c0a1000a", "7d3f9a2e/main", "anthropic-request/main",
                         "openai-chat-request/main"}
    assert rows["5f0c1d2e/agent-a1b2c3d"].split()[1:3] == ["subagent", "2"]
    assert rows["7d3f9a2e/branch-c0a1000a"].split()[1:4] == ["branch", "1", "(2)"]  # its own call: call 2
    assert rows["anthropic-request/main"].split()[1] == "request"
    assert "2026-03-02 09:00  2026-03-02 09:02" in rows["5f0c1d2e/main"]
    assert "sanitize 3, inter_session 1" in rows["7d3f9a2e/main"]


def test_json_is_one_object_and_agrees_with_the_summary(out: Path) -> None:
    r = cli("threads", out, "--json")
    doc = json.loads(r.stdout)
    assert set(doc) == {"out_dir", "run_id", "session", "target", "count", "threads"}
    assert doc["count"] == len(doc["threads"]) == 8
    summary = json.loads((out / "summary.json").read_text())
    assert sum(t["calls"] for t in doc["threads"]) == summary["recorded_calls"]
    by_stage: dict[str, int] = {}
    for t in doc["threads"]:
        assert set(t) == THREAD_KEYS
        for k, v in t["decisions_by_stage"].items():
            by_stage[k] = by_stage.get(k, 0) + v
    assert by_stage == {k: v for k, v in summary["decisions"].items() if v}
    assert sum(t["violations"] for t in doc["threads"]) == summary["violations"]
    main = next(t for t in doc["threads"] if t["thread_key"] == CC)
    calls = pl.read_parquet(out / "calls.parquet").filter(pl.col("thread_key") == CC)
    assert main["last_prompt_tokens"] == calls.filter(pl.col("is_pending"))["prompt_tokens"][0]
    assert main["models"] == ["claude-sonnet-4-5-20250929"] and main["pending_call"] == 6
    assert main["first_time"] == "2026-03-02T09:00:07.000Z"


def test_violations_are_counted_per_thread(tmp_path: Path) -> None:
    """The identity preset keeps the small session's blank text blocks, which the anthropic rules
    refuse; the default preset drops them (sanitize)."""
    write_session(tmp_path / "src")
    for preset, want in (("identity", {SYN_SID: {"empty_text": 2}}), ("default", {})):
        o = tmp_path / preset
        s = json.loads(cli("run", SAMPLES, tmp_path / "src", "--out", o, "--preset", preset, "--json",
                           "--fast-tokens").stdout)
        doc = json.loads(cli("threads", o, "--json").stdout)
        assert sum(t["violations"] for t in doc["threads"]) == s["violations"] == sum(
            sum(v.values()) for v in want.values())
        assert {t["thread_key"]: t["violations_by_rule"] for t in doc["threads"] if t["violations"]} == want
        line = next(ln for ln in cli("threads", o).stdout.splitlines() if ln.startswith("a0b1c2d3/main"))
        assert line.endswith(f" {s['violations']}")


def test_session_filter_takes_a_prefix(out: Path) -> None:
    doc = json.loads(cli("threads", out, "--session", "5f0c", "--json").stdout)
    assert doc["session"] == CC and [t["thread_id"] for t in doc["threads"]] == ["agent-a1b2c3d", "main"]
    r = cli("threads", out, "--session", "nope")
    assert r.exit_code == 2
    assert one_error_line(r).startswith(f"ctxreplay: no session 'nope' in {out}. Sessions: 019a7c21-")


def test_an_ambiguous_prefix_lists_the_candidates(tmp_path: Path) -> None:
    write_session(tmp_path / "src")
    o = tmp_path / "o"
    assert cli("run", SAMPLES, tmp_path / "src", "--out", o, "-q", "--fast-tokens").exit_code == 0
    for cmd in (["threads", o, "--session"], ["ledger", o, "--session"]):
        assert cli(*cmd, "0").exit_code == 0  # one session starts with 0
        r = cli(*cmd, "a")
        assert r.exit_code == 2
        assert one_error_line(r) == (f"ctxreplay: session 'a' is ambiguous in {o}: it starts 2 session ids "
                                     f"({SYN_SID}, anthropic-request); give more of the id")
        assert cli(*cmd, "an").exit_code == 0
    for cmd in ("request", "why"):
        r = cli(cmd, o, "7d3f9a2e/b")
        assert r.exit_code == 0, r.stderr
        r = cli(cmd, o, "7")
        assert r.exit_code == 0, r.stderr  # one session: its main thread
        r = cli(cmd, o, "5f0c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f--")
        assert r.exit_code == 0  # the one key that continues the session id: the subagent
        r = cli(cmd, o, "5f0c1d2e/")
        assert r.exit_code == 2
        assert one_error_line(r) == (f"ctxreplay: thread '5f0c1d2e/' is ambiguous in {o}: '' starts 2 threads of "
                                     f"session {CC} (main, agent-a1b2c3d); give more of the thread id")
        r = cli(cmd, o, "a")
        assert r.exit_code == 2
        assert one_error_line(r) == (f"ctxreplay: thread 'a' is ambiguous in {o}: it starts the thread keys of "
                                     f"2 sessions: {SYN_SID} (1 thread), anthropic-request (1 thread); give more "
                                     f"of the key")


def _refs() -> list[ThreadRef]:
    return [ThreadRef("s1aaaa", "s1aaaa", "main"), ThreadRef("s1aaaa--agent-x1", "s1aaaa", "agent-x1"),
            ThreadRef("s1aaaa--agent-x2", "s1aaaa", "agent-x2"), ThreadRef("s1bbbb--branch-1", "s1bbbb", "branch-1"),
            ThreadRef("s1bbbb--branch-2", "s1bbbb", "branch-2"), ThreadRef("s2", "s2", "main")]


@pytest.mark.parametrize(("ref", "key"), [
    ("s1aaaa", "s1aaaa"),  # exact key
    ("s1a", "s1aaaa"),  # a prefix of one session id: its main thread
    ("s1aaaa--agent-x2", "s1aaaa--agent-x2"),
    ("s1aaaa--agent-x1", "s1aaaa--agent-x1"),
    ("s1aaaa/agent-x1", "s1aaaa--agent-x1"),  # SESSION/THREAD
    ("s1a/agent-x2", "s1aaaa--agent-x2"),
    ("s1b/branch-2", "s1bbbb--branch-2"),
    ("s2", "s2"),
])
def test_thread_prefixes(ref: str, key: str) -> None:
    assert resolve_thread(ref, _refs(), where="OUT").key == key


@pytest.mark.parametrize(("ref", "message"), [
    ("s1", ("thread 's1' is ambiguous in OUT: it starts the thread keys of 2 sessions: s1aaaa (3 threads), s1bbbb "
           "(2 threads); give more of the key")),
    ("s1aaaa--agent", ("thread 's1aaaa--agent' is ambiguous in OUT: it starts 2 thread keys (s1aaaa--agent-x1, "
                      "s1aaaa--agent-x2); give more of the key")),
    ("s1b", ("thread 's1b' is ambiguous in OUT: session s1bbbb has no main thread and 2 threads (s1bbbb--branch-1, "
            "s1bbbb--branch-2); give the thread key, or SESSION/THREAD")),
    ("s1aaaa/agent", ("thread 's1aaaa/agent' is ambiguous in OUT: 'agent' starts 2 threads of session s1aaaa "
                     "(agent-x1, agent-x2); give more of the thread id")),
])
def test_ambiguous_thread_prefixes(ref: str, message: str) -> None:
    with pytest.raises(AmbiguousRef) as err:
        resolve_thread(ref, _refs(), where="OUT")
    assert str(err.value) == message and len(err.value.candidates) >= 2


def test_unknown_threads_and_sessions() -> None:
    with pytest.raises(UnknownRef, match=r"^no thread 's22' in OUT. Did you mean 's2'\? See them with: ctxreplay "
                                         r"threads OUT$"):
        resolve_thread("s22", _refs(), where="OUT")
    with pytest.raises(UnknownRef, match=r"^session s1aaaa in OUT has no thread 'sub'; its threads: main, agent-x1, "
                                         r"agent-x2$"):
        resolve_thread("s1aaaa/sub", _refs(), where="OUT")
    with pytest.raises(UnknownRef, match=r"^no session 'x' in OUT. Sessions: s1, s2$"):
        resolve_session("x", ["s1", "s2"], where="OUT")
    assert resolve_session("s1", ["s1", "s12"], where="OUT") == "s1"  # exact wins over prefix


@pytest.mark.parametrize(("tid", "fmt", "side", "kind"), [
    ("main", "claude_code", False, "main"), ("agent-a1b2", "claude_code", True, "subagent"),
    ("agent-acompact-946d2b", "claude_code", True, "compaction agent"), ("branch-5270777a", "claude_code", False, "branch"),
    ("sidechain-6340ddef", "claude_code", True, "sidechain"), ("agent-a1-branch-0f", "claude_code", True, "subagent branch"),
    ("main", "anthropic_request", False, "request"), ("lanegrid__claude_session", "claude_code", False, "main"),
])
def test_thread_kinds(tid: str, fmt: str, side: bool, kind: str) -> None:
    assert thread_kind(tid, fmt, side) == kind
