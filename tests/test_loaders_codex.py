"""Codex rollout loader: response grouping, tool items, usage from token_count, accounting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.loaders import codex
from ctxreplay.pipeline.loaders.base import call_ranges, threads_to_blocks
from ctxreplay.testkit import visible

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
UID = "019a0000-1111-7222-8333-944455556666"
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="


def line(t: str, payload: Any, ts: str = "2026-01-01T10:00:00.000Z") -> dict[str, Any]:
    return {"timestamp": ts, "type": t, "payload": payload}


def meta(**kw: Any) -> dict[str, Any]:
    return line(
        "session_meta",
        {
            "id": UID,
            "cwd": "/w",
            "originator": "codex_cli_rs",
            "cli_version": "0.70.0",
            "instructions": None,
            "source": "cli",
            "model_provider": "openai",
            **kw,
        },
    )


def item(**payload: Any) -> dict[str, Any]:
    return line("response_item", payload)


def user(text: str) -> dict[str, Any]:
    return item(type="message", role="user", content=[{"type": "input_text", "text": text}])


def answer(text: str) -> dict[str, Any]:
    return item(type="message", role="assistant", content=[{"type": "output_text", "text": text}])


def reasoning(text: str, enc: str = "gAAAenc") -> dict[str, Any]:
    return item(
        type="reasoning",
        summary=[{"type": "summary_text", "text": text}],
        content=None,
        encrypted_content=enc,
    )


def call(cid: str, name: str = "shell", args: str = '{"command":"ls"}') -> dict[str, Any]:
    return item(type="function_call", name=name, arguments=args, call_id=cid)


def output(cid: str, text: str = "ok") -> dict[str, Any]:
    return item(type="function_call_output", call_id=cid, output=text)


def tokens(inp: int, cached: int, out: int, total: int) -> dict[str, Any]:
    last = {
        "input_tokens": inp,
        "cached_input_tokens": cached,
        "output_tokens": out,
        "reasoning_output_tokens": 0,
        "total_tokens": inp + out,
    }
    return line(
        "event_msg",
        {
            "type": "token_count",
            "info": {"total_token_usage": {"total_tokens": total}, "last_token_usage": last},
            "rate_limits": None,
        },
    )


def turn(model: str = "gpt-5-codex") -> dict[str, Any]:
    return line("turn_context", {"cwd": "/w", "model": model, "effort": "medium"})


def write(tmp_path: Path, objs: list[Any], name: str = f"rollout-2026-01-01T10-00-00-{UID}.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(o if isinstance(o, str) else json.dumps(o) for o in objs) + "\n")
    return p


def frame(threads: list[codex.Thread]) -> pl.DataFrame:
    return pl.from_arrow(threads_to_blocks(threads)).sort("entry_order", "block_pos", "part_pos")  # type: ignore[union-attr]


def test_sniff() -> None:
    p = Path("x.jsonl")
    assert codex.sniff([meta()], p) == "codex"
    assert codex.sniff([{"type": "session", "version": 3}], p) is None
    assert codex.sniff([{"type": "response_item"}], p) is None


def test_one_response_is_one_assistant_message(tmp_path: Path) -> None:
    objs = [
        meta(),
        user("list files"),
        turn(),
        reasoning("**Listing**"),
        call("c1"),
        call("c2", args='{"x":1}'),
        tokens(1000, 800, 50, 1050),
        output("c1", "a\nb"),
        output("c2"),
        turn(),
        tokens(1000, 800, 50, 1050),
        answer("Two files."),
        tokens(1200, 1000, 10, 2260),
    ]
    threads, load = codex.load(write(tmp_path, objs))
    t = threads[0]
    assert [m.role for m in t.messages] == ["user", "assistant", "tool", "tool", "assistant"]
    df = frame(threads)
    a1 = df.filter(pl.col("msg_key") == "L4")
    assert a1.select("entry_id", "source_line", "block_pos", "block_type").rows() == [
        ("L4", 4, 0, "thinking"),
        ("L5", 5, 1, "tool_use"),
        ("L6", 6, 2, "tool_use"),
    ]
    th = a1.row(0, named=True)
    assert (th["text"], th["signature"], th["model"], th["provider"], th["api"]) == (
        "**Listing**",
        "gAAAenc",
        "gpt-5-codex",
        "openai",
        "openai-responses",
    )
    assert a1["tool_input"].to_list()[1:] == ['{"command":"ls"}', '{"x":1}']
    assert (th["usage_input"], th["usage_cache_read"], th["usage_output"]) == (200, 800, 50)
    last = df.filter(pl.col("msg_key") == "L12").row(0, named=True)
    assert (last["usage_input"], last["usage_cache_read"], last["usage_output"]) == (200, 1000, 10)
    tools = df.filter(pl.col("role") == "tool")
    assert tools.select("tool_use_id", "tool_name", "part_type", "text").rows() == [
        ("c1", "shell", "string", "a\nb"),
        ("c2", "shell", "string", "ok"),
    ]
    ic, _, _ = call_ranges(t)
    assert sum(ic) == 2
    assert load.message_lines == 7
    assert load.other_lines == {"session_meta": 1, "turn_context": 2, "event_msg:token_count": 3}
    assert threads[0].session_id == UID


def test_repeated_token_count_does_not_split_or_reassign(tmp_path: Path) -> None:
    # the repeated figures after the tool output must not be read as the usage of the next response
    objs = [
        meta(),
        user("go"),
        call("c1"),
        tokens(100, 0, 5, 105),
        output("c1"),
        tokens(100, 0, 5, 105),
        answer("done"),
    ]
    threads, _ = codex.load(write(tmp_path, objs))
    df = frame(threads).filter(pl.col("role") == "assistant")
    assert df.select("entry_id", "usage_input").rows() == [("L3", 100), ("L7", None)]


def test_instructions_developer_and_models(tmp_path: Path) -> None:
    objs = [
        meta(instructions="Be brief."),
        item(
            type="message", role="developer", content=[{"type": "input_text", "text": "sandbox: read-only"}]
        ),
        user("<environment_context>\n<cwd>/w</cwd>\n</environment_context>"),
        user("hi"),
        turn("gpt-a"),
        answer("hello"),
        user("again"),
        turn("gpt-b"),
        answer("hi again"),
    ]
    threads, load = codex.load(write(tmp_path, objs))
    msgs = threads[0].messages
    assert [(m.role, m.blocks[0].text) for m in msgs[:2]] == [
        ("system", "Be brief."),
        ("system", "sandbox: read-only"),
    ]
    # the developer message was an input item: its recorded role stays with it (the base
    # instructions were the request's `instructions`: no role)
    assert [(b.extra or {}).get("role") for m in msgs[:2] for b in m.blocks] == [None, "developer"]
    assert [m.is_meta for m in msgs[2:4]] == [True, False]
    assert [m.model for m in msgs if m.role == "assistant"] == ["gpt-a", "gpt-b"]
    assert load.other_lines["session_meta"] == 1  # a meta line feeding the system message is still "other"


def test_base_instructions_win_over_instructions(tmp_path: Path) -> None:
    objs = [meta(base_instructions={"text": "You are Codex."}, instructions="user notes"), user("hi")]
    threads, _ = codex.load(write(tmp_path, objs))
    assert threads[0].messages[0].blocks[0].text == "You are Codex."


def test_custom_tool_call_and_unparsable_arguments(tmp_path: Path) -> None:
    patch = "*** Begin Patch\n*** Add File: a.py\n+print(2)\n*** End Patch"
    objs = [
        meta(),
        user("go"),
        item(type="custom_tool_call", status="completed", call_id="c1", name="apply_patch", input=patch),
        call("c2", args="{not json"),
        tokens(10, 0, 1, 11),
        item(type="custom_tool_call_output", call_id="c1", output='{"output":"Success"}'),
        output("c2", "err"),
    ]
    threads, _ = codex.load(write(tmp_path, objs))
    df = frame(threads)
    uses = df.filter(pl.col("block_type") == "tool_use").to_dicts()
    assert uses[0]["tool_input"] == json.dumps(patch, ensure_ascii=False)
    assert json.loads(uses[0]["extra_json"]) == {"item_type": "custom_tool_call", "status": "completed"}
    assert uses[1]["tool_input"] == '"{not json"' and json.loads(uses[1]["extra_json"]) == {
        "arguments_not_json": True
    }
    assert df.filter(pl.col("role") == "tool")["tool_name"].to_list() == ["apply_patch", "shell"]


def test_user_image_and_list_output(tmp_path: Path) -> None:
    img = {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}
    objs = [
        meta(),
        item(type="message", role="user", content=[{"type": "input_text", "text": "see"}, img]),
        call("c1"),
        item(type="function_call_output", call_id="c1", output=[{"type": "input_text", "text": "shot"}, img]),
    ]
    threads, _ = codex.load(write(tmp_path, objs))
    df = frame(threads)
    assert df.filter(pl.col("block_type") == "image").select("image_media_type", "image_data").rows() == [
        ("image/png", PNG)
    ]
    parts = df.filter(pl.col("role") == "tool")
    assert parts.select("part_pos", "part_type").rows() == [(0, "text"), (1, "image")]


def test_other_lines_and_quarantine(tmp_path: Path) -> None:
    objs = [
        meta(),
        user("go"),
        item(type="ghost_snapshot", ghost_commit={"id": "abc"}),
        line("event_msg", {"type": "agent_message", "message": "x"}),
        {"type": "response_item"},
        [1],
        {"payload": {}},
        item(type="message", role="robot", content=[]),
    ]
    _threads, load = codex.load(write(tmp_path, objs))
    assert load.other_lines == {
        "session_meta": 1,
        "response_item:ghost_snapshot": 1,
        "event_msg:agent_message": 1,
    }
    assert {q.line: q.reason for q in load.quarantine} == {
        5: "'response_item' line has no 'payload' object",
        6: "expected a JSON object, got list",
        7: "line has no 'type' field (expected session_meta, response_item, event_msg, ...)",
        8: "response_item message has no usable 'role' (got 'robot')",
    }
    assert load.message_lines == 1


def test_compacted_with_replacement_history(tmp_path: Path) -> None:
    hist = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "first ask"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "SUMMARY"}]},
    ]
    objs = [
        meta(),
        user("first ask"),
        answer("a1"),
        user("second"),
        answer("a2"),
        line("compacted", {"message": "", "replacement_history": hist}),
        user("third"),
        answer("a3"),
    ]
    threads, load = codex.load(write(tmp_path, objs))
    blocks = pl.from_arrow(threads_to_blocks(threads))
    assert visible(blocks, 1)["text"].to_list() == ["first ask", "a1", "second"]
    assert visible(blocks, 2)["text"].to_list() == ["first ask", "SUMMARY", "third"]
    assert load.other_lines["compacted"] == 1


def test_compacted_without_history_uses_the_summary(tmp_path: Path) -> None:
    objs = [
        meta(),
        user("q"),
        answer("a1"),
        line("compacted", {"message": "we did X"}),
        user("q2"),
        answer("a2"),
    ]
    threads, load = codex.load(write(tmp_path, objs))
    blocks = pl.from_arrow(threads_to_blocks(threads))
    assert visible(blocks, 1)["text"].to_list() == ["we did X", "q2"]
    assert "approximation" in load.recovered[0]["note"]


def test_codex_sample() -> None:
    threads, load = codex.load(SAMPLES / "codex-sample.jsonl")
    assert (load.lines, load.message_lines, load.quarantined_lines) == (27, 11, 0)
    assert load.other_lines == {
        "session_meta": 1,
        "event_msg:user_message": 2,
        "turn_context": 4,
        "event_msg:token_count": 6,
        "event_msg:agent_reasoning": 1,
        "event_msg:agent_message": 1,
        "response_item:ghost_snapshot": 1,
    }
    t = threads[0]
    assert [m.role for m in t.messages] == [
        "system",
        "system",
        "user",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]
    assert [m.usage for m in t.messages if m.role == "assistant"] == [
        {"input": 852, "cache_read": 2048, "output": 80},
        {"input": 284, "cache_read": 2816, "output": 120},
        {"input": 228, "cache_read": 3072, "output": 30},
    ]
    assert t.session_id == "019a7c21-4d2e-7f10-b3a8-5e6f7a8b9c0d"


@pytest.mark.corpus
def test_corpus_codex_rollout(corpus: Path) -> None:
    path = corpus / "codex" / "lanegrid__agtrace__codex_session.jsonl"
    with path.open() as fh:
        assert codex.sniff([json.loads(fh.readline())], path) == "codex"
    threads, load = codex.load(path)
    assert (load.lines, load.message_lines, sum(load.other_lines.values()), load.quarantined_lines) == (
        55,
        21,
        34,
        0,
    )
    t = threads[0]
    assert t.session_id == "019b04ae-b1c6-7c72-a134-a4c2de66058c"
    ic, _, _ = call_ranges(t)
    assert sum(ic) == 7
    assistants = [m for m in t.messages if m.role == "assistant"]
    # per-request usage adds up to the cumulative total the CLI recorded
    assert sum((m.usage or {})["input"] + (m.usage or {})["cache_read"] for m in assistants) == 26740
    assert sum((m.usage or {})["output"] for m in assistants) == 408
    assert all(m.model == "gpt-5.1-codex-max" for m in assistants)
    assert [b.block_type for b in assistants[0].blocks] == ["thinking", "tool_use"]


def _count(totals: dict[str, int], last: dict[str, int] | None, ts: str) -> dict[str, Any]:
    info: dict[str, Any] = {"total_token_usage": totals}
    if last is not None:
        info["last_token_usage"] = last
    return line("event_msg", {"type": "token_count", "info": info, "rate_limits": None}, ts)


def _usage(inp: int, cached: int, out: int, written: int | None = None) -> dict[str, int]:
    u = {"input_tokens": inp, "cached_input_tokens": cached, "output_tokens": out, "reasoning_output_tokens": 0,
         "total_tokens": inp + out}
    return u if written is None else {**u, "cache_write_tokens": written}


def _plus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}


def test_report_and_run_count_the_same_requests(tmp_path: Path) -> None:
    """`ctxreplay report` sums every distinct token_count of a rollout (ccusage does the same): the
    cumulative total_token_usage it ends on is the rollout's own account of what was sent. `run`
    must record the same tokens on its calls: a token_count with only totals (older CLIs: the delta
    is the difference of totals), a cache write (GPT-5.6), and a request whose answer the rollout
    does not record (a compaction's summary request: its own call, on a thread of its own)."""
    from click.testing import CliRunner

    from ctxreplay.pipeline.commands.cli import main

    reqs = [_usage(9000, 8276, 30), _usage(12000, 9000, 200), _usage(15000, 11000, 120, written=2500),
            _usage(16000, 14000, 900), _usage(4000, 0, 60)]
    totals, t = [], {}
    for u in reqs:
        t = _plus(t, u)
        totals.append(t)
    ts = [f"2026-01-01T10:0{i}:00.000Z" for i in range(10)]
    objs = [
        meta(), turn("gpt-5.4"), user("first"),
        answer("one"), _count(totals[0], None, ts[1]),                   # totals only: the first request
        user("second"), call("c1"), _count(totals[1], reqs[1], ts[2]), output("c1"),
        answer("two"), _count(totals[2], reqs[2], ts[3]),                # with a cache write
        line("compacted", {"message": "summary of the work so far"}, ts[4]),
        _count(totals[3], reqs[3], ts[5]),                               # the compaction's own request
        user("third"), answer("three"), _count(totals[4], reqs[4], ts[6]),
    ]
    d = tmp_path / "sessions"
    d.mkdir()
    write(d, objs)
    rep = CliRunner().invoke(main, ["report", str(d), "--by", "session", "--json"])
    assert rep.exit_code == 0, rep.output
    (row,) = json.loads(rep.stdout)["rows"]
    assert (row["requests"], row["input_tokens"], row["cache_read_tokens"], row["output_tokens"]) == (
        5, 724 + 3000 + 1500 + 2000 + 4000, 8276 + 9000 + 11000 + 14000, 30 + 200 + 120 + 900 + 60)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["run", str(d), "--preset", "identity", "--out", str(out), "-q"])
    assert r.exit_code == 0, r.output
    calls = pl.read_parquet(out / "calls.parquet").filter(~pl.col("is_pending") & pl.col("recorded_output_tokens")
                                                          .is_not_null())
    assert calls.height == 5
    assert calls["recorded_input_tokens"].sum() == row["input_tokens"]
    assert calls["recorded_cache_read_tokens"].sum() == row["cache_read_tokens"]
    assert calls["recorded_output_tokens"].sum() == row["output_tokens"]
    assert calls["recorded_cache_write_tokens"].drop_nulls().to_list() == [2500]
    assert round(calls["recorded_cost_usd"].sum(), 6) == round(row["cost_usd"], 6)
    # the compaction's request: the history before the compaction, answered by the summary
    comp = calls.filter(pl.col("thread_id") != "main")
    assert comp["thread_id"].to_list() == ["compaction-L13"] and comp["recorded_cache_read_tokens"].to_list() == [14000]


