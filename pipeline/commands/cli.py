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

from ctxreplay.errors import ArgumentError, CtxReplayError, Interrupted, internal_error
from ctxreplay.pipeline.commands.cli_regress import diff, snapshot
from ctxreplay.pipeline.commands.cli_report import compare, report
from ctxreplay.pipeline.commands.clicommon import (
    CONTEXT,
    RegistryChoice,
    echo,
    follow_links_option,
    json_option,
    max_line_bytes_option,
    no_cache_option,
    paths_or_roots,
    pipeline_option,
    preset_choice,
    preset_option,
    stage_option,
    target_option,
)
from ctxreplay.pipeline.core.termtext import shown
from ctxreplay.pipeline.core.words import plural


class _Shown(click.ClickException):
    """A CtxReplayError as the user sees it: `ctxreplay: <its message>` on stderr, its exit code."""

    def __init__(self, exc: CtxReplayError) -> None:
        super().__init__(str(exc))
        self.exit_code = exc.exit_code

    def show(self, file: Any = None) -> None:
        echo(f"ctxreplay: {self.format_message()}", err=True)


class _Main(click.Group):
    """The command group, with the one place where errors become exit codes: a CtxReplayError (a
    command's own ArgumentError, or one raised below it) ends as one paragraph on stderr and its
    `exit_code`; Ctrl-C as Interrupted (130); anything else as an internal error (2) whose
    traceback goes to a file. Never a traceback on the terminal."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with _signals_raise():
                return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit):
            raise
        except CtxReplayError as exc:
            if _SIGNALLED and exc.exit_code != 130:  # an error the interruption caused (see _signals_raise)
                raise _interrupted(exc) from None
            raise _Shown(exc) from exc
        except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly, as Unix tools do
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(141)
        except KeyboardInterrupt as exc:
            raise _interrupted(exc) from None
        except Exception as exc:
            if _SIGNALLED:  # an error the interruption caused (see _signals_raise)
                raise _interrupted(exc) from None
            raise _Shown(internal_error(exc)) from exc


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is (as Ctrl-C is), so that it cleans up as on Ctrl-C: worker
    processes stopped, their queues' semaphores freed (no `leaked semaphore` warning), locks released."""


_SIGNALLED: list[int] = []  # the signals (SIGINT, SIGTERM) this command received
IMPORT_WAIT_S = 5.0  # how long Ctrl-C / SIGTERM waits for imports under way to end (_signals_raise)


@contextlib.contextmanager
def _signals_raise() -> Any:
    """While a command runs (issue 23, item 8): Ctrl-C raises KeyboardInterrupt as always and
    SIGTERM raises _Terminated, where nobody set a handler of their own and in the main thread only;
    each is noted, so that an error it caused on its way up (DuckDB's `Query interrupted`, a
    BrokenProcessPool, a polars panic) still ends as the interruption it is, not an internal error."""
    import signal
    import threading
    import time

    from ctxreplay.entry import exit_at_once, quiet_sigint

    _SIGNALLED.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def importing(frame: Any) -> bool:
        while frame is not None:
            if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
                return True
            frame = frame.f_back
        return False

    def later(signum: int) -> None:
        """The signal again in a moment. An exception raised inside an import can land in a native
        module's initialisation (DuckDB's, imported lazily by a loader), which then aborts the
        process (SIGABRT) instead of unwinding; so the signal waits until no import is under way."""
        t = threading.Timer(0.02, os.kill, (os.getpid(), signum))
        t.daemon = True
        t.start()

    deferred: dict[int, float] = {}

    def defer(signum: int, frame: Any) -> bool:
        if not importing(frame):
            deferred.pop(signum, None)
            return False
        first = deferred.setdefault(signum, time.monotonic())
        if time.monotonic() - first > IMPORT_WAIT_S:
            # imports for 5 s each time the signal came back (one that does not end, or a busy
            # machine importing one module after another): an exception cannot be raised safely
            # there (it lands in a native init, or in importlib's weakref callback, which swallows
            # it and the command goes on), so the process ends now, as a SIGKILL would leave it:
            # the output directory holds its last complete run, the ledger's open transaction
            # is never committed
            exit_at_once(signum)
        later(signum)
        return True

    def on_sigint(signum: int, frame: Any) -> None:
        if defer(signum, frame):
            return
        _SIGNALLED.append(signum)
        signal.default_int_handler(signum, frame)

    def on_sigterm(signum: int, frame: Any) -> None:
        if defer(signum, frame):
            return
        _SIGNALLED.append(signum)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        raise _Terminated()

    # SIGINT's start-up handler (ctxreplay/entry.py: exit 130 at once) is replaced too: inside a
    # command, Ctrl-C must unwind so that the command cleans up; it is put back afterwards
    old = {}
    for sig, handler, defaults in ((signal.SIGINT, on_sigint, (signal.default_int_handler, quiet_sigint)),
                                   (signal.SIGTERM, on_sigterm, (signal.SIG_DFL,))):
        if signal.getsignal(sig) in defaults:
            old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _interrupted(exc: BaseException) -> _Shown:
    import signal

    term = isinstance(exc, _Terminated) or signal.SIGTERM in _SIGNALLED
    err = Interrupted(f"{'terminated (SIGTERM)' if term else 'interrupted'}; the output directory still holds the "
                      "last complete run and the ledger is as it was before this run")
    if term:
        err.exit_code = 143  # 128 + SIGTERM, as a shell reports a process it ended
    return _Shown(err)


