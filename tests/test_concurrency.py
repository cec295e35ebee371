"""Two `ctxreplay run` processes on one ledger or one OUT (issue 8, hardening 3): the second fails at
once with one paragraph naming the holder; nothing is lost or duplicated; a killed run's lock
never blocks the next run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ctxreplay.errors import LockError
from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.core.outdir import RunLock
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.ledger import Ledger
from ctxreplay.pipeline.staging.spec import load_spec
from tests.crashkit import SAMPLES, cli, out_state, popen

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="flock and SIGKILL: Linux only")

ARGS = [SAMPLES, "--preset", "default", "--fast-tokens", "-q"]


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the first run ended early (rc {proc.returncode}): {proc.communicate()[1]}")
        if time.monotonic() > deadline:
            raise AssertionError("the first run never reached its hold point")
        time.sleep(0.05)


def _counts(ledger: Path) -> tuple[int, int, list[int]]:
    led = Ledger(ledger, read_only=True)
    try:
        runs = led.runs().height
        d = led.decisions()
    finally:
        led.close()
    return runs, d.height, sorted(d["seq"].to_list())


def _held(tmp: Path, hold_at: str = "stage:1") -> tuple[subprocess.Popen, Path]:
    hold = tmp / "hold"
    first = popen(["run", *ARGS, "--out", tmp / "o"],
                  env={"CTXREPLAY_HOLD_AT": hold_at, "CTXREPLAY_HOLD_FILE": str(hold)})
    _wait_for(Path(f"{hold}.reached"), first)
    return first, hold


def _one_paragraph(stderr: str) -> str:
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.slow
def test_a_second_run_fails_at_once_naming_the_holder_and_nothing_is_lost(tmp_path: Path) -> None:
    first, hold = _held(tmp_path)
    try:
        t0 = time.monotonic()
        same = cli(["run", *ARGS, "--out", tmp_path / "o"])
        other_out = cli(["run", *ARGS, "--out", tmp_path / "o2", "--ledger", tmp_path / "o" / "ledger.duckdb"])
        other_ledger = cli(["run", *ARGS, "--out", tmp_path / "o", "--ledger", tmp_path / "l2.duckdb"])
        waited = time.monotonic() - t0
    finally:
        Path(f"{hold}.go").touch()
        _, first_err = first.communicate(timeout=120)
    assert first.returncode == 0, first_err
    assert waited < 60  # they failed at once, they did not wait for the first run
    for r, what in ((same, f"the output directory {tmp_path / 'o'}"),
                    (other_out, f"the ledger {tmp_path / 'o' / 'ledger.duckdb'}"),
                    (other_ledger, f"the output directory {tmp_path / 'o'}")):
        assert r.returncode == 2
        line = _one_paragraph(r.stderr)
        assert line.startswith(f"ctxreplay: {what} is in use by another ctxreplay run: pid {first.pid} on "
                               f"{socket.gethostname()}, started "), line
        assert "command `" in line and "run " in line and "Wait for it to finish" in line
    assert not (tmp_path / "o2").exists() and not (tmp_path / "l2.duckdb").exists()
    # the first run's results are all there, once
    ledger = tmp_path / "o" / "ledger.duckdb"
    runs, decisions, seqs = _counts(ledger)
    assert runs == 1 and decisions > 0 and seqs == list(range(decisions))
    first_out = out_state(tmp_path / "o")
    # the refused run, run again now, reuses every decision: nothing duplicated
    again = cli(["run", *ARGS, "--out", tmp_path / "o"])
    assert again.returncode == 0, again.stderr
    assert _counts(ledger) == (2, decisions, seqs)
    second_out = out_state(tmp_path / "o")
    assert (second_out.calls, second_out.decisions) == (first_out.calls, first_out.decisions)


def test_a_killed_run_never_blocks_the_next_one(tmp_path: Path) -> None:
    first, _ = _held(tmp_path, hold_at="write:2")
    lock = tmp_path / "o" / ".lock"
    assert json.loads(lock.read_text())["pid"] == first.pid
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=30)
    assert json.loads(lock.read_text())["pid"] == first.pid  # its details stay in the file ...
    t0 = time.monotonic()
    nxt = cli(["run", *ARGS, "--out", tmp_path / "o"])
    assert nxt.returncode == 0, nxt.stderr  # ... but the lock went with the process
    assert time.monotonic() - t0 < 60
    shown = out_state(tmp_path / "o")
    assert [d.name for d in (tmp_path / "o" / ".runs").iterdir()] == [shown.run_id]  # its staging is gone
    assert _counts(tmp_path / "o" / "ledger.duckdb")[0] == 1


@pytest.mark.slow
def test_two_runs_started_together_serialise_or_refuse(tmp_path: Path) -> None:
    single = tmp_path / "single"
    run([SAMPLES], load_spec(preset="default"), RunOptions(out_dir=single, token_counter=CHARS4_COUNTER))
    _, decisions, _ = _counts(single / "ledger.duckdb")
    procs = [popen(["run", *ARGS, "--out", tmp_path / "o"]) for _ in range(2)]
    results = [(p.communicate(timeout=120)[1], p.returncode)[::-1] for p in procs]
    ok = [rc for rc, _ in results if rc == 0]
    refused = [err for rc, err in results if rc == 2]
    assert len(ok) + len(refused) == 2 and ok, results
    for err in refused:
        assert "is in use by another ctxreplay run: pid " in _one_paragraph(err)
    runs, got, seqs = _counts(tmp_path / "o" / "ledger.duckdb")
    assert (runs, got, seqs) == (len(ok), decisions, list(range(decisions)))


def test_a_lock_file_naming_a_dead_process_does_not_block(tmp_path: Path) -> None:
    dead = subprocess.run(["true"], check=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    out = tmp_path / "o"
    out.mkdir()
    (out / ".lock").write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(),
                                           "started_at": "2026-01-01T00:00:00+00:00", "command": "ctxreplay run"}))
    res = run([SAMPLES], load_spec(preset="identity"), RunOptions(out_dir=out, token_counter=CHARS4_COUNTER))
    assert res.summary["calls"] > 0 and dead.returncode == 0


def test_the_message_says_when_the_named_holder_is_dead(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    msg = RunLock(tmp_path / ".lock", "the output directory o")._held_message(
        {"pid": gone.pid, "host": socket.gethostname(), "started_at": "t", "command": "ctxreplay run x"})
    assert f"Pid {gone.pid} is no longer running, yet the lock is held" in msg
    alive = RunLock(tmp_path / ".lock", "o")._held_message({"pid": os.getpid(), "host": socket.gethostname()})
    assert "no longer running" not in alive


def test_an_in_process_holder_is_named(tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    with RunLock(out / ".lock", "the output directory"), pytest.raises(LockError, match=f"pid {os.getpid()} on "):
        run([SAMPLES], load_spec(preset="identity"), RunOptions(out_dir=out, token_counter=CHARS4_COUNTER))
