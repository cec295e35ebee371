"""`ctxreplay why` (issue 13, point 1): the request at a call, block by block, with every decision
effective there shown once on its block, and nothing else; dropped blocks shown; --diff against
the transcript as recorded; folding; --json; exit codes and messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pytest

from tests.inspectkit import SAMPLES, SYN_SID, cli, effective, one_error_line, shown, write_session

WHY_KEYS = {"thread_key", "session_id", "thread_id", "kind", "call", "pending_call", "is_pending", "target",
            "pipeline", "pipeline_sha256", "run_id", "model", "timestamp", "request_sha256",
            "request_sha256_matches", "request_bytes", "n_messages", "prompt_tokens", "stage_filter",
            "changed_only", "full", "decisions", "blocks", "messages", "wire"}
BLOCK_KEYS = {"entry_id", "block_pos", "part_pos", "block_type", "part_type", "tool_use_id", "tool_name", "is_error",
              "status", "origin", "first_call", "last_call", "bytes", "decisions"}
DECISION_KEYS = {"stage", "stage_version", "action", "reason", "from_call", "cache_epoch", "before_len", "after_len",
                 "is_provisional", "tool_use_id"}


@pytest.fixture(scope="module")
def syn(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The synthetic session replayed with the default preset and with the identity preset."""
    base = tmp_path_factory.mktemp("why")
    src = base / "src"
    write_session(src)
    for name, preset in (("out", "default"), ("ident", "identity")):
        assert cli("run", src, "--out", base / name, "--preset", preset, "-q", "--fast-tokens").exit_code == 0
    return {"src": src, "out": base / "out", "ident": base / "ident"}


def _why(*args: object) -> dict[str, Any]:
    r = cli("why", *args, "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def _every_call_is_one_to_one(out: Path, ident: Path, *, diff_every: int = 1, in_process: bool = False,
                              stride: int = 1) -> int:
    """For every call of every thread of a run: the shown decisions are exactly the effective ones,
    each once; the request hash matches calls.parquet; blocks are mapped to wire messages; with
    --diff, the recorded request is the identity run's. Returns the number of decisions checked.
    `in_process` builds the documents without the CLI, from one RunView (a session's transcript
    is then read once, not once per call). With `stride` > 1: every stride-th call, each call
    where a decision starts to apply, and each pending call."""
    from ctxreplay.pipeline.inspection.threads import RunView
    from ctxreplay.pipeline.inspection.why import WhyOptions, build

    view = RunView(out)
    calls = pl.read_parquet(out / "calls.parquet")
    decisions = pl.read_parquet(out / "decisions.parquet")
    final = pl.read_parquet(out / "blocks.parquet")
    recorded = pl.read_parquet(ident / "blocks.parquet")
    ident_calls = pl.read_parquet(ident / "calls.parquet")
    starts = set(decisions.select("session_id", "thread_id", "from_call").unique().iter_rows())
    checked = 0
    for i, r in enumerate(calls.sort("thread_key", "call").iter_rows(named=True)):
        if not (i % stride == 0 or r["is_pending"] or (r["session_id"], r["thread_id"], r["call"]) in starts):
            continue
        diff = i % diff_every == 0
        if in_process:
            doc = json.loads(json.dumps(build(view, view.thread(r["thread_key"]), WhyOptions(call=r["call"], diff=diff)),
                                        default=str))
        else:
            doc = _why(out, r["thread_key"], "--call", r["call"], *(["--diff"] if diff else []))
        want = effective(decisions, final, recorded, r["session_id"], r["thread_id"], r["call"])
        got = shown(doc)
        assert got == want, (r["thread_key"], r["call"])
        assert doc["decisions"]["count"] == len(want)
        checked += len(want)
        assert doc["request_sha256"] == r["request_sha256"] and doc["request_sha256_matches"]
        assert doc["wire"]["mapped"]
        for m in doc["messages"]:
            for b in m["blocks"]:
                # a block differs from the transcript exactly when a decision explains it
                assert (b["status"] != "unchanged") == bool(b["decisions"]), (r["thread_key"], r["call"], b)
        if diff:
            want_sha = ident_calls.filter((pl.col("thread_key") == r["thread_key"]) & (pl.col("call") == r["call"]))
            assert doc["recorded"]["request_sha256"] == want_sha["request_sha256"][0]
    return checked


