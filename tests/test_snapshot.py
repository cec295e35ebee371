"""`ctxreplay snapshot`: golden files that are byte-identical run to run, hold no machine paths,
and rebuild every call's request (issue 12.1)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.core.blockops import canonical_json
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.regress.snapshot import (
    GOLDEN_FORMAT_VERSION,
    Golden,
    decode_texts,
    snapshot,
)
from ctxreplay.pipeline.staging.spec import load_spec
from tests.goldenkit import rebuild_every_call, write_policy

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
CODEX = "019a7c21-4d2e-7f10-b3a8-5e6f7a8b9c0d"



def _cli(*args: object) -> object:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _tree(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}




@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("snap")
    g = tmp / "golden"
    r = _cli("snapshot", SAMPLES, "--pipeline", write_policy(tmp), "--golden", g, "--fast-tokens", "-q")
    assert r.exit_code == 0, r.stderr
    return g


def test_snapshot_is_byte_identical_across_runs_cwd_and_path_spelling(golden: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # the same inputs named relative to another working directory, the spec from another place
    monkeypatch.chdir(SAMPLES.parent)
    other = tmp_path / "elsewhere" / "g"
    spec = load_spec(write_policy(tmp_path))
    snapshot([Path("samples")], spec, other, token_counter=CHARS4_COUNTER)
    assert _tree(other) == _tree(golden)


def test_golden_files_hold_no_machine_path_and_no_run_time(golden: Path) -> None:
    for name, data in _tree(golden).items():
        text = data.decode()
        for leak in (str(ROOT), str(golden.parent), os.path.expanduser("~") + "/"):
            assert leak not in text, (name, leak)
        assert not re.search(r"\d{8}T\d{6}\d*Z", text), name  # a run id or a wall-clock stamp
    assert "run_id" not in (golden / "manifest.json").read_text()


def test_manifest_names_format_version_target_pipeline_and_input_hashes(golden: Path) -> None:
    m = json.loads((golden / "manifest.json").read_text())
    spec = load_spec(golden.parent / "policy-2.toml")
    assert m["format"] == "ctxreplay-golden" and m["format_version"] == GOLDEN_FORMAT_VERSION == 2
    assert m["ctxreplay_version"] == "0.1.0" and m["target"] == "anthropic" and m["token_counter"] == CHARS4_COUNTER
    assert m["pipeline"]["sha256"] == spec.sha256 and m["pipeline"]["source"] == "policy-2.toml"
    assert m["pipeline"]["resolved"] == json.loads(orjson.dumps(spec.resolved()))
    files = {p.relative_to(SAMPLES).as_posix(): p for p in SAMPLES.rglob("*") if p.is_file()}
    assert set(m["inputs"]["files"]) == set(files)
    for key, info in m["inputs"]["files"].items():
        assert info["sha256"] == hashlib.sha256(files[key].read_bytes()).hexdigest()
        assert info["bytes"] == files[key].stat().st_size
    assert m["sessions"]["5f0c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f"] == [
        "claude-projects/-home-dev-demo/5f0c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f.jsonl",
        "claude-projects/-home-dev-demo/5f0c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f/subagents/agent-a1b2c3d.jsonl"]
    assert sorted(m["threads"]) == sorted(p.name for p in (golden / "threads").iterdir())
    assert m["totals"]["calls"] == sum(t["calls"] for t in m["threads"].values()) == 36


def test_goldens_rebuild_every_call_request_byte_for_byte(golden: Path) -> None:
    assert rebuild_every_call(Golden(golden)) == 36


def test_messages_file_holds_only_what_no_pending_request_holds(golden: Path) -> None:
    lines = (golden / "messages.jsonl").read_bytes().splitlines()
    g = Golden(golden)
    shas = [orjson.loads(x)[0] for x in lines]
    assert shas == sorted(shas) and lines
    for line in lines:
        sha, enc = orjson.loads(line)
        assert hashlib.sha256(canonical_json(decode_texts(enc, g.text))).hexdigest() == sha
    in_pending = set()
    from ctxreplay.pipeline.regress.snapshot import pending_messages

    for key in g.threads:
        in_pending |= set(pending_messages(g.pending_request(key), g.list_key))
    assert not in_pending & set(shas)


def test_long_texts_are_set_apart_and_every_line_is_short(golden: Path) -> None:
    texts = sorted((golden / "texts").iterdir())
    assert texts and all(p.name == f"{hashlib.sha256(p.read_bytes()).hexdigest()}.txt" for p in texts)
    assert (golden / ".gitattributes").read_text().splitlines()[-1] == "* -text"
    for name, data in _tree(golden).items():
        if name.startswith("texts/") or name == "manifest.json":
            continue
        for line in data.decode().splitlines():  # a block (messages.jsonl: a message) per line, texts apart
            assert len(line) <= (1000 if name == "messages.jsonl" else 400), (name, line[:80])
    # pending.json: the request, a block per line
    pending = (golden / "threads" / "019a7c21-4d2e-7f10-b3a8-5e6f7a8b9c0d" / "pending.json").read_text()
    assert '        {"content":{"$text":"' in pending and '"tool_use_id":"call_A1b2C3d4","type":"tool_result"}' in pending


@pytest.mark.parametrize("target", [None, "anthropic"])
def test_a_one_result_tombstone_changes_at_most_10_lines_of_the_goldens(tmp_path: Path, target: str | None) -> None:
    """Two snapshots of one session whose policies differ in one tombstoned result (keep_recent 2
    and 1: the codex sample's first result, 7 lines, is cleared at its last call): `git diff` of
    the goldens touches at most 10 lines, none of them long; in the sample's own shape (OpenAI
    Responses: the result is a function_call_output item) and replayed for Anthropic (a
    tool_result block)."""
    import difflib

    src = SAMPLES / "codex-sample.jsonl"
    for k in (2, 1):
        d = tmp_path / f"keep-{k}"
        d.mkdir()
        (d / "policy.toml").write_text(write_policy(tmp_path, k).read_text())  # one spec name for both
        snapshot([src], load_spec(d / "policy.toml"), d / "golden", token_counter=CHARS4_COUNTER, target=target)
    a, b = _tree(tmp_path / "keep-2" / "golden"), _tree(tmp_path / "keep-1" / "golden")
    touched = 0  # lines changed, added or removed (a changed line counts once), as difflib pairs them
    shown: list[str] = []
    for name in sorted(a.keys() | b.keys()):
        old = a.get(name, b"").decode().splitlines()
        new = b.get(name, b"").decode().splitlines()
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
            if tag != "equal":
                touched += max(i2 - i1, j2 - j1)
                shown += [f"{name}: -{x}" for x in old[i1:i2]] + [f"{name}: +{x}" for x in new[j1:j2]]
    assert touched <= 10, "\n".join(shown)
    assert all(len(x) <= 300 for x in shown), "\n".join(shown)
    # the change itself, on one line of pending.json: the reference to the result's text, cleared
    cleared = ('        {"content":"[Old tool result content cleared]","tool_use_id":"call_A1b2C3d4","type":"tool_result"}'
               if target else
               '    {"call_id":"call_A1b2C3d4","output":"[Old tool result content cleared]","type":"function_call_output"},')
    assert f"threads/019a7c21-4d2e-7f10-b3a8-5e6f7a8b9c0d/pending.json: +{cleared}" in shown
    print(f"{touched} lines touched:\n" + "\n".join(shown))


def test_snapshot_json_and_human_output(tmp_path: Path) -> None:
    r = _cli("snapshot", SAMPLES / "codex-sample.jsonl", "--preset", "identity", "--golden", tmp_path / "g",
             "--fast-tokens", "--json")
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert {"golden", "threads", "calls", "input_files", "bytes", "pipeline_sha256", "target"} <= set(doc)
    assert (doc["threads"], doc["calls"], doc["input_files"]) == (1, 4, 1)
    r = _cli("snapshot", SAMPLES / "codex-sample.jsonl", "--preset", "identity", "--golden", tmp_path / "g",
             "--fast-tokens")
    assert r.stdout.startswith(f"ctxreplay snapshot: wrote {tmp_path / 'g'}: 1 thread, 4 calls, 1 input file")


def test_snapshot_replaces_the_whole_directory(tmp_path: Path) -> None:
    g = tmp_path / "g"
    assert _cli("snapshot", SAMPLES, "--preset", "identity", "--golden", g, "--fast-tokens", "-q").exit_code == 0
    assert len(list((g / "threads").iterdir())) == 8
    assert _cli("snapshot", SAMPLES / "codex-sample.jsonl", "--preset", "identity", "--golden", g,
                "--fast-tokens", "-q").exit_code == 0
    assert [p.name for p in (g / "threads").iterdir()] == ["019a7c21-4d2e-7f10-b3a8-5e6f7a8b9c0d"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_snapshot_refuses_a_directory_that_is_not_a_golden_one(tmp_path: Path) -> None:
    d = tmp_path / "repo"
    d.mkdir()
    (d / "keep.txt").write_text("mine")
    r = _cli("snapshot", SAMPLES / "codex-sample.jsonl", "--golden", d, "--fast-tokens")
    assert r.exit_code == 2
    assert r.stderr.startswith(f"ctxreplay: --golden {d} holds files but no manifest.json: it is not a ctxreplay "
                               "golden directory")
    assert (d / "keep.txt").read_text() == "mine" and sorted(p.name for p in d.iterdir()) == ["keep.txt"]
    # an empty directory is fine
    (d / "keep.txt").unlink()
    assert _cli("snapshot", SAMPLES / "codex-sample.jsonl", "--golden", d, "--fast-tokens", "-q").exit_code == 0


def test_files_the_run_skips_are_not_inputs(tmp_path: Path) -> None:
    s = tmp_path / "s"
    shutil.copytree(SAMPLES, s)
    (s / "notes.json").write_text('{"not": "a request"}')
    (s / "README.md").write_text("hello")
    g = tmp_path / "g"
    assert _cli("snapshot", s, "--preset", "identity", "--golden", g, "--fast-tokens", "-q").exit_code == 0
    files = json.loads((g / "manifest.json").read_text())["inputs"]["files"]
    assert "notes.json" not in files and "README.md" not in files and "codex-sample.jsonl" in files


def test_snapshot_of_a_missing_path_cannot_run(tmp_path: Path) -> None:
    r = _cli("snapshot", tmp_path / "nope", "--golden", tmp_path / "g")
    assert r.exit_code == 2 and "no such file or directory" in r.stderr
    assert not (tmp_path / "g").exists()


def test_goldens_of_format_1_are_still_read_and_update_rewrites_them(tmp_path: Path) -> None:
    """tests/fixtures/golden-format-1: the codex sample under keep_recent = 2, as ctxreplay wrote
    goldens before the texts were set apart (spans.jsonl, pending.json as indented JSON)."""
    g = tmp_path / "g"
    shutil.copytree(ROOT / "tests" / "fixtures" / "golden-format-1", g)
    src = SAMPLES / "codex-sample.jsonl"
    assert Golden(g).version == 1 and (g / "threads" / CODEX / "spans.jsonl").is_file()
    assert rebuild_every_call(Golden(g)) == 4
    same = _cli("diff", src, "--pipeline", write_policy(tmp_path, 2), "--golden", g)
    assert same.exit_code == 0 and same.stdout.startswith("ctxreplay diff: identical: 1 thread, 4 calls match")
    other = _cli("diff", src, "--pipeline", write_policy(tmp_path, 1), "--golden", g, "--json")
    assert other.exit_code == 1
    (t,) = json.loads(other.stdout)["threads"]
    assert (t["first_call"], t["where"]["message"], t["where"]["block"], t["where"]["tool_use_id"]) == \
        (3, 2, 0, "call_A1b2C3d4")
    assert (t["decision"]["stage"], t["decision"]["from_call"]) == ("tombstone", 3)
    # --update writes the current format; the next diff reads it
    assert _cli("diff", src, "--pipeline", tmp_path / "policy-2.toml", "--golden", g, "--update", "-q").exit_code == 0
    assert Golden(g).version == GOLDEN_FORMAT_VERSION and not (g / "threads" / CODEX / "spans.jsonl").exists()
    assert (g / "threads" / CODEX / "lists.jsonl").is_file()
    assert rebuild_every_call(Golden(g)) == 4
    assert _cli("diff", src, "--pipeline", tmp_path / "policy-2.toml", "--golden", g).exit_code == 0


def test_list_rows_give_back_every_list() -> None:
    from ctxreplay.pipeline.regress.snapshot import apply_ops, list_ops

    lists = [[], ["a", "b"], ["a", "b", "c", "d"], ["a", "B", "c", "d", "e"], ["B", "c", "d", "e", "f"],
             ["B", "x", "y", "e", "f", "g"], ["B", "e", "f", "g"], ["z", "B", "e", "f", "g", "h"], []]
    lst: list[str] = []
    for k in range(1, len(lists)):
        rows = list_ops(k, lists[k - 1], lists[k])
        assert apply_ops(lst, rows) == lists[k], k
    # a message replaced in the middle is one row, whatever follows; appending at the end has no position
    assert list_ops(9, ["a", "b", "c"], ["a", "X", "c", "d"]) == [[9, "=", 1, "X"], [9, "+", None, "d"]]
    assert list_ops(9, ["a", "b", "c"], ["a", "c", "d"]) == [[9, "-", 1, "b"], [9, "+", None, "d"]]


def test_texts_set_apart_come_back_exactly() -> None:
    from ctxreplay.pipeline.regress.snapshot import encode_texts

    value = {"a": "x" * 121, "b": ["short", "1\n2\n3", {"$text": "not a reference"}, {"$dict": {"k": 1}}],
             "c": {"nested": "y" * 500, "n": 1.5, "t": True, "z": None}, "$odd": "ok"}
    texts: dict[str, str] = {}
    enc = encode_texts(value, texts)
    assert len(texts) == 3 and enc["a"] == {"$text": hashlib.sha256(b"x" * 121).hexdigest()}
    assert enc["b"][0] == "short" and enc["b"][2] == {"$dict": {"$text": "not a reference"}}
    back = decode_texts(orjson.loads(orjson.dumps(enc)), texts.__getitem__)
    assert canonical_json(back) == canonical_json(value)


@pytest.mark.corpus
@pytest.mark.slow
def test_corpus_goldens_are_byte_identical_and_rebuild(corpus: Path, tmp_path: Path) -> None:
    spec = load_spec(preset="default")
    a = snapshot([corpus], spec, tmp_path / "a")
    snapshot([corpus], spec, tmp_path / "b")
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
    assert a.calls == 1590 and a.threads == 45
    print(f"corpus goldens: {a.bytes:,} bytes, {a.messages_stored} messages besides the pending requests")
    assert rebuild_every_call(Golden(tmp_path / "a")) == 1590
