"""Self-contained HTML pages of charts for `ctxreplay report --html` and `ctxreplay compare --html`.

One file, viewable offline: plotly's JavaScript is embedded once (`include_plotlyjs=True`), each
chart is a `<div class="plotly-graph-div">` with its data inline; nothing is fetched from a
network. Charts:
- usage report (`report PATHS --html`): cost over time by model, the cache hit rate over time (and
  each session's), cost per session (the largest), and the table the terminal shows;
- run view (`report --sim OUT --html`): cost per session recorded vs simulated; prompt size and
  cache read / write along each session (a menu picks the session) with the breaks marked and
  their cause on hover; cost over time by model, recorded and simulated;
- compare: total cost, hit rate and breaks per pipeline, cost per session per pipeline side by side,
  and the prompt size along each session under every pipeline.

Readable over months: cost over time is drawn per day up to `DAY_MAX_SPAN` days, per week up to
`WEEK_MAX_SPAN`, else per month (the chart's title and axis say which); series get colours from a
palette of `len(PALETTE)` distinct colours, and past that the smallest are summed as "other"; a hit
rate's axis spans the data with a margin, not 0-100 %; a chart of sessions shows the `TOP_SESSIONS`
dearest (its title says what the others cost). plotly is imported only here, only when a page is written.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable
from datetime import date
from pathlib import Path
from typing import Any, NamedTuple

import polars as pl

from ctxreplay.errors import OutputError

_STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 1.5em auto; max-width: 1200px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; }
p.note { color: #555; font-size: 0.9em; }
div.scroll { overflow-x: auto; }
table.kv { border-collapse: collapse; font-size: 0.85em; }
table.kv td { padding: 2px 8px; border-bottom: 1px solid #eee; white-space: nowrap; }
table.kv td.wrap { white-space: normal; } table.kv code { font-size: 1.1em; } table.kv td.wrap span { white-space: nowrap; }
table.kv td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.kv thead td { position: sticky; top: 0; background: #fff; border-bottom: 2px solid #ccc; }
table.kv tfoot td { border-top: 2px solid #ccc; font-weight: bold; }
table.kv td.sub { padding-left: 2em; color: #555; }
"""

# 14 colours, each far from the others (CIE76 distance over 29) and readable on white: the first
# fourteen of Sasha Trubetskoy's "20 distinct colours" without the pale ones. "other" is grey.
PALETTE = ("#4363d8", "#f58231", "#3cb44b", "#e6194b", "#911eb4", "#42d4f4", "#f032e6", "#9a6324", "#469990",
           "#000075", "#808000", "#800000", "#bfef45", "#ffe119")
OTHER = "#9e9e9e"
TOP_SESSIONS = 30
DAY_MAX_SPAN = 62      # days from the first to the last: up to this many, a bar per day
WEEK_MAX_SPAN = 366    # then a bar per week up to a year, then per month
_DAY_MS = 86_400_000
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")


def _go() -> Any:
    try:
        import plotly.graph_objects as go
    except ImportError as exc:  # pragma: no cover - plotly is a dependency
        raise OutputError("--html needs plotly (a dependency of ctxreplay): pip install plotly") from exc
    return go


class Abbr(NamedTuple):
    """A table cell shown short, whole on hover and in the page's text (e.g. a session id)."""

    short: str
    full: str


