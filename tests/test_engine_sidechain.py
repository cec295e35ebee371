"""The live engine on Claude Code 1.0's inline sidechains (issue 24): a sidechain's first request
can be assembled as soon as its first user line is in, and is the batch replay's call 0 of that
sidechain, byte for byte; docs/engine.md's recipe (examples/engine_feed.py: a new answer starts
at a new `message.id`, `model=` the answer's, the sidechain's thread named after its root) gives
`ctxreplay run`'s request for every call, on a session written here and on the corpus's one file
with inline sidechains."""

from __future__ import annotations

import json
import runpy
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.errors import InputError
from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.engine.engine import Engine
from ctxreplay.pipeline.loaders import load_paths
from ctxreplay.pipeline.staging.spec import load_spec
from tests.cckit import CCSession
from tests.test_loader_paths import all_ways

ROOT = Path(__file__).resolve().parent.parent
SID = "d1c3a5e7-2b4d-4f60-9a8b-7c6d5e4f3a2b"
T0 = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
VIEWER = "claude-code/d-kimuson__claude-code-viewer__5c0375b4-57a5-4f26-b12d-d022ee4e51b7.jsonl"


def _feed_example() -> dict[str, Any]:
    return runpy.run_path(str(ROOT / "examples" / "engine_feed.py"))


def _answer(k: int, content: list[dict[str, Any]], stop: str, model: str = "claude-sonnet-4") -> dict[str, Any]:
    return {"id": f"msg_side{k:04d}", "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "usage": {"input_tokens": 40, "output_tokens": 9}}


def _use(tid: str, name: str, **inp: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": tid, "name": name, "input": inp}


def _result(tid: str, text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid, "content": text}]}


class Session(CCSession):
    """Claude Code 1.0 entries: the main thread delegates twice to a Task whose sub-agent runs
    inline, as a sidechain of the same file (`isSidechain: true`, its first line without a
    parent), between the Task call and its result. `answers` holds the index of each answer's
    first line; `roots` the uuid of each sidechain's first line."""

    def __init__(self) -> None:
        super().__init__(SID, T0)
        self.answers: list[int] = []
        self.roots: list[str] = []
        self.k = 0

    def say(self, content: list[dict[str, Any]], stop: str = "end_turn", side: bool = False,
            parent: Any = None, lines: int = 1) -> str:
        """An answer; with lines=2 its first block and the rest on two lines of the same message id."""
        self.k += 1
        self.answers.append(len(self.entries))
        kw: dict[str, Any] = {"isSidechain": True} if side else {}
        if parent is not None:
            kw["parent"] = parent
        uid = ""
        parts = [content[:1], content[1:]] if lines == 2 else [content]
        for i, part in enumerate(parts):
            uid = self.entry("assistant", _answer(self.k, part, stop), 4, requestId=f"req_side{self.k:04d}",
                             version="1.0.90", **(kw if i == 0 else {"isSidechain": side}))
        return uid

    def side_user(self, message: dict[str, Any], root: bool = False) -> str:
        uid = self.entry("user", message, 1, **({"parent": None} if root else {}), isSidechain=True,
                         version="1.0.90")
        if root:
            self.roots.append(uid)
        return uid

    def task(self, n: int, prompt: str, steps: list[tuple[str, str]], summary: str) -> None:
        """A Task call, its sidechain (one tool call per step, then the summary) and its result."""
        call = self.say([{"type": "text", "text": "I will delegate this."}, _use(f"toolu_task{n}", "Task",
                                                                                 prompt=prompt)],
                        "tool_use", lines=2)
        self.side_user({"role": "user", "content": prompt}, root=True)
        for i, (cmd, out) in enumerate(steps):
            tid = f"toolu_s{n}_{i}"
            self.say([_use(tid, "Bash", command=cmd)], "tool_use", side=True)
            self.side_user(_result(tid, out))
        self.say([{"type": "text", "text": summary}], side=True)
        self.entry("user", _result(f"toolu_task{n}", summary), 1, parent=call, version="1.0.90")


