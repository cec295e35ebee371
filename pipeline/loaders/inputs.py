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

Memory per line is bounded (issue 23, item 6): `read_lines` reads a transcript in chunks and leaves
out every line longer than MAX_LINE_BYTES (the commands' --max-line-bytes, default 64 MiB), keeping
only its number, length and first LONG_LINE_PREFIX bytes (`LongLine`; the loaders quarantine it as
`line_too_long`), so a 1 GB line, with or without a line break, is never held whole; `raw_lines`
gives the first lines of a file (format detection) under the same limit, and `head` the first bytes
of a file too big to read (a .json document over the limit).
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

# whether the commands follow symbolic links out of the directories they were given (--follow-links)
FOLLOW_LINKS: ContextVar[bool] = ContextVar("ctxreplay_follow_links", default=False)

# the longest line a transcript may hold, in bytes (without its line break): a longer one is not read
# but quarantined as `line_too_long` (the commands' --max-line-bytes; a .json document, read whole,
# is limited as one line). Peak memory is a few times the longest line read (bench/bench_memory.py).
DEFAULT_MAX_LINE_BYTES = 64 * 1024 * 1024
MAX_LINE_BYTES: ContextVar[int] = ContextVar("ctxreplay_max_line_bytes", default=DEFAULT_MAX_LINE_BYTES)
LONG_LINE_PREFIX = 1024  # bytes of a line over the limit kept (quarantine.parquet's `raw`)
CHUNK_BYTES = 1 << 20  # read size (at most the limit: a line inside one chunk is never over it)


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


def max_line_bytes(limit: int | None = None) -> int:
    """The limit to use: `limit`, else MAX_LINE_BYTES (the command's --max-line-bytes)."""
    n = MAX_LINE_BYTES.get() if limit is None else limit
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"max_line_bytes must be a whole number of bytes of at least 1, not {n!r}")
    return n


@dataclass
class LongLine:
    """A line over the limit, not read: where, how long, and its first bytes."""

    line: int  # 1-based physical line
    length: int  # its bytes, without the line break
    prefix: bytes  # its first LONG_LINE_PREFIX bytes


@dataclass
class Lines:
    """A transcript read under a line limit (`read_lines`)."""

    data: bytes  # the file's bytes, every line over the limit left empty (its line break kept)
    size: int  # the file's size in bytes (long lines included)
    sha256: str  # of all the file's bytes (long lines included)
    limit: int
    long: list[LongLine] = field(default_factory=list)
    # lines longer than `read_lines`' `aside` (and within the limit), by line number, each left empty
    # in `data` too: a reader that copies `data` whole (the columnar loader) then never copies them
    aside: dict[int, bytes] = field(default_factory=dict)


class _LongLineReader:
    """One line over the limit, fed in pieces: its length, first bytes and whether it is blank."""

    def __init__(self, line: int, head: bytes | memoryview) -> None:
        self.line, self.length, self.prefix, self.blank = line, 0, b"", True
        self.feed(head)

    def feed(self, piece: bytes | memoryview) -> None:
        n = len(piece)
        if not n:
            return
        if len(self.prefix) < LONG_LINE_PREFIX:
            self.prefix += bytes(piece[:LONG_LINE_PREFIX - len(self.prefix)])
        if self.blank and bytes(piece).strip():
            self.blank = False  # a line of nothing but (ASCII) whitespace is blank, as in base.nonblank_lines
        self.length += n

    def done(self) -> LongLine | None:
        return None if self.blank else LongLine(self.line, self.length, self.prefix)


def read_lines(path: Path | str, limit: int | None = None, aside: int | None = None) -> Lines:
    """A transcript's bytes, read in chunks, with every line longer than `limit` bytes (default:
    MAX_LINE_BYTES) left out: such a line is never held whole (a 1 GB file without a line break
    neither); its place keeps its line break, so the other lines keep their numbers. `open_input`
    opens the file (never a FIFO or a device). A line of nothing but whitespace is blank, however long.
    `aside`: lines longer than this many bytes (and within the limit) are taken out of `data` too,
    into `Lines.aside`.
    """
    got = _read_lines(path, max_line_bytes(limit))
    if aside is not None and len(got.data) > aside:
        got.data, got.aside = _set_aside(got.data, aside)
    return got


def _set_aside(data: bytes, aside: int) -> tuple[bytes, dict[int, bytes]]:
    """`data` with each line longer than `aside` bytes left empty, and those lines by number. Steps
    over the short lines `aside` bytes at a time (their line breaks counted, not walked one by one)."""
    taken: dict[int, bytes] = {}
    kept: list[bytes] = []
    n, pos, line, last = len(data), 0, 1, 0
    while pos < n:
        k = data.rfind(b"\n", pos, pos + aside + 1)
        if k >= 0:  # every line that starts before k ends by k: none of them is longer than `aside`
            line += data.count(b"\n", pos, k + 1)
            pos = k + 1
            continue
        end = data.find(b"\n", pos)
        end = n if end < 0 else end
        if end - pos > aside:
            taken[line] = data[pos:end]
            kept.append(data[last:pos])
            last = end
        pos, line = end + 1, line + 1
    if not taken:
        return data, taken
    kept.append(data[last:])
    return b"".join(kept), taken


