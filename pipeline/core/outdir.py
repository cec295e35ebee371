"""The output directory: staged runs published all at once, and the locks that keep runs apart.

Layout of OUT (see README, "Outputs"):

```
OUT/.runs/<run_id>/          every output of one run (calls.parquet, blocks.parquet, requests/, ...)
OUT/current -> .runs/<run_id>          the published run; swapped in one atomic rename
OUT/calls.parquet -> current/calls.parquet     (and every other output): fixed relative links
OUT/ledger.duckdb            the default ledger (a file of its own, never staged)
OUT/.lock                    held (flock) by the run writing OUT
```

A run writes everything into a fresh `.runs/<run_id>/` and publishes it by replacing the
`current` link (`rename(2)` of a new symlink over the old one): a reader that goes through
`current` sees the complete old run or the complete new one, never a mix, whenever the writer
stops. The next run removes whatever an interrupted run left behind (its staging directory, a
half-made link, and the hidden `.calls.parquet.<random>` temp files of versions before staging).

Locks are `flock(2)` locks on `OUT/.lock` and on `.<ledger name>.lock` beside the ledger. The
kernel drops them when their process ends, however it ends (SIGKILL included), so a crashed run
never blocks the next one. The lock file names its holder (pid, host, start time, command); a
second run fails at once with that in its message (it does not wait).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import secrets
import shutil
import socket
import sys
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import orjson

from ctxreplay.errors import CtxReplayError, LockError, OutputError
from ctxreplay.pipeline.core import crashpoints

RUNS = ".runs"
CURRENT = "current"
LOCK = ".lock"
# outputs written in OUT itself before runs were staged (ctxreplay <= 0.1): replaced by links
LEGACY_OUTPUTS = ("calls.parquet", "blocks.parquet", "quarantine.parquet", "decisions.parquet", "summary.json",
                  "requests", "spill")


def new_run_id() -> str:
    """A fresh run id: UTC time, pid and random bits (sorts by start time). Every id has the same
    length (the pid padded to 7 digits), so a reused output file is relabelled in place
    (pipeline/batch/reuse.py)."""
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    return f"{stamp}-{os.getpid():07d}-{secrets.token_hex(3)}"


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------------- locks


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """An exclusive, non-blocking flock on `path`; the file names the holder while it is held."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what
        self.fd: int | None = None

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    def acquire(self) -> None:
        import fcntl

        for _ in range(5):
            try:
                # 0o666 less the umask, like every other file a run writes
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except OSError as exc:
                raise OutputError(f"cannot create the lock file {self.path} for {self.what}: {exc.strerror}. "
                                  f"Pass a directory you can write to") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._holder(fd)
                os.close(fd)
                raise LockError(self._held_message(holder)) from None
            except OSError as exc:  # a file system without flock (some network mounts): run unlocked
                os.close(fd)
                print(f"ctxreplay: warning: cannot lock {self.path} ({exc.strerror}); two runs on {self.what} "
                      f"at once would not be kept apart", file=sys.stderr)
                return
            # the file may have been replaced between open and flock: then lock the new one
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            info = {"pid": os.getpid(), "host": socket.gethostname(),
                    "started_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                    "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:500]}
            os.ftruncate(fd, 0)
            os.pwrite(fd, orjson.dumps(info) + b"\n", 0)
            self.fd = fd
            return
        raise LockError(f"cannot lock {self.path} for {self.what}: the lock file keeps being replaced")

    def release(self) -> None:
        if self.fd is None:
            return
        import fcntl

        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    @staticmethod
    def _holder(fd: int) -> dict[str, Any]:
        try:
            raw = os.pread(fd, 4096, 0)
            doc = orjson.loads(raw) if raw.strip() else {}
            return doc if isinstance(doc, dict) else {}
        except (OSError, orjson.JSONDecodeError):
            return {}

    def _held_message(self, h: dict[str, Any]) -> str:
        if not h:
            who = "another process (it has not written its details yet)"
        else:
            who = (f"pid {h.get('pid')} on {h.get('host')}, started {h.get('started_at')}, "
                   f"command `{h.get('command')}`")
        msg = (f"{self.what} is in use by another ctxreplay run: {who} (lock file {self.path}). "
               f"Wait for it to finish, or pass another --out / --ledger; the lock goes away as soon as that "
               f"process ends, even if it is killed")
        pid = h.get("pid")
        if isinstance(pid, int) and h.get("host") == socket.gethostname() and not _pid_alive(pid):
            msg += (f". Pid {pid} is no longer running, yet the lock is held: a process it started still has "
                    f"the lock file open; end that process")
        return msg


def ledger_lock_path(ledger_path: Path) -> Path:
    return ledger_path.with_name(f".{ledger_path.name}.lock")


# ---------------------------------------------------------------------------------------- writing


