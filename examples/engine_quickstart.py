"""The live engine on the sample Claude Code session: feed it as the agent wrote it, assemble each
request before its answer arrives, check every request against the batch replay, then restart and
resume. It needs ctxreplay installed (an editable install of the checkout or the wheel) and reads
the sample session beside it, in the checkout's data/samples/, so it runs from any directory:

    python examples/engine_quickstart.py

docs/engine.md walks through it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import polars as pl

from ctxreplay.pipeline.batch.runner import RunOptions, run
from ctxreplay.pipeline.engine.engine import Engine
from ctxreplay.pipeline.staging.spec import load_spec

# the checkout this file is in (not the installed package, which ships no samples; importing
# ctxreplay from the checkout's folders would not work either: they are mapped under it at install)
ROOT = Path(__file__).resolve().parent.parent
SESSION = "5f0c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f"
TRANSCRIPT = ROOT / "data" / "samples" / "claude-projects" / "-home-dev-demo" / f"{SESSION}.jsonl"


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="engine-quickstart-") as tmp:
        quickstart(Path(tmp))


def quickstart(work: Path) -> None:
    entries = [json.loads(line) for line in TRANSCRIPT.read_text().splitlines() if line.strip()]
    ledger = work / "ledger.duckdb"
    spec = load_spec(preset="default")

    sent: list[str] = []
    with Engine.open(spec, ledger) as eng:
        last_answer = None
        for e in entries:
            msg = e.get("message") or {}
            if e.get("type") == "assistant" and msg.get("id") != last_answer:
                # a new answer is about to arrive: this is the request the agent sent for it
                res = eng.assemble(SESSION, model=msg.get("model"))
                sent.append(res.request_sha256)
                brk = res.prefix_break_message
                print(f"call {res.call}: {res.n_messages} messages, ~{res.prompt_tokens} tokens, "
                      f"sha256 {res.request_sha256[:12]}, "
                      + ("extends the last request" if brk is None else f"differs from message {brk} on"))
                last_answer = msg.get("id")
            eng.ingest(SESSION, [e])
        # the pending call, as a resumed session carries it until the user's next message
        res = eng.assemble(SESSION, awaiting_user=True)
        sent.append(res.request_sha256)
        print(f"pending call {res.call}: {res.n_messages} messages, ~{res.prompt_tokens} tokens, "
              f"awaits the user: {res.awaits_user}, decisions for it: {res.decisions.height}, "
              f"quarantined entries: {len(res.quarantined)}")
        usage = eng.after_turn(SESSION, {"input_tokens": 12, "cache_read_input_tokens": res.prompt_tokens,
                                         "output_tokens": 80})
        print(f"after_turn: recorded {usage.recorded_prompt_tokens} prompt tokens for call {usage.call}")

    # the batch replay of the same transcript gives the same bytes, call by call
    batch = run([TRANSCRIPT], spec, RunOptions(out_dir=work / "out", ledger_path=work / "batch.duckdb"))
    main_calls = batch.calls.filter(pl.col("thread_id") == "main").sort("call")
    print("same requests as ctxreplay run:", main_calls.get_column("request_sha256").to_list() == sent)

    # a new process: re-open the engine on the ledger, ingest the transcript again, resume
    with Engine.open(spec, ledger) as eng:
        eng.ingest(SESSION, entries)
        print("resumed pending request identical:",
              eng.assemble(SESSION, awaiting_user=True).request_sha256 == sent[-1])


if __name__ == "__main__":
    main()