def test_every_layer_on_a_small_session_is_one_to_one(syn: dict[str, Path]) -> None:
    stages = set(pl.read_parquet(syn["out"] / "decisions.parquet")["stage"])
    assert {"sanitize", "images", "pairing", "tombstone"} <= stages
    assert _every_call_is_one_to_one(syn["out"], syn["ident"]) > 0


def test_samples_are_one_to_one(tmp_path: Path) -> None:
    for name, preset in (("out", "default"), ("ident", "identity")):
        assert cli("run", SAMPLES, "--out", tmp_path / name, "--preset", preset, "-q", "--fast-tokens").exit_code == 0
    assert _every_call_is_one_to_one(tmp_path / "out", tmp_path / "ident") > 0


def test_json_keys_and_annotations(syn: dict[str, Path]) -> None:
    doc = _why(syn["out"], SYN_SID[:8])
    assert WHY_KEYS | {"messages"} <= set(doc) and "recorded" not in doc
    assert doc["is_pending"] and doc["call"] == doc["pending_call"] == 16 and doc["kind"] == "main"
    assert doc["decisions"] == {"count": 8, "provisional": 1,
                                "by_stage": {"sanitize": 2, "images": 1, "pairing": 2, "tombstone": 3}}
    blocks = [b for m in doc["messages"] for b in m["blocks"]]
    for b in blocks:
        assert BLOCK_KEYS <= set(b)
        for d in b["decisions"]:
            assert set(d) == DECISION_KEYS
    dropped = [b for b in blocks if b["status"] == "dropped"]
    # both blank blocks are shown though the request no longer holds them, with their decision
    assert [(b["text"]["text"], [(d["stage"], d["reason"], d["from_call"], d["is_provisional"]) for d in b["decisions"]])
            for b in dropped] == [("   ", [("sanitize", "blank_text", 0, False)]),
                                  (" \n ", [("sanitize", "blank_text", 16, True)])]
    image = next(b for b in blocks if b["block_type"] == "image")
    assert image["status"] == "changed" and image["image"]["width"] == 2000
    assert [(d["stage"], d["action"], d["before_len"], d["after_len"]) for d in image["decisions"]] == [
        ("images", "replace", image["decisions"][0]["before_len"], image["bytes"])]
    cleared = [b for b in blocks if b["decisions"] and b["decisions"][-1]["stage"] == "tombstone"]
    assert len(cleared) == 3
    for b in cleared:
        assert b["text"]["text"] == "[Old tool result content cleared]"
        d = b["decisions"][-1]
        assert (d["action"], d["reason"], d["from_call"], d["cache_epoch"], d["after_len"]) == \
            ("tombstone", "idle", 14, 15, 33)
    paired = [b for b in blocks if any(d["stage"] == "pairing" for d in b["decisions"])]
    # moved by pairing (from call 1), then cleared by tombstone: changed, with both decisions in order
    assert [[(d["stage"], d["reason"]) for d in b["decisions"]] for b in paired] == \
        [[("pairing", "displaced"), ("tombstone", "idle")]] * 2
    assert {b["status"] for b in paired} == {"changed"}
    early = [b for m in _why(syn["out"], SYN_SID, "--call", 2)["messages"] for b in m["blocks"] if b["decisions"]
             and b["block_type"] == "tool_result"]
    assert [b["status"] for b in early] == ["moved", "moved"]


def test_terminal_view_shows_decisions_inline_and_dropped_blocks(syn: dict[str, Path]) -> None:
    r = cli("why", syn["out"], SYN_SID, "--changed")
    assert r.exit_code == 0 and r.stderr == ""
    out = r.stdout
    assert out.startswith(f"{SYN_SID}  main · the pending call (calls 0..16, 16 pending) · target anthropic · "
                          f"pipeline default (")
    assert "8 decisions effective at this call: sanitize 2, images 1, pairing 2, tombstone 3, 1 provisional" in out
    assert "  [1.0] text · 3 B  ✗ DROPPED\n      │ (blank: \"   \")\n" \
           "      ↳ sanitize: drop (blank_text) · from call 0 · cache_epoch 0 · 3 B → –\n" in out
    assert "      ↳ sanitize: drop (blank_text) · from call 16 · cache_epoch 0 · 3 B → – · provisional\n" in out
    assert out.count("      ↳ tombstone: tombstone (idle) · from call 14 · cache_epoch 15 · ") == 3
    assert "~ CHANGED" in out and "↕ MOVED" in cli("why", syn["out"], SYN_SID, "--call", 2).stdout
    assert "wire request (anthropic): " in out and "← changed blocks in #" in out


