"""The `ctxreplay` command line. Thin: parse flags, call the runner, print the result.

Exit codes: 0 done; 1 done, but --strict found problems; 2 could not run (one paragraph on
stderr, never a traceback: an unexpected exception is reported as an internal error whose
traceback goes to a file); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import click
import orjson

from pipeline.cli_regress import diff, snapshot
from pipeline.cli_report import report
from pipeline.clicommon import CONTEXT, Failure, Interrupted, fail
from pipeline.errors import CtxReplayError, internal_error

_fail = fail


class _Main(click.Group):
    """The command group, with the last-resort handler: whatever a command raises ends as one
    paragraph on stderr and an exit code, never as a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit):
            raise
        except CtxReplayError as exc:
            raise _fail(exc) from exc
        except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly, as Unix tools do
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(141)
        except KeyboardInterrupt:
            raise Interrupted("interrupted; the output directory still holds the last complete run and the "
                              "ledger is as it was before this run") from None
        except Exception as exc:
            raise _fail(internal_error(exc)) from exc


def _progress(quiet: bool, json_: bool) -> Any:
    if quiet or json_ or not sys.stderr.isatty():
        return None
    return lambda msg: click.echo(f"… {msg}", err=True)


def _default_paths() -> list[Path]:
    home = Path.home()
    return [p for p in (home / ".claude" / "projects", home / ".openclaw" / "agents") if p.is_dir()]


@click.group(cls=_Main, context_settings=CONTEXT)
@click.version_option(package_name="ctxreplay", prog_name="ctxreplay")
def main() -> None:
    """Replay, call by call, what an AI agent sent to its model, from session transcripts on disk."""


@main.command(context_settings=CONTEXT)
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("--pipeline", "pipeline_file", type=click.Path(path_type=Path), help="Pipeline spec (TOML).")
@click.option("--preset", help="A preset from data/pipelines (default: default).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("ctxreplay-out"), show_default=True,
              help="Output directory.")
@click.option("--ledger", "ledger_path", type=click.Path(path_type=Path),
              help="Ledger file (default: OUT/ledger.duckdb).")
@click.option("--target", help="Wire shape of the assembled requests (default: the spec's [pipeline] target, "
                               "else anthropic).")
@click.option("--all-calls", is_flag=True, help="Also write every call's request to requests/<thread_key>.jsonl.")
@click.option("--json", "json_", is_flag=True, help="Print the summary as one JSON document on stdout.")
@click.option("--strict", is_flag=True, help="Exit 1 when lines were quarantined or requests violate the target.")
@click.option("--fast-tokens", is_flag=True, help="Estimate tokens as ceil(chars/4) instead of tiktoken.")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
def run(paths: tuple[Path, ...], pipeline_file: Path | None, preset: str | None, out_dir: Path,
        ledger_path: Path | None, target: str | None, all_calls: bool, json_: bool, strict: bool, fast_tokens: bool,
        quiet: bool) -> None:
    """Load transcripts, apply the pipeline, replay every call; write outputs and the ledger.

    PATHS are files or directories (searched recursively). Without PATHS: ~/.claude/projects and
    ~/.openclaw/agents, where they exist. The outputs of OUT change all at once when the run ends
    (an interrupted run leaves the previous ones); a second run on the same OUT or ledger while
    one runs is refused.

    \b
    Example:
      ctxreplay run ~/.claude/projects --preset identity --out /tmp/replay
    """
    from pipeline.runner import RunOptions
    from pipeline.runner import run as do_run
    from pipeline.spec import load_spec
    from pipeline.tokens import CHARS4_COUNTER, TIKTOKEN_COUNTER

    try:
        spec = load_spec(pipeline_file, preset=preset)
        chosen = list(paths) or _default_paths()
        if not chosen:
            raise Failure("no PATHS given and neither ~/.claude/projects nor ~/.openclaw/agents exists; "
                          "pass transcript files or directories, e.g. `ctxreplay run data/samples`")
        opts = RunOptions(out_dir=out_dir, ledger_path=ledger_path, target=target, all_calls=all_calls,
                          token_counter=CHARS4_COUNTER if fast_tokens else TIKTOKEN_COUNTER,
                          progress=_progress(quiet, json_))
        result = do_run(chosen, spec, opts)
    except Failure:
        raise
    except CtxReplayError as exc:
        raise _fail(exc) from exc
    s = result.summary
    if json_:
        click.echo(orjson.dumps(s, option=orjson.OPT_SORT_KEYS).decode())
    else:
        click.echo(_human(s))
    if strict and result.found_problems:
        if not json_:
            click.echo(f"--strict: {s['quarantined_lines']} quarantined line(s), {s['violations']} violation(s), "
                       f"{s['conflicts']} ledger conflict(s)", err=True)
            for v in result.violations[:20]:
                click.echo(f"  {v}", err=True)
        sys.exit(1)


