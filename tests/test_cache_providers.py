"""The cache rules of a call come from what the agent recorded: its API, provider and model
(providers.cache_provider; docs/cache-simulation.md "Which cache rules a call gets").

Small hand-written OpenClaw sessions: three turns, each request the previous one plus a user
message, recorded usage as the provider would report it. Each rule is checked on both sides: the
API that makes MiniMax write-charge and the one that does not, the minimum of 512 tokens MiniMax
documents, Z.ai's automatic cache without a documented minimum against a model of unknown provider
(OpenAI's rules: 1,024 tokens in 128-token steps).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from ctxreplay.pipeline.cost.providers import cache_provider, min_cacheable_tokens

SID = "5a0c3e7d-2b1f-4c6a-8e9d-0f1a2b3c4d5e"


def _session(d: Path, api: str, provider: str, model: str, words: int, *, writes: bool) -> Path:
    """Three turns; a turn's user message is `words` distinct words (3 tokens each as counted); the
    recorded usage reads the previous request and writes (or, automatic, sends uncached) the rest."""
    lines: list[dict[str, Any]] = [
        {"type": "session", "version": 3, "id": SID, "timestamp": "2026-01-01T10:00:00.000Z", "cwd": "/w"}]
    parent, before = None, 0
    for i in range(3):
        text = f"question {i} " + " ".join(f"w{i}x{j}" for j in range(words))
        lines.append({"type": "message", "id": f"u{i}", "parentId": parent,
                      "timestamp": f"2026-01-01T10:0{i}:00.000Z",
                      "message": {"role": "user", "content": [{"type": "text", "text": text}]}})
        prompt = (i + 1) * words * 3
        new = prompt - before
        usage = {"input": 0 if writes else new, "output": 5, "cacheRead": before, "cacheWrite": new if writes else 0}
        lines.append({"type": "message", "id": f"a{i}", "parentId": f"u{i}",
                      "timestamp": f"2026-01-01T10:0{i}:05.000Z",
                      "message": {"role": "assistant", "content": [{"type": "text", "text": f"answer {i}"}],
                                  "api": api, "provider": provider, "model": model, "stopReason": "stop",
                                  "usage": usage}})
        parent, before = f"a{i}", prompt
    d.mkdir(parents=True)
    (d / f"{SID}.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return d


def _sim(tmp_path: Path, *args: Any, **kw: Any) -> pl.DataFrame:
    from ctxreplay.pipeline.batch.runner import RunOptions, run
    from ctxreplay.pipeline.staging.spec import load_spec

    d = _session(tmp_path / "s", *args, **kw)
    res = run([d], load_spec(preset="identity"), RunOptions(out_dir=tmp_path / "out"))
    return res.calls.filter(~pl.col("is_pending")).sort("call")


def test_minimax_on_its_anthropic_api_writes_and_the_writes_are_charged(tmp_path: Path) -> None:
    """OpenClaw sends MiniMax's Anthropic-compatible API cache_control breakpoints: explicit
    caching, as Anthropic's, writes charged at 1.25x input. The identity simulation writes what the
    recorded requests wrote (today's defect: simulated as an automatic cache, writes 0, -100 %)."""
    c = _sim(tmp_path, "anthropic-messages", "minimax", "MiniMax-M2.5", 600, writes=True)
    assert c["recorded_cache_write_tokens"].to_list() == [1800, 1800, 1800]
    assert c["sim_cache_write_5m_tokens"].to_list() == [1800, 1800, 1800]
    assert c["sim_cache_read_tokens"].to_list() == [0, 1800, 3600]
    assert c["sim_cost_usd"].round(9).to_list() == c["recorded_cost_usd"].round(9).to_list()
    # a write costs more than the same tokens sent uncached
    from ctxreplay.pipeline.cost.prices import PriceBook

    uncached = PriceBook.load().price("MiniMax-M2.5", "2026-01-01T10:00:05Z", 1800, 5, 0, 0, 0)
    assert uncached is not None and c["sim_cost_usd"][0] > uncached.total_usd


def test_minimax_on_another_api_is_an_automatic_cache_that_writes_nothing(tmp_path: Path) -> None:
    """Over its OpenAI-compatible API MiniMax caches prompts passively: nothing is written (or
    charged as a write), the previous request's prefix is read."""
    c = _sim(tmp_path, "openai-completions", "minimax", "MiniMax-M2.5", 600, writes=False)
    assert c["sim_cache_write_5m_tokens"].to_list() == [0, 0, 0]
    assert c["sim_cache_read_tokens"].to_list() == [0, 1800, 3600]
    assert c["sim_cost_usd"].round(9).to_list() == c["recorded_cost_usd"].round(9).to_list()


def test_minimax_caches_from_512_tokens(tmp_path: Path) -> None:
    """Requests of 300, 600, 900 tokens: the second's cached prefix (300) is under MiniMax's 512,
    the third's (600) is not (OpenAI's rule would read nothing below 1,024)."""
    c = _sim(tmp_path, "openai-completions", "minimax", "MiniMax-M2.5", 100, writes=False)
    assert c["calibrated_prompt_tokens"].to_list() == [300, 600, 900]
    assert c["sim_cache_read_tokens"].to_list() == [0, 0, 600]


@pytest.mark.parametrize("api", ["anthropic-messages", "openai-completions"])
def test_zai_glm_is_an_automatic_cache_on_every_api(tmp_path: Path, api: str) -> None:
    """Z.ai's context caching is implicit on each of its APIs and stores cached input for free, with
    no documented minimum: a 900-token prefix is read, nothing is written."""
    c = _sim(tmp_path, api, "zai", "glm-5-turbo", 300, writes=False)
    assert c["sim_cache_write_5m_tokens"].to_list() == [0, 0, 0]
    assert c["sim_cache_read_tokens"].to_list() == [0, 900, 1800]


def test_a_model_of_unknown_provider_keeps_the_openai_rules(tmp_path: Path) -> None:
    """The other side: a provider nobody documented here gets OpenAI's automatic rules where its
    recorded usage shows caching (1,024 tokens, 128-token steps)."""
    c = _sim(tmp_path, "openai-completions", "someprovider", "m1", 300, writes=False)
    assert c["sim_cache_read_tokens"].to_list() == [0, 0, 1792]


def test_cache_provider_rules() -> None:
    assert cache_provider("claude-opus-4-5", "anthropic-messages", "anthropic") == "anthropic"
    assert cache_provider("gpt-5.4") == "openai"
    assert cache_provider("MiniMax-M2.7", "anthropic-messages", "minimax") == "anthropic"
    assert cache_provider("MiniMax-M2.7", "anthropic-messages", "minimax-cn") == "anthropic"
    assert cache_provider("MiniMax-M2.7", "openai-completions", "minimax") == "automatic"
    assert cache_provider("minimax/minimax-m2", "openai-completions", "openrouter") == "automatic"
    assert cache_provider("glm-5-turbo", "anthropic-messages", "zai") == "automatic"
    assert cache_provider("GLM-4.7", "openai-completions", "zhipu") == "automatic"
    assert cache_provider("qwen3.5-plus", "openai-completions", "bailian") is None
    assert cache_provider("m1", "anthropic-messages", "someprovider") is None
    assert min_cacheable_tokens("MiniMax-M2.5", "anthropic") == 512
    assert min_cacheable_tokens("glm-5", "automatic") == 0
    assert min_cacheable_tokens("m1", None) == 1024
