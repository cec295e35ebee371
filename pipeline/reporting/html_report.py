"""Self-contained HTML pages of charts for `ctxreplay report --html` and `ctxreplay compare --html`.

One file, viewable offline: plotly's JavaScript is embedded once (`include_plotlyjs=True`), each
chart is a `<div class="plotly-graph-div">` with its data inline; nothing is fetched from a
network. Charts:
- usage report (`report PATHS --html`): cost per session, cost by day and model (recorded usage);
- run view (`report --sim OUT --html`): cost per session recorded vs simulated; prompt size and
  cache read / write along each session (a menu picks the session) with the breaks marked and
  their cause on hover; cost by day and model, recorded and simulated;
- compare: total cost, hit rate and breaks per pipeline, cost per session per pipeline side by side,
  and the prompt size along each session under every pipeline.
plotly is imported only here, only when a page is written.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import polars as pl

from ctxreplay.errors import OutputError

_STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 1.5em auto; max-width: 1200px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; }
p.note { color: #555; font-size: 0.9em; }
table.kv { border-collapse: collapse; font-size: 0.9em; } table.kv td { padding: 2px 10px; border-bottom: 1px solid #eee; }
table.kv td.num { text-align: right; font-variant-numeric: tabular-nums; }
"""


def _go() -> Any:
    try:
        import plotly.graph_objects as go
    except ImportError as exc:  # pragma: no cover - plotly is a dependency
        raise OutputError("--html needs plotly (a dependency of ctxreplay): pip install plotly") from exc
    return go


