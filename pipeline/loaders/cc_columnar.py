"""Claude Code sessions loaded column by column: the fast path behind `load_paths`.

Same output as `claude_code.load_session` + `base.threads_to_blocks` (the reference path, kept as
`load_paths(..., engine="reference")`): the same blocks table, row for row and value for value, and
the same accounting (line kinds, quarantine rows, recovered notes, loader stats). How:

1. **Lines.** Each file is read once; its bytes are split into physical lines and checked for
   UTF-8 by Arrow, without a Python object per line.
2. **Which lines the fast path takes.** A line is *fast* when it is one JSON object (starts with
   `{`, ends with `}`, at most MAX_FAST_LINE bytes) that DuckDB's JSON reader parses and that holds
   nothing the reader accepts and orjson refuses (trailing commas, NaN / Infinity: byte patterns,
   strings included, so a few clean lines go the careful way too; lone surrogate escapes and broken
   JSON the reader refuses itself; a number beyond a double, which both readers take, sends the line
   the careful way where the loader reads it and changes nothing elsewhere), nests at most MAX_DEPTH
   levels, and whose fields have the types the loader expects (checked in SQL below: strings where
   ids and texts are read, flags that are JSON booleans, integer usage counts, no duplicate keys in
   any object read).
   Every other line takes the *careful path*: `base.read_line` and the reference loader's
   per-object code, so damaged and unusual lines are quarantined, noted and counted exactly as
   before. A line the careful path reads becomes a node like any other; the two kinds mix freely.
3. **Entries and blocks in SQL.** DuckDB parses the fast lines once (`json_transform` with the
   fields the loader reads kept as JSON text, so types can be checked), unnests `message.content`
   and tool-result parts in SQL, and returns two Arrow tables: one row per entry (ids, flags,
   usage, timestamp) and one row per block part (block type, text, tool fields, image). Values
   that need a canonical JSON text (a tool input, the other keys of a block) are re-serialised
   with orjson from the JSON text DuckDB returns (sorted keys, like `json_text`).
4. **Threads.** Parent chains, compaction boundaries, parallel tool results recovered off the
   chain, branches and their inherited calls are graph logic: they stay Python, as in the
   reference loader, but over a compact per-entry table (node ids, parents, types, message keys,
   tool ids) instead of parsed dicts, and they produce plans (which entries make which message of
   which thread), not rows.
5. **Blocks table.** Rows are gathered from the entry and block tables by the plans' index arrays
   (Arrow `take`; polars `gather` for the long strings: raw lines and block parts); `block_pos` is
   computed with expressions. `content_sha256` is orjson + hashlib per block part (34,000 parts of
   the 190 MB benchmark tree in about 0.25 s CPU; DuckDB's `to_json` + `sha256` over the same rows
   took longer).

A value the careful path reads that does not fit its column (a number where a text is expected,
...) makes the reference loader coerce the whole batch and note it; rather than reproduce that
here, `NeedsReference` is raised and `load_paths` runs the reference path for the whole call.

No data is kept between calls: `load_sessions` takes a list of session groups (one, or a batch
sized by the caller) and returns their threads, accounting and blocks. What is kept is one DuckDB
connection per process and thread with its macros (batches up to REUSE_MAX_BYTES; its tables are
dropped after each call). `load_paths` sends batches under SMALL_BATCH_BYTES to the reference
loader, whose cost there is below this engine's fixed cost.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import duckdb
import orjson
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from ctxreplay.pipeline.core.blockops import canonical_json
from ctxreplay.pipeline.core.duck import connect
from ctxreplay.pipeline.loaders import claude_code as cc
from ctxreplay.pipeline.loaders.base import (
    MAX_DEPTH,
    ORDER_STRIDE,
    FileLoad,
    b64_decoded_len,
    bad,
    depth_exceeds,
    json_text,
    line_digest,
    parse_json_line,
    parse_ts,
    path_str,
    read_line,
    read_lines,
    take_long_lines,
    unreadable,
)
from ctxreplay.schemas.blocks import BLOCKS, CONTENT_COLUMNS, TS
from ctxreplay.schemas.check import empty_table

FORMAT = cc.FORMAT
# what the SQL JSON reader accepts and orjson does not (two patterns: an alternation of both is slower)
_TRAILING_COMMA = r",[ \t\r\n]*[\]}]"
_NAN_OR_INF = r"[:,\[][ \t\r\n]*[-+]?(?i:nan|inf)"
# lines longer than this take the careful path (bounded memory in the SQL engine for huge lines)
MAX_FAST_LINE = 8 << 20
# block keys the reference loader reads itself; any other key of a block is kept in extra_json
KNOWN_BLOCK_KEYS = ("type", "text", "thinking", "signature", "id", "name", "input", "tool_use_id", "content",
                    "is_error", "source", "data")


class NeedsReference(Exception):
    """A value read by the careful path does not fit its column: the reference loader coerces such
    values over the whole batch (with notes); `load_paths` then runs it for the whole call."""


# ---------------------------------------------------------------- SQL

_MACROS = r"""
CREATE OR REPLACE TEMP MACRO jstr(x) AS CASE WHEN starts_with(x, '"') THEN x->>'$' END;
CREATE OR REPLACE TEMP MACRO jok(x) AS (x IS NULL OR starts_with(x, '"'));
CREATE OR REPLACE TEMP MACRO jbool(x) AS (x = 'true');
CREATE OR REPLACE TEMP MACRO jbool_ok(x) AS (x IS NULL OR x = 'true' OR x = 'false');
CREATE OR REPLACE TEMP MACRO jint(x) AS CASE WHEN regexp_full_match(x, '-?[0-9]+') THEN TRY_CAST(x AS BIGINT) END;
CREATE OR REPLACE TEMP MACRO jint_ok(x) AS (x IS NULL OR regexp_full_match(x, '-?[0-9]+') OR starts_with(x, '"')
    OR x = 'true' OR x = 'false' OR starts_with(x, '[') OR starts_with(x, '{'));
CREATE OR REPLACE TEMP MACRO nodup(l) AS (l IS NULL OR len(l) = len(list_distinct(l)));
CREATE OR REPLACE TEMP MACRO keys_nodup(ks) AS (ks IS NULL OR list_bool_and(list_transform(ks, lambda k: nodup(k))));
CREATE OR REPLACE TEMP MACRO nodupk(x) AS (x IS NULL OR x = [NULL] OR hash(x) NOT IN (SELECT hk FROM dup_keys));
"""

_LINE_SPEC = orjson.dumps({
    "type": "JSON", "uuid": "JSON", "parentUuid": "JSON", "logicalParentUuid": "JSON", "subtype": "JSON",
    "isSidechain": "JSON", "isMeta": "JSON", "isCompactSummary": "JSON", "isVisibleInTranscriptOnly": "JSON",
    "requestId": "JSON", "timestamp": "JSON", "agentId": "JSON",
    "data": {"type": "JSON"}, "attachment": {"type": "JSON"},
    "message": {"id": "JSON", "role": "JSON", "model": "JSON", "stop_reason": "JSON", "content": ["JSON"],
                "usage": {"input_tokens": "JSON", "output_tokens": "JSON", "cache_read_input_tokens": "JSON",
                          "cache_creation_input_tokens": "JSON",
                          "cache_creation": {"ephemeral_5m_input_tokens": "JSON",
                                             "ephemeral_1h_input_tokens": "JSON"}},
                "diagnostics": {"cache_miss_reason": {"type": "JSON", "cache_missed_input_tokens": "JSON"}}},
}).decode()
_BLOCK_SPEC = orjson.dumps({k: "JSON" for k in KNOWN_BLOCK_KEYS}).decode()
_PART_SPEC = orjson.dumps({"type": "JSON", "text": "JSON", "source": "JSON", "tool_name": "JSON"}).decode()
_SOURCE_SPEC = orjson.dumps({"type": "JSON", "media_type": "JSON", "data": "JSON"}).decode()
_TS_RE = r'"[1-9][0-9]{3}-[0-9]{2}-[0-9]{2}T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]\.[0-9]{3}Z"'
_KNOWN_SQL = ", ".join(f"'{k}'" for k in KNOWN_BLOCK_KEYS)

# One row per candidate line: the keys of every object read (duplicate keys: the SQL engine reads the
# first, the reference loader the last; such lines take the careful path), which also says whether
# the line is JSON at all (null: not JSON), and the transform of the lines that are.
_SQL_PARSE = f"""
CREATE OR REPLACE TEMP TABLE p AS
SELECT lid, k, CASE WHEN k IS NOT NULL THEN json_transform(t, '{_LINE_SPEC}') END AS s
FROM (SELECT lid, t, try(json_keys(t, ['$', '$.message', '$.message.usage', '$.message.usage.cache_creation',
                                       '$.message.diagnostics', '$.message.diagnostics.cache_miss_reason',
                                       '$.data', '$.attachment'])) AS k FROM v)
"""

# key lists with a duplicate key: checked once per distinct list (a few dozen in real files), then
# matched back by hash (a hash shared with a clean list only sends more lines to the careful path)
_SQL_DUPS = """
CREATE OR REPLACE TEMP TABLE dup_keys AS
WITH sig AS (
  SELECT hash(k) AS hk, min(k) AS lo, max(k) AS hi FROM p WHERE k IS NOT NULL GROUP BY hash(k)
  UNION ALL
  SELECT hash(bk), min(bk), max(bk) FROM bi WHERE bk IS NOT NULL GROUP BY hash(bk)
  UNION ALL
  SELECT hash(qk), min(qk), max(qk) FROM pt WHERE qk IS NOT NULL GROUP BY hash(qk)
  UNION ALL
  SELECT hash([rk]), min([rk]), max([rk]) FROM src2 WHERE rk IS NOT NULL GROUP BY hash([rk])
)
-- a hash shared by two different key lists is flagged too (their lines then take the careful path)
SELECT hk FROM sig WHERE lo <> hi OR NOT keys_nodup(lo)
"""

# message.content that is not a list: a string (one text block), null / missing, or something else
_SQL_CONTENT = """
CREATE OR REPLACE TEMP TABLE c AS
SELECT v.lid, json_extract(v.t, '$.message.content') AS cj
FROM v JOIN p ON v.lid = p.lid
WHERE p.s.message IS NOT NULL AND p.s.message.content IS NULL
"""

# one row per item of message.content
_SQL_ITEMS = f"""
CREATE OR REPLACE TEMP TABLE bi AS
WITH u AS (
  SELECT lid, unnest(s.message.content) AS it, unnest(range(len(s.message.content)::BIGINT)) AS bi
  FROM p WHERE s.message.content IS NOT NULL
)
SELECT lid, bi, it, starts_with(it, '{{') AS obj,
       CASE WHEN starts_with(it, '{{') THEN json_transform(it, '{_BLOCK_SPEC}') END AS b,
       CASE WHEN starts_with(it, '{{') THEN json_keys(it, ['$', '$.source']) END AS bk
