"""Broken and hostile inputs never abort a batch (issue 8): bytes that are not UTF-8, the same
session in two files, hostile ids and file names, images that are not what they claim, a huge
line, empty files; and nothing is ever written outside --out."""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from bench.make_hostile_inputs import animated_gif, bomb_png, cc_entry, cc_session, dump, write_hostile_inputs
from ctxreplay.pipeline.assembly.replay import KEY_MAX, thread_key, thread_key_expr
from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.loaders import load_paths
from ctxreplay.schemas.blocks import BLOCKS
from ctxreplay.schemas.check import check_frame

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "loaders"
CC_SID = "0b5e7c1a-2d3f-4a6b-8c9d-1e2f3a4b5c6d"
CC_FILE = FIX / "claude-code" / f"{CC_SID}.jsonl"
OC_FILE = FIX / "openclaw" / "5a6b7c8d-9e0f-4a1b-8c2d-3e4f5a6b7c8d.jsonl"
CX_FILE = FIX / "codex" / "rollout-2026-01-05T10-00-00-019c0d1e-2f3a-7b4c-9d5e-6f7a8b9c0d1e.jsonl"
REQ_FILE = FIX / "request" / "7e8f9a0b-1c2d-4e3f-8a4b-5c6d7e8f9a0b.json"


def _cli(*args: Any) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


def _blocks(res: Any) -> pl.DataFrame:
    df = pl.from_arrow(res.blocks)
    assert isinstance(df, pl.DataFrame)
    check_frame(df, BLOCKS, where="test")
    return df


def _content(df: pl.DataFrame) -> pl.DataFrame:
    """What a load replays, without where it came from (file paths differ between copies)."""
    return df.drop("source_file", "raw_line").sort("session_id", "thread_id", "order_key", "block_pos", "part_pos")


def _accounted(s: dict[str, Any]) -> None:
    assert s["message_lines"] + s["other_lines"] + s["quarantined_lines"] == s["lines"]


# ---------------------------------------------------------------- defect 1: bytes that are not UTF-8


def test_a_non_utf8_file_beside_good_ones_is_quarantined_losslessly(tmp_path: Path) -> None:
    shutil.copy(CC_FILE, tmp_path / CC_FILE.name)
    (tmp_path / "x.jsonl").write_bytes(b"\xff{}\n")
    alone = load_paths([CC_FILE])
    res = load_paths([tmp_path])
    (q,) = res.quarantine
    assert (Path(q.file).name, q.line, q.code, q.raw) == ("x.jsonl", 1, "invalid_utf8", "\\xff{}")
    assert base64.b64decode(q.raw_base64 or "") == b"\xff{}"
    assert _content(_blocks(res)).equals(_content(_blocks(alone)))  # the good file fully replayed


def test_a_bad_byte_inside_a_json_string_keeps_the_entry(tmp_path: Path) -> None:
    lines = CC_FILE.read_bytes().split(b"\n")
    k = next(i for i, ln in enumerate(lines) if "café".encode() in ln)
    lines[k] = lines[k].replace("café".encode(), b"caf\xff\xfe")
    p = tmp_path / CC_FILE.name
    p.write_bytes(b"\n".join(lines))
    res = load_paths([p])
    assert not res.quarantine
    assert res.stats["invalid_utf8_replaced"] == 2
    (ld,) = res.loads
    assert ld.recovered == [{"file": str(p), "line": k + 1,
                             "note": "2 byte sequence(s) that are not UTF-8 inside JSON strings replaced by U+FFFD"}]
    texts = _blocks(res).filter(pl.col("entry_id") == "aa000001-0000-4000-8000-000000000001")["text"].unique().to_list()
    assert texts == ["Rename frobnicate() to frob() everywhere — caf\ufffd\ufffd naïve 日本語 ✓"]
    ok = _blocks(load_paths([CC_FILE]))
    assert _blocks(res).height == ok.height  # nothing else changed


def test_lone_surrogate_escapes_are_replaced_and_counted(tmp_path: Path) -> None:
    p = tmp_path / "d1000000-0000-4000-8000-000000000004.jsonl"
    p.write_bytes(cc_session("d1000000-0000-4000-8000-000000000004", "lone <1> and <2> end")
                  .replace(b"<1>", b"\\ud800").replace(b"<2>", b"\\udfff"))  # JSON escapes of lone surrogates
    res = load_paths([p])
    assert not res.quarantine and res.stats["lone_surrogates_replaced"] == 2
    assert "lone \ufffd and \ufffd end" in _blocks(res)["text"].to_list()


def test_a_binary_file_named_jsonl_is_quarantined_line_by_line(tmp_path: Path) -> None:
    data = random.Random(5).randbytes(30_000)
    (tmp_path / "binary.jsonl").write_bytes(data)
    res = load_paths([tmp_path])
    (ld,) = res.loads
    ld.check()
    assert ld.format == "unknown" and ld.lines == ld.quarantined_lines > 50
    assert {q.code for q in ld.quarantine} <= {"invalid_utf8", "unknown_format", "invalid_json", "truncated_json"}
    by_line = dict(enumerate(data.split(b"\n"), start=1))
    for q in ld.quarantine:
        q.raw.encode("utf-8")  # displayable: never a lone surrogate
        if q.code == "invalid_utf8":
            assert base64.b64decode(q.raw_base64 or "") == by_line[q.line]



