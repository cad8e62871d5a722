"""The coding-agent workload: what a coding agent (Claude Code, and its kind) sends on every call.

A coding agent's request has a shape no chat benchmark produces:
- a **system prompt in blocks**: a short per-request *header block* first, then a long
  *static instruction block* marked `cache_control` (the part a prefix cache should keep);
- about **fifteen tool schemas** (read, write, edit, grep, glob, bash, tests...);
- the **session so far**: the task, then for each step an assistant turn ending in a
  `tool_use` block and a user turn holding its `tool_result`. Every call re-sends all of
  it, so the prefix cache decides whether a call costs a fraction of a second or a
  whole prefill again.

One source, two wire shapes. `coding_agent_session(api="anthropic")` renders it for
`POST /v1/messages` (system blocks, `tool_use` / `tool_result`, tools with `input_schema`);
`api="openai"` renders the same session for `POST /v1/chat/completions` (one system
message, `tool_calls` / `role: tool`, tools as `{"type": "function"}`). Both carry the
same text in the same order, so a server that converts one into the other (llama-server
does: `server_chat_convert_anthropic_to_oai` joins the system blocks with no separator and
dumps `tool_use.input` as compact JSON with sorted keys) sees the same prompt tokens.

The cache buster: real coding agents have shipped a header block whose content changes
on every request (a per-request hash in the first system block). Everything after a
changed token must be prefilled again, so with `bust=True` every call re-prefills the whole
system prompt and session. The fix is to drop the header (`header="none"`) or move it after
the static block (`header="after"`).

Content: the instructions (data/coding_agent_instructions.md) and tool schemas
(data/coding_agent_tools.json) were written for this project; the session's steps and tool
results are those of the recorded session in data/agentic_session.json (the tools really
ran on data/synthetic_repo). Sizes follow the hardware profile: on `cpu` the session is cut
to fit the embedded model's 8,192-token window; on `mac`/`gpu` the static block is padded
with project notes to what the real Claude Code sends before its messages (system blocks and
tool schemas: measured from the pinned version, `data/agent_shapes.json`, about 9,500 tokens
with SmolLM2's tokenizer).
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from typing import Any

from infercourse.core.types import Request
from infercourse.measure.workloads import DATA_DIR, Workload, _repo_files, eval_text

__all__ = ["SIZES", "Sizes", "real_agent_static_tokens", "Turn", "APIS", "HEADERS", "coding_agent_session", "session_turns",
           "static_block", "tool_schemas", "header_block", "estimate_tokens", "CHARS_PER_TOKEN"]

APIS = ("anthropic", "openai")
HEADERS = ("first", "after", "none")
# Characters per token of this workload's text with SmolLM2's tokenizer (measured: ~3.3
# over the whole session; tests/test_anthropic.py checks the default still fits with the
# real tokenizer). Only used to choose sizes, never reported as a count.
CHARS_PER_TOKEN = 3.3


@dataclass(frozen=True)
class Sizes:
    """How big the session is on one hardware profile.

    Args:
        window: the model context the session must fit (llama-server `-c` per slot).
        static_tokens: target size of system prompt + tools; the static block is padded
            with project notes up to it (0: no padding, the instructions alone).
        max_tokens: output cap per call (None: the recorded session's length per call).
    """

    window: int
    static_tokens: int = 0
    max_tokens: int | None = None


def real_agent_static_tokens(agent: str = "claude-code") -> int:
    """System text + tool schemas of the real agent's first request, in tokens: measured from
    the pinned version (data/agent_shapes.json, numbers only; notebook 20 captures it)."""
    parts = json.loads((DATA_DIR / "agent_shapes.json").read_text())[agent]["first_request"]["parts"]
    return int(parts["system"]["tokens"] + parts["tool"]["tokens"])


# mac/gpu: the static part as big as the real Claude Code's (its system blocks and 12 tools,
# measured); cpu: cut to fit the embedded SmolLM2's 8,192-token window at -np 1
SIZES: dict[str, Sizes] = {
    "cpu": Sizes(window=8192),
    "mac": Sizes(window=32768, static_tokens=real_agent_static_tokens()),
    "gpu": Sizes(window=32768, static_tokens=real_agent_static_tokens()),
}


@dataclass(frozen=True)
class Turn:
    """One step of the session: the assistant's words, the tool it called, and its result."""

    thought: str
    tool: str | None
    args: dict[str, Any]
    result: str | None


def estimate_tokens(text: str) -> int:
    """A size estimate from characters (see CHARS_PER_TOKEN); count with a tokenizer to report."""
    return int(len(text) / CHARS_PER_TOKEN) + 1


def session_turns() -> list[Turn]:
    """The recorded session's steps: plan (thought, tool, arguments) + the real tool results."""
    plan = json.loads((DATA_DIR / "agentic_plan.json").read_text())
    recorded = json.loads((DATA_DIR / "agentic_session.json").read_text())["messages"]
    results = [m["content"] for m in recorded if m["role"] == "user"][1:]   # [0] is the task
    turns, k = [], 0
    for thought, tool, args in plan["steps"]:
        result = None
        if tool is not None:
            result = re.sub(r"^<tool_response>\n|\n</tool_response>$", "", results[k])
            k += 1
        turns.append(Turn(thought, tool, args or {}, result))
    return turns


def _task() -> str:
    return json.loads((DATA_DIR / "agentic_plan.json").read_text())["task"]


def _notes(n_chars: int) -> str:
    # Project notes standing in for the long memory files and docs a real agent sends:
    # the project's own prose words, seeded, so the padding is deterministic.
    vocab = sorted(set(re.findall(r"[a-z]+", eval_text().lower())))
    rng, out, k = random.Random(14), [], 0
    while sum(len(s) for s in out) < n_chars:
        k += 1
        words = [rng.choice(vocab) for _ in range(60)]
        out.append(f"\n## Note {k}\n" + " ".join(words).capitalize() + ".\n")
    return "".join(out)


def static_block(profile: str = "cpu") -> str:
    """The long static system block: instructions, the repository's layout and README, and
    (on mac/gpu) project notes up to the profile's static size. Identical on every call."""
    sizes = _sizes(profile)
    files = _repo_files()
    text = ((DATA_DIR / "coding_agent_instructions.md").read_text()
            + "\n# Repository\nFiles:\n" + "\n".join(files) + "\n\nREADME.md:\n" + files["README.md"])
    if sizes.static_tokens:
        tools = json.dumps(tool_schemas("anthropic"))
        missing = sizes.static_tokens - estimate_tokens(text) - estimate_tokens(tools)
        if missing > 0:
            text += "\n# Project notes" + _notes(int(missing * CHARS_PER_TOKEN))
    return text


def header_block(salt: str | None = None, call: int | None = None) -> str:
    """The short per-request header. `call` given: a hash that changes on every call (the
    cache buster); else one value for the whole session (`salt`, e.g. a session id)."""
    stamp = hashlib.sha256(f"{salt}:{call}".encode()).hexdigest()[:8] if call is not None else (salt or "0")
    return f"agent-header: client=infercourse-agent/1.0; entry=cli; req={stamp};\n"


def tool_schemas(api: str = "anthropic", n: int | None = None) -> list[dict[str, Any]]:
    """The 15 tool schemas (or the first n) in the API's shape (Anthropic `input_schema`,
    OpenAI `function`). The session's own five come first."""
    tools = json.loads((DATA_DIR / "coding_agent_tools.json").read_text())[:n]
    if api == "anthropic":
        tools[-1] = {**tools[-1], "cache_control": {"type": "ephemeral"}}  # the end of the cached part
        return tools
    return [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                              "parameters": t["input_schema"]}} for t in tools]