class OutputDir:
    """OUT: checks it can be used, cleans what interrupted runs left, stages and publishes a run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.created = False

    @property
    def runs(self) -> Path:
        return self.path / RUNS

    def check(self) -> None:
        """Refuse an OUT that cannot be a directory, before any work."""
        p = self.path
        if p.exists() and not p.is_dir():
            raise OutputError(f"--out {p} is a file, not a directory: pass a directory (it is created when "
                              f"missing); ctxreplay never overwrites a file it did not write")
        for parent in p.absolute().parents:
            if parent.exists():
                if not parent.is_dir():
                    raise OutputError(f"--out {p}: {parent} is a file, so the output directory cannot be made "
                                      f"there; pass another --out")
                break

    def create(self) -> None:
        self.check()
        try:
            self.created = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create the output directory {self.path}: {exc.strerror}. "
                              f"Pass an --out you can write to") from exc

    def lock(self) -> RunLock:
        return RunLock(self.path / LOCK, f"the output directory {self.path}")

    def current_run(self) -> str | None:
        """The run id `current` points to (None: nothing published yet)."""
        link = self.path / CURRENT
        if not link.is_symlink():
            return None
        return Path(os.readlink(link)).name

    def clean_stale(self) -> list[str]:
        """Remove what interrupted runs left behind (call with the lock held). Returns the names."""
        removed: list[str] = []
        keep = self.current_run()
        try:
            if self.runs.is_dir():
                for d in sorted(self.runs.iterdir()):
                    if d.name != keep:
                        _remove(d)
                        removed.append(f"{RUNS}/{d.name}")
            for f in sorted(self.path.iterdir()):
                n = f.name
                stale_link = f.is_symlink() and n.startswith((f".{CURRENT}.", ".link-"))
                stale_tmp = any(n.startswith(f".{name}.") for name in LEGACY_OUTPUTS) and not f.is_dir()
                if stale_link or stale_tmp:
                    f.unlink()
                    removed.append(n)
        except OSError as exc:
            raise OutputError(f"cannot clean up {self.path}: {exc}. Pass an --out you can write to") from exc
        return removed

    def stage(self, run_id: str) -> Path:
        staging = self.runs / run_id
        try:
            staging.mkdir(parents=True)
        except OSError as exc:
            raise OutputError(f"cannot write outputs under {self.path}: {exc.strerror}. "
                              f"Pass an --out you can write to") from exc
        return staging

    def publish(self, run_id: str) -> None:
        """Make the staged run the one OUT shows: links first, then the atomic swap of `current`,
        then the old run and stale links go."""
        out, staging = self.path, self.runs / run_id
        names = sorted(p.name for p in staging.iterdir())
        try:
            for name in names:
                self._link(name, run_id)
                crashpoints.point("publish")
            tmp = out / f".{CURRENT}.{run_id}"
            os.symlink(f"{RUNS}/{run_id}", tmp)
            os.replace(tmp, out / CURRENT)
        except OSError as exc:
            raise OutputError(f"cannot publish the run in {out}: {exc}. The previous outputs are kept; "
                              f"re-run to publish") from exc
        _fsync_dir(out)
        crashpoints.point("publish")
        # published: what follows is tidying; what it cannot remove, the next run does
        with contextlib.suppress(OSError):
            for f in sorted(out.iterdir()):
                if f.is_symlink() and f.name not in names and os.readlink(f).startswith(f"{CURRENT}/"):
                    f.unlink()
                    crashpoints.point("publish")
            for d in sorted(self.runs.iterdir()):
                if d.name != run_id:
                    _remove(d)
                    crashpoints.point("publish")

    def _link(self, name: str, run_id: str) -> None:
        out = self.path
        dest, want = out / name, f"{CURRENT}/{name}"
        if dest.is_symlink() and os.readlink(dest) == want:
            return
        if dest.is_dir() and not dest.is_symlink():
            # a directory of a run written before staging: move it aside, removed with the old runs
            dest.rename(self.runs / f".legacy-{run_id}-{name}")
        tmp = out / f".link-{name}.{run_id}"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.symlink(want, tmp)
        os.replace(tmp, dest)

    def discard(self, run_id: str) -> None:
        """Remove a staged run that will not be published (best effort); never the published one
        (an interrupt can come after the swap)."""
        if self.current_run() == run_id:
            return
        with contextlib.suppress(OSError):
            _remove(self.runs / run_id)

    def remove_if_unused(self, lock_names: tuple[str, ...]) -> None:
        """After a failed run that made OUT: remove OUT again when it holds nothing but this run's
        bookkeeping (lock files, an empty .runs), so a refused run leaves no trace."""
        if not self.created or self.current_run() is not None:
            return
        with contextlib.suppress(OSError):
            self.runs.rmdir()
        with contextlib.suppress(OSError):
            leftovers = {p.name for p in self.path.iterdir()}
            if leftovers <= {LOCK, *lock_names}:
                for name in leftovers:
                    (self.path / name).unlink(missing_ok=True)
                self.path.rmdir()


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------- reading


def resolve_run(out_dir: Path) -> Path:
    """The directory that holds one complete run of OUT, resolved once so that every file a reader
    opens comes from the same run: OUT/.runs/<run_id>, or OUT itself for a run written before
    staging (or when OUT is a run directory already)."""
    link = out_dir / CURRENT
    if link.is_symlink():
        target = out_dir / os.readlink(link)
        if target.is_dir():
            return target
        raise CtxReplayError(f"{out_dir}: the published run {target.name} is missing (removed by hand?); "
                             f"re-run `ctxreplay run ... --out {out_dir}`")
    if (out_dir / "summary.json").is_file() or (out_dir / "blocks.parquet").is_file():
        return out_dir
    if out_dir.exists() and not out_dir.is_dir():
        raise CtxReplayError(f"{out_dir} is a file, not a ctxreplay output directory")
    raise CtxReplayError(f"{out_dir}: no ctxreplay run here; run `ctxreplay run ... --out {out_dir}` first")


def read_summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    try:
        doc = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, orjson.JSONDecodeError) as exc:
        raise CtxReplayError(f"{path}: cannot read the run's summary: {exc}") from exc
    return doc if isinstance(doc, dict) else {}
