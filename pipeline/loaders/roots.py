"""Where agents keep their transcripts: the directories a command reads when given no PATHS.

Light on purpose (the standard library only), so that `ctxreplay report`, which must not load
polars, pyarrow or DuckDB, finds the same transcripts as `ctxreplay run`.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOTS_TEXT = ("$CLAUDE_CONFIG_DIR/projects (else ~/.claude/projects and ~/.config/claude/projects), "
              "~/.openclaw/agents, $CODEX_HOME/sessions (else ~/.codex/sessions) and the chats folders of "
              "~/.gemini/tmp/* ($GEMINI_CLI_HOME/.gemini/tmp/* when set)")
"""The default roots in words, for --help and for the error when none exists."""


def default_roots() -> list[Path]:
    """The transcript directories of this machine's agents, those that exist, in this order:

    - Claude Code: `$CLAUDE_CONFIG_DIR/projects` for each directory of `$CLAUDE_CONFIG_DIR`
      (comma-separated, as Claude Code and ccusage read it), else `~/.claude/projects` and
      `~/.config/claude/projects`;
    - OpenClaw / pi: `~/.openclaw/agents`;
    - Codex CLI: `$CODEX_HOME/sessions`, else `~/.codex/sessions`;
    - Gemini CLI: every `~/.gemini/tmp/<project>/chats` (the CLI's home is `$GEMINI_CLI_HOME` when
      set), in name order: only the chats, not the project folder's logs, checkpoints or tool output.

    `~` is the user's home directory ($HOME)."""
    home = Path.home()
    env = os.environ.get("CLAUDE_CONFIG_DIR")
    claude = ([Path(p.strip()).expanduser() / "projects" for p in env.split(",") if p.strip()] if env
              else [home / ".claude" / "projects", home / ".config" / "claude" / "projects"])
    codex_home = os.environ.get("CODEX_HOME")
    codex = (Path(codex_home).expanduser() if codex_home else home / ".codex") / "sessions"
    gemini_home = os.environ.get("GEMINI_CLI_HOME")
    gemini_tmp = (Path(gemini_home).expanduser() if gemini_home else home) / ".gemini" / "tmp"
    try:
        gemini = sorted(p / "chats" for p in gemini_tmp.iterdir() if (p / "chats").is_dir())
    except OSError:  # no ~/.gemini/tmp (or not readable)
        gemini = []
    return [p for p in [*claude, home / ".openclaw" / "agents", codex] if p.is_dir()] + gemini
