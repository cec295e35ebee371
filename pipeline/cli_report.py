"""`ctxreplay report`: cost and cache hit rate from recorded usage, no replay.

Kept light on purpose: importing this module (and running the command) loads click, orjson and
the standard library only; rich for the table; genai-prices only when its disk cache misses.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from pipeline.clicommon import CONTEXT, Failure
from pipeline.errors import CtxReplayError

BY = ("session", "day", "month", "model", "project")


@click.command(context_settings=CONTEXT)
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("--by", "by", type=click.Choice(BY), default="session", show_default=True, help="Group rows by.")
@click.option("--since", help="First day to count (YYYYMMDD or YYYY-MM-DD, in --tz).")
@click.option("--until", help="Last day to count (YYYYMMDD or YYYY-MM-DD, in --tz).")
@click.option("--tz", help="Time zone of days and months (IANA name, e.g. UTC); default: this machine's.")
@click.option("--json", "json_", is_flag=True, help="Print one JSON document on stdout.")
@click.option("--prices", "prices_file", type=click.Path(path_type=Path),
              help="TOML file of prices that override or add models (see README, Prices).")
@click.option("--compat", type=click.Choice(["ccusage"]),
              help="Compute as ccusage 20 does where it departs from the provider's rules.")
@click.option("--count-progress-copies", is_flag=True,
              help="Count agent_progress copies of requests whose subagent file is missing.")
@click.option("--workers", type=click.IntRange(min=1), help="Processes for the scan (default: CPU count "
              "for inputs of 48 MB and more, else 1).")
def report(paths: tuple[Path, ...], by: str, since: str | None, until: str | None, tz: str | None, json_: bool,
           prices_file: Path | None, compat: str | None, count_progress_copies: bool, workers: int | None) -> None:
    """Cost, tokens and cache hit rate from the usage transcripts record (no replay).

    PATHS are files or directories (searched recursively). Without PATHS: what ccusage reads,
    $CLAUDE_CONFIG_DIR/projects or ~/.claude/projects (and ~/.config/claude/projects), and
    ~/.openclaw/agents. One copy of each request is kept (Claude Code repeats usage on every
    line of a response), priced with genai-prices (version in the output) and --prices; a
    model without a price is listed under unpriced_models and warned about, never counted as 0.

    \b
    Example:
      ctxreplay report ~/.claude/projects --by day --since 20260201 --tz UTC
    """
    import orjson

    from pipeline.prices import PriceBook
    from pipeline.report import ReportOptions, build_report, default_paths, parse_day

    try:
        chosen = list(paths) or default_paths()
        if not chosen:
            raise Failure("no PATHS given and none of ~/.claude/projects, ~/.config/claude/projects, "
                          "~/.openclaw/agents exists; pass transcript files or directories, "
                          "e.g. `ctxreplay report data/samples`")
        opts = ReportOptions(by=by, since=parse_day(since, "--since"), until=parse_day(until, "--until"),  # type: ignore[arg-type]
                             tz=tz, compat=compat, count_progress_copies=count_progress_copies,  # type: ignore[arg-type]
                             workers=workers)
        book = PriceBook.load(prices_file)
        rep = build_report(chosen, book, opts)
    except Failure:
        raise
    except CtxReplayError as exc:
        raise Failure(str(exc)) from exc
    doc = rep.to_json()
    if json_:
        click.echo(orjson.dumps(doc).decode())
    else:
        _table(doc)
    _warnings(doc)


def _warnings(doc: dict[str, Any]) -> None:
    err = sys.stderr
    unpriced = doc["totals"]["unpriced_models"]
    if unpriced:
        click.echo(f"ctxreplay report: no price for {', '.join(unpriced)}: their requests are left out of "
                   f"cost_usd (listed under unpriced_models); add them with --prices FILE", file=err)
    po = doc["progress_only"]
    if po["requests"] and not po["counted"]:
        ss = po["sessions"]
        where = f"session {', '.join(ss)}" if len(ss) <= 3 else \
            f"sessions {', '.join(ss[:3])} and {len(ss) - 3} more (progress_only in --json)"
        click.echo(f"ctxreplay report: {po['requests']} request(s) recorded only as agent_progress copies "
                   f"(subagent file missing; {where}) are not counted: "
                   f"{po['cost_usd']:.4f} USD; --count-progress-copies counts them", file=err)
    if doc["bad_lines"]:
        first = doc["bad_lines"][0]
        click.echo(f"ctxreplay report: {len(doc['bad_lines'])} line(s) holding usage could not be read and are "
                   f"left out (listed under bad_lines in --json), first: {first['file']}:{first['line']}: "
                   f"{first['reason']}", file=err)
    for w in doc["warnings"]:
        click.echo(f"ctxreplay report: {w}", file=err)


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def _table(doc: dict[str, Any]) -> None:
    import shutil

    from rich.console import Console
    from rich.table import Table

    by = doc["by"]
    t = doc["totals"]
    width = shutil.get_terminal_size((200, 24)).columns if sys.stdout.isatty() else 200
    console = Console(file=sys.stdout, width=width, highlight=False, soft_wrap=False)
    click.echo(f"ctxreplay report: {len(doc['rows'])} {by} row(s), {t['requests']:,} requests from {doc['files']} "
               f"file(s); prices: {doc['prices']}" + (f"; compat {doc['compat']}" if doc["compat"] else ""))
    table = Table(show_footer=True)
    table.add_column(by.capitalize(), footer="Total", no_wrap=True)
    if by == "session":
        table.add_column("Last activity", no_wrap=True)
    if by != "model":
        table.add_column("Models", footer=str(len(t["models"])), overflow="fold", min_width=12)
    cols = [("Input", "input_tokens"), ("Output", "output_tokens"), ("Cache write 5m", "cache_write_5m_tokens"),
            ("Cache write 1h", "cache_write_1h_tokens"), ("Cache read", "cache_read_tokens")]
    for label, k in cols:
        table.add_column(label, justify="right", footer=_fmt_int(t[k]))
    table.add_column("Hit rate", justify="right", footer=_rate(t["cache_hit_rate"]))
    table.add_column("Cost (USD)", justify="right", footer=_cost(t))
    for r in doc["rows"]:
        cells = [r["key"]]
        if by == "session":
            cells.append((r["last_activity"] or "")[:16].replace("T", " "))
        if by != "model":
            cells.append(", ".join(r["models"]))
        cells += [_fmt_int(r[k]) for _, k in cols]
        cells += [_rate(r["cache_hit_rate"]), _cost(r)]
        table.add_row(*cells)
    console.print(table)


def _rate(v: float | None) -> str:
    return "–" if v is None else f"{v:.1%}"


def _cost(r: dict[str, Any]) -> str:
    if r["unpriced_models"] and r["unpriced_models"] == r["models"]:
        return "unpriced"
    s = f"{r['cost_usd']:,.4f}"
    return s + " + unpriced" if r["unpriced_models"] else s
