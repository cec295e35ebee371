"""Prompt-cache simulator: what each request of a run would read from and write to the provider's
cache, by the published rules (../shared/docs/cost-and-cache.md §2), over the call timestamps.

```python
prep = prepare(loaded_blocks, calls, counter.series_counter(), final_blocks)   # calibration + facts
store = SimStore.from_dir(out)                       # or SimStore.from_tables(messages, call_messages)
sim = simulate(calls, store, prep, decisions=decisions, prices=PriceBook.load())
sim.calls          # calls + the sim_* / recorded cost / break columns (schemas/calls.py)
```

`simulate` is deterministic and changes nothing but the `CacheState` it is given: the same
inputs give the same frame. It walks every
reported, non-pending call of the given frame in time order (per thread in call order) through a
`CacheState`: the cached prefixes per (scope, model) with their expiry and the time from which
they can be read. Pass one state to several `simulate` calls to share the cache across groups of
sessions processed in time order (`compare` of several pipelines uses one fresh state each).

Requests are the request store's message lists (`SimStore`): a request is a chain of prefix
nodes — the shared preamble (Claude Code's system prompt and tools, common to the sessions of an
account), the thread's own system prompt, what the agent injects before the first recorded message
(one node per compaction segment), then one node per wire message (its sha256; with a thinking
block stripped or not). A node is a hash chained over the prefix's parts (`CacheState.child` for the
preamble's, a polynomial step per message after it: `_extend_chain`), so two requests that send the
same bytes reach the same node, whichever thread sends them, and nothing is stored per prefix but
cache entries. Between two calls a thread's chain is recomputed only from its first changed slot:
the walk costs O(calls + the slots at or after each call's first change) hash steps (appends only,
under identity), and a long recomputation (a deep prefix break) is one vectorised numpy pass.
Token positions come from the calibration (pipeline/cost/calibrate.py): `preamble + ratio × (our
cumulative tokens)`.

Rules per provider (`Policy` holds the knobs):
- **anthropic**: breakpoints where the agent puts them; for Claude Code (the default) the end of
  the shared preamble, the end of the system prompt and the end of the last message (at most 4; a
  5th is an error). A breakpoint reads the longest cached prefix ending at it or at an earlier
  block boundary at most `lookback_blocks` (20) content blocks back; a prefix cached at the end of
  a message that has since grown by appended blocks (a tool result followed by text) is such a
  boundary. Below the model's minimum cacheable length a breakpoint is neither read nor written.
  Written tokens run from the read prefix to the last breakpoint; `tail_tokens` (the recorded
  median `input_tokens`) come after it. Entries live 5 minutes or 1 hour (the call's recorded
  split, else the policy default), refreshed on every hit, and become readable only from the
  answer's first recorded line (concurrent requests both write). With extended thinking, a user
  message without a tool result (a new turn) strips the thinking blocks of the turn before it,
  which changes the prefix from the first of them on (`strip_thinking`; a tool result with text
  appended continues the tool loop and strips nothing: five compaction requests of the corpus
  read their thread's whole prefix, thinking included). Only where the thread strips it
  (calibration `strips_thinking`: Opus 4.5+ and Sonnet 4.6+ keep earlier thinking by default,
  older models strip it, and the thread's recorded new turns decide).
- **openai** (and models of unknown provider whose recorded usage shows caching): automatic, for
  prompts of at least 1,024 tokens, in 128-token steps; every request's prefix is cached (for
  `openai_ttl_s`); writes are free (uncached input) before GPT-5.6 and priced as 5-minute writes
  from GPT-5.6 on.
- **gemini** (implicit caching): automatic from the model's minimum; no hit is guaranteed by
  Google: modelled as a hit whenever the prefix matches a live request (`gemini_ttl_s`); no write fee.
- **automatic** (another provider's documented prefix cache: MiniMax outside its Anthropic API,
  Z.ai GLM): like openai from the provider's minimum, without the 128-token steps, no write fee.
- which rules a call gets: providers.cache_provider of its model and the API and provider its
  answer recorded (`answer_api`, `answer_provider` of the facts): MiniMax on `anthropic-messages`
  gets the anthropic rules (explicit breakpoints, writes charged).
- the cache is per (scope, model): a model switch reads nothing its predecessor wrote. The scope
  is the account or workspace: `all` (every session of the run is one account, the default) or
  `session` (nothing shared between sessions).

The preamble a thread's first request read from other sessions' caches (its calibrated
`shared_tokens`) is taken as warm at that request when no simulated request keeps it warm
(`warm_shared`): it was written outside the data, by sessions of the account that are not in it;
so is it at any later request whose recorded read covers it (after an idle gap past the TTL, the
account's other sessions kept it warm).

Breaks no context policy can cause (`EXOGENOUS`: a system prompt or tools change, an eviction, a
provider's best-effort miss, ...) are replayed where the recorded usage shows them: the simulated
request reads at most what the recorded one read (`Policy.replay_exogenous`). A model switch, an
idle gap and a compaction the agent made happen at the same call under every pipeline by
themselves (the calls' models, times and compaction segments are the recorded ones).
"""

from __future__ import annotations

import bisect
import gc
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl

from ctxreplay.errors import CtxReplayError, SimError
from ctxreplay.pipeline.core.constants import (
    CACHE_EDIT_SUFFIX,
    MESSAGE_OVERHEAD_TOKENS,
    REQUEST_OVERHEAD_TOKENS,
    TTL_1H_S,
    TTL_5M_S,
    TTL_SECONDS,
)
from ctxreplay.pipeline.cost.calibrate import Calibration
from ctxreplay.pipeline.cost.providers import (  # noqa: F401  (public here too)
    OPENAI_MIN_TOKENS,
    OPENAI_STEP,
    OPENAI_WRITE_FEE,
    cache_provider,
    min_cacheable_tokens,
    provider_of,
)

NEVER = float("inf")

# recorded break causes (pipeline/cost/breaks.py) that no context policy can cause or prevent: a
# system prompt or tools change, the provider dropping the previous request's entry, a
# best-effort miss of automatic caching, the server's miss of a request it could not compare, a
# change of the messages the agent made outside the transcript, a break nothing explains. The
# simulator replays them (`Policy.replay_exogenous`); a model switch, an idle gap past the TTL and a
# compaction the agent made are exogenous too but simulated as they happened (the model, the
# timestamps and the compaction segments are the same under every pipeline).
EXOGENOUS = ("preamble", "eviction", "best_effort", "provider_miss", "messages_change", "unexplained")

@dataclass(frozen=True)
class Policy:
    """How the simulated agent and provider behave."""

    ttl: str = "recorded"
    """`recorded`: each call's 5m / 1h choice from its recorded cache-write split (else its thread's
    nearest recorded choice, else `default_ttl`); `5m` or `1h`: every write with that TTL."""
    default_ttl: str = "5m"
    breakpoints: tuple[str, ...] = ("shared", "system", "last")
    """Anthropic breakpoints: `shared` (end of the preamble shared across sessions), `system` (end
    of the thread's system prompt), `last` (end of the last message). Claude Code's placement."""
    lookback_blocks: int = 20
    max_breakpoints: int = 4
    strip_thinking: bool = True
    warm_shared: bool = True
    scope: str = "all"
    """`all`: one account / workspace for every session of the run; `session`: no sharing between
    sessions; a callable is not allowed (the policy must stay hashable and printable)."""
    openai_ttl_s: float = TTL_5M_S
    gemini_ttl_s: float = TTL_5M_S
    replay_exogenous: bool = True
    """Replay, at the call where the recorded usage shows it, each cache break no context policy
    can cause (`EXOGENOUS`): the simulated request reads at most what the recorded one read.
    False: every break is simulated (the rules alone, as before issue 20)."""

    def __post_init__(self) -> None:
        if self.ttl not in ("recorded", "5m", "1h"):
            raise SimError(f"cache policy: ttl must be 'recorded', '5m' or '1h', not {self.ttl!r}")
        if self.default_ttl not in ("5m", "1h"):
            raise SimError(f"cache policy: default_ttl must be '5m' or '1h', not {self.default_ttl!r}")
        bad = [b for b in self.breakpoints if b not in ("shared", "system", "last")]
        if bad:
            raise SimError(f"cache policy: unknown breakpoint(s) {bad}; use shared, system, last")
        if len(self.breakpoints) > self.max_breakpoints:
            raise SimError(f"cache policy: {len(self.breakpoints)} breakpoints; Anthropic accepts at most "
                           f"{self.max_breakpoints} (a 5th returns 400)")
        if self.scope not in ("all", "session"):
            raise SimError(f"cache policy: scope must be 'all' or 'session', not {self.scope!r}")
        if self.lookback_blocks < 0:
            raise SimError("cache policy: lookback_blocks must be >= 0")


# ---------------------------------------------------------------------------------------------
# the request store, as the simulator reads it


@dataclass
class _ThreadEvents:
    adds: dict[int, list[tuple[int, int]]] = field(default_factory=dict)   # call -> [(slot, message id)]
    rems: dict[int, list[int]] = field(default_factory=dict)               # call -> [slot]
    env: dict[int, int] = field(default_factory=dict)                      # call -> envelope id from it on
    pending: int = 0


