"""Run the commands that README.md and docs/*.md show, and compare what they print.

A small collector of our own (tests/test_docs_run.py drives it; docs/development.md, "Docs that
run", is its user documentation). It reads the fenced blocks of a Markdown file in order:

- A block with lines starting `$ ` (a console block; fence ``` , ```console, ```bash or ```sh):
  each such line is a command (a line ending in `\\` continues on the next), the lines after it up
  to the next command are what it prints (stdout and stderr together, as a terminal shows them).
- A ```bash / ```sh block without `$ ` lines: every line that is not blank or a `#` comment is a
  command whose output is not shown.
- A ```python block is run as a script.

The commands of one file run in order, with bash, in one scratch directory that holds a copy of
`data/samples/` and links to `examples/` and `bench/`, so a later command sees what an earlier one
wrote (`ctxreplay run data/samples --out s`, then `ctxreplay threads s`). `ctxreplay` and `python`
are those of the interpreter running the tests; HOME, the price cache and TZ=UTC are the scratch
directory's own.

Shown output is compared line by line, trailing spaces ignored, after these normalisations of both
sides: a run id (`20261201T074814906944Z-31533-b2ef7b`) and the seconds on a line that says `took`
(`took 2.00 s`, `took 4.55 s (replay 3.61 s, compare 0.00 s)`) match any other. In the shown output, `...` is a wildcard: a line that is only `...` stands for any number of
lines (none included), and `...` inside a line for any text on that line. A command may exit with
a status other than 0 only when its shown output says more than `...`.

A comment on the line just before a block's fence changes what happens to it:

- `<!-- docs-test skip: REASON -->`: the block's commands are not run (a benchmark that takes
  minutes on generated trees, a second process holding a lock); tests/test_docs.py counts these,
  so they stay few;
- `<!-- docs-test corpus: REASON -->`: the block reads the project's corpus of real sessions
  (`../shared/corpus`, not shipped) or takes minutes: it runs only in the slow pass
  (`pytest -m slow tests/test_docs_run.py`), where the corpus is found as `../shared/corpus` from
  the scratch directory; counted with the skipped ones;
- `<!-- docs-test file: PATH -->`: the block is written to PATH in the scratch directory (a spec
  the next commands read), not run;
- `<!-- docs-test include: PATH -->`: the block is the repository file PATH, whole and as it is
  (the CI job of docs/ci.md); checked;
- `<!-- docs-test excerpt: PATH -->`: the block's lines are lines of the repository file PATH, in
  order, with gaps (a stage's source shown in docs/writing-a-stage.md); checked;
- `<!-- docs-test fragment: REASON -->`: Python that is not meant to run (a signature, a sketch
  with names it does not define); not run, and not a command.

`python tests/doccheck.py [--corpus] FILE.md ...` runs the files' commands and prints what each
printed, to write the shown output from.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test\s+(skip|corpus|file|include|excerpt|fragment):\s*(.+?)\s*-->\s*$")
CORPUS = ROOT.parent / "shared" / "corpus"
FENCE = re.compile(r"^(\s*)(```+)\s*([\w+-]*)\s*$")
SHELL_LANGS = {"bash", "sh", "shell", "console"}
ELLIPSIS = "..."
# run ids and timings differ from run to run; the price table's release from install to install
# (`genai-prices>=...`: a fresh venv takes the newest; the figures it gives are still compared)
VOLATILE = [
    (re.compile(r"\b\d{8}T\d{6,12}Z-\d+-[0-9a-f]{6}\b"), "<run-id>"),
    (re.compile(r"\btook \d+(?:\.\d+)? s\b"), "took <seconds> s"),
    (re.compile(r"\bgenai-prices \d+(?:\.\d+)+\S*"), "genai-prices <version>"),
]


@dataclass
class Command:
    line: int                 # 1-based line of the `$ ` in the file
    cmd: str
    expected: list[str] | None  # None: output not shown (a bash block without prompts)


@dataclass
class Block:
    line: int                 # 1-based line of the opening fence
    lang: str
    text: str
    directive: str | None = None
    argument: str | None = None
    commands: list[Command] = field(default_factory=list)

    @property
    def is_console(self) -> bool:
        return bool(self.commands)

    @property
    def is_python(self) -> bool:
        return self.lang in ("python", "py")


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with their directive and commands."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            ln = lines[i]
            body.append(ln[len(indent):] if ln.startswith(indent) else ln.lstrip())
            i += 1
        i += 1
        b = Block(line=start + 1, lang=lang, text="\n".join(body) + "\n")
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        d = DIRECTIVE.match(lines[j]) if j >= 0 else None
        if d:
            b.directive, b.argument = d.group(1), d.group(2)
        if lang in SHELL_LANGS or lang == "":
            b.commands = _commands(body, start + 2, prompts_only=(lang == ""), where=f"{path}:{start + 1}")
        out.append(b)
    return out


def _commands(body: list[str], first_line: int, prompts_only: bool, where: str) -> list[Command]:
    if any(ln.startswith("$ ") for ln in body):
        cmds: list[Command] = []
        k = 0
        while k < len(body):
            ln = body[k]
            if ln.startswith("$ "):
                line_no = first_line + k
                cmd = ln[2:]
                while cmd.endswith("\\") and k + 1 < len(body):
                    k += 1
                    cmd = cmd[:-1].rstrip() + " " + body[k].strip()
                cmds.append(Command(line_no, cmd, []))
            elif not cmds:
                raise ValueError(f"{where}: output before the first `$ ` command: {ln!r}")
            else:
                cmds[-1].expected.append(ln)           # type: ignore[union-attr]
            k += 1
        return cmds
    if prompts_only:
        return []
    return [Command(first_line + k, ln.strip(), None) for k, ln in enumerate(body)
            if ln.strip() and not ln.lstrip().startswith("#")]


SECONDS = re.compile(r"\b\d+(?:\.\d+)? s\b")


def normalise(text: str) -> list[str]:
    for pat, rep in VOLATILE:
        text = pat.sub(rep, text)
    lines = [ln.rstrip() for ln in text.rstrip("\n").splitlines()] if text.strip() else []
    # on a `took ...` line every figure in seconds is a timing
    return [SECONDS.sub("<seconds> s", ln) if "took " in ln else ln for ln in lines]


def matches(expected: list[str], actual: str) -> bool:
    """Does `actual` fit the shown output `expected` (with its `...` wildcards)?"""
    want = normalise("\n".join(expected))
    got = normalise(actual)
    parts = []
    for ln in want:
        if ln.strip() == ELLIPSIS:
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(p) for p in ln.split(ELLIPSIS)) + r"\n")
    return re.fullmatch("".join(parts), "".join(g + "\n" for g in got)) is not None


def only_elided(expected: list[str]) -> bool:
    return all(ln.strip() in ("", ELLIPSIS) for ln in expected)


def scratch(base: Path) -> tuple[Path, dict[str, str]]:
    """A working directory and environment for one file's commands."""
    work = base / "work"
    (work / "data").mkdir(parents=True)
    shutil.copytree(ROOT / "data" / "samples", work / "data" / "samples")
    for name in ("examples", "bench"):
        (work / name).symlink_to(ROOT / name)
    if CORPUS.is_dir():                  # `../shared/corpus`, as from the checkout
        (base / "shared").mkdir()
        (base / "shared" / "corpus").symlink_to(CORPUS)
    (base / "home").mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CTXREPLAY_", "PYTEST_", "COV_", "HYPOTHESIS_"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", HOME=str(base / "home"),
               CTXREPLAY_CACHE_DIR=str(base / "cache"), TZ="UTC", PYTHONUNBUFFERED="1", NO_COLOR="1")
    env.pop("COLUMNS", None)
    return work, env