def test_an_earlier_call_shows_only_what_applies_there(syn: dict[str, Path]) -> None:
    before = _why(syn["out"], SYN_SID, "--call", 13)
    at = _why(syn["out"], SYN_SID, "--call", 14)
    assert before["decisions"]["by_stage"] == {"sanitize": 1, "images": 1, "pairing": 2}
    assert at["decisions"]["by_stage"] == {"sanitize": 1, "images": 1, "pairing": 2, "tombstone": 3}
    assert not before["is_pending"] and before["call"] == 13


def test_stage_filter_and_changed_only(syn: dict[str, Path]) -> None:
    doc = _why(syn["out"], SYN_SID, "--stage", "tombstone")
    assert doc["decisions"]["by_stage"] == {"tombstone": 3} and doc["blocks"]["shown"] == 3
    assert {d["stage"] for m in doc["messages"] for b in m["blocks"] for d in b["decisions"]} == {"tombstone"}
    changed = _why(syn["out"], SYN_SID, "--changed")
    assert {b["status"] for m in changed["messages"] for b in m["blocks"]} == {"changed", "dropped"}
    everything = _why(syn["out"], SYN_SID)
    assert everything["blocks"]["shown"] == everything["blocks"]["visible"] + everything["blocks"]["dropped"]
    bad = cli("why", syn["out"], SYN_SID, "--stage", "tombstones")
    assert bad.exit_code == 2
    assert one_error_line(bad) == ("ctxreplay: unknown stage 'tombstones'. Did you mean 'tombstone'? Stages: auto_compact, "
                                   "images, inter_session, pairing, pairing#2, result_budget, sanitize, snip, tombstone")


def test_long_texts_fold_and_full_unfolds(syn: dict[str, Path]) -> None:
    folded = cli("why", syn["out"], SYN_SID, "--call", 2).stdout
    assert "      │ … 54 lines not shown (--full shows them) …\n" in folded
    full = cli("why", syn["out"], SYN_SID, "--call", 2, "--full").stdout
    assert "lines not shown" not in full and "      │ line 30 of the first listing\n" in full
    doc = _why(syn["out"], SYN_SID, "--call", 2)
    result = next(b for m in doc["messages"] for b in m["blocks"] if b["tool_use_id"] == "toolu_syn_A" and b["block_type"] == "tool_result")
    assert (result["text"]["folded"], result["text"]["elided_lines"], result["text"]["lines"]) == (True, 54, 60)
    doc_full = _why(syn["out"], SYN_SID, "--call", 2, "--full")
    result = next(b for m in doc_full["messages"] for b in m["blocks"] if b["tool_use_id"] == "toolu_syn_A" and b["block_type"] == "tool_result")
    assert result["text"]["folded"] is False and result["text"]["text"].count("\n") == 59


def test_diff_against_the_transcript_as_recorded(syn: dict[str, Path]) -> None:
    doc = _why(syn["out"], SYN_SID, "--diff")
    ident = pl.read_parquet(syn["ident"] / "calls.parquet").filter(pl.col("is_pending"))
    rec = doc["recorded"]
    assert rec["request_sha256"] == ident["request_sha256"][0] != doc["request_sha256"]
    assert rec["first_difference"] == 0  # the resized image is in the first message
    cleared = [b for m in doc["messages"] for b in m["blocks"] if b["status"] == "changed" and b["block_type"] == "tool_result"]
    assert len(cleared) == 3
    for b in cleared:
        assert b["recorded"]["text"]["text"].startswith(("line 0 of the first listing", "row 0: xxx"))
        assert b["recorded"]["diff"]["text"].splitlines()[-1] == "+[Old tool result content cleared]"
    out = cli("why", syn["out"], SYN_SID, "--diff", "--stage", "tombstone").stdout
    assert "recorded (identity, no stage): sha256 " in out and "first difference at wire message 0" in out
    assert "      recorded → replayed:\n" in out and "      +[Old tool result content cleared]\n" in out


