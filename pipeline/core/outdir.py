"""The output directory: staged runs published all at once, and the locks that keep runs apart.

Layout of OUT (see README, "Outputs"):

```
OUT/.runs/<run_id>/          every output of one run (calls.parquet, blocks.parquet, requests/, ...)
OUT/current -> .runs/<run_id>          the published run; swapped in one atomic rename
OUT/calls.parquet -> current/calls.parquet     (and every other output): fixed relative links
OUT/ledger.duckdb            the default ledger (a file of its own, never staged)
OUT/.lock                    held (flock) by the run writing OUT
OUT/.ctxreplay-out.json      what ctxreplay made in OUT: the runs it staged, the links it published
```

A run writes everything into a fresh `.runs/<run_id>/` and publishes it by replacing the
`current` link (`rename(2)` of a new symlink over the old one): a reader that goes through
`current` sees the complete old run or the complete new one, never a mix, whenever the writer
stops. The next run removes whatever an interrupted run left behind (its staging directory, a
half-made link).

Nothing in OUT that ctxreplay did not write is ever removed or replaced (issue 23). A run writes
only into a new or empty directory, or into one whose `.ctxreplay-out.json` (or, for an output
written before that file, whose `current` link into `.runs/`) says a run made it; anything else is
refused before any work. The record lists each staging directory before it is made and each link
before it is published; only those (and the temp links named after a listed run) are ever
removed, and a foreign file where a run must write stops the run rather than being replaced. A
ledger inside `.runs/`, `current` or an output's place is refused (a run would delete it).

Locks are `flock(2)` locks on `OUT/.lock` and on `.<ledger name>.lock` beside the ledger. The
kernel drops them when their process ends, however it ends (SIGKILL included), so a crashed run
never blocks the next one. The lock file names its holder (pid, host, start time, command); a
second run fails at once with that in its message (it does not wait).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import re
import secrets
import shutil
import socket
import sys
from collections.abc import Collection
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import orjson

from ctxreplay.errors import CtxReplayError, LockError, OutputError
from ctxreplay.pipeline.core import crashpoints

RUNS = ".runs"
CURRENT = "current"
LOCK = ".lock"
# what ctxreplay made in OUT: the runs it staged and the links it published (see the module docstring)
OWNED = ".ctxreplay-out.json"
_RECORD_TEMP = re.compile(re.escape(OWNED) + r"\.tmp-[0-9a-f]{8}")
OUT_FORMAT = "ctxreplay-out"
# every name a run may publish in OUT (a link into current/): a foreign file of one of these names is
# in a run's way; it is refused, never replaced (tests/test_foreign_outputs.py checks a run's names)
OUTPUT_NAMES = ("blocks.parquet", "call_facts.parquet", "call_messages.parquet", "calls.parquet",
                "decisions.parquet", "manifest.json", "messages.parquet", "quarantine.parquet", "requests", "spill",
                "summary.json")
# a run id (new_run_id; older versions did not pad the pid)
_RUN_ID = re.compile(r"\d{8}T\d{6,12}Z-\d+-[0-9a-f]{6}")


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
    """An exclusive, non-blocking flock on `path`; the file names the holder while it is held.

    `instead`: what the message tells a refused run to pass instead. `remove`: the lock file goes
    when the lock is released (for a lock beside a user's files, e.g. a golden directory); safe,
    since a run that locked a file since removed locks the new one (`acquire`)."""

    def __init__(self, path: Path, what: str, *, instead: str = "another --out / --ledger",
                 remove: bool = False) -> None:
        self.path, self.what, self.instead, self.remove = path, what, instead, remove
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
            if self.remove and os.path.samestat(os.fstat(self.fd), os.stat(self.path)):
                os.unlink(self.path)
        with contextlib.suppress(OSError):
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
               f"Wait for it to finish, or pass {self.instead}; the lock goes away as soon as that "
               f"process ends, even if it is killed")
        pid = h.get("pid")
        if isinstance(pid, int) and h.get("host") == socket.gethostname() and not _pid_alive(pid):
            msg += (f". Pid {pid} is no longer running, yet the lock is held: a process it started still has "
                    f"the lock file open; end that process")
        return msg


def ledger_lock_path(ledger_path: Path) -> Path:
    return ledger_path.with_name(f".{ledger_path.name}.lock")


# ---------------------------------------------------------------------------------------- writing


def _describe(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class OutputDir:
    """OUT: checks it can be used, cleans what interrupted runs left, stages and publishes a run.

    Only what OUT/.ctxreplay-out.json lists is ever removed or replaced (see the module docstring):
    a directory without it is used only when it is empty; a foreign file where a run must write
    is refused, never overwritten."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.created = False
        self._record: dict[str, list[str]] | None = None

    @property
    def runs(self) -> Path:
        return self.path / RUNS

    # ------------------------------------------------------------------ whose directory is it

    def check(self, own: Collection[str] = ()) -> None:
        """Refuse an OUT that cannot be a directory, or that holds files of someone else's, before
        any work. `own`: names in OUT that belong to this run although no record lists them (the
        default ledger, its lock)."""
        p = self.path
        if str(p) in ("", "."):
            raise OutputError("--out is empty or '.': pass the output directory by name (e.g. --out ctxreplay-out); "
                              "ctxreplay does not write its outputs into the current directory")
        if p.exists() and not p.is_dir():
            raise OutputError(f"--out {p} is a file, not a directory: pass a directory (it is created when "
                              f"missing); ctxreplay never overwrites a file it did not write")
        for parent in p.absolute().parents:
            if parent.exists():
                if not parent.is_dir():
                    raise OutputError(f"--out {p}: {parent} is a file, so the output directory cannot be made "
                                      f"there; pass another --out")
                break
        if p.is_dir():
            self._check_ours(own)

    def _check_ours(self, own: Collection[str]) -> None:
        p = self.path
        try:
            names = sorted(os.listdir(p))
        except OSError as exc:
            raise OutputError(f"cannot read the output directory {p}: {exc.strerror}. Pass an --out you can "
                              f"read and write") from exc
        if OWNED in names:
            self._read_record()
        elif self._today_layout():
            pass  # written by a ctxreplay before OWNED: adopted under the lock (adopt)
        else:
            # a temp file of our record is ours by its name: a run stopped (Ctrl-C) while writing the
            # record of a new OUT left it and nothing else; the next run takes OUT and removes it
            foreign = [n for n in names if n not in {LOCK, *own} and not self._is_record_temp(n)]
            if foreign:
                raise OutputError(
                    f"--out {p} is not a ctxreplay output directory: it holds {_describe(foreign)} and no {OWNED} "
                    f"(the list of what ctxreplay wrote there). A run deletes and replaces the outputs it wrote "
                    f"in OUT, so it writes only into a new or empty directory, or into one a previous run made, "
                    f"and never touches files it did not write. Pass a new or empty directory as --out, or "
                    f"remove {p} first if nothing in it is needed")
            return
        # inside our own output: a foreign file where a run writes is refused, not replaced
        in_way = [n for n in (CURRENT, RUNS, *OUTPUT_NAMES) if os.path.lexists(p / n) and not self._is_ours(n)]
        if in_way:
            self._in_the_way(in_way)

    def _in_the_way(self, names: list[str]) -> None:
        raise OutputError(f"--out {self.path}: {_describe(names)} {'is' if len(names) == 1 else 'are'} not ctxreplay's "
                          f"(not in {OWNED}) but where a run writes its outputs; ctxreplay does not replace files "
                          f"it did not write. Move {'it' if len(names) == 1 else 'them'} out of {self.path}, or "
                          f"pass another --out")

    def _is_record_temp(self, name: str) -> bool:
        """A temp file `_save_record` writes (`.ctxreplay-out.json.tmp-` and 8 hex digits), a plain file."""
        f = self.path / name
        return _RECORD_TEMP.fullmatch(name) is not None and f.is_file() and not f.is_symlink()

    def _today_layout(self) -> bool:
        """OUT written by a ctxreplay of before OWNED: `current` links to a run directory in .runs
        that holds its manifest or summary."""
        link = self.path / CURRENT
        if not link.is_symlink():
            return False
        target = os.readlink(link)
        run = self.path / target
        return (target.startswith(f"{RUNS}/") and _RUN_ID.fullmatch(Path(target).name) is not None
                and run.is_dir() and ((run / "manifest.json").is_file() or (run / "summary.json").is_file()))

    def _is_ours(self, name: str) -> bool:
        """Whether the entry `name` of OUT is one a run made (and may replace)."""
        f = self.path / name
        if name == RUNS:
            return f.is_dir() and not f.is_symlink()
        if not f.is_symlink():
            return False
        target = os.readlink(f)
        if name == CURRENT:
            return target.startswith(f"{RUNS}/") and _RUN_ID.fullmatch(Path(target).name) is not None
        rec = self._record
        return target == f"{CURRENT}/{name}" and (rec is None or name in rec["links"])

    # ------------------------------------------------------------------ the record of what is ours

    @property
    def record_path(self) -> Path:
        return self.path / OWNED

    def _read_record(self) -> dict[str, list[str]]:
        path = self.record_path
        try:
            doc = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise OutputError(f"{path} cannot be read ({exc}): it lists what ctxreplay wrote in {self.path}, so "
                              f"without it nothing there can be replaced safely. Remove {self.path} (or pass "
                              f"another --out)") from exc
        if not (isinstance(doc, dict) and doc.get("format") == OUT_FORMAT and isinstance(doc.get("runs"), list)
                and isinstance(doc.get("links"), list)):
            raise OutputError(f"{path} is not ctxreplay's record of its outputs (no \"format\": \"{OUT_FORMAT}\"); "
                              f"pass a new or empty directory as --out, or remove {self.path} first")
        runs = [r for r in doc["runs"] if isinstance(r, str) and _RUN_ID.fullmatch(r)]
        links = [n for n in doc["links"] if isinstance(n, str) and n and "/" not in n and n not in (".", "..")]
        self._record = {"runs": runs, "links": links}
        return self._record

    def _save_record(self) -> None:
        """Write the record (a temp file and a rename: it is whole after any crash)."""
        rec = self._record
        assert rec is not None
        doc = {"format": OUT_FORMAT, "version": 1, "runs": sorted(set(rec["runs"])), "links": sorted(set(rec["links"]))}
        tmp = self.path / f"{OWNED}.tmp-{secrets.token_hex(4)}"
        try:
            with open(tmp, "xb") as fh:
                fh.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.record_path)
        except BaseException as exc:  # a Ctrl-C too: no temp file is left for the next run to judge
            with contextlib.suppress(OSError):
                tmp.unlink()
            if not isinstance(exc, OSError):
                raise
            raise OutputError(f"cannot write {self.record_path}: {exc.strerror or exc}. Pass an --out you can "
                              f"write to") from exc
        _fsync_dir(self.path)

    def adopt(self, own: Collection[str] = ()) -> None:
        """With the lock held: check OUT again, and make its record when it has none (a new or
        empty directory; or one written before records, whose run, staging directories and links
        into `current` are then listed)."""
        self._check_ours(own)
        if self._record is not None:
            return
        runs: list[str] = []
        links: list[str] = []
        if self._today_layout():
            if self.runs.is_dir():
                runs = [d.name for d in self.runs.iterdir() if _RUN_ID.fullmatch(d.name) and d.is_dir()
                        and not d.is_symlink()]
            links = [f.name for f in self.path.iterdir() if f.is_symlink() and os.readlink(f) == f"{CURRENT}/{f.name}"]
        self._record = {"runs": runs, "links": links}
        self._save_record()

    # ------------------------------------------------------------------ the run

    def create(self, own: Collection[str] = ()) -> None:
        self.check(own)
        try:
            self.created = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create the output directory {self.path}: {exc.strerror}. "
                              f"Pass an --out you can write to") from exc

    def lock(self) -> RunLock:
        return RunLock(self.path / LOCK, f"the output directory {self.path}")

    def check_ledger(self, ledger: Path) -> None:
        """Refuse a ledger where a run writes (in .runs/, through `current`, an output's name): the
        next run would delete it with the run that holds it."""
        out = Path(os.path.realpath(self.path))
        where = Path(os.path.realpath(ledger))
        try:
            rel = where.relative_to(out)
        except ValueError:
            return
        parts = rel.parts
        if parts and (parts[0] in (RUNS, CURRENT, LOCK, OWNED, *OUTPUT_NAMES) or parts[0].startswith(f"{OWNED}.")):
            raise OutputError(
                f"--ledger {ledger} is inside {parts[0]} of the output directory {self.path}, which every run "
                f"replaces or removes: the ledger would be deleted by a run. Keep the ledger out of "
                f"{self.path}/{RUNS}, {self.path}/{CURRENT} and the output files: leave --ledger out (the default "
                f"{self.path}/ledger.duckdb is kept across runs) or pass a path outside {self.path}")

    def current_run(self) -> str | None:
        """The run id `current` points to (None: nothing published yet)."""
        link = self.path / CURRENT
        if not link.is_symlink():
            return None
        return Path(os.readlink(link)).name

    def _remove_run(self, rid: str) -> list[str]:
        """A listed run's directory and the temp links named after it (what its publish may have
        left); returns what was there."""
        gone = []
        d = self.runs / rid
        if os.path.lexists(d):
            _remove(d)
            gone.append(f"{RUNS}/{rid}")
        for f in sorted(self.path.iterdir()):
            n = f.name
            if f.is_symlink() and (n == f".{CURRENT}.{rid}" or (n.startswith(".link-") and n.endswith(f".{rid}"))):
                f.unlink()
                gone.append(n)
        return gone

    def clean_stale(self) -> list[str]:
        """Remove what interrupted runs left behind (call with the lock held, after adopt): the
        listed runs but the published one, their temp links, the record's temp files. Returns the
        names."""
        rec = self._record if self._record is not None else self._read_record()
        removed: list[str] = []
        keep = self.current_run()
        try:
            for rid in sorted(set(rec["runs"])):
                if rid != keep:
                    removed += self._remove_run(rid)
            for f in sorted(self.path.iterdir()):
                if self._is_record_temp(f.name):
                    f.unlink()
                    removed.append(f.name)
        except OSError as exc:
            raise OutputError(f"cannot clean up {self.path}: {exc}. Pass an --out you can write to") from exc
        rec["runs"] = [keep] if keep in rec["runs"] else []
        rec["links"] = [n for n in rec["links"] if self._is_ours(n)]
        self._save_record()
        return removed

    def stage(self, run_id: str) -> Path:
        """The run's staging directory, listed in the record before it is made."""
        rec = self._record if self._record is not None else self._read_record()
        rec["runs"].append(run_id)
        self._save_record()
        staging = self.runs / run_id
        try:
            if os.path.lexists(self.runs) and not self._is_ours(RUNS):
                self._in_the_way([RUNS])
            self.runs.mkdir(exist_ok=True)
            staging.mkdir()
        except OSError as exc:
            raise OutputError(f"cannot write outputs under {self.path}: {exc.strerror}. "
                              f"Pass an --out you can write to") from exc
        return staging

    def publish(self, run_id: str) -> None:
        """Make the staged run the one OUT shows: links first, then the atomic swap of `current`,
        then the old run and stale links go. Every link is listed in the record before it is made;
        a foreign file where a link goes stops the publish before anything changes."""
        out, staging = self.path, self.runs / run_id
        names = sorted(p.name for p in staging.iterdir())
        rec = self._record if self._record is not None else self._read_record()
        in_way = [n for n in (CURRENT, *names) if os.path.lexists(out / n) and not self._is_ours(n)]
        if in_way:
            self._in_the_way(in_way)
        rec["links"] = sorted(set(rec["links"]) | set(names))
        self._save_record()
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
        with contextlib.suppress(OSError, OutputError):
            for name in sorted(set(rec["links"]) - set(names)):
                if self._is_ours(name):
                    (out / name).unlink()
                    crashpoints.point("publish")
            for rid in sorted(set(rec["runs"]) - {run_id}):
                self._remove_run(rid)
                crashpoints.point("publish")
            rec["links"], rec["runs"] = names, [run_id]
            self._save_record()

    def _link(self, name: str, run_id: str) -> None:
        out = self.path
        dest, want = out / name, f"{CURRENT}/{name}"
        if dest.is_symlink() and os.readlink(dest) == want:
            return
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
        rec = self._record
        if rec is not None and run_id in rec["runs"]:
            rec["runs"] = [r for r in rec["runs"] if r != run_id]
            with contextlib.suppress(OutputError):
                self._save_record()

    def remove_if_unused(self, lock_names: tuple[str, ...]) -> None:
        """After a failed run that made OUT: remove OUT again when it holds nothing but this run's
        bookkeeping (lock files, the record, an empty .runs), so a refused run leaves no trace."""
        if not self.created or self.current_run() is not None:
            return
        with contextlib.suppress(OSError):
            self.runs.rmdir()
        with contextlib.suppress(OSError):
            leftovers = {p.name for p in self.path.iterdir()}
            if leftovers <= {LOCK, OWNED, *lock_names}:
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