def test_a_crlf_line_of_an_unknown_file_keeps_its_exact_bytes(tmp_path: Path) -> None:
    # a file no loader takes (its first line is not UTF-8) written with CRLF line ends: a line's
    # raw_base64 is every byte of it, the \r included; the text shown leaves the \r out
    lines = [b'{"type":"\xffsession","id":"x"}\r', b'{"type":"message","id":"b1"}\r', b'not json \xfe\r']
    (tmp_path / "crlf.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (ld,) = load_paths([tmp_path]).loads
    assert ld.format == "unknown"
    bad = {q.line: q for q in ld.quarantine if q.code == "invalid_utf8"}
    assert sorted(bad) == [1, 3]
    for n, q in bad.items():
        assert base64.b64decode(q.raw_base64 or "") == lines[n - 1]
        assert not q.raw.endswith("\r")

def test_request_json_with_bad_bytes(tmp_path: Path) -> None:
    good = tmp_path / "d1000000-0000-4000-8000-000000000002.json"
    good.write_bytes(b'{"model":"claude-x","messages":[{"role":"user","content":"hi \xff there"},'
                     b'{"role":"assistant","content":"hello"}]}\n')
    broken = tmp_path / "d1000000-0000-4000-8000-000000000003.json"
    broken.write_bytes(b'{"model":"claude-x",\xff"messages":[]}\n')
    res = load_paths([tmp_path])
    assert res.stats["invalid_utf8_replaced"] == 1
    assert "hi \ufffd there" in _blocks(res)["text"].to_list()
    assert res.skipped == [{"file": str(broken), "reason": "a .json file that does not parse as one JSON "
                                                           "document (it holds bytes that are not UTF-8)"}]


def test_run_over_good_and_bad_bytes_exits_0_and_accounts_every_line(tmp_path: Path) -> None:
    inp = tmp_path / "in"
    shutil.copytree(FIX, inp)
    (inp / "x.jsonl").write_bytes(b"\xff{}\n")
    (inp / "binary.jsonl").write_bytes(random.Random(1).randbytes(5000))
    lines = CX_FILE.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b"Fix the typo", b"Fix \xe9 the typo")  # latin-1 inside a string
    (inp / "codex" / CX_FILE.name).write_bytes(b"\n".join(lines))
    r = _cli("run", inp, "--out", tmp_path / "o", "--json", "--fast-tokens", "-q")
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    s = json.loads(r.stdout)
    _accounted(s)
    good = json.loads(_cli("run", FIX, "--out", tmp_path / "g", "--json", "--fast-tokens", "-q").stdout)
    assert s["calls"] == good["calls"] and s["message_lines"] == good["message_lines"]  # all replayed
    assert s["quarantine_codes"]["invalid_utf8"] == s["quarantined_lines"] >= 2
    assert s["loader_stats"]["invalid_utf8_replaced"] == 1
    q = pl.read_parquet(tmp_path / "o" / "quarantine.parquet")
    assert q.filter(pl.col("file").str.ends_with("x.jsonl"))["raw_base64"].to_list() == [
        base64.b64encode(b"\xff{}").decode()]
    strict = _cli("run", inp, "--out", tmp_path / "o2", "--strict", "--fast-tokens", "-q")
    assert strict.exit_code == 1  # done, but quarantined lines under --strict


# ---------------------------------------------------------------- defect 6: one session in two files


@pytest.mark.parametrize("src", [CC_FILE, OC_FILE, CX_FILE, REQ_FILE], ids=["claude_code", "openclaw", "codex", "request"])
def test_a_session_copied_to_two_folders_is_read_once(tmp_path: Path, src: Path) -> None:
    for d in ("a", "backup/old"):
        (tmp_path / d).mkdir(parents=True)
        shutil.copy(src, tmp_path / d / src.name)
    alone = load_paths([tmp_path / "a"])
    res = load_paths([tmp_path])
    assert _content(_blocks(res)).equals(_content(_blocks(alone)))
    copy = next(ld for ld in res.loads if "backup" in ld.path)
    copy.check()
    assert copy.other_lines == {"duplicate_entry": copy.lines} and copy.message_lines == 0
    assert res.stats["duplicate_entries"] == copy.lines