def session() -> Session:
    s = Session()
    s.entry("user", {"role": "user", "content": "Why is test_sync flaky?"}, 10, version="1.0.90")
    s.task(1, "Find sleeps in the tests", [("grep -rn sleep tests", "tests/test_sync.py:12: time.sleep(0.1)"),
                                           ("sed -n 1,20p tests/test_sync.py", "def test_sync():\n  ...")],
           "One sleep: tests/test_sync.py line 12 waits 0.1 s for the worker.")
    s.say([{"type": "text", "text": "The test races the worker; it sleeps instead of waiting."}])
    s.entry("user", {"role": "user", "content": "Fix it."}, 20, version="1.0.90")
    s.task(2, "Replace the sleep with an event", [], "Replaced time.sleep with worker.done.wait(5).")
    s.say([{"type": "text", "text": "Fixed: the test now waits on the worker's event."}])
    return s


def _batch(path: Path, tmp: Path) -> pl.DataFrame:
    calls = run([path], load_spec(preset="default"),
                RunOptions(out_dir=tmp / "out", token_counter=CHARS4_COUNTER)).calls
    return calls.filter(~pl.col("is_pending"))


def test_a_sidechains_first_request_is_assembled_before_its_answer(tmp_path: Path) -> None:
    """Fed line by line as written: before each answer's first line, the request of the thread it
    answers on (sidechain-<root> for the sidechain's) is the batch replay's call, call 0 of each
    sidechain included (it used to be "has no thread" until the answer was in)."""
    s = session()
    path = s.write(tmp_path / f"{SID}.jsonl")
    batch = _batch(path, tmp_path)
    want = {r["message_id"]: (r["thread_id"], r["call"], r["request_sha256"]) for r in batch.iter_rows(named=True)}
    sides = {f"sidechain-{r[:8]}" for r in s.roots}
    assert sides == set(batch.get_column("thread_id").unique().to_list()) - {"main"}  # the names the docs give
    got: dict[str, tuple[str, int, str]] = {}
    with Engine.open("default", tmp_path / "e.duckdb", token_counter=CHARS4_COUNTER) as eng:
        fed = 0
        for i in s.answers:
            eng.ingest(SID, s.entries[fed:i])
            fed = i
            e = s.entries[i]
            tid = "main"
            if e["isSidechain"]:
                tid = next(t for t in sides if t == f"sidechain-{_root(s, e['parentUuid'])[:8]}")
            res = eng.assemble(SID, tid, model=e["message"]["model"])
            got[e["message"]["id"]] = (tid, res.call, res.request_sha256)
    assert got == want
    firsts = [v for v in want.values() if v[0] != "main" and v[1] == 0]
    assert len(firsts) == 2  # both sidechains' first requests were compared


def _root(s: Session, uid: str) -> str:
    by = {e["uuid"]: e for e in s.entries}
    while by[uid]["parentUuid"] is not None:
        uid = by[uid]["parentUuid"]
    return uid


def test_the_sidechain_is_a_thread_from_its_first_line_and_its_first_call_needs_the_model(tmp_path: Path) -> None:
    s = session()
    root = s.entries.index(next(e for e in s.entries if e["uuid"] == s.roots[0]))
    tid = f"sidechain-{s.roots[0][:8]}"
    batch = _batch(s.write(tmp_path / f"{SID}.jsonl"), tmp_path)
    call0 = batch.filter((pl.col("thread_id") == tid) & (pl.col("call") == 0)).row(0, named=True)
    with Engine.open("default", tmp_path / "e.duckdb", token_counter=CHARS4_COUNTER) as eng:
        eng.ingest(SID, s.entries[:root])  # up to the Task call: no sidechain yet
        assert tid not in eng.threads(SID)
        with pytest.raises(InputError, match="has no thread"):
            eng.assemble(SID, tid)
        eng.ingest(SID, s.entries[root:root + 1])  # its first user line
        assert tid in eng.threads(SID)
        # no earlier call to take the model from: the request names none, unlike the batch's call 0
        assert eng.assemble(SID, tid).request_sha256 != call0["request_sha256"]
        res = eng.assemble(SID, tid, model=call0["model"])
        assert (res.call, res.n_messages, res.request_sha256) == (0, 1, call0["request_sha256"])
        assert res.request["messages"][0]["role"] == "user"


def _prefix(s: Session, tmp: Path, upto: int) -> Path:
    return s.write(tmp / "p" / f"{SID}.jsonl", upto)


