"""Replay: assemble each call's request from the final blocks, hash it, measure it — in linear time.

Call k of a thread sees the block versions with first_call <= k < last_call. Between two calls
only the rows that start or end there change: a few appended at the end, and now and then one
replaced deep in the history (a layer clearing an old tool result). The replay keeps, across
calls, the visible rows, the logical messages and the wire messages with their canonical bytes,
and does work only where something changed:

- the logical messages around each changed row are regrouped (a message is identified by its
  first row, so nothing after a change needs renumbering);
- the target re-shapes only the wire messages around the change, plus a few after it, until its
  output meets the old wire messages again (same first row, same logical messages from there
  on, `context_key` unchanged): from there the old canonical bytes are kept as they are. A wire
  message's bytes are thus re-made only when one of the block versions it is made of changes;
- the request hash: the canonical JSON of a request puts its message list first (its key sorts
  first), so `sha256(request)` continues the sha256 state of the unchanged prefix with the bytes
  after it and the envelope. States are kept every CHUNK messages; a change at message j costs a
  hash update over the cached bytes after j, not Python shaping. That update is the one piece of
  work that grows with the bytes after a change; when it is long, a worker thread does it (hashlib
  lets the replay's Python run meanwhile) and the results are yielded in order, a few calls late.

Every distinct wire message (and envelope) goes once into a MessageStore (canonical bytes,
sha256, role, content blocks, estimated tokens); each call is its list of message ids. A wire
message's tokens are those of the block rows it sends (`targets.Wire.rows`), so `prompt_tokens`
counts exactly the request that was hashed. Requests are materialised only when asked for
(the pending one by default); any call's request can be rebuilt from the store
(`pipeline/assembly/store.py`).

A recorded call's request never ends with an assistant message when the target does not allow a
prefill (Anthropic): the replay leaves that message out. The pending request of a thread that
ended on the assistant's answer keeps it (`awaits_user`): it is what a resumed session carries
and sends with the user's next message.
"""

from __future__ import annotations

import bisect
import hashlib
import re
import time
from array import array
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson
import polars as pl

from ctxreplay.errors import TargetError
from ctxreplay.pipeline.core.blockops import canonical_json, sort_blocks
from ctxreplay.pipeline.core.constants import MESSAGE_OVERHEAD_TOKENS, POLARS_ENGINE, REQUEST_OVERHEAD_TOKENS
from ctxreplay.pipeline.targets import ASSISTANT_ROLES, LogicalMessage, Target, Wire, in_envelope, wire_role
from ctxreplay.pipeline.targets.wire import label, split

CHUNK = 64  # a sha256 state is kept every CHUNK wire messages
FAR = 1  # the kept hash states grow by at most FAR chunks per call; a longer tail is hashed by a worker
LAG = 16  # calls the replay may run ahead of the worker's hashes
WINDOW = 3  # logical messages shaped past a change before looking for the old wire messages again
MERGE_GAP = 4  # changed logical messages closer than this are re-shaped together
MAX_STAND_IN = 4  # messages a target's stand-in may hold: a request's first ids compared with the previous one's

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")

ROW_COLUMNS = [
    "msg_key", "role", "block_pos", "part_pos", "block_type", "part_type", "text", "signature",
    "tool_use_id", "tool_name", "tool_input", "is_error", "image_media_type", "image_data", "extra_json",
    "first_call", "last_call", "timestamp",
]


KEY_MAX = 200  # bytes of a key's readable part: `requests/<key>.jsonl` stays under 255 bytes
_PLAIN_SESSION = re.compile(r"[a-z0-9][a-z0-9._-]*")
_PLAIN_THREAD = re.compile(r"[a-z0-9][a-z0-9._-]*")


def thread_key(session_id: str, thread_id: str) -> str:
    """The thread's name in outputs and file names (`requests/<key>.json`).

    Plain ids give `<session_id>` for a main thread, else `<session_id>--<thread_id>`. Any other
    id (characters outside `[a-z0-9._-]`, uppercase, a `--` inside the session id, a leading dot
    or dash, an empty or very long id: `..`, `a/b`, a NUL, 300 bytes) gives the readable form with
    every character outside `[A-Za-z0-9._-]` replaced by `_`, and a leading `-` or `.` too, cut to
    KEY_MAX characters, then `~` and 16 hex digits of the sha256 of the two ids. So a key is always a
    safe file name under 255 bytes that never starts with `-` (no key reads as an option on a command
    line: `ctxreplay why OUT --help--main` would need `--`) nor `.` (no hidden file), and two threads
    never share one (not even on a case-insensitive file system): plain keys hold no `~` and decode
    back to their ids, the others carry the ids' hash."""
    readable = session_id if thread_id == "main" else f"{session_id}--{thread_id}"
    if (len(readable) <= KEY_MAX and _PLAIN_SESSION.fullmatch(session_id) and "--" not in session_id
            and (thread_id == "main" or _PLAIN_THREAD.fullmatch(thread_id))):
        return readable
    digest = hashlib.sha256(f"{session_id}\0{thread_id}".encode("utf-8", "surrogatepass")).hexdigest()[:16]
    shown = _UNSAFE.sub("_", readable)[:KEY_MAX]
    return f"{'_' + shown[1:] if shown[:1] in ('-', '.') else shown}~{digest}"


