"""The example plug-in examples/redact-secrets, installed through its entry point and run.

"Installed" without pip or network: the test writes the `.dist-info` that `pip install` would
(METADATA, top_level.txt, and entry_points.txt taken from the example's own pyproject.toml) into a
temporary directory, and puts it and the package's source on sys.path, the way a site-packages
directory is found; `importlib.metadata` then sees the distribution and its entry point like any
installed one. (`pip install --no-deps --no-build-isolation -e examples/redact-secrets` does the
same for real, and needs setuptools in the environment.)
"""

from __future__ import annotations

import json
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.commands.cli import main as cli
from ctxreplay.pipeline.stageapi.registry import PLUGIN_ERRORS, STAGES, get_stage, reload_plugins
from ctxreplay.testkit import check_golden

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "redact-secrets"
SECRET = "sk-ant-api03-" + "Q" * 40


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    site = tmp_path_factory.mktemp("site")
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    (info / "top_level.txt").write_text("redact_secrets\n")
    eps = project["entry-points"]
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) for group, items in eps.items()))
    added = [str(site), str(EXAMPLE / "src")]
    sys.path[:0] = added
    reload_plugins()
    yield
    for p in added:
        sys.path.remove(p)
    STAGES.pop("redact_secrets", None)
    for m in [m for m in sys.modules if m == "redact_secrets" or m.startswith("redact_secrets.")]:
        del sys.modules[m]
    reload_plugins()


def test_the_entry_point_registers_the_stage_with_its_owner(installed: None) -> None:
    st = get_stage("redact_secrets")
    assert (st.owner, st.owner_version, st.is_builtin, st.requires) == ("redact-secrets", "0.1.0", False,
                                                                          ("sanitize",))
    assert not PLUGIN_ERRORS
    r = CliRunner().invoke(cli, ["stages", "--json"])
    (doc,) = [s for s in json.loads(r.stdout)["stages"] if s["name"] == "redact_secrets"]
    assert doc["owner"] == "redact-secrets" and doc["owner_version"] == "0.1.0"


def test_its_golden_cases_pass(installed: None) -> None:
    cases = sorted(p for p in (EXAMPLE / "tests" / "golden").iterdir() if p.is_dir())
    assert cases
    for case in cases:
        check_golden(case, "redact_secrets")


def _spec(tmp_path: Path) -> Path:
    p = tmp_path / "spec.toml"
    p.write_text('[pipeline]\nname = "redacted"\n[[stage]]\nuse = "sanitize"\n[[stage]]\nuse = "redact_secrets"\n'
                 'time_budget_seconds = 300\n[[stage]]\nuse = "pairing"\n')
    return p


def test_it_masks_a_secret_in_a_replayed_session(installed: None, tmp_path: Path) -> None:
    from tests.test_branch_causality import Writer

    w = Writer()
    u = w.user(None, f"use the key {SECRET} for the deploy")
    r = w.call(u, "Bash", 200)
    w.answer(r, "deployed")
    f = w.write(tmp_path / "in" / "session.jsonl")
    res = CliRunner().invoke(cli, ["run", str(f), "--pipeline", str(_spec(tmp_path)), "--out", str(tmp_path / "o"),
                                   "--fast-tokens", "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["stage_failures"] == [] and s["decisions"]["redact_secrets"] == 1
    (req,) = (tmp_path / "o" / "current" / "requests").glob("*.json")
    text = req.read_text()
    assert SECRET not in text and "[REDACTED anthropic-key]" in text


@pytest.mark.slow
@pytest.mark.corpus
def test_it_runs_on_the_corpus_from_its_entry_point(installed: None, corpus: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["run", str(corpus), "--pipeline", str(_spec(tmp_path)), "--out",
                                   str(tmp_path / "o"), "--fast-tokens", "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["stage_failures"] == [] and "redact_secrets" in s["decisions_by_stage"]
    dec = pl.read_parquet(tmp_path / "o" / "current" / "decisions.parquet").filter(
        pl.col("stage") == "redact_secrets")
    assert set(dec["reason"]) <= {"secret"}
    blocks = pl.read_parquet(tmp_path / "o" / "current" / "blocks.parquet")
    from redact_secrets.stage import PATTERNS

    looked_at = blocks.filter(((pl.col("role") == "user") & (pl.col("block_type") == "text"))
                              | (pl.col("block_type") == "tool_result"))
    for kind, pattern in PATTERNS.items():  # nothing left to mask in what it looks at
        assert looked_at.filter(pl.col("text").str.contains(pattern).fill_null(False)).height == 0, kind


def test_its_live_rule_takes_the_live_path_in_the_engine(installed: None, tmp_path: Path) -> None:
    # a plug-in with a live rule (@stage(live=...)): steps without a secret take the live path, the
    # step that appends one is a full pass for the reason its rule gives; every request is the one
    # of an engine doing a full pass at every step (and the secret never reaches a request)
    from datetime import UTC, datetime

    from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
    from ctxreplay.pipeline.engine.engine import Engine
    from tests.cckit import CCSession

    sid = "0e1e2f30-4b3d-4e5f-8a6b-1c2d3e4f5a6b"
    s = CCSession(sid, datetime(2026, 6, 1, 8, 0, tzinfo=UTC))
    s.user("Deploy it, please.")
    for k in range(1, 7):
        s.tool_call(k, "Bash", 300)
        if k == 3:
            s.answer(100, "Which key?")
            s.user(f"use the key {SECRET} for the deploy")

    def feed(live: bool) -> list:
        out = []
        with Engine.open(_spec(tmp_path), tmp_path / f"e-{live}.duckdb", token_counter=CHARS4_COUNTER) as eng:
            eng.live_path = live
            for i, e in enumerate(s.entries):
                if i and e["type"] == "assistant":
                    out.append(eng.assemble(sid, model="claude-x"))
                eng.ingest(sid, [e])
            out.append(eng.assemble(sid, awaiting_user=True))
        return out

    got, full = feed(True), feed(False)
    assert [r.request_sha256 for r in got] == [r.request_sha256 for r in full]
    secret = next(i for i, r in enumerate(got) if b"[REDACTED anthropic-key]" in r.request_json)
    reasons = [r.full_pass_reason for r in got]
    # past the first calls (a file's format is sniffed from its first 5 entries), the one full pass
    # is the step that appends the secret; the next step is live again
    assert [(i, r) for i, r in enumerate(reasons) if r is not None and "fewer than 5" not in r] == [
        (secret, "redact_secrets: a secret to mask in a new row")], reasons
    assert got[secret + 1].incremental and got[-1].incremental
    assert all(SECRET.encode() not in r.request_json for r in got)