def test_a_request_without_a_recorded_answer_is_a_call_of_its_own_thread(tmp_path: Path) -> None:
    """Two distinct token_counts with no response between them: the second request's answer is
    not in the rollout (an interrupted turn). It becomes the call of a thread of its own that
    carries the history so far (the main thread's requests inherited, not reported twice); the
    main thread's calls and requests are what they were."""
    objs = [meta(), turn(), user("go"), answer("one"), tokens(1000, 0, 10, 1010), user("again"),
            tokens(1200, 1000, 0, 2210), user("once more"), answer("two"), tokens(1300, 1000, 20, 3530)]
    threads, _ = codex.load(write(tmp_path, objs))
    main, side = threads
    assert [m.role for m in main.messages] == ["user", "assistant", "user", "user", "assistant"]
    assert [m.usage for m in main.messages if m.role == "assistant"] == [
        {"input": 1000, "cache_read": 0, "output": 10}, {"input": 300, "cache_read": 1000, "output": 20}]
    assert side.thread_id == "request-L7"
    assert [m.role for m in side.messages] == ["user", "assistant", "user", "assistant"]
    assert side.messages[-1].blocks == [] and side.messages[-1].usage == {"input": 200, "cache_read": 1000, "output": 0}
    is_call, _, _ = call_ranges(side)
    assert is_call == [False, False, False, True]      # the first answer is main's call