class Page:
    """An HTML page being assembled: headings, notes, tables and plotly figures."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.parts: list[str] = []
        self.charts = 0

    def h2(self, text: str) -> None:
        self.parts.append(f"<h2>{html.escape(text)}</h2>")

    def note(self, text: str) -> None:
        self.parts.append(f'<p class="note">{html.escape(text)}</p>')

    def table(self, header: list[str], rows: list[list[Any]]) -> None:
        def cell(v: Any) -> str:
            num = isinstance(v, (int, float)) and not isinstance(v, bool)
            txt = f"{v:,.4f}" if isinstance(v, float) else f"{v:,}" if num else html.escape(str(v if v is not None else "–"))
            return f'<td class="num">{txt}</td>' if num else f"<td>{txt}</td>"

        head = "".join(f"<td><b>{html.escape(h)}</b></td>" for h in header)
        body = "".join("<tr>" + "".join(cell(v) for v in r) + "</tr>" for r in rows)
        self.parts.append(f'<table class="kv"><tr>{head}</tr>{body}</table>')

    def figure(self, fig: Any, height: int = 420) -> None:
        fig.update_layout(height=height, margin={"l": 60, "r": 20, "t": 40, "b": 60}, template="plotly_white",
                          legend={"orientation": "h", "y": -0.2})
        self.parts.append(fig.to_html(full_html=False, include_plotlyjs=self.charts == 0,
                                      div_id=f"chart-{self.charts}", config={"displaylogo": False}))
        self.charts += 1

    def render(self) -> str:
        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>{html.escape(self.title)}</title><style>{_STYLE}</style></head><body>"
                f"<h1>{html.escape(self.title)}</h1>" + "\n".join(self.parts) + "</body></html>\n")


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


def _by_day_model(calls: pl.DataFrame, cost: str) -> pl.DataFrame:
    return (calls.filter(pl.col(cost).is_not_null() & pl.col("timestamp").is_not_null())
            .with_columns(day=pl.col("timestamp").dt.strftime("%Y-%m-%d"), model=pl.col("model").fill_null("unknown"))
            .group_by("day", "model").agg(cost=pl.col(cost).sum()).sort("day", "model"))


def _day_model_figure(frames: list[tuple[str, pl.DataFrame]], title: str) -> Any:
    """Stacked bars of cost per day, one colour per model; one panel per source (recorded, simulated)."""
    go = _go()
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=len(frames), shared_yaxes=True, subplot_titles=[lb for lb, _ in frames]) \
        if len(frames) > 1 else go.Figure()
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]
    models = sorted({m for _, df in frames for m in df["model"].to_list()})
    for i, (label, df) in enumerate(frames):
        for mi, model in enumerate(models):
            d = df.filter(pl.col("model") == model)
            if d.height == 0:
                continue
            kw = {"row": 1, "col": i + 1} if len(frames) > 1 else {}
            fig.add_bar(x=d["day"].to_list(), y=d["cost"].to_list(), name=model, legendgroup=model, showlegend=i == 0,
                        marker_color=palette[mi % len(palette)],
                        hovertemplate=f"{html.escape(model)} · {html.escape(label)}<br>%{{x}}: %{{y:$,.4f}}<extra></extra>",
                        **kw)
    fig.update_layout(barmode="stack", title=title, yaxis_title="USD")
    return fig


def _hover_break(cause: pl.Expr, detail: pl.Expr, tokens: pl.Expr, cost: pl.Expr) -> pl.Expr:
    return pl.format("{}<br>{}<br>{} tokens re-written, {} USD", cause, detail.fill_null(""),
                     tokens.fill_null(0), cost.round(4).cast(pl.String).fill_null("–"))


def _session_traces(calls: pl.DataFrame, sessions: list[str], page: Page, title: str,
                    series: list[tuple[str, pl.DataFrame]] | None = None) -> None:
    """Prompt size and cache read / write along each session (its main thread and subagents one
    after the other, in time order), breaks marked with their cause on hover; a menu picks the
    session. `series`: several pipelines' calls (prompt and read per pipeline) instead of one."""
    go = _go()
    fig = go.Figure()
    vis: list[list[bool]] = []
    sources = series or [("", calls)]
    for si, sid in enumerate(sessions):
        count = 0
        for label, df in sources:
            c = (df.filter((pl.col("session_id") == sid) & ~pl.col("is_pending")).sort("timestamp", "thread_key", "call")
                 .with_row_index("i"))
            if c.height == 0:
                continue
            x = c["i"].to_list()
            hover = c.select(pl.format("{} #{} {}", pl.col("thread_key").str.slice(37), pl.col("call"),
                                       pl.col("timestamp").dt.strftime("%Y-%m-%d %H:%M:%S"))).to_series().to_list()
            sfx = f" · {label}" if label else ""
            fig.add_scatter(x=x, y=c["calibrated_prompt_tokens"].to_list(), mode="lines", name=f"prompt{sfx}",
                            text=hover, hovertemplate="%{text}<br>prompt %{y:,}<extra></extra>", visible=si == 0)
            fig.add_scatter(x=x, y=c["sim_cache_read_tokens"].to_list(), mode="lines", name=f"cache read (sim){sfx}",
                            text=hover, hovertemplate="%{text}<br>read %{y:,}<extra></extra>", visible=si == 0)
            write = (c["sim_cache_write_5m_tokens"].fill_null(0) + c["sim_cache_write_1h_tokens"].fill_null(0)).to_list()
            fig.add_bar(x=x, y=write, name=f"cache write (sim){sfx}", text=hover, opacity=0.6, textposition="none",
                        hovertemplate="%{text}<br>write %{y:,}<extra></extra>", visible=si == 0)
            count += 3
            if not series:
                fig.add_scatter(x=x, y=c["recorded_cache_read_tokens"].to_list(), mode="lines",
                                line={"dash": "dot"}, name="cache read (recorded)", text=hover,
                                hovertemplate="%{text}<br>recorded read %{y:,}<extra></extra>", visible=si == 0)
                count += 1
            b = c.filter(pl.col("sim_break_cause").is_not_null()).with_columns(
                _h=_hover_break(pl.col("sim_break_cause"), pl.col("sim_break_detail"), pl.col("sim_break_tokens"),
                                pl.col("sim_break_cost_usd")))
            fig.add_scatter(x=b["i"].to_list(), y=b["calibrated_prompt_tokens"].to_list(), mode="markers",
                            marker={"symbol": "x", "size": 11, "color": "#d62728"}, name=f"break (sim){sfx}",
                            text=b["_h"].to_list(), hovertemplate="%{text}<extra>break</extra>", visible=si == 0)
            count += 1
            if not series:
                rb = c.filter(pl.col("recorded_break_cause").is_not_null()).with_columns(
                    _h=_hover_break(pl.col("recorded_break_cause"), pl.col("recorded_break_detail"),
                                    pl.col("recorded_break_tokens"), pl.col("recorded_break_cost_usd")))
                fig.add_scatter(x=rb["i"].to_list(), y=rb["recorded_cache_read_tokens"].to_list(), mode="markers",
                                marker={"symbol": "circle-open", "size": 11, "color": "#9467bd"},
                                name="break (recorded)", text=rb["_h"].to_list(),
                                hovertemplate="%{text}<extra>recorded break</extra>", visible=si == 0)
                count += 1
        vis.append([False] * len(fig.data))
        for k in range(len(fig.data) - count, len(fig.data)):
            vis[-1][k] = True
    n = len(fig.data)
    buttons = []
    for si, sid in enumerate(sessions):
        mask = [(vis[si][k] if k < len(vis[si]) else False) for k in range(n)]
        buttons.append({"label": _short(sid), "method": "update", "args": [{"visible": mask},
                                                                          {"title": f"{title}: session {sid}"}]})
    fig.update_layout(title=f"{title}: session {sessions[0]}" if sessions else title, xaxis_title="call (time order)",
                      yaxis_title="tokens (calibrated)", barmode="overlay",
                      updatemenus=[{"buttons": buttons, "direction": "down", "x": 1.0, "xanchor": "right", "y": 1.15}]
                      if len(buttons) > 1 else [])
    page.figure(fig, height=520)


