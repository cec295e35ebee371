"""Helpers for stage tests and golden cases (also for third-party stage authors).

`make_blocks` builds a blocks frame from a short message-level description, so tests state only
what matters; `run_stage` runs one registered stage with params given as a dict, as the runner
does (its frozen decisions in `ledger` re-applied first); `run_golden_dir` checks a golden case
directory (docs/writing-a-stage.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import polars as pl

from ctxreplay.pipeline.core.constants import POLARS_ENGINE
from ctxreplay.pipeline.loaders.base import Block, Compaction, Message, Thread, json_text, threads_to_blocks
from ctxreplay.pipeline.stageapi.registry import StageContext, StageResult, get_stage
from ctxreplay.pipeline.staging.spec import resolve_params
from ctxreplay.schemas.check import conform, polars_schema
from ctxreplay.schemas.decisions import STAGE_DECISION

T0 = datetime(2026, 1, 1, tzinfo=UTC)

# Columns shown in golden files and in compact test comparisons.
VIEW = [
    "session_id", "thread_id", "entry_id", "order_key", "role", "block_pos", "part_pos", "first_call",
    "last_call", "block_type", "part_type", "text", "signature", "tool_use_id", "tool_name", "tool_input",
    "is_error", "image_media_type", "image_width", "image_height", "origin",
]


def _block(b: Mapping[str, Any]) -> Block:
    b = dict(b)
    if "tool_input" in b and not isinstance(b["tool_input"], str) and b["tool_input"] is not None:
        b["tool_input"] = json_text(b["tool_input"])
    if "type" in b:
        b["block_type"] = b.pop("type")
    return Block(**b)


def make_thread(messages: Iterable[Mapping[str, Any]], *, session_id: str = "s1", thread_id: str = "main",
                compactions: Iterable[tuple[int, int]] = ()) -> Thread:
    """Messages as dicts: role, blocks (list of Block fields; `type` = block_type) or text, and any
    Message field (timestamp may be seconds after T0)."""
    msgs = []
    for i, m in enumerate(messages):
        m = dict(m)
        blocks = [_block(b) for b in m.pop("blocks", [])]
        if "text" in m:
            blocks.insert(0, Block("text", text=m.pop("text")))
        ts = m.pop("timestamp", i)
        if isinstance(ts, (int, float)):
            ts = T0 + timedelta(seconds=ts)
        entry_id = m.pop("entry_id", f"e{i:04d}")
        msgs.append(Message(entry_id=entry_id, role=m.pop("role"), blocks=blocks, source_file="test.jsonl",
                            source_line=i + 1, raw_line="{}", timestamp=ts, **m))
    return Thread(session_id, thread_id, "test", "test.jsonl", msgs,
                  [Compaction(at, keep) for at, keep in compactions])


def make_context(*, peers: Mapping[str, Mapping[str, Any]] | None = None, **kw: Any) -> StageContext:
    """A StageContext for a test: `kw` are its fields; `peers` maps the names of stages a stage
    reads (e.g. snip reads tombstone) to their params as dicts, `{}` for none (None: the stage runs
    alone and a stage it reads takes its defaults)."""
    from ctxreplay.pipeline.stageapi.registry import StageRef

    refs = None
    if peers is not None:
        refs = []
        for name, params in peers.items():
            st = get_stage(name)
            refs.append(StageRef(st, resolve_params(st, dict(params), where=f"test peer ({name})")))
    return StageContext(peers=tuple(refs) if refs is not None else None, **kw)


def make_blocks(messages: Iterable[Mapping[str, Any]], **kw: Any) -> pl.LazyFrame:
    return pl.from_arrow(threads_to_blocks([make_thread(messages, **kw)])).lazy()  # type: ignore[union-attr]


def run_stage(name: str, blocks: pl.LazyFrame, params: Mapping[str, Any] | None = None, *,
              ledger: pl.LazyFrame | None = None, ctx: StageContext | None = None, checks: bool = True) -> StageResult:
    """Run one stage as the runner runs it, in-process: the frozen decisions among `ledger` (earlier
    decisions of this stage, STAGE_DECISION columns) re-applied first, then the stage (its quick
    check first, `@stage(quiet=...)`; `checks=False`: its plan, whatever the check says, to test
    one against the other); both outputs checked against their schemas (a failure is a
    `StageFailed`). The decisions returned are the re-applied ones, the conflicts and the stage's own."""
    from ctxreplay.pipeline.staging.stagerun import reapply_and_run

    st = get_stage(name)
    p = resolve_params(st, dict(params or {}), where=f"test ({name})")
    earlier = conform(ledger, STAGE_DECISION).collect(engine=POLARS_ENGINE) if ledger is not None else \
        pl.DataFrame(schema=polars_schema(STAGE_DECISION))
    out, decisions = reapply_and_run(st, blocks.lazy().collect(engine=POLARS_ENGINE), p, earlier, ctx or StageContext(),
                                     name, 1, quiet=None if checks else False)
    return StageResult(out.lazy(), decisions.lazy())


