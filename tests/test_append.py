"""Issue 22, item 4: appending is cheap. A re-run copies the row groups of the batches whose groups
are all reused as bytes (pipeline/batch/rgcopy.py) instead of reading and encoding them again; its
outputs stay those of a fresh run on the same inputs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ctxreplay.pipeline.batch import rgcopy
from tests.test_scale import _cc_line, _run, _run_before_the_last_lines, _same_outputs, _summary_core, _tree

SID_A = "11111111-2222-4333-8444-555555555555"
SID_B = "99999999-2222-4333-8444-555555555555"


def _table(n: int, start: int = 0) -> pa.Table:
    ints = list(range(start, start + n))
    return pa.table({
        "i": pa.array(ints, pa.int64()),
        "s": pa.array([f"text {i}" if i % 7 else None for i in ints], pa.string()),
        "b": pa.array([i % 3 == 0 for i in ints], pa.bool_()),
        "f": pa.array([i / 3 for i in ints], pa.float64()),
        "d": pa.array([f"k{i % 4}" for i in ints]).dictionary_encode(),
        "l": pa.array([[i, i + 1] for i in ints], pa.list_(pa.int32())),
        "t": pa.array(ints, pa.timestamp("us", tz="UTC")),
    })


def _write(path: Path, tables: list[pa.Table], **kw: Any) -> None:
    with pq.ParquetWriter(path, tables[0].schema, **kw) as w:
        for t in tables:
            w.write_table(t, row_group_size=max(t.num_rows, 1))


def test_a_footer_decodes_and_encodes_to_its_own_bytes(tmp_path: Path) -> None:
    p = tmp_path / "a.parquet"
    _write(p, [_table(50), _table(3000, 50), _table(1, 9000)], store_schema=True)
    meta, at = rgcopy.footer(p)
    assert rgcopy.encode(meta) == p.read_bytes()[at:-8]


def test_row_groups_of_two_files_spliced_read_back_as_their_rows(tmp_path: Path) -> None:
    a, b, out = tmp_path / "a.parquet", tmp_path / "b.parquet", tmp_path / "out.parquet"
    ta = [_table(40), _table(500, 40), _table(7, 600)]
    tb = [_table(20, 1000), _table(300, 2000)]
    _write(a, ta)
    _write(b, tb)
    assert rgcopy.splice(out, b, [(a, 2), (b, 1), (a, 0), (b, 0)])
    got = pq.ParquetFile(out)
    assert got.metadata.num_row_groups == 4 and got.metadata.num_rows == 7 + 300 + 40 + 20
    assert got.read().equals(pa.concat_tables([ta[2], tb[1], ta[0], tb[0]]))
    assert got.schema_arrow.equals(pq.ParquetFile(b).schema_arrow, check_metadata=True)
    # each row group read alone (its offsets moved with it)
    assert got.read_row_group(1).equals(tb[1]) and got.read_row_group(3).equals(tb[0])


def test_splice_refuses_what_it_cannot_copy(tmp_path: Path) -> None:
    """A page index (written after every row group), another schema, a row group twice: False,
    and no output file; the caller writes the rows the ordinary way."""
    a, idx, other, out = (tmp_path / n for n in ("a.parquet", "idx.parquet", "other.parquet", "out.parquet"))
    _write(a, [_table(10), _table(10, 10)])
    _write(idx, [_table(10)], write_page_index=True)
    _write(other, [pa.table({"x": [1, 2]})])
    assert not rgcopy.splice(out, a, [(idx, 0)])
    assert not rgcopy.splice(out, a, [(other, 0)])
    assert not rgcopy.splice(out, a, [(a, 0), (a, 0)])
    assert not out.exists()
    assert rgcopy.splice(out, a, [(a, 1)]) and pq.read_table(out).equals(_table(10, 10))


def _count_splices(monkeypatch: pytest.MonkeyPatch, result: bool | None = None) -> dict[str, int]:
    """Patch rgcopy.splice to count, per output file, the row groups it copied from a previous run
    (`result`: what it returns instead of copying)."""
    copied: dict[str, int] = {}
    real = rgcopy.splice

    def spy(dest: Path, base: Path, parts: list[tuple[Path, int]]) -> bool:
        copied[dest.name] = sum(1 for p, _ in parts if p != dest)
        return real(dest, base, parts) if result is None else result

    monkeypatch.setattr(rgcopy, "splice", spy)
    return copied


@pytest.mark.parametrize("splice_works", [True, False])
def test_a_grown_file_copies_the_other_batches_row_groups_and_equals_a_fresh_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, splice_works: bool) -> None:
    tree, main, full, out = _run_before_the_last_lines(tmp_path)
    main.write_bytes(full)
    copied = _count_splices(monkeypatch, None if splice_works else False)
    grown = _run([tree], out, batch_bytes=1)
    g = grown["groups"]
    assert (g["rerun"], g["new"]) == (1, 0) and g["batches"] > 5
    # every output but quarantine (no rows) holds row groups of the reused batches
    assert sorted(copied) == ["blocks.parquet", "call_facts.parquet", "call_messages.parquet", "decisions.parquet",
                              "messages.parquet"], copied
    assert all(n >= g["batches"] // 2 for n in copied.values()), copied
    monkeypatch.undo()
    fresh = _run([tree], tmp_path / "fresh", batch_bytes=1)
    assert _summary_core(grown, "tokens") == _summary_core(fresh, "tokens")
    _same_outputs(tmp_path / "fresh", out)


def _session(sid: str, texts: list[str]) -> bytes:
    lines, parent = [], None
    for i, text in enumerate(texts):
        u, a = f"{sid[:4]}u{i}", f"{sid[:4]}a{i}"
        lines.append(_cc_line(sid, u, parent, "user", text))
        lines.append(_cc_line(sid, a, u, "assistant", f"answer {i} of {sid[:4]}"))
        parent = a
    return b"".join(lines)


def test_a_message_an_earlier_batch_now_holds_is_not_copied_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 ) -> None:
    """messages.parquet holds a message once, in the first batch that has it. Session B (a later
    batch) holds the message "shared question"; session A (the first batch) grows to hold it too:
    B's batch is reused, but its row group of messages is not the one a fresh run writes (the
    message moved to A's), so it is written anew while B's other outputs are copied."""
    proj = tmp_path / "tree" / "proj"
    proj.mkdir(parents=True)
    a, b = proj / f"{SID_A}.jsonl", proj / f"{SID_B}.jsonl"
    a.write_bytes(_session(SID_A, ["first of a"]))
    b.write_bytes(_session(SID_B, ["shared question", "second of b"]))
    out = tmp_path / "o"
    first = _run([tmp_path / "tree"], out, batch_bytes=1)
    assert first["groups"]["batches"] == 2
    a.write_bytes(_session(SID_A, ["first of a", "shared question"]))
    copied = _count_splices(monkeypatch)
    again = _run([tmp_path / "tree"], out, batch_bytes=1)
    assert (again["groups"]["rerun"], again["groups"]["reused"]) == (1, 1)
    monkeypatch.undo()
    shared = pq.read_table(out / "messages.parquet")
    assert shared.num_rows == len(set(shared.column("sha256").to_pylist()))
    _run([tmp_path / "tree"], tmp_path / "fresh", batch_bytes=1)
    _same_outputs(tmp_path / "fresh", out)
    # blocks, call_messages and call_facts (and decisions, if any) copied B's row group; messages did not
    assert "messages.parquet" not in copied and copied.get("blocks.parquet") == 1, copied
    assert set(copied.values()) == {1} and {"call_facts.parquet", "call_messages.parquet"} <= set(copied)


def test_a_batch_whose_groups_changed_is_not_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With one batch for everything, the grown group's batch holds the reused groups too: nothing
    is copied (the batch's rows are new), and the outputs are a fresh run's."""
    tree = _tree(tmp_path)
    main = next((tree / "samples" / "claude-projects").rglob("5f0c1d2e-*.jsonl"))
    full = main.read_bytes()
    main.write_bytes(b"".join(full.splitlines(keepends=True)[:-4]))
    out = tmp_path / "o"
    _run([tree], out)
    main.write_bytes(full)
    copied = _count_splices(monkeypatch)
    _run([tree], out)
    monkeypatch.undo()
    assert copied == {}
    shutil.rmtree(tmp_path / "fresh", ignore_errors=True)
    _run([tree], tmp_path / "fresh")
    _same_outputs(tmp_path / "fresh", out)