def _read_lines(path: Path | str, limit: int) -> Lines:
    h = hashlib.sha256()
    with open_input(path) as fh:
        if os.fstat(fh.fileno()).st_size <= limit:  # no line can be over the limit: one read
            data = fh.read()
            if len(data) <= limit:
                h.update(data)
                return Lines(data, len(data), h.hexdigest(), limit)
            fh.seek(0)  # it grew since: read it the careful way
        out = io.BytesIO()
        long: list[LongLine] = []
        chunk_size = min(CHUNK_BYTES, limit)
        line_no, cur = 1, 0  # the current line's number, and its bytes in `out` so far
        over: _LongLineReader | None = None  # the current line, when it is over the limit
        size = 0

        def end_long() -> None:
            nonlocal over
            assert over is not None
            got = over.done()
            if got is not None:
                long.append(got)
            over = None

        while chunk := fh.read(chunk_size):
            h.update(chunk)
            size += len(chunk)
            mv = memoryview(chunk)
            nl = chunk.find(b"\n")
            end = len(chunk) if nl < 0 else nl  # the current line's bytes in this chunk: mv[:end]
            if over is not None:
                over.feed(mv[:end])
            elif cur + end > limit:  # the current line goes over the limit here: take it back from `out`
                out.seek(out.tell() - cur)
                head = out.read()
                out.seek(out.tell() - cur)
                out.truncate()
                over = _LongLineReader(line_no, head)
                over.feed(mv[:end])
                cur = 0
            else:
                out.write(mv[:end])
                cur += end
            if nl < 0:
                continue
            if over is not None:
                end_long()
            # the rest of the chunk: whole lines (each shorter than the chunk, so within the limit),
            # then the start of the next line
            last = chunk.rfind(b"\n")
            out.write(mv[nl:last + 1])
            line_no += chunk.count(b"\n", nl, last + 1)
            out.write(mv[last + 1:])
            cur = len(chunk) - last - 1
        if over is not None:
            end_long()
    data = out.getvalue()
    out.close()
    return Lines(data, size, h.hexdigest(), limit, long)


def raw_lines(fh: BinaryIO, limit: int | None = None) -> Iterator[bytes | None]:
    """The physical lines of an open file, in order, each with its line break if it has one; None
    for a line over `limit` bytes (default: MAX_LINE_BYTES), read past without being held."""
    limit = max_line_bytes(limit)
    while raw := fh.readline(limit + 1):  # a line within the limit and its \n, or one byte too many
        if raw.endswith(b"\n") or len(raw) <= limit:
            yield raw
            continue
        while (rest := fh.readline(CHUNK_BYTES)) and not rest.endswith(b"\n"):
            pass
        yield None


def read_document(path: Path | str, limit: int | None = None) -> bytes | None:
    """A file read whole as one JSON document (a .json file), or None when it is bigger than `limit`
    bytes (default: MAX_LINE_BYTES): the limit of one line applies to the whole document."""
    limit = max_line_bytes(limit)
    with open_input(path) as fh:
        if os.fstat(fh.fileno()).st_size > limit:
            return None
        data = fh.read(limit + 1)
    return None if len(data) > limit else data


def head(path: Path | str, n: int = LONG_LINE_PREFIX) -> tuple[bytes, int, str]:
    """A file's first `n` bytes, its size and its sha256 (read in chunks: it may be too big to hold)."""
    h = hashlib.sha256()
    first = b""
    size = 0
    with open_input(path) as fh:
        while chunk := fh.read(CHUNK_BYTES):
            if not size:
                first = chunk[:n]
            h.update(chunk)
            size += len(chunk)
    return first, size, h.hexdigest()


def first_bytes(path: Path, n: int = 65536) -> bytes | None:
    """A regular file's first `n` bytes, to tell its format; None for a FIFO, a device or a folder
    (never opened) and for a file that cannot be read."""
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as fh:
            return fh.read(n)
    except OSError:
        return None


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


__all__ = ["DEFAULT_MAX_LINE_BYTES", "FOLLOW_LINKS", "MAX_LINE_BYTES", "Lines", "LongLine", "NotARegularFile",
           "file_kind", "first_bytes", "head", "list_files", "max_line_bytes", "open_input", "path_str", "raw_lines", "read_document",
           "read_file", "read_lines", "unreadable"]