def view(blocks: pl.LazyFrame | pl.DataFrame) -> pl.DataFrame:
    df = blocks.collect(engine=POLARS_ENGINE) if isinstance(blocks, pl.LazyFrame) else blocks
    return df.select(VIEW).sort(["session_id", "thread_id", "order_key", "block_pos", "part_pos", "first_call"])


def visible(blocks: pl.LazyFrame | pl.DataFrame, call: int) -> pl.DataFrame:
    """The block versions that call `call` sees, in order."""
    df = blocks.collect(engine=POLARS_ENGINE) if isinstance(blocks, pl.LazyFrame) else blocks
    return view(df.filter((pl.col("first_call") <= call) & (pl.col("last_call").is_null() | (pl.col("last_call") > call))))


# ------------------------------------------------------------------ replay against a naive assembly


def replay_rows(blocks: pl.DataFrame) -> list[dict[str, Any]]:
    """One thread's rows in replay order."""
    from ctxreplay.pipeline.assembly.replay import ROW_COLUMNS

    return blocks.sort(["order_key", "block_pos", "part_pos", "first_call", "entry_id"]).select(ROW_COLUMNS).to_dicts()


def naive_request(rows: list[dict[str, Any]], k: int, target_name: str, model: str | None = "m",
                  pending: bool = False) -> dict[str, Any]:
    """Call k's request built from scratch: the rows visible at k, grouped, shaped from the start
    (a recorded call's trailing assistant message left out unless the target allows a prefill)."""
    from ctxreplay.pipeline.targets import ASSISTANT_ROLES, LogicalMessage, get_target, wire_role

    target = get_target(target_name)
    split = target.splits_system()
    vis = [r for r in rows if r["first_call"] <= k and (r["last_call"] is None or r["last_call"] > k)]
    system = [LogicalMessage("system", [r], r["msg_key"]) for r in vis if split and r["role"] == "system"]
    logical: list[LogicalMessage] = []
    for r in vis:
        if split and r["role"] == "system":
            continue
        if logical and logical[-1].msg_key == r["msg_key"]:
            logical[-1].rows.append(r)
        else:
            logical.append(LogicalMessage(r["role"], [r], r["msg_key"]))
    msgs = [m for _, m in target.shape(logical, 0)]
    if msgs and not pending and not target.allow_prefill and wire_role(msgs[-1]) in ASSISTANT_ROLES:
        msgs = msgs[:-1]
    if not msgs:
        msgs = target.empty_messages()
    return {target.list_key: msgs, **target.envelope(model, system)}


def naive_prompt_tokens(request: dict[str, Any], rows: list[dict[str, Any]], k: int, target_name: str) -> int:
    """prompt_tokens of a naive request (rows weigh their `_tok`): the rows each wire message sends,
    the system text rows of the envelope, and the per-message and per-request overheads."""
    from ctxreplay.pipeline.core.constants import MESSAGE_OVERHEAD_TOKENS, REQUEST_OVERHEAD_TOKENS
    from ctxreplay.pipeline.targets import get_target

    target = get_target(target_name)
    msgs = request[target.list_key]
    env = 0
    if target.splits_system():
        env = sum(r["_tok"] for r in rows if r["role"] == "system" and r["block_type"] == "text"
                  and r["first_call"] <= k and (r["last_call"] is None or r["last_call"] > k))
    sent = sum(r["_tok"] for m in msgs for r in getattr(m, "rows", ()))
    return REQUEST_OVERHEAD_TOKENS + env + sent + MESSAGE_OVERHEAD_TOKENS * len(msgs)


def replay_all_calls(blocks: pl.DataFrame, target_name: str, rows: list[dict[str, Any]] | None = None) -> list[Any]:
    """Every call of one thread, each request materialised (model "m"); rows weigh 1 token each."""
    from ctxreplay.pipeline.assembly.replay import CallInfo, replay_thread
    from ctxreplay.pipeline.targets import get_target

    rows = replay_rows(blocks) if rows is None else rows
    # calls of the path: inherited ones (is_call false) count too
    n = max(blocks.filter(pl.col("is_call"))["msg_key"].n_unique(), int(blocks["first_call"].max() or 0))
    calls = [CallInfo(k, model="m") for k in range(n)]
    return list(replay_thread(rows, [1] * len(rows), calls, get_target(target_name), materialize=lambda k, p: True))


def check_replay_against_naive(blocks: pl.DataFrame, target_name: str) -> None:
    """The incremental replay equals the naive assembly at every call: same request, same sha256,
    same prompt_tokens, and its prefix_break_message is the first message that differs from the
    previous call's request."""
    import hashlib

    from ctxreplay.pipeline.core.blockops import canonical_json
    from ctxreplay.pipeline.targets import get_target

    rows = replay_rows(blocks)
    key = get_target(target_name).list_key
    prev = None
    results = replay_all_calls(blocks, target_name, rows=rows)
    for r in results:
        naive = naive_request(rows, r.call, target_name, pending=r.is_pending)
        assert r.request == naive, f"call {r.call}"
        assert r.request_sha256 == hashlib.sha256(canonical_json(naive)).hexdigest()
        assert r.prompt_tokens == naive_prompt_tokens(naive, rows, r.call, target_name), f"call {r.call}"
        if prev is not None:
            old, new = prev[key], naive[key]
            first_diff = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b),
                              None if len(new) >= len(old) else len(new))
            assert r.prefix_break_message == first_diff, f"call {r.call}"
        prev = naive


