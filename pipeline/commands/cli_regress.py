"""`ctxreplay snapshot` and `ctxreplay diff`: golden files of assembled requests, and CI regression
against them (pipeline/regress/snapshot.py, pipeline/regress/diff.py).

Exit codes of `diff`: 0 the requests match the goldens (or --update rewrote them); 1 something
differs (the report says what); 2 it could not run (no goldens, another golden format or target,
an unreadable input or spec).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from ctxreplay.pipeline.commands.clicommon import (
    CONTEXT,
    echo,
    follow_links_option,
    json_option,
    max_line_bytes_option,
    no_cache_option,
    paths_or_roots,
    pipeline_option,
    preset_option,
    target_option,
)
from ctxreplay.pipeline.core.words import plural

FORMATS = ("text", "markdown", "json")


def _progress(quiet: bool) -> Any:
    if quiet or not sys.stderr.isatty():
        return None
    return lambda msg: echo(f"… {msg}", err=True)


def _size(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


@click.command(context_settings=CONTEXT)
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@pipeline_option()
@preset_option()
@target_option()
@click.option("--golden", "golden_dir", type=click.Path(path_type=Path), required=True,
              help="Directory for the goldens (created or replaced as a whole).")
@click.option("--fast-tokens", is_flag=True, help="Estimate tokens as ceil(chars/4) instead of tiktoken "
                                                  "(recorded in the goldens; diff then counts the same way).")
@json_option("what was written")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors (no summary, no progress); with --json "
              "the JSON document is still printed.")
@follow_links_option()
@max_line_bytes_option()
@no_cache_option()
def snapshot(paths: tuple[Path, ...], pipeline_file: Path | None, preset: str | None, target: str | None,
             golden_dir: Path, fast_tokens: bool, json_: bool, quiet: bool) -> None:
    """Write golden files of every thread's requests, to compare later runs with (`ctxreplay diff`).

    Per thread: each call's request_sha256 and prompt tokens, the pending request as pretty-printed
    canonical JSON, and what rebuilds every call's request (the request store's rows and the
    messages no pending request holds); a manifest names the pipeline (sha256 and resolved spec),
    the ctxreplay version, the target and each input file's sha256. The files are byte-identical
    from run to run and machine to machine: commit them next to the sessions and the policy.

    \b
    Example:
      ctxreplay snapshot sessions/ --pipeline policy.toml --golden ctxreplay-golden/
    """
    import orjson

    from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER, TIKTOKEN_COUNTER
    from ctxreplay.pipeline.regress.snapshot import snapshot as do_snapshot
    from ctxreplay.pipeline.staging.spec import load_spec

    spec = load_spec(pipeline_file, preset=preset)
    stats = do_snapshot(paths_or_roots(paths, "ctxreplay snapshot sessions/ --golden golden/"), spec, golden_dir, target=target,
                        token_counter=CHARS4_COUNTER if fast_tokens else TIKTOKEN_COUNTER,
                        progress=_progress(quiet or json_))
    if json_:
        click.echo(orjson.dumps(stats.to_json(), option=orjson.OPT_SORT_KEYS).decode())
        return
    if quiet:
        return
    echo(f"ctxreplay snapshot: wrote {golden_dir}: {plural(stats.threads, 'thread')}, "
         f"{plural(stats.calls, 'call')}, {plural(stats.files, 'input file')}; {_size(stats.bytes)} "
         f"({plural(stats.messages_stored, 'message')} besides the pending requests, {plural(stats.texts, 'text')} "
         f"set apart)")
    echo(f"  pipeline '{stats.pipeline}' ({stats.pipeline_sha256[:12]}), target {stats.target}")
    echo(f"  took {stats.seconds:.2f} s")


@click.command(context_settings=CONTEXT)
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@pipeline_option()
@preset_option()
@target_option("the spec's [pipeline] target, else the goldens' target")
@click.option("--golden", "golden_dir", type=click.Path(path_type=Path), required=True,
              help="Directory of the goldens (written by `ctxreplay snapshot`).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True,
              help="Report format: text, markdown (a pull-request comment) or json.")
@json_option("the report", note="the same as --format json")
@click.option("--update", is_flag=True, help="Rewrite the goldens from this run (after reporting what changed); "
                                             "exit 0. With --thread: only those threads' goldens.")
@click.option("--thread", "threads", multiple=True, metavar="PREFIX",
              help="Only the threads whose key starts with PREFIX (a session id or prefix: its threads; "
                   "SESSION/THREAD: a prefix of each); repeatable. With --update, the other threads' goldens are "
                   "kept as they are.")
@click.option("--stat", "detail", flag_value="stat", help="One line per thread (calls that differ, tokens and "
              "cost delta), no section per thread.")
@click.option("--all", "detail", flag_value="all", help="Every differing call of each thread, each with where it "
              "differs and the decision behind it (a call that differs as the one before it says so).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path),
              help="Keep this run's outputs in DIR (as `ctxreplay run --out` writes them; the ledger is not kept). "
                   "Default: a temporary directory, removed.")
@click.option("--prices", "prices_file", type=click.Path(path_type=Path),
              help="TOML file of prices that override or add models (see README, Prices).")
@click.option("-q", "--quiet", is_flag=True, help="Nothing on stderr but errors (no progress, timing or notes); the "
              "report, the result, still goes to stdout.")
@follow_links_option()
@max_line_bytes_option()
@no_cache_option()
def diff(paths: tuple[Path, ...], pipeline_file: Path | None, preset: str | None, target: str | None,
         golden_dir: Path, fmt: str, json_: bool, update: bool, threads: tuple[str, ...], detail: str | None,
         out_dir: Path | None, prices_file: Path | None, quiet: bool) -> None:
    """Replay the sessions and compare every request with the goldens; exit 1 when any differs.

    The report starts with a one-screen summary (threads changed by the pipeline or by changed
    inputs, new and vanished threads, calls that differ, the prompt-token and cost deltas); then,
    per changed thread, the first call whose request differs, the message and block where it
    differs, the stage decision that explains it, and a unified diff of that block (--all: every
    differing call; --stat: one line per thread). Input files whose sha256 changed are reported
    apart: an input change is not a pipeline regression; a file renamed (the same bytes under
    another name) is matched with its threads by content and said "renamed" (exit 0 when nothing
    else changed).

    \b
    Example:
      ctxreplay diff sessions/ --pipeline policy.toml --golden ctxreplay-golden/ --format markdown
    """
    from ctxreplay.pipeline.regress.diff import render, run_diff
    from ctxreplay.pipeline.staging.spec import load_spec

    fmt = "json" if json_ else fmt
    spec = load_spec(pipeline_file, preset=preset)
    report = run_diff(paths_or_roots(paths, "ctxreplay diff sessions/ --golden golden/"), spec, golden_dir, target=target, update=update, out_dir=out_dir,
                      prices=prices_file, progress=_progress(quiet or fmt == "json"), threads=threads,
                      detail=detail or "first")
    if report is None:  # --update with no goldens to compare with: written afresh
        if not quiet:
            echo(f"ctxreplay diff: no goldens to compare with in {golden_dir}; wrote them from this run", err=True)
        if fmt == "json":
            import orjson

            click.echo(orjson.dumps({"identical": None, "exit_code": 0, "updated": True,
                                     "golden_dir": str(golden_dir)}).decode())
        return
    (click.echo if fmt == "json" else echo)(render(report, fmt), nl=False)  # JSON escapes its text itself
    if not quiet:
        s = report.seconds
        echo(f"ctxreplay diff: took {s.get('total', 0):.2f} s (replay {s.get('replay', 0):.2f} s, "
             f"compare {s.get('compare', 0):.2f} s)", err=True)
        for note in report.notes:
            echo(f"ctxreplay diff: note: {note}", err=True)
        if report.updated and threads:
            echo(f"ctxreplay diff: goldens in {golden_dir} rewritten from this run for "
                 f"{plural(report.selection['threads'] if report.selection else 0, 'thread')} of "
                 f"{' '.join('--thread ' + x for x in threads)}; "
                 f"{plural(report.kept_threads, 'other thread')} kept as they were", err=True)
        elif report.updated:
            echo(f"ctxreplay diff: goldens in {golden_dir} rewritten from this run", err=True)
    sys.exit(report.exit_code)