def test_the_loaders_keep_an_open_sidechain_only_when_asked_and_agree(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """load_paths(open_sidechains=True) (the engine's) keeps the sidechain awaiting its first
    answer as a thread of no call; a batch load (the default) leaves it out, as before; the lines
    read the careful way and the table made as values give the same either way."""
    s = session()
    root = s.entries.index(next(e for e in s.entries if e["uuid"] == s.roots[1]))
    path = _prefix(s, tmp_path, root + 1)
    tid = f"sidechain-{s.roots[1][:8]}"
    for open_ in (False, True):
        new = all_ways([path], monkeypatch, f"open_sidechains={open_}", open_sidechains=open_)
        b = pl.from_arrow(new.blocks)
        assert isinstance(b, pl.DataFrame)
        mine = b.filter(pl.col("thread_id") == tid)
        if open_:
            assert mine.select("role", "first_call", "is_call").rows() == [("user", 0, False)]
            assert new.stats.get("branches_without_calls", 0) == 0
        else:
            assert mine.height == 0 and new.stats["branches_without_calls"] == 1
        # the first sidechain, answered, is a thread either way
        assert b.filter(pl.col("thread_id") == f"sidechain-{s.roots[0][:8]}").height


def test_a_rewound_path_without_an_answer_stays_out_even_for_the_engine(tmp_path: Path) -> None:
    """Only an inline sidechain is kept open: a user message of the main chain left behind by a
    rewind (no answer on its path that is not another thread's) is no thread, as in a batch run."""
    s = CCSession(SID, T0)
    s.user("first question")
    answered = s.answer(1, "first answer")
    s.user("a question edited away")
    s.user("the edited question", parent=answered)  # a rewind: the path above is left without an answer
    s.answer(2, "second answer")
    path = s.write(tmp_path / f"{SID}.jsonl")
    for open_ in (False, True):
        res = load_paths([path], open_sidechains=open_)
        b = pl.from_arrow(res.blocks)
        assert isinstance(b, pl.DataFrame)
        assert b.get_column("thread_id").unique().to_list() == ["main"]
        assert res.stats["branches_without_calls"] == 1


def test_the_example_checks_every_call_of_a_session_with_sidechains(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    s = session()
    path = s.write(tmp_path / f"{SID}.jsonl")
    run([path], load_spec(preset="default"), RunOptions(out_dir=tmp_path / "out"))
    got = _feed_example()["check"](tmp_path / "out", [path])
    assert got.ok and got.calls == len(s.answers) and got.pending >= 3, got
    out = capsys.readouterr().out
    assert f"sidechain-{s.roots[1][:8]} call 0: sha256" in out and "!=" not in out


def test_the_example_reports_a_request_that_differs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Against the outputs of another transcript's run, the example says which calls differ and
    exits 1: its check can fail."""
    s = session()
    path = s.write(tmp_path / f"{SID}.jsonl")
    other = Session()
    other.entries = [json.loads(json.dumps(e).replace("Why is test_sync flaky?", "Why is test_async flaky?"))
                     for e in s.entries]
    run([other.write(tmp_path / "other" / f"{SID}.jsonl")], load_spec(preset="default"),
        RunOptions(out_dir=tmp_path / "out"))
    assert _feed_example()["main"]([str(tmp_path / "out"), str(path)]) == 1
    assert "!= ctxreplay run's main call 0" in capsys.readouterr().out


@pytest.mark.corpus
def test_the_corpus_file_with_inline_sidechains(corpus: Path, tmp_path: Path) -> None:
    """The corpus's Claude Code 1.0 file with two inline sidechains: every call of it, both
    sidechains' first requests included, is assembled call by call (none skipped) and is
    `ctxreplay run`'s; the example's recipe agrees on all 20."""
    from tests.test_engine_corpus import feed_call_by_call

    path = corpus / VIEWER
    got = feed_call_by_call(path, load_spec(preset="default"), tmp_path / "a")
    assert (got.matched, got.skipped, got.mismatches) == (20, 0, [])
    run([path], load_spec(preset="default"), RunOptions(out_dir=tmp_path / "out"))
    checked = _feed_example()["check"](tmp_path / "out", [path], show=False)
    assert checked.ok and (checked.calls, checked.pending) == (20, 3), checked
