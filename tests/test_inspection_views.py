"""`why` and `ledger` show what their filters select and say what they count (issue 24,
inspection): a branch's call of shared history names the thread that reports it (and `why`
shows that thread's view), `why --stage` lists only the wire messages of the blocks it shows,
a folded text keeps the marker a layer wrote, `ledger --thread` says its first line counts the
whole ledger, its columns line up, and `--stage` lists the registered stages in the help."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from tests.inspectkit import SAMPLES, SYN_SID, cli, one_error_line, write_session

BRANCH = "7d3f9a2e/branch-c0a1000a"
MAIN_KEY = "7d3f9a2e-1b4c-4e8a-9f60-2c5d8e1a4b37"
BUDGET = """\
[pipeline]
name = "budget"

[[stage]]
use = "sanitize"

[[stage]]
use = "pairing"

[[stage]]
use = "result_budget"
max_result_chars = 600
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The samples under the default preset; the synthetic session under default and under a
    result_budget that truncates its long results."""
    base = tmp_path_factory.mktemp("views")
    src = base / "src"
    write_session(src)
    spec = base / "budget.toml"
    spec.write_text(BUDGET)
    for name, args in (("samples", [SAMPLES]), ("syn", [src]), ("budget", [src, "--pipeline", spec])):
        r = cli("run", *args, "--out", base / name, "-q", "--fast-tokens")
        assert r.exit_code == 0, r.stderr
    return {"samples": base / "samples", "syn": base / "syn", "budget": base / "budget"}


def _why_json(*args: object) -> dict[str, Any]:
    r = cli("why", *args, "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


# ------------------------------------------------------------------------------ shared history


def test_a_branch_call_of_shared_history_names_the_thread_that_reports_it(runs: dict[str, Path]) -> None:
    out = runs["samples"]
    # the ledger lists a decision of the branch from call 1, a call of the history it shares with main
    led = cli("ledger", out, "--thread", BRANCH).stdout
    assert f"thread {BRANCH}  entry c0a10005  block 0.0  from call 1" in led
    r = cli("request", out, BRANCH, "--call", 1)
    assert r.exit_code == 2
    assert f"is history it shares with thread '{MAIN_KEY}', which reports that request " \
           f"(`ctxreplay request {out} {MAIN_KEY} --call 1`)" in one_error_line(r)
    # why accepts the call: the reporting thread's view, named first
    r = cli("why", out, BRANCH, "--call", 1)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines()[0] == (
        f"call 1 of {BRANCH} is history it shares with 7d3f9a2e/main, which reports it: showing 7d3f9a2e/main's "
        f"view of call 1. {BRANCH}'s own calls are 2 and 3 (pending); its decisions on this history apply in them")
    doc = _why_json(out, BRANCH, "--call", 1)
    main_call_1 = pl.read_parquet(out / "calls.parquet").filter(
        (pl.col("thread_key") == MAIN_KEY) & (pl.col("call") == 1))
    assert doc["thread_key"] == MAIN_KEY and doc["call"] == 1
    assert doc["request_sha256"] == main_call_1["request_sha256"][0] and doc["request_sha256_matches"]
    assert doc["shared"] == {"thread_key": f"{MAIN_KEY}--branch-c0a1000a", "thread": BRANCH, "reported_by": MAIN_KEY,
                             "reported_by_thread": "7d3f9a2e/main", "own_calls": [2], "pending_call": 3}
    # the branch's own calls are its own view, as before
    own = _why_json(out, BRANCH, "--call", 2)
    assert own["thread_key"] == f"{MAIN_KEY}--branch-c0a1000a" and "shared" not in own


# ------------------------------------------------------------------------------ why's filters


def _wire_rows(text: str) -> list[int]:
    """The wire messages the terminal view lists after its `wire request` line."""
    lines = text.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("wire request ("))
    return [int(m.group(1)) for x in lines[at + 1:] if (m := re.match(r"^\s{2,}(\d+) ", x))]


def test_why_stage_lists_only_the_wire_messages_of_the_blocks_it_shows(runs: dict[str, Path]) -> None:
    out = runs["syn"]
    doc = _why_json(out, SYN_SID, "--stage", "tombstone")
    held = sorted({j for m in doc["messages"] for j in m["wire"] if isinstance(j, int)})
    assert held and len(held) < doc["n_messages"]
    text = cli("why", out, SYN_SID, "--stage", "tombstone").stdout
    assert _wire_rows(text) == held
    assert f"(showing the {len(held)} wire messages that hold the blocks above; the filter leaves out " \
           f"{doc['n_messages'] - len(held)})" in text
    changed = cli("why", out, SYN_SID, "--changed").stdout
    doc = _why_json(out, SYN_SID, "--changed")
    assert _wire_rows(changed) == sorted({j for m in doc["messages"] for j in m["wire"] if isinstance(j, int)})
    # without a filter: every wire message
    assert _wire_rows(cli("why", out, SYN_SID).stdout) == list(range(doc["n_messages"]))
    # a filter that selects nothing lists no wire message
    none = cli("why", out, SYN_SID, "--stage", "result_budget").stdout
    assert _wire_rows(none) == [] and "(showing none of them: no block above; the filter leaves out" in none


def test_a_folded_text_keeps_the_marker_a_layer_wrote(runs: dict[str, Path]) -> None:
    out = runs["budget"]
    text = cli("why", out, SYN_SID, "--stage", "result_budget").stdout
    blocks = text.split("\n  [")[1:]
    assert len(blocks) == 9
    for b in blocks:
        body = [x.removeprefix("      │ ") for x in b.splitlines() if x.startswith("      │ ")]
        markers = [x for x in body if re.fullmatch(r"…[\d]+ chars truncated…", x)]
        assert len(markers) == 1, b  # folded, and the marker is there
        assert any(x.startswith("… ") and x.endswith("not shown (--full shows them) …") for x in body)
    doc = _why_json(out, SYN_SID, "--stage", "result_budget")
    for m in doc["messages"]:
        for b in m["blocks"]:
            assert b["text"]["folded"] and re.search(r"\n…\d+ chars truncated…\n", b["text"]["text"])
    # --full shows the text as it is, the marker once
    full = _why_json(out, SYN_SID, "--stage", "result_budget", "--full")
    for m in full["messages"]:
        for b in m["blocks"]:
            assert not b["text"]["folded"] and b["text"]["text"].count("chars truncated…") == 1
    # a text no layer changed folds as before (head and tail)
    r = cli("why", runs["syn"], SYN_SID, "--call", 2).stdout
    assert "      │ … 54 lines not shown (--full shows them) …\n" in r


# ------------------------------------------------------------------------------ ledger


def test_ledger_with_a_filter_says_its_first_line_counts_the_whole_ledger(runs: dict[str, Path]) -> None:
    out = runs["samples"]
    whole = cli("ledger", out).stdout.splitlines()[0]
    assert re.fullmatch(rf"{re.escape(str(out / 'ledger.duckdb'))}: 1 run, 8 frozen decisions, 0 violations recorded",
                        whole)
    one = cli("ledger", out, "--thread", BRANCH).stdout.splitlines()
    assert one[0] == f"{whole} (whole ledger); 2 of its frozen decisions match --thread {BRANCH}"
    assert re.fullmatch(rf"run \S+ \(pipeline default, [0-9a-f]{{12}}\), --thread {BRANCH}: 2 decisions applied = "
                        r"2 frozen in the ledger \+ 0 provisional", one[1])
    doc = json.loads(cli("ledger", out, "--thread", BRANCH, "--json").stdout)
    assert (doc["ledger_decisions"], doc["ledger_totals"]["decisions"], doc["decisions"]) == (2, 8, 2)


def test_ledger_columns_line_up_under_their_heads(runs: dict[str, Path]) -> None:
    for args in ([], ["--thread", BRANCH], ["--stage", "pairing"]):
        lines = cli("ledger", runs["syn"] if args[:2] == ["--stage", "pairing"] else runs["samples"], *args).stdout \
            .splitlines()
        head = lines[2]
        assert head.split() == ["stage", "action", "reason", "frozen", "provisional", "total"]
        rows = [x for x in lines[3:] if not x.startswith("  #") and not x.startswith("  ...")
                and not x.startswith("provisional:")]
        assert rows
        for col in ("action", "reason"):
            at = head.index(col)
            for row in rows:
                assert row[at - 2:at] == "  " and row[at] != " ", (args, head, row)
        end = head.index("total") + len("total")
        assert all(len(row) == end for row in rows), (head, rows)


@pytest.mark.parametrize("cmd", ["why", "ledger"])
def test_stage_option_lists_the_registered_stages(cmd: str) -> None:
    from ctxreplay.pipeline.stageapi.registry import load_stages

    help_text = re.sub(r"\s+", " ", cli(cmd, "--help").stdout)
    assert f"--stage [{'|'.join(sorted(load_stages()))}]" in help_text