FROM u
"""

# one row per part of a tool_result whose content is a non-empty list
_SQL_PARTS = f"""
CREATE OR REPLACE TEMP TABLE pt AS
WITH u AS (
  SELECT lid, bi, b.tool_use_id AS tuid, b.is_error AS iserr, bk AS bbk,
         unnest(json_extract(b.content, '$[*]')) AS pj,
         unnest(range(json_array_length(b.content)::BIGINT)) AS pi
  FROM bi WHERE obj AND b.type = '"tool_result"' AND starts_with(b.content, '[') AND b.content <> '[]'
)
SELECT *, starts_with(pj, '{{') AS pobj,
       CASE WHEN starts_with(pj, '{{') THEN json_transform(pj, '{_PART_SPEC}') END AS q,
       CASE WHEN starts_with(pj, '{{') THEN json_keys(pj, ['$', '$.source']) END AS qk
FROM u
"""

# image sources (blocks and tool_result parts) that are objects
_SQL_SOURCES = """
CREATE OR REPLACE TEMP TABLE src AS
SELECT lid, bi, 0::BIGINT AS pi, b.source AS sj FROM bi
  WHERE obj AND b.type = '"image"' AND starts_with(b.source, '{')
UNION ALL
SELECT lid, bi, pi, q.source AS sj FROM pt
  WHERE pobj AND q.type = '"image"' AND starts_with(q.source, '{')
"""

_SQL_SOURCES2 = f"""
CREATE OR REPLACE TEMP TABLE src2 AS
SELECT lid, bi, pi, sj, json_transform(sj, '{_SOURCE_SPEC}') AS r, json_keys(sj) AS rk FROM src
"""

# every block part, in (line, block, part) order; `bad`: the line must take the careful path
_SQL_EB = f"""
CREATE OR REPLACE TEMP TABLE eb AS
WITH blk AS (
  SELECT bi.lid, bi.bi, 0::BIGINT AS pi, bi.it, bi.obj, bi.b, bi.bk, jstr(bi.b.type) AS bt,
         list_filter(bi.bk[1], lambda x: x NOT IN ({_KNOWN_SQL})) AS rest,
         src2.r AS r, src2.rk AS rk, src2.sj AS sj
  FROM bi LEFT JOIN src2 ON bi.lid = src2.lid AND bi.bi = src2.bi AND src2.pi = 0
), rows AS (
  -- message.content given as a string: one text block
  SELECT lid, 0::BIGINT AS bi, 0::BIGINT AS pi, 'text' AS block_type, NULL::VARCHAR AS part_type,
         jstr(cj) AS text, NULL::VARCHAR AS signature, NULL::VARCHAR AS tool_use_id, NULL::VARCHAR AS tool_name,
         NULL::BOOLEAN AS is_error, NULL::VARCHAR AS image_media_type, NULL::VARCHAR AS image_data,
         NULL::VARCHAR AS py, NULL::VARCHAR AS pyj, NULL::VARCHAR AS pyj2, false AS bad
  FROM c WHERE starts_with(cj, '"')
  UNION ALL
  -- an item of the content list that is a string: a text block; any other non-object: careful path
  SELECT lid, bi, pi, 'text', NULL, jstr(it), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
         it IS NULL OR NOT starts_with(it, '"')
  FROM blk WHERE NOT coalesce(obj, false)
  UNION ALL
  -- blocks that are not tool results
  SELECT lid, bi, pi,
         bt, NULL,
         CASE bt WHEN 'text' THEN jstr(b.text) WHEN 'thinking' THEN jstr(b.thinking)
                 WHEN 'redacted_thinking' THEN jstr(b.data) WHEN 'tool_use' THEN NULL WHEN 'server_tool_use' THEN NULL
                 WHEN 'image' THEN NULL ELSE jstr(b.text) END,
         CASE WHEN bt = 'thinking' THEN jstr(b.signature) END,
         CASE WHEN bt IN ('tool_use', 'server_tool_use') THEN jstr(b.id) END,
         CASE WHEN bt IN ('tool_use', 'server_tool_use') THEN jstr(b.name) END,
         NULL,
         CASE WHEN bt = 'image' THEN jstr(r.media_type) END,
         CASE WHEN bt = 'image' THEN jstr(r.data) END,
         -- what Python completes: canonical JSON of the tool input, of the other keys, of the block
         CASE WHEN bt IN ('tool_use', 'server_tool_use') AND list_contains(bk[1], 'input') AND len(rest) > 0
                   THEN 'input+rest'
              WHEN bt IN ('tool_use', 'server_tool_use') AND list_contains(bk[1], 'input') THEN 'input'
              WHEN bt IN ('text', 'thinking', 'redacted_thinking', 'tool_use', 'server_tool_use') AND len(rest) > 0
                   THEN 'rest'
              WHEN bt = 'image' AND r.type IS NOT NULL AND r.type <> '"base64"' THEN 'source'
              WHEN bt NOT IN ('text', 'thinking', 'redacted_thinking', 'tool_use', 'server_tool_use', 'image')
                   THEN 'whole'
         END,
         CASE WHEN bt IN ('tool_use', 'server_tool_use') AND list_contains(bk[1], 'input')
                   THEN coalesce(b.input, 'null')
              WHEN bt IN ('text', 'thinking', 'redacted_thinking') AND len(rest) > 0 THEN it
              WHEN bt = 'image' AND r.type IS NOT NULL AND r.type <> '"base64"' THEN sj
              WHEN bt NOT IN ('text', 'thinking', 'redacted_thinking', 'tool_use', 'server_tool_use', 'image')
                   THEN it
         END,
         CASE WHEN bt IN ('tool_use', 'server_tool_use') AND len(rest) > 0 THEN it END,
         NOT (bt IS NOT NULL AND nodupk(bk) AND nodupk([rk])
              AND (bt NOT IN ('text') OR jok(b.text))
              AND (bt <> 'thinking' OR (jok(b.thinking) AND jok(b.signature)))
              AND (bt <> 'redacted_thinking' OR jok(b.data))
              AND (bt NOT IN ('tool_use', 'server_tool_use') OR (jok(b.id) AND jok(b.name)))
              AND (bt <> 'image' OR r IS NULL OR (jok(r.media_type) AND jok(r.data))))
  FROM blk WHERE obj AND (bt IS NULL OR bt <> 'tool_result')
  UNION ALL
  -- tool_result content given as a string, or nothing usable (a missing `content` key too): one part
  SELECT lid, bi, pi, 'tool_result', CASE WHEN starts_with(b.content, '"') THEN 'string' ELSE 'empty' END,
         jstr(b.content), NULL, jstr(b.tool_use_id), NULL, jbool(b.is_error), NULL, NULL, NULL, NULL, NULL,
         NOT (nodupk(bk) AND jok(b.tool_use_id) AND jbool_ok(b.is_error))
  FROM blk WHERE obj AND bt = 'tool_result'
    AND NOT coalesce(starts_with(b.content, '[') AND b.content <> '[]', false)
  UNION ALL
  -- tool_result content given as a list: one row per part
  SELECT pt.lid, pt.bi, pt.pi, 'tool_result',
         CASE WHEN q.type = '"text"' THEN 'text' WHEN q.type = '"image"' THEN 'image'
              WHEN q.type = '"tool_reference"' THEN 'tool_reference' ELSE 'other' END,
         CASE WHEN q.type = '"text"' THEN jstr(q.text) END,
         NULL, jstr(tuid), CASE WHEN q.type = '"tool_reference"' THEN jstr(q.tool_name) END, jbool(iserr),
         CASE WHEN q.type = '"image"' THEN jstr(src2.r.media_type) END,
         CASE WHEN q.type = '"image"' THEN jstr(src2.r.data) END,
         CASE WHEN q.type IS NULL OR q.type NOT IN ('"text"', '"image"', '"tool_reference"') THEN 'part' END,
         CASE WHEN q.type IS NULL OR q.type NOT IN ('"text"', '"image"', '"tool_reference"')
              THEN coalesce(pj, 'null') END,
         NULL,
         NOT (jok(tuid) AND jbool_ok(iserr) AND nodupk(bbk) AND nodupk(qk) AND nodupk([src2.rk])
              AND (q.type IS DISTINCT FROM '"text"' OR jok(q.text))
              AND (q.type IS DISTINCT FROM '"tool_reference"' OR jok(q.tool_name))
              AND (q.type IS DISTINCT FROM '"image"' OR src2.r IS NULL
                   OR (jok(src2.r.media_type) AND jok(src2.r.data))))
  FROM pt LEFT JOIN src2 ON pt.lid = src2.lid AND pt.bi = src2.bi AND pt.pi = src2.pi
)
SELECT * FROM rows
"""

# one row per fast line: what the node loop and the blocks table need
_SQL_ENTRIES = f"""
WITH agg AS (
  SELECT lid, count(*) AS nb, bool_and(block_type = 'tool_result') AS all_tr, bool_or(bad) AS anybad,
         list(tool_use_id ORDER BY bi) FILTER (WHERE block_type = 'tool_result' AND pi = 0 AND tool_use_id <> '')
           AS tr_ids,
         list(tool_use_id ORDER BY bi) FILTER (WHERE block_type = 'tool_use' AND tool_use_id <> '') AS tu_ids
  FROM eb GROUP BY lid
), e AS (
  SELECT p.lid, s, k, c.cj, agg.nb, agg.all_tr, agg.anybad, agg.tr_ids, agg.tu_ids,
         jstr(s.type) AS typ,
         s.message IS NOT NULL AND (s.message.id IS NOT NULL OR s.message.role IS NOT NULL
           OR s.message.model IS NOT NULL OR s.message.stop_reason IS NOT NULL
           OR s.message.content IS NOT NULL OR c.cj IS NOT NULL OR s.message.usage IS NOT NULL) AS msg_obj,
         s.message.usage IS NOT NULL AS has_usage,
         s.message.usage.input_tokens IS NOT NULL OR s.message.usage.output_tokens IS NOT NULL
           OR s.message.usage.cache_read_input_tokens IS NOT NULL
           OR s.message.usage.cache_creation_input_tokens IS NOT NULL
           OR s.message.usage.cache_creation IS NOT NULL AS usage_fields,
         regexp_full_match(s.timestamp, '{_TS_RE}') AS ts_std
  FROM p LEFT JOIN c ON p.lid = c.lid LEFT JOIN agg ON p.lid = agg.lid
)
SELECT lid, typ,
  jstr(s.uuid) AS uuid, jstr(s.parentUuid) AS parent, jstr(s.logicalParentUuid) AS lparent,
  typ = 'system' AND jstr(s.subtype) = 'compact_boundary' AS boundary,
  CASE WHEN typ = 'system' AND length(jstr(s.subtype)) BETWEEN 1 AND 100 THEN 'system:' || jstr(s.subtype)
       WHEN typ = 'progress' AND length(jstr(s.data.type)) BETWEEN 1 AND 100 THEN 'progress:' || jstr(s.data.type)
       WHEN typ = 'attachment' AND length(jstr(s.attachment.type)) BETWEEN 1 AND 100
            THEN 'attachment:' || jstr(s.attachment.type)
       ELSE typ END AS kind,
  jbool(s.isSidechain) AS side, jbool(s.isMeta) AS meta, jbool(s.isCompactSummary) AS csum,
  jbool(s.isVisibleInTranscriptOnly) AS disp,
  jstr(s.requestId) AS request_id, jstr(s.agentId) AS agent_id,
  jstr(s.message.id) AS msg_id,
  CASE WHEN typ IN ('user', 'assistant') THEN
    CASE WHEN coalesce(nullif(jstr(s.message.role), ''), typ) = 'user' AND coalesce(nb, 0) > 0 AND all_tr
         THEN 'tool' ELSE coalesce(nullif(jstr(s.message.role), ''), typ) END
  END AS role,
  jstr(s.message.model) AS model, jstr(s.message.stop_reason) AS stop_reason,
  CASE WHEN ts_std THEN epoch_ms(try_strptime(s.timestamp->>'$', '%Y-%m-%dT%H:%M:%S.%gZ')) END AS ts_ms,
  CASE WHEN s.timestamp IS NOT NULL AND NOT ts_std THEN s.timestamp END AS ts_json,
  has_usage,
  jint(s.message.usage.input_tokens) AS u_in, jint(s.message.usage.output_tokens) AS u_out,
  jint(s.message.usage.cache_read_input_tokens) AS u_cr, jint(s.message.usage.cache_creation_input_tokens) AS u_cw,
  jint(s.message.usage.cache_creation.ephemeral_5m_input_tokens) AS u_5m,
  jint(s.message.usage.cache_creation.ephemeral_1h_input_tokens) AS u_1h,
  jstr(s.message.diagnostics.cache_miss_reason.type) AS d_reason,
  jint(s.message.diagnostics.cache_miss_reason.cache_missed_input_tokens) AS d_missed,
  coalesce(nb, 0) AS nb, tr_ids, tu_ids,
  -- the line takes the fast path only when every value read has the type the loader expects
  (typ IS NOT NULL AND typ <> '' AND length(typ) <= 100 AND nodupk(k) AND NOT coalesce(anybad, false)
   AND jok(s.uuid) AND jok(s.requestId)
   AND jbool_ok(s.isSidechain) AND jbool_ok(s.isMeta) AND jbool_ok(s.isCompactSummary)
   AND jbool_ok(s.isVisibleInTranscriptOnly)
   -- Claude Code's local notices (model <synthetic>, a few per session) are read by the careful path
   AND NOT coalesce(typ = 'assistant' AND jstr(s.message.model) = '{cc.LOCAL_MODEL}', false)
   AND (typ NOT IN ('user', 'assistant') OR (
        msg_obj AND jok(s.message.id) AND jok(s.message.role) AND jok(s.message.model) AND jok(s.message.stop_reason)
        AND (s.message.content IS NOT NULL OR starts_with(cj, '"') OR (typ = 'user' AND cj IS NULL))
        AND (typ <> 'assistant' OR NOT has_usage OR (usage_fields
             AND jint_ok(s.message.usage.input_tokens) AND jint_ok(s.message.usage.output_tokens)
             AND jint_ok(s.message.usage.cache_read_input_tokens)
             AND jint_ok(s.message.usage.cache_creation_input_tokens)
             AND jint_ok(s.message.usage.cache_creation.ephemeral_5m_input_tokens)
             AND jint_ok(s.message.usage.cache_creation.ephemeral_1h_input_tokens)
             AND jint_ok(s.message.diagnostics.cache_miss_reason.cache_missed_input_tokens)))))) AS ok
