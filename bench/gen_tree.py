"""Generate a large `~/.claude/projects`-shaped tree from a real one, with fresh ids in every copy.

Each copy of the source tree gets new session ids, message ids (`msg_…`), request ids (`req_…`),
tool-use ids (`toolu_…`), entry uuids and subagent ids. Every id is rewritten the same way
wherever it appears (file names, `sessionId`, `uuid` / `parentUuid` / `logicalParentUuid`,
`toolUseResult.agentId`, `agent_progress` copies, tool-result text), so subagent links, parent
chains and file names stay valid inside a copy, and no copy shares an id with another one (ccusage
and `ctxreplay report` would de-duplicate shared message/request ids away). The new ids have the
length and alphabet of the old ones, so every file keeps its exact size and every line stays valid
JSON. Timestamps, models and usage are kept, so the cost of the tree is exactly
`copies × cost(source)` (whole copies; the last copy may stop after any session).

Deterministic: the same source, size and seed give byte-identical trees.

    python bench/gen_tree.py OUT --size 190MB [--src ../shared/corpus/claude-projects] [--seed 0]
    python bench/gen_tree.py OUT --copies 3

OUT receives `projects/<project>/<session>.jsonl` (+ `<session>/subagents/…`), the layout ccusage
reads with `CLAUDE_CONFIG_DIR=OUT`. From Python: `from bench.gen_tree import generate`.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SRC = ROOT.parent / "shared" / "corpus" / "claude-projects"

_UUID = rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_PREFIXED = rb"(?:msg|req|toolu)_[0-9A-Za-z]{20,}"
_ALNUM = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_HEX = b"0123456789abcdef"


@dataclass
class GenStats:
    """What `generate` wrote."""

    out: Path
    copies: int            # copies started (the last one may be partial)
    sessions: int          # session units written (main file + its subagent files)
    files: int
    bytes: int
    source_bytes: int
    sessions_per_copy: int
    ids_rewritten: int = 0
    partial_last_copy: bool = False
    session_ids: list[str] = field(default_factory=list)


@dataclass
class _Unit:
    """One session of the source: its main file and the files under `<session>/`."""

    sid: str
    files: list[Path]
    size: int


def _units(projects: Path) -> list[_Unit]:
    units: dict[tuple[str, str], _Unit] = {}
    for f in sorted(p for p in projects.rglob("*") if p.is_file()):
        rel = f.relative_to(projects).parts
        if len(rel) < 2:
            continue
        project = rel[0]
        sid = Path(rel[1]).name.split(".")[0] if len(rel) == 2 else rel[1]
        u = units.setdefault((project, sid), _Unit(sid, [], 0))
        u.files.append(f)
        u.size += f.stat().st_size
    return [units[k] for k in sorted(units)]


def _agent_ids(files: list[Path]) -> set[bytes]:
    ids: set[bytes] = set()
    for f in files:
        m = re.match(r"agent-(.+?)\.(?:jsonl|meta\.json)$", f.name)
        if m:
            ids.add(m.group(1).encode())
        for m2 in re.finditer(rb'"agentId":"([0-9A-Za-z_-]+)"', f.read_bytes()):
            ids.add(m2.group(1))
    return ids


class _Template:
    """A file split once into literal bytes and id tokens; `render(mapper)` joins a copy."""

    def __init__(self, data: bytes, pattern: re.Pattern[bytes]):
        self.parts: list[bytes] = []
        self.tokens: list[bytes] = []
        pos = 0
        for m in pattern.finditer(data):
            self.parts.append(data[pos:m.start()])
            self.tokens.append(m.group(0))
            pos = m.end()
        self.parts.append(data[pos:])

    def render(self, mapper: _Mapper) -> bytes:
        out = [self.parts[0]]
        for tok, lit in zip(self.tokens, self.parts[1:], strict=True):
            out.append(mapper(tok))
            out.append(lit)
        return b"".join(out)


class _Mapper:
    """Token → fresh token of the same shape, a pure function of (seed, copy, token)."""

    def __init__(self, seed: int, copy: int, agent_ids: set[bytes]):
        self.key = f"ctxreplay-gen-tree/{seed}/{copy}".encode()
        self.agent_ids = agent_ids
        self.memo: dict[bytes, bytes] = {}

    def _digest(self, tok: bytes, n: int) -> bytes:
        h = hashlib.shake_256(self.key + b"\0" + tok).digest(n)
        return h

    def __call__(self, tok: bytes) -> bytes:
        got = self.memo.get(tok)
        if got is not None:
            return got
        if len(tok) == 36 and tok[8:9] == b"-":          # uuid: keep version / variant nibbles
            d = self._digest(tok, 32)
            hexs = bytes(_HEX[b & 15] for b in d)
            new = (hexs[0:8] + b"-" + hexs[8:12] + b"-" + tok[14:15] + hexs[13:16] + b"-"
                   + tok[19:20] + hexs[17:20] + b"-" + hexs[20:32])
        elif tok in self.agent_ids:                      # subagent id: same prefix letters, new hex
            head = re.match(rb"[a-z]*-?", tok).group(0) if tok.startswith(b"acompact-") else tok[:1]
            d = self._digest(tok, len(tok))
            new = head + bytes(_HEX[b & 15] for b in d[: len(tok) - len(head)])
        else:                                            # msg_01…, req_011C…, toolu_01…
            cut = tok.index(b"_") + 1
            keep = cut + (4 if tok.startswith(b"req_") else 2)
            d = self._digest(tok, len(tok))
            new = tok[:keep] + bytes(_ALNUM[b % 62] for b in d[: len(tok) - keep])
        self.memo[tok] = new
        return new


def _pattern(agent_ids: set[bytes]) -> re.Pattern[bytes]:
    alts = [_UUID, _PREFIXED]
    if agent_ids:
        alts.append(b"|".join(re.escape(a) for a in sorted(agent_ids, key=len, reverse=True)))
    return re.compile(rb"(?<![0-9A-Za-z])(?:" + b"|".join(alts) + rb")(?![0-9A-Za-z])")


def parse_size(text: str) -> int:
    """'190MB', '0.8GB', '1500000' → bytes (decimal units: MB = 10^6)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgG]?)[bB]?\s*", text)
    if not m:
        raise ValueError(f"size {text!r}: write a number of bytes or e.g. 190MB, 0.8GB")
    mult = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def generate(out: Path, *, size: int | None = None, copies: int | None = None, src: Path = DEFAULT_SRC,
             seed: int = 0) -> GenStats:
    """Write copies of `src` (a folder holding `projects/`, or a `projects` folder itself) to `out`.

    Give `size` (bytes: copies are added session by session until the tree reaches it) or
    `copies` (whole copies). `out` must not exist or be empty.
    """
    if (size is None) == (copies is None):
        raise ValueError("give exactly one of size= or copies=")
    projects = src / "projects" if (src / "projects").is_dir() else src
    if not projects.is_dir():
        raise FileNotFoundError(f"{src}: no projects/ folder here; pass the folder that holds it (like "
                                f"~/.claude or ../shared/corpus/claude-projects)")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: not empty; give a new folder (generated trees are never merged)")
    units = _units(projects)
    if not units:
        raise FileNotFoundError(f"{projects}: no session files")
    all_files = [f for u in units for f in u.files]
    agent_ids = _agent_ids(all_files)
    pattern = _pattern(agent_ids)
    templates = {f: _Template(f.read_bytes(), pattern) for f in all_files}
    src_bytes = sum(u.size for u in units)
    stats = GenStats(out=out, copies=0, sessions=0, files=0, bytes=0, source_bytes=src_bytes,
                     sessions_per_copy=len(units))
    copy = 0
    while True:
        if copies is not None and copy >= copies:
            break
        if size is not None and stats.bytes >= size:
            break
        mapper = _Mapper(seed, copy, agent_ids)
        stats.copies += 1
        for i, u in enumerate(units):
            if size is not None and stats.bytes >= size:
                stats.partial_last_copy = i < len(units)
                break
            for f in u.files:
                rel = f.relative_to(projects)
                new_rel = Path(*[_Template(part.encode(), pattern).render(mapper).decode() for part in rel.parts])
                dest = out / "projects" / new_rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                data = templates[f].render(mapper)
                dest.write_bytes(data)
                stats.files += 1
                stats.bytes += len(data)
                stats.ids_rewritten += len(templates[f].tokens)
            stats.sessions += 1
            stats.session_ids.append(mapper(u.sid.encode()).decode())
        copy += 1
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="new folder to write (gets projects/…)")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--size", type=parse_size, help="target size, e.g. 190MB or 0.8GB (decimal units)")
    g.add_argument("--copies", type=int, help="number of whole copies")
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC, help=f"source tree (default {DEFAULT_SRC})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the new ids (default 0)")
    a = ap.parse_args(argv)
    try:
        st = generate(a.out, size=a.size, copies=a.copies, src=a.src, seed=a.seed)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"gen_tree: {exc}", file=sys.stderr)
        return 2
    part = " (last copy partial)" if st.partial_last_copy else ""
    print(f"wrote {st.out}: {st.bytes / 1e6:.1f} MB in {st.files} files, {st.sessions} sessions, "
          f"{st.copies} copies{part} of {st.source_bytes / 1e6:.1f} MB; {st.ids_rewritten:,} ids rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