SHOW_SKIPPED = 5


def _human(s: dict[str, Any]) -> str:
    lines = [
        f"ctxreplay: pipeline '{s['pipeline']}' ({s['pipeline_sha256'][:12]}), target {s['target']}",
        (f"  read {s['files']} files, {s['lines']:,} lines: {s['message_lines']:,} message, "
         f"{s['other_lines']:,} other, {s['quarantined_lines']:,} quarantined"),
        (f"  {s['sessions']} sessions, {s['threads']} threads, {s['calls']:,} calls "
         f"({s['recorded_calls']:,} recorded + {s['pending_calls']} pending)"),
    ]
    if s["decisions"]:
        lines.append("  decisions: " + ", ".join(f"{k} {v:,}" for k, v in s["decisions"].items()))
    else:
        lines.append("  decisions: none (no context layers in this pipeline)")
    if s["violations"]:
        lines.append(f"  {s['violations']} violation(s) of the {s['target']} rules (recorded in the ledger): "
                     + ", ".join(f"{k} {v}" for k, v in s["violations_by_rule"].items()))
    if s["quarantined_lines"]:
        reasons = ", ".join(f"{k}: {v}" for k, v in s["quarantine_reasons"].items())
        lines.append(f"  {s['quarantined_lines']} of {s['lines']:,} lines quarantined ({reasons}); everything else "
                     f"was replayed. See them with: ctxreplay ledger {s['out_dir']} --quarantine")
    if s["recovered_lines"]:
        lines.append(f"  recovered {len(s['recovered_lines'])} line(s) holding more than one JSON object")
    skipped = s.get("skipped_files") or []
    if skipped:
        lines.append(f"  skipped {len(skipped)} file(s) that are not transcripts:")
        lines += [f"    {x['file']}: {x['reason']}" for x in skipped[:SHOW_SKIPPED]]
        if len(skipped) > SHOW_SKIPPED:
            lines.append(f"    ... and {len(skipped) - SHOW_SKIPPED} more (all in {s['out_dir']}/summary.json)")
    lines.append(f"  wrote {s['out_dir']}/calls.parquet, requests/, summary.json (run {s['run_id']}); "
                 f"ledger {s['ledger']}")
    lines.append(f"  took {s['seconds']:.2f} s")
    return "\n".join(lines)


@main.command(context_settings=CONTEXT)
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.argument("thread_key")
@click.option("--call", "call", type=int, help="Call index (0-based); default: the pending call.")
@click.option("--target", default=None,
              help="Wire shape (default: the run's own, as stored; another one is shaped anew from the blocks).")
@click.option("--canonical", is_flag=True,
              help="Print exactly the hashed bytes (no newline): `| sha256sum` gives its request_sha256.")
def request(out_dir: Path, thread_key: str, call: int | None, target: str | None, canonical: bool) -> None:
    """Print one call's request from a run's output directory, rebuilt from its request store.

    It reads the run OUT shows (OUT/current): byte for byte the request whose sha256 is in
    calls.parquet, in the run's own target, with no stage or shaping run again (`--target` another
    wire shape: shaped anew from the run's final blocks).

    \b
    Example:
      ctxreplay request ctxreplay-out 8d1e0b7c-... --call 3
    """
    from pipeline.store import request_json

    try:
        data = request_json(out_dir, thread_key, call, target)
    except FileNotFoundError:  # a newer run was published and the one we read removed: read that
        data = request_json(out_dir, thread_key, call, target)
    if canonical:
        click.echo(data, nl=False)
        return
    click.echo(orjson.dumps(orjson.loads(data), option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2).decode())