class Page:
    """An HTML page being assembled: headings, notes, tables and plotly figures."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.parts: list[str] = []
        self.figures: list[Any] = []

    def h2(self, text: str) -> None:
        self.parts.append(f"<h2>{html.escape(text)}</h2>")

    def note(self, text: str) -> None:
        self.parts.append(f'<p class="note">{html.escape(text)}</p>')

    def table(self, header: list[str], rows: list[list[Any]], footer: list[Any] | None = None,
              sub: Iterable[int] = (), wrap: Iterable[int] = (), table_id: str | None = None) -> None:
        """A table; numbers right-aligned with thousands separators (floats with 4 decimals); `sub`:
        the indices of rows drawn indented (a row's per-model rows); `wrap`: the columns whose
        text may wrap (the others stay on one line); a list in a cell: names, wrapped between them;
        a newline in a header: a line break."""
        wraps = set(wrap)

        def cell(j: int, v: Any) -> str:
            num = isinstance(v, (int, float)) and not isinstance(v, bool)
            if isinstance(v, Abbr):
                return f'<td title="{html.escape(v.full)}"><code>{html.escape(v.short)}</code></td>'
            if isinstance(v, list):    # names, each kept on one line
                return f'<td class="wrap">{", ".join(f"<span>{html.escape(str(x))}</span>" for x in v)}</td>'
            txt = f"{v:,.4f}" if isinstance(v, float) else f"{v:,}" if num else html.escape(str(v if v is not None else "–"))
            return f'<td class="num">{txt}</td>' if num or _numeric_text(v) else \
                f'<td class="wrap">{txt}</td>' if j in wraps else f"<td>{txt}</td>"

        subs = set(sub)

        def row(i: int, r: list[Any]) -> str:
            cells = [cell(j, v) for j, v in enumerate(r)]
            if i in subs and cells:
                cells[0] = cells[0].replace("<td>", '<td class="sub">', 1)
            return "<tr>" + "".join(cells) + "</tr>"

        head = "".join(f"<td><b>{html.escape(h).replace(chr(10), '<br>')}</b></td>" for h in header)
        body = "".join(row(i, r) for i, r in enumerate(rows))
        foot = f"<tfoot><tr>{''.join(cell(j, v) for j, v in enumerate(footer))}</tr></tfoot>" if footer else ""
        ident = f' id="{html.escape(table_id)}"' if table_id else ""
        self.parts.append(f'<div class="scroll"><table class="kv"{ident}><thead><tr>{head}</tr></thead><tbody>{body}</tbody>'
                          f'{foot}</table></div>')

    def figure(self, fig: Any, height: int = 420) -> None:
        fig.update_layout(height=height, template="plotly_white")
        layout = fig.layout
        if layout.margin.t is None:
            fig.update_layout(margin={"l": 60, "r": 20, "t": 50, "b": 60})
        if layout.legend.orientation is None:
            fig.update_layout(legend={"orientation": "h", "y": -0.2})
        self.parts.append(fig.to_html(full_html=False, include_plotlyjs=not self.figures,
                                      div_id=f"chart-{len(self.figures)}", config={"displaylogo": False}))
        self.figures.append(fig)

    def render(self) -> str:
        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>{html.escape(self.title)}</title><style>{_STYLE}</style></head><body>"
                f"<h1>{html.escape(self.title)}</h1>" + "\n".join(self.parts) + "</body></html>\n")


_FIGURE = re.compile(r"^(?:[+\-]?[\d,]+(?:\.\d+)?%?(?: \+ unpriced)?|–|unpriced)$")


def _numeric_text(v: Any) -> bool:
    """A formatted figure ("97.5%", "1,234.5678", "0.1 + unpriced", "–") is right-aligned as numbers are."""
    return isinstance(v, str) and bool(_FIGURE.match(v))


def write_html(path: Path, page: Page) -> None:
    """Write the page (one file; its directory must exist)."""
    try:
        Path(path).write_text(page.render(), encoding="utf-8")
    except OSError as exc:
        raise OutputError(f"--html {path}: cannot write it: {exc.strerror or exc}; pass a writable file path") from exc


# ---------------------------------------------------------------------------------------------
# pieces


def _short(sid: str) -> str:
    return sid[:8]


def palette(n: int) -> list[str]:
    """Colours for `n` series, distinct up to len(PALETTE) (callers sum the rest as "other")."""
    return [PALETTE[i % len(PALETTE)] for i in range(n)]


def named_and_other(names: list[str], limit: int = len(PALETTE)) -> tuple[list[str], str | None]:
    """The series to draw by name (`names` in order, largest first) and the label of the rest
    summed as one grey series: all of them when they fit the palette, else the first limit - 1."""
    if len(names) <= limit:
        return names, None
    rest = len(names) - (limit - 1)
    return names[:limit - 1], f"other ({rest} models)"


def time_unit(first: date, last: date) -> str:
    """The bar of a chart over time: a day while the range is at most DAY_MAX_SPAN days, a week up
    to WEEK_MAX_SPAN, else a month, so that each bar stays wide enough to see."""
    span = (last - first).days + 1
    return "day" if span <= DAY_MAX_SPAN else "week" if span <= WEEK_MAX_SPAN else "month"


def rate_axis(values: Iterable[float | None]) -> dict[str, Any]:
    """A hit-rate axis fitted to the data: from a little below the lowest to a little above the
    highest (a quarter of the spread, at least half a point), within 0-100 %."""
    vs = [v for v in values if v is not None]
    if not vs:
        return {"range": [0, 1], "tickformat": ".0%"}
    lo, hi = min(vs), max(vs)
    pad = max((hi - lo) * 0.25, 0.005)
    lo, hi = max(0.0, lo - pad), min(1.0, hi + pad)
    return {"range": [lo, hi], "tickformat": ".1%" if hi - lo < 0.1 else ".0%"}


def _axis_from(ax: dict[str, Any]) -> str:
    """A title's word on a fitted axis that does not start at 0."""
    lo = ax["range"][0]
    return f" (axis from {lo:.1%})" if lo > 0 else ""


def _periods(days: pl.Expr, unit: str, week_start: str) -> tuple[pl.Expr, pl.Expr]:
    """(first day, length in days) of the period holding each day ('YYYY-MM-DD' strings)."""
    d = days.str.to_date("%Y-%m-%d", strict=False)
    if unit == "day":
        return d, pl.lit(1)
    if unit == "week":
        first = _WEEKDAYS.index(week_start) if week_start in _WEEKDAYS else 6
        return d - pl.duration(days=(d.dt.weekday().cast(pl.Int32) - 1 - first) % 7), pl.lit(7)
    start = d.dt.month_start()
    return start, (d.dt.month_end() - start).dt.total_days() + 1


def _unit_label(unit: str, week_start: str) -> str:
    return f"week (from {week_start.capitalize()})" if unit == "week" else unit


def by_period(frames: list[pl.DataFrame], week_start: str = "sunday") -> tuple[list[pl.DataFrame], str]:
    """Each frame (a `day` column, 'YYYY-MM-DD') with its period added (`start` date, `days`,
    `label`), the unit chosen from all frames' days together; rows without a day are dropped."""
    span = pl.concat([pl.DataFrame(schema={"d": pl.Date}),
                      *(f.select(d=pl.col("day").cast(pl.String).str.to_date("%Y-%m-%d", strict=False)) for f in frames)])
    lo, hi = span["d"].min(), span["d"].max()
    unit = time_unit(lo, hi) if isinstance(lo, date) and isinstance(hi, date) else "day"
    start, length = _periods(pl.col("day"), unit, week_start)
    fmt = {"day": "%Y-%m-%d", "week": "week of %Y-%m-%d", "month": "%B %Y"}[unit]
    out = [f.with_columns(start=start, days=length).filter(pl.col("start").is_not_null())
           .with_columns(label=pl.col("start").dt.strftime(fmt)) for f in frames]
    return out, unit


def _bar_geometry(p: pl.DataFrame) -> dict[str, Any]:
    """A date-axis bar per period, from 10 % to 90 % of it (months are as long as they are)."""
    return {"x": p["start"].dt.strftime("%Y-%m-%d").to_list(),
            "width": (p["days"] * int(_DAY_MS * 0.8)).to_list(), "offset": (p["days"] * int(_DAY_MS * 0.1)).to_list()}


def _period_model_figure(frames: list[tuple[str, pl.DataFrame]], what: str, week_start: str = "sunday") -> Any:
    """Stacked bars of cost per period (day, week or month, from the range), one colour per model
    (the dearest first; past the palette the rest as "other"); one panel per source."""
    go = _go()
    from plotly.subplots import make_subplots

    spans, unit = by_period([df for _, df in frames], week_start)
    spans = [s.with_columns(model=pl.col("model").fill_null("unknown")) for s in spans]
    allc = pl.concat([s.select("model", "cost") for s in spans]) if spans else pl.DataFrame()
    order = (allc.group_by("model").agg(pl.col("cost").sum()).sort(["cost", "model"], descending=[True, False])
             ["model"].to_list()) if allc.height else []
    named, other = named_and_other(order)
    colours = dict(zip(named, palette(len(named)), strict=True))
    many = len(frames) > 1
    fig = make_subplots(rows=1, cols=len(frames), shared_yaxes=True, subplot_titles=[lb for lb, _ in frames]) \
        if many else go.Figure()
    shown: set[str] = set()
    for i, ((label, _), s) in enumerate(zip(frames, spans, strict=True)):
        s = s.with_columns(series=pl.when(pl.col("model").is_in(named)).then(pl.col("model")).otherwise(pl.lit(other)))
        per = s.group_by("series", "start", "days", "label").agg(pl.col("cost").sum()).sort("start")
        for name in [*named, *([other] if other else [])]:
            p = per.filter(pl.col("series") == name)
            if p.height == 0:
                continue
            kw = {"row": 1, "col": i + 1} if many else {}
            fig.add_bar(**_bar_geometry(p), y=p["cost"].to_list(), name=name, legendgroup=name,
                        showlegend=name not in shown,
                        marker_color=colours.get(name, OTHER), customdata=p["label"].to_list(),
                        hovertemplate=f"{html.escape(name)} · {html.escape(label)}<br>%{{customdata}}: "
                                      f"%{{y:$,.4f}}<extra></extra>", **kw)
            shown.add(name)
    fig.update_layout(barmode="stack", title=f"Cost by {unit} and model ({what})", yaxis_title="USD")
    if many:    # room for the panels' titles under the chart's
        fig.update_layout(margin={"l": 60, "r": 20, "t": 90, "b": 60})
    fig.update_xaxes(type="date", title_text=_unit_label(unit, week_start))
    if unit == "month":
        fig.update_xaxes(tickformat="%b %Y", dtick="M1")
    return fig


def _hit_rate_figure(frame: pl.DataFrame, sessions: list[dict[str, Any]], week_start: str) -> Any:
    """The cache hit rate per period (all requests of the period) and each session's (a dot at its
    last activity), on an axis fitted to them."""
    go = _go()
    (p,), unit = by_period([frame], week_start)
    per = (p.group_by("start", "days", "label")
           .agg(pl.col("input").sum(), pl.col("cw5").sum(), pl.col("cw1").sum(), pl.col("cr").sum(),
                n=pl.len()).sort("start")
           .with_columns(prompt=pl.col("input") + pl.col("cw5") + pl.col("cw1") + pl.col("cr"))
           .filter(pl.col("prompt") > 0)
           .with_columns(rate=pl.col("cr") / pl.col("prompt"),
                         mid=pl.col("start").cast(pl.Datetime("ms")) + pl.duration(milliseconds=pl.col("days") * (_DAY_MS // 2))))
    fig = go.Figure()
    dots = [r for r in sessions if r.get("cache_hit_rate") is not None and r.get("last_activity")]
    fig.add_scatter(x=[r["last_activity"][:19].replace("T", " ") for r in dots], y=[r["cache_hit_rate"] for r in dots],
                    mode="markers", name="a session (at its last activity)", marker={"color": OTHER, "size": 6, "opacity": 0.6},
                    text=[r["key"] for r in dots], hovertemplate="%{text}<br>%{x}: %{y:.2%}<extra></extra>")
    fig.add_scatter(x=per["mid"].dt.strftime("%Y-%m-%d %H:%M:%S").to_list(), y=per["rate"].to_list(),
                    mode="lines+markers", name=f"all requests of the {unit}", line={"color": PALETTE[0], "width": 2},
                    customdata=list(zip(per["label"].to_list(), per["n"].to_list(), strict=True)),
                    hovertemplate="%{customdata[0]}: %{y:.2%} of the prompt read from the cache "
                                  "(%{customdata[1]:,} requests)<extra></extra>")
    ax = rate_axis([*per["rate"].to_list(), *(r["cache_hit_rate"] for r in dots)])
    fig.update_layout(title=f"Cache hit rate by {unit}{_axis_from(ax)}",
                      yaxis={**ax, "title": "cache read / prompt"})
    fig.update_xaxes(type="date", title_text=_unit_label(unit, week_start))
    return fig


def _by_day_model(calls: pl.DataFrame, cost: str) -> pl.DataFrame:
    return (calls.filter(pl.col(cost).is_not_null() & pl.col("timestamp").is_not_null())
            .with_columns(day=pl.col("timestamp").dt.strftime("%Y-%m-%d"), model=pl.col("model").fill_null("unknown"))
            .group_by("day", "model").agg(cost=pl.col(cost).sum()).sort("day", "model"))


def _session_bars(fig: Any, rows: list[dict[str, Any]], key: str, value: str, *, name: str, colour: str,
                  order: list[str], extra: str = "", error: tuple[str, str] | None = None) -> None:
    """One bar per session of `order`'s first TOP_SESSIONS (the dearest); `error`: the keys of each
    bar's interval (low, high), drawn as an error bar."""
    by = {r[key]: r for r in rows}
    top = order[:TOP_SESSIONS]
    x = [_short(s) for s in top]
    y = [by[s][value] if s in by else None for s in top]
    text = [s + (f"<br>{extra.format(**by[s])}" if extra and s in by else "") for s in top]
    kw: dict[str, Any] = {}
    if error is not None:
        lo = [by[s].get(error[0]) if s in by else None for s in top]
        hi = [by[s].get(error[1]) if s in by else None for s in top]
        kw["error_y"] = {"type": "data", "symmetric": False,
                         "array": [None if h is None or v is None else h - v for h, v in zip(hi, y, strict=True)],
                         "arrayminus": [None if lw is None or v is None else v - lw for lw, v in zip(lo, y, strict=True)]}
    fig.add_bar(x=x, y=y, name=name, text=text, textposition="none", marker_color=colour,
                hovertemplate="%{text}<br>%{y:$,.4f}<extra>" + html.escape(name) + "</extra>", **kw)


def _more(what: str, order: list[str], rows: list[dict[str, Any]], key: str, value: str, of: str = "") -> str:
    """The title's word on the sessions left out of a chart of the TOP_SESSIONS dearest (`of`: whose
    cost, e.g. "recorded")."""
    rest = set(order[TOP_SESSIONS:])
    if not rest:
        return what
    usd = sum((r[value] or 0) for r in rows if r[key] in rest)
    return (f"{what}: the {TOP_SESSIONS} dearest of {len(order)} (the other {len(rest)}: {usd:,.4f} USD"
            f"{' ' + of if of else ''} together)")


def _hover_break(cause: pl.Expr, detail: pl.Expr, tokens: pl.Expr, cost: pl.Expr) -> pl.Expr:
    return pl.format("{}<br>{}<br>{} tokens re-written, {} USD", cause, detail.fill_null(""),
                     tokens.fill_null(0), cost.round(4).cast(pl.String).fill_null("–"))


# the traces along one session of a run (report --sim): a colour each
_SIM_COLOURS = {"prompt": PALETTE[0], "read": PALETTE[1], "write": PALETTE[2], "recorded": "#555555",
                "break": PALETTE[3], "recorded break": PALETTE[4]}


def _session_traces(calls: pl.DataFrame, sessions: list[str], page: Page, title: str,
                    series: list[tuple[str, pl.DataFrame]] | None = None, *, estimate: bool = False) -> None:
    """Prompt size and cache read / write along each session (its main thread and subagents one
    after the other, in time order), breaks marked with their cause on hover; a menu (top left,
    clear of plotly's toolbar at the top right) picks the session. `series`: several pipelines'
    calls instead of one, a colour per pipeline (prompt solid, cache read dashed, writes as bars,
    breaks as crosses), grouped in the legend by pipeline. `estimate`: the cache read and write drawn
    are the anchored estimate's (`est_cache_*`), not the raw simulation's."""
    go = _go()
    fig = go.Figure()
    vis: list[list[bool]] = []
    labels: list[str] = []
    sources = series or [("", calls)]
    colours = palette(len(sources))
    for si, sid in enumerate(sessions):
        count = 0
        first_day, ncalls = "", 0
        for pi, (label, df) in enumerate(sources):
            c = (df.filter((pl.col("session_id") == sid) & ~pl.col("is_pending")).sort("timestamp", "thread_key", "call")
                 .with_row_index("i"))
            if c.height == 0:
                continue
            if not first_day:
                ts = c["timestamp"].drop_nulls()
                first_day = ts.min().strftime("%Y-%m-%d") if ts.len() else ""  # type: ignore[union-attr]
                ncalls = c.height
            x = c["i"].to_list()
            hover = c.select(pl.format("{} #{} {}", pl.col("thread_key").str.slice(37), pl.col("call"),
                                       pl.col("timestamp").dt.strftime("%Y-%m-%d %H:%M:%S"))).to_series().to_list()
            sfx = f" · {label}" if label else ""
            if series:
                col = colours[pi]
                look = {"prompt": {"color": col}, "read": {"color": col, "dash": "dash"}, "write": col,
                        "break": col}
                grp = {"legendgroup": label, "legendgrouptitle_text": label}
                names = {"prompt": "prompt", "read": "cache read", "write": "cache write", "break": "breaks"}
            else:
                look = {"prompt": {"color": _SIM_COLOURS["prompt"]}, "read": {"color": _SIM_COLOURS["read"]},
                        "write": _SIM_COLOURS["write"], "break": _SIM_COLOURS["break"]}
                grp = {}
                what = "estimate" if estimate else "sim"
                names = {"prompt": "prompt", "read": f"cache read ({what})", "write": f"cache write ({what})",
                         "break": "break (sim)"}
            fig.add_scatter(x=x, y=c["calibrated_prompt_tokens"].to_list(), mode="lines", name=names["prompt"],
                            line=look["prompt"], text=hover, visible=si == 0,
                            hovertemplate=f"%{{text}}<br>prompt %{{y:,}}<extra>{html.escape(label)}</extra>", **grp)
            read = c["est_cache_read_tokens"] if estimate else c["sim_cache_read_tokens"]
            fig.add_scatter(x=x, y=read.to_list(), mode="lines", name=names["read"],
                            line=look["read"], text=hover, visible=si == 0,
                            hovertemplate=f"%{{text}}<br>read %{{y:,}}<extra>{html.escape(label)}</extra>", **grp)
            write = (c["est_cache_write_tokens"] if estimate else
                     c["sim_cache_write_5m_tokens"].fill_null(0) + c["sim_cache_write_1h_tokens"].fill_null(0)).to_list()
            fig.add_bar(x=x, y=write, name=names["write"], text=hover, opacity=0.6, textposition="none",
                        marker_color=look["write"], visible=si == 0,
                        hovertemplate=f"%{{text}}<br>write %{{y:,}}<extra>{html.escape(label)}</extra>", **grp)
            count += 3
            if not series:
                fig.add_scatter(x=x, y=c["recorded_cache_read_tokens"].to_list(), mode="lines",
                                line={"dash": "dot", "color": _SIM_COLOURS["recorded"]}, name="cache read (recorded)",
                                text=hover, hovertemplate="%{text}<br>recorded read %{y:,}<extra></extra>",
                                visible=si == 0)
                count += 1
            b = c.filter(pl.col("sim_break_cause").is_not_null()).with_columns(
                _h=_hover_break(pl.col("sim_break_cause"), pl.col("sim_break_detail"), pl.col("sim_break_tokens"),
                                pl.col("sim_break_cost_usd")))
            fig.add_scatter(x=b["i"].to_list(), y=b["calibrated_prompt_tokens"].to_list(), mode="markers",
                            marker={"symbol": "x", "size": 11, "color": look["break"]}, name=names["break"],
                            text=b["_h"].to_list(), visible=si == 0,
                            hovertemplate=f"%{{text}}<extra>break{html.escape(sfx)}</extra>", **grp)
            count += 1
            if not series:
                rb = c.filter(pl.col("recorded_break_cause").is_not_null()).with_columns(
                    _h=_hover_break(pl.col("recorded_break_cause"), pl.col("recorded_break_detail"),
                                    pl.col("recorded_break_tokens"), pl.col("recorded_break_cost_usd")))
                fig.add_scatter(x=rb["i"].to_list(), y=rb["recorded_cache_read_tokens"].to_list(), mode="markers",
                                marker={"symbol": "circle-open", "size": 11, "color": _SIM_COLOURS["recorded break"]},
                                name="break (recorded)", text=rb["_h"].to_list(),
                                hovertemplate="%{text}<extra>recorded break</extra>", visible=si == 0)
                count += 1
        vis.append([False] * len(fig.data))
        for k in range(len(fig.data) - count, len(fig.data)):
            vis[-1][k] = True
        labels.append(" · ".join(p for p in (_short(sid), first_day, f"{ncalls:,} calls" if ncalls else "") if p))
    n = len(fig.data)
    buttons = []
    for si, sid in enumerate(sessions):
        mask = [(vis[si][k] if k < len(vis[si]) else False) for k in range(n)]
        buttons.append({"label": labels[si], "method": "update",
                        "args": [{"visible": mask}, {"title.text": f"{title}: session {sid}"}]})
    fig.update_layout(title={"text": f"{title}: session {sessions[0]}" if sessions else title, "x": 0, "xref": "paper",
                             "xanchor": "left", "y": 1, "yref": "container", "yanchor": "top", "pad": {"t": 12}},
                      xaxis_title="call (time order)", yaxis_title="tokens (calibrated)", barmode="overlay",
                      margin={"l": 60, "r": 20, "t": 100 if len(buttons) > 1 else 50, "b": 60},
                      updatemenus=[{"buttons": buttons, "direction": "down", "x": 0, "xanchor": "left",
                                    "y": 1.02, "yanchor": "bottom", "pad": {"b": 4},
                                    "showactive": True}] if len(buttons) > 1 else [])
    if series:
        fig.update_layout(legend={"orientation": "h", "y": -0.2, "groupclick": "toggleitem"})
    page.figure(fig, height=560 if series else 520)


# ---------------------------------------------------------------------------------------------
# the pages


def _rate_text(v: float | None) -> str:
    return "–" if v is None else f"{v:.1%}"


def _cost_text(r: dict[str, Any]) -> str:
    if r.get("unpriced_models") and r["unpriced_models"] == r.get("models"):
        return "unpriced"
    s = f"{(r.get('cost_usd') or 0):,.4f}"
    return s + " + unpriced" if r.get("unpriced_models") else s


def _usage_table(page: Page, doc: dict[str, Any]) -> None:
    """The report's table as the terminal shows it at full width (every column, ids and models in
    full), each row's per-model rows under it when the report has them (--breakdown)."""
    by = doc["by"]
    t = doc["totals"]
    header = [by.capitalize()]
    if by == "session":
        header.append("Last activity")
    if by != "model":
        header.append("Models")
    header += ["Input", "Output", "Cache write\n5m", "Cache write\n1h", "Cache read", "Hit rate", "Cost\n(USD)"]

    def cells(r: dict[str, Any], key: Any, sub: bool) -> list[Any]:
        out: list[Any] = [key]
        if by == "session":
            out.append("" if sub else (r.get("last_activity") or "")[:16].replace("T", " "))
        if by != "model":
            out.append(r.get("model", "") if sub else list(r.get("models") or []))
        return out + [r["input_tokens"], r["output_tokens"], r["cache_write_5m_tokens"], r["cache_write_1h_tokens"],
                      r["cache_read_tokens"], _rate_text(r.get("cache_hit_rate")), _cost_text(r)]

    rows, subs = [], []
    for r in doc["rows"]:
        k = r["key"]
        # a session id as the terminal shows it when narrow: its first 8 characters (whole on hover)
        rows.append(cells(r, Abbr(_short(k), k) if by == "session" and _UUID.match(k) else k, False))
        for m in r.get("breakdown") or []:
            subs.append(len(rows))
            rows.append(cells({**m, "models": [m["model"]]}, f"└ {m['model']}" if by == "model" else "└", True))
    foot = ["Total"] + ([""] if by == "session" else []) + ([f"{len(t['models'])} models"] if by != "model" else []) \
        + [t["input_tokens"], t["output_tokens"], t["cache_write_5m_tokens"], t["cache_write_1h_tokens"],
           t["cache_read_tokens"], _rate_text(t.get("cache_hit_rate")), _cost_text(t)]
    page.table(header, rows, foot, sub=subs, wrap=[header.index("Models")] if "Models" in header else [],
               table_id="report-table")


def usage_html(doc: dict[str, Any], session_rows: list[dict[str, Any]], requests: pl.DataFrame,
               week_start: str = "sunday") -> Page:
    """`ctxreplay report PATHS --html`: the recorded usage (no replay). `requests`: one row per
    request counted, columns day ('YYYY-MM-DD' in --tz), model, cost (USD, null when unpriced),
    input, cw5, cw1, cr (tokens); `session_rows`: the report's rows by session."""
    go = _go()
    t = doc["totals"]
    page = Page("ctxreplay report: cost and cache from recorded usage")
    page.note(f"{t['requests']:,} requests from {doc['files']} file(s); prices: {doc['prices']}. Total "
              f"{t['cost_usd']:,.4f} USD, cache hit rate {_rate_text(t['cache_hit_rate'])}. The table by "
              f"{doc['by']} is at the end. Simulated costs, and the prompt and cache along a session with its "
              f"breaks, need a replay: `ctxreplay run PATHS --out OUT`, then `ctxreplay report --sim OUT --html FILE`.")
    priced = requests.filter(pl.col("cost").is_not_null())
    page.h2("Cost over time, by model")
    page.note(f"A bar per day up to {DAY_MAX_SPAN} days, per week up to a year (weeks from "
              f"{week_start.capitalize()}), else per month; past {len(PALETTE)} models the cheapest are summed as "
              f"\"other\".")
    page.figure(_period_model_figure([("recorded", priced)], "recorded usage", week_start))
    page.h2("Cache hit rate over time")
    page.note("The share of the prompt read from the cache, of all requests in each period (line) and of each "
              "session (grey dots). The axis spans the data, not 0-100 %.")
    page.figure(_hit_rate_figure(requests, session_rows, week_start))
    page.h2("Cost per session")
    rows = sorted(session_rows, key=lambda r: (-(r["cost_usd"] or 0), r["key"]))
    fig = go.Figure()
    _session_bars(fig, rows, "key", "cost_usd", name="recorded", colour=PALETTE[0], order=[r["key"] for r in rows],
                  extra="{requests:,} requests, last {last_activity}")
    fig.update_layout(title=_more("Cost per session", [r["key"] for r in rows], rows, "key", "cost_usd"),
                      yaxis_title="USD", showlegend=False)
    page.figure(fig)
    page.h2(f"The report by {doc['by']}")
    _usage_table(page, doc)
    if t.get("unpriced_models"):
        page.note("Unpriced models (left out of the costs): " + ", ".join(t["unpriced_models"]))
    return page


def sim_html(calls: pl.DataFrame, doc: dict[str, Any], out: str) -> Page:
    """`ctxreplay report --sim OUT --html`: per session and along each, the anchored estimate against
    the recorded usage (`doc["figures"] == "estimate"`: `calls` carry the est_* columns), else the
    raw simulation (--raw, or no anchor)."""
    go = _go()
    t = doc["totals"]
    est = doc.get("figures") == "estimate"
    page = Page(f"ctxreplay report --sim {out}")
    if est:
        lo, hi = t.get("est_cost_low"), t.get("est_cost_high")
        page.note(f"Pipeline {doc['pipeline']}; prices: {doc['prices']}. {t.get('calls', 0):,} calls; recorded "
                  f"{(t.get('rec_cost') or 0):,.4f} USD, estimated {(t.get('est_cost') or 0):,.4f} USD "
                  f"({doc['interval']['coverage']:.0%} interval {(lo or 0):,.4f}–{(hi or 0):,.4f}): the recorded usage "
                  f"plus the simulated change from identity (anchor: {doc['anchor']['note']}); the raw simulation "
                  f"{(t.get('sim_cost') or 0):,.4f} USD (--raw draws it).")
    else:
        page.note(f"Pipeline {doc['pipeline']}; prices: {doc['prices']}. {t.get('calls', 0):,} calls; recorded "
                  f"{(t.get('rec_cost') or 0):,.4f} USD, simulated {(t.get('sim_cost') or 0):,.4f} USD (the raw "
                  f"simulation: {doc['anchor']['note']}); per-call agreement of hit / break "
                  f"{(t.get('agreement') or 0):.1%}.")
    sess = sorted(doc["sessions"], key=lambda r: (-(r["rec_cost"] or 0), r["session_id"]))
    what, key = ("estimated", "est_cost") if est else ("simulated", "sim_cost")
    page.h2(f"Cost per session, recorded vs {what}")
    if est:
        iv = f"{doc['interval']['coverage']:.0%} interval"
        page.table(["Session", "Calls", "Cache read\nrecorded", "estimated", "Cache write\nrecorded", "estimated",
                    "Cost (USD)\nrecorded", "estimated", iv, "Δ"],
                   [[Abbr(_short(r["session_id"]), r["session_id"]), r["calls"], r["rec_read"], r["est_read"],
                     r["rec_write"], r["est_write"], r["rec_cost"], r["est_cost"], _span(r), _pct_text(r["est_cost_diff"])]
                    for r in sess],
                   footer=["Total", t.get("calls"), t.get("rec_read"), t.get("est_read"), t.get("rec_write"),
                           t.get("est_write"), t.get("rec_cost"), t.get("est_cost"), _span(t),
                           _pct_text(t.get("est_cost_diff"))])
    fig = go.Figure()
    order = [r["session_id"] for r in sess]
    _session_bars(fig, sess, "session_id", "rec_cost", name="recorded", colour=PALETTE[0], order=order)
    _session_bars(fig, sess, "session_id", key, name=what, colour=PALETTE[1], order=order,
                  error=("est_cost_low", "est_cost_high") if est else None)
    fig.update_layout(barmode="group", title=_more(f"Cost per session, recorded and {what}", order, sess, "session_id",
                                                      "rec_cost", "recorded"),
                      yaxis_title="USD")
    page.figure(fig)
    page.h2("Prompt and cache along a session")
    page.note("Pick the session in the menu. Red crosses: simulated breaks; open circles: recorded breaks (hover "
              "for the cause, the tokens written again and what it cost)."
              + (" The cache read and write are the estimate's: the recorded usage plus the simulated change." if est
                 else ""))
    c = calls.filter(~pl.col("is_pending"))
    order_n = c.group_by("session_id").agg(n=pl.len()).sort("n", "session_id", descending=[True, False])
    _session_traces(c, order_n["session_id"].to_list(), page, "Prompt and cache", estimate=est)
    page.h2("Cost over time, by model")
    page.figure(_period_model_figure([("recorded", _by_day_model(c, "recorded_cost_usd")),
                                      (what, _by_day_model(c, "est_cost_usd" if est else "sim_cost_usd"))],
                                     f"recorded and {what}, days in UTC"))
    return page


def _span(r: dict[str, Any]) -> str:
    lo, hi = r.get("est_cost_low"), r.get("est_cost_high")
    return "–" if lo is None or hi is None else f"{lo:,.4f}–{hi:,.4f}"


def _pct_text(v: float | None) -> str:
    return "–" if v is None else f"{v:+.1%}"


def compare_html(res: Any) -> Page:
    """`ctxreplay compare --html`: the pipelines side by side, a colour per pipeline throughout."""
    go = _go()
    from plotly.subplots import make_subplots

    doc = res.to_json()
    labels = [p["label"] for p in doc["pipelines"]]
    colours = palette(len(labels))
    page = Page("ctxreplay compare: " + " vs ".join(labels))
    page.note(f"Prices: {doc['prices']}. Differences are from {labels[0]}. Recorded usage of the same calls: "
              f"{doc['recorded']['recorded_cost_usd']:,.4f} USD.")
    tot = doc["totals"]
    page.table(["Pipeline", "Calls", "Prompt", "Cache read", "Cache write", "Hit rate", "Breaks", "Cost (USD)", "Δ cost"],
               [[r["pipeline"], r["calls"], r["prompt_tokens"], r["cache_read_tokens"], r["cache_write_tokens"],
                 _rate_text(r["cache_hit_rate"]), r["breaks"], r["cost_usd"], r["d_cost_usd"]] for r in tot])
    page.h2("The pipelines side by side")
    rates = [r["cache_hit_rate"] for r in tot]
    ax = rate_axis(rates)
    fig = make_subplots(rows=1, cols=3, subplot_titles=(
        "Cost (USD)", f"Cache hit rate{_axis_from(ax)}", "Breaks by cause"))
    fig.add_bar(x=labels, y=[r["cost_usd"] for r in tot], name="cost", showlegend=False, marker_color=colours,
                hovertemplate="%{x}<br>%{y:$,.4f}<extra></extra>", row=1, col=1)
    # dots, not bars: the axis does not start at 0, and a bar's length would mislead
    fig.add_scatter(x=labels, y=rates, name="hit rate", showlegend=False, mode="markers+text",
                    marker={"color": colours, "size": 14}, text=[_rate_text(v) for v in rates],
                    textposition="top center", cliponaxis=False,
                    hovertemplate="%{x}<br>%{y:.2%}<extra></extra>", row=1, col=2)
    causes = sorted({c for d in doc["breaks_by_cause"].values() for c in d})
    cause_colours = palette(len(labels) + len(causes))[len(labels):]    # apart from the pipelines' colours
    for cause, col in zip(causes, cause_colours, strict=True):
        fig.add_bar(x=labels, y=[doc["breaks_by_cause"][lb].get(cause, 0) for lb in labels], name=cause,
                    marker_color=col, hovertemplate=f"{cause}<br>%{{x}}: %{{y}}<extra></extra>", row=1, col=3)
    fig.update_layout(barmode="stack")
    fig.update_yaxes(row=1, col=2, **ax)
    page.figure(fig, height=440)
    page.h2("Cost per session")
    sess = doc["sessions"]
    dearest: dict[str, float] = {}
    for r in sess:
        dearest[r["session_id"]] = max(dearest.get(r["session_id"], 0.0), r["cost_usd"] or 0)
    ids = sorted(dearest, key=lambda s: (-dearest[s], s))
    fig = go.Figure()
    for lb, col in zip(labels, colours, strict=True):
        _session_bars(fig, [r for r in sess if r["pipeline"] == lb], "session_id", "cost_usd", name=lb, colour=col,
                      order=ids, extra="Δ {d_cost_usd:+,.4f} USD")
    base = [r for r in sess if r["pipeline"] == labels[0]]
    fig.update_layout(barmode="group", yaxis_title="USD",
                      title=_more("Cost per session and pipeline", ids, base, "session_id", "cost_usd",
                                  f"under {labels[0]}"))
    page.figure(fig)
    page.h2("Prompt and cache along a session, per pipeline")
    page.note("Pick the session in the menu (the 30 dearest with more than one call). A colour per pipeline: "
              "prompt solid, cache read dashed, cache writes as bars, breaks as crosses (hover for the cause).")
    top = [s for s in ids if any(r["session_id"] == s and r["calls"] > 1 for r in sess)][:30]
    _session_traces(res.calls[0], top, page, "Prompt and cache", series=list(zip(labels, res.calls, strict=True)))
    return page


__all__ = ["OTHER", "PALETTE", "Abbr", "Page", "by_period", "compare_html", "named_and_other", "palette", "rate_axis",
           "sim_html", "time_unit", "usage_html", "write_html"]
