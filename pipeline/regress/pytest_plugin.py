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

Unused goldens (as syrupy reports unused snapshots): at the end of the session, a golden directory
under `__ctxreplay__/<test file stem>/` that no check used is reported when no test of that file
has its name any more (a test renamed or removed; the whole directory when the test file is
gone), or when the test it belongs to passed without using it (a second check removed). A golden
of a test that was deselected, skipped or failed is left alone. `--ctxreplay-update` deletes them.
With pytest-xdist the workers send what they collected to the controller, which decides.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

UPDATE_OPTION = "--ctxreplay-update"
GOLDENS = "__ctxreplay__"
_PROPERTY = "ctxreplay_golden"  # a test's user property: the golden directory a check used
_UPDATED = pytest.StashKey[list[str]]()
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ctxreplay", "ctxreplay golden requests")
    group.addoption(UPDATE_OPTION, action="store_true", default=False,
                    help="rewrite the goldens of ctxreplay_golden.check() from the current replay instead of "
                         "comparing with them, and delete the goldens no test uses any more")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_UPDATED] = []
    config.pluginmanager.register(_Goldens(config), "ctxreplay-goldens")


def _golden_name(name: str) -> str:
    return _UNSAFE.sub("_", name).strip("_") or "test"


class _Goldens:
    """The session's record of goldens: which ones checks used (a test's user property, so that it
    reaches the pytest-xdist controller in the test's reports), how each test ended, and every test
    collected (deselected ones apart); at the end, the unused goldens."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.used: set[str] = set()
        self.outcomes: dict[str, str] = {}  # nodeid -> passed | failed | skipped
        self.collected: dict[str, dict[str, list[str]]] = {}  # test file -> {golden name: [nodeid]}
        self.deselected: set[str] = set()

    def _record(self, items: Sequence[pytest.Item], deselected: bool) -> None:
        for item in items:
            path = getattr(item, "path", None)
            if path is None or Path(path).suffix != ".py":
                continue
            names = self.collected.setdefault(str(Path(path).resolve()), {})
            names.setdefault(_golden_name(item.name), []).append(item.nodeid)
            if deselected:
                self.deselected.add(item.nodeid)

    def pytest_deselected(self, items: Sequence[pytest.Item]) -> None:
        self._record(items, deselected=True)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._record(session.items, deselected=False)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == _PROPERTY:
                self.used.add(str(value))
        if report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome
        elif report.when == "call":
            self.outcomes.setdefault(report.nodeid, "passed")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        out = getattr(self.config, "workeroutput", None)
        if out is not None:  # a pytest-xdist worker: what it collected goes to the controller
            out["ctxreplay_collected"] = {"collected": self.collected, "deselected": sorted(self.deselected)}

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """pytest-xdist, in the controller: a worker's collection (each worker collects every test)."""
        got = (getattr(node, "workeroutput", None) or {}).get("ctxreplay_collected")
        if not got:
            return
        for path, names in got["collected"].items():
            mine = self.collected.setdefault(path, {})
            for name, ids in names.items():
                mine[name] = sorted(set(mine.get(name, [])) | set(ids))
        self.deselected |= set(got["deselected"])

    def unused(self) -> list[Path]:
        """The golden directories of the default layout that no test of this session uses any more."""
        unused: list[Path] = []
        dirs: set[Path] = set()
        for path_s, names in sorted(self.collected.items()):
            path = Path(path_s)
            dirs.add(path.parent)
            base = path.parent / GOLDENS / path.stem
            if not base.is_dir():
                continue
            for d in sorted(p for p in base.iterdir() if (p / "manifest.json").is_file()):
                owners = names.get(d.name) or names.get(re.sub(r"-\d+$", "", d.name)) or []
                if not owners:
                    unused.append(d)  # no test of that file has its name: renamed or removed
                elif all(n not in self.deselected and self.outcomes.get(n) == "passed" for n in owners) and \
                        str(d.resolve()) not in self.used:
                    unused.append(d)  # its test ran through and did not check it
        for parent in sorted(dirs):
            root = parent / GOLDENS
            if not root.is_dir():
                continue
            for stem in sorted(p for p in root.iterdir() if p.is_dir()):
                if not (parent / f"{stem.name}.py").exists():  # the test file is gone
                    unused += sorted(p for p in stem.iterdir() if (p / "manifest.json").is_file())
        return unused

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        config = self.config
        if hasattr(config, "workerinput"):  # a pytest-xdist worker sees its own tests only: the controller decides
            return
        updated = config.stash.get(_UPDATED, [])
        unused = self.unused()
        if not updated and not unused:
            return
        terminalreporter.write_sep("-", "ctxreplay")
        if updated:
            checks = "1 check" if len(updated) == 1 else f"{len(updated)} checks"
            terminalreporter.write_line(f"ctxreplay: wrote the goldens of {checks}: review them like code")
            for path in updated:
                terminalreporter.write_line(f"  {path}")
        if not unused:
            return
        n = f"{len(unused)} unused golden" + ("s" if len(unused) > 1 else "")
        them = "it" if len(unused) == 1 else "them"
        if config.getoption(UPDATE_OPTION):
            for d in unused:
                _delete(d)
            terminalreporter.write_line(f"ctxreplay: deleted {n} (no test checks {them} any more):")
        else:
            terminalreporter.write_line(f"ctxreplay: {n} (no test checks {them} any more: a test renamed or "
                                        f"removed); pytest {UPDATE_OPTION} deletes {them}:")
        root = Path(config.rootpath)
        for d in unused:
            terminalreporter.write_line(f"  {d.relative_to(root) if d.is_relative_to(root) else d}")


def _delete(d: Path) -> None:
    shutil.rmtree(d)
    for parent in (d.parent, d.parent.parent):  # __ctxreplay__/<stem>, __ctxreplay__: when left empty
        try:
            parent.rmdir()
        except OSError:
            break


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
        self._request.node.user_properties.append((_PROPERTY, str(where.resolve())))  # used: not reported unused
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