# ------------------------------------------------------------------ golden case directories

DECISION_VIEW = ["session_id", "thread_id", "entry_id", "block_pos", "part_pos", "tool_use_id", "from_call",
                 "action", "reason", "before_sha256", "after_sha256", "replacement", "cache_epoch"]
# golden block files also carry each version's cache epoch: a layer that fires must take a new
# epoch, one that does not must leave epochs alone
GOLDEN_VIEW = [*VIEW, "cache_epoch"]


def _golden_view(blocks: pl.LazyFrame | pl.DataFrame) -> pl.DataFrame:
    df = blocks.collect(engine=POLARS_ENGINE) if isinstance(blocks, pl.LazyFrame) else blocks
    return df.select(GOLDEN_VIEW).sort(["session_id", "thread_id", "order_key", "block_pos", "part_pos",
                                        "first_call"])


def _json_rows(df: pl.DataFrame) -> list[dict[str, Any]]:
    import orjson

    return [orjson.loads(orjson.dumps(r, default=str)) for r in df.to_dicts()]


def _read_jsonl(p: Path) -> list[dict[str, Any]]:
    import orjson

    return [orjson.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]


def _write_jsonl(p: Path, rows: list[dict[str, Any]]) -> None:
    import orjson

    p.write_text("".join(orjson.dumps(r, option=orjson.OPT_SORT_KEYS).decode() + "\n" for r in rows),
                 encoding="utf-8")


def check_golden(case: Path, stage_name: str | None = None, *, update: bool = False) -> None:
    """Run a stage on a golden case directory and compare with what is expected there.

    The directory holds `input.jsonl` (one message per line, in the `make_thread` form),
    `params.toml` (the stage's params; `compactions = [[at, keep_from], ...]` and a `[context]`
    table of `make_context` keyword arguments are taken out first; a comment says what the case
    shows), `expected_blocks.jsonl` (the `VIEW` columns and `cache_epoch`) and `expected_decisions.jsonl`
    (`DECISION_VIEW`), sorted by key. `stage_name` defaults to the name of the parent directory.
    With `update`, the expected files are (re)written: review their diff like code. Also checks
    that running the stage on its own output decides nothing and changes nothing (idempotence).
    """
    import tomllib

    name = stage_name or case.parent.name
    cfg = tomllib.loads((case / "params.toml").read_text()) if (case / "params.toml").exists() else {}
    ctx = make_context(**cfg.pop("context", {}))
    compactions = [tuple(x) for x in cfg.pop("compactions", [])]
    blocks = make_blocks(_read_jsonl(case / "input.jsonl"), compactions=compactions)
    res = run_stage(name, blocks, cfg, ctx=ctx)
    got_blocks = _json_rows(_golden_view(res.blocks))
    got_dec = _json_rows(res.decisions.collect(engine=POLARS_ENGINE).select(DECISION_VIEW).sort(DECISION_VIEW[:7]))
    if update:
        _write_jsonl(case / "expected_blocks.jsonl", got_blocks)
        _write_jsonl(case / "expected_decisions.jsonl", got_dec)
    assert got_blocks == _read_jsonl(case / "expected_blocks.jsonl"), f"{case}: blocks differ"
    assert got_dec == _read_jsonl(case / "expected_decisions.jsonl"), f"{case}: decisions differ"
    again = run_stage(name, res.blocks, cfg, ctx=ctx)
    assert again.decisions.collect(engine=POLARS_ENGINE).height == 0, f"{case}: a second pass must decide nothing"
    assert _json_rows(_golden_view(again.blocks)) == got_blocks, f"{case}: a second pass must change nothing"


# ------------------------------------------------------------------ version histories for tests

def replace_from(blocks: pl.LazyFrame, mask: pl.Expr, new_values: dict[str, pl.Expr], from_call: int,
                 reason: str = "test") -> pl.LazyFrame:
    """The blocks with `new_values` replacing the columns where `mask` holds, from call `from_call`
    on (a new version there), as a layer would do it through the marks API."""
    from ctxreplay.pipeline.stageapi.marks import finish, mark_replace_from, start_marks

    return finish(mark_replace_from(start_marks(blocks), mask, new_values, reason, pl.lit(from_call))).blocks


def drop_from(blocks: pl.LazyFrame, mask: pl.Expr, from_call: int, reason: str = "test") -> pl.LazyFrame:
    """The blocks with the versions where `mask` holds dropped from call `from_call` on."""
    from ctxreplay.pipeline.stageapi.marks import finish, mark_drop, start_marks

    return finish(mark_drop(start_marks(blocks), mask, reason, pl.lit(from_call))).blocks