class SimStore:
    """Every distinct message of a run (tokens, content blocks, thinking / real-user flags, bytes)
    and, per thread, which message enters or leaves which slot at which call."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.sha: list[str] = []
        self.tok: array[int] = array("q")
        self.blk: array[int] = array("i")
        self.thinking = bytearray()
        self.real_user = bytearray()
        self.data: list[bytes | None] = []
        self.threads: dict[str, _ThreadEvents] = {}
        self._ext: dict[tuple[int, int], bool] = {}

    def add_message(self, sha: str, tokens: int, n_blocks: int, data: bytes | None = None, *,
                    role: str | None = None, thinking: bool | None = None, real_user: bool | None = None) -> int:
        i = self.ids.get(sha)
        if i is not None:
            return i
        i = len(self.data)
        self.ids[sha] = i
        self.sha.append(sha)
        self.tok.append(int(tokens))
        self.blk.append(int(n_blocks))
        th, ru = _flags(role, data)
        self.thinking.append(bool(th if thinking is None else thinking))
        self.real_user.append(bool(ru if real_user is None else real_user))
        self.data.append(data)
        return i

    def add_span(self, thread_key: str, slot: int | None, first: int, last: int, mid: int) -> None:
        ev = self.threads.get(thread_key)
        if ev is None:
            ev = self.threads[thread_key] = _ThreadEvents()
        ev.pending = max(ev.pending, last - 1)
        if slot is None:
            ev.env[first] = mid
            return
        ev.adds.setdefault(first, []).append((slot, mid))
        ev.rems.setdefault(last, []).append(slot)

    @classmethod
    def from_tables(cls, messages: Any, call_messages: Any) -> SimStore:
        """From messages.parquet and call_messages.parquet (pyarrow tables or polars frames)."""
        msgs = messages if isinstance(messages, pl.DataFrame) else pl.from_arrow(messages)
        rows = call_messages if isinstance(call_messages, pl.DataFrame) else pl.from_arrow(call_messages)
        assert isinstance(msgs, pl.DataFrame) and isinstance(rows, pl.DataFrame)
        st = cls()
        cols = [msgs.get_column(c).to_list() for c in ("sha256", "kind", "role", "n_blocks", "tokens", "canonical_json")]
        for sha, kind, role, nb, tok, data in zip(*cols, strict=True):
            st.add_message(sha, tok, nb, data, role=role if kind == "message" else None)
        rc = [rows.get_column(c).to_list() for c in ("thread_key", "slot", "first_call", "last_call", "sha256")]
        ids = st.ids
        for key, slot, first, last, sha in zip(*rc, strict=True):
            st.add_span(key, slot, first, last, ids[sha])
        return st

    @classmethod
    def from_dir(cls, out_dir: Path) -> SimStore:
        """The store of the run OUT shows."""
        from ctxreplay.pipeline.assembly.store import CALL_MESSAGES_FILE, MESSAGES_FILE, run_dir

        run = run_dir(Path(out_dir))
        for name in (MESSAGES_FILE, CALL_MESSAGES_FILE):
            if not (run / name).is_file():
                raise SimError(f"{out_dir}: the run shown there has no {name} (made before the request store); "
                               f"run `ctxreplay run ... --out {out_dir}` again")
        return cls.from_tables(pl.read_parquet(run / MESSAGES_FILE), pl.read_parquet(run / CALL_MESSAGES_FILE))

    @classmethod
    def from_lists(cls, threads: Mapping[str, list[list[str]]], messages: Mapping[str, Mapping[str, Any]]) -> SimStore:
        """A store from plain per-call lists (tests, synthetic sequences): `threads[key][k]` is call
        k's list of message names; `messages[name]` = {"tokens", "blocks", optional "thinking",
        "real_user", "data"}. The last list of a thread is its pending call."""
        st = cls()
        for name, m in messages.items():
            st.add_message(name, m["tokens"], m.get("blocks", 1), m.get("data"), thinking=m.get("thinking", False),
                           real_user=m.get("real_user", False))
        env = st.add_message("<envelope>", 0, 0, None, thinking=False, real_user=False)
        for key, lists in threads.items():
            n = len(lists)
            st.add_span(key, None, 0, n, env)
            for slot in range(max((len(x) for x in lists), default=0)):
                k = 0
                while k < n:
                    if slot >= len(lists[k]):
                        k += 1
                        continue
                    name = lists[k][slot]
                    end = k + 1
                    while end < n and slot < len(lists[end]) and lists[end][slot] == name:
                        end += 1
                    st.add_span(key, slot, k, end, st.ids[name])
                    k = end
        return st

    def extends(self, old: int, new: int) -> bool:
        """Message `new` is message `old` with content blocks appended (Anthropic canonical JSON:
        `{"content":[...],"role":...}`), so the end of `old` is a block boundary inside `new`.
        In a store without bytes (`absorb`), the answers known when its threads were added."""
        key = (old, new)
        got = self._ext.get(key)
        if got is None:
            got = self._ext[key] = _extends(self.data[old], self.data[new])
        return got

    def absorb(self, part: SimStore, calls: pl.DataFrame) -> None:
        """Add the messages and threads of `part` (a store of whole threads, with bytes: one batch
        of a run) keeping no bytes: per message its tokens, blocks and flags, and for the pairs of
        messages the simulation can ask `extends` about in these threads, the answer. Those pairs
        are fixed by the threads' spans and the calls simulated (`calls`: thread_key, call,
        is_pending, as simulate takes them): at each simulated call, the message that left the
        first changed index and the one there now. Memory then grows with the distinct messages
        and calls of the run, not their bytes."""
        ids = [self.add_message(sha, part.tok[i], part.blk[i], None, thinking=bool(part.thinking[i]),
                                real_user=bool(part.real_user[i])) for i, sha in enumerate(part.sha)]
        todo = calls.filter(~pl.col("is_pending") & pl.col("thread_key").is_in(list(part.threads))) \
            .select("thread_key", "call").sort("thread_key", "call")
        by_key: dict[str, list[int]] = {}
        for key, k in zip(todo.get_column("thread_key").to_list(), todo.get_column("call").to_list(), strict=True):
            by_key.setdefault(key, []).append(k)
        for key, ev in part.threads.items():
            if key in self.threads:
                raise SimError(f"thread '{key}' is in two batches of the run's request store: a bug")
            self.threads[key] = _ThreadEvents({k: [(s, ids[m]) for s, m in v] for k, v in ev.adds.items()},
                                              dict(ev.rems), {k: ids[m] for k, m in ev.env.items()}, ev.pending)
            w = _Walk(key, ev)
            for k in by_key.get(key, ()):
                first, old, _ = w.advance(k)
                if old >= 0 and first < len(w.ids):
                    self._ext[(ids[old], ids[w.ids[first]])] = part.extends(old, w.ids[first])


def _flags(role: str | None, data: bytes | None) -> tuple[bool, bool]:
    """(has a thinking block, is a user message that opens a turn: content without a tool result)."""
    if not data or role is None:
        return False, False
    if role == "assistant":
        if b'"thinking"' not in data:
            return False, False
        import orjson

        c = orjson.loads(data).get("content")
        return isinstance(c, list) and any(isinstance(b, dict) and b.get("type") in ("thinking", "redacted_thinking")
                                           for b in c), False
    if role == "user":
        if b'"tool_result"' not in data:
            return False, True
        import orjson

        c = orjson.loads(data).get("content")
        if isinstance(c, str):
            return False, bool(c)
        return False, isinstance(c, list) and bool(c) and not any(
            isinstance(b, dict) and b.get("type") == "tool_result" for b in c)
    return False, False


def _extends(old: bytes | None, new: bytes | None) -> bool:
    if not old or not new or len(new) <= len(old) or not old.startswith(b'{"content":['):
        return False
    i = old.rfind(b'],"role":')
    j = new.rfind(b'],"role":')
    if i <= len(b'{"content":[') or j < 0:
        return False
    return old[i:] == new[j:] and new[:i] == old[:i] and new[i:i + 1] == b","


# ---------------------------------------------------------------------------------------------
# cache state


class CacheState:
    """The cache entries per (scope, model): node -> [expiry, readable_from] (seconds since the
    epoch). A node names a prefix: a hash chained over its parts (`child`, `_extend_chain`), the
    same for the same content whichever thread, store or run sends it, so nothing per prefix is
    kept but the entries themselves."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], dict[int, list[float]]] = {}
        self.gids: dict[str, int] = {}   # message sha256 -> the label its prefix nodes chain
        self.shas: list[str] = []
        self.names: dict[Any, int] = {}  # preamble parts -> a negative label

    def gid(self, sha: str) -> int:
        g = self.gids.get(sha)
        if g is None:
            g = self.gids[sha] = len(self.shas)
            self.shas.append(sha)
        return g

    def gid_map(self, store: SimStore, aliases: Mapping[str, str] | None = None) -> list[int]:
        """The labels of a store's messages (by content, so stores and states mix); an aliased
        message takes its alias's label (see simulate)."""
        if aliases:
            return [self.gid(aliases.get(x, x)) for x in store.sha]
        return [self.gid(x) for x in store.sha]

    def child(self, parent: int, label: Any) -> int:
        """The node of prefix `parent` followed by `label`: a message label (int >= 0) or a
        preamble part (any hashable, named by a negative int)."""
        if type(label) is not int:
            got = self.names.get(label)
            if got is None:
                got = self.names[label] = -1 - len(self.names)
            label = got
        return hash((parent, label))

    def cache(self, scope: str, model: str) -> dict[int, list[float]]:
        k = (scope, model)
        d = self.entries.get(k)
        if d is None:
            d = self.entries[k] = {}
        return d