FROM e
ORDER BY lid
"""

_SQL_BLOCKS_OUT = """
SELECT lid, pi, block_type, part_type, text, signature, tool_use_id, tool_name, is_error, image_media_type,
       image_data, py, pyj, pyj2
FROM eb ORDER BY lid, bi, pi
"""


# ---------------------------------------------------------------- plans


@dataclass
class MessagePlan:
    """One message of a thread: the entries (node ids) whose blocks it holds, in order."""

    members: list[int]
    usage_node: int  # the entry whose usage the message reports (the largest copy, the last of equals)
    stop_node: int  # the entry whose stop_reason it reports (the last that has one, else the first)
    role: str
    msg_key: str | None
    source_line: int
    inherited: bool = False
    local: bool = False  # a local notice of Claude Code (claude_code.is_local_notice): never a call


@dataclass
class ThreadPlan:
    """A thread as node indices; it has what `load_paths` reads of a `base.Thread`."""

    session_id: str
    thread_id: str
    source_format: str
    source_file: str
    messages: list[MessagePlan]
    compactions: list[tuple[int, int]] = field(default_factory=list)  # (at, keep_from), as base.Compaction


@dataclass
class SessionsLoad:
    """What `load_sessions` returns: its threads (in group order), the accounting of every file,
    and the loader stats of every group (in order, for the caller to add up)."""

    threads: list[ThreadPlan]
    loads: list[FileLoad]
    stats: list[dict[str, int]]
    batch: _Batch

    def blocks(self, threads: list[ThreadPlan] | None = None) -> pa.Table:
        """The blocks table (BLOCKS schema) of these threads (default: all of them), in their order,
        with the thread ids they carry now. Called once: it lets go of the careful path's texts as it
        moves them into columns (a long line is then held once, not once in Python too)."""
        return self.batch.assemble(self.threads if threads is None else threads)


# ---------------------------------------------------------------- the batch's columns


@dataclass
class _File:
    group: int
    fi: int  # position in its group's file order (claude_code._main_first)
    path: Path
    spath: str
    load: FileLoad | None  # None: unreadable
    data: bytes | None = None
    start: int = 0  # its first line in the batch's line arrays
    n: int = 0  # its physical lines (split on \n, the last one possibly empty)
    # lines longer than MAX_FAST_LINE by line number (`inputs.read_lines`' aside): empty in the line arrays
    aside: dict[int, bytes] = field(default_factory=dict)


@dataclass
class _Fast:
    """The SQL output for the fast lines (row r = r-th fast line in line order), for the node loop."""

    row: dict[int, int] = field(default_factory=dict)  # line id -> r
    lid: list[int] = field(default_factory=list)
    typ: list[str] = field(default_factory=list)
    uuid: list[str | None] = field(default_factory=list)
    parent: list[str | None] = field(default_factory=list)
    lparent: list[str | None] = field(default_factory=list)
    boundary: list[bool] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)
    side: list[bool] = field(default_factory=list)
    msg_id: list[str | None] = field(default_factory=list)
    request_id: list[str | None] = field(default_factory=list)
    agent_id: list[str | None] = field(default_factory=list)
    tr: list[list[str] | None] = field(default_factory=list)
    tu: list[list[str] | None] = field(default_factory=list)
    # message lines only: row in the fast entry table (-1 for other lines), role, stop_reason, usage total
    erow: list[int] = field(default_factory=list)
    role: list[str | None] = field(default_factory=list)
    stop: list[str | None] = field(default_factory=list)
    utotal: list[int] = field(default_factory=list)


class _Nodes:
    """Per-node columns of a batch: every entry with a uuid, of every group."""

    def __init__(self) -> None:
        self.uuid: list[str] = []
        self.parent: list[str | None] = []
        self.lparent: list[str | None] = []
        self.type: list[str] = []
        self.boundary: list[bool] = []
        self.fi: list[int] = []
        self.line: list[int] = []
        self.is_msg: list[bool] = []
        self.msg_key: list[str | None] = []
        self.side: list[bool] = []
        self.tr: list[tuple[str, ...]] = []
        self.tu: list[tuple[str, ...]] = []
        # message nodes: >= 0 row of the fast entry table, < 0: -(index in _Batch.slow_msgs) - 1
        self.src: list[int] = []
        self.path: list[str] = []
        self.role: list[str | None] = []
        self.utotal: list[int] = []
        self.stop: list[bool] = []  # has a stop_reason that counts (truthy)
        self.local: list[bool] = []  # a local notice (model `<synthetic>`; only careful lines are)

    def add(self, uuid: str, parent: str | None, lparent: str | None, typ: str, boundary: bool, fi: int, line: int,
            is_msg: bool, msg_key: str | None, side: bool, tr: tuple[str, ...], tu: tuple[str, ...], src: int,
            path: str, role: str | None, utotal: int, stop: bool, local: bool = False) -> int:
        self.uuid.append(uuid)
        self.parent.append(parent)
        self.lparent.append(lparent)
        self.type.append(typ)
        self.boundary.append(boundary)
        self.fi.append(fi)
        self.line.append(line)
        self.is_msg.append(is_msg)
        self.msg_key.append(msg_key)
        self.side.append(side)
        self.tr.append(tr)
        self.tu.append(tu)
        self.src.append(src)
        self.path.append(path)
        self.role.append(role)
        self.utotal.append(utotal)
        self.stop.append(stop)
        self.local.append(local)
        return len(self.uuid) - 1


_E_COLS = ["message_id", "request_id", "role", "timestamp", "model", "provider", "api", "stop_reason",
           "usage_input", "usage_output", "usage_cache_read", "usage_cache_write", "usage_cache_write_5m",
           "usage_cache_write_1h", "cache_miss_reason", "cache_missed_tokens", "is_sidechain", "is_meta",
           "is_compact_summary", "is_display_only"]
_EB_COLS = ["part_pos", "block_type", "part_type", "text", "signature", "tool_use_id", "tool_name", "tool_input",
            "is_error", "image_media_type", "image_data", "extra_json"]
_E_SCHEMA = pa.schema([BLOCKS.field(c).with_nullable(True) for c in _E_COLS])
_EB_SCHEMA = pa.schema([BLOCKS.field(c).with_nullable(True) for c in _EB_COLS]
                       + [pa.field("image_bytes", pa.int64()), pa.field("content_sha256", pa.string())])
_EMPTY_SHA = hashlib.sha256(canonical_json({"block_type": "empty"})).hexdigest()


class _Clock:
    """Optional wall-clock and CPU seconds per phase (for bench/bench_load.py); no-op without a dict."""

    def __init__(self, timings: dict[str, float] | None) -> None:
        self.timings = timings
        self.t = time.perf_counter()
        self.c = time.process_time()

    def lap(self, name: str) -> None:
        if self.timings is not None:
            now, cpu = time.perf_counter(), time.process_time()
            self.timings[name] = self.timings.get(name, 0.0) + now - self.t
            self.timings[f"cpu: {name}"] = self.timings.get(f"cpu: {name}", 0.0) + cpu - self.c
            self.t, self.c = now, cpu


class _Batch:
    """Everything read from the files of a batch of session groups."""

    def __init__(self, timings: dict[str, float] | None = None) -> None:
        self.clock = _Clock(timings)
        self.files: list[_File] = []
        self.text: pa.Array = pa.array([], pa.large_string())  # every physical line, decoded (null: not UTF-8)
        self.lines_bin: pa.Array = pa.array([], pa.large_binary())
        self.fast = _Fast()
        self.fast_e: pa.Table = empty_table(_E_SCHEMA)  # one row per fast message line
        self.fast_eb: pa.Table = empty_table(_EB_SCHEMA)  # their block parts, in order
        self.fast_eb_off: list[int] = [0]  # fast entry row -> first block part row (one more at the end)
        self.slow_msgs: list[Any] = []  # message entries read by the careful path (base.Message)
        self.fast_lid: list[int] = []  # fast entry row -> line id (its raw line is text[line id])
        self.nodes = _Nodes()
        self.open_sidechains = False  # keep inline sidechains awaiting their first answer (load_sessions)

    # ------------------------------------------------------------ blocks table

    def assemble(self, threads: list[ThreadPlan]) -> pa.Table:
        """The blocks table of these threads. Every column is gathered once from contiguous arrays
        (a gather from a chunked array is many times slower), by per-row and per-message indices."""
        self.clock.lap("(before assemble)")
        nodes = self.nodes
        n_fast_e = self.fast_e.num_rows
        n_fast_eb = self.fast_eb.num_rows
        n_text = len(self.text)
        slow_off = [0]
        for m in self.slow_msgs:
            slow_off.append(slow_off[-1] + len(m.blocks))
        fast_off = self.fast_eb_off
        fast_lid = self.fast_lid
        src, n_uuid, n_line, n_path = nodes.src, nodes.uuid, nodes.line, nodes.path

        def entry_row(node: int) -> int:  # row of the entry table (fast rows, then careful ones)
            s = src[node]
            return s if s >= 0 else n_fast_e - s - 1

        m_thread: list[int] = []
        m_pos: list[int] = []
        m_first: list[int] = []
        m_first_node: list[int] = []
        m_usage: list[int] = []
        m_stop: list[int] = []
        m_is_call: list[bool] = []
        m_fc: list[int] = []
        m_lc: list[int | None] = []
        r_msg: list[int] = []
        r_node: list[int] = []
        r_eb: list[int | None] = []
        for ti, t in enumerate(threads):
            is_call, first, last = _call_ranges(t)
            for pos, m in enumerate(t.messages):
                mi = len(m_thread)
                m_thread.append(ti)
                m_pos.append(pos)
                m_first_node.append(m.members[0])
                m_first.append(entry_row(m.members[0]))
                m_usage.append(entry_row(m.usage_node))
                m_stop.append(entry_row(m.stop_node))
                m_is_call.append(is_call[pos])
                m_fc.append(first[pos])
                m_lc.append(last[pos])
                got = False
                for e in m.members:
                    s = src[e]
                    if s >= 0:
                        a, b = fast_off[s], fast_off[s + 1]
                    else:
                        a, b = n_fast_eb + slow_off[-s - 1], n_fast_eb + slow_off[-s]
                    if b > a:
                        got = True
                        r_eb.extend(range(a, b))
                        r_msg.extend([mi] * (b - a))
                        r_node.extend([e] * (b - a))
                if not got:  # a message with no content still exists: one "empty" row
                    r_eb.append(None)
                    r_msg.append(mi)
                    r_node.append(m.members[0])
        self.clock.lap("assemble: plans to indices")
        n = len(r_msg)
        idx_msg = pa.array(r_msg, pa.int64())
        # entry columns, per message (first entry; usage and stop_reason from the chosen copies)
        slow_e = self._slow_entry_table()
        entries = pa.concat_tables([self.fast_e, slow_e]).combine_chunks() if slow_e is not None else self.fast_e
        per_msg = entries.take(pa.array(m_first, pa.int64()))
        msg_cols: dict[str, pa.Array] = {c: per_msg.column(c) for c in entries.column_names}
        for c in (*_USAGE_COLS, *_DIAG_COLS):  # the diagnosis comes with the usage copy it was recorded on
            msg_cols[c] = entries.column(c).take(pa.array(m_usage, pa.int64()))
        msg_cols["stop_reason"] = entries.column("stop_reason").take(pa.array(m_stop, pa.int64()))
        msg_cols["parent_id"] = pa.array([nodes.parent[i] for i in m_first_node], pa.string())
        msg_cols["msg_key"] = pa.array([nodes.msg_key[i] or n_uuid[i] for i in m_first_node], pa.string())
        msg_cols["entry_order"] = pa.array(m_pos, pa.int64())
        msg_cols["is_call"] = pa.array(m_is_call, pa.bool_())
        msg_cols["first_call"] = pa.array(m_fc, pa.int32())
        msg_cols["last_call"] = pa.array(m_lc, pa.int32())
        thread_of = pa.array(m_thread, pa.int64())
        msg_cols["session_id"] = pa.array([t.session_id for t in threads], pa.string()).take(thread_of)
        msg_cols["thread_id"] = pa.array([t.thread_id for t in threads], pa.string()).take(thread_of)
        cols: dict[str, Any] = {c: _combined(v).take(idx_msg) for c, v in msg_cols.items()}
        cols["order_key"] = pc.multiply(cols["entry_order"], pa.scalar(ORDER_STRIDE, pa.int64()))
        self.clock.lap("assemble: message columns")
        # the block's own entry: id, file, line and raw line
        cols["entry_id"] = pa.array([n_uuid[i] for i in r_node], pa.string())
        cols["source_file"] = pa.array([n_path[i] for i in r_node], pa.string())
        cols["source_line"] = pa.array([n_line[i] for i in r_node], pa.int64())
        raw_src = self.text
        raw_idx: list[int] = []
        slow_at: dict[int, int] = {}  # a careful-path entry's raw line: once, whatever its blocks
        for i in r_node:
            s = src[i]
            if s >= 0:
                raw_idx.append(fast_lid[s])
            else:
                raw_idx.append(n_text + slow_at.setdefault(s, len(slow_at)))
        raw = pl.Series("raw", raw_src)
        if slow_at:
            slow_raw = pl.Series("raw", [self.slow_msgs[-s - 1].raw_line for s in slow_at], pl.String)
            for s in slow_at:  # polars holds them now: the Python copies go (a long line's text once less)
                self.slow_msgs[-s - 1].raw_line = ""
            # one chunk: a gather over several copies a long string once per row it lands on (a careful
            # line of N blocks would have had N copies of its text)
            raw = pl.concat([raw, slow_raw], rechunk=True)
            del slow_raw
        # a view per row into the lines' bytes: a line's blocks share them (BLOCKS: raw_line)
        cols["raw_line"] = raw.gather(pl.Series(raw_idx, dtype=pl.Int64)).to_arrow(
            compat_level=pl.CompatLevel.newest())
        self.clock.lap("assemble: raw lines")
        eb = _gather(self._eb_table(), r_eb)
        for c in (*_EB_COLS, "image_bytes", "content_sha256"):
            cols[c] = eb.column(c)
        cols["part_pos"] = pc.fill_null(cols["part_pos"], 0)
        cols["block_type"] = pc.fill_null(cols["block_type"], "empty")
        cols["content_sha256"] = pc.fill_null(cols["content_sha256"], _EMPTY_SHA)
        # block_pos: parts of one tool_result share it; part_pos 0 (or a message's first row) starts a block
        starts = pc.or_(pc.equal(cols["part_pos"], 0), _run_starts(idx_msg))
        cols["block_pos"] = _running_count(starts, idx_msg)
        cols["source_format"] = _const(FORMAT, n, pa.string())
        cols["origin"] = _const("transcript", n, pa.string())
        cols["cache_epoch"] = _const(0, n, pa.int32())
        for c in ("image_width", "image_height"):
            cols[c] = pa.nulls(n, pa.int32())
        for c in ("u_input", "u_output", "u_cache_read", "u_cache_write", "u_total"):
            cols[c] = pa.nulls(n, pa.int64())
        cols["usage_stale"] = pa.nulls(n, pa.bool_())
        for c in ("provenance_kind", "provenance_source_session", "provenance_channel", "provenance_tool"):
            cols[c] = pa.nulls(n, pa.string())
        out = pa.Table.from_arrays([_typed(cols[f.name], f.type) for f in BLOCKS], schema=BLOCKS)
        self.clock.lap("assemble: block columns")
        return out

    def _slow_entry_table(self) -> pa.Table | None:
        if not self.slow_msgs:
            return None
        cols: dict[str, list[Any]] = {c: [] for c in _E_COLS}
        for m in self.slow_msgs:
            u = m.usage or {}
            vals = (m.message_id, m.request_id, m.role, m.timestamp, m.model, m.provider, m.api, m.stop_reason,
                    u.get("input"), u.get("output"), u.get("cache_read"), u.get("cache_write"),
                    u.get("cache_write_5m"), u.get("cache_write_1h"), u.get("miss_reason"), u.get("missed_tokens"),
                    m.is_sidechain, m.is_meta,
                    m.is_compact_summary, m.is_display_only)
            for c, v in zip(_E_COLS, vals, strict=True):
                cols[c].append(v)
        return _strict_table(cols, _E_SCHEMA)

    def _eb_table(self) -> pa.Table:
        if not self.slow_msgs:
            return self.fast_eb
        cols: dict[str, list[Any]] = {c: [] for c in _EB_COLS}
        for m in self.slow_msgs:
            for b in m.blocks:
                cols["part_pos"].append(b.part_pos)
                cols["block_type"].append(b.block_type)
                cols["part_type"].append(b.part_type)
                cols["text"].append(b.text)
                cols["signature"].append(b.signature)
                cols["tool_use_id"].append(b.tool_use_id)
                cols["tool_name"].append(b.tool_name)
                cols["tool_input"].append(b.tool_input)
                cols["is_error"].append(b.is_error)
                cols["image_media_type"].append(b.image_media_type)
                cols["image_data"].append(b.image_data)
                cols["extra_json"].append(json_text(b.extra) if b.extra else None)
        try:
            cols["content_sha256"] = _content_shas_py(cols)
            cols["image_bytes"] = [b64_decoded_len(d) if d is not None else None for d in cols["image_data"]]
        except (TypeError, ValueError, OverflowError) as exc:
            raise NeedsReference(str(exc)) from exc
        slow = _strict_table(cols, _EB_SCHEMA)
        del cols
        for m in self.slow_msgs:  # Arrow holds them now: the Python copies go (a long text once less)
            for b in m.blocks:
                b.text = None
        # left in two chunks: `_gather` copies it into polars once (combining the chunks here copied the
        # fast rows' texts one more time)
        return pa.concat_tables([self.fast_eb, slow])


_USAGE_COLS = ["usage_input", "usage_output", "usage_cache_read", "usage_cache_write", "usage_cache_write_5m",
               "usage_cache_write_1h"]
_DIAG_COLS = ["cache_miss_reason", "cache_missed_tokens"]  # the server's cache diagnosis (claude_code._usage)


def _gather(tbl: pa.Table, idx: list[int | None]) -> pa.Table:
    """`tbl.take(idx)` (a null index gives a null row) with polars: Arrow's take copies long strings
    several times slower (0.7 s against 0.1 s for the 194 MB of raw lines of the 190 MB tree). The
    columns come back as Arrow types polars writes (large strings); `_typed` casts them back."""
    return pl.from_arrow(tbl).select(pl.all().gather(pl.Series(idx, dtype=pl.Int64))).to_arrow()


def _const(v: Any, n: int, typ: pa.DataType) -> pa.Array:
    return pa.repeat(pa.scalar(v, typ), n) if n else pa.array([], typ)


def _typed(a: Any, typ: pa.DataType) -> Any:
    return a if a.type == typ else a.cast(typ)


def _combined(a: Any) -> pa.Array:
    return a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a


def _strict_table(cols: dict[str, list[Any]], schema: pa.Schema) -> pa.Table:
    """Python values as an Arrow table when every value fits its column as it is (what the reference
    loader's first attempt does); otherwise the reference loader would coerce: NeedsReference."""
    try:
        return pa.Table.from_pydict(cols, schema=schema)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        raise NeedsReference(str(exc)) from exc


def _content_shas_py(cols: dict[str, list[Any]]) -> list[str]:
    """`base._content_shas`: sha256 of the canonical JSON of each row's non-null content columns."""
    return [hashlib.sha256(canonical_json({c: v for c, v in zip(CONTENT_COLUMNS, vals) if v is not None})).hexdigest()
            for vals in zip(*(cols[c] for c in CONTENT_COLUMNS))]


def _run_starts(keys: pa.Array) -> pa.Array:
    """True where a row starts a run of equal keys (the rows of one message are contiguous)."""
    n = len(keys)
    if n == 0:
        return pa.array([], pa.bool_())
    prev = pa.concat_arrays([pa.array([-1], pa.int64()), keys.slice(0, n - 1)])
    return pc.not_equal(keys, prev)


def _running_count(starts: pa.Array, keys: pa.Array) -> pa.Array:
    """Per run of equal keys, the running count of `starts` minus one."""
    if len(keys) == 0:
        return pa.array([], pa.int32())
    df = pl.DataFrame({"k": pl.from_arrow(keys), "s": pl.from_arrow(starts)})
    return df.select(pl.col("s").cast(pl.Int32).cum_sum().over("k") - 1).to_series().to_arrow().cast(pa.int32())


def _call_ranges(t: ThreadPlan) -> tuple[list[bool], list[int], list[int | None]]:
    """`base.call_ranges` of a thread plan: assistant messages are calls (local notices excepted); an
    inherited one starts a call of the path but is reported by the thread that claimed it."""
    n = len(t.messages)
    is_call = [m.role == "assistant" and not m.inherited and not m.local for m in t.messages]
    starts = [i for i in range(n) if is_call[i] or t.messages[i].inherited]
    first = [bisect.bisect_right(starts, i) for i in range(n)]
    last: list[int | None] = [None] * n
    for at, keep_from in t.compactions:
        cut = bisect.bisect_right(starts, at)
        for i in range(min(keep_from, n)):
            if last[i] is None or last[i] > cut:  # type: ignore[operator]
                last[i] = cut
    return is_call, first, last


# ---------------------------------------------------------------- entry point


def load_sessions(groups: list[cc.SessionFiles], skipped: list[dict[str, str]] | None = None,
                  timings: dict[str, float] | None = None, *, open_sidechains: bool = False) -> SessionsLoad:
    """Load Claude Code session groups (each: the files of one session) as `claude_code.load_session`
    loads each group in turn, with one columnar parse of all their lines. No data survives the call.

    `timings`: when given, wall-clock seconds per phase are added to it (bench/bench_load.py).
    `open_sidechains`: as for `claude_code.load_session`."""
    b = _Batch(timings)
    b.open_sidechains = open_sidechains
    for gi, g in enumerate(groups):
        for fi, p in enumerate(cc._main_first(g.files, g.session_id)):
            spath = path_str(p)
            try:
                # a line over the limit is quarantined, never read (as in the reference); one too long for
                # the fast path stays out of the batch's line arrays (each a copy of every line) and is
                # read the careful way from its own bytes
                src = read_lines(p, aside=MAX_FAST_LINE)
            except OSError as exc:
                if skipped is not None:
                    skipped.append(unreadable(p, exc))
                b.files.append(_File(gi, fi, p, spath, None))
                continue
            load = FileLoad(spath, FORMAT)
            take_long_lines(load, src)
            b.files.append(_File(gi, fi, p, spath, load, src.data, aside=src.aside))
            del src
    b.clock.lap("read files")
    _parse(b)
    for f in b.files:
        f.data = None
    by_group: dict[int, list[_File]] = defaultdict(list)
    for f in b.files:
        by_group[f.group].append(f)
    threads: list[ThreadPlan] = []
    loads: list[FileLoad] = []
    stats: list[dict[str, int]] = []
    for gi, g in enumerate(groups):
        t, lds, st = _load_group(b, g.session_id, by_group.get(gi, []))
        threads.extend(t)
        loads.extend(lds)
        stats.append(st)
    b.clock.lap("nodes and threads (Python)")
    return SessionsLoad(threads, loads, stats, b)


# ---------------------------------------------------------------- parse (columnar)


def _parse(b: _Batch) -> None:
    clock = b.clock
    readable = [f for f in b.files if f.load is not None]
    if not readable:
        return
    parts = pc.split_pattern(_joined(readable), b"\n")
    offsets = parts.offsets.to_pylist()
    for k, f in enumerate(readable):
        f.start, f.n = offsets[k], offsets[k + 1] - offsets[k]
    lines_bin = parts.flatten()
    text = _decode(lines_bin, readable)
    if len(text) and pc.any(pc.ends_with(text, "\r")).as_py():
        text = pc.utf8_rtrim(text, characters="\r")  # decode_line drops a line's trailing \r
    b.text, b.lines_bin = text, lines_bin
    clock.lap("split lines, UTF-8")
    # candidates: one JSON object per line, not too long; the SQL reader checks the rest, but it also
    # reads trailing commas and NaN / Infinity literals, which orjson refuses: lines that may hold
    # one (anywhere, strings included) take the careful path
    s = pl.Series("t", text)
    cand = (s.str.starts_with("{") & s.str.ends_with("}") & (s.str.len_bytes() <= MAX_FAST_LINE)
            & ~s.str.contains(_TRAILING_COMMA) & ~s.str.contains(_NAN_OR_INF)).fill_null(False)
    # a line with more brackets than MAX_DEPTH may nest deeper than the reference loader reads
    many = s.str.count_matches(r"[\[{]") > MAX_DEPTH  # one pass: half the time of two literal counts
    lid_all = pl.int_range(0, len(s), eager=True, dtype=pl.Int64)
    deep = pl.DataFrame({"lid": lid_all, "t": s}).filter(cand & many)
    if deep.height:
        too_deep = [i for i, t in zip(deep["lid"].to_list(), deep["t"].to_list(), strict=True) if _nests_too_deep(t)]
        if too_deep:
            cand = cand & ~lid_all.is_in(too_deep)
    clock.lap("candidate lines (polars)")
    if not cand.any():
        return
    mask = cand.to_arrow()
    con = _connection()
    try:
        con.register("lines", pa.table({"lid": lid_all.to_arrow(), "t": text, "ok": mask}))
        con.execute("CREATE OR REPLACE TEMP VIEW v AS SELECT lid, t FROM lines WHERE ok")
        for q in (_SQL_PARSE, _SQL_CONTENT, _SQL_ITEMS, _SQL_PARTS, _SQL_SOURCES, _SQL_SOURCES2, _SQL_DUPS, _SQL_EB):
            con.execute(q)
        ent = con.sql(_SQL_ENTRIES).to_arrow_table().combine_chunks()
        ebt = con.sql(_SQL_BLOCKS_OUT).to_arrow_table().combine_chunks()
    except BaseException:
        _drop_connection()
        raise
    else:
        if sum(f.load.bytes for f in readable if f.load is not None) > REUSE_MAX_BYTES:
            _drop_connection()  # closing gives back the memory a big batch made DuckDB hold
        else:
            _release(con)
    clock.lap("entries and blocks (SQL)")
    ok = [bool(x) for x in ent.column("ok").to_pylist()]
    ebt = _complete_blocks(ebt, ent, ok)
    _careful_timestamps(ent, ok)
    clock.lap("canonical JSON of tool inputs and extra keys")
    ent = ent.filter(pa.array(ok, pa.bool_()))
    typ = ent.column("typ")
    is_msg = pc.is_in(typ, value_set=pa.array(sorted(cc.MESSAGE_TYPES)))
    msg_ent = ent.filter(is_msg)
    ebt = ebt.filter(pc.is_in(ebt.column("lid"), value_set=msg_ent.column("lid")))
    counts = msg_ent.column("nb").to_pylist()
    off = [0]
    for c in counts:
        off.append(off[-1] + c)
    if off[-1] != ebt.num_rows:  # pragma: no cover - a bug in the SQL above
        raise AssertionError(f"columnar loader: {ebt.num_rows} block rows where {off[-1]} were expected")
    b.fast_eb_off = off
    b.fast_eb = _fast_block_table(ebt)
    clock.lap("block parts: image sizes, content hashes")
    b.fast_e, utotal = _fast_entry_table(msg_ent)
    b.fast_lid = msg_ent.column("lid").to_pylist()
    f = b.fast
    f.lid = ent.column("lid").to_pylist()
    f.row = {lid: r for r, lid in enumerate(f.lid)}
    f.typ = typ.to_pylist()
    f.uuid = ent.column("uuid").to_pylist()
    f.parent = ent.column("parent").to_pylist()
    f.lparent = ent.column("lparent").to_pylist()
    f.boundary = [bool(x) for x in ent.column("boundary").to_pylist()]
    f.kind = ent.column("kind").to_pylist()
    f.side = [bool(x) for x in ent.column("side").to_pylist()]
    f.msg_id = ent.column("msg_id").to_pylist()
    f.request_id = ent.column("request_id").to_pylist()
    f.agent_id = ent.column("agent_id").to_pylist()
    f.tr = ent.column("tr_ids").to_pylist()
    f.tu = ent.column("tu_ids").to_pylist()
    n = ent.num_rows
    f.erow = [-1] * n
    f.role = [None] * n
    f.stop = [None] * n
    f.utotal = [-1] * n
    roles = msg_ent.column("role").to_pylist()
    stops = msg_ent.column("stop_reason").to_pylist()
    for k, r in enumerate(pc.indices_nonzero(is_msg).to_pylist()):
        f.erow[r] = k
        f.role[r] = roles[k]
        f.stop[r] = stops[k]
        f.utotal[r] = utotal[k]
    clock.lap("entry columns")


# One DuckDB connection per process and thread, with the macros made once: a fresh one per call cost
# about 30 of the ~85 ms CPU of fixed SQL cost of every load (connection, JSON extension, macros),
# which a live engine pays per call. After each call its temp tables are dropped and the input unregistered, so nothing
# of a load is kept; a process forked from this one makes its own.
# A connection that has parsed a big batch keeps part of that memory after its tables are dropped
# (about 40 MB after the 16.5 MB corpus, against a close), so it is closed after a batch of more than
# REUSE_MAX_BYTES of files: the fixed cost matters for small calls, the memory for big ones.
REUSE_MAX_BYTES = 16 << 20
# `load_paths` loads a batch of Claude Code files smaller than this with the reference loader: the
# columnar engine's fixed cost (DuckDB planning ~60-100 ms CPU a call) is more than the reference
# loader spends on a few MB (about 35 ms CPU per MB; the two are even near 10-16 MB under load:
# bench/bench_load.py --tree ../shared/corpus/claude-projects). Both give the same results.
SMALL_BATCH_BYTES = 8 << 20
_LOCAL = threading.local()
_TEMP_TABLES = ("p", "c", "bi", "pt", "src", "src2", "dup_keys", "eb")


def _connection() -> duckdb.DuckDBPyConnection:
    con = getattr(_LOCAL, "con", None)
    if con is not None and getattr(_LOCAL, "pid", None) == os.getpid():
        return con
    con = connect()  # core/duck.py: no extension fetched, no progress bar on stdout, spills to the temp directory
    # give memory back to the system when a load's tables are dropped, as closing the connection did
    con.execute("SET allocator_flush_threshold = '1MiB'; SET allocator_bulk_deallocation_flush_threshold = '1MiB'")
    con.execute(_MACROS)
    _LOCAL.con, _LOCAL.pid = con, os.getpid()
    return con


def _release(con: duckdb.DuckDBPyConnection) -> None:
    """Drop what the call made (its tables hold the batch's parsed lines) and its registered input."""
    try:
        for t in _TEMP_TABLES:
            con.execute(f"DROP TABLE IF EXISTS {t}")
        con.execute("DROP VIEW IF EXISTS v")
        con.unregister("lines")
    except duckdb.Error:  # pragma: no cover - start afresh next time
        _drop_connection()


def _drop_connection() -> None:
    con = getattr(_LOCAL, "con", None)
    _LOCAL.con = None
    if con is not None and getattr(_LOCAL, "pid", None) == os.getpid():
        try:
            con.close()
        except duckdb.Error:  # pragma: no cover
            pass


def _joined(files: list[_File]) -> pa.Array:
    """The files' bytes as one binary array over a single buffer (one copy; building the array from
    the bytes objects grows its buffer step by step, four times slower on the 190 MB tree)."""
    offsets = [0]
    for f in files:
        offsets.append(offsets[-1] + len(f.data or b""))
    buf = pa.py_buffer(b"".join(f.data or b"" for f in files))
    for f in files:
        f.data = None  # the joined buffer holds them now
    off = pa.array(offsets, pa.int64()).buffers()[1]
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(files), [None, off, buf])