def _sizes(profile: Any) -> Sizes:
    name = getattr(profile, "name", profile)     # an ops.profiles.Profile, or its name
    if name not in SIZES:
        raise ValueError(f"unknown profile {name!r}; choose one of {sorted(SIZES)}")
    return SIZES[name]


def _tool_id(api: str, i: int) -> str:
    return f"toolu_{i:04d}" if api == "anthropic" else f"call_{i:04d}"


def _render_turn(api: str, i: int, turn: Turn) -> list[dict[str, Any]]:
    """One step as wire messages: assistant (text + tool call), then the tool's result."""
    tid = _tool_id(api, i)
    if api == "anthropic":
        content: list[dict[str, Any]] = [{"type": "text", "text": turn.thought}]
        if turn.tool is None:
            return [{"role": "assistant", "content": content}]
        content.append({"type": "tool_use", "id": tid, "name": turn.tool, "input": turn.args})
        return [{"role": "assistant", "content": content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid,
                                              "content": turn.result}]}]
    msg: dict[str, Any] = {"role": "assistant", "content": turn.thought}
    if turn.tool is None:
        return [msg]
    # the same argument text llama-server makes of tool_use.input (nlohmann: sorted, compact)
    args = json.dumps(turn.args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    msg["tool_calls"] = [{"id": tid, "type": "function", "function": {"name": turn.tool, "arguments": args}}]
    return [msg, {"role": "tool", "tool_call_id": tid, "content": turn.result}]


def _system(api: str, static: str, header: str | None, where: str) -> dict[str, Any]:
    blocks = [{"type": "text", "text": static, "cache_control": {"type": "ephemeral"}}]
    if header is not None and where != "none":
        head = {"type": "text", "text": header}
        blocks = [head] + blocks if where == "first" else blocks + [head]
    if api == "anthropic":
        return {"role": "system", "content": blocks}
    return {"role": "system", "content": "".join(b["text"] for b in blocks)}


def coding_agent_session(*, salt: str | None = None, profile: Any = "cpu", api: str = "anthropic",
                         header: str = "first", bust: bool = False, n_calls: int | None = None,
                         max_tokens: int | None = None, n_tools: int | None = None,
                         static_chars: int | None = None) -> Workload:
    """The coding-agent session as a Workload: one Request per model call, in order.

    Call i sends the system prompt, the tools, the task and steps 0..i-1 (each a tool call
    and its result); its send offset is the recorded session's. Requests carry `tools` and,
    first in `messages`, a system message (Anthropic: a list of blocks, which
    `AnthropicHTTPEngine` sends as `system`; OpenAI: one string).

    Args:
        salt: the header's value for this session (e.g. a session id; None: "0"). Two
            sessions with different salts share no cached prefix when the header comes first.
        profile: "cpu", "mac", "gpu" (or a Profile): window and static size (see SIZES).
        api: "anthropic" (POST /v1/messages) or "openai" (POST /v1/chat/completions).
        header: "first" (as real agents send it), "after" (moved behind the static block)
            or "none" (dropped).
        bust: the header changes on every call (the cache buster) instead of once per session.
        n_calls: calls to include (None: as many as fit the profile's window).
        max_tokens: output cap per call (None: the recorded output length of each call).
        n_tools: send only the first n tool schemas (None: all 15), to shrink the prompt
            on a slow machine; the session's own tools come first, so its turns stay valid.
        static_chars: cut the static block at the last paragraph before this many
            characters (None: whole); like n_tools, a size knob for slow machines.
    """
    if api not in APIS:
        raise ValueError(f"api must be one of {APIS}, got {api!r}")
    if header not in HEADERS:
        raise ValueError(f"header must be one of {HEADERS}, got {header!r}")
    sizes, turns = _sizes(profile), session_turns()
    recorded = json.loads((DATA_DIR / "agentic_session.json").read_text())["calls"]
    static, tools = static_block(profile), tool_schemas(api, n_tools)
    if static_chars is not None and len(static) > static_chars:
        static = static[:static[:static_chars].rfind("\n\n") + 1 or static_chars]
    task = {"role": "user", "content": _task()}
    history: list[dict[str, Any]] = []
    budget = sizes.window - estimate_tokens(static + json.dumps(tools)) - 64   # 64: template markup
    requests, offsets = [], []
    for i, (turn, rec) in enumerate(zip(turns, recorded)):
        cap = max_tokens or sizes.max_tokens or rec["max_tokens"]
        if n_calls is not None and i >= n_calls:
            break
        if n_calls is None and estimate_tokens(json.dumps(history) + task["content"]) + cap > budget:
            break
        head = header_block(salt, i if bust else None)
        system = _system(api, static, head, header)
        requests.append(Request(messages=[system, task, *history], max_tokens=cap, tools=tools))
        offsets.append(rec["offset_s"])
        history += _render_turn(api, i, turn)
    name = f"coding-agent-{api}-{getattr(profile, 'name', profile)}-header-{header}{'-bust' if bust else ''}"
    return Workload(name, tuple(requests), tuple(offsets), cache_workload=True)
