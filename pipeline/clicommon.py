"""What every `ctxreplay` command module shares: click settings and the exit-2 failure.

Kept apart from `pipeline.cli` so that command modules (`cli_report`, ...) can import it without a
circular import when `pipeline.cli` runs as `python -m pipeline.cli`.
"""

from __future__ import annotations

from typing import Any

import click

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class Failure(click.ClickException):
    """Could not run: one paragraph on stderr, exit 2."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"ctxreplay: {self.format_message()}", err=True)


class Interrupted(Failure):
    exit_code = 130


def fail(exc: Exception) -> Failure:
    return Failure(str(exc))
