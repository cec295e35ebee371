"""Which files a command reads, and how it opens them (issue 23, items 4 and 9). Standard library
only: `ctxreplay report` lists its files here without loading pyarrow.

`list_files(paths, wanted)` walks the PATHS a command was given:

- a file given by name is read (a symbolic link given by name too: it was named);
- a directory is walked recursively, in name order. A symbolic link in it whose target is outside
  the directory given (`ln -s ~/.aws/credentials d/x.jsonl`, `/proc/self/environ`) is not read but
  skipped with the reason, unless links are followed (`follow_links`, the commands' `--follow-links`);
  a link to a directory is not walked unless links are followed (one inside the directory adds
  nothing: its files are read by their own path), and a walk never enters a directory twice;
- a FIFO, a device, a socket, or a link to one (`/dev/zero` named `x.jsonl`), is skipped with the
  reason and never opened: reading a FIFO blocks forever, `/dev/zero` never ends.

`open_input` opens a listed file for reading and checks, on the open file, that it is still a
regular file: a file replaced after it was listed (by a FIFO, a directory) is refused with
NotARegularFile, one that is gone raises FileNotFoundError, and `unreadable` words either as a
`skipped_files` entry. Nothing here raises for a file that changed after it was listed; a PATH
that does not exist is the caller's error (`missing`).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from pathlib import Path
from typing import BinaryIO

# whether the commands follow symbolic links out of the directories they were given (--follow-links)
FOLLOW_LINKS: ContextVar[bool] = ContextVar("ctxreplay_follow_links", default=False)


def path_str(path: Path | str) -> str:
    """A path as text that can always be written (Arrow, JSON): a name holding bytes that are not
    UTF-8 shows them as `\\xNN` escapes instead of lone surrogates."""
    s = str(path)
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(s).decode("utf-8", "backslashreplace")
    return s


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is, in words (from its `st_mode`)."""
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return what
    return "not a regular file"


class NotARegularFile(OSError):
    """An input path that is not a regular file (a FIFO, a device, a directory) where one was
    listed: it is never read."""

    def __init__(self, path: Path | str, mode: int) -> None:
        super().__init__(errno.EINVAL, f"{file_kind(mode)}, not a regular file: never read", str(path))


def open_input(path: Path | str) -> BinaryIO:
    """Open an input file for reading, refusing anything that is not a regular file before reading a
    byte: opened without blocking (a FIFO does not wait for a writer), then checked on the open file
    itself (nothing can take its place in between). Raises OSError: FileNotFoundError for a file gone
    since it was listed, NotARegularFile for a FIFO, a device, a directory."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile(path, mode)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_file(path: Path | str) -> bytes:
    """An input file's bytes (`open_input`: never a FIFO or a device)."""
    with open_input(path) as fh:
        return fh.read()


def unreadable(path: Path | str, exc: OSError) -> dict[str, str]:
    """The `skipped_files` entry of an input that could not be read: gone since it was listed (deleted,
    or renamed: OpenClaw renames a session file to `*.jsonl.deleted.<time>` on every reset), not a
    regular file, or an error of the system (permissions, ...). The other files are read."""
    if isinstance(exc, FileNotFoundError):
        why = "gone since the run listed it (deleted, or renamed as OpenClaw does on a session reset)"
    elif isinstance(exc, NotARegularFile):
        why = exc.strerror
    else:
        why = f"cannot be read: {exc.strerror or exc}. Check the file and its permissions"
    return {"file": path_str(path), "reason": f"{why}; the other files were loaded"}


def _inside(target: str, root: str) -> bool:
    return target == root or target.startswith(root.rstrip(os.sep) + os.sep)


