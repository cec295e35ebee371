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

from ctxreplay.pipeline.assembly.replay import request_bytes
from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.regress.snapshot import (
    GOLDEN_FORMAT_VERSION,
    Golden,
    parse_messages_line,
    read_table,
    snapshot,
    spans_at,
)
from ctxreplay.pipeline.staging.spec import load_spec
from tests.goldenkit import write_policy

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"



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
    assert m["format"] == "ctxreplay-golden" and m["format_version"] == GOLDEN_FORMAT_VERSION == 1
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
    g = Golden(golden)
    rebuilt = 0
    for key, info in g.threads.items():
        spans = g.spans(key)
        calls = read_table(g.thread_dir(key) / "calls.jsonl")
        assert [c["call"] for c in calls] == list(range(info["first_call"], info["pending_call"] + 1))
        for c in calls:
            shas, env = spans_at(spans, c["call"])
            assert env is not None and len(shas) == c["n_messages"]
            data = request_bytes(g.list_key, [g.message(s, key) for s in shas], g.message(env, key))  # type: ignore[misc]
            assert hashlib.sha256(data).hexdigest() == c["request_sha256"], (key, c["call"])
            rebuilt += 1
        # the pending request: pretty-printed canonical JSON of the pending call's request
        pending = g.pending_json(key)
        assert pending == orjson.dumps(orjson.loads(data), option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n"
    assert rebuilt == 36


def test_messages_file_holds_only_what_no_pending_request_holds(golden: Path) -> None:
    lines = (golden / "messages.jsonl").read_bytes().splitlines()
    shas = [parse_messages_line(x)[0] for x in lines]
    assert shas == sorted(shas) and lines
    for line in lines:
        sha, data = parse_messages_line(line)
        assert hashlib.sha256(data).hexdigest() == sha
    g = Golden(golden)
    in_pending = set()
    from ctxreplay.pipeline.regress.snapshot import pending_messages

    for key in g.threads:
        in_pending |= set(pending_messages(g.pending_json(key), g.list_key))
    assert not in_pending & set(shas)


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


@pytest.mark.corpus
@pytest.mark.slow
def test_corpus_goldens_are_byte_identical_and_rebuild(corpus: Path, tmp_path: Path) -> None:
    spec = load_spec(preset="default")
    a = snapshot([corpus], spec, tmp_path / "a")
    snapshot([corpus], spec, tmp_path / "b")
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
    assert a.calls == 1590 and a.threads == 45
    print(f"corpus goldens: {a.bytes:,} bytes, {a.messages_stored} messages besides the pending requests")
    g = Golden(tmp_path / "a")
    for key in g.threads:
        for c in read_table(g.thread_dir(key) / "calls.jsonl"):
            shas, env = spans_at(g.spans(key), c["call"])
            data = request_bytes(g.list_key, [g.message(s, key) for s in shas], g.message(env, key))  # type: ignore[misc]
            assert hashlib.sha256(data).hexdigest() == c["request_sha256"], (key, c["call"])