@main.command(context_settings=CONTEXT)
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--ledger", "ledger_path", type=click.Path(path_type=Path), help="Ledger file (default: OUT/ledger.duckdb).")
@click.option("--stage", "stage_name", help="Only this stage's decisions.")
@click.option("--session", "session_id", help="Only this session's decisions.")
@click.option("--quarantine", is_flag=True, help="Show the quarantined lines of the run instead.")
@click.option("--limit", type=int, default=50, show_default=True, help="Rows to list (0: all).")
@click.option("--json", "json_", is_flag=True, help="One JSON document on stdout.")
def ledger(out_dir: Path, ledger_path: Path | None, stage_name: str | None, session_id: str | None, quarantine: bool,
           limit: int, json_: bool) -> None:
    """Query a run's ledger: decisions by stage and reason, the runs, or the quarantined lines.

    \b
    Example:
      ctxreplay ledger ctxreplay-out --stage tombstone --limit 10
    """
    import polars as pl

    from pipeline.ledger import Ledger
    from pipeline.outdir import resolve_run

    if quarantine:
        q_path = resolve_run(out_dir) / "quarantine.parquet"
        if not q_path.is_file():
            raise Failure(f"{out_dir}: no quarantine.parquet here; run `ctxreplay run ... --out {out_dir}` first")
        q = pl.read_parquet(q_path)
        rows = q.head(limit) if limit else q
        if json_:
            click.echo(orjson.dumps(rows.to_dicts()).decode())
        else:
            click.echo(f"{q.height} quarantined line(s)")
            for r in rows.iter_rows(named=True):
                click.echo(f"{r['file']}:{r['line']}: {r['reason']}\n    {r['raw'][:200]}")
        return
    path = ledger_path or out_dir / "ledger.duckdb"
    if not path.is_file():
        raise Failure(f"{path}: no ledger here; run `ctxreplay run ... --out {out_dir}` first or pass --ledger")
    try:
        led = Ledger(path, read_only=True)
    except CtxReplayError as exc:
        raise _fail(exc) from exc
    try:
        by = led.decision_counts(stage=stage_name, session_id=session_id)
        listed = led.decisions(stage=stage_name, session_id=session_id, with_replacement=False, limit=limit or None)
        runs = led.runs()
    finally:
        led.close()
    total = int(by["len"].sum()) if by.height else 0
    if json_:
        click.echo(orjson.dumps({"runs": runs.height, "decisions": total, "by_reason": by.to_dicts(),
                                 "rows": listed.to_dicts()}, default=str).decode())
        return
    click.echo(f"{path}: {runs.height} run(s), {total} decision(s)")
    for r in by.iter_rows(named=True):
        click.echo(f"  {r['spec_sha256'][:12]}  {r['stage']:<14} {r['action']:<12} {r['reason']:<24} {r['len']:>7}")
    for r in listed.iter_rows(named=True):
        click.echo(f"  #{r['seq']} {r['stage']} {r['action']} {r['reason']} thread {r['session_id'][:8]}/{r['thread_id']} "
                   f"entry {r['entry_id'][:12]} block {r['block_pos']}.{r['part_pos']} from call {r['from_call']}")


@main.command(context_settings=CONTEXT)
@click.option("--json", "json_", is_flag=True, help="One JSON document on stdout.")
def stages(json_: bool) -> None:
    """List the registered stages with version, parameters, defaults and docs.

    \b
    Example:
      ctxreplay stages --json
    """
    from pipeline.registry import load_stages, params_doc

    reg = load_stages()
    out = [{"name": s.name, "version": s.version, "module": s.module, "doc": s.doc.splitlines()[0] if s.doc else "",
            "params": params_doc(s.params)} for s in sorted(reg.values(), key=lambda s: s.name)]
    if json_:
        click.echo(orjson.dumps(out, option=orjson.OPT_SORT_KEYS, default=str).decode())
        return
    if not out:
        click.echo("no stages registered")
    for s in out:
        click.echo(f"{s['name']} (v{s['version']}): {s['doc']}")
        for p in s["params"]:
            click.echo(f"    {p['name']} = {p['default']!r}  {p['doc']}")


@main.command(context_settings=CONTEXT)
@click.argument("spec", required=False)
@click.option("--preset", help="Explain a preset instead of a file.")
@click.option("--json", "json_", is_flag=True, help="One JSON document on stdout.")
def explain(spec: str | None, preset: str | None, json_: bool) -> None:
    """Print the resolved pipeline spec (defaults filled in) and its sha256.

    \b
    Example:
      ctxreplay explain data/pipelines/default.toml
    """
    from pipeline.spec import load_spec

    try:
        sp = load_spec(spec, preset=preset)
    except CtxReplayError as exc:
        raise _fail(exc) from exc
    doc = {"sha256": sp.sha256, "source": sp.source, **sp.resolved()}
    if json_:
        click.echo(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS).decode())
        return
    click.echo(f"# {sp.source}\n# sha256 {sp.sha256}")
    click.echo(_toml(sp.resolved()))


def _toml(doc: dict[str, Any]) -> str:
    def val(v: Any) -> str:
        return orjson.dumps(v).decode() if not isinstance(v, bool) else ("true" if v else "false")

    out = ["[pipeline]"] + [f"{k} = {val(v)}" for k, v in doc["pipeline"].items()]
    for st in doc["stage"]:
        out += ["", "[[stage]]"] + [f"{k} = {val(v)}" for k, v in st.items() if v is not None]
    return "\n".join(out)


main.add_command(report)  # pipeline/cli_report.py
main.add_command(snapshot)  # pipeline/cli_regress.py
main.add_command(diff)  # pipeline/cli_regress.py

if __name__ == "__main__":  # pragma: no cover
    main()
