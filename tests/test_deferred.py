"""Polars imported at its first use by the command line (ctxreplay/deferred.py): the stand-in's
semantics on probe modules of our own, and the run it is for, a re-run that reuses every output,
which does not import polars at all and returns and writes what it did before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest

from ctxreplay import deferred
from ctxreplay.pipeline.batch.runner import RunOptions, _call_counts, run
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A package `ctxreplay_defer_probe` (a submodule `sub`) that appends a line to a file each time
    its body runs, and sleeps a little there (so that threads meet inside the import)."""
    name = "ctxreplay_defer_probe"
    pkg = tmp_path / name
    pkg.mkdir()
    log = tmp_path / "imports.log"
    (pkg / "__init__.py").write_text(
        f"import time\nwith open({str(log)!r}, 'a') as f:\n    f.write('package\\n')\ntime.sleep(0.05)\n"
        "VALUE = 42\ndef double(x):\n    return 2 * x\n")
    (pkg / "sub.py").write_text("from ctxreplay_defer_probe import VALUE\nSUB = VALUE + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, log
    for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[m]


def _runs(log: Path) -> int:
    return log.read_text().count("package") if log.exists() else 0


def test_import_binds_the_stand_in_and_the_first_attribute_imports_the_module_once(probe: tuple[str, Path]) -> None:
    name, log = probe
    assert deferred.defer(name)
    mod = __import__(name)
    again = __import__(name)  # a second `import` (importlib.util.LazyLoader ran the import here)
    assert _runs(log) == 0 and not deferred.is_loaded(name)
    assert mod is again and isinstance(mod, deferred.Deferred)
    assert mod.VALUE == 42 and mod.double(4) == 8
    assert _runs(log) == 1 and deferred.is_loaded(name)
    assert "VALUE" in mod.__dict__  # copied: later reads are plain attributes
    assert sys.modules[name] is not mod and sys.modules[name].VALUE == 42  # the real module took its place
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = mod.no_such_name
    assert _runs(log) == 1


def test_from_import_and_a_submodule_import_the_real_module(probe: tuple[str, Path]) -> None:
    name, log = probe
    deferred.defer(name)
    ns: dict[str, object] = {}
    exec(f"from {name}.sub import SUB\nfrom {name} import double", ns)  # noqa: S102 - a fixed probe
    assert ns["SUB"] == 43 and callable(ns["double"])
    assert _runs(log) == 1


def test_threads_that_read_at_once_import_the_module_once(probe: tuple[str, Path]) -> None:
    name, log = probe
    deferred.defer(name)
    mod = __import__(name)
    start = threading.Barrier(8)
    seen: list[int] = []

    def read() -> None:
        start.wait()
        seen.append(mod.VALUE)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [42] * 8
    assert _runs(log) == 1


def test_an_import_that_fails_raises_each_time_and_leaves_the_stand_in(probe: tuple[str, Path]) -> None:
    name, log = probe
    (log.parent / name / "__init__.py").write_text("raise ImportError('the probe cannot be imported')\n")
    deferred.defer(name)
    mod = __import__(name)
    for _ in range(2):
        with pytest.raises(ImportError, match="cannot be imported"):
            _ = mod.VALUE
        assert sys.modules[name] is mod and not deferred.is_loaded(name)


def test_defer_does_nothing_for_a_module_imported_already_missing_or_dotted(probe: tuple[str, Path]) -> None:
    name, _ = probe
    assert not deferred.defer("polars")  # imported by this test process: it stays the real module
    assert not isinstance(sys.modules["polars"], deferred.Deferred)
    assert not deferred.defer("ctxreplay_no_such_module_here")
    assert "ctxreplay_no_such_module_here" not in sys.modules
    assert not deferred.defer(f"{name}.sub")
    assert deferred.is_loaded("polars") and not deferred.is_loaded(name)


# the command: a cold run imports polars, a re-run that reuses every output does not
_CLI = """
import atexit, sys
from ctxreplay import deferred
atexit.register(lambda: sys.stderr.write(f"polars imported: {deferred.is_loaded('polars')}\\n"))
from ctxreplay.entry import main
sys.argv = ["ctxreplay", *sys.argv[1:]]
main()
"""


def _cli_run(out: Path) -> tuple[dict[str, object], bool]:
    r = subprocess.run([sys.executable, "-c", _CLI, "run", str(SAMPLES), "--out", str(out), "--json", "-q",
                        "--fast-tokens"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    loaded = r.stderr.strip().splitlines()[-1]
    assert loaded.startswith("polars imported: "), r.stderr
    return json.loads(r.stdout), loaded.endswith("True")


def _same_run(summary: dict[str, object]) -> dict[str, object]:
    """What a re-run with nothing to do repeats: all but its id and times, which groups it reused,
    and what it did afresh (the stages' new and reused decisions, the texts it counted)."""
    return {k: v for k, v in summary.items()
            if k not in ("run_id", "seconds", "timings_seconds", "groups", "decisions_by_stage", "tokens")}


def test_a_re_run_that_reuses_every_output_does_not_import_polars(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cold, cold_loaded = _cli_run(out)
    warm, warm_loaded = _cli_run(out)
    assert cold_loaded, "the first run computes frames: it imports polars"
    assert warm["groups"]["reused"] == warm["groups"]["total"] > 0  # type: ignore[index]
    assert not warm_loaded, "a re-run that reused every output imported polars"
    assert _same_run(warm) == _same_run(cold)
    assert warm["decisions_by_stage"].keys() == cold["decisions_by_stage"].keys()  # type: ignore[attr-defined]
    assert warm["versions"]["polars"] == pl.__version__  # type: ignore[index]


def test_a_run_that_reuses_every_output_returns_the_same_frames(tmp_path: Path) -> None:
    """RunResult's calls and decisions, read back as Arrow tables by a run that reused every
    output, are the frames the first run returned, column types included (the decisions in the
    order of decisions.parquet, as before: the first run returns them in the order it applied them)."""
    opts = RunOptions(out_dir=tmp_path / "out", token_counter=CHARS4_COUNTER)
    first = run([SAMPLES], load_spec(), opts)
    again = run([SAMPLES], load_spec(), opts)
    assert again.summary["groups"]["reused"] == again.summary["groups"]["total"]
    assert again.calls.schema == first.calls.schema and again.calls.equals(first.calls)
    assert first.decisions is not None and again.decisions is not None
    assert again.decisions.schema == first.decisions.schema
    assert again.decisions.equals(pl.read_parquet(opts.out_dir / "decisions.parquet"))
    assert again.decisions.sort(again.decisions.columns).equals(first.decisions.sort(first.decisions.columns))
    assert first.calls.height and first.decisions.height


@pytest.mark.parametrize("rows", [
    [],
    [("s1", False), ("s1", True), ("s2", False), ("s2", False), ("s3", True)],
    [("s1", False)],
])
def test_the_call_counts_are_the_same_from_a_frame_and_from_an_arrow_table(rows: list[tuple[str, bool]]) -> None:
    frame = pl.DataFrame({"session_id": [s for s, _ in rows], "is_pending": [p for _, p in rows]},
                         schema={"session_id": pl.String, "is_pending": pl.Boolean})
    table = pa.table({"session_id": pa.array([s for s, _ in rows], pa.string()),
                      "is_pending": pa.array([p for _, p in rows], pa.bool_())})
    counts = _call_counts(frame)
    assert _call_counts(table) == counts
    assert counts == (len(rows), sum(p for _, p in rows), len({s for s, _ in rows}))