def _thread_keys(s: pl.Series) -> pl.Series:
    ids = s.struct.unnest()
    uniq = ids.unique()
    keys = [None if a is None or b is None else thread_key(a, b)
            for a, b in zip(uniq.get_column("session_id").to_list(), uniq.get_column("thread_id").to_list())]
    uniq = uniq.with_columns(_key=pl.Series(keys, dtype=pl.String))
    return ids.join(uniq, on=["session_id", "thread_id"], how="left", nulls_equal=True,
                    maintain_order="left").get_column("_key")


def thread_key_expr() -> pl.Expr:
    """thread_key as a column expression (over session_id, thread_id; one Python call per thread)."""
    return pl.struct("session_id", "thread_id").map_batches(_thread_keys, return_dtype=pl.String,
                                                            is_elementwise=True)


@dataclass
class CallInfo:
    """What the replay needs of recorded call k: its index and the model it asked.

    `reported` is False for an inherited call: a recorded request on the thread's path that another
    thread reports (a branch's shared history). The replay walks it like any call, so the stages'
    state and the prefix comparison follow the path, but its row is not output.
    """

    call: int
    model: str | None = None
    reported: bool = True


@dataclass
class CallResult:
    call: int
    is_pending: bool
    request_sha256: str  # (inside replay_thread, a Future while a worker thread hashes a long tail)
    n_messages: int
    prompt_tokens: int
    prefix_break_message: int | None
    timestamp: Any
    model: str | None
    awaits_user: bool  # pending, and the request ends with the assistant's answer
    request_json: bytes | None  # the request's canonical JSON, when materialised
    request: dict[str, Any] | None  # the same, parsed


class MessageStore:
    """Every distinct wire message and envelope of a run, once, under a dense id: its canonical
    bytes, sha256, kind (`message` / `envelope`), role, number of content blocks and estimated
    tokens. Two messages with the same bytes are one message, with one token count (the first
    one seen; `token_conflicts` counts bytes seen again with another count, which the row-exact
    accounting of the targets should never produce)."""

    def __init__(self) -> None:
        self.ids: dict[bytes, int] = {}
        self.sha256: list[str] = []
        self.data: list[bytes] = []
        self.kind: list[str] = []
        self.role: list[str | None] = []
        self.n_blocks: list[int] = []
        self.tokens: list[int] = []
        self.token_conflicts = 0

    def __len__(self) -> int:
        return len(self.data)

    def add(self, data: bytes, *, kind: str, role: str | None, n_blocks: int, tokens: int) -> int:
        digest = hashlib.sha256(data).digest()
        i = self.ids.get(digest)
        if i is not None:
            if self.tokens[i] != tokens:
                self.token_conflicts += 1
            return i
        i = len(self.data)
        self.ids[digest] = i
        self.sha256.append(digest.hex())
        self.data.append(data)
        self.kind.append(kind)
        self.role.append(role)
        self.n_blocks.append(n_blocks)
        self.tokens.append(tokens)
        return i


ENVELOPE_SLOT = -(1 << 62)  # SpanLog.slot of an envelope (null in call_messages.parquet)


class SpanLog:
    """Which message holds which place of which call's request, in linear space: one row per
    stretch of calls [first, last) during which a message holds one place (`slot`: ascending
    in request order) of a thread's requests; an envelope's rows have ENVELOPE_SLOT. Call k's
    request is the messages of the rows with first <= k < last, by slot, then its envelope;
    `last` is the thread's pending call + 1 for what stays to the end."""

    def __init__(self) -> None:
        self.threads: list[tuple[str, str, str]] = []  # (session_id, thread_id, thread_key)
        self.thread: array = array("i")  # type: ignore[type-arg]
        self.slot: array = array("q")  # type: ignore[type-arg]
        self.first: array = array("i")  # type: ignore[type-arg]
        self.last: array = array("i")  # type: ignore[type-arg]
        self.id: array = array("i")  # type: ignore[type-arg]

    def begin_thread(self, session_id: str, thread_id: str, key: str) -> None:
        self.threads.append((session_id, thread_id, key))

    def add(self, slot: int, first: int, last: int, mid: int) -> None:
        if last > first:
            self.thread.append(len(self.threads) - 1)
            self.slot.append(slot)
            self.first.append(first)
            self.last.append(last)
            self.id.append(mid)

    def __len__(self) -> int:
        return len(self.id)


def n_blocks(msg: dict[str, Any]) -> int:
    """Content blocks of a wire message: its content (or Gemini parts) list, or 1 for a non-empty
    string content, plus OpenAI chat tool calls; an item without content (OpenAI Responses) is one."""
    content = msg.get("content", msg.get("parts"))
    if isinstance(content, list):
        n = len(content)
    elif isinstance(content, str):
        n = 1 if content else 0
    else:
        n = 0 if "role" in msg else 1
    return n + len(msg.get("tool_calls") or ())


def list_prefix(list_key: str) -> bytes:
    """The canonical JSON of a request up to its first message."""
    return b'{"' + list_key.encode() + b'":['


def envelope_suffix(env_json: bytes) -> bytes:
    """What follows the message list in a request, from the envelope's canonical JSON."""
    return b"]}" if env_json == b"{}" else b"]," + env_json[1:]


def _envelope_bytes(env: dict[str, Any], target: Target) -> bytes:
    list_key = target.list_key
    for k in env:
        if k <= list_key:
            raise TargetError(
                f"target {target.name}: its envelope() returns the key '{k}', which does not sort after the "
                f"message list's key '{list_key}'; ctxreplay builds a request's canonical JSON with the messages "
                f"before every other key (its hashes and request store rely on it). Rename the key in the "
                f"target's envelope() so that it sorts after '{list_key}', or use another list_key")
    return envelope_suffix(canonical_json(env))