# ---------------------------------------------------------------------------------------------
# the pages


def usage_html(doc: dict[str, Any], session_rows: list[dict[str, Any]], day_model: pl.DataFrame) -> Page:
    """`ctxreplay report PATHS --html`: the recorded usage (no replay)."""
    go = _go()
    t = doc["totals"]
    page = Page("ctxreplay report: cost and cache from recorded usage")
    page.note(f"{t['requests']:,} requests from {doc['files']} file(s); prices: {doc['prices']}. Total "
              f"{t['cost_usd']:,.4f} USD, cache hit rate {(t['cache_hit_rate'] or 0):.1%}. Simulated costs, and the "
              f"prompt and cache along a session with its breaks, need a replay: `ctxreplay run PATHS --out OUT`, "
              f"then `ctxreplay report --sim OUT --html FILE`.")
    page.h2("Cost per session")
    rows = sorted(session_rows, key=lambda r: -(r["cost_usd"] or 0))
    fig = go.Figure()
    fig.add_bar(x=[_short(r["key"]) for r in rows], y=[r["cost_usd"] for r in rows], name="recorded",
                text=[r["key"] for r in rows], textposition="none",
                hovertemplate="%{text}<br>%{y:$,.4f}<extra></extra>")
    fig.update_layout(title="Cost per session (recorded usage)", yaxis_title="USD")
    page.figure(fig)
    page.h2("Cost by day and model")
    page.figure(_day_model_figure([("recorded", day_model)], "Cost by day and model (recorded usage)"))
    if t.get("unpriced_models"):
        page.note("Unpriced models (left out of the costs): " + ", ".join(t["unpriced_models"]))
    return page


def sim_html(calls: pl.DataFrame, doc: dict[str, Any], out: str) -> Page:
    """`ctxreplay report --sim OUT --html`: recorded vs simulated, per session and along each."""
    go = _go()
    t = doc["totals"]
    page = Page(f"ctxreplay report --sim {out}")
    page.note(f"Pipeline {doc['pipeline']}; prices: {doc['prices']}. {t.get('calls', 0):,} calls; recorded "
              f"{(t.get('rec_cost') or 0):,.4f} USD, simulated {(t.get('sim_cost') or 0):,.4f} USD; per-call "
              f"agreement of hit / break {(t.get('agreement') or 0):.1%}.")
    sess = sorted(doc["sessions"], key=lambda r: -(r["rec_cost"] or 0))
    page.h2("Cost per session, recorded vs simulated")
    fig = go.Figure()
    for name, key in (("recorded", "rec_cost"), ("simulated", "sim_cost")):
        fig.add_bar(x=[_short(r["session_id"]) for r in sess], y=[r[key] for r in sess], name=name,
                    text=[r["session_id"] for r in sess], textposition="none", hovertemplate="%{text}<br>%{y:$,.4f}<extra>" + name + "</extra>")
    fig.update_layout(barmode="group", title="Cost per session", yaxis_title="USD")
    page.figure(fig)
    page.h2("Prompt and cache along a session")
    page.note("Pick the session in the menu. Red crosses: simulated breaks; open circles: recorded breaks (hover "
              "for the cause, the tokens written again and what it cost).")
    c = calls.filter(~pl.col("is_pending"))
    order = c.group_by("session_id").agg(n=pl.len()).sort("n", "session_id", descending=[True, False])
    _session_traces(c, order["session_id"].to_list(), page, "Prompt and cache")
    page.h2("Cost by day and model")
    page.figure(_day_model_figure([("recorded", _by_day_model(c, "recorded_cost_usd")),
                                   ("simulated", _by_day_model(c, "sim_cost_usd"))],
                                  "Cost by day and model, recorded and simulated"))
    return page


