"""Where agents keep their transcripts: the directories a command reads when given no PATHS.

Light on purpose (the standard library only), so that `ctxreplay report`, which must not load
polars, pyarrow or DuckDB, finds the same transcripts as `ctxreplay run`.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOTS_TEXT = ("$CLAUDE_CONFIG_DIR/projects (else ~/.claude/projects and ~/.config/claude/projects), "
              "~/.openclaw/agents and $CODEX_HOME/sessions (else ~/.codex/sessions)")
"""The default roots in words, for --help and for the error when none exists."""


def default_roots() -> list[Path]:
    """The transcript directories of this machine's agents, those that exist, in this order:

    - Claude Code: `$CLAUDE_CONFIG_DIR/projects` for each directory of `$CLAUDE_CONFIG_DIR`
      (comma-separated, as Claude Code and ccusage read it), else `~/.claude/projects` and
      `~/.config/claude/projects`;
    - OpenClaw / pi: `~/.openclaw/agents`;
    - Codex CLI: `$CODEX_HOME/sessions`, else `~/.codex/sessions`.

    `~` is the user's home directory ($HOME)."""
    home = Path.home()
    env = os.environ.get("CLAUDE_CONFIG_DIR")
    claude = ([Path(p.strip()).expanduser() / "projects" for p in env.split(",") if p.strip()] if env
              else [home / ".claude" / "projects", home / ".config" / "claude" / "projects"])
    codex_home = os.environ.get("CODEX_HOME")
    codex = (Path(codex_home).expanduser() if codex_home else home / ".codex") / "sessions"
    return [p for p in [*claude, home / ".openclaw" / "agents", codex] if p.is_dir()]
