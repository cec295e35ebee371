"""Provider wire shapes ("targets"): how the blocks of one request become a provider request.

A target turns the logical messages visible at a call (blocks grouped by msg_key, in order) into
wire messages, and wraps them into the request. The replay hashes requests incrementally, so a
target exposes its list key (sorted first in the canonical JSON) and the other top-level keys
separately. Targets register in TARGETS by name; `get_target(name)` finds one.

What the replay relies on (it re-shapes only the wire messages around a change and keeps the
canonical bytes of all the others, see pipeline/assembly/replay.py):
- `shape(msgs, start)` is a function of `msgs` alone, and a wire message depends only on the
  logical messages it holds, the logical message that ends its run, whether it is the first wire
  message, and what `context_key` says later messages may read of earlier ones (Gemini names a
  tool result after the call it answers); `shape` never looks at whether a message is the last
  one: leaving out a trailing assistant turn (`allow_prefill = False`) is the replay's job, so the
  pending request of a thread that ended on the assistant's answer can keep it.
- Each wire message is a `Wire` (a dict) that lists the block rows whose content it sends: its
  token estimate is the sum of theirs, so `prompt_tokens` counts exactly what was hashed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ctxreplay.errors import UnknownTarget, did_you_mean


@dataclass
class LogicalMessage:
    """The visible block rows of one message (dicts with the blocks columns), in order."""

    role: str
    rows: list[dict[str, Any]]
    msg_key: str = ""


@dataclass
class Violation:
    thread_key: str
    call: int
    message: int | None
    block: int | None
    rule: str
    detail: str

    def __str__(self) -> str:
        where = f"thread {self.thread_key}, call {self.call}"
        if self.message is not None:
            where += f", message {self.message}"
        if self.block is not None:
            where += f", block {self.block}"
        return f"{where}: {self.rule}: {self.detail}"


class Wire(dict):  # type: ignore[type-arg]
    """A wire message (a plain dict to JSON and to ==) that remembers the block rows it sends."""

    __slots__ = ("rows",)

    def __init__(self, msg: dict[str, Any], rows: list[dict[str, Any]] | None = None) -> None:
        super().__init__(msg)
        self.rows = rows if rows is not None else []


ASSISTANT_ROLES = ("assistant", "model")
# items without a role (OpenAI Responses): whose they are
_ITEM_ROLE = {"function_call": "assistant", "reasoning": "assistant", "custom_tool_call": "assistant",
              "function_call_output": "tool", "custom_tool_call_output": "tool"}


def wire_role(msg: dict[str, Any]) -> str | None:
    """The role of a wire message: its `role`, else (an item without one) whose item it is."""
    role = msg.get("role")
    if role is not None:
        return str(role)
    t = msg.get("type")
    return _ITEM_ROLE.get(str(t), str(t)) if t is not None else None


class Target(Protocol):
    name: str
    list_key: str
    allow_prefill: bool  # False: a recorded call's request never ends with an assistant message

    def shape(self, msgs: list[LogicalMessage], start: int) -> list[tuple[int, dict[str, Any]]]:
        """Wire messages for msgs[start:], each with the index of the first logical message it holds."""
        ...

    def envelope(self, model: str | None, system: list[LogicalMessage]) -> dict[str, Any]:
        """The request's other top-level keys (their names must sort after list_key)."""
        ...

    def splits_system(self) -> bool:
        """True when system messages go to the envelope instead of the message list."""
        ...

    def empty_messages(self) -> list[dict[str, Any]]:
        """What stands in for a request with no recorded message ([] for none)."""
        ...

    def validate(self, request: dict[str, Any], *, thread_key: str, call: int,
                 awaits_user: bool = False) -> list[Violation]:
        """`awaits_user`: the request is a pending one that ends with the assistant's answer (what a
        resumed session carries), so a trailing assistant message is not a violation."""
        ...

    # optional: def context_key(self, msg: LogicalMessage) -> Hashable | None
    #   what a LATER wire message may read of this logical message (None: nothing); the replay
    #   re-shapes everything after a change that alters it
    # optional: def keeps_in_list(self, row: dict[str, Any]) -> bool
    #   for a target whose splits_system() is True: a system row that stays in the message list
    #   (OpenAI Responses: a developer message the agent sent as an input item)