def _progress(quiet: bool, json_: bool) -> Any:
    if quiet or json_ or not sys.stderr.isatty():
        return None
    return lambda msg: echo(f"… {msg}", err=True)


@click.group(cls=_Main, context_settings=CONTEXT)
@click.version_option(package_name="ctxreplay", prog_name="ctxreplay")
def main() -> None:
    """Replay, call by call, what an AI agent sent to its model, from session transcripts on disk."""


@main.command(context_settings=CONTEXT)
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@pipeline_option()
@preset_option()
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("ctxreplay-out"), show_default=True,
              help="Output directory.")
@click.option("--ledger", "ledger_path", type=click.Path(path_type=Path),
              help="Ledger file (default: OUT/ledger.duckdb).")
@target_option()
@click.option("--all-calls", is_flag=True, help="Also write every call's request to requests/<thread_key>.jsonl.")
@json_option("the summary")
@click.option("--strict", is_flag=True, help="Exit 1 when lines were quarantined or requests violate the target.")
@click.option("--fast-tokens", is_flag=True, help="Estimate tokens as ceil(chars/4) instead of tiktoken.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors (no summary, no progress); with --json "
              "the JSON document is still printed.")
@click.option("--batch-bytes", type=click.IntRange(min=1), help="Input bytes per batch of session groups (default: "
              "16 MiB): memory grows with it, not with the whole input.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), help="Worker processes for the batches (default: one per "
              "core); the outputs are the same for any number.")
@click.option("--full", is_flag=True, help="Run every session group again, even those whose files did not change "
              "since the previous run in OUT (by default their outputs are reused).")
@click.option("--engine", type=RegistryChoice(lambda: ["local", "ray"], "engine"), default="local",
              show_default=True, help="Where the batches run: this machine, or Ray Data (the `ray` extra; a local "
              "Ray with --jobs CPUs, or the cluster of --address); the outputs are the same.")
@click.option("--address", metavar="HOST:PORT", help="With --engine ray: join this Ray cluster (HOST:PORT of its "
              "head node); inputs and --out must then be on a shared path.")
@click.option("--profile", is_flag=True, help="Also print what each pipeline pass cost: per stage position its "
              "time and polars collects, the quick checks, the totals (summary.json: profile).")
@follow_links_option()
@max_line_bytes_option()
@no_cache_option()
def run(paths: tuple[Path, ...], pipeline_file: Path | None, preset: str | None, out_dir: Path,
        ledger_path: Path | None, target: str | None, all_calls: bool, json_: bool, strict: bool, fast_tokens: bool,
        quiet: bool, batch_bytes: int | None, jobs: int | None, full: bool, engine: str,
        address: str | None, profile: bool) -> None:
    """Load transcripts, apply the pipeline, replay every call; write outputs and the ledger.

    PATHS are files or directories (searched recursively). Without PATHS: $CLAUDE_CONFIG_DIR/projects
    (else ~/.claude/projects and ~/.config/claude/projects), ~/.openclaw/agents,
    $CODEX_HOME/sessions (else ~/.codex/sessions) and the chats folders of ~/.gemini/tmp/*
    ($GEMINI_CLI_HOME/.gemini/tmp/* when set), where they exist (`ctxreplay report` reads the same).
    The outputs of OUT change all at once when the run ends
    (an interrupted run leaves the previous ones); a second run on the same OUT or ledger while
    one runs is refused.

    \b
    Example:
      ctxreplay run ~/.claude/projects --preset identity --out /tmp/replay
      ctxreplay run ~/.claude/projects --engine ray --jobs 4 --out /tmp/replay
    """
    from ctxreplay.pipeline.batch.runner import RunOptions
    from ctxreplay.pipeline.batch.runner import run as do_run
    from ctxreplay.pipeline.core.tokens import CHARS4_COUNTER, TIKTOKEN_COUNTER
    from ctxreplay.pipeline.staging.spec import load_spec

    spec = load_spec(pipeline_file, preset=preset)
    chosen = paths_or_roots(paths, "ctxreplay run data/samples")
    opts = RunOptions(out_dir=out_dir, ledger_path=ledger_path, target=target, all_calls=all_calls,
                      token_counter=CHARS4_COUNTER if fast_tokens else TIKTOKEN_COUNTER)
    if _progress(quiet, json_) is not None:  # a terminal: files, groups, calls, ETA (pipeline/core/progress.py)
        from ctxreplay.pipeline.core.progress import RunProgress

        opts.display = RunProgress()
        opts.progress = opts.display.note
    opts.reuse = not full
    opts.jobs = jobs  # None: one per core
    if address and engine != "ray":
        raise ArgumentError(f"--address {address} joins a Ray cluster: it needs --engine ray")
    opts.engine, opts.address = engine, address
    opts.profile = profile
    if batch_bytes:
        opts.batch_bytes = batch_bytes
    result = do_run(chosen, spec, opts)
    s = result.summary
    if json_:
        click.echo(orjson.dumps(s, option=orjson.OPT_SORT_KEYS).decode())
    elif not quiet:
        echo(_human(s))
        if profile:
            echo(_profile(s["profile"]))
    if strict and result.found_problems:
        if not json_:
            failed = len(s.get("stage_failures") or [])
            echo(f"--strict: {plural(s['quarantined_lines'], 'quarantined line')}, "
                 f"{plural(s['violations'], 'violation')}, {plural(s['conflicts'], 'ledger conflict')}"
                 + (f", {plural(failed, 'plug-in stage failure')}" if failed else ""), err=True)
            for v in result.violations[:20]:
                echo(f"  {v}", err=True)
        sys.exit(1)


SHOW_SKIPPED = 5


def _human(s: dict[str, Any]) -> str:
    lines = [
        f"ctxreplay: pipeline '{s['pipeline']}' ({s['pipeline_sha256'][:12]}), target {s['target']}",
        (f"  read {plural(s['files'], 'file')}, {plural(s['lines'], 'line')}: {s['message_lines']:,} message, "
         f"{s['other_lines']:,} other, {s['quarantined_lines']:,} quarantined"),
        (f"  {plural(s['sessions'], 'session')}, {plural(s['threads'], 'thread')}, {plural(s['calls'], 'call')} "
         f"({s['recorded_calls']:,} recorded + {s['pending_calls']:,} pending)"),
    ]
    g = s.get("groups")
    if g:
        lines.append(f"  {plural(g['total'], 'session group')} in {plural(g['batches'], 'batch', 'batches')}: "
                     f"{g['reused']:,} reused from the previous run, {g['rerun']:,} re-run, {g['new']:,} new")
    if s["decisions"]:
        lines.append("  decisions: " + ", ".join(f"{k} {v:,}" for k, v in s["decisions"].items()))
    else:
        lines.append("  decisions: none (no context layers in this pipeline)")
    if s["violations"]:
        lines.append(f"  {plural(s['violations'], 'violation')} of the {s['target']} rules (recorded in the ledger): "
                     + ", ".join(f"{k} {v}" for k, v in s["violations_by_rule"].items()))
    for f in s.get("stage_failures") or []:
        lines.append(f"  plug-in stage '{f['stage']}' (#{f['position']}, {f['owner']}) skipped for "
                     f"{len(f['sessions'])} session(s) ({f['kind']}): {f['message']}")
    if s["quarantined_lines"]:
        reasons = ", ".join(f"{k}: {v}" for k, v in (s.get("quarantine_codes") or s["quarantine_reasons"]).items())
        lines.append(f"  {s['quarantined_lines']:,} of {plural(s['lines'], 'line')} quarantined ({reasons}); everything else "
                     f"was replayed. See them with: ctxreplay ledger {s['out_dir']} --quarantine")
    glued = sum(1 for r in s["recovered_lines"] if "objects" in r)
    if glued:
        lines.append(f"  recovered {plural(glued, 'line')} holding more than one JSON object")
    if len(s["recovered_lines"]) > glued:
        lines.append(f"  {plural(len(s['recovered_lines']) - glued, 'line')} read with a repair or a note (bytes "
                     "that are not UTF-8 replaced, a copy of a session read once, ...): recovered_lines in summary.json")
    skipped = s.get("skipped_files") or []
    if skipped:
        lines.append(f"  skipped {plural(len(skipped), 'file')}:")
        lines += [f"    {shown(x['file'])}: {x['reason']}" for x in skipped[:SHOW_SKIPPED]]
        if len(skipped) > SHOW_SKIPPED:
            lines.append(f"    ... and {len(skipped) - SHOW_SKIPPED} more (all in {s['out_dir']}/summary.json)")
    lines.append(f"  wrote {s['out_dir']}/calls.parquet, requests/, summary.json (run {s['run_id']}); "
                 f"ledger {s['ledger']}")
    lines.append(f"  took {s['seconds']:.2f} s")
    return "\n".join(lines)


def _profile(p: dict[str, Any]) -> str:
    """`run --profile`: the stage positions' time and polars collects over the passes run."""
    n = p["passes"]
    if not n:
        return "profile: no pipeline pass (every session group's outputs were reused; --full runs them again)"
    head = f"profile: {plural(n, 'pipeline pass', 'pipeline passes')} (one per batch); time and polars collects in all"
    lines = [head + ", per stage position:"]
    width = max([len("quick checks"), *(len(v["position"]) for v in p["stages"])])
    lines.append(f"  {'position':<{width}}  {'ms':>9}  {'collects':>8}  quiet")
    for v in p["stages"]:
        lines.append(f"  {v['position']:<{width}}  {v['seconds'] * 1e3:9.1f}  {v['collects']:8,}  {v['quiet']} of {n}")
    c = p["checks"]
    lines.append(f"  {'quick checks':<{width}}  {c['seconds'] * 1e3:9.1f}  {c['collects']:8,}  "
                 f"({plural(c['positions'], 'position')} asked in {plural(c['queries'], 'query', 'queries')})")
    t = p["totals"]
    lines.append(f"  {'stages, total':<{width}}  {t['seconds'] * 1e3:9.1f}  {t['collects']:8,}")
    lines.append("  phases: " + ", ".join(f"{k} {v['seconds'] * 1e3:.0f} ms ({v['collects']:,} collects)"
                                         for k, v in p["phases"].items()))
    return "\n".join(lines)


def _dump(doc: Any) -> str:
    """One JSON document (an object with named keys) for --json."""
    return orjson.dumps(doc, option=orjson.OPT_SORT_KEYS, default=str).decode()


def _retry_on_republish(fn: Any) -> Any:
    """Call fn() again once when a newer run was published while it read the old one (its files removed)."""
    try:
        return fn()
    except FileNotFoundError:
        return fn()


THREAD_HELP = ("THREAD is a thread key (`ctxreplay threads OUT` lists them) or any unique prefix of one; a "
               "session id or prefix alone means that session's main thread; SESSION/THREAD takes a prefix of each.")


@main.command(context_settings=CONTEXT)
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.argument("thread")
@click.option("--call", "call", type=int, help="Call index (0-based); default: the pending call.")
@target_option("the target the run used, from its summary.json", of="the request")
@click.option("--canonical", is_flag=True, help="Print exactly the bytes whose sha256 is request_sha256 in "
              "calls.parquet (sorted keys, no whitespace, no newline at the end).")
def request(out_dir: Path, thread: str, call: int | None, target: str | None, canonical: bool) -> None:
    """Print one call's request (JSON, indented) from a run's output directory, rebuilt from its
    request store.

    It reads the run OUT shows (OUT/current): byte for byte the request whose sha256 is in
    calls.parquet, in the run's own target, with no stage or shaping run again (`--target` another
    wire shape: shaped anew from the run's final blocks); `--canonical | sha256sum` prints that sha256. THREAD is a thread key or a unique prefix of one (a session id or prefix alone:
    its main thread; SESSION/THREAD: a prefix of each).

    \b
    Example:
      ctxreplay request ctxreplay-out 5f0c1d2e --call 3 --canonical | sha256sum
    """
    from ctxreplay.pipeline.assembly.store import request_json
    from ctxreplay.pipeline.inspection.threads import RunView

    def assemble() -> bytes:
        view = RunView(out_dir)  # once: every file read comes from the same run
        ref = view.thread(thread)
        return request_json(view.run_dir, ref.key, call, target)

    data = _retry_on_republish(assemble)
    if canonical:
        click.echo(data, nl=False)
    else:
        click.echo(orjson.dumps(orjson.loads(data), option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2).decode())


@main.command(context_settings=CONTEXT)
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.argument("thread")
@click.option("--call", "call", type=int, help="Call index (0-based); default: the pending call.")
@stage_option("Only the blocks this stage changed, and its decisions (`pairing` also takes pairing#2).")
@click.option("--changed", "changed_only", is_flag=True, help="Only the blocks a layer changed, dropped, inserted "
              "or moved.")
@click.option("--diff", is_flag=True, help="Also replay the transcript as recorded (no stage) at the same call: "
              "its request's hash, where it first differs, and each changed block's recorded text against "
              "the replayed one.")
@click.option("--full", is_flag=True, help="Unfold long texts (by default: first and last lines).")
@json_option("the same")
def why(out_dir: Path, thread: str, call: int | None, stage_name: str | None, changed_only: bool, diff: bool,
        full: bool, json_: bool) -> None:
    """Show one call's request block by block, with the decision behind every change.

    Every block a layer changed, dropped, inserted or moved carries its decisions inline: stage,
    action and reason, the call it applies from, cache_epoch, and the size before and after
    (bytes). Dropped blocks are shown struck through, where the transcript had them, though the
    request no longer holds them. Then the wire request: its messages, and which of them hold
    changes. A decision is shown when it applies at this call (from_call <= call) to a block
    the request holds or the transcript held there; provisional decisions (for the pending call,
    not frozen in the ledger) are marked. The session's transcript files are read again (they
    must be where `run` read them, unchanged). THREAD as for `ctxreplay request`.

    \b
    Example:
      ctxreplay why ctxreplay-out 9e953218 --call 40 --changed
    """
    from ctxreplay.pipeline.inspection.threads import RunView
    from ctxreplay.pipeline.inspection.why import WhyOptions, build, render, to_json

    def make() -> dict[str, Any]:
        view = RunView(out_dir)
        return build(view, view.thread(thread), WhyOptions(call=call, stage=stage_name, diff=diff, full=full,
                                                           changed_only=changed_only))

    doc = _retry_on_republish(make)
    if json_:
        click.echo(to_json(doc).decode())
    else:
        click.echo(render(doc, color=sys.stdout.isatty()), nl=False)


@main.command(context_settings=CONTEXT)
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--session", "session", help="Only this session (a unique prefix of its id).")
@json_option()
def threads(out_dir: Path, session: str | None, json_: bool) -> None:
    """List the threads of a run, one line each.

    Per thread: SESSION/THREAD (what `request`, `why` and `ledger --thread` take), kind (main,
    subagent, compaction agent, branch, sidechain, request), its own calls (a thread that shares
    history with another reports only the calls after it: their range is shown), models, the
    time of its first and last call, the pending request's prompt tokens, the decisions applied
    to it by stage (provisional ones counted), and the target's rule violations in its pending
    request.

    \b
    Example:
      ctxreplay threads ctxreplay-out --session 5f0c
    """
    from ctxreplay.pipeline.inspection.threads import RunView, render_threads, threads_table

    def make() -> tuple[Any, list[dict[str, Any]], str | None]:
        view = RunView(out_dir)
        sid = view.session(session) if session else None
        return view, threads_table(view, sid), sid

    view, rows, sid = _retry_on_republish(make)
    if json_:
        click.echo(_dump({"out_dir": str(out_dir), "run_id": view.summary.get("run_id"), "session": sid,
                          "target": view.target, "count": len(rows), "threads": rows}))
        return
    echo(render_threads(rows, view))
    calls = sum(r["calls"] for r in rows)
    echo(f"{plural(len(rows), 'thread')}, {plural(len({r['session_id'] for r in rows}), 'session')}, "
         f"{plural(calls, 'own call')} + {len(rows):,} pending")


@main.command(context_settings=CONTEXT)
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--ledger", "ledger_path", type=click.Path(path_type=Path), help="Ledger file (default: OUT/ledger.duckdb).")
@stage_option("Only this stage's decisions (`pairing` also takes pairing#2).")
@click.option("--session", "session_id", help="Only this session's decisions (a unique prefix of its id).")
@click.option("--thread", "thread", help="Only this thread's decisions (as THREAD of `ctxreplay request`).")
@click.option("--quarantine", is_flag=True, help="Show the quarantined lines of the run instead.")
@click.option("--limit", type=click.IntRange(min=0, max=2**63 - 1, clamp=True), default=50, show_default=True,
              help="Rows to list (0: all; more than there are: all).")
@json_option()
def ledger(out_dir: Path, ledger_path: Path | None, stage_name: str | None, session_id: str | None,
           thread: str | None, quarantine: bool, limit: int, json_: bool) -> None:
    """Count and list the decisions of the run OUT shows, and the ledger's frozen ones.

    The run's counts equal its summary's: each stage, action and reason with its frozen
    decisions (in the ledger) and its provisional ones (made for a thread's pending call: applied
    to that request, not frozen, since the transcript may still grow). Listed rows carry their
    ledger seq (#n) when frozen. Without a run in OUT: the ledger's decisions, per namespace.

    \b
    Example:
      ctxreplay ledger ctxreplay-out --stage tombstone --session 9e95 --limit 10
    """
    import polars as pl

    from ctxreplay.pipeline.core.outdir import resolve_run
    from ctxreplay.pipeline.inspection.ledger_query import LedgerQuery, query
    from ctxreplay.pipeline.inspection.ledger_query import render as render_ledger

    if quarantine:
        q_path = resolve_run(out_dir) / "quarantine.parquet"
        if not q_path.is_file():
            raise ArgumentError(f"{out_dir}: no quarantine.parquet here; run `ctxreplay run ... --out {out_dir}` first")
        q = pl.read_parquet(q_path)
        rows = q.head(limit) if limit else q
        if json_:
            click.echo(_dump({"count": q.height, "rows": rows.to_dicts()}))
        else:
            echo(f"{plural(q.height, 'quarantined line')}")
            for r in rows.iter_rows(named=True):
                code = f"[{r['code']}] " if r.get("code") else ""
                echo(f"{shown(r['file'])}:{r['line']}: {code}{r['reason']}\n    {shown(r['raw'][:200])}")
        return
    doc = _retry_on_republish(lambda: query(out_dir, ledger_path, LedgerQuery(stage=stage_name, session=session_id,
                                                                             thread=thread, limit=limit)))
    text, notes = render_ledger(doc)
    if json_:
        click.echo(_dump(doc))
    else:
        echo(text)
    for n in notes:
        echo(f"ctxreplay: {n}", err=True)


@main.command(context_settings=CONTEXT)
@json_option()
def stages(json_: bool) -> None:
    """List the registered stages: owner package and version, what each needs, and its parameters
    with their defaults as a [[stage]] table you can paste into a spec. Plug-ins that failed to load
    are listed at the end.

    \b
    Example:
      ctxreplay stages --json
    """
    from ctxreplay.pipeline.stageapi.registry import PLUGIN_ERRORS, describe, load_stages

    reg = load_stages()
    out = [describe(s) for s in sorted(reg.values(), key=lambda s: (not s.is_builtin, s.name))]
    errors = [{"entry_point": e.entry_point, "package": e.package, "message": e.message, "stage": e.stage}
              for e in PLUGIN_ERRORS]
    if json_:
        click.echo(orjson.dumps({"stages": out, "plugin_errors": errors}, option=orjson.OPT_SORT_KEYS,
                                default=str).decode())
        return
    if not out:
        echo("no stages registered")
    for s in out:
        owner = f"{s['owner']} {s['owner_version'] or ''}".strip() + (" (built-in)" if s["builtin"] else "")
        echo(f"# {s['name']} v{s['version']}, from {owner}: {s['doc']}")
        needs = [f"requires {', '.join(s['requires'])} earlier" if s["requires"] else "",
                 f"reads {', '.join(s['reads'])}'s params" if s["reads"] else ""]
        if any(needs):
            echo("# " + "; ".join(x for x in needs if x))
        echo(s["toml"] + "\n")
    for e in errors:
        echo(f"plug-in {e['package']} (entry point '{e['entry_point']}') was not loaded: {e['message']}")


@main.command(context_settings=CONTEXT)
@click.argument("spec", required=False)
@preset_option("Explain a preset instead of a file.")
@json_option()
def explain(spec: str | None, preset: str | None, json_: bool) -> None:
    """Print the resolved pipeline spec (defaults filled in) and its sha256.

    \b
    Example:
      ctxreplay explain data/pipelines/default.toml
    """
    from ctxreplay.pipeline.staging.spec import load_spec

    sp = load_spec(spec, preset=preset)
    doc = {"sha256": sp.sha256, "source": sp.source, **sp.resolved()}
    if json_:
        click.echo(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS).decode())
        return
    click.echo(f"# {sp.source}\n# sha256 {sp.sha256}")
    click.echo(_toml(sp.resolved()))


