"""`ctxreplay run --engine ray` (issue 10 point 6): the same outputs and ledger as the local engine.

Slow (a local Ray takes seconds to start) and skipped when the `ray` extra is not installed
(`pip install -e '.[test,ray]'`; CI's slow pass installs it and sets CTXREPLAY_REQUIRE_RAY=1, which
turns the skip into a failure). The Ray of these tests listens on 127.0.0.1 only, with 2 CPUs, no
dashboard, a 200 MB object store, and is shut down at the end of the module.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pytest
from click.testing import CliRunner

from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.commands.cli import main
from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER
from ctxreplay.pipeline.staging.spec import load_spec
from tests.test_scale import _ledger_rows, _outputs, _same_outputs, _stage_counts, _summary_core

# Ray's own modules warn about their own deprecated defaults; ctxreplay's warnings stay errors
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings(r"ignore::DeprecationWarning:ray\..*")]

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
FIXTURES = ROOT / "tests" / "fixtures" / "loaders"
OBJECT_STORE_MB = 200


def _need_ray() -> Any:
    from ctxreplay.pipeline.batch.rayengine import _local_only

    _local_only()  # before the import: a local Ray on 127.0.0.1 only
    try:
        import ray
        import ray.data
    except ImportError:
        if os.environ.get("CTXREPLAY_REQUIRE_RAY") == "1":
            pytest.fail("CTXREPLAY_REQUIRE_RAY=1 but the ray extra is not installed")
        pytest.skip("the `ray` extra is not installed (pip install -e '.[test,ray]')")
    return ray


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Any]:
    """One local Ray for the module; the runs below find it initialised and use it as it is."""
    ray = _need_ray()
    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=OBJECT_STORE_MB << 20, log_to_driver=False, logging_level="ERROR")
    try:
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
        yield ray
    finally:
        ray.shutdown()


def _run(paths: list[Path], out: Path, **kw: Any) -> dict[str, Any]:
    return run(paths, load_spec(preset="default"), RunOptions(out_dir=out, token_counter=CHARS4_COUNTER,
                                                              **kw)).summary


def _hashes(out: Path) -> list[tuple[str, str, int, str]]:
    calls = pl.read_parquet(out / "calls.parquet").sort("session_id", "thread_id", "call")
    return list(calls.select("session_id", "thread_id", "call", "request_sha256").iter_rows())


def _same_run(local: tuple[dict[str, Any], Path], ray: tuple[dict[str, Any], Path]) -> None:
    (a, out_a), (b, out_b) = local, ray
    assert _hashes(out_a / "current") == _hashes(out_b / "current")  # every call's request_sha256
    # texts_counted is not compared: each worker counts the texts of its batches (as --jobs workers)
    assert _summary_core(a, "tokens") == _summary_core(b, "tokens")
    assert _stage_counts(a) == _stage_counts(b)
    assert {k: v for k, v in a["cache_sim"].items() if k != "seconds"} == \
        {k: v for k, v in b["cache_sim"].items() if k != "seconds"}
    _same_outputs(out_a / "current", out_b / "current")
    assert _ledger_rows(out_a / "ledger.duckdb") == _ledger_rows(out_b / "ledger.duckdb")


def test_ray_engine_equals_the_local_engine_on_the_samples(local_ray: Any, tmp_path: Path) -> None:
    inputs = [SAMPLES, FIXTURES]
    local = _run(inputs, tmp_path / "local", batch_bytes=20_000, jobs=1)
    ray = _run(inputs, tmp_path / "ray", batch_bytes=20_000, jobs=2, engine="ray")
    assert ray["groups"]["batches"] > 3 and ray["calls"] > 20
    _same_run((local, tmp_path / "local"), (ray, tmp_path / "ray"))
    assert local_ray.is_initialized()  # a caller's Ray is left up

    # a re-run after a grown file: its group runs again on Ray, the others are reused
    f = next((SAMPLES / "claude-projects").rglob("5f0c1d2e-*.jsonl"))
    for name in ("local", "ray"):
        tree = tmp_path / f"tree-{name}"
        shutil.copytree(SAMPLES, tree)
        grown = tree / f.relative_to(SAMPLES)
        grown.write_bytes(f.read_bytes() + f.read_bytes().splitlines(keepends=True)[-1])
    a = _run([tmp_path / "tree-local"], tmp_path / "local", batch_bytes=20_000, jobs=1)
    b = _run([tmp_path / "tree-ray"], tmp_path / "ray", batch_bytes=20_000, jobs=2, engine="ray")
    assert a["groups"]["new"] == b["groups"]["new"] > 0 and b["groups"]["reused"] == a["groups"]["reused"]
    assert _hashes(tmp_path / "local" / "current") == _hashes(tmp_path / "ray" / "current")
    assert _ledger_rows(tmp_path / "local" / "ledger.duckdb") == _ledger_rows(tmp_path / "ray" / "ledger.duckdb")


@pytest.mark.corpus
def test_ray_engine_equals_the_local_engine_on_a_corpus_subset(local_ray: Any, corpus: Path,
                                                                 tmp_path: Path) -> None:
    """Claude Code (main files, subagents, sidecars), Codex and OpenClaw files of the corpus."""
    inputs = [corpus / "claude-code", corpus / "codex", corpus / "openclaw"]
    local = _run(inputs, tmp_path / "local", batch_bytes=400_000, jobs=1)
    ray = _run(inputs, tmp_path / "ray", batch_bytes=400_000, jobs=2, engine="ray")
    assert ray["groups"]["batches"] > 3 and ray["calls"] > 200
    assert sum(ray["decisions"].values()) > 0
    _same_run((local, tmp_path / "local"), (ray, tmp_path / "ray"))


def _ray_processes() -> set[str]:
    """The pids of Ray's daemons running now (GCS server, raylet)."""
    out = subprocess.run(["ps", "-eo", "pid=,comm="], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines()
            if line.split()[-1] in ("gcs_server", "raylet")}