ROOT = 0


# ---------------------------------------------------------------------------------------------
# one thread's requests, walked call by call


class _Walk:
    """A thread's current request: message ids by slot, their chain nodes, running tokens and blocks."""

    def __init__(self, key: str, ev: _ThreadEvents) -> None:
        self.key = key
        self.ev = ev
        self.k = -1                     # the last call applied
        self.slots: list[int] = []
        # int64 arrays (not lists): a long recomputation lands in them as one copy from numpy
        self.ids = array("q")
        self.nodes = array("q")
        self.cum_tok = array("q")
        self.cum_blk = array("q")
        self.valid = 0                  # nodes / cums are right for indices < valid
        self.env = -1
        self.ru: list[int] = []         # indices of real-user messages (ascending)
        self.th: list[int] = []         # indices of messages with thinking
        self.flags_valid = 0
        self.h = -1                     # strip horizon: last real-user index of the current request
        self.base = -1                  # the node before message 0 (preamble chain end)
        self.base_key: Any = None
        # the previous simulated call
        self.prev: dict[str, Any] | None = None

    def advance(self, k: int) -> tuple[int, int, bool]:
        """Apply the store's changes up to call k; returns (first index that may differ, the old
        message id there or -1, whether the envelope changed)."""
        ev = self.ev
        first = len(self.ids)
        env_changed = False
        slots, ids = self.slots, self.ids
        old_at: dict[int, int] = {}
        for j in range(self.k + 1, k + 1):
            env = ev.env.get(j)
            if env is not None and env != self.env:
                env_changed = self.env >= 0
                self.env = env
                first = 0
            for s in ev.rems.get(j, ()):
                i = bisect.bisect_left(slots, s)
                if i < len(slots) and slots[i] == s:
                    first = min(first, i)
                    old_at.setdefault(i, ids[i])
                    del slots[i]
                    del ids[i]
            for s, mid in sorted(ev.adds.get(j, ())):
                i = bisect.bisect_left(slots, s)
                first = min(first, i)
                slots.insert(i, s)
                ids.insert(i, mid)
        self.k = k
        self.valid = min(self.valid, first)
        self.flags_valid = min(self.flags_valid, first)
        return first, old_at.get(first, -1), env_changed


@dataclass
class Prepared:
    """What simulate needs besides the calls and the store: the calibration and per-call facts
    (`segment`, `recorded_strip`, `recorded_turn`, `answer_timestamp`) keyed by (session_id, thread_id, call)."""

    calibration: Calibration
    facts: pl.DataFrame

    @classmethod
    def for_calls(cls, calls: pl.DataFrame, calibration: Calibration, *, segment: str | None = None,
                  recorded_strip: str | None = None, answer_timestamp: str | None = None,
                  recorded_turn: str | None = None) -> Prepared:
        """Facts taken from columns of `calls` (each optional: segment 0, no recorded strip, the
        answer readable from the request's own time, no new user turn), with a given calibration."""
        keys = ["session_id", "thread_id", "call"]
        f = calls.select(
            *keys,
            segment=pl.col(segment).cast(pl.Int32) if segment else pl.lit(0, pl.Int32),
            recorded_strip=pl.col(recorded_strip).cast(pl.Boolean) if recorded_strip else pl.lit(False),
            recorded_turn=pl.col(recorded_turn).cast(pl.Boolean) if recorded_turn else pl.lit(False),
            answer_timestamp=pl.col(answer_timestamp) if answer_timestamp else pl.lit(None, pl.Datetime("ms", "UTC")),
        )
        return cls(calibration, f)


def prepare(loaded_blocks: pl.DataFrame, calls: pl.DataFrame, count_tokens: Any,
            final_blocks: pl.DataFrame | None = None, *, mode: str = "thread") -> Prepared:
    """Fit the calibration on the recorded session (the loaded blocks, before any stage) and
    gather the per-call facts the simulator and the break attribution use."""
    from ctxreplay.pipeline.cost import calibrate

    rec = calibrate.recorded_facts(loaded_blocks, count_tokens)
    cal = calibrate.fit(calls, rec, mode=mode)
    times = answer_times(final_blocks if final_blocks is not None else loaded_blocks)
    facts = rec.join(times, on=["session_id", "thread_id", "call"], how="left")
    return Prepared(cal, facts)


def answer_times(blocks: pl.DataFrame) -> pl.DataFrame:
    """(session_id, thread_id, call, answer_timestamp, answer_api, answer_provider): the first
    recorded line of each call's answer, from when its cache writes are readable, and the API and
    provider the agent recorded for it (OpenClaw: `api`, `provider`; null where not recorded), from
    which the simulator takes the provider's cache rules (providers.cache_provider)."""
    def col(name: str) -> pl.Expr:
        return pl.col(name).drop_nulls().first() if name in blocks.columns else pl.lit(None, pl.String)

    # a call answered by several messages takes its earliest (then the least msg_key): a group_by's
    # order is arbitrary, so "the first" of them was another message from run to run
    return (blocks.filter(pl.col("is_call"))
            .group_by("session_id", "thread_id", "msg_key")
            .agg(call=(pl.col("first_call").min() - 1).cast(pl.Int32), answer_timestamp=pl.col("timestamp").min(),
                 answer_api=col("api").cast(pl.String), answer_provider=col("provider").cast(pl.String))
            .sort("session_id", "thread_id", "call", "answer_timestamp", "msg_key", nulls_last=True)
            .unique(["session_id", "thread_id", "call"], keep="first", maintain_order=True)
            .select("session_id", "thread_id", "call", "answer_timestamp", "answer_api", "answer_provider"))


def _cache_providers(c: pl.DataFrame) -> pl.DataFrame:
    """`_cprov`: each call's cache rules (providers.cache_provider of its model and its recorded API
    and provider), and `_claude`: whether its model is Claude's (the thinking strip is: an
    Anthropic-compatible provider documents none), looked up once per distinct (model, api, provider)."""
    keys = c.select(_m=pl.col("model"), _a=pl.col("answer_api"), _p=pl.col("answer_provider")).unique()
    rules = keys.with_columns(_cprov=pl.Series([cache_provider(m, a, p) for m, a, p in keys.iter_rows()],
                                               dtype=pl.String),
                              _claude=pl.Series([provider_of(m) == "anthropic" for m, _, _ in keys.iter_rows()],
                                                dtype=pl.Boolean))
    return c.join(rules, left_on=["model", "answer_api", "answer_provider"], right_on=["_m", "_a", "_p"],
                  how="left", nulls_equal=True)


def _ttl_choice(c: pl.DataFrame, policy: Policy) -> pl.DataFrame:
    if policy.ttl != "recorded":
        return c.with_columns(_ttl=pl.lit(policy.ttl))
    w5 = pl.col("recorded_cache_write_5m_tokens").fill_null(0)
    w1 = pl.col("recorded_cache_write_1h_tokens").fill_null(0)
    rec = pl.when((w1 > 0) & (w1 >= w5)).then(pl.lit("1h")).when(w5 > 0).then(pl.lit("5m")) \
        .when(pl.col("recorded_cache_write_tokens").fill_null(0) > 0).then(pl.lit("5m")).otherwise(None)
    return c.sort("thread_key", "call").with_columns(
        _ttl=rec.forward_fill().backward_fill().over("thread_key").fill_null(policy.default_ttl))


@dataclass
class SimResult:
    calls: pl.DataFrame
    """The input calls plus the columns of schemas/calls.py's cache-simulation group."""
    summary: dict[str, Any]


SIM_COLUMNS = {
    "preamble_tokens": pl.Int64, "calibrated_prompt_tokens": pl.Int64,
    "sim_cache_read_tokens": pl.Int64, "sim_cache_write_5m_tokens": pl.Int64, "sim_cache_write_1h_tokens": pl.Int64,
    "sim_input_tokens": pl.Int64, "sim_cost_usd": pl.Float64, "recorded_cost_usd": pl.Float64,
    "sim_break_cause": pl.String, "sim_break_detail": pl.String, "sim_break_tokens": pl.Int64,
    "sim_break_cost_usd": pl.Float64, "recorded_break_cause": pl.String,
    "recorded_break_inferred_cause": pl.String, "recorded_break_detail": pl.String,
    "recorded_break_tokens": pl.Int64, "recorded_break_cost_usd": pl.Float64,
    "sim_summary_cache_read_tokens": pl.Int64, "sim_summary_cache_write_tokens": pl.Int64,
    "sim_summary_input_tokens": pl.Int64, "sim_summary_output_tokens": pl.Int64, "sim_summary_cost_usd": pl.Float64,
}


