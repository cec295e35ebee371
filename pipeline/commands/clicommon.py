"""What every `ctxreplay` command module shares: click settings and choices read from the
registries, and the options several commands take, each written once (`pipeline_option`,
`preset_option`, `target_option`, `json_option`). A command refuses its arguments with `ctxreplay.errors.ArgumentError` (any
CtxReplayError): `cli.main` maps every error to its exit code and one paragraph on stderr.

Kept apart from `ctxreplay.pipeline.commands.cli` so that command modules (`cli_report`, ...) can import it without a
circular import when `ctxreplay.pipeline.commands.cli` runs as `python -m ctxreplay.pipeline.commands.cli`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from ctxreplay.errors import ArgumentError, did_you_mean
from ctxreplay.pipeline.core.termtext import shown, terminal_text
from ctxreplay.pipeline.loaders import ROOTS_TEXT, default_roots

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def echo(text: str, *, err: bool = False, nl: bool = True) -> None:
    """Print human-readable text (not JSON): `click.echo` of the text with its control characters
    escaped (`ctxreplay.pipeline.core.termtext.terminal_text`): what a transcript or a file name
    holds never acts on the terminal. Every command's text output goes through here or `console`."""
    click.echo(terminal_text(text), err=err, nl=nl)


def console(**kw: Any) -> Any:
    """A rich Console on stdout for the commands' tables: every string it renders (cells, titles)
    has its control characters escaped (`shown`: a newline in a session id stays in its cell) and
    no markup or emoji codes read (`[/x]` in a model name is text, not a style); a reader that
    goes away (`| head`) raises BrokenPipeError, which `ctxreplay` ends with 141 as for any output
    (rich's own handling exits 1)."""
    from rich.console import Console

    class _Console(Console):
        def render_str(self, text: str, **kwargs: Any) -> Any:
            return super().render_str(shown(text), **kwargs)

        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return _Console(**{"file": sys.stdout, "markup": False, "emoji": False, "highlight": False, **kw})


def paths_or_roots(paths: Sequence[Path], example: str) -> list[Path]:
    """PATHS as given; without them the transcript directories that exist on this machine
    (`ctxreplay.pipeline.loaders.default_roots`, the same for every command), or ArgumentError
    when there is none (`example`: a command line that passes PATHS)."""
    if paths:
        return list(paths)
    found = default_roots()
    if not found:
        raise ArgumentError(f"no PATHS given and none of {ROOTS_TEXT} exists; pass transcript files or "
                            f"directories, e.g. `{example}`")
    return found


class RegistryChoice(click.Choice):  # type: ignore[type-arg]
    """A click.Choice whose values come from a registry, read when needed (so that importing the
    CLI reads no registry), and whose error is ctxreplay's one paragraph with a "did you mean"
    (exit 2), e.g. `unknown preset 'defualt'. Did you mean 'default'? Presets: ...`.

    `what` names the kind of value ("preset"); `normalize` maps an accepted spelling to its
    registry name (targets take `_` for `-`).
    """

    def __init__(self, names: Callable[[], Sequence[str]], what: str,
                 normalize: Callable[[str], str] | None = None) -> None:
        self._names, self.what, self._normalize = names, what, normalize or (lambda s: s)
        self.case_sensitive = True

    @property  # type: ignore[override]
    def choices(self) -> tuple[str, ...]:
        return tuple(self._names())  # read each time: a registry can grow (plug-ins, tests)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        name = self._normalize(value)
        if name in self.choices:
            return name
        raise ArgumentError(f"unknown {self.what} '{value}'.{did_you_mean(name, self.choices)} "
                      f"{self.what.capitalize()}s: {', '.join(self.choices)}")


def preset_choice() -> RegistryChoice:
    def names() -> list[str]:
        from ctxreplay.pipeline.staging.spec import preset_names

        return preset_names()

    return RegistryChoice(names, "preset")


def target_choice() -> RegistryChoice:
    def names() -> list[str]:
        from ctxreplay.pipeline.targets import target_names

        return target_names()

    return RegistryChoice(names, "target", normalize=lambda s: s.replace("_", "-"))


class StageName(click.ParamType):
    """A stage name whose metavar lists the registered stages, read when help is shown (importing
    the CLI loads no plug-in); any value passes: the command checks it against the registered
    stages and the run's own (a later use of a stage is `name#2`), with a "did you mean"."""

    name = "stage"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        from ctxreplay.pipeline.stageapi.registry import load_stages

        return "[" + "|".join(sorted(load_stages())) + "]"


# ---------------------------------------------------------------------------------------------
# options shared by several commands: each written once

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def stage_option(help_text: str) -> Decorator:
    """`--stage NAME` (-> `stage_name`) of `why` and `ledger`, the registered stages listed in its help."""
    return click.option("--stage", "stage_name", type=StageName(), help=help_text)