@pytest.mark.slow
def test_the_corpus_grown_by_its_last_call_equals_a_fresh_run(corpus: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The real corpus in small batches, its largest session without its last lines, then grown
    back (an append): the reused batches' row groups are copied, and every output is a fresh run's."""
    tree = tmp_path / "tree"
    shutil.copytree(corpus, tree)  # a scratch copy under tmp_path: the file is edited
    target = max((p for p in tree.rglob("*.jsonl") if "subagents" not in p.parts), key=lambda p: p.stat().st_size)
    full = target.read_bytes()
    target.write_bytes(b"".join(full.splitlines(keepends=True)[:-2]))
    out = tmp_path / "o"
    _run([tree], out, preset="claude-code", batch_bytes=2_000_000)
    target.write_bytes(full)
    copied = _count_splices(monkeypatch)
    grown = _run([tree], out, preset="claude-code", batch_bytes=2_000_000)
    monkeypatch.undo()
    assert grown["groups"]["rerun"] == 1 and grown["groups"]["batches"] > 3
    assert copied.get("blocks.parquet", 0) >= grown["groups"]["batches"] // 2, copied
    fresh = _run([tree], tmp_path / "fresh", preset="claude-code", batch_bytes=2_000_000)
    assert _summary_core(grown, "tokens") == _summary_core(fresh, "tokens")
    _same_outputs(tmp_path / "fresh", out)


def test_the_previous_messages_row_groups_kept_between_batches_give_a_fresh_runs_outputs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-run keeps the last row groups of the previous messages.parquet it read for the next
    batches (reuse.KEEP_MESSAGE_GROUPS): with one kept (evicted at every batch) and with four, a
    grown file's re-run in one-group batches writes a fresh run's outputs, and four read fewer."""
    from ctxreplay.pipeline.batch import reuse

    # six sessions in batches of their own, all opening with one message (written with the first)
    tree = tmp_path / "tree"
    tree.mkdir()
    sids = [f"{i}1111111-2222-4333-8444-555555555555" for i in range(1, 7)]
    for sid in sids:
        (tree / f"{sid}.jsonl").write_bytes(_session(sid, ["shared question", f"own question of {sid[:1]}"]))
    main = tree / f"{sids[-1]}.jsonl"
    full = _session(sids[-1], ["shared question", f"own question of {sids[-1][:1]}", "one more"])
    main.write_bytes(full)
    _run([tree], tmp_path / "fresh", batch_bytes=1)
    real = pq.ParquetFile.read_row_group
    reads: dict[int, int] = {}
    for keep in (1, 4):
        monkeypatch.setattr(reuse, "KEEP_MESSAGE_GROUPS", keep)
        main.write_bytes(b"".join(full.splitlines(keepends=True)[:-2]))
        out = tmp_path / f"o{keep}"
        _run([tree], out, batch_bytes=1)
        main.write_bytes(full)
        reads[keep] = 0

        def counted(self: pq.ParquetFile, i: int, *a: Any, _k: int = keep, **kw: Any) -> pa.Table:
            if kw.get("columns") is None and not a and self.schema_arrow.names[:2] == ["sha256", "kind"]:
                reads[_k] += 1
            return real(self, i, *a, **kw)

        monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
        _run([tree], out, batch_bytes=1)
        monkeypatch.setattr(pq.ParquetFile, "read_row_group", real)
        _same_outputs(tmp_path / "fresh", out)
    assert 0 < reads[4] < reads[1], reads


def test_the_content_hashes_taken_beforehand_are_those_reuse_compares(tmp_path: Path) -> None:
    """manifest.hash_candidates hashes (on threads) every file of a group whose paths and sizes are
    the previous run's, and no other: a grown file keeps no hash (its size tells already)."""
    from ctxreplay.pipeline.batch.manifest import Prior, content_sha256, hash_candidates

    files = {}
    for name, data in (("a", b"x" * 5000), ("b", b"y" * 7000), ("c", b"z" * 100)):
        (tmp_path / name).write_bytes(data)
        files[name] = tmp_path / name
    old = {"g1": {"files": [{"path": "a", "size": 5000, "fp": "old"}, {"path": "b", "size": 7000, "fp": "old"}]},
           "g2": {"files": [{"path": "c", "size": 99, "fp": "old"}]}}
    now = {"g1": [{"path": "a", "size": 5000}, {"path": "b", "size": 7000}], "g2": [{"path": "c", "size": 100}]}
    hash_candidates(Prior(tmp_path, old, {}), now, files)
    assert [f.get("fp") for f in now["g1"]] == [content_sha256(files["a"]), content_sha256(files["b"])]
    assert "fp" not in now["g2"][0]


def test_a_message_no_request_holds_is_not_written(tmp_path: Path) -> None:
    """A message version that lives for no call (made and replaced before the next call: its
    stretch is empty) is not in messages.parquet: that file holds what the requests hold."""
    from ctxreplay.pipeline.assembly.replay import MessageStore, SpanLog
    from ctxreplay.pipeline.assembly.store import store_tables

    store, spans = MessageStore(), SpanLog()
    spans.begin_thread("s", "t", "s/t")
    def add(text: str) -> int:
        return store.add(f'{{"role":"user","content":"{text}"}}'.encode(), kind="message", role="user", n_blocks=1,
                         tokens=5)

    held = [add("held 0"), add("held 1")]
    gone = add("replaced at once")
    spans.add(0, 0, 2, held[0])
    spans.add(1, 1, 1, gone)  # an empty stretch: no call holds it
    spans.add(1, 1, 3, held[1])
    messages, call_messages = store_tables(store, spans, "anthropic", "messages")
    assert messages.column("sha256").to_pylist() == [store.sha256[i] for i in held]
    assert sorted(set(call_messages.column("sha256").to_pylist())) == sorted(messages.column("sha256").to_pylist())


def test_a_reused_group_beside_a_rerun_one_keeps_a_fresh_runs_messages(corpus: Path, tmp_path: Path) -> None:
    """The corpus' OpenClaw session e3063350 makes a message version no call holds. In one batch with
    a session that grows (so the batch is re-run around the reused group), the re-run's outputs are
    a fresh run's: the reused group's messages are those its call_messages rows list, and a fresh
    run writes no other (before: the fresh run wrote the unheld message, the re-run lost it)."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("e3063350-9fbd-46dd-99f7-0559c3d78207.jsonl", "b1a9203a-456c-43ac-8f93-da28a4589d43.jsonl"):
        shutil.copyfile(corpus / "openclaw" / f"okbest2024__openclaw-backup__{name}", tree / name)
    grows = tree / "b1a9203a-456c-43ac-8f93-da28a4589d43.jsonl"
    full = grows.read_bytes()
    grows.write_bytes(b"".join(full.splitlines(keepends=True)[:-2]))
    out = tmp_path / "o"
    first = _run([tree], out, batch_bytes=64 << 20)
    assert first["groups"]["batches"] == 1
    grows.write_bytes(full)
    again = _run([tree], out, batch_bytes=64 << 20)
    assert (again["groups"]["rerun"], again["groups"]["reused"]) == (1, 1)
    _run([tree], tmp_path / "fresh", batch_bytes=64 << 20)
    _same_outputs(tmp_path / "fresh", out)


def test_every_output_file_is_zstd_compressed_also_when_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """Every Parquet output, of a fresh run and of a re-run (copied row groups, and the files
    rewritten when they cannot be copied), is zstd-compressed (batchout.COMPRESSION): a third of
    snappy's bytes for less writing time."""
    tree, main, full, out = _run_before_the_last_lines(tmp_path)

    def codecs(d: Path) -> dict[str, set[str]]:
        got = {}
        for p in sorted(d.glob("*.parquet")):
            md = pq.ParquetFile(p).metadata
            got[p.name] = {md.row_group(i).column(j).compression for i in range(md.num_row_groups)
                           for j in range(md.num_columns)}
        return got

    assert set(codecs(out / "current")) >= {"blocks.parquet", "calls.parquet", "messages.parquet",
                                            "call_messages.parquet", "decisions.parquet", "call_facts.parquet"}
    assert all(c <= {"ZSTD"} for c in codecs(out / "current").values()), codecs(out / "current")
    main.write_bytes(full)
    monkeypatch.setattr(rgcopy, "splice", lambda *a, **k: False)  # every file rebuilt row group by row group
    _run([tree], out, batch_bytes=1)
    assert all(c <= {"ZSTD"} for c in codecs(out / "current").values()), codecs(out / "current")


def test_a_warm_rerun_imports_no_module_only_new_work_needs(tmp_path: Path) -> None:
    """A re-run that reuses every group imports neither tiktoken (its version is read from its
    metadata), PIL.Image (imported where an image is decoded) nor pyarrow.compute (imported where a
    table is computed on): together ~60 ms of a ~0.6 s warm run. The cold run, which counts tokens,
    imports tiktoken (the check is not vacuous)."""
    import subprocess
    import sys

    tree = _tree(tmp_path)
    probe = ("import sys\nfrom ctxreplay.entry import main\n"
             f"sys.argv = ['ctxreplay', 'run', {str(tree)!r}, '--out', {str(tmp_path / 'o')!r}, '--jobs', '1', '-q']\n"
             "try:\n    main()\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('tiktoken', 'PIL.Image', 'pyarrow.compute') if m in sys.modules))\n")
    cold, warm = (subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                 cwd=tmp_path).stdout.splitlines()[-1] for _ in range(2))
    assert "tiktoken" in cold
    assert warm == "[]"