def _decode(lines_bin: pa.Array, files: list[_File]) -> pa.Array:
    """Lines as text; a line that is not UTF-8 is null (it takes the careful path)."""
    try:
        return lines_bin.cast(pa.large_string())
    except pa.ArrowInvalid:
        pass
    chunks = []
    for f in files:
        sl = lines_bin.slice(f.start, f.n)
        try:
            chunks.append(sl.cast(pa.large_string()))
        except pa.ArrowInvalid:
            vals: list[str | None] = []
            for raw in sl.to_pylist():
                try:
                    vals.append(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    vals.append(None)
            chunks.append(pa.array(vals, pa.large_string()))
    return pa.concat_arrays(chunks)


def _nests_too_deep(text: str) -> bool:
    try:
        return depth_exceeds(orjson.loads(text))
    except orjson.JSONDecodeError:
        return True  # deeper than orjson reads: the careful path decides


def _complete_blocks(ebt: pa.Table, ent: pa.Table, ok: list[bool]) -> pa.Table:
    """Fill what needs a canonical JSON text (sorted keys, as `json_text` writes it): tool inputs, the
    other keys of a block, whole blocks of unknown types, image sources that are not base64 and
    tool_result parts of other types. A value orjson cannot read or write sends its line to the
    careful path (`ok` is updated)."""
    py = ebt.column("py")
    idx = pc.indices_nonzero(pc.fill_null(pc.is_valid(py), False)).to_pylist()
    n = ebt.num_rows
    tool_input: list[str | None] = [None] * n
    extra: list[str | None] = [None] * n
    text_over: dict[int, str] = {}
    if idx:
        take = pa.array(idx, pa.int64())
        bad_lids: set[int] = set()
        for i, kind, a, bj, lid in zip(idx, py.take(take).to_pylist(), ebt.column("pyj").take(take).to_pylist(),
                                       ebt.column("pyj2").take(take).to_pylist(),
                                       ebt.column("lid").take(take).to_pylist(), strict=True):
            try:
                if kind in ("input", "input+rest"):
                    tool_input[i] = json_text(orjson.loads(a))
                    if kind == "input+rest":
                        extra[i] = _rest_json(bj)
                elif kind == "rest":
                    extra[i] = _rest_json(a)
                elif kind == "whole":
                    extra[i] = json_text(orjson.loads(a))
                elif kind == "source":
                    extra[i] = json_text({"source": orjson.loads(a)})
                elif kind == "part":
                    p = orjson.loads(a)
                    text_over[i] = json_text(p)
                    extra[i] = json_text({"part": p})
            except (orjson.JSONDecodeError, orjson.JSONEncodeError, TypeError, ValueError):
                bad_lids.add(lid)
        if bad_lids:
            for r, lid in enumerate(ent.column("lid").to_pylist()):
                if lid in bad_lids:
                    ok[r] = False
    out = ebt.append_column("tool_input", pa.array(tool_input, pa.string())).append_column(
        "extra_json", pa.array(extra, pa.string()))
    if text_over:
        tl = ebt.column("text").to_pylist()
        for i, v in text_over.items():
            tl[i] = v
        out = out.set_column(out.schema.get_field_index("text"), "text", pa.array(tl, pa.string()))
    return out


def _careful_timestamps(ent: pa.Table, ok: list[bool]) -> None:
    """A timestamp that is not a string is parsed in Python as the reference loader parses it
    (`_fast_entry_table`); one orjson cannot read, a number beyond a double (`1e400`, which the SQL
    reader takes), sends its line the careful way (`ok` is updated), where the reference code reads
    it (issue 23, item 7: it stopped the batch)."""
    ts_json = ent.column("ts_json")
    if ts_json.null_count == len(ts_json):
        return
    for r, j in enumerate(ts_json.to_pylist()):
        if j is not None:
            try:
                orjson.loads(j)
            except orjson.JSONDecodeError:
                ok[r] = False


def _rest_json(block_json: str) -> str:
    d = orjson.loads(block_json)
    return json_text({k: v for k, v in d.items() if k not in KNOWN_BLOCK_KEYS})


def _fast_entry_table(ent: pa.Table) -> tuple[pa.Table, list[int]]:
    """The fast message entries' own columns (E schema), and their usage totals (-1: no usage)."""
    n = ent.num_rows
    is_asst = pc.equal(ent.column("typ"), "assistant")
    ts_ms = ent.column("ts_ms")
    ts_json = ent.column("ts_json")
    if ts_json.null_count < n:  # timestamps in another shape: parsed as the reference loader parses them
        ms = ts_ms.to_pylist()
        for i, j in enumerate(ts_json.to_pylist()):
            if j is not None:
                dt = parse_ts(orjson.loads(j))
                ms[i] = None if dt is None else pa.array([dt], TS).cast(pa.int64())[0].as_py()
        ts_ms = pa.array(ms, pa.int64())
    has_usage = pc.and_(is_asst, ent.column("has_usage"))
    none_i64 = pa.nulls(n, pa.int64())
    cols = {
        "message_id": pc.if_else(is_asst, ent.column("msg_id"), pa.nulls(n, pa.string())),
        "request_id": ent.column("request_id"),
        "role": ent.column("role"),
        "timestamp": ts_ms.cast(TS),
        "model": ent.column("model"),
        "provider": pc.if_else(is_asst, pa.scalar("anthropic"), pa.nulls(n, pa.string())),
        "api": pc.if_else(is_asst, pa.scalar("anthropic-messages"), pa.nulls(n, pa.string())),
        "stop_reason": ent.column("stop_reason"),
        "is_sidechain": pc.fill_null(ent.column("side"), False),
        "is_meta": pc.fill_null(ent.column("meta"), False),
        "is_compact_summary": pc.fill_null(ent.column("csum"), False),
        "is_display_only": pc.fill_null(ent.column("disp"), False),
    }
    for c, k in zip(_USAGE_COLS, ("u_in", "u_out", "u_cr", "u_cw", "u_5m", "u_1h"), strict=True):
        cols[c] = pc.if_else(has_usage, ent.column(k), none_i64)
    # read with the usage, as the reference loader does (no usage object: no diagnosis)
    cols["cache_miss_reason"] = pc.if_else(has_usage, ent.column("d_reason"), pa.nulls(n, pa.string()))
    cols["cache_missed_tokens"] = pc.if_else(has_usage, ent.column("d_missed"), none_i64)
    tbl = pa.Table.from_arrays([_typed(cols[f.name], f.type) for f in _E_SCHEMA], schema=_E_SCHEMA)
    vals = [cols[c].to_pylist() for c in _USAGE_COLS[:4]]
    totals = [sum(v or 0 for v in four) if h else -1
              for h, *four in zip(has_usage.to_pylist(), *vals, strict=True)]
    return tbl, totals


def _fast_block_table(ebt: pa.Table) -> pa.Table:
    """The fast block parts (EB schema), with image sizes and content hashes computed column-wise."""
    data = ebt.column("image_data")
    length = pc.utf8_length(data)
    pad = pc.subtract(length, pc.utf8_length(pc.utf8_rtrim(data, characters="=")))
    decoded = pc.subtract(pc.divide(pc.multiply(length, 3), 4), pad)  # b64_decoded_len
    cols = {c: ebt.column(c) for c in _EB_COLS if c != "part_pos"}
    cols["part_pos"] = ebt.column("pi")
    cols["image_bytes"] = pc.max_element_wise(decoded, pa.scalar(0, pa.int64()), skip_nulls=False)
    cols["content_sha256"] = pa.array(_content_shas_py({c: cols[c].to_pylist() for c in CONTENT_COLUMNS}), pa.string())
    return pa.Table.from_arrays([_typed(cols[f.name], f.type) for f in _EB_SCHEMA], schema=_EB_SCHEMA)


# ---------------------------------------------------------------- per group: nodes


def _load_group(b: _Batch, session_id: str, files: list[_File],
                ) -> tuple[list[ThreadPlan], list[FileLoad], dict[str, int]]:
    """`claude_code.load_session` for one group, over the batch's columns: the per-line loop (fast
    lines from their SQL row, the others through `read_line` and the reference loader's code), then
    the threads."""
    nodes = b.nodes
    fast = b.fast
    stats: Counter[str] = Counter()
    loads: list[FileLoad] = []
    by_uuid: dict[str, int] = {}
    objs: dict[int, Any] = {}  # node -> parsed object (careful nodes, and fast ones once compared)
    per_file: list[list[int]] = []
    agents: list[str | None] = []
    paths = [f.path for f in files]
    earlier_lines: set[bytes] = set()
    fast_row = fast.row
    text, lines_bin = b.text, b.lines_bin

    def obj_of(node: int) -> Any:
        if node not in objs:
            objs[node] = _parse_fast(text[nodes_lid[node]].as_py())
        return objs[node]

    nodes_lid: dict[int, int] = {}
    for f in files:
        fi = f.fi
        file_nodes: list[int] = []
        per_file.append(file_nodes)
        agent: str | None = None
        load = f.load
        if load is None:
            agents.append(None)
            continue
        loads.append(load)
        spath = load.path
        other = load.other_lines
        for j in range(f.n):
            lid = f.start + j
            line_no = j + 1
            r = fast_row.get(lid)
            if r is not None:  # ---- a fast line: one object, its fields from the SQL row
                load.lines += 1
                typ = fast.typ[r]
                is_msg = typ == "user" or typ == "assistant"
                uid = fast.uuid[r]
                if not uid:
                    if is_msg:
                        uid = f"L{fi}:{line_no}.0"
                    else:
                        digest = line_digest(lines_bin[lid].as_py())
                        load.digests[line_no] = digest
                        if digest in earlier_lines:
                            stats["duplicate_entries"] += 1
                            other["duplicate_entry"] += 1
                        else:
                            other[fast.kind[r]] += 1
                        continue
                conflict = ""
                if uid in by_uuid:
                    first = by_uuid[uid]
                    o = _parse_fast(text[lid].as_py())
                    if obj_of(first) == o:
                        stats["duplicate_entries"] += 1
                        other["duplicate_entry"] += 1
                        continue
                    conflict = "~" + hashlib.sha256(json_text(o).encode()).hexdigest()[:8]
                    if uid + conflict in by_uuid:
                        stats["duplicate_entries"] += 1
                        other["duplicate_entry"] += 1
                        continue
                    stats["conflicting_duplicate_entries"] += 1
                    load.recovered.append({"file": spath, "line": line_no, "note": (
                        f"entry uuid {uid!r} was read before ({path_str(paths[nodes.fi[first]])} line "
                        f"{nodes.line[first]}) with other content; kept apart as {uid + conflict!r}")})
                    uid += conflict
                if typ == "assistant":
                    mid = fast.msg_id[r]
                    msg_key: str | None = f"{mid}|{fast.request_id[r]}{conflict}" if mid else uid
                else:
                    msg_key = None
                node = nodes.add(uid, fast.parent[r], fast.lparent[r], typ, fast.boundary[r], fi, line_no, is_msg,
                                 msg_key, fast.side[r], tuple(fast.tr[r] or ()), tuple(fast.tu[r] or ()),
                                 fast.erow[r], spath, fast.role[r], fast.utotal[r], bool(fast.stop[r]))
                nodes_lid[node] = lid
                by_uuid[uid] = node
                file_nodes.append(node)
                if agent is None and fast.agent_id[r]:
                    agent = fast.agent_id[r]
                if is_msg:
                    load.message_lines += 1
                else:
                    other[fast.kind[r]] += 1
                continue
            # ---- the careful path: the reference loader's code for this line
            raw_b = f.aside.pop(line_no, None)  # a line too long for the fast path: its own bytes
            if raw_b is None:
                raw_b = lines_bin[lid].as_py()
            if not _nonblank(raw_b):
                continue
            load.lines += 1
            digest = line_digest(raw_b)
            load.digests[line_no] = digest
            got = read_line(load, line_no, raw_b)
            if got is None:
                continue
            raw, line_objs = got
            kinds: list[str] = []
            for k, o in enumerate(line_objs):
                kind, node = _careful_object(b, obj_of, load, fi, line_no, k, raw, o, digest, earlier_lines,
                                             by_uuid, objs, stats, paths)
                kinds.append(kind)
                if node is not None:
                    file_nodes.append(node)
                    aid = o.get("agentId")
                    if agent is None and isinstance(aid, str) and aid:
                        agent = aid
            load.account(line_no, raw, kinds)
        agents.append(agent)
        earlier_lines.update(load.digests.values())
        load.check()
    return _threads(b, session_id, files, per_file, agents, by_uuid, stats), loads, dict(stats)


def _nonblank(raw: bytes) -> bool:
    """`base.nonblank_lines`' test for one line."""
    if not raw.strip():
        return False
    try:
        return bool(raw.decode("utf-8").strip())
    except UnicodeDecodeError:
        return True


def _parse_fast(text: str) -> Any:
    """The object on a fast line, as the reference loader parsed it."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:  # pragma: no cover - fast lines are what orjson reads
        return parse_json_line(text).objs[0]


def _careful_object(b: _Batch, obj_of: Any, load: FileLoad, fi: int, line_no: int, k: int, raw: str, o: Any,
                    digest: bytes, earlier_lines: set[bytes], by_uuid: dict[str, int], objs: dict[int, Any],
                    stats: Counter[str], paths: list[Path]) -> tuple[str, int | None]:
    """One object of a line read by the careful path: its kind, and its node (the reference loop)."""
    if not isinstance(o, dict):
        return bad("not_an_object", "not an object"), None
    t = o.get("type")
    if not isinstance(t, str) or not t:
        return bad("no_type", "entry has no 'type' field (expected user, assistant, system, progress, ...)"), None
    if t in cc.MESSAGE_TYPES:
        msg = o.get("message")
        if not isinstance(msg, dict):
            return bad("no_message", f"'{t}' entry has no 'message' object"), None
        if t == "assistant" and not isinstance(msg.get("content"), (list, str)):
            return bad("bad_content", "'assistant' entry: message.content is not a list or string"), None
    uid = o.get("uuid")
    if not isinstance(uid, str) or not uid:
        if t in cc.MESSAGE_TYPES:
            uid = f"L{fi}:{line_no}.{k}"
        elif digest in earlier_lines:
            stats["duplicate_entries"] += 1
            return "duplicate_entry", None
        else:
            return cc._kind(o), None
    nodes = b.nodes
    conflict = ""
    if uid in by_uuid:
        first = by_uuid[uid]
        if obj_of(first) == o:
            stats["duplicate_entries"] += 1
            return "duplicate_entry", None
        conflict = "~" + hashlib.sha256(json_text(o).encode()).hexdigest()[:8]
        if uid + conflict in by_uuid:
            stats["duplicate_entries"] += 1
            return "duplicate_entry", None
        stats["conflicting_duplicate_entries"] += 1
        load.recovered.append({"file": load.path, "line": line_no, "note": (
            f"entry uuid {uid!r} was read before ({path_str(paths[nodes.fi[first]])} line {nodes.line[first]}) "
            f"with other content; kept apart as {uid + conflict!r}")})
        uid += conflict
    tr_ids, tu_ids = cc.entry_tool_ids(o)
    node_obj = cc.Node(
        uuid=uid,
        parent=o.get("parentUuid") if isinstance(o.get("parentUuid"), str) else None,
        logical_parent=o.get("logicalParentUuid") if isinstance(o.get("logicalParentUuid"), str) else None,
        type=t,
        subtype=o.get("subtype") if isinstance(o.get("subtype"), str) else None,
        file_idx=fi, line=line_no, raw=raw, obj=o, is_message=t in cc.MESSAGE_TYPES,
        msg_key=(f"{msg.get('id')}|{o.get('requestId')}{conflict}" if t == "assistant" and msg.get("id")
                 else (uid if t == "assistant" else None)),
    )
    src, role, utotal, stop, local = 0, None, -1, False, False
    if node_obj.is_message:
        m = cc._message(node_obj, load.path)
        src = -len(b.slow_msgs) - 1
        b.slow_msgs.append(m)
        role, utotal, stop, local = m.role, cc._usage_total(m.usage), bool(m.stop_reason), m.is_call is False
    node = nodes.add(uid, node_obj.parent, node_obj.logical_parent, t,
                     t == "system" and node_obj.subtype == "compact_boundary", fi, line_no, node_obj.is_message,
                     node_obj.msg_key, bool(o.get("isSidechain")), tr_ids, tu_ids, src, load.path, role, utotal, stop,
                     local)
    by_uuid[uid] = node
    objs[node] = o
    return ("message" if node_obj.is_message else cc._kind(o)), node


# ---------------------------------------------------------------- per group: threads


def _threads(b: _Batch, session_id: str, files: list[_File], per_file: list[list[int]], agents: list[str | None],
             by_uuid: dict[str, int], stats: Counter[str]) -> list[ThreadPlan]:
    """The threads of one group: `claude_code.load_session`'s second half over node indices."""
    nodes = b.nodes
    ntype, msg_key, is_msg, side, uuid = nodes.type, nodes.msg_key, nodes.is_msg, nodes.side, nodes.uuid
    by_key: dict[str, list[int]] = defaultdict(list)
    result_by_tool_id: dict[str, list[int]] = defaultdict(list)
    for fn in per_file:
        for n in fn:
            if ntype[n] == "assistant" and msg_key[n]:
                by_key[msg_key[n]].append(n)  # type: ignore[index]
            for tid in nodes.tr[n]:
                result_by_tool_id[tid].append(n)
    prev_in_file: dict[str, str] = {}
    for fn in per_file:
        for x, y in pairwise(fn):
            prev_in_file[uuid[y]] = uuid[x]
    threads: list[ThreadPlan] = []
    covered: set[int] = set()
    claimed: set[str] = set()
    for fi, f in enumerate(files):
        main_file = cc._is_main_file(f.path, session_id)
        first_thread = True
        tips = [n for n in reversed(per_file[fi]) if is_msg[n]]
        if main_file:
            tips = [n for n in tips if not side[n]] + [n for n in tips if side[n]]
        used: set[str] = set()
        for tip in tips:
            if tip in covered:
                continue
            entries, boundaries = build_thread(nodes, tip, by_uuid, by_key, result_by_tool_id, prev_in_file, stats)
            first_own = next((n for n in entries if is_msg[n] and n not in covered), tip)
            covered.update(entries)
            msgs, compactions = thread_messages(nodes, entries, boundaries)
            answers = [m for m in msgs if m.role == "assistant" and not m.local]
            own = [m for m in answers if m.msg_key not in claimed]
            for m in answers:
                m.inherited = m.msg_key in claimed
            if not own and not first_thread and not (b.open_sidechains and main_file and side[tip]
                                                     and cc.opens_sidechain([m.role for m in msgs if not m.local])):
                stats["branches_without_calls"] += 1
                continue
            claimed.update(m.msg_key for m in own if m.msg_key)
            if main_file:
                base_id = "main"
            elif agents[fi]:
                base_id = f"agent-{agents[fi]}"
            else:
                base_id = cc._agent_thread_id(f.path, [])
            if first_thread:
                tid = base_id
            elif side[tip] and main_file:
                tid = f"sidechain-{uuid[entries[0]][:8]}"
                if tid in used:
                    tid = f"{tid}-branch-{uuid[first_own][:8]}"
            else:
                tid = f"branch-{uuid[first_own][:8]}" if main_file else f"{base_id}-branch-{uuid[first_own][:8]}"
            used.add(tid)
            first_thread = False
            threads.append(ThreadPlan(session_id, tid, FORMAT, path_str(f.path), msgs, compactions))
    stats["off_thread_message_entries"] += sum(1 for fn in per_file for n in fn if is_msg[n] and n not in covered)
    return threads


def build_thread(nodes: _Nodes, tip: int, by_uuid: dict[str, int], by_key: dict[str, list[int]],
                  result_by_tool_id: dict[str, list[int]], prev_in_file: dict[str, str],
                  stats: Counter[str]) -> tuple[list[int], set[int]]:
    """`claude_code.build_thread` over node indices."""
    parent, lparent, boundary, uuid = nodes.parent, nodes.lparent, nodes.boundary, nodes.uuid
    chain: list[int] = []
    seen: set[int] = set()
    boundaries: set[int] = set()
    cur: int | None = tip
    while cur is not None and cur not in seen:
        seen.add(cur)
        chain.append(cur)
        nxt = parent[cur]
        if nxt is None and boundary[cur]:
            boundaries.add(cur)
            nxt = lparent[cur]
            if (nxt is None or nxt not in by_uuid) and uuid[cur] in prev_in_file:
                stats["compact_boundary_parent_from_file_order"] += 1
                nxt = prev_in_file[uuid[cur]]
        if nxt is not None and nxt not in by_uuid:
            stats["parent_not_found"] += 1
            nxt = None
        cur = by_uuid.get(nxt) if nxt else None
    chain.reverse()
    on_chain = set(chain)
    recovered: list[int] = []
    tool_ids: set[str] = set()
    answered: set[str] = set()
    for n in chain:
        answered.update(nodes.tr[n])
    for n in chain:
        key = nodes.msg_key[n]
        if nodes.type[n] == "assistant" and key:
            sibs = by_key.get(key, [])
            for sib in sibs:
                if sib not in on_chain and sib not in seen:
                    seen.add(sib)
                    recovered.append(sib)
            for sib in sibs:
                tool_ids.update(nodes.tu[sib])
    for tid in sorted(tool_ids):
        if tid in answered:
            continue
        for r in result_by_tool_id.get(tid, []):
            if r not in seen:
                seen.add(r)
                recovered.append(r)
                answered.add(tid)
                stats["recovered_parallel_results"] += 1
                break
    fi, line = nodes.fi, nodes.line
    file_rank: dict[int, int] = {}
    for n in chain:
        file_rank.setdefault(fi[n], len(file_rank))
    entries = chain + recovered
    entries.sort(key=lambda n: (file_rank.get(fi[n], len(file_rank)), line[n], uuid[n]))
    return entries, boundaries


def thread_messages(nodes: _Nodes, entries: list[int], boundaries: set[int]) -> tuple[list[MessagePlan], list[tuple[int, int]]]:
    """`claude_code.thread_messages` as plans: split assistant entries of one response make one message."""
    msgs: list[MessagePlan] = []
    group_index: dict[str, int] = {}
    compactions: list[tuple[int, int]] = []
    ntype, is_msg, msg_key, utotal, stop = nodes.type, nodes.is_msg, nodes.msg_key, nodes.utotal, nodes.stop
    for n in entries:
        if n in boundaries:
            k = len(msgs)
            if k > 0:
                compactions.append((k - 1, k))
            continue
        if not is_msg[n]:
            continue
        key = msg_key[n]
        if ntype[n] == "assistant" and key in group_index:
            g = msgs[group_index[key]]  # type: ignore[index]
            g.members.append(n)
            if utotal[n] >= utotal[g.usage_node]:
                g.usage_node = n
            if stop[n]:
                g.stop_node = n
            continue
        if ntype[n] == "assistant" and key:
            group_index[key] = len(msgs)
        msgs.append(MessagePlan([n], n, n, nodes.role[n] or "", key, nodes.line[n], local=nodes.local[n]))
    return msgs, compactions
