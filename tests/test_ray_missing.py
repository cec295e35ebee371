"""`--engine ray` without the `ray` extra, and `--address` without `--engine ray`: clear errors
before anything is written (default suite: no Ray needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main

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
