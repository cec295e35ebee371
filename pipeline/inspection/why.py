"""`ctxreplay why`: the request of one call, block by block, with the decision behind every change.

Three sources, all of one run (OUT/current resolved once):

- `blocks.parquet`: every version of every block after the stages. The versions visible at call K
  (first_call <= K < last_call), in replay order, are what the request holds before provider
  shaping; grouped by message as the replay groups them.
- the transcript as recorded: the session's source files (named in blocks.parquet) are loaded
  again, as `run` loaded them, and checked against the run (same calls, same raw lines of every
  block the run kept). Its versions visible at K are the identity request's blocks: a block there
  and not in the run's view was dropped, one only in the run's view was inserted, one in both
  with another content hash was changed. Loading a session again costs 0.2 s at most on the
  corpus (the largest session is 3.8 MB), and keeps OUT free of a second copy of every block.
- `decisions.parquet`: every decision the run applied, provisional ones included. A decision is
  effective at call K when its from_call <= K and its block (entry_id, block_pos, part_pos) is in
  the run's view or the recorded view at K; each effective decision is shown on that block, once.

The request itself comes from `ctxreplay.pipeline.assembly.store.request`, and its sha256 is checked against
calls.parquet. `--diff` also replays the recorded blocks without stages (the identity request at
the same call) and shows, per changed block, the recorded text against the replayed one.
"""

from __future__ import annotations

import bisect
import difflib
import hashlib
import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from ctxreplay.errors import CtxReplayError, SourceChanged
from ctxreplay.pipeline.core.blockops import canonical_json, sort_blocks
from ctxreplay.pipeline.core.constants import POLARS_ENGINE
from ctxreplay.pipeline.core.seq import common_ends
from ctxreplay.pipeline.core.termtext import terminal_text
from ctxreplay.pipeline.core.words import plural
from ctxreplay.pipeline.inspection.threads import RunView, ThreadRef, known_stages, thread_kind
from ctxreplay.pipeline.inspection.threads import stage_rank as _stage_rank
from ctxreplay.pipeline.targets import in_envelope

KEY = ("entry_id", "block_pos", "part_pos")
HEAD_LINES, TAIL_LINES, LINE_CHARS = 4, 2, 240
MAX_CHANGED_LINES = 6  # lines a layer changed, kept in a folded text (result_budget's marker: 1-3)


@dataclass
class WhyOptions:
    call: int | None = None
    stage: str | None = None
    diff: bool = False
    full: bool = False
    changed_only: bool = False


# ---------------------------------------------------------------------------------------- folding