@dataclass
class Outcome:
    where: str
    cmd: str
    expected: list[str] | None
    output: str
    returncode: int

    @property
    def ok(self) -> bool:
        if self.expected is None or only_elided(self.expected):
            return self.returncode == 0
        return matches(self.expected, self.output)


def run_file(path: Path, base: Path, corpus: bool = False, timeout: float = 600) -> list[Outcome]:
    """Run every command of one Markdown file in order; return what each printed. The blocks
    marked `corpus` run only with `corpus=True`."""
    rel = path.relative_to(ROOT)
    work, env = scratch(base)
    outcomes: list[Outcome] = []
    for n, b in enumerate(blocks(path)):
        where = f"{rel}:{b.line}"
        if b.directive == "file":
            target = work / b.argument                 # type: ignore[operator]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(b.text)
            continue
        if b.directive in ("skip", "include", "excerpt", "fragment") or (b.directive == "corpus" and not corpus):
            continue
        if b.is_python:
            script = base / f"block-{n}.py"
            script.write_text(b.text)
            r = subprocess.run([sys.executable, str(script)], cwd=work, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False)
            outcomes.append(Outcome(where, f"python <the block at {where}>", None, r.stdout, r.returncode))
            continue
        for c in b.commands:
            r = subprocess.run(["bash", "--noprofile", "--norc", "-c", c.cmd], cwd=work, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                               check=False)
            outcomes.append(Outcome(f"{rel}:{c.line}", c.cmd, c.expected, r.stdout, r.returncode))
    return outcomes


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


if __name__ == "__main__":
    with_corpus = "--corpus" in sys.argv
    for arg in [a for a in sys.argv[1:] if a != "--corpus"]:
        with tempfile.TemporaryDirectory(prefix="doccheck-") as tmp:
            for o in run_file(Path(arg).resolve(), Path(tmp), corpus=with_corpus):
                mark = "ok  " if o.ok else "FAIL"
                print(f"{mark} {o.where} (exit {o.returncode}) $ {o.cmd}")
                for ln in o.output.rstrip("\n").splitlines():
                    print(f"    {ln}")