def _developer_mid_session(tmp_path: Path) -> Path:
    """A rollout whose second turn starts with a developer message (a collaboration-mode switch), as
    Codex CLI records it: the base instructions in session_meta, developer items in the history."""
    objs = [
        meta(base_instructions={"text": "You are Codex."}), turn("gpt-5.4"),
        item(type="message", role="developer", content=[{"type": "input_text", "text": "sandbox: read-only"}]),
        user("go " + "word " * 1500), answer("one"), tokens(3000, 0, 10, 3010),
        item(type="message", role="developer",
             content=[{"type": "input_text", "text": "<collaboration_mode>plan</collaboration_mode>"}]),
        user("again"), answer("two"), tokens(3300, 2944, 20, 6330),
    ]
    d = tmp_path / "sessions"
    d.mkdir()
    write(d, objs)
    return d


@pytest.mark.parametrize("target", [None, "anthropic"])
def test_developer_messages_are_input_items_where_they_occur(tmp_path: Path, target: str | None) -> None:
    """Codex CLI sends its base instructions as the Responses request's `instructions` and every
    developer message as a `developer` input item where it occurs. A run of Codex rollouts replays
    them in that shape (the native target), so a mid-session developer message is an appended item:
    the request's prefix holds, and the simulated cache reads it (no preamble break). Replayed for
    Anthropic (no developer role), the same message is system content: the system prompt changes."""
    from ctxreplay.pipeline.batch.runner import RunOptions, run
    from ctxreplay.pipeline.loaders.gemini_cli import native_target
    from ctxreplay.pipeline.staging.spec import load_spec

    d = _developer_mid_session(tmp_path)
    assert native_target([d]) == "openai-responses"
    out = tmp_path / "out"
    res = run([d], load_spec(preset="identity"), RunOptions(out_dir=out, target=target))
    assert res.summary["target"] == (target or "openai-responses") and not res.violations
    (req_file,) = (out / "requests").glob("*.json")
    req = json.loads(req_file.read_text())
    calls = res.calls.filter(~pl.col("is_pending")).sort("call")
    if target is None:
        assert req["instructions"] == "You are Codex."
        assert [(x.get("role"), x["content"][0]["text"][:5]) for x in req["input"]] == [
            ("developer", "sandb"), ("user", "go wo"), ("assistant", "one"), ("developer", "<coll"),
            ("user", "again"), ("assistant", "two")]
        assert calls["sim_break_cause"].to_list() == [None, None]
        assert calls["sim_cache_read_tokens"][1] > 0
    else:
        assert [b["text"][:5] for b in req["system"]] == ["You a", "sandb", "<coll"]
        assert calls["sim_break_cause"].to_list() == [None, "preamble"]
        assert calls["sim_cache_read_tokens"][1] == 0


def test_native_target_of_codex_rollouts(tmp_path: Path) -> None:
    """Codex rollouts alone replay as openai-responses, whatever the first line's length or spacing;
    mixed with another agent's transcripts, a run keeps the default target."""
    from ctxreplay.pipeline.loaders.gemini_cli import native_target

    long_meta = meta(base_instructions={"text": "x" * 100_000})
    d = tmp_path / "rollouts"
    d.mkdir()
    write(d, [long_meta, user("hi")])
    (d / "compact.jsonl").write_text(orjson_line(meta()) + "\n")
    assert native_target([d]) == "openai-responses"
    assert native_target([d, SAMPLES / "openclaw-sample.jsonl"]) is None
    assert native_target([SAMPLES / "codex-sample.jsonl"]) == "openai-responses"
    assert native_target([SAMPLES]) is None


def orjson_line(o: Any) -> str:
    import orjson

    return orjson.dumps(o).decode()
