"""The request store and the incremental replay behind it.

- The replay re-shapes only around a change and keeps every other wire message's bytes: on long
  threads with changes deep in the history it still equals a naive assembly of every call, for
  every target (request, sha256, prompt_tokens, prefix break).
- messages.parquet + call_messages.parquet rebuild every call's request byte for byte (samples,
  and the whole corpus), in space linear in the thread, and prompt_tokens is a function of the
  stored request: the sum of its messages' tokens and the overheads.
- A thread that ended on the assistant's answer: the pending request keeps it (awaits_user), a
  recorded call's request never ends with an assistant message on a target without prefill.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxreplay.pipeline.assembly.replay import (
    CHUNK,
    MESSAGE_OVERHEAD_TOKENS,
    REQUEST_OVERHEAD_TOKENS,
    CallInfo,
    MessageStore,
    SpanLog,
    replay_thread,
)
from ctxreplay.pipeline.assembly.store import (
    call_message_frame,
    iter_call_lists,
    iter_request_json,
    read_call_messages,
    request,
    request_json,
    run_dir,
    store_tables,
    write_store,
)
from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec
from ctxreplay.pipeline.targets import TARGETS, get_target
from ctxreplay.schemas.messages import CALL_MESSAGES, MESSAGES
from ctxreplay.testkit import (
    check_replay_against_naive,
    drop_from,
    make_blocks,
    replace_from,
    replay_all_calls,
    replay_rows,
)

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
TARGET_NAMES = ["anthropic", "openai-chat", "openai-responses", "gemini"]


def long_conversation(loops: int, *, end_on_assistant: bool = False) -> list[dict[str, Any]]:
    """A system prompt, then user turns of up to 3 tool loops (thinking now and then, results
    without a tool name, as Claude Code writes them; every 5th loop makes two calls, answered in
    two messages, the second with a note after its result)."""
    conv: list[dict[str, Any]] = [{"role": "system", "text": "be brief"}, {"role": "user", "text": "start"}]
    for i in range(loops):
        blocks: list[dict[str, Any]] = []
        if i % 4 == 1:
            blocks.append({"type": "thinking", "text": f"think {i}", "signature": f"sig{i}"})
        blocks.append({"type": "tool_use", "tool_use_id": f"t{i}", "tool_name": f"Tool{i % 3}", "tool_input": {"i": i}})
        if i % 5 == 4:
            blocks.append({"type": "tool_use", "tool_use_id": f"u{i}", "tool_name": "Other", "tool_input": {}})
        conv.append({"role": "assistant", "blocks": blocks})
        conv.append({"role": "tool", "blocks": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                                 "text": f"result {i} " + "x" * (i % 7) * 20, "part_type": "string"}]})
        if i % 5 == 4:
            conv.append({"role": "tool", "blocks": [
                {"type": "tool_result", "tool_use_id": f"u{i}", "text": f"other {i}", "part_type": "text"},
                {"type": "text", "text": f"note {i}"}]})
        if i % 3 == 2:
            conv.append({"role": "user", "text": f"next {i}"})
    conv.append({"role": "assistant", "text": "done"})
    if not end_on_assistant:
        conv.append({"role": "user", "text": "thanks"})
    return conv


# ------------------------------------------------------------------ incremental = naive, deep changes


CHANGES = ["replace", "rename", "drop", "drop_block", "replace_any", "insert"]


def _deep_changes(conv: list[dict[str, Any]], changes: list[tuple[int, int, str]],
                  compactions: list[tuple[int, int]] | None = None) -> pl.DataFrame:
    """Apply (entry index, from call, kind) changes to the blocks of conv, as layers do."""
    b = make_blocks(conv, compactions=compactions or [])
    for j, (entry, k, kind) in enumerate(changes):
        where = pl.col("entry_id") == f"e{entry:04d}"
        if kind == "replace":  # a tombstone: the content changes, the message stays
            b = replace_from(b, where & (pl.col("block_type") == "tool_result"), {"text": pl.lit(f"[cleared at {k}]")}, k)
        elif kind == "rename":  # a tool call's name (Gemini names results after their call)
            b = replace_from(b, where & (pl.col("block_type") == "tool_use"), {"tool_name": pl.lit(f"Renamed{k}")}, k)
        elif kind == "replace_any":  # every block of the message
            b = replace_from(b, where, {"text": pl.lit(f"changed at {k}")}, k)
        elif kind == "drop":  # a whole message dropped (snip)
            b = drop_from(b, where, k)
        elif kind == "drop_block":  # one block of it
            b = drop_from(b, where & (pl.col("block_pos") == 0), k)
        else:  # a message inserted after it from call k on (a synthetic result, a header)
            df = b.collect()
            src = df.filter(where).sort("block_pos", "part_pos", "first_call").head(1)
            new = src.with_columns(
                entry_id=pl.lit(f"ins{j}"), msg_key=pl.lit(f"ins{j}"), order_key=pl.col("order_key") + 1 + j,
                role=pl.lit(["user", "tool", "assistant"][j % 3]), block_type=pl.lit("text"),
                part_type=pl.lit(None, pl.String), text=pl.lit(f"inserted {j}"), first_call=pl.lit(k, pl.Int32),
                last_call=pl.lit(None, pl.Int32), is_call=pl.lit(False), tool_use_id=pl.lit(None, pl.String),
                tool_name=pl.lit(None, pl.String), tool_input=pl.lit(None, pl.String))
            b = pl.concat([df, new.select(df.columns)]).lazy()
        b = b.collect().lazy()  # each change reads its input twice: keep the plan flat
    df = b.collect()
    return df.filter(pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("first_call")))


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_a_change_deep_in_a_long_thread_at_every_call(target: str) -> None:
    # 120 tool loops (requests of up to 4 hash chunks of wire messages); from call 70 on, every
    # call clears the next old result (the context-editing pattern: a change deep in a long
    # request), some are dropped, and tool calls are renamed
    conv = long_conversation(120)
    results = [i for i, m in enumerate(conv) if m["role"] == "tool"]
    calls = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
    changes = [(results[j], 70 + j, "replace") for j in range(45)]
    changes += [(results[60], 30, "drop"), (calls[20], 95, "drop"), (calls[3], 80, "rename"), (calls[50], 100, "rename")]
    df = _deep_changes(conv, changes)
    check_replay_against_naive(df, target)
    res = replay_all_calls(df, target)
    assert max(r.n_messages for r in res) > 2 * CHUNK  # the hash states of several chunks are used
    assert sum(r.prefix_break_message is not None for r in res) >= 45


def test_long_tails_are_hashed_off_the_main_thread_to_the_same_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    # requests of ~500 wire messages, changed near their start at every call from call 150 on:
    # the bytes after the change go to the worker thread, as the joined bytes of whole chunks (a
    # few long pieces, no join of their messages again); every request is materialised and its
    # full sha256 checked against the incremental one (and a few against a naive assembly)
    import ctxreplay.pipeline.assembly.replay as replay_mod

    submitted = []

    class Pool(replay_mod.ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            submitted.append((len(args[2]), sum(map(len, args[2]))))
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr(replay_mod, "ThreadPoolExecutor", Pool)
    conv = long_conversation(230)
    results = [i for i, m in enumerate(conv) if m["role"] == "tool"]
    df = _deep_changes(conv, [(results[j], 150 + j, "replace") for j in range(80)])
    res = replay_all_calls(df, "anthropic")
    assert len(submitted) > 50
    longest = max(len(r.request_json or b"") for r in res)
    assert max(size for _, size in submitted) > longest // 2  # most of a request: the tail after its change
    assert max(pieces for pieces, _ in submitted) < 2 + longest // (CHUNK * 100)  # whole chunks, not messages
    rows = replay_rows(df)
    from ctxreplay.testkit import naive_request

    for r in res[150::20]:
        assert r.request == naive_request(rows, r.call, "anthropic", pending=r.is_pending)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_incremental_equals_naive_on_long_threads(data: st.DataObject) -> None:
    loops = data.draw(st.integers(20, 70))
    conv = long_conversation(loops, end_on_assistant=data.draw(st.booleans()))
    n_entries = len(conv)
    changes = data.draw(st.lists(st.tuples(st.integers(0, n_entries - 1), st.integers(0, loops),
                                           st.sampled_from(CHANGES)), max_size=12))
    at = data.draw(st.integers(2, n_entries - 2))
    compactions = data.draw(st.sampled_from([[], [(at, data.draw(st.integers(1, at)))]]))
    check_replay_against_naive(_deep_changes(conv, changes, compactions), data.draw(st.sampled_from(TARGET_NAMES)))


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_a_compaction_that_keeps_messages_equal_to_the_ones_it_removes(target: str) -> None:
    # the same exchange twice, then a compaction that keeps only the second: several changed
    # ranges in one call, the second undoing the first's difference (found by fuzzing)
    from tests.test_targets import CONVERSATION

    df = make_blocks(CONVERSATION * 2, compactions=[(28, 13)]).collect()
    check_replay_against_naive(df.filter(pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("first_call"))),
                               target)


class _Numbered:
    """A broken target: every wire message carries its index, so a message dropped early changes
    all the later ones although none of their rows changed (it breaks the shape contract)."""

    name = "numbered-test"
    list_key = "messages"
    allow_prefill = False

    def __init__(self) -> None:
        self.base = get_target("anthropic")

    def shape(self, msgs: list, start: float) -> list:
        return [(lab, {**m, "n": lab}) for lab, m in self.base.shape(msgs, start)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


def test_a_target_that_breaks_the_shape_contract_is_caught() -> None:
    TARGETS[_Numbered.name] = _Numbered()  # type: ignore[assignment]
    try:
        df = _deep_changes(long_conversation(30), [(5, 12, "drop")])
        rows = replay_rows(df)
        calls = [CallInfo(k, "m") for k in range(df.filter(pl.col("is_call"))["msg_key"].n_unique())]
        with pytest.raises(AssertionError, match="depends on none of the changed rows"):
            list(replay_thread(rows, [1] * len(rows), calls, get_target(_Numbered.name)))
    finally:
        del TARGETS[_Numbered.name]


# ------------------------------------------------------------------ the store, in memory and on disk


def _replay_into_store(conv: list[dict[str, Any]], target: str) -> tuple[list[Any], MessageStore, SpanLog]:
    df = make_blocks(conv).collect()
    rows = replay_rows(df)
    calls = [CallInfo(k, "m") for k in range(df.filter(pl.col("is_call"))["msg_key"].n_unique())]
    store, spans = MessageStore(), SpanLog()
    spans.begin_thread("s1", "main", "s1")
    res = list(replay_thread(rows, [1] * len(rows), calls, get_target(target), store=store, spans=spans,
                             materialize=lambda k, p: True))
    return res, store, spans


LEADING_ASSISTANT = [  # the history starts with the assistant: call 0 has no recorded message
    {"role": "assistant", "text": "hello, I am here"},
    {"role": "assistant", "text": "still here"},
    {"role": "user", "text": "hi"},
    {"role": "assistant", "blocks": []},  # an aborted turn with no content
    {"role": "user", "text": "again"},
    {"role": "assistant", "text": "fine"},
]


@pytest.mark.parametrize("target", TARGET_NAMES)
@pytest.mark.parametrize("shape", ["ends_on_user", "ends_on_assistant", "starts_with_assistant"])
def test_every_call_is_rebuilt_from_the_store(target: str, shape: str, tmp_path: Path) -> None:
    conv = LEADING_ASSISTANT if shape == "starts_with_assistant" else \
        long_conversation(40, end_on_assistant=shape == "ends_on_assistant")
    res, store, spans = _replay_into_store(conv, target)
    messages, call_messages = store_tables(store, spans, target, get_target(target).list_key)
    write_store(tmp_path, messages, call_messages)
    rebuilt = list(iter_request_json(tmp_path))
    assert [(k, c) for k, c, _ in rebuilt] == [("s1", r.call) for r in res]
    for (_, _, data), r in zip(rebuilt, res, strict=True):
        assert data == r.request_json
        assert hashlib.sha256(data).hexdigest() == r.request_sha256
    # one call on its own, as `ctxreplay request` does
    assert request_json(tmp_path, "s1", 2) == res[2].request_json
    assert request(tmp_path, "s1") == res[-1].request


def test_the_store_files_read_back_as_declared(tmp_path: Path) -> None:
    _, store, spans = _replay_into_store(long_conversation(10), "anthropic")
    write_store(tmp_path, *store_tables(store, spans, "anthropic", "messages"))
    import pyarrow.parquet as pq

    assert pq.read_schema(tmp_path / "messages.parquet").remove_metadata() == MESSAGES.remove_metadata()
    got = pq.read_schema(tmp_path / "call_messages.parquet")
    assert [(f.name, f.type) for f in got] == [(f.name, f.type) for f in CALL_MESSAGES]


def test_store_space_is_linear_in_the_thread() -> None:
    # an append-only thread of n calls: the request lists hold ~n²/2 message references, the
    # store a few rows per call
    res, store, spans = _replay_into_store(long_conversation(300), "anthropic")
    n_calls = len(res)
    references = sum(r.n_messages for r in res)
    assert references > 100 * n_calls
    assert len(spans) <= 4 * n_calls
    assert len(store) <= 4 * n_calls


def test_call_lists_give_hashes_and_running_tokens(tmp_path: Path) -> None:
    res, store, spans = _replay_into_store(long_conversation(12), "anthropic")
    write_store(tmp_path, *store_tables(store, spans, "anthropic", "messages"))
    frame = call_message_frame(tmp_path, "s1", 9)
    assert frame.height == res[9].n_messages
    env_tokens = 1  # the system row ("be brief") weighs 1 in these replays
    assert frame["cum_tokens"][-1] + REQUEST_OVERHEAD_TOKENS + env_tokens == res[9].prompt_tokens
    assert frame["cum_tokens"].to_list() == (frame["tokens"] + MESSAGE_OVERHEAD_TOKENS).cum_sum().to_list()
    lists = {k: shas for _, k, shas, _ in iter_call_lists(pl.read_parquet(tmp_path / "call_messages.parquet"))}
    assert lists[9] == frame["sha256"].to_list()
    assert [len(lists[r.call]) for r in res] == [r.n_messages for r in res]


# ------------------------------------------------------------------ the pending call of a finished thread


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_pending_request_keeps_the_final_answer(target: str) -> None:
    t = get_target(target)
    res, _, _ = _replay_into_store(long_conversation(5, end_on_assistant=True), target)
    pending = res[-1]
    assert pending.is_pending and pending.awaits_user
    assert not any(r.awaits_user for r in res[:-1])
    last = pending.request[t.list_key][-1]
    assert last.get("role") in ("assistant", "model")
    assert t.validate(pending.request, thread_key="t", call=pending.call, awaits_user=True) == []
    # the request differs from the last recorded one by the answer: not the same hash
    assert pending.request_sha256 != res[-2].request_sha256
    res_user, _, _ = _replay_into_store(long_conversation(5), target)
    assert not res_user[-1].awaits_user


def test_anthropic_flags_a_trailing_answer_only_when_it_does_not_await_the_user() -> None:
    res, _, _ = _replay_into_store(long_conversation(5, end_on_assistant=True), "anthropic")
    rules = [v.rule for v in get_target("anthropic").validate(res[-1].request, thread_key="t", call=res[-1].call)]
    assert rules == ["trailing_assistant"]


def test_recorded_call_never_ends_with_an_assistant_message_and_counts_what_it_sends() -> None:
    # two answers in a row (an answer whose next call came without a user turn): call 2's request
    # would end with answer 1; the Anthropic target leaves it out, and does not count it either
    conv = [{"role": "user", "text": "hi"}, {"role": "assistant", "text": "one"},
            {"role": "assistant", "text": "two"}, {"role": "user", "text": "ok"}]
    res, _, _ = _replay_into_store(conv, "anthropic")
    assert [r.request["messages"][-1]["role"] for r in res] == ["user", "user", "user"]
    assert res[1].request_sha256 == res[0].request_sha256
    assert res[1].prompt_tokens == res[0].prompt_tokens
    res_chat, _, _ = _replay_into_store(conv, "openai-chat")  # a target that allows the prefill keeps it
    assert res_chat[1].request["messages"][-1]["role"] == "assistant"


# ------------------------------------------------------------------ runs: samples and corpus


def _check_run(out: Path, calls: pl.DataFrame) -> None:
    """Every call of a run: rebuilt from the store byte for byte, its n_messages, and its
    prompt_tokens = the overheads + its envelope's and messages' tokens in messages.parquet."""
    msgs = pl.read_parquet(run_dir(out) / "messages.parquet", columns=["sha256", "kind", "tokens"])
    tokens = dict(zip(msgs["sha256"].to_list(), msgs["tokens"].to_list(), strict=True))
    want = {(r["thread_key"], r["call"]): r for r in calls.iter_rows(named=True)}
    seen = 0
    for key, k, shas, env in iter_call_lists(read_call_messages(run_dir(out))):
        r = want.get((key, k))
        if r is None:  # a branch's inherited call: the thread it shares the history with reports it
            continue
        assert len(shas) == r["n_messages"], (key, k)
        assert r["prompt_tokens"] == REQUEST_OVERHEAD_TOKENS + tokens[env] + sum(
            tokens[s] + MESSAGE_OVERHEAD_TOKENS for s in shas), (key, k)
        seen += 1
    assert seen == calls.height
    rebuilt = {(key, k): hashlib.sha256(data).hexdigest() for key, k, data in iter_request_json(out)}
    assert {k: rebuilt[k] for k in want} == {k: r["request_sha256"] for k, r in want.items()}
    # the same request is counted the same, always
    per_sha = calls.group_by("request_sha256").agg(pl.col("prompt_tokens").n_unique())
    assert per_sha["prompt_tokens"].max() == 1


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_samples_rebuild_from_the_store(target: str, tmp_path: Path) -> None:
    out = tmp_path / "o"
    res = run([SAMPLES], load_spec(preset="default"), RunOptions(out_dir=out, target=target,
                                                                token_counter=CHARS4_COUNTER))
    _check_run(out, res.calls)
    assert res.summary["request_store"]["token_conflicts"] == 0
    pending = res.calls.filter(pl.col("is_pending"))
    for r in pending.iter_rows(named=True):  # requests/<key>.json is the store's pending request
        assert orjson.loads((out / "requests" / f"{r['thread_key']}.json").read_bytes()) == request(out, r["thread_key"])


def test_request_command_prints_the_stored_bytes(tmp_path: Path) -> None:
    out = tmp_path / "o"
    cli = CliRunner()
    assert cli.invoke(main, ["run", str(SAMPLES / "claude-projects"), "--out", str(out), "-q", "--fast-tokens"]).exit_code == 0
    calls = pl.read_parquet(out / "calls.parquet").sort("thread_key", "call")
    for r in calls.iter_rows(named=True):
        got = cli.invoke(main, ["request", str(out), r["thread_key"], "--call", str(r["call"]), "--canonical"])
        assert got.exit_code == 0
        assert hashlib.sha256(got.stdout_bytes).hexdigest() == r["request_sha256"]
    key = calls["thread_key"][0]
    other = cli.invoke(main, ["request", str(out), key, "--target", "gemini"])  # shaped anew in that target
    assert other.exit_code == 0 and "contents" in orjson.loads(other.stdout)
    (run_dir(out) / "messages.parquet").unlink()  # a damaged run directory
    gone = cli.invoke(main, ["request", str(out), key])
    assert gone.exit_code == 2 and "no messages.parquet" in gone.stderr and f"--out {out}" in gone.stderr
    # a run made before the request store: shaped from its blocks, the same bytes
    (run_dir(out) / "call_messages.parquet").unlink()
    last = calls.row(-1, named=True)
    old = cli.invoke(main, ["request", str(out), last["thread_key"], "--call", str(last["call"]), "--canonical"])
    assert old.exit_code == 0 and hashlib.sha256(old.stdout_bytes).hexdigest() == last["request_sha256"]


@pytest.mark.corpus
def test_corpus_every_request_rebuilds_and_counts_what_was_hashed(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    res = run([corpus], load_spec(preset="default"), RunOptions(out_dir=out, token_counter=CHARS4_COUNTER,
                                                               validate=False))
    assert res.calls.height > 1500
    _check_run(out, res.calls)
    assert res.summary["request_store"]["token_conflicts"] == 0
    # a finished thread's pending request holds the final answer: flagged, never the recorded
    # call's hash again
    calls = res.calls.sort("session_id", "thread_id", "call").with_columns(
        prev=pl.col("request_sha256").shift(1).over("session_id", "thread_id"))
    pending = calls.filter(pl.col("is_pending"))
    assert pending.filter(pl.col("awaits_user") & (pl.col("request_sha256") == pl.col("prev"))).height == 0
    assert pending["awaits_user"].sum() > 30
    assert calls.filter(~pl.col("is_pending"))["awaits_user"].sum() == 0


@pytest.mark.corpus
@pytest.mark.slow
@pytest.mark.parametrize("target", ["openai-chat", "openai-responses", "gemini"])
def test_corpus_store_on_the_other_targets(corpus: Path, tmp_path: Path, target: str) -> None:
    out = tmp_path / "o"
    res = run([corpus], load_spec(preset="identity"), RunOptions(out_dir=out, target=target,
                                                                token_counter=CHARS4_COUNTER, validate=False))
    _check_run(out, res.calls)