def pipeline_option() -> Decorator:
    """`--pipeline FILE` (-> `pipeline_file`): the pipeline spec of run, snapshot, diff."""
    return click.option("--pipeline", "pipeline_file", type=click.Path(path_type=Path), help="Pipeline spec (TOML).")


def preset_option(help_text: str = "A preset from data/pipelines (default: default).") -> Decorator:
    """`--preset NAME` (-> `preset`), its choices read from the presets."""
    return click.option("--preset", type=preset_choice(), help=help_text)


def target_option(default: str = "the spec's [pipeline] target, else gemini when every transcript is a Gemini CLI "
                  "session, else anthropic", of: str = "the requests") -> Decorator:
    """`--target NAME` (-> `target`), its choices read from the targets (`_` taken for `-`); `default`
    says what the command uses without it."""
    return click.option("--target", type=target_choice(), help=f"Wire shape of {of} (default: {default}).")


def follow_links_option() -> Decorator:
    """`--follow-links` of the commands that read transcripts (no parameter: it sets
    `ctxreplay.pipeline.loaders.inputs.FOLLOW_LINKS` for the command, which every listing of PATHS
    reads). Without it a symbolic link out of a directory given is skipped and listed."""
    def follow(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
        from ctxreplay.pipeline.loaders.inputs import FOLLOW_LINKS

        FOLLOW_LINKS.set(bool(value))
        return value

    return click.option("--follow-links", is_flag=True, expose_value=False, callback=follow,
                        help="Read symbolic links that lead out of the directories given too (by default they are "
                             "skipped and listed, so that a link among someone else's files cannot make this read "
                             "~/.aws/credentials). FIFOs and devices are never read.")


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


class ByteSize(click.ParamType):
    """A number of bytes: a whole number, or one with a unit K, M or G (KiB, MiB, GiB: `64M`,
    `1.5G`, `512KiB`), at least 1 byte."""

    name = "bytes"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        import re

        if isinstance(value, int) and not isinstance(value, bool):
            n: float = value
        else:
            m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
            unit = m.group(2).lower() if m else ""
            if not m or unit not in _SIZE_UNITS:
                self.fail(f"{value!r} is not a size: give a number of bytes, optionally with a unit K, M or G "
                          "(KiB, MiB, GiB), e.g. 64M", param, ctx)
            n = float(m.group(1)) * _SIZE_UNITS[unit] if "." in m.group(1) else int(m.group(1)) * _SIZE_UNITS[unit]
        if n < 1:
            self.fail(f"{value!r} is below 1 byte: give a size of at least 1 byte, e.g. 64M", param, ctx)
        return int(n)


def max_line_bytes_option() -> Decorator:
    """`--max-line-bytes SIZE` of the commands that read transcripts (no parameter: it sets
    `ctxreplay.pipeline.loaders.inputs.MAX_LINE_BYTES` for the command, which every reader of a
    transcript's lines takes, in worker processes too)."""
    def limit(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
        from ctxreplay.pipeline.loaders.inputs import DEFAULT_MAX_LINE_BYTES, MAX_LINE_BYTES

        token = MAX_LINE_BYTES.set(DEFAULT_MAX_LINE_BYTES if value is None else value)
        ctx.call_on_close(lambda: MAX_LINE_BYTES.reset(token))  # the limit is the command's only
        return value

    return click.option("--max-line-bytes", type=ByteSize(), expose_value=False, callback=limit,
                        help="Longest transcript line read, in bytes (K, M, G: KiB, MiB, GiB; default 64M). A longer "
                             "line is not read but quarantined as line_too_long (its length and first 1024 bytes "
                             "kept; report: listed under bad_lines), so memory stays a few times this size; a .json "
                             "file, read whole as one JSON document, is limited as one line.")


def no_cache_option() -> Decorator:
    """`--no-cache` of the commands that price requests (no parameter: it sets
    `ctxreplay.pipeline.cost.prices.NO_CACHE` for the command): the disk cache of prices in
    ~/.cache/ctxreplay is neither read nor written (the environment's CTXREPLAY_CACHE_DIR="" does
    the same for every command)."""
    def no_cache(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
        from ctxreplay.pipeline.cost.prices import NO_CACHE

        NO_CACHE.set(bool(value))
        return value

    return click.option("--no-cache", is_flag=True, expose_value=False, callback=no_cache,
                        help="Neither read nor write the disk cache of prices (~/.cache/ctxreplay, or "
                             "$CTXREPLAY_CACHE_DIR; CTXREPLAY_CACHE_DIR= turns it off for every command).")


def json_option(what: str = "", *, note: str = "") -> Decorator:
    """`--json` (-> `json_`): print `what` (the command's result when empty) as one JSON document
    on stdout; `note` is added in parentheses (e.g. what else gives the same)."""
    shown = f"Print {what} as one JSON document on stdout" if what else "Print one JSON document on stdout"
    return click.option("--json", "json_", is_flag=True, help=shown + (f" ({note})." if note else "."))