def recorded_role(row: dict[str, Any]) -> str | None:
    """The wire role a loader recorded for a system row that was a message of the request's list
    (its extra's `role`: `developer` for Codex's developer input items and OpenAI chat's developer
    messages), else None."""
    e = row.get("extra_json")
    if not e or '"role"' not in e:
        return None
    import orjson

    try:
        v = orjson.loads(e)
    except orjson.JSONDecodeError:
        return None
    role = v.get("role") if isinstance(v, dict) else None
    return role if isinstance(role, str) else None


def in_envelope(target: Target, row: dict[str, Any]) -> bool:
    """Whether a block row goes to the target's envelope instead of its message list: a system row
    of a target that splits system, unless the target keeps that row in the list (`keeps_in_list`)."""
    if row["role"] != "system" or not target.splits_system():
        return False
    keeps = getattr(target, "keeps_in_list", None)
    return not (keeps is not None and keeps(row))


TARGETS: dict[str, Target] = {}

# Block types (the blocks table's `block_type`) that every target shapes: text, images, client tool
# calls and their results, and thinking (which the sanitize layer keeps or drops per provider; a
# target without a wire form for it leaves it out). `empty` stands for a message recorded without
# content.
PORTABLE_BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking",
                                  "empty"})

# Provider-specific block types by API family (ctxreplay.pipeline.targets.target_family): a target carries
# them only when they come from its own family (server-side tools and their results, documents,
# OpenAI's hosted-tool items, refusals, files). Anything else that is not portable is foreign to
# the target: the sanitize layer converts it to text or drops it, with a decision, and the
# target's validator reports one that reaches a request (`unsupported_block_type`).
NATIVE_BLOCK_TYPES: dict[str, frozenset[str]] = {
    "anthropic": frozenset({
        "server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
        "bash_code_execution_tool_result", "text_editor_code_execution_tool_result", "tool_search_tool_result",
        "mcp_tool_use", "mcp_tool_result", "container_upload", "document", "search_result",
    }),
    "openai_responses": frozenset({
        "web_search_call", "file_search_call", "image_generation_call", "code_interpreter_call", "computer_call",
        "mcp_call", "mcp_list_tools", "mcp_approval_request", "refusal", "input_file",
    }),
}

# What an Anthropic tool_result's content list may hold (a part of another type is foreign).
ANTHROPIC_RESULT_PART_TYPES = frozenset({"text", "image", "document", "search_result", "tool_reference"})


def native_block_types(target: str) -> frozenset[str]:
    """The provider-specific block types a target carries (from its own API family)."""
    return NATIVE_BLOCK_TYPES.get(target_family(target), frozenset())


def register(target: Target) -> Target:
    TARGETS[target.name] = target
    return target


def get_target(name: str) -> Target:
    _load_builtin()
    key = name.replace("_", "-")
    if key not in TARGETS:
        hint = did_you_mean(key, list(TARGETS))
        raise UnknownTarget(f"unknown target '{name}'.{hint} Targets: {', '.join(sorted(TARGETS))}")
    return TARGETS[key]


def target_names() -> list[str]:
    _load_builtin()
    return sorted(TARGETS)


def target_family(target: str) -> str:
    """The API family a target name belongs to: anthropic (also bedrock, claude*), openai_responses,
    openai_chat (any other openai*), gemini (also google*), mistral; another name is returned
    lower-cased. `-` and `_` are the same in a name."""
    t = (target or "").lower()
    if t.startswith(("anthropic", "bedrock", "claude")):
        return "anthropic"
    if t.startswith(("openai_responses", "openai-responses")):
        return "openai_responses"
    if t.startswith("openai"):
        return "openai_chat"
    if t.startswith(("gemini", "google")):
        return "gemini"
    if t.startswith("mistral"):
        return "mistral"
    return t


_loaded = False


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    import importlib
    import pkgutil

    for m in sorted(x.name for x in pkgutil.iter_modules(__path__) if not x.name.startswith("_")):
        importlib.import_module(f"{__name__}.{m}")
    _loaded = True


def group_blocks(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Rows of one message grouped into blocks (tool_result parts share block_pos), in order."""
    out: list[list[dict[str, Any]]] = []
    last = None
    for r in rows:
        key = r["block_pos"]
        if out and key == last and r["block_type"] == "tool_result" and out[-1][0]["block_type"] == "tool_result":
            out[-1].append(r)
        else:
            out.append([r])
        last = key
    return out