def test_an_older_prefix_copy_counts_as_duplicates(tmp_path: Path) -> None:
    for src in (CC_FILE, OC_FILE, CX_FILE):
        lines = src.read_bytes().split(b"\n")
        (tmp_path / "now").mkdir(exist_ok=True)
        (tmp_path / "old").mkdir(exist_ok=True)
        shutil.copy(src, tmp_path / "now" / src.name)
        (tmp_path / "old" / src.name).write_bytes(b"\n".join(lines[: len(lines) // 2]) + b"\n")
    alone = load_paths([tmp_path / "now"])
    res = load_paths([tmp_path])
    assert _content(_blocks(res)).equals(_content(_blocks(alone)))
    for ld in res.loads:
        if "/old/" in ld.path:
            assert ld.other_lines == {"duplicate_entry": ld.lines}


def test_an_entry_repeated_with_other_content_is_kept_apart_and_reported(tmp_path: Path) -> None:
    lines = CC_FILE.read_bytes().split(b"\n")
    k = max(i for i, ln in enumerate(lines) if b'"type":"assistant"' in ln)
    changed = list(lines)
    changed[k] = changed[k].replace(b'"text":"', b'"text":"(edited) ', 1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    shutil.copy(CC_FILE, tmp_path / "a" / CC_FILE.name)
    (tmp_path / "b" / CC_FILE.name).write_bytes(b"\n".join(changed))
    res = load_paths([tmp_path])
    assert res.stats["conflicting_duplicate_entries"] == 1
    assert res.stats["duplicate_entries"] == sum(1 for ln in lines if ln.strip()) - 1
    notes = [r for ld in res.loads for r in ld.recovered if "other content" in r.get("note", "")]
    assert len(notes) == 1 and notes[0]["line"] == k + 1  # in the file read second (the larger is read first)
    df = _blocks(res)
    uid = json.loads(lines[k])["uuid"]
    kept = df.filter(pl.col("entry_id").str.starts_with(uid))
    apart = notes[0]["note"].split("kept apart as ")[1].strip("'")
    assert sorted(set(kept["entry_id"])) == sorted([uid, apart])
    # both versions are replayed, each as a call of its own
    assert sorted(kept.filter(pl.col("block_type") == "text")["text"].unique().str.slice(0, 8).to_list()) == [
        "(edited)", "Renaming"]
    assert kept.filter(pl.col("entry_id") == apart)["is_call"].to_list() == [True]


def test_run_completes_with_copies_of_every_format(tmp_path: Path) -> None:
    for d in ("a", "b"):
        shutil.copytree(FIX, tmp_path / d)
    r = _cli("run", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "o", "--json", "--fast-tokens", "-q")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    _accounted(s)
    one = json.loads(_cli("run", tmp_path / "a", "--out", tmp_path / "o1", "--json", "--fast-tokens", "-q").stdout)
    assert (s["calls"], s["threads"], s["message_lines"]) == (one["calls"], one["threads"], one["message_lines"])
    assert s["other_lines_by_kind"]["duplicate_entry"] == one["lines"]


def _copies_kept_apart(d: Path) -> None:
    """Sessions that need a `~<hash>`: one-file sessions copied with a line of their own (kept apart
    as `<id>~<hash>`), and a request file claiming a Claude Code session's id (its thread `main` made
    unique as `main~<hash>`)."""
    import re

    for src in (OC_FILE, CX_FILE, REQ_FILE):
        data = src.read_bytes()
        last = list(re.finditer(rb'"(text|content)": ?"', data))[-1]  # the last text: the copy's own line
        for sub, body in (("a", data), ("b", data[:last.end()] + b"(edited) " + data[last.end():])):
            (d / sub).mkdir(parents=True, exist_ok=True)
            (d / sub / src.name).write_bytes(body)
    shutil.copy(CC_FILE, d / "a" / CC_FILE.name)
    shutil.copy(REQ_FILE, d / "b" / f"{CC_SID}.json")


def _ids(res: Any) -> list[tuple[str, str]]:
    return sorted(set(_blocks(res).select("session_id", "thread_id").iter_rows()))


def test_session_and_thread_ids_do_not_depend_on_where_the_input_lives(tmp_path: Path) -> None:
    """The `~<hash>` that tells apart two files holding one session is the same for the same files
    at another path (a checkout in another directory, CI): it is made of what the file holds and
    its name, never of its directory."""
    _copies_kept_apart(tmp_path / "here" / "in")
    shutil.copytree(tmp_path / "here", tmp_path / "elsewhere" / "deeper")
    here = load_paths([tmp_path / "here" / "in"])
    ids = _ids(here)
    assert len({sid for sid, _ in ids if "~" in sid}) == 3 and sum("~" in tid for _, tid in ids) == 1  # all 4 cases
    assert _ids(load_paths([tmp_path / "elsewhere" / "deeper" / "in"])) == ids
    import os

    cwd = os.getcwd()
    try:
        os.chdir(tmp_path / "here")
        assert _ids(load_paths([Path("in")])) == ids  # a relative path, as a CI job passes it
    finally:
        os.chdir(cwd)


def test_a_gemini_cli_copy_kept_apart_has_the_same_id_wherever_it_lives(tmp_path: Path) -> None:
    from tests.geminikit import SID, GeminiSession, standard, write_json, write_jsonl

    s = standard()
    other = GeminiSession(messages=[*s.messages[:3], {**s.messages[3], "id": "elsewhere"}])
    for where in ("here", "there/deeper"):
        write_json(tmp_path / where / "a" / "session-x.json", other.document())
        write_jsonl(tmp_path / where / "b" / "session-x.jsonl", s.records())
    ids = _ids(load_paths([tmp_path / "here"]))
    assert len({sid for sid, _ in ids if sid.startswith(f"{SID}~")}) == 1
    assert _ids(load_paths([tmp_path / "there" / "deeper"])) == ids


def test_diff_of_identical_inputs_at_another_path_is_identical(tmp_path: Path) -> None:
    _copies_kept_apart(tmp_path / "one" / "in")
    shutil.copytree(tmp_path / "one" / "in", tmp_path / "two" / "in")
    golden = tmp_path / "golden"
    r = _cli("snapshot", tmp_path / "one" / "in", "--golden", golden, "--fast-tokens", "-q")
    assert r.exit_code == 0, r.output
    r = _cli("diff", tmp_path / "two" / "in", "--golden", golden, "--json", "-q")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["identical"] is True, doc


@pytest.mark.corpus
def test_a_corpus_session_copied_to_two_folders(corpus: Path, tmp_path: Path) -> None:
    picks = [next((corpus / "claude-code").glob("*03eb5929*.jsonl")),
             next((corpus / "openclaw").glob("*e3063350*.jsonl")),
             next((corpus / "codex").glob("*.jsonl"))]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        for p in picks:
            shutil.copy(p, tmp_path / d / p.name)
    r = _cli("run", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "o", "--json", "--fast-tokens", "-q")
    assert r.exit_code == 0, r.output
    one = _cli("run", tmp_path / "a", "--out", tmp_path / "o1", "--json", "--fast-tokens", "-q")
    s, s1 = json.loads(r.stdout), json.loads(one.stdout)
    _accounted(s)
    assert s["other_lines_by_kind"]["duplicate_entry"] == s1["lines"]
    k = ["session_id", "thread_id", "call"]
    both = pl.read_parquet(tmp_path / "o" / "calls.parquet").sort(k).select(*k, "request_sha256")
    single = pl.read_parquet(tmp_path / "o1" / "calls.parquet").sort(k).select(*k, "request_sha256")
    assert both.equals(single)


# ---------------------------------------------------------------- hostile ids and names


def _safe_name(key: str) -> None:
    name = f"{key}.jsonl"
    assert "/" not in name and "\0" not in name and key not in ("", ".", "..")
    assert len(name.encode("utf-8")) <= 255
    assert not key.startswith(("-", ".")), key  # never read as an option (`--help--main`), never a hidden file


@pytest.mark.parametrize("sid, tid", [
    ("../../x", "main"), ("a/b", "main"), ("..", "main"), (".", "main"), ("", "main"), ("a\0b", "main"),
    ("x" * 300, "main"), ("é" * 200, "agent-" + "y" * 300), ("s", "../../t"), ("s", "."), ("s", ""),
    ("-rf", "main"), ("--help", "main"), ("-", "x"), (".hidden", "main"), ("ABC", "main")])
def test_thread_key_is_always_a_safe_file_name(sid: str, tid: str) -> None:
    _safe_name(thread_key(sid, tid))


def test_plain_thread_keys_are_unchanged() -> None:
    assert thread_key("5f0c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f", "main") == "5f0c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f"
    assert thread_key("abc", "agent-a1b2c3d") == "abc--agent-a1b2c3d"
    assert thread_key("abc", "branch-1f2e3d4c") == "abc--branch-1f2e3d4c"
    assert len(thread_key("a" * KEY_MAX, "main")) == KEY_MAX
    assert "~" in thread_key("a" * (KEY_MAX + 1), "main")


def test_thread_keys_of_look_alike_ids_differ() -> None:
    pairs = [("a/b", "main"), ("a_b", "main"), ("a b", "main"), ("a--b", "main"), ("a", "b"), ("A_B", "main"),
             ("a_B", "main"), ("x" * 300, "main"), ("x" * 301, "main"), ("a", "b/c"), ("a", "b_c"), ("a--b", "c"),
             ("a", "b--c"), ("", "main"), (".", "main"), ("..", "main"), ("_", "main")]
    keys = [thread_key(s, t) for s, t in pairs]
    assert len({k.lower() for k in keys}) == len(pairs)  # distinct even on a case-insensitive file system


ids = st.text(alphabet=st.sampled_from(list("aAb-_./~ \0é")), max_size=12) | st.text(max_size=30)


@given(st.lists(st.tuples(ids, ids | st.just("main")), min_size=2, max_size=8, unique=True))
def test_thread_key_is_injective_and_safe(pairs: list[tuple[str, str]]) -> None:
    keys = [thread_key(s, t) for s, t in pairs]
    assert len({k.lower() for k in keys}) == len(pairs)
    for k in keys:
        _safe_name(k)
    df = pl.DataFrame({"session_id": [s for s, _ in pairs], "thread_id": [t for _, t in pairs]})
    assert df.select(thread_key_expr()).to_series().to_list() == keys  # the expression agrees


def test_hostile_ids_and_names_stay_inside_out(tmp_path: Path) -> None:
    inp = tmp_path / "in"
    for k, hid in enumerate(["../../escape", "a/b/../../c", "..", ".", "", "nul\u0000id", "z" * 300, "/etc/x"]):
        (inp / f"ids-{k}.jsonl").parent.mkdir(parents=True, exist_ok=True)
        (inp / f"ids-{k}.jsonl").write_bytes(cc_session(hid, "hi", agentId="../../agent"))
    (inp / os.fsdecode(b"bad-\xff-name.jsonl")).write_bytes(cc_session("d3000000-0000-4000-8000-000000000005", "b"))
    (inp / ("n" * 244 + ".jsonl")).write_bytes(cc_session("d3000000-0000-4000-8000-000000000006", "long"))
    (inp / "...jsonl").write_bytes(cc_session("d3000000-0000-4000-8000-000000000007", "dots"))
    oc = [{"type": "session", "version": 3, "id": "../../oc", "timestamp": "2026-04-01T10:00:00Z"},
          {"type": "message", "id": "../x", "parentId": None, "message": {"role": "user", "content": "hi"}},
          {"type": "message", "id": "a/b", "parentId": "../x", "message": {"role": "assistant", "content": "1"}},
          {"type": "message", "id": "\0" + "q" * 300, "parentId": "../x",
           "message": {"role": "assistant", "content": "2"}}]
    (inp / "hostile-openclaw.jsonl").write_bytes(b"".join(dump(o) + b"\n" for o in oc))
    before = sorted(p for p in tmp_path.rglob("*"))
    out = tmp_path / "work" / "o"
    r = _cli("run", inp, "--out", out, "--json", "--fast-tokens", "-q", "--all-calls")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    _accounted(s)
    assert s["quarantined_lines"] == 0 and s["sessions"] == 12
    after = sorted(p for p in tmp_path.rglob("*") if out not in p.parents and p != out)
    assert after == before + [tmp_path / "work"]  # nothing written anywhere but --out
    keys = pl.read_parquet(out / "calls.parquet")["thread_key"].unique().to_list()
    files = {p.name for p in (out / "requests").iterdir()}
    assert files == {f"{k}.json" for k in keys} | {f"{k}.jsonl" for k in keys}
    for k in keys:
        _safe_name(k)
    assert any(f.startswith("bad-\\xff-name") for f in {Path(x).name for x in
                                                       pl.read_parquet(out / "blocks.parquet")["source_file"]})


# ---------------------------------------------------------------- images that are not what they claim


def _image_session(tmp_path: Path, data: bytes, media: str) -> Path:
    sid = "d5000000-0000-4000-8000-000000000001"
    p = tmp_path / f"{sid}.jsonl"
    p.write_bytes(cc_session(sid, [{"type": "text", "text": "see"}, {"type": "image", "source": {
        "type": "base64", "media_type": media, "data": base64.b64encode(data).decode()}}]))
    return p


def test_image_decisions_on_hostile_images() -> None:
    import time

    from ctxreplay.stages.images import Images, fit_image

    p = Images()
    t = time.perf_counter()
    bomb = fit_image(base64.b64encode(bomb_png()).decode(), "image/png", p)
    assert time.perf_counter() - t < 1.0  # refused by its header, never decoded
    assert (bomb.status, bomb.reason) == ("omit", f"pixel count exceeds {p.max_pixels}")
    just_over = fit_image(base64.b64encode(bomb_png(8001, 8001)).decode(), "image/png", p)
    assert just_over.status == "omit" and "pixel count" in (just_over.reason or "")
    assert fit_image(base64.b64encode(b"plain text, not an image").decode(), "image/png", p).status == "omit"
    gif = fit_image(base64.b64encode(animated_gif()).decode(), "image/gif", p)
    assert (gif.status, gif.media_type, gif.width, gif.height) == ("keep", "image/gif", 24, 16)


def test_hostile_images_run_end_to_end(tmp_path: Path) -> None:
    sid = "d5000000-0000-4000-8000-000000000001"
    (tmp_path / "in").mkdir()

    def img(d: bytes, m: str) -> dict[str, Any]:
        return {"type": "image", "source": {"type": "base64", "media_type": m, "data": base64.b64encode(d).decode()}}

    (tmp_path / "in" / f"{sid}.jsonl").write_bytes(cc_session(sid, [
        {"type": "text", "text": "see"}, img(bomb_png(), "image/png"), img(b"not an image", "image/png"),
        img(animated_gif(), "image/gif")]))
    r = _cli("run", tmp_path / "in", "--out", tmp_path / "o", "--json", "--fast-tokens", "-q")
    assert r.exit_code == 0, r.output
    d = pl.read_parquet(tmp_path / "o" / "decisions.parquet").filter(pl.col("stage") == "images")
    # the bomb (block 1) and the text bytes (block 2) are replaced by a placeholder; the GIF stays
    assert d.sort("block_pos").select("block_pos", "action", "reason").rows() == [
        (1, "replace", "image_omitted"), (2, "replace", "image_omitted")]
    req = json.loads((tmp_path / "o" / "requests" / f"{sid}.json").read_text())
    kinds = [b["type"] for m in req["messages"] for b in (m["content"] if isinstance(m["content"], list) else [])]
    assert kinds.count("image") == 1  # only the GIF is sent


# ---------------------------------------------------------------- size extremes


def test_empty_and_blank_files(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_bytes(b"\n \n\t\r\n")
    (tmp_path / "empty.json").write_bytes(b"")
    res = load_paths([tmp_path])
    assert [(Path(ld.path).name, ld.format, ld.lines) for ld in res.loads] == [
        ("blank.jsonl", "empty", 0), ("empty.jsonl", "empty", 0)]
    assert res.skipped == [{"file": str(tmp_path / "empty.json"), "reason": "an empty .json file"}]
    r = _cli("run", tmp_path, "--out", tmp_path / "o", "--json", "--fast-tokens", "-q")
    assert "Traceback" not in r.output


def _huge(tmp_path: Path, mb: int) -> Path:
    sid = "d4000000-0000-4000-8000-000000000001"
    p = tmp_path / f"{sid}.jsonl"
    with open(p, "wb") as f:
        f.write(dump(cc_entry(sid, "u1", None, "user", "y" * (mb * 1024 * 1024))) + b"\n")
        f.write(dump(cc_entry(sid, "a1", "u1", "assistant", [{"type": "text", "text": "long"}])) + b"\n")
    return p


def test_a_large_single_line_loads(tmp_path: Path) -> None:
    res = load_paths([_huge(tmp_path, 8)])
    assert _blocks(res)["text"].str.len_bytes().max() == 8 * 1024 * 1024


@pytest.mark.slow
def test_a_100mb_single_line_loads_with_sane_memory(tmp_path: Path) -> None:
    import resource

    from ctxreplay.pipeline.loaders.inputs import MAX_LINE_BYTES

    p = _huge(tmp_path, 100)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    token = MAX_LINE_BYTES.set(128 << 20)  # over the default limit (64 MiB): read it (--max-line-bytes 128M)
    try:
        res = load_paths([p])
    finally:
        MAX_LINE_BYTES.reset(token)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert _blocks(res)["text"].str.len_bytes().max() == 100 * 1024 * 1024
    assert grown_mb < 100 * 8  # a few copies of the line (bytes, text, parsed value, Arrow), not more
    res.loads[0].check()


# ---------------------------------------------------------------- the hostile directory


def _hostile_run(tmp_path: Path, extra: list[Path], huge_mb: float) -> dict[str, Any]:
    hostile = tmp_path / "hostile"
    write_hostile_inputs(hostile, huge_mb=huge_mb, seed=3)
    before = sorted(tmp_path.rglob("*"))
    out = tmp_path / "o"
    r = _cli("run", *extra, hostile, "--out", out, "--json", "--fast-tokens", "-q")
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output and "Traceback" not in (r.stderr if r.stderr_bytes else "")
    s = json.loads(r.stdout)
    _accounted(s)
    assert sorted(p for p in tmp_path.rglob("*") if out not in p.parents and p != out) == before
    # every line of every input file is counted once
    files = {Path(f["file"]).name for f in s["skipped_files"]}
    assert s["files"] + len(files - {"README.md"}) >= 150
    q = pl.read_parquet(out / "quarantine.parquet")
    assert q.height == s["quarantined_lines"]
    assert set(q["code"].unique()) >= {"invalid_utf8", "truncated_json", "too_deep", "not_an_object", "no_type"}
    return s


@pytest.mark.slow
def test_cli_over_the_hostile_directory(tmp_path: Path) -> None:
    s = _hostile_run(tmp_path, [], huge_mb=1)
    assert s["loader_stats"]["duplicate_session_files"] >= 5
    assert s["loader_stats"]["conflicting_duplicate_entries"] >= 1


@pytest.mark.slow
@pytest.mark.corpus
def test_cli_over_the_corpus_and_the_hostile_directory(corpus: Path, tmp_path: Path) -> None:
    s = _hostile_run(tmp_path, [corpus], huge_mb=1)
    alone = json.loads(_cli("run", corpus, "--out", tmp_path / "c", "--json", "--fast-tokens", "-q").stdout)
    assert s["lines"] > alone["lines"] and s["message_lines"] > alone["message_lines"]
    by_sid = pl.read_parquet(tmp_path / "o" / "calls.parquet")
    corpus_calls = pl.read_parquet(tmp_path / "c" / "calls.parquet")
    k = ["session_id", "thread_id", "call", "request_sha256"]
    # every corpus call is replayed exactly as without the hostile files
    assert corpus_calls.select(k).join(by_sid.select(k), on=k, how="anti").height == 0


# ---------------------------------------------------------------- what reaches the terminal (issue 23, items 12, 14)


def test_a_thread_key_never_reads_as_an_option(tmp_path: Path) -> None:
    """A session id `--help` gives a key that `request` and `why` take as it is, without `--`."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "dash.jsonl").write_bytes(cc_session("--help", "dash"))
    out = tmp_path / "o"
    assert _cli("run", tmp_path / "in", "--out", out, "-q", "--fast-tokens").exit_code == 0
    (key,) = pl.read_parquet(out / "calls.parquet")["thread_key"].unique().to_list()
    assert key.startswith("_-help")
    r = _cli("request", out, key)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["messages"][0]["content"][0]["text"] == "dash"


def _printed(r: Any) -> str:
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    return r.output


def test_control_characters_are_escaped_in_everything_printed(tmp_path: Path) -> None:
    """A session id and a model name holding `ESC ] 0 ; PWNED BEL ESC [ 2 J` and a newline, a file
    name with the same: every human-readable printer shows them escaped (`\\x1b`), each table row
    on one line; --json keeps the values as they are (its encoder escapes them)."""
    from bench.make_hostile_inputs import TERMINAL_ESCAPES, escapes_session

    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "session.jsonl").write_bytes(escapes_session())
    (inp / f"notes{TERMINAL_ESCAPES}.txt").write_bytes(b"not a transcript")  # listed under skipped files
    out = tmp_path / "o"
    texts = {"run": _printed(_cli("run", inp, "--out", out, "--fast-tokens"))}
    s = json.loads(_cli("run", inp, "--out", tmp_path / "o2", "--json", "--fast-tokens").stdout)
    sid = f"esc{TERMINAL_ESCAPES}\nsession"
    assert s["sessions"] == 1
    th = json.loads(_printed(_cli("threads", out, "--json")))["threads"]
    assert [t["session_id"] for t in th] == [sid]  # JSON: the value itself
    key = th[0]["thread_key"]
    texts["threads"] = _printed(_cli("threads", out))
    for by in ("session", "model", "day", "project"):
        texts[f"report --by {by}"] = _printed(_cli("report", inp, "--by", by))
    texts["report --sim"] = _printed(_cli("report", "--sim", out, "--calls"))
    texts["report --breaks"] = _printed(_cli("report", "--breaks", out))
    texts["ledger"] = _printed(_cli("ledger", out))
    texts["why"] = _printed(_cli("why", out, key))
    for name, text in texts.items():
        bad = sorted({c for c in text if (ord(c) < 32 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F})
        assert not bad, (name, bad, text)
    for name in ("threads", "report --by session", "report --by model", "report --sim"):
        assert "\\x1b]0;PWNED\\x07\\x1b[2J" in texts[name], (name, texts[name])
    assert "[/x]" in texts["report --by model"]  # rich markup in a model name is shown, not read
    assert "notes\\x1b]0;PWNED\\x07\\x1b[2J.txt" in texts["run"]
    # the threads table: a header, one line per thread, the totals line (a newline in an id stays in its cell)
    lines = texts["threads"].splitlines()
    assert len(lines) == 3 and lines[1].startswith("esc\\x1b]0;P/session  main")


def test_every_control_character_is_escaped() -> None:
    from ctxreplay.pipeline.core.termtext import shown, terminal_text

    assert shown("a\x1b[2J\x07\nb\t\r\x00\x7f\x9b\u202e\u2028z é 日本") == (
        "a\\x1b[2J\\x07\\nb\\t\\r\\x00\\x7f\\x9b\\u202e\\u2028z é 日本")
    assert terminal_text("line 1\x1b[2J\n\tline 2\r\x9b") == "line 1\\x1b[2J\n\tline 2\\r\\x9b"
    assert shown(None) == "None" and shown("plain") == "plain"


@given(st.text())
def test_shown_text_holds_no_control_character(text: str) -> None:
    import unicodedata

    from ctxreplay.pipeline.core.termtext import shown, terminal_text

    assert not any(unicodedata.category(c) == "Cc" for c in shown(text))
    assert all(c in "\n\t" for c in terminal_text(text) if unicodedata.category(c) == "Cc")


def _many_sessions(d: Path, n: int) -> None:
    d.mkdir()
    for k in range(n):
        sid = f"d9000000-0000-4000-8000-{k:012d}"
        (d / f"{sid}.jsonl").write_bytes(cc_session(sid, "hi"))


@pytest.mark.parametrize("args", [["report", "{inp}"], ["report", "{inp}", "--by", "model"], ["threads", "{out}"]],
                         ids=["report", "report-by-model", "threads"])
def test_a_reader_that_goes_away_ends_the_command_with_141(tmp_path: Path, args: list[str]) -> None:
    """`ctxreplay report ... | head -1` exits 141 (SIGPIPE), as `threads | head` and Unix tools do,
    not 1 (rich's own broken-pipe handling); nothing on stderr."""
    import fcntl
    import subprocess
    import sys

    inp, out = tmp_path / "in", tmp_path / "o"
    _many_sessions(inp, 400)  # a table longer than a pipe's buffer: the write after the first line fails
    if "{out}" in args:
        assert _cli("run", inp, "--out", out, "-q", "--fast-tokens").exit_code == 0
    cmd = [sys.executable, "-m", "ctxreplay.pipeline.commands.cli", *(a.format(inp=inp, out=out) for a in args)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    # a one-page pipe (Linux), set while the command is still starting: the output is many times larger,
    # so it cannot all fit in the pipe before the reader goes away (with the default 64 KiB, the ~48 kB
    # `threads` listing sometimes did, and the command rightly exited 0)
    fcntl.fcntl(p.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)
    first = p.stdout.readline()
    p.stdout.close()  # what `head -1` does after its line
    err = p.stderr.read()
    p.stderr.close()
    assert p.wait(timeout=120) == 141, err
    assert first and not err


# ---------------------------------------------------------------- files that vanish, links and FIFOs (issue 23, items 4, 9)


def _within(seconds: float, fn: Any, fifo: Path) -> Any:
    """fn() in a thread, failing the test when it has not returned after `seconds` (it opened the
    FIFO `fifo` and waits for a writer: the test gives it one, so that nothing stays blocked)."""
    import stat
    import threading

    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(result=fn()), daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        if fifo.exists() and stat.S_ISFIFO(fifo.stat().st_mode):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the reader's open returns, then reads EOF
        t.join(30)
        pytest.fail(f"still running after {seconds} s: it opened the FIFO {fifo} and waited")
    return box["result"]


@pytest.mark.parametrize("how", ["deleted", "renamed", "fifo", "directory"])
@pytest.mark.parametrize("victim", ["openclaw", "claude-code"])
def test_a_file_that_vanishes_after_listing_is_skipped_and_the_run_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, victim: str) -> None:
    """Between the listing of the inputs and their reading, one file is deleted, renamed as OpenClaw
    does on a session reset, or replaced by a FIFO or a directory: it is listed in skipped_files
    with the reason and every other file is replayed (exit 0); a FIFO is never opened."""
    from bench.make_hostile_inputs import vanish
    from ctxreplay.pipeline.batch import batches

    inp = tmp_path / "in"
    shutil.copytree(FIX, inp)
    gone = next((inp / victim).glob("*.jsonl"))
    listed = batches.discover

    def discover_then_vanish(paths: Any, **kw: Any) -> Any:
        got = listed(paths, **kw)
        vanish(gone, how)
        return got

    monkeypatch.setattr(batches, "discover", discover_then_vanish)
    r = _within(120, lambda: _cli("run", inp, "--out", tmp_path / "o", "--json", "--fast-tokens", "-q", "--jobs", "1"),
                gone)
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    _accounted(s)
    (skip,) = [x for x in s["skipped_files"] if x["file"] == str(gone)]
    assert {"deleted": "gone since", "renamed": "gone since", "fifo": "a FIFO, not a regular file",
            "directory": "a directory, not a regular file"}[how] in skip["reason"]
    monkeypatch.undo()
    (inp / victim).mkdir(exist_ok=True)
    shutil.rmtree(inp / victim)
    alone = json.loads(_cli("run", inp, "--out", tmp_path / "o2", "--json", "--fast-tokens", "-q").stdout)
    assert (s["sessions"], s["calls"], s["lines"]) == (alone["sessions"], alone["calls"], alone["lines"])


def test_open_input_never_blocks_on_a_fifo_nor_reads_a_device(tmp_path: Path) -> None:
    from ctxreplay.pipeline.loaders.inputs import NotARegularFile, open_input

    os.mkfifo(tmp_path / "fifo.jsonl")
    for p in (tmp_path / "fifo.jsonl", Path("/dev/zero"), tmp_path):
        with pytest.raises(NotARegularFile):
            open_input(p)
    res = load_paths([tmp_path / "fifo.jsonl", tmp_path / "gone.jsonl"], listed=True)  # a batch of a run
    assert [x["reason"].split(",")[0] for x in res.skipped] == ["a FIFO", "gone since the run listed it (deleted"]


def _run_subprocess(*args: Any, timeout: int = 120) -> Any:
    """The CLI in its own process with a time limit: a FIFO read by mistake blocks, not the test run."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "ctxreplay.pipeline.commands.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_links_out_of_the_tree_fifos_and_devices_are_skipped_and_reported(tmp_path: Path) -> None:
    from bench.make_hostile_inputs import SECRET, special_inputs

    d = tmp_path / "in"
    expect = special_inputs(d, tmp_path / "outside")
    r = _run_subprocess("run", d, "--out", tmp_path / "o", "--json", "--fast-tokens", "-q")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    reasons = {Path(x["file"]).name: x["reason"] for x in s["skipped_files"]}
    assert set(reasons) == set(expect), reasons
    for name, words in expect.items():
        assert words in reasons[name], (name, reasons[name])
    assert s["sessions"] == 1 and s["files"] == 1  # the session inside, read once (inside.jsonl is a link to it)
    q = pl.read_parquet(tmp_path / "o" / "quarantine.parquet")
    assert q.height == 0  # neither the secret nor the environment was read
    # report lists the same files and reads none of them
    rep = _run_subprocess("report", d, "--json")
    assert rep.returncode == 0, rep.stderr
    doc = json.loads(rep.stdout)
    assert {Path(b["file"]).name for b in doc["bad_lines"]} == set(expect) and doc["files"] == 1
    # with --follow-links the links out are read (the secret then lands in quarantine.parquet, as
    # any file of no known format); a FIFO or a device still never is
    r = _run_subprocess("run", d, "--out", tmp_path / "f", "--json", "--fast-tokens", "-q", "--follow-links")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["sessions"] == 2  # the session outside, through the link to its directory
    reasons = {Path(x["file"]).name: x["reason"] for x in s["skipped_files"]}
    assert "fifo.jsonl" in reasons and "zero.jsonl" in reasons and "secret.jsonl" not in reasons
    raw = pl.read_parquet(tmp_path / "f" / "quarantine.parquet")["raw"].to_list()
    assert SECRET.decode().strip() in raw


def test_paths_given_by_name_are_read_even_through_a_link_but_never_a_fifo(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    shutil.copy(CC_FILE, tmp_path / "x" / CC_FILE.name)
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "x" / CC_FILE.name)
    os.mkfifo(tmp_path / "fifo.jsonl")
    res = load_paths([tmp_path / "link.jsonl", tmp_path / "fifo.jsonl"])
    assert [ld.path for ld in res.loads] == [str(tmp_path / "link.jsonl")]
    assert res.skipped == [{"file": str(tmp_path / "fifo.jsonl"), "reason": "a FIFO, not a regular file: never read"}]


# ---------------------------------------------------------------- what is written outside --out (issue 23, item 14)


def _tree(root: Path, but: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p != but and but not in p.parents)


def test_outside_out_only_the_price_cache_is_written_and_no_cache_writes_nothing(tmp_path: Path) -> None:
    """docs/running.md lists what a command writes outside --out; for a run and a report that is the
    price cache (~/.cache/ctxreplay, $XDG_CACHE_HOME/ctxreplay, $CTXREPLAY_CACHE_DIR), and with
    --no-cache nothing at all: not in HOME, not in the temp directory, not in the current directory."""
    import subprocess
    import sys

    home, tmp, cwd, out = tmp_path / "home", tmp_path / "tmp", tmp_path / "cwd", tmp_path / "o"
    for d in (home, tmp, cwd):
        d.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "CTXREPLAY_CACHE_DIR")}
    env.update(HOME=str(home), TMPDIR=str(tmp))

    def ctx(*args: Any) -> None:
        r = subprocess.run([sys.executable, "-m", "ctxreplay.pipeline.commands.cli", *map(str, args)], cwd=cwd,
                           env=env, capture_output=True, text=True, timeout=300, check=False)
        assert r.returncode == 0, r.stderr

    samples = ROOT / "data" / "samples"
    ctx("run", samples, "--out", out, "-q", "--fast-tokens")
    (price_file,) = (home / ".cache" / "ctxreplay").iterdir()
    assert price_file.name.startswith("genai-prices-")
    assert _tree(tmp_path, out) == ["cwd", "home", "home/.cache", "home/.cache/ctxreplay",
                                    f"home/.cache/ctxreplay/{price_file.name}", "tmp"]
    shutil.rmtree(home / ".cache")
    ctx("run", samples, "--out", out, "-q", "--fast-tokens", "--no-cache", "--full")
    ctx("report", samples, "--no-cache", "--json")
    assert _tree(tmp_path, out) == ["cwd", "home", "tmp"]
