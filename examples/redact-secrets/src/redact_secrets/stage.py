"""The `redact_secrets` stage: API keys, access tokens and `password=...` style values in user text
and tool results become `[REDACTED <kind>]`, so replays of transcripts can be shared.

It is a plain ctxreplay stage (docs/writing-a-stage.md in ctxreplay): a pure function over the
blocks LazyFrame, edits made with the marks functions of ctxreplay's stable API (it imports from
`ctxreplay` only), one decision per changed block. It never looks inside thinking blocks (signed
thinking must stay byte-identical) or tool inputs (a tool call's input is what the model wrote, and
changing it would change what the model said).

It also has a live rule (`live=LiveRule(...)`): in ctxreplay's live engine, a step that appends
rows without a secret to mask takes the live path (no pipeline pass); one with a secret asks for a
full pass. The rule asks the very expression the stage uses, over the new rows only.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from ctxreplay import (
    Live,
    LiveRows,
    LiveRule,
    LiveThread,
    StageContext,
    StageResult,
    finish,
    mark_replace,
    stage,
    start_marks,
)

# kind -> regex; `[REDACTED <kind>]` replaces each match. A pattern with two groups keeps them (the
# name and the separator of an assignment) and masks what follows.
PATTERNS: dict[str, str] = {
    "anthropic-key": r"sk-ant-[A-Za-z0-9_-]{20,}",
    "openai-key": r"sk-(?:proj-|svcacct-)?[A-Za-z0-9_-]{20,}",
    "github-token": r"gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}",
    "aws-access-key": r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    "slack-token": r"xox[abposr]-[A-Za-z0-9-]{10,}",
    "google-api-key": r"AIza[0-9A-Za-z_-]{35}",
    "bearer-token": r"(?i)\bbearer\s+[A-Za-z0-9._~+/-]{20,}=*",
    "assignment": r"(?i)\b(api[_-]?key|secret|token|password|passwd)(\s*[:=]\s*['\"]?)[A-Za-z0-9_\-./+=]{8,}",
}
MASK = "[REDACTED {kind}]"


@dataclass(frozen=True, slots=True, kw_only=True)
class RedactSecrets:
    kinds: tuple[str, ...] = tuple(PATTERNS)
    """Which kinds of secret to mask (names of PATTERNS)."""
    user_text: bool = True
    """Mask secrets in the text of user messages."""
    tool_results: bool = True
    """Mask secrets in tool results (their text parts)."""

    def validate(self) -> None:
        unknown = sorted(set(self.kinds) - set(PATTERNS))
        if unknown:
            raise ValueError(f"kinds has unknown kind(s) {unknown}; kinds are {', '.join(PATTERNS)}")


def masked(text: pl.Expr, kinds: tuple[str, ...]) -> pl.Expr:
    """`text` with every secret of these kinds replaced by its mask."""
    for kind in kinds:
        pattern = PATTERNS[kind]
        keep = "${1}${2}" if kind == "assignment" else ""
        text = text.str.replace_all(pattern, keep + MASK.format(kind=kind))
    return text


def _masked_where(params: RedactSecrets) -> pl.Expr:
    """Each row's text with its secrets masked, on the rows this stage looks at (null elsewhere)."""
    where = pl.lit(False)
    if params.user_text:
        where = where | ((pl.col("role") == "user") & (pl.col("block_type") == "text"))
    if params.tool_results:
        where = where | ((pl.col("block_type") == "tool_result") & (pl.col("part_type").fill_null("text") != "image"))
    # only the rows looked at are scanned: the others are null here
    return masked(pl.when(where & pl.col("text").is_not_null()).then(pl.col("text")), params.kinds)


def _changes(new: pl.Expr) -> pl.Expr:
    return new.is_not_null() & (new != pl.col("text"))


def live_start(thread: LiveThread, params: RedactSecrets, ctx: StageContext) -> None:
    """Nothing to carry: whether a row holds a secret depends on that row alone."""
    return


def live_step(carry: None, new: LiveRows, params: RedactSecrets, ctx: StageContext) -> Live:
    """Quiet when no appended row holds a secret this stage masks (the stage's own expression)."""
    if new.frame.select(_changes(_masked_where(params)).fill_null(False).any()).item():
        return Live.full_pass("a secret to mask in a new row")
    return Live.quiet()


@stage("redact_secrets", version=1, params=RedactSecrets, requires=("sanitize",),
       live=LiveRule(live_start, live_step))
def redact_secrets(blocks: pl.LazyFrame, params: RedactSecrets, ledger: pl.LazyFrame,
                   ctx: StageContext) -> StageResult:
    """Mask API keys and tokens in user text and tool results as `[REDACTED <kind>]`.

    Each changed block gets one `replace` decision, reason `secret`; a masked text has nothing left
    to mask, so a second run decides nothing.
    """
    new = _masked_where(params)
    w = start_marks(blocks)
    w = mark_replace(w, _changes(new), {"text": new}, "secret")
    return finish(w)