def simulate(calls: pl.DataFrame, store: SimStore, prep: Prepared, *, decisions: pl.DataFrame | None = None,
             prices: Any = None, policy: Policy | None = None, state: CacheState | None = None,
             aliases: Mapping[str, str] | None = None) -> SimResult:
    """Simulate the cache over `calls` (calls.parquet's columns; pending calls are left out) and
    attribute every cache break, recorded and simulated. Returns the calls, in their order, with
    SIM_COLUMNS added (costs null without `prices`, a ctxreplay.pipeline.cost.prices.PriceBook) and a summary.
    Nothing but `state` (when given) is changed: the same inputs give the same result.

    `aliases` maps a message's sha256 to the sha256 whose place in the cache it keeps: a cache
    edit (Anthropic's context editing, Claude Code's cached microcompact) changes a message on the
    provider's side without breaking the cached prefix, and the cleared tokens leave it."""
    from ctxreplay.pipeline.cost import breaks as brk
    from ctxreplay.pipeline.cost import calibrate

    policy = policy or Policy()
    state = state or CacheState()
    calls = calls.drop([x for x in SIM_COLUMNS if x in calls.columns])
    cal = prep.calibration
    c = calibrate.apply(calls.with_row_index("_row"), cal, prep.facts)
    facts = prep.facts if "recorded_turn" in prep.facts.columns else prep.facts.with_columns(recorded_turn=pl.lit(False))
    for x in ("answer_api", "answer_provider"):   # facts of an older run, or given by for_calls
        if x not in facts.columns:
            facts = facts.with_columns(pl.lit(None, pl.String).alias(x))
    c = c.join(facts.select("session_id", "thread_id", "call", "segment", "recorded_strip", "recorded_turn",
                            "answer_timestamp", "answer_api", "answer_provider"),
               on=["session_id", "thread_id", "call"], how="left")
    c = _cache_providers(c)
    c = c.join(cal.threads.select("thread_key", "ratio", "shared_tokens", "system_tokens", "tail_tokens",
                                  "uses_cache", "owner_key", "strips_thinking"), on="thread_key", how="left")
    c = _ttl_choice(c, policy)
    c = c.with_columns(
        _t=pl.col("timestamp").dt.epoch("ms").cast(pl.Float64) / 1000.0,
        _ta=pl.col("answer_timestamp").dt.epoch("ms").cast(pl.Float64) / 1000.0,
    ).with_columns(_t=pl.col("_t").forward_fill().backward_fill().over("thread_key").fill_null(0.0))
    c = c.with_columns(_t=pl.col("_t").cum_max().over("thread_key", order_by="call"))
    c = brk.recorded_breaks(c)         # before the walk: the exogenous breaks it replays
    c = c.with_columns(**_exogenous(policy))
    todo = c.filter(~pl.col("is_pending")).sort("_t", "session_id", "thread_id", "call")
    decisions_by = _decisions_by_thread(decisions)
    walks: dict[str, _Walk] = {}
    out: dict[tuple[str, int], tuple[Any, ...]] = {}
    cols = _Columns(store, state.gid_map(store, aliases))
    fields = ["thread_key", "session_id", "call", "model", "_t", "_ta", "_ttl", "preamble_tokens", "ratio",
            "shared_tokens", "system_tokens", "tail_tokens", "uses_cache", "owner_key", "segment", "strips_thinking",
            "_exo", "_exo_read", "_exo_frac", "_cprov", "_claude"]
    was = gc.isenabled()
    gc.disable()      # the walk allocates many small long-lived objects: no cyclic GC rescans
    try:
        for row in zip(*(todo.get_column(x).to_list() for x in fields), strict=True):
            key = row[0]
            w = walks.get(key)
            if w is None:
                ev = store.threads.get(key)
                if ev is None:
                    raise SimError(f"thread '{key}' is in the calls but not in the request store; the run's "
                                   f"outputs do not belong together: run again")
                w = walks[key] = _Walk(key, ev)
                parent = walks.get(row[13]) if "--agent-acompact" in key else None
                if (parent is not None and parent.prev is not None and parent.prev["call"] < row[2]
                        and parent.prev["model"] == (row[3] or "")):
                    # a compaction agent's first request is its main thread's history plus the
                    # summarising prompt, sent after the main thread's last request (of its model):
                    # it is compared with what that request cached
                    w.prev = dict(parent.prev)
            out[(key, row[2])] = _simulate_call(w, row, store, cols, state, policy, decisions_by.get(key))
    finally:
        if was:
            gc.enable()
    sim = pl.DataFrame(
        [(k, c_, *v) for (k, c_), v in out.items()],
        schema={"thread_key": pl.String, "call": pl.Int32, "sim_cache_read_tokens": pl.Int64,
                "sim_cache_write_5m_tokens": pl.Int64, "sim_cache_write_1h_tokens": pl.Int64,
                "sim_input_tokens": pl.Int64, "sim_prompt": pl.Int64, "sim_break_cause": pl.String,
                "sim_break_detail": pl.String, "sim_break_tokens": pl.Int64}, orient="row")
    c = c.join(sim, on=["thread_key", "call"], how="left")
    c = _price(c, prices)
    c = _summary_requests(c, decisions, prices)
    result = c.sort("_row").select(*calls.columns, *SIM_COLUMNS)   # the input's row order
    summary = brk.summary(result, cal, policy, prices)
    return SimResult(result, summary)


def _exogenous(policy: Policy) -> dict[str, pl.Expr]:
    """Per call, the exogenous break to replay (`_exo`: its recorded cause, null for none) and what
    the recorded request read: tokens (`_exo_read`) and the share of its prompt (`_exo_frac`)."""
    from ctxreplay.pipeline.cost.calibrate import recorded_write

    read = pl.col("recorded_cache_read_tokens").fill_null(0)
    prompt = read + recorded_write().fill_null(0) + pl.col("recorded_input_tokens").fill_null(0)
    on = pl.col("recorded_break_cause").is_in(list(EXOGENOUS)) if policy.replay_exogenous else pl.lit(False)
    return {"_exo": pl.when(on).then(pl.col("recorded_break_cause")),
            "_exo_read": read.cast(pl.Float64),
            "_exo_frac": pl.when(prompt > 0).then(read.cast(pl.Float64) / prompt).otherwise(0.0)}


def summary_requests(decisions: pl.DataFrame | None) -> pl.DataFrame:
    """(thread_key, call, request tokens, summary tokens) of each simulated auto-compaction (the
    `insert` decisions of stage auto_compact: their text holds the request's size and the summary's)."""
    schema = {"thread_key": pl.String, "call": pl.Int32, "_sum_request": pl.Int64, "_sum_out": pl.Int64}
    if decisions is None or decisions.height == 0 or not {"stage", "replacement"} <= set(decisions.columns):
        return pl.DataFrame(schema=schema)
    from ctxreplay.pipeline.assembly.replay import thread_key_expr
    from ctxreplay.pipeline.core.constants import AUTO_COMPACT_RE

    d = decisions.filter((pl.col("stage") == "auto_compact") & (pl.col("action") == "insert")
                         & pl.col("replacement").is_not_null())
    if d.height == 0:
        return pl.DataFrame(schema=schema)
    text = pl.col("replacement").str.json_decode(pl.Struct({"text": pl.String})).struct.field("text")

    def num(i: int) -> pl.Expr:
        return text.str.extract(AUTO_COMPACT_RE, i).str.replace_all(",", "").cast(pl.Int64)

    return d.select(thread_key=thread_key_expr().cast(pl.String), call=pl.col("from_call").cast(pl.Int32),
                    _sum_request=num(3), _sum_out=num(2)).drop_nulls().unique(["thread_key", "call"]).cast(schema)