@main.command(context_settings=CONTEXT)
@click.argument("preset", type=preset_choice(), default="default")
def init(preset: str) -> None:
    """Print a commented pipeline spec to start from: PRESET (default: default) with every stage's
    parameters spelled out, each with its type, default and one-line doc as TOML comments, and
    the stages it does not use commented out after it. As printed it is the preset:
    `ctxreplay explain` gives it the preset's sha256.

    \b
    Example:
      ctxreplay init default > mine.toml && ctxreplay explain mine.toml
    """
    from ctxreplay.pipeline.staging.spec_init import init_spec

    click.echo(init_spec(preset), nl=False)


def _toml(doc: dict[str, Any]) -> str:
    def val(v: Any) -> str:
        return orjson.dumps(v).decode() if not isinstance(v, bool) else ("true" if v else "false")

    out = ["[pipeline]"] + [f"{k} = {val(v)}" for k, v in doc["pipeline"].items()]
    for st in doc["stage"]:
        out += ["", "[[stage]]"] + [f"{k} = {val(v)}" for k, v in st.items() if v is not None]
    return "\n".join(out)


main.add_command(report)  # pipeline/commands/cli_report.py
main.add_command(compare)  # pipeline/commands/cli_report.py
main.add_command(snapshot)  # pipeline/commands/cli_regress.py
main.add_command(diff)  # pipeline/commands/cli_regress.py

if __name__ == "__main__":  # pragma: no cover
    from ctxreplay.deferred import defer

    defer("polars")  # as the `ctxreplay` command does (ctxreplay/entry.py)
    main()