def list_files(paths: Iterable[Path], wanted: Callable[[str], bool], *, follow_links: bool | None = None,
               listed: bool = False, unwanted: str | None = None,
               missing: Callable[[Path], Exception] | None = None) -> tuple[list[Path], list[dict[str, str]]]:
    """The files to read under `paths` (see the module docstring), in path order per PATH, and the
    ones skipped with the reason (`{"file", "reason"}`).

    `wanted(name)`: whether a file name in a directory is one to read; a regular file whose name is
    not is skipped with the reason `unwanted` (when given; silently otherwise). `follow_links`: None
    takes FOLLOW_LINKS. `listed`: the paths are files listed before (a run's batch): one that is gone
    or no longer a regular file is skipped, not an error. `missing(path)`: the exception for a PATH
    that does not exist (default: FileNotFoundError)."""
    follow = FOLLOW_LINKS.get() if follow_links is None else follow_links
    out: list[Path] = []
    skipped: list[dict[str, str]] = []
    for p in paths:
        p = Path(p)
        if listed:
            try:
                mode = os.stat(p).st_mode
            except OSError as exc:
                skipped.append(unreadable(p, exc))
                continue
            if stat.S_ISREG(mode):
                out.append(p)
            else:
                skipped.append({"file": path_str(p), "reason": f"{NotARegularFile(p, mode).strerror} (it was a "
                                                               "file when the run listed it)"})
            continue
        try:
            mode = os.stat(p).st_mode
        except OSError:
            raise (missing(p) if missing else FileNotFoundError(errno.ENOENT, "no such file or directory",
                                                                str(p))) from None
        if stat.S_ISDIR(mode):
            files, skips = _walk(p, wanted, follow, unwanted)
            out += files
            skipped += skips
        elif stat.S_ISREG(mode):
            out.append(p)
        else:
            skipped.append({"file": path_str(p), "reason": NotARegularFile(p, mode).strerror})
    return out, skipped


def _walk(root: Path, wanted: Callable[[str], bool], follow: bool,
          unwanted: str | None) -> tuple[list[Path], list[dict[str, str]]]:
    """One directory given as a PATH, recursively (see list_files); entries sorted by path, as
    `sorted(root.rglob("*"))` gives them."""
    root_real = os.path.realpath(root)
    entries: list[tuple[Path, str, str]] = []  # (path, what: file | skip, reason)
    visited = {root_real}
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                children = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            entries.append((d, "skip", f"a directory that cannot be read: {exc.strerror or exc}"))
            continue
        for e in children:
            f = Path(e.path)
            is_link = False
            try:
                is_link = e.is_symlink()
                st = os.stat(f)  # follows a link
            except OSError as exc:
                if is_link and wanted(e.name):
                    gone = isinstance(exc, FileNotFoundError)
                    entries.append((f, "skip", f"a symbolic link to {path_str(os.path.realpath(f))}, which does not "
                                    "exist" if gone else f"cannot be read: {exc.strerror or exc}"))
                continue
            if is_link:
                target = os.path.realpath(f)
                if not follow and not _inside(target, root_real):
                    if stat.S_ISDIR(st.st_mode) or wanted(e.name):
                        why = f"a symbolic link to {path_str(target)}, outside {path_str(root)}: not read (--follow-links reads it)"
                        entries.append((f, "skip", why))
                    continue
            if stat.S_ISDIR(st.st_mode):
                if is_link and not follow:
                    continue  # inside the directory: its files are read by their own path
                real = os.path.realpath(f)
                if real not in visited:  # a link back up the tree is not walked twice
                    visited.add(real)
                    stack.append(f)
            elif stat.S_ISREG(st.st_mode):
                if wanted(e.name):
                    entries.append((f, "file", ""))
                elif unwanted is not None:
                    entries.append((f, "skip", unwanted))
            elif wanted(e.name):
                entries.append((f, "skip", f"{file_kind(st.st_mode)}, not a regular file: never read"))
    entries.sort(key=lambda x: x[0])
    files = [f for f, what, _ in entries if what == "file"]
    return files, [{"file": path_str(f), "reason": why} for f, what, why in entries if what == "skip"]


__all__ = ["FOLLOW_LINKS", "NotARegularFile", "file_kind", "list_files", "open_input", "path_str", "read_file",
           "unreadable"]