def _summary_requests(c: pl.DataFrame, decisions: pl.DataFrame | None, prices: Any) -> pl.DataFrame:
    """The summarisation request of each simulated auto-compaction, sent just before its call: it
    reads the history (the request as it stood before compacting, calibrated like the call), from
    the cache where the thread's previous request left it alive (same model, within its TTL),
    writes the rest with the call's TTL (uncached input where writes are free), and answers
    `summary_tokens`; priced like any call."""
    req = summary_requests(decisions)
    cols = [x for x in SIM_COLUMNS if x.startswith("sim_summary_")]
    if req.height == 0:
        return c.with_columns(*(pl.lit(None, SIM_COLUMNS[x]).alias(x) for x in cols))
    done = ~pl.col("is_pending") & pl.col("sim_cache_read_tokens").is_not_null()
    # what the previous request left cached: Anthropic, its read and writes (up to its last
    # breakpoint); automatic caching (OpenAI, Gemini), its whole prompt
    cached = pl.when(pl.col("_cprov") == "anthropic").then(
        pl.col("sim_cache_read_tokens") + pl.col("sim_cache_write_5m_tokens") + pl.col("sim_cache_write_1h_tokens")) \
        .otherwise(pl.col("calibrated_prompt_tokens"))
    prev = c.filter(done).sort("thread_key", "call").select(
        "thread_key", "call",
        _p_cached=cached.shift(1).over("thread_key"),
        _p_t=pl.col("_t").shift(1).over("thread_key"), _p_ttl=pl.col("_ttl").shift(1).over("thread_key"),
        _p_model=pl.col("model").shift(1).over("thread_key"))
    x = c.join(req, on=["thread_key", "call"], how="left").join(prev, on=["thread_key", "call"], how="left")
    provider = pl.col("_cprov").fill_null("")
    hist = (pl.col("preamble_tokens").fill_null(0) + pl.col("ratio").fill_null(1.0) * pl.col("_sum_request")).round(0) \
        .cast(pl.Int64)
    ttl_s = pl.when(pl.col("_p_ttl") == "1h").then(pl.lit(TTL_1H_S)).otherwise(pl.lit(TTL_5M_S))
    alive = (pl.col("_p_model") == pl.col("model")) & ((pl.col("_t") - pl.col("_p_t")) < ttl_s) \
        & pl.col("uses_cache").fill_null(False)
    read = pl.when(alive.fill_null(False)).then(pl.min_horizontal(pl.col("_p_cached"), hist)).otherwise(0)
    x = x.with_columns(_prov=provider, _hist=hist).with_columns(
        sim_summary_cache_read_tokens=pl.when(pl.col("_sum_request").is_not_null()).then(read.cast(pl.Int64)))
    write = pl.when((pl.col("_prov") == "anthropic") & pl.col("uses_cache").fill_null(False)) \
        .then(pl.col("_hist") - pl.col("sim_summary_cache_read_tokens")).otherwise(0)
    x = x.with_columns(sim_summary_cache_write_tokens=pl.when(pl.col("_sum_request").is_not_null())
                       .then(write.clip(0).cast(pl.Int64))).with_columns(
        sim_summary_input_tokens=(pl.col("_hist") - pl.col("sim_summary_cache_read_tokens")
                                  - pl.col("sim_summary_cache_write_tokens")).clip(0),
        sim_summary_output_tokens=pl.col("_sum_out"))
    if prices is None:
        x = x.with_columns(sim_summary_cost_usd=pl.lit(None, pl.Float64))
    else:
        z = pl.lit(0, pl.Int64)
        is1h = pl.col("_ttl") == "1h"
        x = x.with_columns(
            _si=pl.col("sim_summary_input_tokens").fill_null(0), _so=pl.col("sim_summary_output_tokens").fill_null(0),
            _s5=pl.when(is1h).then(z).otherwise(pl.col("sim_summary_cache_write_tokens")).fill_null(0),
            _s1=pl.when(is1h).then(pl.col("sim_summary_cache_write_tokens")).otherwise(z).fill_null(0),
            _sr=pl.col("sim_summary_cache_read_tokens").fill_null(0),
            _pmodel=pl.col("model").fill_null("unknown"),
            _pts=pl.col("timestamp").forward_fill().backward_fill().over("thread_key").fill_null(
                pl.lit(datetime(1970, 1, 1, tzinfo=UTC)).cast(c.schema["timestamp"])))
        x = prices.price_frame(x, model="_pmodel", timestamp="_pts", input="_si", output="_so", cache_write_5m="_s5",
                               cache_write_1h="_s1", cache_read="_sr", out="sim_summary_cost_usd")
        x = x.with_columns(sim_summary_cost_usd=pl.when(pl.col("_sum_request").is_not_null())
                           .then(pl.col("sim_summary_cost_usd")))
    return x.drop([k for k in x.columns if k.startswith("_") and k not in c.columns])


def _decisions_by_thread(decisions: pl.DataFrame | None) -> dict[str, list[tuple[int, str]]]:
    if decisions is None or decisions.height == 0:
        return {}
    from ctxreplay.pipeline.assembly.replay import thread_key_expr

    d = decisions.filter(~pl.col("action").is_in(["violation", "conflict"]))
    if "stage" not in d.columns:
        d = d.with_columns(stage=pl.lit("?"))
    d = d.select(thread_key=thread_key_expr(), call="from_call",
                 detail=pl.format("{}/{}:{}@{}", "stage", "action", "reason", "cache_epoch")).unique()
    out: dict[str, list[tuple[int, str]]] = {}
    for key, call, detail in zip(*(d.get_column(x).to_list() for x in ("thread_key", "call", "detail")), strict=True):
        out.setdefault(key, []).append((call, detail))
    for v in out.values():
        v.sort()
    return out


def _layer_detail(decs: list[tuple[int, str]] | None, lo: int, hi: int) -> str | None:
    """The decisions that apply from a call in (lo, hi]."""
    if not decs:
        return None
    i = bisect.bisect_right(decs, (lo, "\uffff"))
    j = bisect.bisect_right(decs, (hi, "\uffff"), i)
    got = sorted({d for _, d in decs[i:j]})
    if not got:
        return None
    return ", ".join(got[:3]) + (f" (+{len(got) - 3} more)" if len(got) > 3 else "")


# ---------------------------------------------------------------------------------------------
# the message chain: node i names the prefix ending with message i
#
# Node i is a polynomial hash of the labels of messages 0..i over the thread's base node, modulo
# two 31-bit primes (packed in one int < 2**62): node_i = node_{i-1} * B + label_i, so the chain
# from index v on is a cumulative sum that numpy computes at once. A deep prefix break (a layer
# changing a message far back at every call) recomputes thousands of nodes per call; as a Python
# loop of tuple hashes that was most of a context-editing run's simulation. Short extensions (an
# appended call: a few messages) stay in Python, with the same arithmetic.

_P1, _P2 = 2_147_483_647, 2_147_483_629     # primes < 2**31: products fit in int64
_B1, _B2 = 1_000_003, 786_433               # bases
_LOW = (1 << 31) - 1
_VECTOR_FROM = 48                           # extensions of at least this many messages go to numpy
_POWERS: list[Any] = []                     # [B1**k, B1**-k, B2**k, B2**-k] for k < len, as int64 arrays


def _powers(n: int) -> list[Any]:
    """The power tables for chains of up to n - 1 messages (grown by doubling, kept)."""
    import numpy as np

    if _POWERS and len(_POWERS[0]) >= n:
        return _POWERS
    size = max(n, 2 * len(_POWERS[0]) if _POWERS else 4096)
    tables = []
    for p, b in ((_P1, _B1), (_P2, _B2)):
        for base in (b, pow(b, -1, p)):
            t = [1] * size
            for k in range(1, size):
                t[k] = t[k - 1] * base % p
            tables.append(np.array(t, dtype=np.int64))
    _POWERS[:] = tables
    return _POWERS


class _Columns:
    """A store's per-message columns as numpy arrays, with the run's labels (`CacheState.gid_map`)."""

    def __init__(self, store: SimStore, g: list[int]) -> None:
        import numpy as np

        self.np = np
        self.store = store
        self.g = g
        self.label = np.array(g, dtype=np.int64) * 2 + 1          # +1: no label is 0 (with thinking: +2)
        self.tok = np.array(store.tok, dtype=np.int64) + MESSAGE_OVERHEAD_TOKENS
        self.blk = np.array(store.blk, dtype=np.int64)
        self.thinking = np.frombuffer(bytes(store.thinking), dtype=np.uint8).astype(bool)
        self.real_user = np.frombuffer(bytes(store.real_user), dtype=np.uint8).astype(bool)

    def take(self, ids: array[int], lo: int, hi: int) -> Any:
        """ids[lo:hi] as an int64 array (a copy: `ids` stays resizable)."""
        return self.np.frombuffer(ids[lo:hi], dtype=self.np.int64)


def _extend_chain(w: _Walk, v: int, n: int, horizon: int, cols: _Columns) -> None:
    """Append nodes, cumulative tokens and blocks for messages v..n-1 of the walk (those before v
    are kept); a message before `horizon` has its thinking stripped (its label + 1)."""
    nodes, cum_tok, cum_blk, ids = w.nodes, w.cum_tok, w.cum_blk, w.ids
    w.valid = n
    if v >= n:
        return
    parent = nodes[v - 1] if v else w.base
    h1, h2 = (parent >> 31) % _P1, (parent & _LOW) % _P2
    ct = cum_tok[v - 1] if v else 0
    cb = cum_blk[v - 1] if v else 0
    if n - v < _VECTOR_FROM:
        g, tok, blk, thinking = cols.g, cols.store.tok, cols.store.blk, cols.store.thinking
        for i in range(v, n):
            mid = ids[i]
            x = g[mid] * 2 + 1 + (1 if (i < horizon and thinking[mid]) else 0)
            h1 = (h1 * _B1 + x) % _P1
            h2 = (h2 * _B2 + x) % _P2
            nodes.append(h1 << 31 | h2)
            ct += tok[mid] + MESSAGE_OVERHEAD_TOKENS
            cb += blk[mid]
            cum_tok.append(ct)
            cum_blk.append(cb)
        return
    np = cols.np
    m = cols.take(ids, v, n)
    x = cols.label[m]
    if horizon > v:
        k = min(horizon, n) - v
        x[:k] += cols.thinking[m[:k]]
    size = n - v
    pw1, iv1, pw2, iv2 = _powers(size + 1)
    # node_i = B**(i-v+1) * (node_{v-1} + sum_{j=v..i} x_j * B**-(j-v+1))   (mod p)
    a1 = pw1[1:size + 1] * ((np.cumsum(x * iv1[1:size + 1] % _P1) + h1) % _P1) % _P1
    a2 = pw2[1:size + 1] * ((np.cumsum(x * iv2[1:size + 1] % _P2) + h2) % _P2) % _P2
    nodes.frombytes(((a1 << 31) | a2).tobytes())
    cum_tok.frombytes((np.cumsum(cols.tok[m]) + ct).tobytes())
    cum_blk.frombytes((np.cumsum(cols.blk[m]) + cb).tobytes())