def test_the_cli_starts_a_local_ray_and_shuts_it_down(tmp_path: Path) -> None:
    """Without a Ray in the process: `run --engine ray` starts one (2 CPUs from --jobs), prints
    only its result, and leaves no Ray process behind; the calls are those of the local engine."""
    _need_ray()
    before = _ray_processes()
    env = {**os.environ, "CTXREPLAY_RAY_OBJECT_STORE_MB": str(OBJECT_STORE_MB)}
    # a relative input path: the workers resolve it from the driver's directory, as the outputs name it
    args = [sys.executable, "-m", "ctxreplay.pipeline.commands.cli", "run", "data/samples", "--fast-tokens", "--batch-bytes", "20000",
            "--json", "-q"]
    ray = subprocess.run([*args, "--out", str(tmp_path / "ray"), "--engine", "ray", "--jobs", "2"],
                         capture_output=True, text=True, cwd=ROOT, env=env, check=False, timeout=300)
    assert ray.returncode == 0, ray.stderr
    assert ray.stderr == ""  # Ray's own notes stay in its logs
    local = subprocess.run([*args, "--out", str(tmp_path / "local")], capture_output=True, text=True, cwd=ROOT,
                           check=False, timeout=300)
    assert local.returncode == 0, local.stderr
    s = orjson.loads(ray.stdout)
    assert s["groups"]["batches"] > 1
    assert _hashes(tmp_path / "ray" / "current") == _hashes(tmp_path / "local" / "current")
    assert _outputs(tmp_path / "ray" / "current")["requests"].equals(
        _outputs(tmp_path / "local" / "current")["requests"])
    files = pl.read_parquet(tmp_path / "ray" / "current" / "blocks.parquet").get_column("source_file")
    assert files.str.starts_with("data/samples/").all()
    assert _ray_processes() <= before  # nothing of this run's Ray is left


def test_a_bad_address_fails_cleanly_before_anything_is_written(tmp_path: Path) -> None:
    _need_ray()
    with socket.socket() as s:  # a loopback port nobody listens to
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["run", str(SAMPLES), "--out", str(out), "--engine", "ray",
                                  "--address", f"127.0.0.1:{port}"])
    assert r.exit_code == 2
    assert f"--address 127.0.0.1:{port}: no Ray cluster answers there" in r.output
    assert "ray start --head" in r.output and "Traceback" not in r.output
    assert not out.exists()
    r = CliRunner().invoke(main, ["run", str(SAMPLES), "--out", str(out), "--engine", "ray",
                                  "--address", "127.0.0.1:port"])
    assert r.exit_code == 2 and "the port 'port' is not a number" in r.output
    assert not out.exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_address_joins_a_running_cluster_and_leaves_it_up(tmp_path: Path) -> None:
    """A cluster started apart (`ray start --head`, on 127.0.0.1 only, token authentication as Ray
    sets it by default): `--address` joins it, gives the local engine's calls, and only
    disconnects. The head is stopped by its pid at the end (SIGTERM: it drains, then stops what
    it started)."""
    _need_ray()
    port = _free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    ray_exe = Path(sys.executable).parent / "ray"
    head = subprocess.Popen([str(ray_exe), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             "--include-dashboard=false", f"--object-store-memory={OBJECT_STORE_MB * 10**6}",
                             "--node-ip-address=127.0.0.1", "--disable-usage-stats"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for _ in range(240):  # up to 2 minutes on a loaded machine
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert head.poll() is None, head.stderr.read() if head.stderr else ""
            subprocess.run(["sleep", "0.5"], check=True)
        args = [sys.executable, "-m", "ctxreplay.pipeline.commands.cli", "run", str(SAMPLES), "--fast-tokens", "--batch-bytes", "20000",
                "--json", "-q"]
        joined = subprocess.run([*args, "--out", str(tmp_path / "ray"), "--engine", "ray", "--address",
                                 f"127.0.0.1:{port}"], capture_output=True, text=True, cwd=ROOT,
                                env={**os.environ, "RAY_AUTH_MODE": "token"}, check=False, timeout=300)
        assert joined.returncode == 0, joined.stderr
        local = subprocess.run([*args, "--out", str(tmp_path / "local")], capture_output=True, text=True, cwd=ROOT,
                               check=False, timeout=300)
        assert local.returncode == 0, local.stderr
        assert _hashes(tmp_path / "ray" / "current") == _hashes(tmp_path / "local" / "current")
        _same_outputs(tmp_path / "local" / "current", tmp_path / "ray" / "current")
        assert head.poll() is None  # the cluster is still up: the run only disconnected
    finally:
        head.terminate()
        try:
            head.wait(timeout=90)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        if head.stderr:
            head.stderr.close()