def compare_html(res: Any) -> Page:
    """`ctxreplay compare --html`: the pipelines side by side."""
    go = _go()
    from plotly.subplots import make_subplots

    doc = res.to_json()
    labels = [p["label"] for p in doc["pipelines"]]
    page = Page("ctxreplay compare: " + " vs ".join(labels))
    page.note(f"Prices: {doc['prices']}. Differences are from {labels[0]}. Recorded usage of the same calls: "
              f"{doc['recorded']['recorded_cost_usd']:,.4f} USD.")
    tot = doc["totals"]
    page.table(["Pipeline", "Calls", "Prompt", "Cache read", "Cache write", "Hit rate", "Breaks", "Cost (USD)", "Δ cost"],
               [[r["pipeline"], r["calls"], r["prompt_tokens"], r["cache_read_tokens"], r["cache_write_tokens"],
                 f"{(r['cache_hit_rate'] or 0):.1%}", r["breaks"], r["cost_usd"], r["d_cost_usd"]] for r in tot])
    page.h2("The pipelines side by side")
    fig = make_subplots(rows=1, cols=3, subplot_titles=("Cost (USD)", "Cache hit rate", "Breaks by cause"))
    fig.add_bar(x=labels, y=[r["cost_usd"] for r in tot], name="cost", showlegend=False,
                hovertemplate="%{x}<br>%{y:$,.4f}<extra></extra>", row=1, col=1)
    fig.add_bar(x=labels, y=[r["cache_hit_rate"] for r in tot], name="hit rate", showlegend=False,
                hovertemplate="%{x}<br>%{y:.1%}<extra></extra>", row=1, col=2)
    causes = sorted({c for d in doc["breaks_by_cause"].values() for c in d})
    for cause in causes:
        fig.add_bar(x=labels, y=[doc["breaks_by_cause"][lb].get(cause, 0) for lb in labels], name=cause,
                    hovertemplate=f"{cause}<br>%{{x}}: %{{y}}<extra></extra>", row=1, col=3)
    fig.update_layout(barmode="stack")
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    page.figure(fig, height=440)
    page.h2("Cost per session")
    sess = doc["sessions"]
    ids = sorted({r["session_id"] for r in sess},
                 key=lambda s: -max((r["cost_usd"] or 0) for r in sess if r["session_id"] == s))
    fig = go.Figure()
    for lb in labels:
        by = {r["session_id"]: r for r in sess if r["pipeline"] == lb}
        fig.add_bar(x=[_short(s) for s in ids], y=[by[s]["cost_usd"] if s in by else None for s in ids], name=lb,
                    text=[f"{s}<br>Δ {by[s]['d_cost_usd']:+,.4f} USD" if s in by else s for s in ids], textposition="none",
                    hovertemplate="%{text}<br>%{y:$,.4f}<extra>" + html.escape(lb) + "</extra>")
    fig.update_layout(barmode="group", title="Cost per session and pipeline", yaxis_title="USD")
    page.figure(fig)
    page.h2("Prompt and cache along a session, per pipeline")
    page.note("Pick the session in the menu; crosses mark each pipeline's simulated breaks (hover for the cause).")
    top = [s for s in ids if any(r["session_id"] == s and r["calls"] > 1 for r in sess)][:30]
    _session_traces(res.calls[0], top, page, "Prompt and cache", series=list(zip(labels, res.calls, strict=True)))
    return page


__all__ = ["Page", "compare_html", "sim_html", "usage_html", "write_html"]