def test_bad_calls_and_threads_are_exit_2(syn: dict[str, Path]) -> None:
    r = cli("why", syn["out"], SYN_SID, "--call", 17)
    assert r.exit_code == 2
    assert one_error_line(r) == f"ctxreplay: thread '{SYN_SID}' has calls 0..16 (16 is the pending call); got --call 17"
    r = cli("why", syn["out"], "zz")
    assert r.exit_code == 2 and one_error_line(r) == f"ctxreplay: no thread 'zz' in {syn['out']}. See them with: " \
                                                     f"ctxreplay threads {syn['out']}"


def test_a_transcript_changed_since_the_run_is_refused(syn: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(syn["src"], src)
    out = tmp_path / "o"
    assert cli("run", src, "--out", out, "-q", "--fast-tokens").exit_code == 0
    f = next(src.rglob("*.jsonl"))
    lines = f.read_bytes().splitlines()
    # the session went on: one more answer
    answer = lines[-2].replace(b"File 6 read.", b"Done.").replace(b"msg_syn_", b"msg_new_").replace(b"req_syn_", b"req_new_")
    answer = answer.replace(b'"uuid": "00000000-0000-4000-8000-000000000042"', b'"uuid": "00000000-0000-4000-8000-0000000000ff"')
    grown = orjson.loads(answer)
    grown["parentUuid"] = orjson.loads(lines[-1])["uuid"]
    grown["uuid"] = "00000000-0000-4000-8000-0000000000ff"
    f.write_bytes(b"\n".join([*lines, orjson.dumps(grown)]) + b"\n")
    r = cli("why", out, SYN_SID)
    assert r.exit_code == 2
    assert one_error_line(r) == (f"ctxreplay: the transcript of thread {SYN_SID} changed since the run (it now has 17 "
                                 f"calls before the pending one, the run had 16); re-run `ctxreplay run ... --out "
                                 f"{out}` to inspect it")
    # same calls, an edited line
    f.write_bytes(b"\n".join(lines).replace(b"Both files are listings.", b"Both files are lists.") + b"\n")
    r = cli("why", out, SYN_SID)
    assert r.exit_code == 2
    assert one_error_line(r) == (f"ctxreplay: the transcript of thread {SYN_SID} changed since the run (1 block the "
                                 f"run read is not in it as it was); re-run `ctxreplay run ... --out {out}` to inspect it")
    f.unlink()
    r = cli("why", out, SYN_SID)
    assert r.exit_code == 2 and one_error_line(r).startswith(
        f"ctxreplay: the transcript of session {SYN_SID} is not where the run read it: {f}")


# ---------------------------------------------------------------------------------------- corpus

# every layer that fires on the corpus, in one run: the stress spec of the layer 5-6 properties
# (small window, low caps and triggers) with inter_session added (images never fire on the corpus:
# the small session above covers them)
CORPUS_SPEC = """
[pipeline]
name = "why-corpus"
window_tokens = 30000

[[stage]]
use = "sanitize"

[[stage]]
use = "inter_session"

[[stage]]
use = "pairing"

[[stage]]
use = "result_budget"
max_result_chars = 4000
aggregate_max_chars = 8000

[[stage]]
use = "snip"
reserve_output_tokens = 4000
min_tail_turns = 2

[[stage]]
use = "pairing"

[[stage]]
use = "tombstone"
trigger_tokens = 12000
clear_at_least_tokens = 2000
keep_recent = 3
trigger_idle_seconds = 600
clear_tool_inputs = true
clear_thinking_keep = 2
"""


@pytest.fixture(scope="module")
def corpus_runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("why-corpus")
    spec = base / "spec.toml"
    spec.write_text(CORPUS_SPEC)
    assert cli("run", corpus, "--pipeline", spec, "--out", base / "out", "-q", "--fast-tokens").exit_code == 0
    return {"out": base / "out", "base": base, "corpus": corpus}


def _chosen_calls(decisions: pl.DataFrame, calls: pl.DataFrame) -> list[tuple[str, str, int]]:
    """Per stage, a thread where it decided several times (at least 5 decisions when a thread has
    that many; the shortest such thread, to keep the test quick); in it, the own call where most of
    that stage's decisions apply, and the pending call."""
    own = calls.select("session_id", "thread_id", "call")
    length = own.group_by("session_id", "thread_id").agg(n=pl.len())
    picks = set()
    for _, part in decisions.group_by("stage"):
        ranked = (part.group_by("session_id", "thread_id").len().join(length, on=["session_id", "thread_id"])
                  .with_columns(enough=pl.min_horizontal(pl.col("len"), pl.lit(5)))
                  .sort(["enough", "n", "session_id", "thread_id"], descending=[True, False, False, False]))
        sid, tid = ranked.row(0)[:2]
        mine = own.filter((pl.col("session_id") == sid) & (pl.col("thread_id") == tid))
        froms = part.filter((pl.col("session_id") == sid) & (pl.col("thread_id") == tid))["from_call"]
        best = max(mine["call"].to_list(), key=lambda k: (int((froms <= k).sum()), -k))
        picks |= {(sid, tid, best), (sid, tid, int(mine["call"].max()))}
    return sorted(picks)


@pytest.mark.corpus
def test_corpus_threads_where_each_layer_fired_are_one_to_one(corpus_runs: dict[str, Path]) -> None:
    out = corpus_runs["out"]
    decisions = pl.read_parquet(out / "decisions.parquet")
    assert {"sanitize", "inter_session", "pairing", "result_budget", "snip", "tombstone"} <= set(decisions["stage"])
    calls = pl.read_parquet(out / "calls.parquet")
    final = pl.read_parquet(out / "blocks.parquet")
    picks = _chosen_calls(decisions, calls)
    # the recorded view, from an identity run over the files of the chosen sessions only
    sessions = sorted({sid for sid, _, _ in picks})
    files = sorted(set(final.filter(pl.col("session_id").is_in(sessions))["source_file"].to_list()))
    ident = corpus_runs["base"] / "ident"
    assert cli("run", *files, "--out", ident, "--preset", "identity", "-q", "--fast-tokens").exit_code == 0
    recorded = pl.read_parquet(ident / "blocks.parquet")
    ident_calls = pl.read_parquet(ident / "calls.parquet")
    seen_stages: set[str] = set()
    for sid, tid, k in picks:
        key = calls.filter((pl.col("session_id") == sid) & (pl.col("thread_id") == tid))["thread_key"][0]
        doc = _why(out, key, "--call", k, "--diff")
        want = effective(decisions, final, recorded, sid, tid, k)
        assert shown(doc) == want, (key, k)
        seen_stages |= {w[3] for w in want}
        assert doc["request_sha256_matches"] and doc["wire"]["mapped"]
        assert doc["recorded"]["request_sha256"] == ident_calls.filter(
            (pl.col("thread_key") == key) & (pl.col("call") == k))["request_sha256"][0]
    assert {"sanitize", "inter_session", "pairing", "result_budget", "snip", "tombstone"} <= seen_stages


@pytest.mark.corpus
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["default", "spec"])
def test_every_corpus_call_is_one_to_one(corpus: Path, tmp_path: Path, preset: str) -> None:
    """The corpus calls (every 5th, and each where a decision starts to apply or that is pending),
    with the default preset and with the spec above."""
    if preset == "spec":
        spec = tmp_path / "spec.toml"
        spec.write_text(CORPUS_SPEC)
        flags = ["--pipeline", spec]
    else:
        flags = ["--preset", preset]
    assert cli("run", corpus, *flags, "--out", tmp_path / "out", "-q", "--fast-tokens").exit_code == 0
    assert cli("run", corpus, "--preset", "identity", "--out", tmp_path / "ident", "-q", "--fast-tokens").exit_code == 0
    assert _every_call_is_one_to_one(tmp_path / "out", tmp_path / "ident", diff_every=7, in_process=True,
                                     stride=5) > 1000
