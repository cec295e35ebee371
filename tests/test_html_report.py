"""The `--html` pages read well over months (issue 24): the cost over time is drawn per day, week or
month as the range grows; colours do not repeat (past the palette the rest is "other"); a hit rate's
axis fits the data; the session menu stays clear of plotly's toolbar; `report --html` has the
table and a hit-rate chart. Input: tests/htmlkit.py (about eight months, a dozen models).

The checks in headless Chromium (skipped without one) open each page with a probe script added
to a copy: it writes the boxes of the menu, the toolbar and the title, the widths of the bars, the
legend's colours and the axes' ranges into the DOM, read back with --dump-dom; the screenshot is
checked for the palette's colours.
"""

from __future__ import annotations

import html as htmllib
import itertools
import json
import math
import os
import re
import shutil
import subprocess
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.reporting import html_report as hr
from tests.htmlkit import MODELS, write_months

SESSIONS = 120
COMPARED = 36


@pytest.fixture(autouse=True)
def _price_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXREPLAY_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "price-cache"))


@pytest.fixture(scope="module")
def months(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("months")
    write_months(d, sessions=SESSIONS)
    return d


def _cli(*args: object) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


def _page_of(monkeypatch: pytest.MonkeyPatch, *args: object) -> tuple[hr.Page, Path]:
    """Run the command and keep the page it writes (its figures, as plotly objects)."""
    pages: list[hr.Page] = []
    real = hr.write_html

    def keep(path: Path, page: hr.Page) -> None:
        pages.append(page)
        real(path, page)

    monkeypatch.setattr(hr, "write_html", keep)
    r = _cli(*args)
    assert r.exit_code == 0, r.output
    assert len(pages) == 1
    out = Path(str(args[args.index("--html") + 1]))
    return pages[0], out


def _title(fig: Any) -> str:
    return fig.layout.title.text or ""


# --------------------------------------------------------------------------------------------- the rules


def test_the_bar_is_a_day_then_a_week_then_a_month_as_the_range_grows() -> None:
    d = date(2026, 1, 1)
    assert hr.time_unit(d, d) == "day"
    assert hr.time_unit(d, d + timedelta(days=hr.DAY_MAX_SPAN - 1)) == "day"
    assert hr.time_unit(d, d + timedelta(days=hr.DAY_MAX_SPAN)) == "week"
    assert hr.time_unit(d, d + timedelta(days=hr.WEEK_MAX_SPAN - 1)) == "week"
    assert hr.time_unit(d, d + timedelta(days=hr.WEEK_MAX_SPAN)) == "month"


def test_periods_start_on_the_chosen_weekday_and_months_are_as_long_as_they_are() -> None:
    days = ["2026-02-27", "2026-03-01", "2026-03-02", "2026-05-10"]   # a Friday, Sunday, Monday, Sunday
    f = pl.DataFrame({"day": days, "cost": [1.0, 2.0, 3.0, 4.0]})
    (w,), unit = hr.by_period([f], "sunday")
    assert unit == "week"
    assert [str(x) for x in w["start"].to_list()] == ["2026-02-22", "2026-03-01", "2026-03-01", "2026-05-10"]
    assert set(w["days"].to_list()) == {7} and w["label"][1] == "week of 2026-03-01"
    (w,), _ = hr.by_period([f], "monday")
    assert [str(x) for x in w["start"].to_list()] == ["2026-02-23", "2026-02-23", "2026-03-02", "2026-05-04"]
    long = pl.DataFrame({"day": ["2026-02-14", "2027-03-31"], "cost": [1.0, 1.0]})
    (m,), unit = hr.by_period([long], "sunday")
    assert unit == "month" and [str(x) for x in m["start"].to_list()] == ["2026-02-01", "2027-03-01"]
    assert m["days"].to_list() == [28, 31] and m["label"][0] == "February 2026"
    # the unit comes from all panels together (recorded and simulated share one)
    short = pl.DataFrame({"day": ["2026-02-14"], "cost": [1.0]})
    (a, _), unit = hr.by_period([short, long], "sunday")
    assert unit == "month" and a["days"].to_list() == [28]
    (d,), unit = hr.by_period([short.vstack(pl.DataFrame({"day": ["unknown"], "cost": [1.0]}))], "sunday")
    assert unit == "day" and d.height == 1


def _lab(hex_colour: str) -> tuple[float, float, float]:
    def lin(c: float) -> float:
        return ((c + 0.055) / 1.055) ** 2.4 if c > 0.04045 else c / 12.92

    r, g, b = (lin(int(hex_colour[i:i + 2], 16) / 255) for i in (1, 3, 5))
    x, y, z = ((r * 0.4124 + g * 0.3576 + b * 0.1805) / 0.95047, r * 0.2126 + g * 0.7152 + b * 0.0722,
               (r * 0.0193 + g * 0.1192 + b * 0.9505) / 1.08883)

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def test_the_palette_has_more_than_ten_colours_each_far_from_the_others() -> None:
    cols = [*hr.PALETTE, hr.OTHER]
    assert len(hr.PALETTE) > 10 and len(set(cols)) == len(cols)
    closest = min(math.dist(_lab(a), _lab(b)) for a, b in itertools.combinations(cols, 2))
    assert closest > 20     # plotly's default ten have two at 21.8
    assert min(math.dist(_lab(c), _lab("#ffffff")) for c in cols) > 20
    names = [f"m{i}" for i in range(len(hr.PALETTE))]
    assert hr.named_and_other(names) == (names, None)
    named, other = hr.named_and_other([*names, "extra"])
    assert named == names[:-1] and other == "other (2 models)"


def test_a_hit_rate_axis_fits_the_data() -> None:
    ax = hr.rate_axis([0.951, 0.98, 0.962, None])
    lo, hi = ax["range"]
    assert 0.9 < lo < 0.951 and 0.98 < hi < 1.0 and ax["tickformat"] == ".1%"
    # a wide spread keeps whole percents; the axis stays within 0-100 %
    ax = hr.rate_axis([0.02, 0.99])
    assert ax["range"] == [0.0, 1.0] and ax["tickformat"] == ".0%"
    lo, hi = hr.rate_axis([0.97, 0.97])["range"]
    assert lo < 0.97 < hi and hi - lo <= 0.011
    assert hr.rate_axis([None])["range"] == [0, 1]


# --------------------------------------------------------------------------------------------- report --html


def test_report_html_over_eight_months(months: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page, out = _page_of(monkeypatch, "report", months, "--tz", "UTC", "--html", tmp_path / "r.html")
    cost, rate, per_session = page.figures
    # eight months: a bar per week, the title and the axis say so
    assert "Cost by week and model" in _title(cost) and cost.layout.xaxis.title.text == "week (from Sunday)"
    weeks = {x for t in cost.data for x in t.x}
    assert 30 <= len(weeks) <= 36
    assert all(date.fromisoformat(x).weekday() == 6 for x in weeks)       # Sundays
    assert all(w == 7 * 86_400_000 * 0.8 for t in cost.data for w in t.width)
    # twelve models, twelve colours
    assert {t.name for t in cost.data} == set(MODELS)
    assert len({t.marker.color for t in cost.data}) == len(MODELS) > 10
    # the week bars add up to the report's total
    doc = json.loads(_cli("report", months, "--tz", "UTC", "--json").stdout)
    assert sum(sum(t.y) for t in cost.data) == pytest.approx(doc["totals"]["cost_usd"], rel=1e-9)
    # hit rate: a line per week and a dot per session, on an axis fitted to them (95-98 %, not 0-100 %)
    dots, line = rate.data
    assert len(dots.y) == SESSIONS and len(line.y) == len(weeks)
    lo, hi = rate.layout.yaxis.range
    values = [*dots.y, *line.y]
    assert 0.85 < lo < min(values) and max(values) < hi <= 1.0
    assert f"(axis from {lo:.1%})" in _title(rate)
    assert line.y[0] == pytest.approx(_week_rate(months, line.customdata[0][0]), rel=1e-9)
    # cost per session: the 30 dearest, the title says what the others cost
    assert len(per_session.data[0].x) == hr.TOP_SESSIONS
    assert f"of {SESSIONS} (the other {SESSIONS - hr.TOP_SESSIONS}:" in _title(per_session)
    # the table as the terminal prints it: a row per session, the totals at the foot
    text = out.read_text(encoding="utf-8")
    # one file, nothing fetched when viewed: plotly's script inline once, no src= or link
    assert re.findall(r"<script[^>]*\ssrc=", text) == [] and re.findall(r"<link[^>]*href=", text) == []
    assert text.count("Plotly.newPlot") == 3 and len(text) > 3_000_000
    table = text[text.index('id="report-table"'):]
    table = table[:table.index("</table>")]
    assert table.count("<tr>") == SESSIONS + 2
    # a session id as the narrow terminal shows it, whole on hover
    assert all(f'<td title="{r["key"]}"><code>{r["key"][:8]}</code></td>' in table for r in doc["rows"])
    t = doc["totals"]
    assert f"{t['cache_read_tokens']:,}" in table and f"{t['cost_usd']:,.4f}" in table and "Total" in table


def _week_rate(months: Path, label: str) -> float:
    """The hit rate of the week `label` ("week of YYYY-MM-DD") from the transcripts themselves."""
    first = date.fromisoformat(label.removeprefix("week of "))
    read = prompt = 0
    for f in months.rglob("*.jsonl"):
        for line in f.read_text().splitlines():
            e = json.loads(line)
            u = (e.get("message") or {}).get("usage") if isinstance(e.get("message"), dict) else None
            if u and first <= date.fromisoformat(e["timestamp"][:10]) < first + timedelta(days=7):
                read += u["cache_read_input_tokens"]
                prompt += u["input_tokens"] + u["cache_creation_input_tokens"] + u["cache_read_input_tokens"]
    return read / prompt


def test_report_html_days_for_a_short_range_and_other_past_the_palette(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.htmlkit import write_session

    extra = ("claude-opus-4-6", "claude-opus-4-5", "claude-opus-4-1", "claude-opus-4", "claude-sonnet-4-6",
             "claude-sonnet-4-5", "claude-sonnet-4", "claude-3-7-sonnet", "claude-3-5-sonnet", "claude-haiku-4-5",
             "claude-3-5-haiku", "claude-3-haiku", "claude-3-opus", "claude-3-sonnet", "claude-3-5-sonnet-20240620",
             "claude-opus-4-1-20250805")
    for i, m in enumerate(extra):
        write_session(tmp_path / "in", i, date(2026, 3, 1) + timedelta(days=i * 3), m, turns=1 + i % 2)
    page, _ = _page_of(monkeypatch, "report", tmp_path / "in", "--tz", "UTC", "--html", tmp_path / "r.html")
    cost = page.figures[0]
    assert "Cost by day and model" in _title(cost) and cost.layout.xaxis.title.text == "day"
    names = [t.name for t in cost.data]
    other = [n for n in names if n.startswith("other")]
    assert other and len(set(names)) == len(hr.PALETTE)
    colours = {t.name: t.marker.color for t in cost.data}
    assert colours[other[0]] == hr.OTHER and len(set(colours.values())) == len(colours)


# --------------------------------------------------------------------------------------------- compare


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("cmp")
    months = tmp / "in"
    write_months(months, sessions=COMPARED)     # fewer: each pipeline replays them all
    spec = tmp / "clear.toml"
    spec.write_text('[pipeline]\nname = "clear"\n\n[[stage]]\nuse = "sanitize"\n\n[[stage]]\nuse = "pairing"\n\n'
                    '[[stage]]\nuse = "tombstone"\ntrigger_tokens = 1000\ntrigger_idle_seconds = 0\nkeep_recent = 1\n'
                    'clear_at_least_tokens = 0\nmin_result_chars = 0\n', encoding="utf-8")
    pages: list[hr.Page] = []
    real = hr.write_html
    mp = pytest.MonkeyPatch()
    mp.setattr(hr, "write_html", lambda path, page: (pages.append(page), real(path, page)))
    try:
        r = _cli("compare", months, "--pipeline", "identity", "--pipeline", spec, "--pipeline", "context-editing",
                 "--pipeline", "identity@ttl=1h", "--json", "--html", tmp / "compare.html", "--keep", tmp / "runs")
    finally:
        mp.undo()
    assert r.exit_code == 0, r.output
    return {"page": pages[0], "html": tmp / "compare.html", "doc": json.loads(r.stdout), "run": tmp / "runs" / "1-clear",
            "identity": tmp / "runs" / "0-identity"}


def test_sim_html_over_months(compared: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page, _ = _page_of(monkeypatch, "report", "--sim", compared["run"], "--anchor", compared["identity"],
                       "--html", tmp_path / "sim.html")
    per_session, along, cost = page.figures
    # the anchored estimate leads, with compare's figures: per session (the dearest), bars with their interval
    clear = {r["session_id"][:8]: r for r in compared["doc"]["sessions"] if r["pipeline"].endswith("clear.toml")}
    est = per_session.data[1]
    assert est.name == "estimated" and len(est.x) == hr.TOP_SESSIONS
    for x, y, up, down in zip(est.x, est.y, est.error_y.array, est.error_y.arrayminus, strict=True):
        r = clear[x]
        assert math.isclose(y, r["cost_usd"], abs_tol=2e-6)
        assert math.isclose(y + up, r["cost_usd_high"], abs_tol=2e-6)
        assert math.isclose(y - down, r["cost_usd_low"], abs_tol=2e-6)
    assert any(u > 0 for u in est.error_y.array)
    # recorded and simulated side by side, by week (one unit for both panels), a colour per model
    assert "Cost by week and model" in _title(cost)
    assert {t.xaxis for t in cost.data} == {"x", "x2"}
    assert all(w == 7 * 86_400_000 * 0.8 for t in cost.data for w in t.width)
    colours = {t.name: t.marker.color for t in cost.data}
    assert len(colours) == len(MODELS) and len(set(colours.values())) == len(MODELS)
    assert sum(t.showlegend is not False for t in cost.data) == len(MODELS)     # each model once in the legend
    assert len(per_session.data[0].x) == hr.TOP_SESSIONS and f"of {COMPARED} (the other" in _title(per_session)
    menu = along.layout.updatemenus[0]
    assert menu.x == 0 and menu.xanchor == "left" and len(menu.buttons) == COMPARED
    assert re.fullmatch(r"[0-9a-f]{8} · \d{4}-\d{2}-\d{2} · \d+ calls", menu.buttons[0].label)
    first = [t for t in along.data if t.visible]
    assert len({(t.type, t.name) for t in first}) == len(first) and any(t.name == "break (sim)" and len(t.x) for t in first)


def test_compare_html_a_colour_per_pipeline_and_a_fitted_hit_rate_axis(compared: dict[str, Any]) -> None:
    page, doc = compared["page"], compared["doc"]
    side, per_session, along = page.figures
    labels = [p["label"] for p in doc["pipelines"]]
    rates = [r["cache_hit_rate"] for r in doc["totals"]]
    assert max(rates) - min(rates) < 0.2
    lo, hi = side.layout.yaxis2.range
    assert 0 < lo < min(rates) and max(rates) < hi <= 1
    assert side.data[1].mode == "markers+text"           # dots: the axis does not start at 0
    # the clearing spec breaks the prefix: its hit rate is lower, and by less than a point
    assert rates[1] < rates[0] and doc["totals"][1]["breaks"] > 0
    # the traces along a session: a colour per pipeline, each (colour, kind) once per session
    first = [t for t in along.data if t.visible]
    assert len(first) == 4 * len(labels) > 10
    assert any(t.name == "breaks" and len(t.x) for t in first)
    looks = {(t.legendgroup, t.name) for t in first}
    assert len(looks) == len(first)
    by_pipeline = {t.legendgroup: _colour(t) for t in first if t.name == "prompt"}
    assert list(by_pipeline) == labels and len(set(by_pipeline.values())) == len(labels)
    assert all(_colour(t) == by_pipeline[t.legendgroup] for t in first)
    assert {t.marker.color for t in per_session.data} == set(by_pipeline.values())
    assert len(per_session.data[0].x) == hr.TOP_SESSIONS and f"of {COMPARED} (the other" in _title(per_session)
    # the menu is top left, the toolbar top right
    menu = along.layout.updatemenus[0]
    assert menu.x == 0 and menu.xanchor == "left"
    assert len(menu.buttons) == min(30, len(doc["sessions"]) // len(labels))


def _colour(t: Any) -> str:
    return t.line.color if t.type == "scatter" and t.mode == "lines" else t.marker.color


# --------------------------------------------------------------------------------------------- in Chromium


def _chromium() -> str | None:
    for name in ("chromium-headless-shell", "chrome-headless-shell", "chromium", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


needs_chromium = pytest.mark.skipif(_chromium() is None,
                                    reason="no headless Chromium (apt-get install chromium-headless-shell)")

PROBE = """<script>
window.addEventListener('load', () => setTimeout(() => {
  const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top + scrollY, r.right, r.bottom + scrollY]; };
  const charts = [];
  document.querySelectorAll('div.plotly-graph-div').forEach(div => {
    const q = s => Array.from(div.querySelectorAll(s));
    const fl = div._fullLayout || {};
    const yr = {};
    Object.keys(fl).filter(k => /^yaxis\\d*$/.test(k)).forEach(k => { yr[k] = fl[k].range; });
    charts.push({id: div.id, box: box(div), title: q('.gtitle').map(e => e.textContent).join(' '),
      titleBox: q('.gtitle').map(box), modebar: q('.modebar').map(box),
      menu: q('.updatemenu-header-group').map(box),
      bars: q('.barlayer .point path').map(e => e.getBoundingClientRect().width),
      // each entry's sample (a line, a square, a marker); a group's title has none and is left out
      legend: q('.legend .traces').map(t => {
        const p = t.querySelector('.legendlines path, .legendpoints path, .legendsymbols path');
        if (!p) return null;
        const s = getComputedStyle(p);
        return [t.querySelector('.legendtext').textContent, s.fill, s.stroke, s.strokeDasharray, p.getAttribute('d')];
      }).filter(e => e), yranges: yr});
  });
  const t = document.getElementById('report-table');
  const out = {charts: charts, table: t ? {scroll: t.parentElement.scrollWidth, client: t.parentElement.clientWidth,
                                          rows: t.querySelectorAll('tbody tr').length} : null};
  const pre = document.createElement('pre'); pre.id = 'probe'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}, 300));
</script>"""


def _open(page: Path, tmp: Path, height: int = 2600) -> tuple[dict[str, Any], Path]:
    """Load a copy of the page with the probe; its findings and a screenshot."""
    exe = _chromium()
    assert exe is not None
    copy = tmp / f"probe-{page.name}"
    copy.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    flags = [exe, "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size=1400,{height}",
             "--virtual-time-budget=15000"]
    env = {**os.environ, "HOME": str(tmp)}
    dom = subprocess.run([*flags, "--dump-dom", copy.as_uri()], capture_output=True, text=True, timeout=180, env=env,
                         check=True).stdout
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.DOTALL)
    assert m, "the probe did not run"
    shot = tmp / f"{page.stem}.png"
    subprocess.run([*flags, f"--screenshot={shot}", copy.as_uri()], capture_output=True, timeout=180, env=env,
                   check=True)
    return json.loads(htmllib.unescape(m.group(1))), shot


def _apart(a: list[float], b: list[float]) -> bool:
    return a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]


def _distinct(legend: list[list[str]]) -> bool:
    """Every legend entry looks different: its colour, its dash, its shape (a line, a square, a cross)."""
    looks = [(fill if fill not in ("none", "") else stroke, dash, shape) for _, fill, stroke, dash, shape in legend]
    return len(set(looks)) == len(looks)


def _palette_colours_in(shot: Path, box: list[float]) -> set[str]:
    from PIL import Image

    img = Image.open(shot).convert("RGB").crop(tuple(int(v) for v in box))  # type: ignore[arg-type]
    seen = {f"#{r:02x}{g:02x}{b:02x}" for _, (r, g, b) in img.getcolors(maxcolors=1 << 22) or []}
    return seen & set(hr.PALETTE)


@needs_chromium
def test_report_page_in_chromium(months: Path, tmp_path: Path) -> None:
    r = _cli("report", months, "--tz", "UTC", "--html", tmp_path / "report.html")
    assert r.exit_code == 0, r.output
    probe, shot = _open(tmp_path / "report.html", tmp_path)
    cost, rate, per_session = probe["charts"]
    assert "Cost by week and model" in cost["title"]
    # a week's bar is wide enough to see and to point at (a day's over eight months is 1-4 pixels)
    assert cost["bars"] and min(cost["bars"]) >= 12
    assert len(cost["legend"]) == len(MODELS) and _distinct(cost["legend"])
    # the chart's pixels hold a dozen palette colours (plotly's default has ten)
    assert len(_palette_colours_in(shot, cost["box"])) >= len(MODELS)
    lo, hi = rate["yranges"]["yaxis"]
    assert 0.85 < lo and hi <= 1.0
    assert len(per_session["bars"]) == hr.TOP_SESSIONS
    # the table: a row per session, as wide as the page (no sideways scrolling at 1400 pixels)
    assert probe["table"]["rows"] == SESSIONS and probe["table"]["scroll"] <= probe["table"]["client"]
    for c in probe["charts"]:
        for t in c["titleBox"]:
            assert all(_apart(t, m) for m in c["modebar"]), c["id"]


@needs_chromium
def test_compare_page_in_chromium(compared: dict[str, Any], tmp_path: Path) -> None:
    probe, shot = _open(compared["html"], tmp_path, height=2800)
    side, per_session, along = probe["charts"]
    # the session menu and plotly's toolbar do not overlap, nor the title either of them
    assert along["menu"] and along["modebar"]
    assert all(_apart(m, t) for m in along["menu"] for t in along["modebar"])
    assert all(_apart(m, t) for m in along["menu"] for t in along["titleBox"])
    assert all(_apart(m, t) for m in along["modebar"] for t in along["titleBox"])
    # four pipelines × prompt, cache read, cache write (and breaks where there are some): none alike
    drawn = [t for t in compared["page"].figures[2].data if t.visible and len(t.x)]
    assert len(along["legend"]) == len(drawn) > 12 and _distinct(along["legend"])
    assert len(per_session["legend"]) == 4 and _distinct(per_session["legend"])
    lo, hi = side["yranges"]["yaxis2"]
    rates = [r["cache_hit_rate"] for r in compared["doc"]["totals"]]
    assert 0 < lo < min(rates) and max(rates) < hi <= 1
    assert len(_palette_colours_in(shot, along["box"])) >= 4
