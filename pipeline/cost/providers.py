"""What the simulator and the break attribution need to know of a provider: who serves a call (from
its model id, and where the agent recorded them, the call's API and provider), how that provider
caches prompts, and the shortest prompt its cache takes (../shared/docs/cost-and-cache.md §2.1;
docs/cache-simulation.md "Which cache rules a call gets" lists the sources)."""

from __future__ import annotations

import re

# minimum cacheable prompt per model (cost-and-cache.md §2.1; where sources disagree, the larger
# value, which real data supports: Sonnet 4.6 caching observed only from 2,048)
_ANTHROPIC_MIN: list[tuple[re.Pattern[str], int]] = [
    (re.compile(r"(?:opus|fable|mythos)-5(?!-\d)|(?:opus|fable|mythos)-5-[0-9]"), 512),
    (re.compile(r"opus-4-[5-7]|haiku-4-5|haiku-4\.5|opus-4\.[5-7]"), 4096),
    (re.compile(r"sonnet-4-6|sonnet-4\.6|haiku-3|3-haiku|3-5-haiku"), 2048),
]
_GEMINI_MIN: list[tuple[re.Pattern[str], int]] = [(re.compile(r"gemini-2\.5"), 2048)]
OPENAI_MIN_TOKENS = 1024
OPENAI_STEP = 128
OPENAI_WRITE_FEE = re.compile(r"gpt-(?:5\.(?:[6-9]|\d\d)|[6-9])")


# Providers of other models whose caching is documented (docs/cache-simulation.md lists the pages):
# - MiniMax: on its Anthropic-compatible API (`anthropic-messages`) `cache_control` breakpoints
#   work as Anthropic's ("explicit caching": tools -> system -> messages, a 20-block lookback, 5
#   minutes refreshed on use), writes charged at 1.25x input, reads 0.1x; on its other APIs a
#   passive prefix cache, writes not charged; caching from 512 input tokens.
# - Z.ai / Zhipu GLM: implicit context caching of repeated prefixes on every API (cached tokens in
#   `usage.prompt_tokens_details.cached_tokens`), cached-input storage free: no write fee; no
#   minimum documented.
_MINIMAX = re.compile(r"minimax")
_ZAI = re.compile(r"(?:^|[/:])(?:zai|z-ai|zhipu|bigmodel)|(?:^|/)glm-")
MINIMAX_MIN_TOKENS = 512
ANTHROPIC_API = "anthropic-messages"


def cache_provider(model: str | None, api: str | None = None, provider: str | None = None) -> str | None:
    """The cache rules a call gets: `anthropic` (explicit breakpoints, writes charged: Claude, and
    MiniMax on its Anthropic-compatible API), `openai`, `gemini`, `automatic` (another provider's
    documented automatic prefix cache, writes free: MiniMax on its other APIs, Z.ai GLM), or None
    (unknown: the simulator takes the OpenAI rules where the thread's recorded usage shows
    caching). `api` and `provider` are what the agent recorded for the call (OpenClaw), if any."""
    own = provider_of(model)
    if own is not None:
        return own
    m, p = (model or "").lower(), (provider or "").lower()
    if _MINIMAX.search(m) or _MINIMAX.search(p):
        return "anthropic" if api == ANTHROPIC_API else "automatic"
    if _ZAI.search(p) or _ZAI.search(m):
        return "automatic"
    return None


def provider_of(model: str | None) -> str | None:
    """anthropic / openai / gemini from a model id (None: unknown)."""
    m = (model or "").lower()
    if "claude" in m or m.startswith("anthropic"):
        return "anthropic"
    if re.search(r"(?:^|/)(?:gpt|o\d|chatgpt|codex)", m):
        return "openai"
    if "gemini" in m:
        return "gemini"
    return None


def min_cacheable_tokens(model: str | None, provider: str | None) -> int:
    """The model's minimum cacheable prompt (Anthropic per model, default 1,024; OpenAI 1,024;
    Gemini 2,048 for 2.5, else 4,096; MiniMax 512; another `automatic` provider 0: none documented)."""
    m = (model or "").lower()
    if _MINIMAX.search(m):
        return MINIMAX_MIN_TOKENS
    if provider == "automatic":
        return 0       # Z.ai documents no minimum
    if provider == "anthropic":
        for pat, n in _ANTHROPIC_MIN:
            if pat.search(m):
                return n
        return 1024
    if provider == "gemini":
        for pat, n in _GEMINI_MIN:
            if pat.search(m):
                return n
        return 4096
    return OPENAI_MIN_TOKENS


# Anthropic models that keep every earlier thinking block in context by default, so that a new user
# turn after a turn with thinking changes no prefix (Anthropic's extended-thinking page, "differences
# in thinking across model versions": Opus 4.5 and later Opus models and Sonnet 4.6 and later Sonnet
# models keep all prior thinking blocks, as does Mythos; Sonnet 4.5 and earlier, Opus 4.1 and
# earlier and every Haiku through 4.5 keep only the last turn's; from the 5 generation on thinking
# is preserved and bound to its prefix, "preserved thinking"). Across the corpora, the recorded new
# turns after thinking of these models keep the cache (Opus 4.5 - 4.8, Sonnet 4.6).
_KEEPS_THINKING = re.compile(
    r"claude-(?:opus-4[-.][5-9](?!\d)|sonnet-4[-.][6-9](?!\d)|(?:opus|sonnet|haiku|fable|mythos)-(?:[5-9]|1\d)(?!\d)"
    r"|mythos)")


def keeps_thinking(model: str | None) -> bool:
    """Whether an Anthropic model keeps earlier turns' thinking blocks in context by default (a new
    user turn strips nothing): Opus 4.5+, Sonnet 4.6+, Mythos, and every model of the 5 generation
    and later. Others (Claude 3, Sonnet 4 / 4.5, Opus 4 / 4.1, Haiku through 4.5) strip them."""
    return bool(_KEEPS_THINKING.search((model or "").lower()))
