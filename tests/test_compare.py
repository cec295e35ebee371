"""tombstone `mode = "cache_edit"` in the cache simulator, `ctxreplay compare` and the `--html` pages.

The sessions are written here (our own words): a Claude Code session reading many long files,
with usage that grows as Claude Code's does (each request reads the previous prefix and writes
the new tail), so that a low tombstone trigger fires several times.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.staging.spec import parse_spec

SID = "c0ffee00-0000-4000-8000-0000000c0de5"
SPEC = """
[pipeline]
name = "clear-{mode}"

[[stage]]
use = "sanitize"

[[stage]]
use = "pairing"

[[stage]]
use = "tombstone"
trigger_tokens = 6000
trigger_idle_seconds = 0
keep_recent = 2
clear_at_least_tokens = 0
min_result_chars = 0
{extra}
"""


@pytest.fixture(autouse=True)
def _price_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXREPLAY_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "price-cache"))


def write_reads(dst: Path, *, sid: str = SID, reads: int = 14, gap_s: int = 20, tool_s: int = 1,
                model: str = "claude-sonnet-4-5") -> Path:
    """A session of `reads` turns (ask, Read, a 2,400-character result `tool_s` seconds later,
    answer), `gap_s` apart."""
    lines: list[dict[str, Any]] = []
    parent: str | None = None
    n = 0
    prompt = 4000     # what Claude Code's system prompt and tools add
    prev_prompt = 0
    t = 0

    def stamp(s: int) -> str:
        return f"2026-06-01T{9 + s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}.000Z"

    def add(kind: str, content: Any, s: int, out: int = 0, stop: str = "tool_use") -> None:
        nonlocal parent, n, prompt, prev_prompt
        n += 1
        uid = f"00000000-0000-4000-8000-{n:012d}"
        msg: dict[str, Any] = {"role": kind, "content": content}
        prompt += len(orjson.dumps(content)) // 3
        if kind == "assistant":
            write = prompt - prev_prompt if prev_prompt else prompt
            msg = {"id": f"msg_rd_{n:03d}", "type": "message", "role": "assistant", "model": model, "content": content,
                   "stop_reason": stop, "usage": {"input_tokens": 3, "output_tokens": out,
                                                  "cache_read_input_tokens": prev_prompt,
                                                  "cache_creation_input_tokens": write,
                                                  "cache_creation": {"ephemeral_5m_input_tokens": write,
                                                                     "ephemeral_1h_input_tokens": 0}}}
            prev_prompt = prompt
        line = {"parentUuid": parent, "isSidechain": False, "type": kind, "uuid": uid, "sessionId": sid,
                "timestamp": stamp(s), "message": msg, "cwd": "/home/dev/rd", "version": "2.1.0"}
        if kind == "assistant":
            line["requestId"] = f"req_rd_{n:03d}"
        lines.append(line)
        parent = uid

    for i in range(reads):
        add("user", [{"type": "text", "text": f"Read part {i} of the manual and tell me what it says."}], t)
        add("assistant", [{"type": "tool_use", "id": f"toolu_rd_{i:03d}", "name": "Read",
                           "input": {"file_path": f"/doc/part{i}.txt"}}], t + 2, out=30)
        body = "\n".join(f"part {i} line {j}: the quick brown fox jumps over the lazy dog {j * i}" for j in range(40))
        add("user", [{"type": "tool_result", "tool_use_id": f"toolu_rd_{i:03d}", "content": body}], t + 2 + tool_s)
        add("assistant", [{"type": "text", "text": f"Part {i} describes step {i} of the setup."}], t + 5 + tool_s,
            out=20, stop="end_turn")
        t += gap_s + tool_s
    path = dst / "-home-dev-rd" / f"{sid}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\n")
    return path


def spec_file(tmp: Path, mode: str | None) -> Path:
    p = tmp / f"clear-{mode or 'default'}.toml"
    p.write_text(SPEC.format(mode=mode or "default", extra=f'mode = "{mode}"' if mode else ""), encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("reads")
    write_reads(d)
    return d


@pytest.fixture(scope="module")
def runs(sessions: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("modes")
    out = {}
    for mode in ("rewrite", "cache_edit"):
        spec = parse_spec(spec_file(tmp, mode).read_text(), source=mode)
        out[mode] = run([sessions], spec, RunOptions(out_dir=tmp / mode))
    return out


# --------------------------------------------------------------------------------------------- cache_edit


def test_cache_edit_sends_the_same_requests_and_says_so_in_its_decisions(runs: dict[str, Any]) -> None:
    rw, ce = runs["rewrite"], runs["cache_edit"]
    key = ["thread_key", "call"]
    a = rw.calls.sort(key).select("call", "request_sha256", "prompt_tokens")
    b = ce.calls.sort(key).select("call", "request_sha256", "prompt_tokens")
    assert a.equals(b)
    drw = rw.decisions.filter(pl.col("stage") == "tombstone")
    dce = ce.decisions.filter(pl.col("stage") == "tombstone")
    assert drw.height > 0 and drw.height == dce.height
    assert set(drw["reason"].to_list()) == {"token"}
    assert set(dce["reason"].to_list()) == {"token:cache_edit"}
    # same blocks, same calls, same epochs: only the reason differs
    cols = ["entry_id", "block_pos", "part_pos", "from_call", "action", "cache_epoch", "after_sha256"]
    assert drw.select(cols).sort(cols).equals(dce.select(cols).sort(cols))


def test_a_rewrite_breaks_the_cached_prefix_and_a_cache_edit_keeps_it(runs: dict[str, Any]) -> None:
    rw = runs["rewrite"].calls.filter(~pl.col("is_pending")).sort("call")
    ce = runs["cache_edit"].calls.filter(~pl.col("is_pending")).sort("call")
    fired = sorted(set(runs["rewrite"].decisions.filter(pl.col("stage") == "tombstone")["from_call"].to_list()))
    assert len(fired) >= 2
    for k in fired:
        r = rw.filter(pl.col("call") == k).row(0, named=True)
        e = ce.filter(pl.col("call") == k).row(0, named=True)
        assert r["sim_break_cause"] == "layer" and "tombstone/tombstone:token@" in r["sim_break_detail"]
        assert e["sim_break_cause"] is None
        # the edit reads the whole previous prefix (less the cleared tokens); the rewrite only up to
        # the first cleared result, and writes the rest again
        assert e["sim_cache_read_tokens"] > r["sim_cache_read_tokens"]
        assert e["sim_cache_write_5m_tokens"] < r["sim_cache_write_5m_tokens"]
        assert e["calibrated_prompt_tokens"] == r["calibrated_prompt_tokens"]
    # calls before the first firing are simulated alike
    before = pl.col("call") < fired[0]
    assert rw.filter(before)["sim_cache_read_tokens"].to_list() == ce.filter(before)["sim_cache_read_tokens"].to_list()
    assert ce["sim_cost_usd"].sum() < rw["sim_cost_usd"].sum()
    assert ce.filter(pl.col("sim_break_cause") == "layer").height == 0


def test_cache_edit_aliases_resolve_to_the_first_cached_version() -> None:
    from ctxreplay.pipeline.cost.cachesim import cache_edit_aliases

    cm = pl.DataFrame({"thread_key": ["t"] * 5, "slot": [0, 1, 1, 1, 2], "first_call": [0, 0, 3, 5, 1],
                       "last_call": [None, 3, 5, None, None], "sha256": ["m0", "a", "a1", "a2", "x"]},
                      schema={"thread_key": pl.String, "slot": pl.Int64, "first_call": pl.Int32, "last_call": pl.Int32,
                              "sha256": pl.String})
    dec = pl.DataFrame({"session_id": ["t"] * 3, "thread_id": ["main"] * 3, "from_call": [3, 5, 5],
                        "action": ["tombstone", "tombstone", "conflict"],
                        "reason": ["token:cache_edit", "token:cache_edit", "token:cache_edit"]})
    # the thread key of (t, main) is "t": compute it as the runner does
    from ctxreplay.pipeline.assembly.replay import thread_key

    cm = cm.with_columns(thread_key=pl.lit(thread_key("t", "main")))
    assert cache_edit_aliases(dec, cm) == {"a1": "a", "a2": "a"}
    # a message that gained blocks at the edit's call (new blocks merged into it) is no edit
    msgs = pl.DataFrame({"sha256": ["m0", "a", "a1", "a2", "x"], "n_blocks": [1, 3, 3, 4, 1]},
                        schema={"sha256": pl.String, "n_blocks": pl.Int32})
    assert cache_edit_aliases(dec, cm, msgs) == {"a1": "a"}
    assert cache_edit_aliases(dec, cm, msgs.with_columns(n_blocks=pl.lit(2, pl.Int32))) == {"a1": "a", "a2": "a"}
    assert cache_edit_aliases(dec.with_columns(reason=pl.lit("token")), cm) == {}
    assert cache_edit_aliases(None, cm) == {}


def test_mode_keeps_the_spec_hash_of_existing_specs_and_is_checked(tmp_path: Path) -> None:
    from ctxreplay.pipeline.staging.spec import SpecError, load_spec

    base = load_spec(spec_file(tmp_path, None))
    rw = load_spec(spec_file(tmp_path, "rewrite"))
    ce = load_spec(spec_file(tmp_path, "cache_edit"))
    base_stage = next(s for s in base.stages if s.stage.name == "tombstone")
    rw_stage = next(s for s in rw.stages if s.stage.name == "tombstone")
    ce_stage = next(s for s in ce.stages if s.stage.name == "tombstone")
    assert base_stage.config_digest == rw_stage.config_digest != ce_stage.config_digest
    assert "mode" not in base_stage.params_dict and ce_stage.params_dict["mode"] == "cache_edit"
    bad = tmp_path / "bad.toml"
    bad.write_text(SPEC.format(mode="x", extra='mode = "sideways"'), encoding="utf-8")
    with pytest.raises(SpecError, match="mode"):
        load_spec(bad)


# --------------------------------------------------------------------------------------------- compare


def _cli(*args: object) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def compared(sessions: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("compare")
    rw, ce = spec_file(tmp, "rewrite"), spec_file(tmp, "cache_edit")
    html = tmp / "compare.html"
    r = _cli("compare", sessions, "--pipeline", "identity", "--pipeline", rw, "--pipeline", ce,
             "--pipeline", "identity@ttl=1h", "--json", "--html", html)
    assert r.exit_code == 0, r.output
    return {"doc": json.loads(r.stdout), "html": html, "rw": str(rw), "ce": str(ce)}


def test_compare_json_per_session_and_total_with_differences(compared: dict[str, Any]) -> None:
    doc = compared["doc"]
    labels = [p["label"] for p in doc["pipelines"]]
    assert labels == ["identity", compared["rw"], compared["ce"], "identity@ttl=1h"]
    assert [p["ttl"] for p in doc["pipelines"]] == ["recorded", "recorded", "recorded", "1h"]
    tot = {r["pipeline"]: r for r in doc["totals"]}
    assert [r["pipeline"] for r in doc["sessions"]] == labels and {r["session_id"] for r in doc["sessions"]} == {SID}
    base = tot["identity"]
    assert base["d_cost_usd"] == 0 and base["cost_change"] == 0 and base["d_breaks"] == 0
    for lb in labels:
        r = tot[lb]
        assert r["d_cost_usd"] == pytest.approx(r["cost_usd"] - base["cost_usd"], abs=1e-6)
        assert r["d_prompt_tokens"] == r["prompt_tokens"] - base["prompt_tokens"]
        est_prompt = r["cache_read_tokens"] + r["cache_write_tokens"] + r["input_tokens"]
        assert r["cache_hit_rate"] == pytest.approx(r["cache_read_tokens"] / est_prompt, abs=1e-6)
        # the anchored estimate and the raw simulation differ by the same amount under every pipeline
        assert r["d_cost_usd"] == pytest.approx(r["d_sim_cost_usd"], abs=1e-6)
        assert r["cost_usd_low"] <= r["cost_usd"] <= r["cost_usd_high"]
        assert r["sim_cost_usd_low"] <= r["sim_cost_usd"] <= r["sim_cost_usd_high"]
    # under identity the estimate is the recorded usage and its interval has no width
    assert base["cost_usd"] == pytest.approx(doc["recorded"]["recorded_cost_usd"], abs=1e-6)
    assert base["cost_usd_low"] == pytest.approx(base["cost_usd_high"], abs=1e-9)
    assert doc["interval"]["coverage"] == 0.9
    rw, ce = tot[compared["rw"]], tot[compared["ce"]]
    # clearing shrinks the prompt either way; by rewrite it breaks the prefix, by cache edit it does not
    assert rw["prompt_tokens"] == ce["prompt_tokens"] < base["prompt_tokens"]
    assert rw["breaks"] > ce["breaks"] == base["breaks"]
    assert ce["cost_usd"] < rw["cost_usd"]
    assert ce["cost_usd"] < base["cost_usd"]
    # 1-hour writes cost twice the input price instead of 1.25 times: same tokens, dearer writes
    h = tot["identity@ttl=1h"]
    assert h["prompt_tokens"] == base["prompt_tokens"] and h["cost_usd"] > base["cost_usd"]
    assert doc["breaks_by_cause"][compared["rw"]].get("layer", 0) == rw["breaks"] - base["breaks"]
    assert doc["recorded"]["recorded_cost_usd"] > 0


def test_compare_table_and_refusals(sessions: Path, tmp_path: Path) -> None:
    r = _cli("compare", sessions, "--pipeline", "identity", "--pipeline", "context-editing")
    assert r.exit_code == 0, r.output
    assert "Total" in r.stdout and "context-editing" in r.stdout and "differences from identity" in r.stdout
    for args, words in (
        (["--pipeline", "nosuch"], "neither a spec file nor a preset"),
        (["--pipeline", "identity@ttl=2h"], "ttl must be one of"),
        (["--pipeline", "identity@speed=9"], "unknown setting"),
        (["--pipeline", "identity", "--pipeline", "identity"], "twice"),
        (["--pipeline", "identity", "--html", tmp_path / "no" / "x.html"], "does not exist"),
        ([], "at least one --pipeline"),
    ):
        r = _cli("compare", sessions, *args)
        assert r.exit_code == 2, (args, r.output)
        assert words in r.stderr and "Traceback" not in r.output


# --------------------------------------------------------------------------------------------- html


def _self_contained(path: Path) -> str:
    import re

    text = path.read_text(encoding="utf-8")
    # nothing is fetched: no script, stylesheet or image from elsewhere; plotly's own code is inline
    assert re.findall(r"<script[^>]*\ssrc=", text) == [] and re.findall(r"<link[^>]*href=", text) == []
    assert len(re.findall(r"<script[^>]*>", text)) >= 2 and "Plotly.newPlot" in text and len(text) > 3_000_000
    assert text.count('class="plotly-graph-div"') >= 2
    return text


def test_html_pages_are_one_self_contained_file(compared: dict[str, Any], sessions: Path, tmp_path: Path) -> None:
    text = _self_contained(compared["html"])
    assert "Cost per session" in text and "identity@ttl=1h" in text and "Breaks by cause" in text
    usage = tmp_path / "usage.html"
    r = _cli("report", sessions, "--html", usage)
    assert r.exit_code == 0, r.output
    assert "Cost by day and model" in _self_contained(usage)
    out = tmp_path / "o"
    assert _cli("run", sessions, "--preset", "identity", "--out", out, "-q").exit_code == 0
    sim = tmp_path / "sim.html"
    r = _cli("report", "--sim", out, "--html", sim)
    assert r.exit_code == 0, r.output
    text = _self_contained(sim)
    assert "recorded vs estimated" in text and "break (sim)" in text and "cache read (estimate)" in text
    r = _cli("report", "--sim", out, "--html", sim, "--raw")
    assert r.exit_code == 0, r.output
    text = _self_contained(sim)
    assert "recorded vs simulated" in text and "cache read (sim)" in text and "recorded vs estimated" not in text
    r = _cli("report", "--breaks", out, "--html", sim)
    assert r.exit_code == 2 and "--html goes with" in r.stderr


def _chromium() -> str | None:
    for name in ("chromium-headless-shell", "chrome-headless-shell", "chromium", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


@pytest.mark.skipif(_chromium() is None, reason="no headless Chromium (apt-get install chromium-headless-shell)")
def test_the_charts_render_in_headless_chromium(compared: dict[str, Any], tmp_path: Path) -> None:
    from PIL import Image

    exe = _chromium()
    assert exe is not None
    url = compared["html"].resolve().as_uri()
    flags = [exe, "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,2200",
             "--virtual-time-budget=10000"]
    env = {**os.environ, "HOME": str(tmp_path)}
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120, env=env,
                         check=True).stdout
    # plotly drew every chart: an SVG per chart, bars, lines and the break markers in the DOM
    charts = dom.count('class="plotly-graph-div')
    assert charts == 3      # side by side, per session, along a session
    assert dom.count('class="main-svg"') >= charts
    assert dom.count('class="trace bars') >= 8 and dom.count('class="trace scatter') >= 4
    assert dom.count('class="point') >= 20
    shot = tmp_path / "shot.png"
    subprocess.run([*flags, f"--screenshot={shot}", url], capture_output=True, timeout=120, env=env, check=True)
    img = Image.open(shot).convert("RGB")
    # the chart area (below the title and the table) holds coloured pixels, not a blank page
    area = img.crop((0, 250, 1280, 2200))
    colours = area.getcolors(maxcolors=1 << 20) or []
    non_white = sum(n for n, (r, g, b) in colours if min(r, g, b) < 235)
    saturated = sum(n for n, (r, g, b) in colours if max(r, g, b) - min(r, g, b) > 60)
    assert non_white > 0.02 * area.width * area.height
    assert saturated > 0.005 * area.width * area.height


# --------------------------------------------------------------------------------------------- auto_compact

AC_SPEC = """
[pipeline]
name = "ac"

