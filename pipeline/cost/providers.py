"""What the simulator and the break attribution need to know of a provider from a model id: who
serves it, and the shortest prompt its cache takes (../shared/docs/cost-and-cache.md §2.1)."""

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
    Gemini 2,048 for 2.5, else 4,096)."""
    m = (model or "").lower()
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
