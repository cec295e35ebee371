"""pytest plugin: the `ctxreplay_golden` fixture, golden files of assembled requests in a test.

```python
def test_policy(ctxreplay_golden):
    ctxreplay_golden.check("sessions/", pipeline="policy.toml")
```

`check` replays the sessions with the pipeline and compares every request with the goldens, as
`ctxreplay diff` does; when anything differs the test fails with the same report as its
assertion message. `pytest --ctxreplay-update` (re)writes the goldens instead. Relative paths
are read from pytest's rootdir (where a CI job runs `ctxreplay diff`); the goldens go to
`<test file's directory>/__ctxreplay__/<test file stem>/<test name>/` unless `golden=` says where.

Registered through the `pytest11` entry point `ctxreplay`, so it loads wherever ctxreplay is
installed (`-p no:ctxreplay` turns it off; `-p ctxreplay.pipeline.regress.pytest_plugin` loads it where plugin
autoloading is off). Importing this module loads only pytest and the standard library.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

UPDATE_OPTION = "--ctxreplay-update"
_UPDATED = pytest.StashKey[list[str]]()
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ctxreplay", "ctxreplay golden requests")
    group.addoption(UPDATE_OPTION, action="store_true", default=False,
                    help="rewrite the goldens of ctxreplay_golden.check() from the current replay instead of "
                         "comparing with them")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_UPDATED] = []


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    updated = config.stash.get(_UPDATED, [])
    if updated:
        terminalreporter.write_sep("-", "ctxreplay")
        checks = "1 check" if len(updated) == 1 else f"{len(updated)} checks"
        terminalreporter.write_line(f"ctxreplay: wrote the goldens of {checks}: review them like code")
        for path in updated:
            terminalreporter.write_line(f"  {path}")


class CtxReplayGolden:
    """What the `ctxreplay_golden` fixture gives a test: `check(paths, pipeline=... | preset=...)`."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        self._checks = 0
        self.update: bool = bool(request.config.getoption(UPDATE_OPTION))
        self.rootdir = Path(request.config.rootpath)

    def default_dir(self) -> Path:
        """`<test file's directory>/__ctxreplay__/<test file stem>/<test name>` (`-2`, `-3` for the
        second and third check of one test)."""
        node = self._request.node
        path = Path(node.path)
        name = _UNSAFE.sub("_", node.name).strip("_") or "test"
        if self._checks > 1:
            name += f"-{self._checks}"
        return path.parent / "__ctxreplay__" / path.stem / name

    def _path(self, p: str | Path) -> Path:
        p = Path(p)
        return p if p.is_absolute() else self.rootdir / p

    def check(self, paths: str | Path | Sequence[str | Path], *, pipeline: str | Path | None = None,
              preset: str | None = None, target: str | None = None, golden: str | Path | None = None,
              fast_tokens: bool = False, prices: str | Path | None = None) -> Any:
        """Replay `paths` with the pipeline (a spec file or a preset; default: the `default` preset)
        and compare every request with the goldens. Fails the test with the diff report when they
        differ, or when there are no goldens yet (write them with --ctxreplay-update); returns the
        report (ctxreplay.pipeline.regress.diff.DiffReport) otherwise (None when --ctxreplay-update wrote goldens where
        there were none). `fast_tokens` counts ceil(chars/4) tokens in
        goldens written now (a comparison counts as the goldens did)."""
        __tracebackhide__ = True
        from ctxreplay.errors import CtxReplayError
        from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER, TIKTOKEN_COUNTER
        from ctxreplay.pipeline.regress.diff import render_text, run_diff
        from ctxreplay.pipeline.regress.snapshot import GoldenError
        from ctxreplay.pipeline.staging.spec import load_spec

        self._checks += 1
        items = [paths] if isinstance(paths, (str, Path)) else list(paths)
        where = self._path(golden) if golden is not None else self.default_dir()
        problem = None
        try:
            spec = load_spec(self._path(pipeline) if pipeline is not None else None, preset=preset)
            report = run_diff([self._path(p) for p in items], spec, where, target=target, update=self.update,
                              prices=self._path(prices) if prices is not None else None,
                              token_counter=CHARS4_COUNTER if fast_tokens else TIKTOKEN_COUNTER)
        except GoldenError as exc:
            if not (where / "manifest.json").is_file() and not self.update:
                problem = (f"ctxreplay: no goldens at {where} yet: run pytest with {UPDATE_OPTION} to write them "
                           f"from this replay, review them and commit them")
            else:
                problem = f"ctxreplay could not compare: {exc}"
        except CtxReplayError as exc:
            problem = f"ctxreplay could not run: {exc}"
        if problem is not None:  # outside the except: no chained traceback in the failure
            pytest.fail(problem, pytrace=False)
        if self.update:
            self._request.config.stash[_UPDATED].append(str(where))
            return report
        assert report is not None
        if not report.identical:
            raise AssertionError(render_text(report))
        return report


@pytest.fixture
def ctxreplay_golden(request: pytest.FixtureRequest) -> CtxReplayGolden:
    """Compare a replay of recorded sessions with golden requests: `ctxreplay_golden.check(paths,
    pipeline="policy.toml")`; `pytest --ctxreplay-update` rewrites the goldens."""
    return CtxReplayGolden(request)