def _simulate_call(w: _Walk, row: tuple[Any, ...], store: SimStore, cols: _Columns, state: CacheState,
                   policy: Policy, decs: list[tuple[int, str]] | None) -> tuple[Any, ...]:
    (_key, session, k, model, t, ta, ttl_name, pre, ratio, shared, system, tail, uses_cache, owner, segment,
     strips, exo, exo_read, exo_frac, provider, claude) = row
    model = model or ""
    first_changed, old_id, env_changed = w.advance(k)
    if provider is None and uses_cache:
        provider = "openai"
    if not uses_cache:
        provider = None
    anthropic = provider == "anthropic"
    shared = float(shared or 0) if provider is not None else 0.0
    ids = w.ids
    n = len(ids)

    # the thinking strip is Claude's (an Anthropic-compatible provider documents none)
    strip = anthropic and policy.strip_thinking and strips is not False and bool(claude)
    h, strip_first = _strip_horizon(w, store, cols, strip)
    change = first_changed if first_changed < len(w.nodes) or env_changed else None
    if strip_first is not None and (change is None or strip_first < change):
        change = strip_first
    if change is not None:
        w.valid = min(w.valid, change)

    # the preamble chain: shared -> system (owner, envelope) -> hidden content of this segment
    node_a = state.child(ROOT, ("shared", int(shared))) if shared > 0 else ROOT
    node_b = state.child(node_a, ("system", owner, cols.g[w.env] if w.env >= 0 else -1))
    base_key = (node_b, ids[0] if n else -1, segment)
    base_changed = base_key != w.base_key
    if base_changed:
        w.base_key = base_key
        w.base = state.child(node_b, ("hidden", cols.g[ids[0]] if n else -1))
        w.valid = 0
    # message chain from the first invalid index (the old node where the first change is: the end of
    # an earlier version of that message, still a block boundary if the new one only appends blocks)
    nodes = w.nodes
    v = w.valid
    ext = (first_changed, nodes[first_changed], old_id) if (
        old_id >= 0 and not base_changed and v >= first_changed and first_changed < min(len(nodes), n)) else None
    del nodes[v:], w.cum_tok[v:], w.cum_blk[v:]
    _extend_chain(w, v, n, h if strip else -1, cols)

    c = _Call(w, t, ta if (ta is not None and ta >= t) else t, float(pre or 0), float(ratio or 1.0),
              REQUEST_OVERHEAD_TOKENS + (store.tok[w.env] if w.env >= 0 else 0),
              state.cache("all" if policy.scope == "all" else session, model), min_cacheable_tokens(model, provider),
              TTL_SECONDS[ttl_name] if anthropic else (
                  policy.gemini_ttl_s if provider == "gemini" else policy.openai_ttl_s), float(exo_read or 0))
    prompt = c.pos(n - 1)
    tail = float(tail or 0) if anthropic else 0.0
    prev = w.prev
    parts = (node_a, shared), (node_b, max(float(system or 0), shared))   # preamble nodes and their ends
    if provider is None:
        read, write_end = 0.0, 0.0
    elif anthropic:
        read, write_end = _read_anthropic(c, policy, store, ext, *parts, prompt - tail, tail)
    else:
        read, write_end = _read_automatic(c, provider, model, *parts, prompt,
                                          min(first_changed, change if change is not None else n))

    replayed = None
    if exo is not None and provider is not None:
        # an exogenous break (EXOGENOUS): read at most what the recorded request read; a preamble
        # change keeps the preamble's recorded tokens, any other the recorded share of the prompt
        cap = exo_read if exo == "preamble" else prompt * exo_frac
        if provider == "openai":
            cap = float(int(cap) // OPENAI_STEP * OPENAI_STEP)
        if read > cap:
            read, replayed = cap, exo
    read_i = round(read)
    prompt_i = round(prompt)
    write_i = max(round(write_end) - read_i, 0)
    if provider == "openai":
        cached_end = int(write_end) // OPENAI_STEP * OPENAI_STEP if write_end >= c.mn else 0
    else:
        cached_end = round(write_end)        # what a later request may read of this one
    if provider == "openai" and not OPENAI_WRITE_FEE.search(model.lower()):
        write_i = 0            # writes are free before GPT-5.6: the uncached prefix is plain input
    if provider in ("gemini", "automatic"):
        write_i = 0            # implicit / automatic caching: nothing is charged for a write
    input_i = max(prompt_i - read_i - write_i, 0)
    w5 = write_i if (ttl_name == "5m" or not anthropic) else 0
    w1 = write_i - w5

    # a simulated break: this request read less than the previous one had cached
    cause = detail = None
    btok = None
    if prev is not None and provider is not None and cached_end > 0:
        expected = prev["cached"]
        if 0 < prev["n"] <= n and nodes[prev["n"] - 1] == prev["end"]:
            # the previous request's prefix, where it stands in this request (a cache edit shrinks it)
            p_here = c.pos(prev["n"] - 1) - tail
            expected = round(p_here) if provider != "openai" else int(p_here) // OPENAI_STEP * OPENAI_STEP
        if read_i < expected:
            btok = max(min(expected, cached_end) - read_i, 0)   # cached again, at most what this one caches
            cause, detail = _sim_cause(w, prev, model, t, n, change, strip_first, segment, decs, k, c.cache,
                                       policy, store, old_id, first_changed, env_changed)
            if replayed is not None:
                also = [x for x in (cause,) if x != "unexplained" and x != replayed]
                cause, detail = replayed, "; ".join(
                    [f"replayed: the recorded request read {round(exo_read):,} tokens"]
                    + ([f"also {', '.join(also)}"] if also else []))
    if cached_end == 0 and provider is not None and prev is not None:
        return read_i, w5, w1, input_i, prompt_i, cause, detail, btok   # uncached: the prefix to compare stays
    w.prev = {"model": model, "cached": cached_end, "end": nodes[n - 1] if n else w.base, "n": n, "t": t,
              "ttl": ttl_name, "call": k, "segment": segment, "cache": c.cache}
    return read_i, w5, w1, input_i, prompt_i, cause, detail, btok


def _strip_horizon(w: _Walk, store: SimStore, cols: _Columns, strip: bool) -> tuple[int, int | None]:
    """Anthropic extended thinking: thinking before the request's last real-user message is stripped.
    Returns (that message's index or -1, the first message whose stripping changed since the
    previous call or None); keeps the walk's real-user / thinking indices current."""
    ids = w.ids
    n = len(ids)
    if w.flags_valid < n or len(w.ru) and w.ru[-1] >= n or len(w.th) and w.th[-1] >= n:
        fv = min(w.flags_valid, n)
        del w.ru[bisect.bisect_left(w.ru, fv):]
        del w.th[bisect.bisect_left(w.th, fv):]
        if n - fv < _VECTOR_FROM:
            ru_flag, th_flag = store.real_user, store.thinking
            w.ru.extend(i for i in range(fv, n) if ru_flag[ids[i]])
            w.th.extend(i for i in range(fv, n) if th_flag[ids[i]])
        else:
            m = cols.take(ids, fv, n)
            w.ru.extend((cols.np.flatnonzero(cols.real_user[m]) + fv).tolist())
            w.th.extend((cols.np.flatnonzero(cols.thinking[m]) + fv).tolist())
        w.flags_valid = n
    h = w.ru[-1] if (strip and w.ru) else -1
    strip_first = None
    if strip and h != w.h:
        lo, hi = min(h, w.h), max(h, w.h)
        j = bisect.bisect_left(w.th, max(lo, 0))
        if j < len(w.th) and w.th[j] < hi:
            strip_first = w.th[j]
    w.h = h
    return h, strip_first


@dataclass
class _Call:
    """One simulated request: its walk, time, the time its answer starts (its writes become readable),
    calibration, the (scope, model) cache it reads and writes, the model's minimum and its TTL."""

    w: _Walk
    t: float
    avail: float
    pre: float
    ratio: float
    base_x: int                  # request overhead + envelope tokens
    cache: dict[int, list[float]]
    mn: int
    ttl_s: float
    rec_read: float = 0.0        # what the recorded request read (0: not recorded)

    def pos(self, i: int) -> float:
        """The calibrated token position of the end of message i (-1: the preamble's end)."""
        return self.pre + self.ratio * (self.base_x + (self.w.cum_tok[i] if i >= 0 else 0))

    def alive(self, node: int) -> bool:
        e = self.cache.get(node)
        return e is not None and e[1] <= self.t < e[0]


def _read_anthropic(c: _Call, policy: Policy, store: SimStore, ext: tuple[int, int, int] | None,
                    shared: tuple[int, float], system: tuple[int, float], last_pos: float,
                    tail: float) -> tuple[float, float]:
    """Explicit breakpoints (shared preamble, system prompt, last message): the longest live prefix
    read at one of them (the last one also looks back `lookback_blocks`), every breakpoint written.
    Returns (tokens read, end of the last breakpoint)."""
    w, cache, t, mn = c.w, c.cache, c.t, c.mn
    nodes, n = w.nodes, len(w.ids)
    read, hit_node = 0.0, None
    bps: list[tuple[int, float]] = []           # (node, position) of the cacheable breakpoints
    node_a, p_a = shared
    if "shared" in policy.breakpoints and p_a >= mn and p_a > 0:
        if policy.warm_shared and (w.prev is None or c.rec_read >= p_a) and not c.alive(node_a):
            # warm from sessions outside the data: at the thread's first request, and wherever the
            # recorded request read at least the shared preamble (after an idle gap, say)
            cache[node_a] = [t + c.ttl_s, -NEVER]
        bps.append(shared)
    if "system" in policy.breakpoints and system[1] >= mn and system[1] > p_a:
        bps.append(system)
    if "last" in policy.breakpoints and n and last_pos >= mn:
        bps.append((nodes[n - 1], last_pos))
    for node, p in bps:
        if p > read and c.alive(node):
            read, hit_node = p, node
    if n and bps and bps[-1][0] == nodes[n - 1]:
        # the last breakpoint also reads the longest live prefix ending within lookback_blocks before it
        got = _lookback(w, cache, t, n, policy.lookback_blocks, store, ext, c.pos, tail)
        if got is not None and got[1] > read:
            hit_node, read = got
    for node, _ in bps:
        _put(cache, node, t, c.avail, c.ttl_s)
    if hit_node is not None:
        e = cache[hit_node]
        e[0] = max(e[0], t + c.ttl_s)
    return read, max((p for _, p in bps), default=0.0)


def _read_automatic(c: _Call, provider: str, model: str, shared: tuple[int, float], system: tuple[int, float],
                    prompt: float, start: int) -> tuple[float, float]:
    """Automatic prefix caching (OpenAI, Gemini): every live request's whole prefix is readable; the
    deepest live node from `start` (the first message that changed) back, or the previous request's
    end where this one still holds its first `start` messages. Returns (tokens read, end written)."""
    w, cache, t, mn = c.w, c.cache, c.t, c.mn
    nodes, n, prev = w.nodes, len(w.ids), w.prev
    read, hit_node = 0.0, None
    cands = [shared, system, (w.base, c.pre)] if n else [shared, system]
    for node, p in cands:
        if p > read and c.alive(node):
            read, hit_node = p, node
    if prev is not None and prev["model"] == model and n:
        m = min(start, prev["n"], n)
        pe = cache.get(prev["end"])
        if m > 0 and pe is not None and pe[1] <= t < pe[0] and c.pos(m - 1) > read:
            read, hit_node = c.pos(m - 1), prev["end"]
    for i in range(n - 1, max(start, 0) - 1, -1):
        if c.pos(i) <= read:
            break
        if c.alive(nodes[i]):
            read, hit_node = c.pos(i), nodes[i]
            break
    if provider == "openai":
        read = float(int(read) // OPENAI_STEP * OPENAI_STEP)
    if prompt < mn or read < mn:
        read = 0.0
    write_end = prompt if prompt >= mn else 0.0
    if write_end:
        for node in ([shared[0]] if shared[1] else []) + [system[0]] + ([w.base, nodes[n - 1]] if n else []):
            _put(cache, node, t, c.avail, c.ttl_s)
    if hit_node is not None and hit_node in cache:
        cache[hit_node][0] = max(cache[hit_node][0], t + c.ttl_s)
    return read, write_end


def _put(cache: dict[int, list[float]], node: int, t: float, avail: float, ttl_s: float) -> None:
    """Write (or refresh) the entry at `node` at time t: readable from `avail` (the answer's start)
    unless it already is; a pending write by a concurrent request stays readable from the earlier
    of the two answers."""
    e = cache.get(node)
    if e is None or e[0] <= t:
        cache[node] = [avail + ttl_s, avail]
        return
    if e[1] > t:
        e[1] = min(e[1], avail)
    e[0] = max(e[0], t + ttl_s, e[1] + ttl_s)


def _lookback(w: _Walk, cache: dict[int, list[float]], t: float, n: int, limit: int, store: SimStore,
              ext: tuple[int, int, int] | None, pos: Any, tail: float) -> tuple[int, float] | None:
    """The deepest live prefix ending at a block boundary at most `limit` blocks before the end of
    message n-1: a message end, the end of the earlier, shorter version of the first changed
    message (`ext`: blocks appended since), or the preamble."""
    nodes, cum_blk, ids = w.nodes, w.cum_blk, w.ids
    end_blk = cum_blk[n - 1]
    i = n - 1
    while i >= 0:
        if end_blk - cum_blk[i] > limit:
            return None
        e = cache.get(nodes[i])
        if e is not None and e[1] <= t < e[0]:
            return nodes[i], pos(i) - tail
        if ext is not None and ext[0] == i:
            _, node, old = ext
            before = cum_blk[i - 1] if i else 0
            e = cache.get(node)
            if (e is not None and e[1] <= t < e[0] and end_blk - (before + store.blk[old]) <= limit
                    and store.extends(old, ids[i])):
                p = pos(i - 1) + (pos(i) - pos(i - 1)) * (store.tok[old] + MESSAGE_OVERHEAD_TOKENS) / max(
                    store.tok[ids[i]] + MESSAGE_OVERHEAD_TOKENS, 1)
                return node, p - tail
        i -= 1
    if end_blk <= limit:
        e = cache.get(w.base)
        if e is not None and e[1] <= t < e[0]:
            return w.base, pos(-1)
    return None


def _sim_cause(w: _Walk, prev: dict[str, Any], model: str, t: float, n: int, change: int | None,
               strip_first: int | None, segment: int, decs: list[tuple[int, str]] | None, k: int,
               cache: dict[int, list[float]], policy: Policy, store: SimStore, old_id: int, first_changed: int,
               env_changed: bool) -> tuple[str, str | None]:
    """Why the simulated request read less than its predecessor had cached: every cause that
    holds, in the order of pipeline/cost/breaks.py; the first is the cause, the others go in the detail."""
    found: list[tuple[str, str | None]] = []
    if prev["model"] != model:
        found.append(("model_switch", f"{prev['model']} -> {model}"))
    end = prev["end"]
    e = prev["cache"].get(end)    # the previous request's entry, in its model's cache
    gap = t - prev["t"]
    if e is None or e[0] <= t:
        found.append(("ttl_expiry", f"idle {gap:.0f} s > TTL {prev['ttl']}"))
    pn = prev["n"]
    on_chain = 0 < pn <= n and w.nodes[pn - 1] == end
    if not on_chain and 0 < pn <= n and first_changed == pn - 1 and old_id >= 0:
        on_chain = store.extends(old_id, w.ids[pn - 1])
    if not on_chain:
        if segment != prev["segment"]:
            found.append(("compaction", None))
        layer = _layer_detail(decs, prev["call"], k)
        if layer is not None:
            found.append(("layer", layer))
        if strip_first is not None and (change is None or strip_first <= change):
            found.append(("thinking_strip", f"from message {strip_first}"))
        if env_changed:
            found.append(("preamble", "the system prompt changed"))
        if len(found) == 0:
            found.append(("unexplained", f"the request differs from message {change} on"
                          if change is not None else None))
    elif e is not None and e[1] > t:
        found.append(("concurrent", "the previous request's write was not readable yet"))
    elif pn:
        blocks = w.cum_blk[n - 1] - w.cum_blk[pn - 1]
        if blocks > policy.lookback_blocks:
            found.append(("lookback", f"{blocks} blocks after the cached prefix > {policy.lookback_blocks}"))
    if not found:
        found.append(("unexplained", None))
    cause, detail = found[0]
    also = [c for c, _ in found[1:]]
    if also:
        detail = "; ".join(x for x in (detail, "also " + ", ".join(also)) if x)
    return cause, detail


def _price(c: pl.DataFrame, prices: Any) -> pl.DataFrame:
    """sim_cost_usd, recorded_cost_usd and the break costs (null without a price book or a price)."""
    if prices is None:
        return c.with_columns(*(pl.lit(None, pl.Float64).alias(x) for x in
                                ("sim_cost_usd", "recorded_cost_usd", "sim_break_cost_usd", "recorded_break_cost_usd")))
    out = pl.col("recorded_output_tokens").fill_null(0)
    z = pl.lit(0, pl.Int64)
    frame = c.with_columns(
        _o=out,
        _si=pl.col("sim_input_tokens"), _s5=pl.col("sim_cache_write_5m_tokens"),
        _s1=pl.col("sim_cache_write_1h_tokens"), _sr=pl.col("sim_cache_read_tokens"),
        _ri=pl.col("recorded_input_tokens"), _r5=pl.col("recorded_cache_write_5m_tokens").fill_null(
            pl.col("recorded_cache_write_tokens")).fill_null(0),
        _r1=pl.col("recorded_cache_write_1h_tokens").fill_null(0), _rr=pl.col("recorded_cache_read_tokens"),
        _z=z,
        # a request without a time (a single request file) is priced as the report does: at 1970-01-01
        _pmodel=pl.col("model").fill_null("unknown"),   # a call without a model is unpriced, not an error
        _pts=pl.col("timestamp").forward_fill().backward_fill().over("thread_key").fill_null(
            pl.lit(datetime(1970, 1, 1, tzinfo=UTC)).cast(c.schema["timestamp"])),
    )
    # a break's cost: the call as it was minus the call had the re-written tokens been read instead
    sb = pl.col("sim_break_tokens").fill_null(0)
    rb = pl.col("recorded_break_tokens").fill_null(0)
    s_is5 = pl.col("_s5") >= pl.col("_s1")
    r_is5 = pl.col("_r5") >= pl.col("_r1")
    # the tokens move from the writes (of the call's TTL), then from the input where writes are free
    frame = frame.with_columns(
        _sb5=pl.when(s_is5).then((pl.col("_s5") - sb).clip(0)).otherwise(pl.col("_s5")),
        _sb1=pl.when(s_is5).then(pl.col("_s1")).otherwise((pl.col("_s1") - sb).clip(0)),
        _sbi=pl.col("_si") - (sb - pl.when(s_is5).then(pl.col("_s5")).otherwise(pl.col("_s1"))).clip(0),
        _sbr=pl.col("_sr") + sb,
        _rb5=pl.when(r_is5).then((pl.col("_r5") - rb).clip(0)).otherwise(pl.col("_r5")),
        _rb1=pl.when(r_is5).then(pl.col("_r1")).otherwise((pl.col("_r1") - rb).clip(0)),
        _rbi=pl.col("_ri") - (rb - pl.when(r_is5).then(pl.col("_r5")).otherwise(pl.col("_r1"))).clip(0),
        _rbr=pl.col("_rr") + rb,
    )
    ts = "_pts"
    frame = prices.price_frame(frame, model="_pmodel", timestamp=ts, input="_si", output="_o", cache_write_5m="_s5",
                               cache_write_1h="_s1", cache_read="_sr", out="sim_cost_usd")
    frame = prices.price_frame(frame, model="_pmodel", timestamp=ts, input="_ri", output="_o", cache_write_5m="_r5",
                               cache_write_1h="_r1", cache_read="_rr", out="recorded_cost_usd")
    frame = prices.price_frame(frame, model="_pmodel", timestamp=ts, input="_sbi", output="_o", cache_write_5m="_sb5",
                               cache_write_1h="_sb1", cache_read="_sbr", out="_sim_nobreak")
    frame = prices.price_frame(frame, model="_pmodel", timestamp=ts, input="_rbi", output="_o", cache_write_5m="_rb5",
                               cache_write_1h="_rb1", cache_read="_rbr", out="_rec_nobreak")
    recorded_known = pl.col("recorded_input_tokens").is_not_null() & pl.col("recorded_cache_read_tokens").is_not_null()
    frame = frame.with_columns(
        sim_cost_usd=pl.when(pl.col("sim_input_tokens").is_not_null()).then(pl.col("sim_cost_usd")),
        recorded_cost_usd=pl.when(recorded_known).then(pl.col("recorded_cost_usd")),
        sim_break_cost_usd=pl.when(pl.col("sim_break_tokens").is_not_null())
        .then(pl.col("sim_cost_usd") - pl.col("_sim_nobreak")),
        recorded_break_cost_usd=pl.when(pl.col("recorded_break_tokens").is_not_null())
        .then(pl.col("recorded_cost_usd") - pl.col("_rec_nobreak")),
    )
    return frame.drop([x for x in frame.columns if x.startswith("_") and x not in c.columns])


def cache_edit_aliases(decisions: pl.DataFrame | None, call_messages: Any, messages: Any = None) -> dict[str, str]:
    """The aliases (see simulate) of the run's cache edits: a decision whose reason ends in
    `:cache_edit` (tombstone `mode = "cache_edit"`) changed its thread's request at its call on the
    provider's side; a message of that call's request that differs from the message at the same
    index of the call before (the edit replaces in place) keeps the place of that earlier version.
    With `messages` (the request store's messages table) only a message that kept or lost content
    blocks is an edit (a clearing replaces or removes blocks), while one that gained blocks (new
    blocks merged into the last message) changed in the request itself. Chains resolve to the first version (a message edited twice
    keeps the place of the one first cached)."""
    if decisions is None or decisions.height == 0 or "reason" not in decisions.columns:
        return {}
    from ctxreplay.pipeline.assembly.replay import thread_key_expr

    edits = decisions.filter(pl.col("reason").str.ends_with(CACHE_EDIT_SUFFIX)
                             & ~pl.col("action").is_in(["violation", "conflict"]))
    if edits.height == 0:
        return {}
    at = edits.select(thread_key=thread_key_expr().cast(pl.String), call=pl.col("from_call").cast(pl.Int32)) \
        .unique().filter(pl.col("call") > 0)
    cm = call_messages if isinstance(call_messages, pl.DataFrame) else pl.from_arrow(call_messages)
    assert isinstance(cm, pl.DataFrame)
    spans = cm.filter(pl.col("slot").is_not_null()).select(pl.col("thread_key").cast(pl.String), "slot", "first_call",
                                                           "last_call", pl.col("sha256").cast(pl.String))

    def listed(c: pl.Expr) -> pl.DataFrame:
        """The messages of the request at call c of each edit, with their index in it."""
        live = spans.join(at.with_columns(_c=c), on="thread_key").filter(
            (pl.col("first_call") <= pl.col("_c")) & (pl.col("last_call").is_null() | (pl.col("last_call") > pl.col("_c"))))
        return live.with_columns(idx=pl.col("slot").rank("ordinal").over("thread_key", "call")).select(
            "thread_key", "call", "idx", "sha256")

    pairs = listed(pl.col("call") - 1).rename({"sha256": "old"}).join(
        listed(pl.col("call")).rename({"sha256": "new"}), on=["thread_key", "call", "idx"]) \
        .filter(pl.col("old") != pl.col("new")).sort("thread_key", "call", "idx")
    if messages is not None:
        msgs = messages if isinstance(messages, pl.DataFrame) else pl.from_arrow(messages)
        assert isinstance(msgs, pl.DataFrame)
        size = msgs.select(pl.col("sha256").cast(pl.String), _n="n_blocks")
        pairs = pairs.join(size.rename({"sha256": "old", "_n": "_old_n"}), on="old", how="left") \
            .join(size.rename({"sha256": "new", "_n": "_new_n"}), on="new", how="left") \
            .filter(pl.col("_new_n") <= pl.col("_old_n"))
    out: dict[str, str] = {}
    for o, n in zip(pairs.get_column("old").to_list(), pairs.get_column("new").to_list(), strict=True):
        out.setdefault(n, out.get(o, o))
    return out


def after_replay(loaded_blocks: Any, final_blocks: Any, calls: pl.DataFrame, store_tables: tuple[Any, Any],
                 decisions: pl.DataFrame | None, count_tokens: Any, prices: Any = "default",
                 policy: Policy | None = None) -> tuple[pl.DataFrame, dict[str, Any]]:
    """The runner's hook, once per run after the replay: calibrate on the loaded blocks, simulate
    the run's requests, return (calls with the cache-simulation columns, the summary's `cache_sim`
    section). `prices="default"` loads genai-prices (costs are null, with a warning, when it cannot)."""
    import time

    t0 = time.perf_counter()
    warnings: list[str] = []
    if isinstance(prices, str) and prices == "default":
        from ctxreplay.pipeline.cost.prices import PriceBook

        try:
            prices = PriceBook.load()
        except CtxReplayError as exc:
            prices = None
            warnings.append(f"no prices: {exc}")
    lb = loaded_blocks if isinstance(loaded_blocks, pl.DataFrame) else pl.from_arrow(loaded_blocks)
    fb = final_blocks if isinstance(final_blocks, pl.DataFrame) else pl.from_arrow(final_blocks)
    assert isinstance(lb, pl.DataFrame) and isinstance(fb, pl.DataFrame)
    prep = prepare(lb, calls, count_tokens, fb)
    store = SimStore.from_tables(*store_tables)
    aliases = cache_edit_aliases(decisions, store_tables[1], store_tables[0])
    res = simulate(calls, store, prep, decisions=decisions, prices=prices, policy=policy, aliases=aliases)
    return sim_outcome(res, prices, warnings, t0)


def sim_outcome(res: Any, prices: Any, warnings: list[str], t0: float) -> tuple[pl.DataFrame, dict[str, Any]]:
    """(calls with the simulation's columns, the summary's `cache_sim` section) of a simulation:
    the price book's cache saved, its warnings and the seconds since t0 added."""
    import time

    summary = res.summary
    if prices is not None:
        prices.save()
        warnings.extend(prices.warnings)
    summary["warnings"] = warnings
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return res.calls, summary


__all__ = ["SIM_COLUMNS", "CacheState", "Policy", "Prepared", "SimError", "SimResult", "SimStore", "after_replay",
           "answer_times", "cache_edit_aliases", "min_cacheable_tokens", "prepare", "provider_of", "simulate"]
