"""`--engine ray` without the `ray` extra, `--address` without `--engine ray`: clear errors before
anything is written; and the Ray engine's error paths that need no Ray (default suite: no Ray)."""

from __future__ import annotations

import pickle
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctxreplay.errors import CheckFailed, CtxReplayError, InputError, OutputError, StageFailed
from ctxreplay.pipeline.batch.batches import Group
from ctxreplay.pipeline.batch.batchrun import BatchCounter, Env
from ctxreplay.pipeline.batch.rayengine import _check_visible, _portable, _take
from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec

SAMPLES = Path(__file__).resolve().parent.parent / "data" / "samples"


def test_engine_ray_without_ray_installed_says_how_to_install_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    monkeypatch.setitem(sys.modules, "ray.data", None)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["run", str(SAMPLES), "--out", str(out), "--engine", "ray"])
    assert r.exit_code == 2, r.output
    assert "--engine ray needs Ray Data, which is not installed" in r.output
    assert "pip install 'ctxreplay[ray]'" in r.output and "Traceback" not in r.output
    assert not out.exists()
    # the local engine does not need it
    r = CliRunner().invoke(main, ["run", str(SAMPLES), "--out", str(out), "--fast-tokens", "-q"])
    assert r.exit_code == 0, r.output


def test_address_needs_engine_ray(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["run", str(SAMPLES), "--out", str(out), "--address", "127.0.0.1:6379"])
    assert r.exit_code == 2
    assert "--address 127.0.0.1:6379 joins a Ray cluster: it needs --engine ray" in r.output
    assert not out.exists()


def test_engine_is_a_choice(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["run", str(SAMPLES), "--out", str(tmp_path / "o"), "--engine", "spark"])
    assert r.exit_code == 2
    assert "ctxreplay: unknown engine 'spark'. Engines: local, ray" in r.output


# ------------------------------------------------------------------ the engine's error paths, without Ray


def _env(staging: Path) -> Env:
    return Env(load_spec(preset="identity"), "anthropic", staging, staging, False, True, lambda s: None,
               BatchCounter(CHARS4_COUNTER), None)


def test_a_worker_that_cannot_see_an_input_or_out_says_they_must_be_on_a_shared_path(tmp_path: Path) -> None:
    present = tmp_path / "a.jsonl"
    present.write_text("{}\n")
    env = _env(tmp_path)
    _check_visible([Group([present])], env)  # all there: nothing to say
    with pytest.raises(InputError, match=r"b\.jsonl: not found by the Ray worker on node .*input files must be "
                                         r"on a shared path"):
        _check_visible([Group([present]), Group([tmp_path / "b.jsonl"])], env)
    with pytest.raises(OutputError, match=r"not visible to the Ray worker .*--out must be on a shared path"):
        _check_visible([Group([present])], _env(tmp_path / "gone"))


def test_a_worker_error_reaches_the_driver_as_itself_and_a_bug_as_an_internal_error(tmp_path: Path) -> None:
    env = _env(tmp_path)
    # StageFailed does not survive pickling as itself (its __init__ takes more than the message)
    failed = StageFailed("snip", 3, ValueError("boom"))
    for exc, kind in ((InputError("x.jsonl: unreadable"), InputError), (failed, CtxReplayError)):
        back = _portable(exc)
        assert type(back) is kind and str(back) == str(exc)
        with pytest.raises(kind, match=re.escape(str(exc))):
            _take(("error", pickle.loads(pickle.dumps(back))), env, None)
    with pytest.raises(CheckFailed, match=r"internal error in a Ray worker \(WorkerBug: KeyError: 'k'"):
        _take(("bug", "KeyError: 'k'", "Traceback ...\nKeyError: 'k'\n"), env, None)
