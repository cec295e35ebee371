"""`ctxreplay report`: cost and cache hit rate from recorded usage, no replay.

Kept light on purpose: importing this module (and running the command) loads click, orjson and
the standard library only; rich for the table; genai-prices only when its disk cache misses.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import click

from ctxreplay.errors import ArgumentError
from ctxreplay.pipeline.commands.clicommon import (
    CONTEXT,
    console,
    echo,
    follow_links_option,
    json_option,
    max_line_bytes_option,
    no_cache_option,
    paths_or_roots,
)

BY = ("session", "day", "week", "month", "block", "model", "project")
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")


@click.command(context_settings=CONTEXT)
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("--by", "by", type=click.Choice(BY), default="session", show_default=True, help="Group rows by.")
@click.option("--breakdown", is_flag=True, help="Under each row, a row per model (in --json: each row's "
              "`breakdown`).")
@click.option("--start-of-week", type=click.Choice(WEEKDAYS), default="sunday", show_default=True,
              help="With --by week: the day a week starts on (a week's key is that day's date).")
@click.option("--since", help="First day to count (YYYYMMDD or YYYY-MM-DD, in --tz): requests of earlier "
              "days are left out, even of a session that goes on past it (see --since-mode).")
@click.option("--until", help="Last day to count (YYYYMMDD or YYYY-MM-DD, in --tz); as --since.")
@click.option("--since-mode", type=click.Choice(["request", "session"]), default="request", show_default=True,
              help="What --since / --until cut: each request by its day, or whole sessions, kept when their "
                   "last activity's day is in the range (as ccusage's session report).")
@click.option("--tz", help="Time zone of days and months (IANA name, e.g. UTC); default: this machine's.")
@json_option()
@click.option("--strict", is_flag=True, help="Exit 1 when no transcript is found or lines holding usage "
              "could not be read (bad_lines).")
@click.option("--wide", is_flag=True, help="Every column, full session ids and model names, however wide "
              "(default: fit the terminal, $COLUMNS, dropping the least needed columns first).")
@click.option("--prices", "prices_file", type=click.Path(path_type=Path),
              help="TOML file of prices that override or add models (see README, Prices).")
@click.option("--compat", type=click.Choice(["ccusage"]),
              help="Compute as ccusage 20 does where it departs from the provider's rules.")
@click.option("--count-progress-copies", is_flag=True,
              help="Count agent_progress copies of requests whose subagent file is missing.")
@click.option("--workers", type=click.IntRange(min=1), help="Processes for the scan (default: CPU count "
              "for inputs of 48 MB and more, else 1).")
@click.option("--sim", "sim_out", type=click.Path(path_type=Path), metavar="OUT",
              help="Instead of PATHS: the cache and cost of the run in OUT against the recorded usage, per "
                   "session: the anchored estimate (recorded + the simulated change from identity).")
@click.option("--calls", "per_call", is_flag=True, help="With --sim: per call too.")
@click.option("--raw", is_flag=True, help="With --sim: the raw simulation (sim_*) instead of the anchored estimate.")
@click.option("--anchor", "anchor_dir", type=click.Path(path_type=Path), metavar="DIR",
              help="With --sim: the identity run of the same inputs whose simulation anchors the estimates "
                   "(default: OUT itself when its run is identity, else an identity run of its inputs, made now).")
@click.option("--breaks", "breaks_out", type=click.Path(path_type=Path), metavar="OUT",
              help="Instead of PATHS: every cache break of the run in OUT, its cause, tokens and cost.")
@click.option("--html", "html_file", type=click.Path(path_type=Path), metavar="FILE",
              help="Also write a self-contained HTML page of charts (no network needed to view it); "
                   "with --sim OUT: recorded vs simulated, the cache along each session, the breaks.")
@follow_links_option()
@no_cache_option()
def report(paths: tuple[Path, ...], by: str, breakdown: bool, start_of_week: str, since: str | None,
           until: str | None, since_mode: str, tz: str | None, json_: bool, strict: bool, wide: bool,
           prices_file: Path | None, compat: str | None, count_progress_copies: bool, workers: int | None,
           sim_out: Path | None, per_call: bool, raw: bool, anchor_dir: Path | None, breaks_out: Path | None,
           html_file: Path | None) -> None:
    """Cost, tokens and cache hit rate from the usage transcripts record (no replay).

    PATHS are files or directories (searched recursively). Without PATHS: $CLAUDE_CONFIG_DIR/projects
    (else ~/.claude/projects and ~/.config/claude/projects), ~/.openclaw/agents,
    $CODEX_HOME/sessions (else ~/.codex/sessions) and the chats folders of ~/.gemini/tmp/*
    ($GEMINI_CLI_HOME/.gemini/tmp/* when set), where they exist (the Claude Code ones are what
    ccusage reads; `ctxreplay run` reads the same). One copy of each request is kept (Claude Code repeats usage on every
    line of a response), priced with genai-prices (version in the output) and --prices; a
    model without a price is listed under unpriced_models and warned about, never counted as 0.

    --sim OUT and --breaks OUT read the outputs of a `ctxreplay run --out OUT` instead: the
    prompt-cache simulation of its requests against the recorded usage, and the cache breaks
    (recorded and simulated) with their causes. --sim leads with the anchored estimate, the
    recorded usage plus what the simulator changes from the sessions as recorded (its anchor:
    see --anchor); --raw shows the raw simulation.

    \b
    Example:
      ctxreplay report ~/.claude/projects --by day --since 20260201 --tz UTC
      ctxreplay report --breaks ctxreplay-out
      ctxreplay report --sim ctxreplay-out --html report.html
    """
    if sim_out is not None or breaks_out is not None:
        if html_file is not None and sim_out is None:
            raise ArgumentError("--html goes with PATHS (recorded usage) or --sim OUT (a run's simulation), not --breaks: "
                          "the page of --sim OUT shows the breaks")
        _run_views(paths, sim_out, per_call, breaks_out, json_, html_file, raw, anchor_dir)
        return
    if per_call:
        raise ArgumentError("--calls goes with --sim OUT (per-call recorded vs simulated cache of a run)")
    if raw or anchor_dir is not None:
        raise ArgumentError(f"{'--raw' if raw else '--anchor'} goes with --sim OUT (the estimates of a run's "
                            f"simulation)")
    import orjson

    from ctxreplay.pipeline.cost.prices import PriceBook
    from ctxreplay.pipeline.reporting.report import ReportOptions, build_report, parse_day

    chosen = paths_or_roots(paths, "ctxreplay report data/samples")
    opts = ReportOptions(by=by, since=parse_day(since, "--since"), until=parse_day(until, "--until"),  # type: ignore[arg-type]
                         tz=tz, compat=compat, count_progress_copies=count_progress_copies,  # type: ignore[arg-type]
                         workers=workers, breakdown=breakdown, start_of_week=start_of_week,
                         since_mode=since_mode)  # type: ignore[arg-type]
    book = PriceBook.load(prices_file)
    rep = build_report(chosen, book, opts)
    doc = rep.to_json()
    if html_file is not None:
        _usage_html(rep, doc, book, opts, chosen, html_file)
    if json_:
        click.echo(orjson.dumps(doc).decode())
    elif doc["files"]:
        _table(doc, wide=wide)
    if not doc["files"]:
        echo(f"ctxreplay report: no transcripts found under {', '.join(str(p) for p in chosen)}", err=True)
    _warnings(doc)
    if strict and (not doc["files"] or doc["bad_lines"]):
        if doc["files"]:
            echo(f"--strict: {len(doc['bad_lines'])} line(s) holding usage could not be read", err=True)
        sys.exit(1)


def _usage_html(rep: Any, doc: dict[str, Any], book: Any, opts: Any, chosen: list[Path], html_file: Path) -> None:
    """The page of `report PATHS --html`: per session (another grouping when --by is not session) and
    by day and model, from the report's requests."""
    import dataclasses

    import polars as pl

    from ctxreplay.pipeline.reporting import report as rp
    from ctxreplay.pipeline.reporting.html_report import usage_html, write_html

    sessions = doc["rows"] if rep.by == "session" else rp.build_report(
        chosen, book, dataclasses.replace(opts, by="session", breakdown=False)).rows
    fields = {"day": rp.DAY, "model": rp.MODEL, "cost": rp.COST, "input": rp.IN, "cw5": rp.CW5, "cw1": rp.CW1,
              "cr": rp.CR}
    cols = list(zip(*rep.records, strict=True)) if rep.records else [()] * (rp.COST + 1)
    schema = {"day": pl.String, "model": pl.String, "cost": pl.Float64, "input": pl.Int64, "cw5": pl.Int64,
              "cw1": pl.Int64, "cr": pl.Int64}
    requests = pl.DataFrame({k: list(cols[i]) for k, i in fields.items()}, schema=schema)
    write_html(html_file, usage_html(doc, sessions, requests, week_start=opts.start_of_week))
    echo(f"ctxreplay report: wrote {html_file}", err=True)


def _warnings(doc: dict[str, Any]) -> None:
    unpriced = doc["totals"]["unpriced_models"]
    if unpriced:
        echo(f"ctxreplay report: no price for {', '.join(unpriced)}: their requests are left out of "
             f"cost_usd (listed under unpriced_models); add them with --prices FILE", err=True)
    po = doc["progress_only"]
    if po["requests"] and not po["counted"]:
        ss = po["sessions"]
        where = f"session {', '.join(ss)}" if len(ss) <= 3 else \
            f"sessions {', '.join(ss[:3])} and {len(ss) - 3} more (progress_only in --json)"
        echo(f"ctxreplay report: {po['requests']} request(s) recorded only as agent_progress copies "
             f"(subagent file missing; {where}) are not counted: "
             f"{po['cost_usd']:.4f} USD; --count-progress-copies counts them", err=True)
    if doc["bad_lines"]:
        first = doc["bad_lines"][0]
        echo(f"ctxreplay report: {len(doc['bad_lines'])} line(s) holding usage could not be read and are "
             f"left out (listed under bad_lines in --json), first: {first['file']}:{first['line']}: "
             f"{first['reason']}", err=True)
    for w in doc["warnings"]:
        echo(f"ctxreplay report: {w}", err=True)


def _fmt_int(n: int | None) -> str:
    return "–" if n is None else f"{n:,}"


_DATE_SUFFIX = re.compile(r"-\d{8}$")


def _short_model(m: str) -> str:
    """claude-opus-4-5-20251101 → opus-4-5 (as ccusage shows models)."""
    return _DATE_SUFFIX.sub("", m.removeprefix("claude-"))


# the session table's layouts, widest first: the first whose natural width fits the terminal is printed
# (--wide: the first). Each narrows one more thing, in this order: short session ids and model names,
# the two cache-write columns as one, the last activity's day only, then no last activity, no models,
# no hit rate, no input.
_LAYOUTS = [
    {},
    {"short": True},
    {"short": True, "writes": True},
    {"short": True, "writes": True, "day_only": True},
    {"short": True, "writes": True, "no_last": True},
    {"short": True, "writes": True, "no_last": True, "no_models": True},
    {"short": True, "writes": True, "no_last": True, "no_models": True, "no_hit": True},
    {"short": True, "writes": True, "no_last": True, "no_models": True, "no_hit": True, "no_input": True},
]
_FOLD_MIN = 12   # narrowest a folded text column (models, project keys) is made


def term_width() -> int:
    """Columns to fit: $COLUMNS when set, else the terminal's, else 200 (output to a pipe or a file)."""
    import os
    import shutil

    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return shutil.get_terminal_size((200, 24)).columns if sys.stdout.isatty() else 200


def _columns(doc: dict[str, Any], lay: dict[str, bool]) -> list[tuple[str, str, Any, str]]:
    """(header, footer, cell of a row, kind) per column; kind: "key", "text" (no wrap), "fold", "num"."""
    by = doc["by"]
    t = doc["totals"]
    short = lay.get("short", False)

    models_col = by != "model" and not lay.get("no_models")

    def sub(r: dict[str, Any]) -> str:
        return "└ " + (_short_model(r["_model_of"]) if short else r["_model_of"])

    def key(r: dict[str, Any]) -> str:
        if r.get("_model_of"):
            return "" if models_col else "  " + sub(r)
        k = r["key"]
        return k[:8] if short and by == "session" and _is_uuid(k) else k

    cols: list[tuple[str, str, Any, str]] = [
        (by.capitalize(), "Total", key, "fold" if short and by == "project" else "key")]
    if by == "session" and not lay.get("no_last"):
        n = 10 if lay.get("day_only") else 16
        cols.append(("Last activity" if n == 16 else "Last day", "",
                     lambda r: "" if r.get("_model_of") else (r["last_activity"] or "")[:n].replace("T", " "), "text"))
    if models_col:
        names = (lambda ms: ", ".join(_short_model(m) for m in ms)) if short else (lambda ms: ", ".join(ms))
        cols.append(("Models", str(len(t["models"])), lambda r: sub(r) if r.get("_model_of") else names(r["models"]),
                     "fold"))
    nums = [("Input", "input_tokens")] if not lay.get("no_input") else []
    nums.append(("Output", "output_tokens"))
    for label, k in nums:
        cols.append((label, _fmt_int(t[k]), lambda r, k=k: _fmt_int(r[k]), "num"))
    if lay.get("writes"):
        def cw(r: dict[str, Any]) -> str:
            return _fmt_int(r["cache_write_5m_tokens"] + r["cache_write_1h_tokens"])
        cols.append(("Cache write", cw(t), cw, "num"))
    else:
        for label, k in (("Cache write 5m", "cache_write_5m_tokens"), ("Cache write 1h", "cache_write_1h_tokens")):
            cols.append((label, _fmt_int(t[k]), lambda r, k=k: _fmt_int(r[k]), "num"))
    cols.append(("Cache read", _fmt_int(t["cache_read_tokens"]), lambda r: _fmt_int(r["cache_read_tokens"]), "num"))
    if not lay.get("no_hit"):
        cols.append(("Hit rate", _rate(t["cache_hit_rate"]), lambda r: _rate(r["cache_hit_rate"]), "num"))
    cols.append(("Cost (USD)", _cost(t), _cost, "num"))
    return cols


def _is_uuid(k: str) -> bool:
    return len(k) == 36 and k.count("-") == 4


def _display_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows, each followed by its per-model rows when the report has them (--breakdown)."""
    out = []
    for r in doc["rows"]:
        out.append(r)
        for m in r.get("breakdown") or []:
            out.append({**m, "_model_of": m["model"]})
    return out


def _natural_width(cols: list[tuple[str, str, Any, str]], rows: list[dict[str, Any]], *, full: bool = False) -> int:
    """Columns the table needs; folded text columns counted at their narrowest unless `full`."""
    from rich.cells import cell_len

    total = 1
    for header, footer, cell, kind in cols:
        w = max([cell_len(header), cell_len(footer), *(cell_len(cell(r)) for r in rows)])
        total += (min(w, _FOLD_MIN) if kind == "fold" and not full else w) + 3
    return total


def _table(doc: dict[str, Any], *, wide: bool = False, width: int | None = None) -> None:
    from rich.table import Table

    by = doc["by"]
    t = doc["totals"]
    echo(f"ctxreplay report: {len(doc['rows'])} {by} row(s), {t['requests']:,} requests from {doc['files']} "
         f"file(s); prices: {doc['prices']}" + (f"; compat {doc['compat']}" if doc["compat"] else ""))
    width = width or term_width()
    rows = _display_rows(doc)
    chosen = 0
    if not wide:
        for i, lay in enumerate(_LAYOUTS):
            chosen = i
            if _natural_width(_columns(doc, lay), rows) <= width:
                break
    cols = _columns(doc, _LAYOUTS[chosen])
    if wide:
        width = max(width, _natural_width(cols, rows, full=True))
    table = Table(show_footer=True)
    for header, footer, _, kind in cols:
        table.add_column(header, footer=footer, justify="right" if kind == "num" else "left",
                         no_wrap=kind != "fold", overflow="fold" if kind == "fold" else "ellipsis",
                         min_width=_FOLD_MIN if kind == "fold" else None)
    for r in rows:
        table.add_row(*[cell(r) for _, _, cell, _ in cols])
    _console(width).print(table)
    if chosen:
        echo(f"ctxreplay report: narrowed to fit {width} columns; --wide shows every column", err=True)


def _rate(v: float | None) -> str:
    return "–" if v is None else f"{v:.1%}"


def _cost(r: dict[str, Any]) -> str:
    if r["unpriced_models"] and r["unpriced_models"] == r["models"]:
        return "unpriced"
    s = f"{r['cost_usd']:,.4f}"
    return s + " + unpriced" if r["unpriced_models"] else s


# ---------------------------------------------------------------------------------------------
# views of a run: --sim OUT, --breaks OUT


def _run_views(paths: tuple[Path, ...], sim_out: Path | None, per_call: bool, breaks_out: Path | None,
               json_: bool, html_file: Path | None = None, raw: bool = False, anchor_dir: Path | None = None) -> None:
    import orjson

    if paths:
        raise ArgumentError("--sim / --breaks read a run's outputs (OUT), not transcripts: drop the PATHS, or run "
                      "`ctxreplay report PATHS` on its own")
    if sim_out is not None and breaks_out is not None:
        raise ArgumentError("give one of --sim OUT and --breaks OUT")
    if per_call and sim_out is None:
        raise ArgumentError("--calls goes with --sim OUT")
    if (raw or anchor_dir is not None) and sim_out is None:
        raise ArgumentError(f"{'--raw' if raw else '--anchor'} goes with --sim OUT")
    if raw and anchor_dir is not None:
        raise ArgumentError("--raw shows the raw simulation, which needs no anchor: give one of --raw and --anchor")
    from ctxreplay.pipeline.cost.breaks import breaks_view, load_run

    out = sim_out if sim_out is not None else breaks_out
    assert out is not None
    calls, summary, run = load_run(out)
    if sim_out is not None:
        calls, doc = _sim_doc(out, Path(run), calls, summary, per_call, raw, anchor_dir, quiet=json_)
        if html_file is not None:
            from ctxreplay.pipeline.reporting.html_report import sim_html, write_html

            whole = doc if not per_call else {k: v for k, v in doc.items() if k != "calls"}
            write_html(html_file, sim_html(calls, whole, str(out)))
            echo(f"ctxreplay report: wrote {html_file}", err=True)
        if json_:
            click.echo(orjson.dumps(doc).decode())
        else:
            _sim_table(doc, str(out))
        if doc["anchor"]["source"] == "none" and not raw:
            echo(f"ctxreplay report: {doc['anchor']['note']}: the raw simulation is shown", err=True)
        if doc["unpriced_models"]:
            echo(f"ctxreplay report: no price for {', '.join(doc['unpriced_models'])}: their calls are left out "
                 f"of the costs", err=True)
    else:
        doc = breaks_view(calls, summary)
        if json_:
            click.echo(orjson.dumps(doc).decode())
        else:
            _breaks_table(doc, str(out))


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:+.1%}"


def _usd(v: float | None) -> str:
    return "–" if v is None else f"{v:,.4f}"


def _console(width: int | None = None) -> Any:
    import shutil

    if width is None:
        width = shutil.get_terminal_size((200, 24)).columns if sys.stdout.isatty() else 200
    return console(width=width, soft_wrap=False)


_EST_KEYS = ("est_calls", "est_read", "est_write", "est_input", "est_cost", "est_read_diff", "est_write_diff",
             "est_cost_diff", "est_cost_low", "est_cost_high", "sim_cost_low", "sim_cost_high", "q")
_EST_CALL_KEYS = ("est_cache_read_tokens", "est_cache_write_tokens", "est_input_tokens", "est_cost_usd")


def _sim_doc(out: Path, run: Path, calls: Any, summary: dict[str, Any], per_call: bool, raw: bool,
             anchor_dir: Path | None, *, quiet: bool) -> tuple[Any, dict[str, Any]]:
    """`report --sim`'s document: sim_view's recorded vs raw simulation, and unless --raw the
    anchored estimate beside it (pipeline/cost/estimate.py; its anchor from
    pipeline/reporting/anchor.py), per session, in total and per call. Returns the calls (with the
    estimate's columns when there is one) and the document."""
    from ctxreplay.pipeline.cost.breaks import sim_view

    doc = sim_view(calls, summary, per_call=per_call)
    if raw:
        doc.update(figures="raw", anchor={"source": "none", "note": "--raw: the raw simulation"})
        return calls, doc
    from ctxreplay.pipeline.cost.estimate import estimate_figures, with_estimate
    from ctxreplay.pipeline.cost.intervals import COVERAGE, DEFAULT_Q
    from ctxreplay.pipeline.reporting.anchor import resolve

    say = None if quiet or not sys.stderr.isatty() else (lambda m: echo(f"… {m}", err=True))
    a = resolve(out, run, calls, summary, anchor_dir, say)
    doc["anchor"] = {"source": a.source, "note": a.note}
    if a.calls is None:
        doc["figures"] = "raw"
        return calls, doc
    est = with_estimate(calls, a.calls)
    rows, total, q = estimate_figures(est)
    by = {r["session_id"]: r for r in rows}
    for r in doc["sessions"]:
        got = by.get(r["session_id"], {})
        r.update({k: got.get(k) for k in _EST_KEYS})
    doc["totals"].update({k: total.get(k) for k in _EST_KEYS if k != "q"})
    doc["interval"] = {"coverage": COVERAGE, "default_q": DEFAULT_Q,
                       "sessions_with_own_q": sum(v != DEFAULT_Q for v in q.values()),
                       "q": {k: round(v, 6) for k, v in sorted(q.items())}}
    if per_call:
        per = {(r[0], r[1]): r[2:] for r in est.select("thread_key", "call", *_EST_CALL_KEYS).iter_rows()}
        for r in doc["calls"]:
            vals = per.get((r["thread_key"], r["call"]), (None,) * len(_EST_CALL_KEYS))
            r.update({k: (round(v, 6) if isinstance(v, float) else v) for k, v in zip(_EST_CALL_KEYS, vals, strict=True)})
    doc["figures"] = "estimate"
    return est, doc


def _sim_table(doc: dict[str, Any], out: str) -> None:
    from rich.table import Table

    t = doc["totals"]
    est = doc.get("figures") == "estimate"
    echo(f"ctxreplay report --sim {out}: {len(doc['sessions'])} session(s), {t.get('calls', 0):,} calls; "
         f"pipeline {doc['pipeline']}; prices: {doc['prices']}")
    if est:
        echo(f"figures: the anchored estimate: recorded usage + the simulated change from identity (anchor: "
             f"{doc['anchor']['note']}; --raw: the raw simulation); costs with their "
             f"{doc['interval']['coverage']:.0%} interval")
    else:
        why = "--raw" if doc["anchor"]["note"].startswith("--raw") else doc["anchor"]["note"]
        echo(f"figures: the raw simulation ({why})")
    if t.get("no_usage"):
        echo(f"{t['no_usage']:,} call(s) recorded no usage: left out of the comparison (no_usage)")
    if est and (t.get("est_calls") or 0) < (t.get("calls") or 0):
        echo(f"{t['calls'] - (t.get('est_calls') or 0):,} call(s) have no estimate: the anchor does not hold them")
    table = Table(show_footer=True)
    table.add_column("Session", footer="Total", no_wrap=True)
    table.add_column("Calls", justify="right", footer=f"{t.get('calls', 0):,}")
    p = "est" if est else "sim"
    specs = [("Cache read rec", "rec_read", _fmt_int), (p, f"{p}_read", _fmt_int),
             ("Δ", "est_read_diff" if est else "read_diff", _pct),
             ("Cache write rec", "rec_write", _fmt_int), (p, f"{p}_write", _fmt_int),
             ("Δ", "est_write_diff" if est else "write_diff", _pct),
             ("Cost rec", "rec_cost", _usd), (p, f"{p}_cost", _usd)]
    cov = f"{doc['interval']['coverage']:.0%} interval" if est else ""

    def span(r: dict[str, Any]) -> str:
        lo, hi = r.get("est_cost_low"), r.get("est_cost_high")
        return "–" if lo is None or hi is None else f"{_usd(lo)}–{_usd(hi)}"

    for label, k, f in specs:
        table.add_column(label, justify="right", footer=f(t.get(k)) if t.get(k) is not None else "–")
    if est:
        table.add_column(cov, justify="right", footer=span(t))
    table.add_column("Δ", justify="right", footer=_pct(t.get("est_cost_diff" if est else "cost_diff")))
    if not est:
        table.add_column("Agree", justify="right", footer=_rate(t.get("agreement")))
    table.add_column("Breaks rec/sim", justify="right",
                     footer=f"{t.get('rec_breaks', 0)}/{t.get('sim_breaks', 0)}")
    for r in doc["sessions"]:
        cells = [f(r[k]) if r.get(k) is not None else "–" for _, k, f in specs]
        cells += [span(r)] if est else []
        cells += [_pct(r.get("est_cost_diff" if est else "cost_diff"))]
        cells += [] if est else [_rate(r["agreement"])]
        table.add_row(r["session_id"], f"{r['calls']:,}", *cells, f"{r['rec_breaks']}/{r['sim_breaks']}")
    _console().print(table)
    if est:
        iv = doc["interval"]
        echo(f"intervals ({iv['coverage']:.0%}): each simulated change ± q, q the simulator's error on the other "
             f"sessions where 9 or more had usage ({iv['sessions_with_own_q']} session(s)), else "
             f"{iv['default_q']:.0%} (its error on real sessions, measured leave-one-session-out)")
    cal = doc.get("calibration") or {}
    for fam, d in (cal.get("families") or {}).items():
        echo(f"calibration {fam}: ratio {d.get('ratio_family')} over {d.get('threads')} thread(s) "
             f"(per thread {d.get('thread_ratio_min')} - {d.get('thread_ratio_max')}, median "
             f"{d.get('thread_ratio_median')}); calibrated prompt within {d.get('fit_mape', 0):.1%} of the recorded "
             f"one at the median call, {d.get('fit_p90_ape', 0):.1%} at p90")
    pre = cal.get("preamble_tokens") or {}
    if pre:
        echo(f"preamble (system, tools, injected; per thread and compaction segment): median "
             f"{pre['median']:,.0f} tokens, {pre['min']:,.0f} - {pre['max']:,.0f}")
    if "calls" in doc:
        _sim_calls_table(doc, est)


def _sim_calls_table(doc: dict[str, Any], est: bool) -> None:
    from rich.table import Table

    table = Table()
    labels = (("Thread", "Call", "Time", "Prompt", "Read rec", "est", "Write rec", "est", "Cost rec", "est",
               "Break rec / sim") if est else
              ("Thread", "Call", "Time", "Prompt", "Read rec", "sim", "Write rec", "sim", "Class rec/sim",
               "Break rec / sim"))
    for label in labels:
        table.add_column(label, justify="left" if label in ("Thread", "Time", "Class rec/sim", "Break rec / sim")
                         else "right", no_wrap=label == "Thread")
    for r in doc["calls"]:
        brk = " / ".join(x or "–" for x in (r["recorded_break_cause"], r["sim_break_cause"]))
        head = [r["thread_key"], str(r["call"]), r["timestamp"] or "", _fmt_int(r["calibrated_prompt_tokens"])]
        if est:
            mid = [_fmt_int(r["recorded_cache_read_tokens"]), _fmt_int(r["est_cache_read_tokens"]),
                   _fmt_int(r["recorded_cache_write_tokens"]), _fmt_int(r["est_cache_write_tokens"]),
                   _usd(r["recorded_cost_usd"]), _usd(r["est_cost_usd"])]
        else:
            mid = [_fmt_int(r["recorded_cache_read_tokens"]), _fmt_int(r["sim_cache_read_tokens"]),
                   _fmt_int(r["recorded_cache_write_tokens"]), _fmt_int(r["sim_cache_write_tokens"]),
                   f"{r['rec_class']}/{r['sim_class']}"]
        table.add_row(*head, *mid, brk if brk != "– / –" else "")
    _console().print(table)


def _breaks_table(doc: dict[str, Any], out: str) -> None:
    from rich.table import Table

    rows = doc["breaks"]
    echo(f"ctxreplay report --breaks {out}: {sum(r['source'] == 'recorded' for r in rows)} recorded and "
         f"{sum(r['source'] == 'sim' for r in rows)} simulated cache break(s); pipeline {doc['pipeline']}")
    table = Table()
    for label in ("Source", "Thread", "Call", "Time", "Cause", "Server", "Detail", "Re-written", "Cost (USD)"):
        table.add_column(label, justify="right" if label in ("Call", "Re-written", "Cost (USD)") else "left",
                         no_wrap=label in ("Thread", "Time"), overflow="fold")
    for r in rows:
        # the server's own diagnosis (Claude Code 2.1.140+) beside our cause; the detail says what we inferred
        server = r.get("server_reason") or ""
        if server and r.get("server_missed_tokens") is not None:
            server += f" ({r['server_missed_tokens']:,} missed)"
        detail = "; ".join(p for p in (r["detail"] or "").split("; ") if p and not p.startswith("server: "))
        table.add_row(r["source"], r["thread_key"], str(r["call"]), r["timestamp"] or "", r["cause"], server,
                      detail, _fmt_int(r["tokens"]), _usd(r["cost_usd"]))
    _console().print(table)
    for src in ("recorded", "sim"):
        d = doc["by_cause"][src]
        parts = [f"{c} {v['breaks']}" for c, v in d.items() if isinstance(v, dict)]
        echo(f"{src}: {d['total']} break(s){': ' + ', '.join(parts) if parts else ''}; "
             f"unexplained {d['unexplained_share']:.0%}")
    dg = doc.get("diagnosis") or {}
    if dg.get("breaks"):
        echo(f"server diagnosis on {dg['breaks']} recorded break(s), the cause taken from it; our inference alone "
             f"puts {dg['agree']} in the same family")
    table = Table(title="Share of cost caused by breaks")
    for label in ("Session", "Breaks rec", "Cost rec", "Break cost rec", "Share rec", "Breaks sim", "Cost sim",
                  "Break cost sim", "Share sim"):
        table.add_column(label, justify="left" if label == "Session" else "right", no_wrap=label == "Session")
    for r in doc["sessions"]:
        table.add_row(r["session_id"], str(r["rec_breaks"]), _usd(r["rec_cost"]), _usd(r["rec_break_cost"]),
                      _rate(r["rec_break_share"]), str(r["sim_breaks"]), _usd(r["sim_cost"]), _usd(r["sim_break_cost"]),
                      _rate(r["sim_break_share"]))
    _console().print(table)


# ---------------------------------------------------------------------------------------------
# ctxreplay compare


@click.command(context_settings=CONTEXT)
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("--pipeline", "pipelines", multiple=True, metavar="SPEC[@ttl=5m|1h]",
              help="A preset name or a spec file, repeatable; the first is the baseline. `identity` is the "
                   "sessions as recorded; `@ttl=1h` prices every cache write with a 1-hour TTL.")
@json_option()
@click.option("--html", "html_file", type=click.Path(path_type=Path), metavar="FILE",
              help="Also write a self-contained HTML page of charts (no network needed to view it).")
@click.option("--prices", "prices_file", type=click.Path(path_type=Path),
              help="TOML file of prices that override or add models (see README, Prices).")
@click.option("--keep", type=click.Path(path_type=Path), metavar="DIR",
              help="Keep each pipeline's run in DIR/<n>-<name>[@ttl=<ttl>], n counted from 0, e.g. "
                   "DIR/1-identity@ttl=1h, with its calls as compared in compare-calls.parquet "
                   "(default: a temporary directory).")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
@click.option("--raw", is_flag=True, help="Show the raw simulation (sim_*) instead of the anchored estimate.")
@follow_links_option()
@max_line_bytes_option()
@no_cache_option()
def compare(paths: tuple[Path, ...], pipelines: tuple[str, ...], json_: bool, html_file: Path | None,
            prices_file: Path | None, keep: Path | None, quiet: bool, raw: bool) -> None:
    """What the same sessions cost under several context policies, side by side.

    Each --pipeline runs over PATHS (fresh ledger, fresh simulated cache) and its requests go
    through the prompt-cache simulator. Per session and in total: prompt tokens (calibrated to
    the provider's tokenizer), cache read and write, cost with its 90 % interval, cache hit rate
    and breaks, with the differences from the first pipeline. The figures are the anchored
    estimate: the recorded usage plus what the simulator changes from the sessions as recorded
    (identity; equal to the recorded usage under identity); --raw shows the raw simulation.
    Without PATHS: the directories `ctxreplay run` reads.

    \b
    Example:
      ctxreplay compare ~/.claude/projects --pipeline identity --pipeline default \\
          --pipeline context-editing --pipeline identity@ttl=1h --html compare.html
    """
    import orjson

    from ctxreplay.pipeline.reporting.compare import compare as run_compare
    from ctxreplay.pipeline.reporting.compare import parse_choice
    if not pipelines:
        raise ArgumentError("give at least one --pipeline (a preset name or a spec file), e.g. "
                      "`ctxreplay compare PATH --pipeline identity --pipeline default`")
    if html_file is not None and not html_file.resolve().parent.is_dir():
        raise ArgumentError(f"--html {html_file}: its directory {html_file.resolve().parent} does not exist; create it "
                      f"or pass another path")
    chosen = paths_or_roots(paths, "ctxreplay compare data/samples --pipeline identity --pipeline default")
    say = None if (quiet or json_ or not sys.stderr.isatty()) else (lambda m: echo(f"… {m}", err=True))
    choices = [parse_choice(p) for p in pipelines]
    if len({c.label for c in choices}) < len(choices):
        raise ArgumentError("the same --pipeline is given twice; each must differ (a preset, a file, or @ttl=...)")
    res = run_compare(chosen, choices, prices_file=prices_file, progress=say, keep=keep)
    doc = res.to_json()
    if html_file is not None:
        from ctxreplay.pipeline.reporting.html_report import compare_html, write_html

        write_html(html_file, compare_html(res))
        if not json_:
            echo(f"ctxreplay compare: wrote {html_file}", err=True)
    if json_:
        click.echo(orjson.dumps(doc).decode())
    else:
        _compare_tables(doc, raw=raw)
    for w in doc["warnings"]:
        echo(f"ctxreplay compare: {w}", err=True)


def _signed_usd(v: float | None) -> str:
    return "–" if v is None else f"{v:+,.4f}"


def _compare_tables(doc: dict[str, Any], *, raw: bool = False) -> None:
    from rich.table import Table

    labels = [p["label"] for p in doc["pipelines"]]
    what = ("the raw simulation (--raw)" if raw else
            "the anchored estimate: recorded usage + the simulated change from identity (--raw: the raw simulation)")
    echo(f"ctxreplay compare: {len({r['session_id'] for r in doc['sessions']})} session(s) under "
         f"{len(labels)} pipeline(s), differences from {labels[0]}; prices: {doc['prices']}; figures: {what}; "
         f"costs with their {doc['interval']['coverage']:.0%} interval")
    p = "sim_" if raw else ""

    def add_cols(table: Table) -> None:
        for label in ("Calls", "Prompt", "Cache read", "Cache write", "Hit rate", "Breaks", "Cost (USD)",
                      f"{doc['interval']['coverage']:.0%} interval", "Δ cost", "Δ %"):
            table.add_column(label, justify="right")

    def cells(r: dict[str, Any]) -> list[str]:
        first = r["pipeline"] == labels[0]
        unpriced = r["unpriced_calls"] == r["calls"]
        cost = "unpriced" if unpriced else _usd(r[f"{p}cost_usd"]) + (" + unpriced" if r["unpriced_calls"] else "")
        lo, hi = r.get(f"{p}cost_usd_low"), r.get(f"{p}cost_usd_high")
        span = "" if unpriced or lo is None or hi is None else f"{_usd(lo)}–{_usd(hi)}"
        return [f"{r['calls']:,}", _fmt_int(r["prompt_tokens"]), _fmt_int(r[f"{p}cache_read_tokens"]),
                _fmt_int(r[f"{p}cache_write_tokens"]), _rate(r[f"{p}cache_hit_rate"]), str(r["breaks"]), cost, span,
                "" if first else _signed_usd(r[f"d_{p}cost_usd"]), "" if first else _pct(r.get(f"{p}cost_change"))]

    table = Table(title="Per session")
    table.add_column("Session", no_wrap=True)
    table.add_column("Pipeline", no_wrap=True)
    add_cols(table)
    last = None
    for r in doc["sessions"]:
        sid = r["session_id"] if r["session_id"] != last else ""
        if sid and last is not None:
            table.add_section()
        last = r["session_id"]
        table.add_row(sid[:8] if sid else "", r["pipeline"], *cells(r))
    _console().print(table)
    table = Table(title="Total")
    table.add_column("Pipeline", no_wrap=True)
    add_cols(table)
    for r in doc["totals"]:
        table.add_row(r["pipeline"], *cells(r))
    _console().print(table)
    rec = doc["recorded"]
    echo(f"recorded usage of the same calls: {_usd(rec['recorded_cost_usd'])} USD, cache read "
         f"{_fmt_int(rec['recorded_cache_read_tokens'])} tokens")
    nu = max((r.get("no_usage_calls") or 0) for r in doc["totals"]) if doc["totals"] else 0
    if nu:
        echo(f"{nu:,} call(s) recorded no usage: no estimate (no_usage)")
    iv = doc["interval"]
    echo(f"intervals (90%): each simulated change ± q, q the simulator's error on the other compared sessions "
         f"where 9 or more had usage ({iv['sessions_with_own_q']} session(s)), else {iv['default_q']:.0%} (its error "
         f"on real sessions, measured leave-one-session-out)")
    for label, causes in doc["breaks_by_cause"].items():
        parts = ", ".join(f"{k} {v}" for k, v in causes.items())
        echo(f"breaks under {label}: {sum(causes.values())}" + (f" ({parts})" if parts else ""))
    for r in doc["totals"]:
        if r["summary_requests"]:
            echo(f"simulated auto-compactions under {r['pipeline']}: {r['summary_requests']}, their "
                 f"summarisation requests {_usd(r['summary_cost_usd'])} USD (in the cost)")