def request_bytes(list_key: str, messages: list[bytes], env_json: bytes) -> bytes:
    """A request's canonical JSON from its messages' and envelope's canonical JSON."""
    return list_prefix(list_key) + b",".join(messages) + envelope_suffix(env_json)


def first_diff(prev: Any, cur: Any, lo: int = 0) -> int | None:
    """The first index where two message lists (arrays or lists of ids) differ (a shorter list
    differs at its end), given that they agree before `lo`; None when `cur` extends `prev`."""
    q = min(len(prev), len(cur))
    lo = min(lo, q)
    if prev[lo:q] == cur[lo:q]:
        return None if len(cur) >= len(prev) else len(cur)
    hi = q  # a difference lies in [lo, hi)
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if prev[lo:mid] == cur[lo:mid]:
            lo = mid
        else:
            hi = mid
    while prev[lo] == cur[lo]:
        lo += 1
    return lo


class _HashChain:
    """sha256 states of `{"<list_key>":[m0,m1,...` after every CHUNK-th wire message, and the joined
    bytes of each complete chunk (`m_{cC},...,m_{cC+C-1}`), kept until a message inside it changes:
    a tail after a deep change is hashed from these pieces (each update long enough for hashlib
    to let the replay's Python run), with no join of its messages again."""

    def __init__(self, list_key: str, data: list[bytes]) -> None:
        self.data = data  # the thread's wire messages' canonical bytes (the replay edits it in place)
        self.states = [hashlib.sha256(list_prefix(list_key))]
        self.blobs: list[bytes] = []  # blobs[c]: chunk c's messages joined, for the first complete chunks
        # the state through the last request's messages (their number, the state), while none of
        # them changed: the next call hashes only the messages it adds, not the ones since the
        # last chunk boundary again (on average CHUNK / 2 messages a call)
        self.last: tuple[int, Any] | None = None

    def invalidate(self, first_changed: int) -> None:
        del self.states[first_changed // CHUNK + 1:]
        if self.last is not None and first_changed < self.last[0]:
            self.last = None

    def edited(self, lo: int, hi: int, moved: bool) -> None:
        """Messages [lo, hi) were replaced (`moved`: by another number of messages, so every later
        one moved too): the chunks that hold them are joined again when asked for."""
        blobs = self.blobs
        end = len(blobs) if moved else min(len(blobs), (max(hi, lo + 1) - 1) // CHUNK + 1)
        c = lo // CHUNK
        if c >= len(blobs):
            return
        if moved or end == len(blobs):
            del blobs[c:]
        else:
            for x in range(c, end):
                blobs[x] = b""

    def blob(self, c: int) -> bytes:
        """Chunk c's messages joined by commas (c a complete chunk)."""
        blobs, data = self.blobs, self.data
        while len(blobs) <= c:
            x = len(blobs)
            blobs.append(b",".join(data[x * CHUNK:(x + 1) * CHUNK]))
        b = blobs[c]
        if not b:  # (no chunk joins to b"": it holds CHUNK messages of at least 2 bytes)
            b = blobs[c] = b",".join(data[c * CHUNK:(c + 1) * CHUNK])
        return b

    def pieces(self, lo: int, m: int) -> list[bytes]:
        """Messages [lo, m) (lo a chunk boundary) as pieces to join by commas: whole chunks' bytes,
        then the messages of the last, incomplete one."""
        out = [self.blob(c) for c in range(lo // CHUNK, m // CHUNK)]
        tail = max(lo, m // CHUNK * CHUNK)
        if tail < m:
            out.append(b",".join(self.data[tail:m]))
        return out

    def split_state(self, m: int) -> tuple[Any, bool, list[bytes], int]:
        """(a new hash object, whether a comma comes next, the pieces still to hash, the number of
        messages they hold) for the prefix through message m-1. The kept states grow by at most
        FAR chunks per call: a long tail (the bytes after a change deep in the history) is left to
        the caller, who hashes it off the main thread."""
        states, last = self.states, self.last
        c = min(m // CHUNK, len(states) - 1 + FAR)
        self._extend(c)
        if last is not None and c * CHUNK < last[0] <= m:
            lo = last[0]
            h, comma, rest = last[1].copy(), True, ([b",".join(self.data[lo:m])] if m > lo else [])
        else:
            lo = c * CHUNK
            h, comma, rest = states[c].copy(), c > 0, self.pieces(lo, m)
        if m - lo > CHUNK:
            return h, comma, rest, m - lo
        for piece in rest:  # a short tail: hashed here, and the state through message m-1 kept
            if comma:
                h.update(b",")
            h.update(piece)
            comma = True
        self.last = (m, h.copy())
        return h, comma, [], 0

    def _extend(self, c: int) -> None:
        """Keep hash states through chunk c (each one the previous plus CHUNK more messages)."""
        states = self.states
        while len(states) <= c:
            x = len(states) - 1
            h = states[-1].copy()
            if x:
                h.update(b",")
            h.update(self.blob(x))
            states.append(h)

    def state(self, m: int) -> Any:
        """A new hash object holding the prefix through message m-1."""
        states, data = self.states, self.data
        c = m // CHUNK
        self._extend(c)
        h = states[c].copy()
        if m > c * CHUNK:
            if c:
                h.update(b",")
            h.update(b",".join(data[c * CHUNK:m]))
        return h


def _same_lead(old: list[LogicalMessage], logical: list[LogicalMessage], start: int, end: int) -> int:
    """How many of logical[start:end] (a range just regrouped) are, from its start, the messages
    `old` held: the same rows (the same row versions, in order)."""
    n = min(len(old), end - start)
    k = 0
    while k < n:
        o, m = old[k], logical[start + k]
        if o.msg_key != m.msg_key or o.role != m.role or len(o.rows) != len(m.rows) or \
                any(x is not y for x, y in zip(o.rows, m.rows)):
            break
        k += 1
    return k


class ThreadWalk:
    """The replay state of one thread between two calls."""

    def __init__(self, rows: list[dict[str, Any]], target: Target, store: MessageStore, spans: SpanLog | None) -> None:
        self.rows = rows
        self.target = target
        self.store = store
        self.spans = spans
        self.k = 0  # the call being replayed
        self.context_key: Callable[[LogicalMessage], Any] | None = getattr(target, "context_key", None)
        self.vis: list[int] = []  # visible rows (not system rows when the target splits them), ascending
        self.logical: list[LogicalMessage] = []
        self.log_start: list[int] = []  # the first row of each logical message
        # wire messages: key (first row of the logical message of its label, sub-message), bytes,
        # store id, tokens, is it the assistant's, the call from which it holds its place in the
        # requests (None: left out of the current request, as its trailing assistant message)
        self.wkey: list[tuple[int, int]] = []
        self.wb: list[bytes] = []
        self.wid: array = array("i")  # type: ignore[type-arg]
        self.wtok: list[int] = []
        self.wasst: list[bool] = []
        self.wfirst: list[int | None] = []
        self.wtok_total = 0
        self.chain = _HashChain(target.list_key, self.wb)

    @staticmethod
    def slot(key: tuple[int, int]) -> int:
        return (key[0] << 20) + key[1]

    def close(self, key: tuple[int, int], first: int | None, mid: int, last: int) -> None:
        if self.spans is not None and first is not None:
            self.spans.add(self.slot(key), first, last, mid)

    # ------------------------------------------------------------------ rows and logical messages

    def apply(self, added: list[int], removed: list[int]) -> int | None:
        """Apply the row changes of one call; returns the first wire message that differs from
        before (None: none does)."""
        vis, log_start = self.vis, self.log_start
        if not removed and not added:
            return None
        changed = removed + added
        if len(changed) > 64 and len(changed) * 8 > len(vis):
            gone = set(removed)
            vis[:] = sorted([i for i in vis if i not in gone] + added)
        else:
            for i in removed:
                p = bisect.bisect_left(vis, i)
                if p == len(vis) or vis[p] != i:
                    raise AssertionError(f"row {i} leaves the request but was not in it")
                del vis[p]
            if added and (not vis or added[0] > vis[-1]):
                vis.extend(added)
            else:
                for i in added:
                    bisect.insort(vis, i)
        n_log = len(self.logical)
        if n_log == 0:
            ranges = [(0, -1)]
        else:
            dirty = sorted({max(bisect.bisect_right(log_start, i) - 1, 0) for i in changed})
            ranges = []
            for m in dirty:
                if self._stays_one(m):  # its rows changed, but it is still one message: no neighbour moves
                    a, b = m, m
                else:  # it splits, vanishes or grows new messages: its neighbours may merge with them
                    a, b = max(m - 1, 0), min(m + 1, n_log - 1)
                if ranges and a <= ranges[-1][1] + MERGE_GAP:
                    ranges[-1] = (ranges[-1][0], max(b, ranges[-1][1]))
                else:
                    ranges.append((a, b))
        # regroup each range (last first, so that the indices of the earlier ones stay valid)
        spliced: list[tuple[int, list[LogicalMessage], int]] = []
        for a, b in reversed(ranges):
            msgs, starts = self._group(*self._bounds(a, b))
            old = self.logical[a:b + 1]
            self.logical[a:b + 1] = msgs
            log_start[a:b + 1] = starts
            spliced.append((a, old, len(msgs)))
        spliced.reverse()
        # with several changed ranges, a later one can undo what an earlier one changed at the same
        # place (a compaction that keeps messages equal to the ones it removes): compare the lists
        before = self.wid[:] if len(spliced) > 1 else None
        first: int | None = None
        shift = 0
        for r, (a, old, n_new) in enumerate(spliced):
            start, end = a + shift, a + shift + n_new
            shift += n_new - len(old)
            nxt = spliced[r + 1][0] + shift if r + 1 < len(spliced) else None
            # the range's first messages may be regrouped as they were (the neighbour taken in with
            # a new message): the wire messages change from the run that holds the first one that differs
            # (a changed row is in one of the range's new messages or was in one of its old ones, so
            # at least one differs; if none did, its last one is shaped again)
            same = min(_same_lead(old, self.logical, start, end), n_new - 1) if n_new else 0
            f = self._reshape(start + same, end, nxt, old[same:])
            if f is not None and (first is None or f < first):
                first = f
        if before is not None and first is not None:
            d = first_diff(before, self.wid, first)
            first = d if d is not None else (len(before) if len(self.wid) > len(before) else None)
        return first

    def _bounds(self, a: int, b: int) -> tuple[int, int]:
        """The positions in `vis` of the rows of logical messages a..b (after this call's changes)."""
        vis, log_start = self.vis, self.log_start
        lo = 0 if a == 0 else bisect.bisect_left(vis, log_start[a])
        hi = len(vis) if b + 1 >= len(log_start) else bisect.bisect_left(vis, log_start[b + 1])
        return lo, hi

    def _stays_one(self, m: int) -> bool:
        lo, hi = self._bounds(m, m)
        if hi <= lo:
            return False
        rows, vis = self.rows, self.vis
        key = self.logical[m].msg_key
        return all(rows[vis[p]]["msg_key"] == key for p in range(lo, hi))

    def _group(self, lo: int, hi: int) -> tuple[list[LogicalMessage], list[int]]:
        rows, vis = self.rows, self.vis
        msgs: list[LogicalMessage] = []
        starts: list[int] = []
        for pos in range(lo, hi):
            i = vis[pos]
            r = rows[i]
            if msgs and msgs[-1].msg_key == r["msg_key"]:
                msgs[-1].rows.append(r)
            else:
                msgs.append(LogicalMessage(r["role"], [r], r["msg_key"]))
                starts.append(i)
        return msgs, starts

    # ------------------------------------------------------------------ wire messages

    def _reshape(self, start: int, end: int, nxt: int | None, old: list[LogicalMessage]) -> int | None:
        """Re-shape the wire messages of logical messages [start, end) (they replace `old`) and as
        few after them as needed; `nxt` is where the next changed range starts. Returns the first
        wire index that differs from before."""
        logical, log_start, wkey = self.logical, self.log_start, self.wkey
        n_log = len(logical)
        # from the first wire message of the run that holds logical message start-1 (it may merge
        # with start; the later wire messages of a run all carry the run's first message as label)
        p = bisect.bisect_right(wkey, (log_start[start - 1], 1 << 30)) - 1 if start > 0 else -1
        if p >= 0:
            p = bisect.bisect_left(wkey, (wkey[p][0], -1))
        if p < 0:
            wj, shape_from = 0, 0.0
        else:
            wj = p
            row, sub = wkey[p]
            li = bisect.bisect_left(log_start, row)
            if li == n_log or log_start[li] != row:
                raise AssertionError(f"wire message {p} starts at row {row}, which starts no message")
            shape_from = label(li, sub)
        may_resync = True
        if self.context_key is not None:
            ck = self.context_key
            before = [x for x in (ck(m) for m in old) if x is not None]
            after = [x for x in (ck(m) for m in logical[start:end]) if x is not None]
            may_resync = before == after
        window = WINDOW
        while True:
            stop = n_log if not may_resync else min(n_log, end + window)
            if nxt is not None and stop > nxt:
                stop = n_log  # would run into the next changed range: shape through it
            out = self.target.shape(logical if stop == n_log else logical[:stop], shape_from) \
                if shape_from < stop else []
            oj = None
            q = len(out)
            if stop < n_log:
                # the first wire message past the change that the old list holds too; it must be
                # complete (one more shaped after it), so that it can be checked against the old one
                for q, (lab, _) in enumerate(out[:-1]):
                    i, sub = split(lab)
                    if i < end:
                        continue
                    key = (log_start[i], sub)
                    o = bisect.bisect_left(wkey, key, lo=wj)
                    if o < len(wkey) and wkey[o] == key and (wj + q == 0) == (o == 0):
                        oj = o
                        break
                else:
                    window *= 4
                    continue
            break
        if oj is None:
            oj = len(wkey)
        else:
            # the messages shaped past the meeting point must be the ones kept (the target contract:
            # a wire message depends on no logical message outside its own run)
            for t in range(q, len(out) - 1):
                if oj + t - q >= len(self.wb) or canonical_json(out[t][1]) != self.wb[oj + t - q]:
                    raise AssertionError(f"target {self.target.name}: re-shaping changed wire message "
                                         f"{oj + t - q}, which depends on none of the changed rows")
        return self._splice(wj, oj, out[:q], stop)

    def _splice(self, wj: int, oj: int, new: list[tuple[float, dict[str, Any]]], stop: int) -> int | None:
        """Replace wire messages [wj, oj) by `new`; returns the first index that differs."""
        store, log_start, k = self.store, self.log_start, self.k
        keys, data, ids, toks, asst, firsts = [], [], [], [], [], []
        n_old = oj - wj
        for t, (lab, msg) in enumerate(new):
            b = canonical_json(msg)
            i, sub = split(lab)
            if isinstance(msg, Wire):
                tok = sum(r["_tok"] for r in msg.rows)
            else:  # a target without row accounting: the rows of the logical messages it starts
                nxt = split(new[t + 1][0])[0] if t + 1 < len(new) else stop
                tok = 0 if sub else sum(r["_tok"] for m in self.logical[i:max(nxt, i + 1)] for r in m.rows)
            key = (log_start[i], sub)
            if t < n_old and self.wkey[wj + t] == key and self.wb[wj + t] == b:
                # re-shaped as it was (the message before a change, or one past it): same id, no new hash
                mid = self.wid[wj + t]
                role = store.role[mid]
                if store.tokens[mid] != tok:
                    store.token_conflicts += 1
                same = True
            else:
                role = wire_role(msg)
                mid = store.add(b, kind="message", role=role, n_blocks=n_blocks(msg), tokens=tok)
                same = t < n_old and self.wkey[wj + t] == key and self.wid[wj + t] == mid
            keys.append(key)
            data.append(b)
            ids.append(mid)
            toks.append(store.tokens[mid])
            asst.append(role in ASSISTANT_ROLES)
            firsts.append(self.wfirst[wj + t] if same else k)
        for t in range(n_old):  # the places that end here
            if t >= len(new) or firsts[t] == k:
                self.close(self.wkey[wj + t], self.wfirst[wj + t], self.wid[wj + t], k)
        first = next((wj + t for t in range(len(ids)) if t >= n_old or self.wid[wj + t] != ids[t]), None)
        if first is None and n_old != len(ids):
            first = wj + len(ids)
        if first is not None and n_old != len(ids) and oj < len(self.wid):
            # the messages after the splice moved: compare them where they now stand
            d = first_diff(self.wid[wj:], array("i", ids) + self.wid[oj:])
            first = wj + (d if d is not None else len(self.wid) - wj)
        self.wtok_total += sum(toks) - sum(self.wtok[wj:oj])
        self.wkey[wj:oj] = keys
        self.wb[wj:oj] = data
        self.wid[wj:oj] = array("i", ids)
        self.wtok[wj:oj] = toks
        self.wasst[wj:oj] = asst
        self.wfirst[wj:oj] = firsts
        self.chain.edited(wj, oj, len(ids) != n_old)
        if first is not None:
            self.chain.invalidate(first)
        return first

    def sent_length(self, *, keep_trailing: bool) -> int:
        """How many wire messages the request sends: all of them, less a trailing assistant message
        when the target takes no prefill, unless `keep_trailing` (the request waits for the user)."""
        n = len(self.wb)
        if n and not keep_trailing and not getattr(self.target, "allow_prefill", True) and self.wasst[-1]:
            return n - 1
        return n

    def request_parts(self, m: int, stand_ids: list[int] | None) -> tuple[int, Any, bool, list[bytes], int]:
        """(message tokens, a hash state, whether a comma comes next, the pieces still to hash, joined
        by commas: messages or runs of them, and how many messages they hold) of a request of the
        first m wire messages, or, with m = 0, of the target's stand-in messages."""
        if m:
            h, comma, rest, n_rest = self.chain.split_state(m)
            return self.wtok_total - (self.wtok[-1] if m < len(self.wb) else 0), h, comma, rest, n_rest
        ids = stand_ids or []
        store = self.store
        return (sum(store.tokens[i] for i in ids), self.chain.states[0].copy(), False, [store.data[i] for i in ids],
                len(ids))

    def hold(self, m: int, excluded: tuple[int, int] | None) -> tuple[int, int] | None:
        """The first m wire messages make this call's request: a trailing one left out stops
        holding its place (only the last one can be); the one left out before holds it again if
        it no longer is. Returns the key of the one left out now."""
        wkey, wfirst, k = self.wkey, self.wfirst, self.k
        n = len(wkey)
        if excluded is not None:
            j = bisect.bisect_left(wkey, excluded)
            if j < n and wkey[j] == excluded and wfirst[j] is None and j < m:
                wfirst[j] = k
        if m == n:
            return None
        j = n - 1
        self.close(wkey[j], wfirst[j], self.wid[j], k)
        wfirst[j] = None
        return wkey[j]

    def finish(self, end: int) -> None:
        for key, first, mid in zip(self.wkey, self.wfirst, self.wid, strict=True):
            self.close(key, first, mid, end)


def replay_thread(
    rows: list[dict[str, Any]],
    tokens: list[int],
    calls: list[CallInfo],
    target: Target,
    *,
    store: MessageStore | None = None,
    spans: SpanLog | None = None,
    materialize: Callable[[int, bool], bool] = lambda k, pending: pending,
) -> Iterator[CallResult]:
    """Yield one CallResult per call 0..n (n = pending) of one thread.

    `rows` are the thread's block versions sorted by (order_key, block_pos, part_pos, first_call);
    `tokens[i]` is row i's token estimate (kept in the row as `_tok`); `calls[k]` what was
    recorded for call k. Wire messages and envelopes go into `store` (a new one if None); which
    message is part of which call's request goes to `spans` (call `spans.begin_thread` first).
    """
    store = store if store is not None else MessageStore()
    for r, t in zip(rows, tokens, strict=True):
        r["_tok"] = t
    n_calls = len(calls)
    add_at: dict[int, list[int]] = defaultdict(list)
    rem_at: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        fc, lc = r["first_call"], r["last_call"]
        if lc is not None and lc <= fc:
            continue
        add_at[fc].append(i)
        if lc is not None:
            rem_at[lc].append(i)
    list_key = target.list_key
    split_system = target.splits_system()
    th = ThreadWalk(rows, target, store, spans)
    system_rows: list[int] = []
    env_key: tuple[Any, ...] | None = None
    env_id, env_first, env_suffix, env_tok = -1, 0, b"]}", 0
    sys_version = 0
    stand_ids: list[int] | None = None  # the target's stand-in messages, for a request with none
    stand_first: int | None = None  # the call from which the stand-in holds the request
    excluded: tuple[int, int] | None = None
    prev_len, prev_head, prev_stand_in = 0, array("i"), False  # the previous request: length, first ids
    last_ts = None
    queue: deque[CallResult] = deque()  # results whose hash the worker may still be computing
    pool: ThreadPoolExecutor | None = None
    guard = _PoolGuard()  # shuts the worker down if the caller stops early
    for k in range(n_calls + 1):
        th.k = k
        added = sorted(add_at.get(k, ()))
        removed = rem_at.get(k, [])
        if split_system:
            added, removed, new_system = split_system_rows(rows, system_rows, added, removed, target)
            if new_system is not None:
                system_rows = new_system
                sys_version += 1
        first_changed = th.apply(added, removed)
        if th.vis:
            ts = rows[th.vis[-1]]["timestamp"]
            last_ts = ts if ts is not None else last_ts
        is_pending = k == n_calls
        info = calls[k] if k < n_calls else None
        model = info.model if info else (calls[-1].model if calls else None)
        if env_key != (model, sys_version):
            env_key = (model, sys_version)
            new_env, env_suffix = make_envelope(target, model, rows, system_rows, store)
            if new_env != env_id:
                if spans is not None and env_id >= 0:
                    spans.add(ENVELOPE_SLOT, env_first, k, env_id)
                env_id, env_first = new_env, k
            env_tok = store.tokens[env_id]
        # a recorded call's request never ends with an assistant message unless the target
        # allows a prefill; the pending one keeps it (it awaits the user's next message)
        m = th.sent_length(keep_trailing=is_pending)
        excluded = th.hold(m, excluded)
        if m:
            msg_tok, h, comma, rest, n_rest = th.request_parts(m, None)
            head = th.wid[:min(m, MAX_STAND_IN)]
            if stand_first is not None:
                if spans is not None:
                    for j, mid in enumerate(stand_ids or ()):
                        spans.add(j - len(stand_ids or ()), stand_first, k, mid)
                stand_first = None
        else:
            # nothing recorded before this call (a history that starts with the assistant): the
            # target's stand-in turn keeps the request valid
            if stand_ids is None:
                stand_ids = stand_in_messages(target, store)
            if stand_first is None:
                stand_first = k
            msg_tok, h, comma, rest, n_rest = th.request_parts(0, stand_ids)
            head = array("i", stand_ids[:MAX_STAND_IN])
        if n_rest > CHUNK:  # a long tail: hashed by the worker while the replay goes on
            if pool is None:
                pool = guard.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctxreplay-hash")
            sha: Any = pool.submit(finish_hash, h, comma, rest, env_suffix)
            # hand the worker the GIL now: it needs it between two hashes (to finish one and join
            # the next one's pieces), and a thread that waits for the GIL while this one runs
            # Python gets it only every switch interval (5 ms), which left the worker idle most of
            # the time (the replay then waited for its hashes: 0.6 s of a 1.3 s replay phase in
            # bench_prefix_break)
            time.sleep(0)
        else:
            sha = finish_hash(h, comma, rest, env_suffix)
        length = m or len(stand_ids or ())
        # where this request first differs from the previous one: the wire messages agree before
        # the first one this call changed; a stand-in (at most MAX_STAND_IN messages) is compared as it is
        if k == 0:
            brk = None
        elif m and not prev_stand_in:
            q = min(prev_len, length)
            brk = first_changed if first_changed is not None and first_changed < q else (
                length if length < prev_len else None)
        else:
            brk = next((i for i in range(min(prev_len, length)) if prev_head[i] != head[i]),
                       length if length < prev_len else None)
        awaits = is_pending and m > 0 and th.wasst[m - 1]
        req_json = None
        if materialize(k, is_pending):
            body = b",".join(th.wb[:m]) if m else b",".join(store.data[i] for i in stand_ids or ())
            req_json = list_prefix(list_key) + body + env_suffix
        queue.append(CallResult(
            call=k,
            is_pending=is_pending,
            request_sha256=sha,
            n_messages=length,
            prompt_tokens=REQUEST_OVERHEAD_TOKENS + env_tok + msg_tok + MESSAGE_OVERHEAD_TOKENS * length,
            prefix_break_message=brk,
            timestamp=last_ts,
            model=model,
            awaits_user=awaits,
            request_json=req_json,
            request=None,
        ))
        prev_len, prev_head, prev_stand_in = length, head, not m
        while queue and (len(queue) > LAG or isinstance(queue[0].request_sha256, str)
                         or queue[0].request_sha256.done()):
            yield _settled(queue.popleft())
    while queue:
        yield _settled(queue.popleft())
    if pool is not None:
        pool.shutdown()
        guard.pool = None
    if spans is not None:
        th.finish(n_calls + 1)
        if stand_first is not None:
            for j, mid in enumerate(stand_ids or ()):
                spans.add(j - len(stand_ids or ()), stand_first, n_calls + 1, mid)
        spans.add(ENVELOPE_SLOT, env_first, n_calls + 1, env_id)


def finish_hash(h: Any, comma: bool, rest: list[bytes], env_suffix: bytes) -> str:
    """The request hash from a prefix state: the remaining pieces (messages, or runs of them joined)
    with commas between, then the envelope. The pieces are joined and hashed by one update:
    hashlib lets other threads run while it hashes more than 2 KiB, and on the worker thread each
    update that does so costs a wait for the GIL afterwards (one per request, not one per chunk)."""
    if rest:
        if comma:
            h.update(b",")
        h.update(rest[0] if len(rest) == 1 else b",".join(rest))
    h.update(env_suffix)
    return str(h.hexdigest())


def _settled(res: CallResult) -> CallResult:
    """The result with its hash in hand (and a materialised request checked against it)."""
    sha = res.request_sha256
    if not isinstance(sha, str):
        res.request_sha256 = sha = sha.result()  # type: ignore[attr-defined]
    if res.request_json is not None:
        if hashlib.sha256(res.request_json).hexdigest() != sha:  # the incremental hash must equal the full one
            raise AssertionError(f"incremental request hash mismatch at call {res.call}")
        res.request = orjson.loads(res.request_json)
    return res


class _PoolGuard:
    pool: ThreadPoolExecutor | None = None

    def __del__(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def split_system_rows(rows: list[dict[str, Any]], system_rows: list[int], added: list[int], removed: list[int],
                      target: Target) -> tuple[list[int], list[int], list[int] | None]:
    """For a target that sends system rows apart (its envelope): (the added and removed rows that
    do not go to the envelope, the new envelope rows or None when they did not change). A system
    row the target keeps in its list (`in_envelope`: a Responses developer input item) stays there."""
    sys_added = [i for i in added if in_envelope(target, rows[i])]
    sys_removed = {i for i in removed if in_envelope(target, rows[i])}
    if not sys_added and not sys_removed:
        return added, removed, None
    sa = set(sys_added)
    return ([i for i in added if i not in sa], [i for i in removed if i not in sys_removed],
            sorted([i for i in system_rows if i not in sys_removed] + sys_added))


def make_envelope(target: Target, model: str | None, rows: list[dict[str, Any]], system_rows: list[int],
                  store: MessageStore) -> tuple[int, bytes]:
    """The request's envelope for `model` and the system rows: (its id in `store`, the bytes that
    close the request after the message list)."""
    system = _system_messages(rows, system_rows) if target.splits_system() else []
    env = target.envelope(model, system)
    sent = [rows[i] for i in system_rows if rows[i]["block_type"] == "text"]
    env_id = store.add(canonical_json(env), kind="envelope", role=None, n_blocks=len(sent),
                       tokens=sum(r["_tok"] for r in sent))
    return env_id, _envelope_bytes(env, target)


def stand_in_messages(target: Target, store: MessageStore) -> list[int]:
    """The target's stand-in turn (a request with no recorded message before it), added to `store`."""
    stand_in = target.empty_messages()
    if len(stand_in) > MAX_STAND_IN:
        raise TargetError(
            f"target {target.name}: its empty_messages() returns {len(stand_in)} messages to stand in for a request "
            f"with no recorded message; the replay takes at most {MAX_STAND_IN} (it compares a stand-in whole). "
            f"Return at most {MAX_STAND_IN} messages (e.g. one user turn), or [] for none")
    return [store.add(canonical_json(x), kind="message", role=wire_role(x), n_blocks=n_blocks(x), tokens=0)
            for x in stand_in]


def _system_messages(rows: list[dict[str, Any]], idx: list[int]) -> list[LogicalMessage]:
    out: list[LogicalMessage] = []
    for i in idx:
        r = rows[i]
        if out and out[-1].msg_key == r["msg_key"]:
            out[-1].rows.append(r)
        else:
            out.append(LogicalMessage("system", [r], r["msg_key"]))
    return out


def call_skeleton(blocks: pl.DataFrame) -> pl.DataFrame:
    """One row per recorded call (assistant message with is_call), from the loaded blocks."""
    return (
        blocks.filter(pl.col("is_call"))
        .group_by("session_id", "thread_id", "msg_key")
        .agg(
            call=(pl.col("first_call").min() - 1).cast(pl.Int32),
            model=pl.col("model").first(),
            message_id=pl.col("message_id").first(),
            request_id=pl.col("request_id").first(),
            usage_input=pl.col("usage_input").first(),
            usage_output=pl.col("usage_output").first(),
            usage_cache_read=pl.col("usage_cache_read").first(),
            usage_cache_write=pl.col("usage_cache_write").first(),
            usage_cache_write_5m=pl.col("usage_cache_write_5m").first(),
            usage_cache_write_1h=pl.col("usage_cache_write_1h").first(),
            cache_miss_reason=pl.col("cache_miss_reason").first(),
            cache_missed_tokens=pl.col("cache_missed_tokens").first(),
        )
        .sort("session_id", "thread_id", "call")
    )


def call_counts(blocks: pl.DataFrame) -> dict[tuple[str, str], int]:
    """Calls per thread, inherited ones included (= the pending call's index: the largest first_call),
    from the loaded blocks."""
    df = blocks.group_by("session_id", "thread_id").agg(n=pl.col("first_call").max())
    return {(sid, tid): int(n) for sid, tid, n in df.iter_rows()}


def thread_calls(skeleton: pl.DataFrame, counts: dict[tuple[str, str], int] | None = None,
                 ) -> dict[tuple[str, str], list[CallInfo]]:
    """CallInfo 0..n-1 per thread: the reported calls of the skeleton, and (with `counts`, calls per
    thread) the inherited calls between them (`reported = False`)."""
    out: dict[tuple[str, str], list[CallInfo]] = defaultdict(list)
    for sid, tid, call, model in skeleton.select("session_id", "thread_id", "call", "model").iter_rows():
        out[(sid, tid)].append(CallInfo(call, model))
    for key, n in (counts or {}).items():
        have = {c.call for c in out[key]}
        out[key].extend(CallInfo(k, None, reported=False) for k in range(n) if k not in have)
    for key, lst in out.items():
        lst.sort(key=lambda c: c.call)
        if [c.call for c in lst] != list(range(len(lst))):
            raise AssertionError(f"calls of thread {key} are not numbered 0..n-1: {[c.call for c in lst][:10]}")
    return out


def thread_rows(blocks: pl.DataFrame) -> Iterator[tuple[tuple[str, str], pl.DataFrame]]:
    """The blocks of each thread, sorted for replay (stable across runs: keys only)."""
    df = sort_blocks(blocks.lazy()).collect(engine=POLARS_ENGINE)
    for key, part in df.group_by(["session_id", "thread_id"], maintain_order=True):
        yield (str(key[0]), str(key[1])), part