def fold(text: str | None, full: bool, recorded: str | None = None) -> dict[str, Any]:
    """A text for display: whole with `full`, else its first and last lines (long lines cut), with
    how much was left out. With `recorded` (the transcript's text of a block a layer changed),
    the lines where the two differ are kept too, each cut around the change: a marker a layer
    wrote (result_budget's `…N chars truncated…`) is never folded away."""
    text = text or ""
    lines = text.split("\n")
    out: dict[str, Any] = {"chars": len(text), "lines": len(lines)}
    if full:
        out.update(text=text, folded=False, elided_lines=0, elided_chars=0)
        return out
    changed = _changed_span(text, recorded) if recorded is not None and recorded != text else None
    keep = set(range(min(HEAD_LINES, len(lines)))) | set(range(max(len(lines) - TAIL_LINES, 0), len(lines)))
    cols: dict[int, int] = {}  # a kept changed line: where in it the change starts
    if changed is not None:
        (l0, c0), (l1, _) = changed
        for i in range(l0, min(l1, l0 + MAX_CHANGED_LINES - 1) + 1):
            keep.add(i)
            cols[i] = c0 if i == l0 else 0
    if len(lines) <= HEAD_LINES + TAIL_LINES + 1:
        keep = set(range(len(lines)))
    shown: list[str] = []
    elided = cut = 0
    prev = -1
    for i in sorted(keep):
        if i > prev + 1:
            gap = i - prev - 1
            elided += gap
            shown.append(f"… {plural(gap, 'line')} not shown (--full shows them) …")
        ln = lines[i]
        if len(ln) > LINE_CHARS:
            start = max(0, min(cols.get(i, 0) - LINE_CHARS // 3, len(ln) - LINE_CHARS))
            part = ln[start:start + LINE_CHARS]
            cut += len(ln) - len(part)
            ln = (f"(+{start:,} chars) … " if start else "") + part + \
                (f" … (+{len(ln) - start - len(part):,} chars)" if start + len(part) < len(ln) else "")
        shown.append(ln)
        prev = i
    if prev < len(lines) - 1:  # (keep always holds the last line; kept for safety)
        elided += len(lines) - 1 - prev
        shown.append(f"… {plural(len(lines) - 1 - prev, 'line')} not shown (--full shows them) …")
    out.update(text="\n".join(shown), folded=bool(elided or cut), elided_lines=elided, elided_chars=cut)
    return out


def _changed_span(text: str, recorded: str) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(line, column) of the first and of the last character of `text` that is not in the prefix
    or suffix it shares with `recorded` (the text a layer wrote there); None when it only lost
    characters (then the place they left: the line where they were)."""
    p, q = common_ends(text, recorded)
    end = max(len(text) - q - 1, p)
    end = min(end, max(len(text) - 1, 0))
    p = min(p, max(len(text) - 1, 0))

    def at(pos: int) -> tuple[int, int]:
        line = text.count("\n", 0, pos)
        return line, pos - (text.rfind("\n", 0, pos) + 1)

    return at(p), at(end)


# ---------------------------------------------------------------------------------------- the recorded view


@dataclass
class Recorded:
    blocks: pl.DataFrame  # the thread's loaded blocks, as `run` filtered them
    skeleton: pl.DataFrame  # the session's call skeleton (for the identity replay)
    counts: dict[tuple[str, str], int]


def load_recorded(view: RunView, ref: ThreadRef, final: pl.DataFrame, pending: int) -> Recorded:
    """The thread as recorded: its session's source files loaded again and checked against the run."""
    key = ("recorded", ref.key)
    if key not in view.memo:
        view.memo[key] = _load_recorded(view, ref, final, pending)
    return view.memo[key]  # type: ignore[no-any-return]


def _load_recorded(view: RunView, ref: ThreadRef, final: pl.DataFrame, pending: int) -> Recorded:
    from ctxreplay.pipeline.assembly.replay import call_counts, call_skeleton
    from ctxreplay.pipeline.loaders import load_paths

    files = sorted(pl.scan_parquet(view.path("blocks.parquet")).filter(pl.col("session_id") == ref.session_id)
                   .select("source_file").unique().collect(engine=POLARS_ENGINE).get_column("source_file").to_list())
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise SourceChanged(f"the transcript of session {ref.session_id} is not where the run read it: "
                            f"{', '.join(missing[:3])} (paths as given to `ctxreplay run`; run this from the same "
                            f"directory, or re-run)")
    loaded = pl.from_arrow(load_paths(files).blocks)
    assert isinstance(loaded, pl.DataFrame)
    skeleton, counts = call_skeleton(loaded), call_counts(loaded)
    mine = loaded.filter((pl.col("session_id") == ref.session_id) & (pl.col("thread_id") == ref.thread_id)
                         & (pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("first_call"))))
    # the same transcript: the same number of calls, and every block the run kept from it is there
    kept = final.filter(pl.col("origin") == "transcript")
    lost = kept.select(KEY).unique().join(mine.select(KEY).unique(), on=KEY, how="anti")
    # each line's text compared once, not once per block (a message of N blocks repeats its line N
    # times: hashing it per block was quadratic, issue 23 item 5); a line is one entry's, in one place
    line, text = ["entry_id", "source_file", "source_line"], ["entry_id", "raw_line"]
    texts = [f.unique(subset=line).select(text).unique() for f in (kept, mine)]
    changed = texts[0].join(texts[1], on=text, how="anti").select("entry_id")
    lost = pl.concat([lost, kept.join(changed, on="entry_id", how="semi").select(KEY)]).unique()
    now = counts.get((ref.session_id, ref.thread_id))
    if now != pending or lost.height:
        what = (f"it now has {now} calls before the pending one, the run had {pending}" if now != pending
                else f"{plural(lost.height, 'block')} the run read {'is' if lost.height == 1 else 'are'} not in it as "
                     f"{'it was' if lost.height == 1 else 'they were'}")
        raise SourceChanged(f"the transcript of thread {ref.key} changed since the run ({what}); re-run "
                            f"`ctxreplay run ... --out {view.out_dir}` to inspect it")
    return Recorded(mine, skeleton, counts)


def identity_request(rec: Recorded, ref: ThreadRef, call: int, target_name: str) -> dict[str, Any]:
    """The request at `call` with no stage at all: the transcript as recorded, in the run's target."""
    from ctxreplay.pipeline.assembly.replay import replay_thread, thread_calls, thread_rows
    from ctxreplay.pipeline.targets import get_target

    infos = thread_calls(rec.skeleton.filter((pl.col("session_id") == ref.session_id)
                                             & (pl.col("thread_id") == ref.thread_id)),
                         {(ref.session_id, ref.thread_id): rec.counts[(ref.session_id, ref.thread_id)]})
    calls = infos.get((ref.session_id, ref.thread_id), [])
    ((_, part),) = list(thread_rows(rec.blocks))
    rows = part.drop("raw_line").to_dicts()  # not the line per block (issue 23, item 5)
    for res in replay_thread(rows, [0] * len(rows), calls, get_target(target_name),
                             materialize=lambda k, p: k == call):
        if res.call == call:
            assert res.request is not None
            return res.request
    raise CtxReplayError(f"thread '{ref.key}': call {call} not found in the recorded transcript")


# ---------------------------------------------------------------------------------------- building


def _visible(df: pl.DataFrame, k: int) -> pl.DataFrame:
    vis = df.filter((pl.col("first_call") <= k) & (pl.col("last_call").is_null() | (pl.col("last_call") > k)))
    return sort_blocks(vis.lazy()).collect(engine=POLARS_ENGINE)


def _key(r: dict[str, Any]) -> tuple[str, int, int]:
    return (r["entry_id"], r["block_pos"], r["part_pos"])


def _payload_bytes(r: dict[str, Any]) -> int:
    """As the stages measure a block (before_len / after_len): text, else image data, else tool input."""
    for c in ("text", "image_data", "tool_input"):
        if r.get(c) is not None:
            return len(r[c].encode("utf-8", "surrogatepass"))
    return 0


def _content(r: dict[str, Any], full: bool, old: dict[str, Any] | None = None) -> dict[str, Any]:
    """The block's content for display; `old`: the transcript's version of a block a layer changed
    (the lines it changed are kept when the text is folded)."""
    t = r["block_type"]
    if t == "image" or r.get("part_type") == "image":
        return {"image": {"media_type": r.get("image_media_type"), "width": r.get("image_width"),
                          "height": r.get("image_height"), "bytes": r.get("image_bytes")}}
    if t in ("tool_use", "server_tool_use") and r.get("text") is None:
        return {"tool_input": fold(r.get("tool_input"), full, (old or {}).get("tool_input") if old else None)}
    if r.get("text") is not None:
        return {"text": fold(r.get("text"), full, (old or {}).get("text") if old else None)}
    if r.get("extra_json"):
        return {"extra": fold(r.get("extra_json"), full, (old or {}).get("extra_json") if old else None)}
    return {}


def _stage_matcher(name: str | None, known: list[str]) -> Any:
    if not name:
        return lambda s: True
    base = {k.split("#")[0] for k in known}
    if name not in known and name not in base:
        from ctxreplay.errors import did_you_mean

        raise CtxReplayError(f"unknown stage '{name}'.{did_you_mean(name, sorted(set(known) | base))} "
                             f"Stages: {', '.join(sorted(set(known) | base))}")
    return lambda s: s == name or (("#" not in name) and s.split("#")[0] == name)


@dataclass
class _Call:
    """What `build` knows about one call: the visible rows of both sides and the decisions."""
    opts: WhyOptions
    fin_by: dict[tuple[str, int, int], dict[str, Any]]
    rec_by: dict[tuple[str, int, int], dict[str, Any]]
    effective: dict[tuple[str, int, int], list[dict[str, Any]]]
    match_stage: Any

    def status_of(self, r: dict[str, Any]) -> str:
        old = self.rec_by.get(_key(r))
        if old is None:
            return "inserted"
        if old["content_sha256"] != r["content_sha256"]:
            return "changed"
        if old["order_key"] != r["order_key"] or any(d["action"] == "move" for d in self.effective.get(_key(r), [])):
            return "moved"
        return "unchanged"

    def block(self, r: dict[str, Any], status: str) -> dict[str, Any]:
        opts = self.opts
        b = {"entry_id": r["entry_id"], "block_pos": r["block_pos"], "part_pos": r["part_pos"],
             "block_type": r["block_type"], "part_type": r["part_type"], "tool_use_id": r["tool_use_id"],
             "tool_name": r["tool_name"], "is_error": r["is_error"], "status": status,
             "origin": r["origin"], "first_call": r["first_call"], "last_call": r["last_call"],
             "bytes": _payload_bytes(r), **_content(r, opts.full, self.rec_by.get(_key(r)) if status == "changed" else None),
             "decisions": [d for d in self.effective.get(_key(r), []) if self.match_stage(d["stage"])]}
        if opts.diff and status in ("changed", "moved"):
            old = self.rec_by[_key(r)]
            b["recorded"] = {"bytes": _payload_bytes(old), **_content(old, opts.full)}
            if status == "changed":
                b["recorded"]["diff"] = _text_diff(old, r, opts.full)
        return b


def _effective_decisions(view: RunView, ref: ThreadRef, k: int, keys: set[tuple[str, int, int]],
                         stage_rank: dict[str, int]) -> dict[tuple[str, int, int], list[dict[str, Any]]]:
    """The decisions in force at call k on the blocks of either side, per block, in applying order."""
    decs = view.decisions.filter((pl.col("session_id") == ref.session_id) & (pl.col("thread_id") == ref.thread_id)
                                 & (pl.col("from_call") <= k))
    effective: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for d in decs.to_dicts():
        key = _key(d)
        if key in keys:
            effective.setdefault(key, []).append({
                "stage": d["stage"], "stage_version": d["stage_version"], "action": d["action"],
                "reason": d["reason"], "from_call": d["from_call"], "cache_epoch": d["cache_epoch"],
                "before_len": d["before_len"], "after_len": d["after_len"],
                "is_provisional": bool(d["is_provisional"]), "tool_use_id": d["tool_use_id"],
            })
    for lst in effective.values():
        lst.sort(key=lambda d: (d["from_call"], stage_rank.get(d["stage"], len(stage_rank)), d["stage"]))
    return effective


def _group_messages(fin_rows: list[dict[str, Any]], split_system: Callable[[dict[str, Any]], bool],
                    ) -> tuple[list[dict[str, Any]], list[Any], list[int]]:
    """Messages as the replay groups them: consecutive visible rows of one msg_key, the rows the
    target carries in its envelope (`split_system(row)`) apart. Returns (messages, the wire-bound logical
    messages, the messages[] index of each)."""
    from ctxreplay.pipeline.targets import LogicalMessage

    messages: list[dict[str, Any]] = []
    logical: list[LogicalMessage] = []
    log_index: list[int] = []
    last_by_stream: dict[bool, int] = {}
    for r in fin_rows:
        is_sys = split_system(r)
        prev = last_by_stream.get(is_sys)
        if prev is not None and messages[prev]["msg_key"] == r["msg_key"]:
            messages[prev]["_rows"].append(r)
        else:
            messages.append({"role": r["role"], "msg_key": r["msg_key"], "entry_id": r["entry_id"],
                             "system": is_sys, "_rows": [r], "_order": (r["order_key"], r["block_pos"])})
            last_by_stream[is_sys] = len(messages) - 1
            if not is_sys:
                logical.append(LogicalMessage(r["role"], [], r["msg_key"]))
                log_index.append(len(messages) - 1)
    for lm, mi in zip(logical, log_index, strict=True):
        lm.rows = messages[mi]["_rows"]
    return messages, logical, log_index


def _wire_places(target: Any, request: dict[str, Any], messages: list[dict[str, Any]], logical: list[Any],
                 log_index: list[int]) -> tuple[dict[int, list[int | str]], bool]:
    """Where each message went on the wire (checked against the assembled request): its indexes in
    the request's list, or "system"; and whether the check held."""
    wire_of: dict[int, list[int | str]] = {}
    wire_list = request.get(target.list_key) or []
    shaped = target.shape(logical, 0) if logical else []
    if (len(shaped) == len(wire_list) + 1 and not getattr(target, "allow_prefill", True)
            and shaped[-1][1].get("role") == "assistant"):
        shaped = shaped[:-1]  # the replay leaves out a trailing assistant message (no prefill)
    wire_checked = [canonical_json(m) for _, m in shaped] == [canonical_json(m) for m in wire_list]
    if wire_checked:
        labels = [lab for lab, _ in shaped]
        for li, mi in enumerate(log_index):
            own = [j for j, lab in enumerate(labels) if math.floor(lab) == li]
            if not own:
                j = bisect.bisect_right(labels, li) - 1
                own = [j] if j >= 0 else []
            wire_of[mi] = list(own)
    for mi, m in enumerate(messages):
        if m["system"]:
            wire_of[mi] = ["system"]
    return wire_of, wire_checked


def _place_dropped(dropped: list[dict[str, Any]], messages: list[dict[str, Any]], wire_of: dict[int, list[int | str]],
                   split_system: Callable[[dict[str, Any]], bool]) -> dict[int, list[int | str]]:
    """Put dropped blocks in their message when it is still there, else in a message of their own
    where the transcript had it (messages is changed in place; returns the renumbered wire_of)."""
    by_msg = {m["msg_key"]: i for i, m in reversed(list(enumerate(messages)))}
    orphans: dict[str, list[dict[str, Any]]] = {}
    for r in dropped:
        mi = by_msg.get(r["msg_key"])
        if mi is None:
            orphans.setdefault(r["msg_key"], []).append(r)
            continue
        rows = messages[mi]["_rows"]
        pos = next((i for i, x in enumerate(rows) if (x["block_pos"], x["part_pos"]) > (r["block_pos"], r["part_pos"])),
                   len(rows))
        rows.insert(pos, {**r, "_dropped": True})
    for mk, rows in orphans.items():
        rows = [{**r, "_dropped": True} for r in rows]
        first = min(rows, key=lambda r: (r["order_key"], r["block_pos"], r["part_pos"]))
        m = {"role": first["role"], "msg_key": mk, "entry_id": first["entry_id"],
             "system": split_system(first), "_rows": rows,
             "_order": (first["order_key"], first["block_pos"])}
        orders = [x["_order"] for x in messages]
        at = bisect.bisect_right(orders, m["_order"])
        messages.insert(at, m)
        wire_of = {(i + 1 if i >= at else i): v for i, v in wire_of.items()}
        wire_of[at] = []
    return wire_of


def _shown_messages(c: _Call, messages: list[dict[str, Any]],
                    wire_of: dict[int, list[int | str]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The messages and blocks to show (after --stage / --changed), and the decisions they carry."""
    opts = c.opts
    out_msgs = []
    shown_decisions: list[dict[str, Any]] = []
    for mi, m in enumerate(messages):
        blocks = []
        for r in m["_rows"]:
            b = c.block(r, "dropped" if r.get("_dropped") else c.status_of(r))
            if opts.stage and not b["decisions"]:
                continue
            if opts.changed_only and b["status"] == "unchanged" and not b["decisions"]:
                continue
            blocks.append(b)
            shown_decisions.extend(b["decisions"])
        if not blocks:
            continue
        statuses = {b["status"] for b in blocks}
        out_msgs.append({
            "index": mi, "role": m["role"], "msg_key": m["msg_key"], "entry_id": m["entry_id"],
            "wire": wire_of.get(mi, []),
            "status": "dropped" if statuses == {"dropped"} and all(r.get("_dropped") for r in m["_rows"]) else
                      ("inserted" if all(r.get("origin") != "transcript" for r in m["_rows"]) else "kept"),
            "blocks": blocks,
        })
    return out_msgs, shown_decisions


def _recorded_side(rec: Any, ref: ThreadRef, k: int, target: Any, request: dict[str, Any]) -> dict[str, Any]:
    """--diff: the identity request at the same call, and where the two part."""
    ident = identity_request(rec, ref, k, target.name)
    ident_bytes = canonical_json(ident)
    a, b = ident.get(target.list_key) or [], request.get(target.list_key) or []
    first_diff = next((j for j in range(min(len(a), len(b))) if canonical_json(a[j]) != canonical_json(b[j])),
                      None if len(a) == len(b) else min(len(a), len(b)))
    return {"request_sha256": hashlib.sha256(ident_bytes).hexdigest(), "request_bytes": len(ident_bytes),
            "n_messages": len(a), "first_difference": first_diff,
            "envelope_differs": {x: y for x, y in ident.items() if x != target.list_key}
            != {x: y for x, y in request.items() if x != target.list_key}}


def build(view: RunView, ref: ThreadRef, opts: WhyOptions) -> dict[str, Any]:
    """The request at opts.call (None: the pending call) with every effective decision, as data.
    A call of the history the thread shares with another (a branch's calls before it parts) is
    shown as the thread that reports it sees it, named in `shared`."""
    from ctxreplay.pipeline.assembly.store import reporting_thread
    from ctxreplay.pipeline.assembly.store import request as assemble_call
    from ctxreplay.pipeline.targets import get_target

    if opts.call is not None:
        mine = view.calls.filter(pl.col("thread_key") == ref.key)
        own = set(mine.get_column("call").to_list())
        pending = mine.filter(pl.col("is_pending")).get_column("call")
        if own and pending.len() and 0 <= opts.call < int(pending[0]) and opts.call not in own:
            other = reporting_thread(view.run_dir, ref.key, opts.call)
            if other is not None:
                by = next(t for t in view.threads if t.key == other)
                doc = build(view, by, opts)
                doc["shared"] = {"thread_key": ref.key, "thread": ref.short, "reported_by": other,
                                 "reported_by_thread": by.short,
                                 "own_calls": sorted(c for c in own if c != int(pending[0])),
                                 "pending_call": int(pending[0])}
                return doc
    target = get_target(view.target)
    request = assemble_call(view.run_dir, ref.key, opts.call, view.target)  # checks the call too
    mine_calls = view.calls.filter(pl.col("thread_key") == ref.key)
    pending = int(mine_calls.filter(pl.col("is_pending"))["call"][0])
    k = pending if opts.call is None else opts.call
    row = mine_calls.filter(pl.col("call") == k).row(0, named=True)

    if ("final", ref.key) not in view.memo:
        view.memo[("final", ref.key)] = pl.scan_parquet(view.path("blocks.parquet")).filter(
            (pl.col("session_id") == ref.session_id) & (pl.col("thread_id") == ref.thread_id)).collect(engine=POLARS_ENGINE)
    final = view.memo[("final", ref.key)]
    rec = load_recorded(view, ref, final, pending)
    # rows as dicts without their raw line: a message of N blocks would give N copies of it
    fin_rows = _visible(final, k).drop("raw_line").to_dicts()
    rec_rows = _visible(rec.blocks, k).drop("raw_line").to_dicts()
    fin_by = {_key(r): r for r in fin_rows}
    rec_by = {_key(r): r for r in rec_rows}
    if len(fin_by) != len(fin_rows) or len(rec_by) != len(rec_rows):
        raise CtxReplayError(f"thread '{ref.key}' call {k}: a block has two versions visible at once; this is "
                             f"a bug in a stage")
    stage_rank = _stage_rank()
    effective = _effective_decisions(view, ref, k, set(fin_by) | set(rec_by), stage_rank)
    c = _Call(opts, fin_by, rec_by, effective, _stage_matcher(opts.stage, known_stages(view)))

    def split_system(r: dict[str, Any]) -> bool:
        return in_envelope(target, r)

    messages, logical, log_index = _group_messages(fin_rows, split_system)
    wire_of, wire_checked = _wire_places(target, request, messages, logical, log_index)
    dropped = [r for r in rec_rows if _key(r) not in fin_by]
    wire_of = _place_dropped(dropped, messages, wire_of, split_system)
    out_msgs, shown_decisions = _shown_messages(c, messages, wire_of)

    by_stage: dict[str, int] = {}
    for d in shown_decisions:
        by_stage[d["stage"]] = by_stage.get(d["stage"], 0) + 1
    by_stage = dict(sorted(by_stage.items(), key=lambda kv: (stage_rank.get(kv[0], len(stage_rank)), kv[0])))
    req_bytes = canonical_json(request)
    sha = hashlib.sha256(req_bytes).hexdigest()
    statuses = [c.status_of(r) for r in fin_rows]
    doc: dict[str, Any] = {
        "thread_key": ref.key, "session_id": ref.session_id, "thread_id": ref.thread_id,
        "kind": thread_kind(ref.thread_id, final["source_format"][0] if final.height else None,
                            bool(final["is_sidechain"].any()) if final.height else False),
        "call": k, "pending_call": pending, "is_pending": k == pending,
        "target": view.target, "pipeline": view.summary.get("pipeline"),
        "pipeline_sha256": view.summary.get("pipeline_sha256"), "run_id": view.summary.get("run_id"),
        "model": row["model"], "timestamp": str(row["timestamp"]) if row["timestamp"] is not None else None,
        "request_sha256": sha, "request_sha256_matches": sha == row["request_sha256"],
        "request_bytes": len(req_bytes), "n_messages": row["n_messages"], "prompt_tokens": row["prompt_tokens"],
        "stage_filter": opts.stage, "changed_only": opts.changed_only, "full": opts.full,
        "decisions": {"count": len(shown_decisions),
                      "provisional": sum(1 for d in shown_decisions if d["is_provisional"]),
                      "by_stage": by_stage},
        "blocks": {"shown": sum(len(m["blocks"]) for m in out_msgs),
                   "visible": len(fin_rows), "dropped": len(dropped),
                   **{s: statuses.count(s) for s in ("changed", "inserted", "moved")}},
        "messages": out_msgs,
        "wire": _wire_summary(request, target.list_key, messages, wire_of, out_msgs, wire_checked),
    }
    if opts.diff:
        doc["recorded"] = _recorded_side(rec, ref, k, target, request)
    return doc


def _text_diff(old: dict[str, Any], new: dict[str, Any], full: bool) -> dict[str, Any]:
    def text(r: dict[str, Any]) -> str:
        for c in ("text", "tool_input", "image_data"):
            if r.get(c) is not None:
                return str(r[c]) if c != "image_data" else f"<image {r.get('image_media_type')} {len(r[c]):,} B base64>"
        return ""

    lines = list(difflib.unified_diff(text(old).split("\n"), text(new).split("\n"), "recorded", "replayed",
                                      lineterm="", n=1))
    return fold("\n".join(lines[2:]), full)  # without the ---/+++ header


def _wire_summary(request: dict[str, Any], list_key: str, messages: list[dict[str, Any]],
                  wire_of: dict[int, list[int | str]], out_msgs: list[dict[str, Any]], checked: bool) -> dict[str, Any]:
    touched: dict[int, list[int]] = {}
    for m in out_msgs:
        if any(b["status"] != "unchanged" or b["decisions"] for b in m["blocks"]):
            for j in m["wire"]:
                if isinstance(j, int):
                    touched.setdefault(j, []).append(m["index"])
    items = []
    for j, msg in enumerate(request.get(list_key) or []):
        items.append({"index": j, "role": msg.get("role") or msg.get("type"), "parts": _parts(msg),
                      "bytes": len(canonical_json(msg)), "changed_messages": touched.get(j, [])})
    env = {k: v for k, v in request.items() if k != list_key}
    def describe(v: Any) -> Any:
        if isinstance(v, str | None):
            return v
        if isinstance(v, list):
            return {"items": len(v), "bytes": len(canonical_json(v))}
        return {"bytes": len(canonical_json(v))}

    return {"list_key": list_key, "messages": items, "mapped": checked,
            "envelope": {k: describe(v) for k, v in env.items()}}


def _parts(msg: dict[str, Any]) -> list[str]:
    """Short descriptions of what a wire message holds (any target's shape)."""
    content = msg.get("content", msg.get("parts"))
    out = []
    if isinstance(content, str):
        out.append(f"text {len(content):,} chars")
    elif isinstance(content, list):
        for c in content:
            if isinstance(c, dict):
                kind = c.get("type") or next(iter(c), "?")
                call = c.get("functionCall")
                name = c.get("name") or (call.get("name") if isinstance(call, dict) else None)
                size = len(canonical_json(c))
                out.append(f"{kind}{' ' + str(name) if name else ''} {size:,} B")
            else:
                out.append(f"{type(c).__name__}")
    for tc in msg.get("tool_calls") or []:
        fn = tc.get("function", {}) if isinstance(tc, dict) else {}
        out.append(f"tool_call {fn.get('name')}")
    if not out and msg.get("type"):
        out.append(f"{msg['type']} {len(canonical_json(msg)):,} B")
    return out


# ---------------------------------------------------------------------------------------- rendering


def render(doc: dict[str, Any], *, color: bool) -> str:
    """The document for a terminal (rich): messages and blocks with their decisions, then the wire."""
    from rich.console import Console
    from rich.text import Text

    buf = io.StringIO()
    con = Console(file=buf, force_terminal=color, no_color=not color, color_system="standard" if color else None,
                  soft_wrap=True, highlight=False, markup=False, emoji=False, width=200)

    def line(*parts: tuple[str, str] | str) -> None:
        t = Text()  # every part escaped: texts, ids and names from the transcript never act on the terminal
        for p in parts:
            if isinstance(p, str):
                t.append(terminal_text(p))
            else:
                t.append(terminal_text(p[0]), style=p[1])
        con.print(t)

    k, n = doc["call"], doc["pending_call"]
    which = "the pending call" if doc["is_pending"] else f"call {k}"
    sh = doc.get("shared")
    if sh:
        own = sh["own_calls"]
        span = (f"{own[0]}..{own[-1]}" if len(own) > 1 else str(own[0])) if own else "none"
        note = (f"call {k} of {sh['thread']} is history it shares with {sh['reported_by_thread']}, which reports it: "
                f"showing {sh['reported_by_thread']}'s view of call {k}. {sh['thread']}'s own calls are {span} and "
                f"{sh['pending_call']} (pending); its decisions on this history apply in them")
        line((note, "dim"))
    line((f"{doc['thread_key']}", "bold"), f"  {doc['kind']} · {which} (calls 0..{n}, {n} pending) · "
         f"target {doc['target']} · pipeline {doc['pipeline']} ({(doc['pipeline_sha256'] or '')[:12]})")
    ok = "= calls.parquet" if doc["request_sha256_matches"] else "DIFFERS from calls.parquet"
    line(f"request sha256 {doc['request_sha256'][:16]}… ({ok}) · {plural(doc['n_messages'], 'wire message')} · "
         f"{doc['prompt_tokens']:,} prompt tokens · {doc['request_bytes']:,} bytes · model {doc['model']}")
    d = doc["decisions"]
    stages = ", ".join(f"{s} {c}" for s, c in d["by_stage"].items())
    prov = f", {d['provisional']} provisional (decided for the pending call, not frozen)" if d["provisional"] else ""
    bl = doc["blocks"]
    line(f"{plural(d['count'], 'decision')} effective at this call" + (f": {stages}" if stages else "") + prov
         + f" · blocks: {bl['visible']:,} in the request, {bl['changed']} changed, {bl['inserted']} inserted, "
           f"{bl['moved']} moved, {bl['dropped']} dropped")
    if doc.get("stage_filter") or doc.get("changed_only"):
        what = f"stage {doc['stage_filter']}" if doc.get("stage_filter") else "changed blocks"
        line((f"showing only {what}: {plural(bl['shown'], 'block')}", "dim"))
    rec = doc.get("recorded")
    if rec:
        fd = rec["first_difference"]
        line(f"recorded (identity, no stage): sha256 {rec['request_sha256'][:16]}… · "
             f"{plural(rec['n_messages'], 'wire message')} · {rec['request_bytes']:,} bytes · "
             + ("identical messages" if fd is None else f"first difference at wire message {fd}")
             + (" · envelope differs" if rec["envelope_differs"] else ""))
    styles = {"changed": "yellow", "inserted": "green", "moved": "cyan", "dropped": "red strike"}
    for m in doc["messages"]:
        con.print()
        wire = ", ".join(f"wire {w}" if isinstance(w, int) else str(w) for w in m["wire"]) or "not on the wire"
        tag = {"dropped": "  DROPPED", "inserted": "  INSERTED"}.get(m["status"], "")
        line((f"#{m['index']} {m['role']}", "bold"), f" → {wire} · entry {m['entry_id']}", (tag, "red" if tag.strip() == "DROPPED" else "green"))
        for b in m["blocks"]:
            st = b["status"]
            what = b["block_type"] + (f"/{b['part_type']}" if b["part_type"] and b["block_type"] == "tool_result" else "")
            extra = " ".join(x for x in (b.get("tool_name") or "", b.get("tool_use_id") or "",
                                         "is_error" if b.get("is_error") else "") if x)
            mark = {"dropped": "✗ DROPPED", "inserted": "+ INSERTED", "changed": "~ CHANGED", "moved": "↕ MOVED"}.get(st, "")
            line(f"  [{b['block_pos']}.{b['part_pos']}] ", (what, "bold"), f" {extra}".rstrip(),
                 f" · {b['bytes']:,} B" + ("  " if mark else ""), (mark, styles.get(st, "")))
            body_style = "strike dim" if st == "dropped" else ""
            for text in _body(b):
                line("      │ ", (text, body_style))
            if b.get("recorded") and b["recorded"].get("diff"):
                line(("      recorded → replayed:", "dim"))
                for dl in b["recorded"]["diff"]["text"].split("\n"):
                    line("      ", (dl, "red" if dl.startswith("-") else "green" if dl.startswith("+") else "dim"))
            for dd in b["decisions"]:
                size = f"{_size(dd['before_len'])} → {_size(dd['after_len'])}"
                line("      ↳ ", (dd["stage"], "bold magenta"), f": {dd['action']} ({dd['reason']}) · from call "
                     f"{dd['from_call']} · cache_epoch {dd['cache_epoch']} · {size}",
                     (" · provisional" if dd["is_provisional"] else "", "yellow"))
    w = doc["wire"]
    con.print()
    env = ", ".join(f"{k} {v}" if not isinstance(v, dict) else
                    (f"{k} {plural(v['items'], 'item')} ({v['bytes']:,} B)" if "items" in v else f"{k} {v['bytes']:,} B")
                    for k, v in w["envelope"].items())
    line((f"wire request ({doc['target']}): {plural(len(w['messages']), 'message')}", "bold"), f" · {env}")
    if not w["mapped"]:
        line(("  (the blocks could not be matched to wire messages: showing the wire as it is)", "dim"))
    items = w["messages"]
    if (doc.get("stage_filter") or doc.get("changed_only")) and w["mapped"]:
        # a filter shows what it selects: the wire messages that hold the blocks shown above
        held = {j for m in doc["messages"] for j in m["wire"] if isinstance(j, int)}
        items = [x for x in items if x["index"] in held]
        which = ("none of them: no block above" if not items else
                 f"the {plural(len(items), 'wire message')} that {'holds' if len(items) == 1 else 'hold'} the "
                 f"blocks above")
        line((f"  (showing {which}; the filter leaves out {len(w['messages']) - len(items):,})", "dim"))
    for item in items:
        ch = item["changed_messages"]
        line(f"  {item['index']:>3} {item['role']!s:<9} ", ", ".join(item["parts"]) or "(empty)",
             (f"  ← changed blocks in #{', #'.join(map(str, ch))}" if ch else "", "yellow"))
    text = buf.getvalue()
    return text if color else "\n".join(ln.rstrip() for ln in text.split("\n"))


def _size(v: int | None) -> str:
    return "–" if v is None else f"{v:,} B"


def _body(b: dict[str, Any]) -> list[str]:
    if "image" in b:
        im = b["image"]
        return [f"<image {im['media_type']} {im['width']}x{im['height']}, {im['bytes'] or 0:,} bytes>"]
    for key in ("text", "tool_input", "extra"):
        if key in b:
            text = b[key]["text"]
            if not text.strip():
                return [f"(blank: {orjson.dumps(text).decode()})"]
            return text.split("\n")
    return []


def to_json(doc: dict[str, Any]) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_SORT_KEYS, default=str)
