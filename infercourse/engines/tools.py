"""Tool calling across APIs: one schema in two shapes, and calls that arrive as plain text.

A tool is a name, a description and a JSON schema of its arguments. OpenAI-style APIs
wrap it as `{"type": "function", "function": {"name", "description", "parameters"}}`;
the Anthropic Messages API sends `{"name", "description", "input_schema"}`. The model
answers with a structured call: OpenAI `tool_calls` (arguments streamed as string
pieces), Anthropic `tool_use` blocks (input streamed as `input_json_delta` pieces).

That structure exists only when the server parsed the model's output with a tool-aware
chat template (llama-server: `--jinja`, its default in this build; `--no-jinja` turns it
off). Otherwise the model's attempt at a call comes back as *text*: `<tool_call>{...}`
(Hermes/Qwen), a bare `{"name": ..., "arguments": ...}` JSON, or `[TOOL_CALLS]`
(Mistral). An agent sees no call at all and stalls or loops; `text_tool_call` spots that
so the failure is reported as what it is, not as a silent "model did nothing".
"""
from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["to_openai_tools", "to_anthropic_tools", "text_tool_call", "parse_arguments"]


def to_openai_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools in the OpenAI `{"type": "function"}` shape (Anthropic-shaped ones converted)."""
    out = []
    for t in tools:
        if t.get("type") == "function":
            out.append(t)
        else:
            out.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description", ""),
                "parameters": t.get("input_schema", {"type": "object", "properties": {}})}})
    return out


def to_anthropic_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools in the Anthropic `input_schema` shape (OpenAI-shaped ones converted)."""
    out = []
    for t in tools:
        if t.get("type") == "function":
            f = t["function"]
            out.append({"name": f["name"], "description": f.get("description", ""),
                        "input_schema": f.get("parameters", {"type": "object", "properties": {}})})
        else:
            out.append(t)
    return out


def parse_arguments(raw: str) -> tuple[Any, str | None]:
    """A call's argument text as JSON: (value, None), or (None, why it does not parse)."""
    if not raw.strip():
        return {}, None
    try:
        return json.loads(raw), None
    except ValueError as exc:
        return None, f"arguments are not JSON ({exc}): {raw[:120]!r}"


_TEXT_CALL = re.compile(r"<tool_call>|\[TOOL_CALLS\]|<\|python_tag\|>|<function=|"
                        r"\{\s*\"(?:name|tool_call|function)\"\s*:", re.S)


def text_tool_call(text: str, tool_names: list[str] | None = None) -> str | None:
    """The marker of a tool call written as plain text, or None.

    Args:
        text: the assistant's text output.
        tool_names: names of the tools offered; when given, a bare JSON match must also
            mention one of them (a model may write JSON for other reasons).
    """
    m = _TEXT_CALL.search(text or "")
    if m is None:
        return None
    if m.group(0).startswith("{") and tool_names and not any(n in text for n in tool_names):
        return None
    return m.group(0).strip()


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    """The names of tools in either shape."""
    return [t["function"]["name"] if t.get("type") == "function" else t["name"] for t in tools or []]