[[stage]]
use = "sanitize"

[[stage]]
use = "pairing"

[[stage]]
use = "auto_compact"
threshold_tokens = 6000
summary_tokens = 800
"""


@pytest.mark.parametrize("tool_s", [1, 400])
def test_the_summarisation_request_is_priced_before_its_call(tmp_path: Path, tool_s: int) -> None:
    # the compactions fire at calls after a tool result: `tool_s` after the call before
    write_reads(tmp_path / "in", tool_s=tool_s)
    res = run([tmp_path / "in"], parse_spec(AC_SPEC, source="ac"), RunOptions(out_dir=tmp_path / "o"))
    fired = sorted(res.decisions.filter((pl.col("stage") == "auto_compact") & (pl.col("action") == "insert"))
                   ["from_call"].to_list())
    assert len(fired) == 2
    c = res.calls.sort("call")
    priced = c.filter(pl.col("sim_summary_cost_usd").is_not_null())
    assert priced["call"].to_list() == fired
    for k in fired:
        r = c.filter(pl.col("call") == k).row(0, named=True)
        p = c.filter(pl.col("call") == k - 1).row(0, named=True)
        prev_cached = p["sim_cache_read_tokens"] + p["sim_cache_write_5m_tokens"] + p["sim_cache_write_1h_tokens"]
        hist = r["sim_summary_cache_read_tokens"] + r["sim_summary_cache_write_tokens"] + r["sim_summary_input_tokens"]
        # the history it reads: the request before compacting, more than the previous one and more
        # than the compacted call
        assert hist > prev_cached and hist > r["calibrated_prompt_tokens"]
        assert r["sim_summary_output_tokens"] == 800
        assert (r["timestamp"] - p["timestamp"]).total_seconds() >= tool_s
        if tool_s < 300:   # the previous request's prefix is alive: read, only the new tail written
            assert r["sim_summary_cache_read_tokens"] == prev_cached
        else:              # idle past the 5-minute TTL: nothing left to read, all written
            assert r["sim_summary_cache_read_tokens"] == 0
        assert r["sim_summary_cache_write_tokens"] == hist - r["sim_summary_cache_read_tokens"]
        assert r["sim_summary_cost_usd"] > 0
    assert c.filter(~pl.col("call").is_in(fired))["sim_summary_cost_usd"].null_count() == c.height - len(fired)


def test_compare_counts_the_summarisation_requests_in_the_cost(sessions: Path, tmp_path: Path) -> None:
    spec = tmp_path / "ac.toml"
    spec.write_text(AC_SPEC, encoding="utf-8")
    keep = tmp_path / "runs"
    r = _cli("compare", sessions, "--pipeline", "identity", "--pipeline", spec, "--json", "--keep", keep)
    assert r.exit_code == 0, r.output
    tot = {x["pipeline"]: x for x in json.loads(r.stdout)["totals"]}
    ac = tot[str(spec)]
    calls = pl.read_parquet(next(keep.glob("1-*")) / "calls.parquet").filter(~pl.col("is_pending"))
    assert ac["summary_requests"] == 2 and tot["identity"]["summary_requests"] == 0
    assert ac["summary_cost_usd"] == pytest.approx(calls["sim_summary_cost_usd"].sum(), abs=1e-6)
    assert ac["sim_cost_usd"] == pytest.approx(calls["sim_cost_usd"].sum() + ac["summary_cost_usd"], abs=1e-6)
    assert ac["d_cost_usd"] == pytest.approx(ac["d_sim_cost_usd"], abs=1e-6)    # the estimate has it too
    assert ac["prompt_tokens"] < tot["identity"]["prompt_tokens"]


def test_compare_prices_file_reprices_every_pipeline(sessions: Path, tmp_path: Path) -> None:
    prices = tmp_path / "prices.toml"
    prices.write_text('[models."claude-sonnet-4-5"]\ninput = 30.0\noutput = 150.0\n', encoding="utf-8")

    def total(*extra: object) -> dict[str, Any]:
        r = _cli("compare", sessions, "--pipeline", "identity", "--pipeline", "identity@ttl=1h", "--json", *extra)
        assert r.exit_code == 0, r.output
        return {x["pipeline"]: x["cost_usd"] for x in json.loads(r.stdout)["totals"]}

    base, dear = total(), total("--prices", prices)
    # ten times genai-prices' Sonnet 4.5 rates (3 / 15 USD per million; writes and reads at the input rate)
    assert dear["identity"] > 5 * base["identity"] and dear["identity@ttl=1h"] > 5 * base["identity@ttl=1h"]


# ----------------------------------------------------------------------- the anchored estimate (issue 20, item 3)


SAMPLES = Path(__file__).resolve().parent.parent / "data" / "samples"


@pytest.fixture(scope="module")
def anchored(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from ctxreplay.pipeline.reporting.compare import compare, parse_choice

    return compare([SAMPLES], [parse_choice("identity"), parse_choice("default"), parse_choice("identity@ttl=1h")])


def test_the_identity_estimate_is_the_recorded_usage_on_every_call_with_usage(anchored: Any) -> None:
    from ctxreplay.pipeline.cost.breaks import has_usage
    from ctxreplay.pipeline.cost.calibrate import recorded_write

    c = anchored.calls[0].filter(~pl.col("is_pending") & pl.col("sim_input_tokens").is_not_null())
    used = c.filter(has_usage() & pl.col("recorded_cost_usd").is_not_null())
    assert used.height >= 10
    for est, rec in (("est_cost_usd", pl.col("recorded_cost_usd")),
                     ("est_cache_read_tokens", pl.col("recorded_cache_read_tokens").fill_null(0)),
                     ("est_cache_write_tokens", recorded_write().fill_null(0)),
                     ("est_input_tokens", pl.col("recorded_input_tokens").fill_null(0))):
        bad = used.filter((pl.col(est) - rec).abs() > 1e-9)
        assert bad.height == 0, (est, bad.select("thread_key", "call", est))
    # a call whose answer recorded no usage has no estimate, and is counted
    none = c.filter(~has_usage())
    assert none.height > 0 and none["est_cost_usd"].null_count() == none.height
    tot = anchored.total_table().to_dicts()
    assert {r["no_usage_calls"] for r in tot} == {none.height}


def test_the_estimate_adds_the_simulated_change_to_the_recorded_usage(anchored: Any) -> None:
    base, dflt = anchored.calls[0], anchored.calls[1]
    j = dflt.join(base.select("thread_key", "call", _b="sim_cost_usd"), on=["thread_key", "call"]).filter(
        pl.col("est_cost_usd").is_not_null())
    diff = j.select((pl.col("est_cost_usd") - (pl.col("recorded_cost_usd") + pl.col("sim_cost_usd")
                                               + pl.col("sim_summary_cost_usd").fill_null(0) - pl.col("_b"))).abs().max())
    assert diff.item() < 1e-9


def test_without_identity_compare_runs_it_as_the_anchor(anchored: Any) -> None:
    from ctxreplay.pipeline.reporting.compare import compare, parse_choice

    alone = compare([SAMPLES], [parse_choice("identity@ttl=1h")])
    assert alone.anchor is not None
    one = alone.total_table().to_dicts()[0]
    ref = {r["pipeline"]: r for r in anchored.total_table().to_dicts()}["identity@ttl=1h"]
    for k in ("cost_usd", "cache_read_tokens", "cache_write_tokens", "input_tokens", "sim_cost_usd"):
        assert one[k] == pytest.approx(ref[k], rel=1e-9), k


def test_compare_raw_shows_the_simulation(tmp_path: Path) -> None:
    r = _cli("compare", SAMPLES, "--pipeline", "identity", "--pipeline", "default", "-q")
    assert r.exit_code == 0, r.output
    assert "anchored estimate" in r.stdout and "interval" in r.stdout
    raw = _cli("compare", SAMPLES, "--pipeline", "identity", "--pipeline", "default", "-q", "--raw")
    assert raw.exit_code == 0, raw.output
    assert "raw simulation (--raw)" in raw.stdout
