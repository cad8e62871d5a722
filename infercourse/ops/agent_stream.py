"""Reading an agent's answer as it streams by: the API a path speaks, each output event's
arrival, the usage block, the stop reason, an error, and the server's own timings.

The recording proxy (`ops.agent_capture`) hands every chunk it forwards to an `SSEWatcher`
before it writes it on to the agent, so what is recorded is what the agent received, when
it arrived. The three APIs coding agents speak name the same things differently:

| | Anthropic `/v1/messages` | OpenAI `/v1/responses` | OpenAI `/v1/chat/completions` |
|---|---|---|---|
| first output | `content_block_start` (tool use) or `content_block_delta` | `response.*.delta`, a function call added | a `delta` with content, tool calls or reasoning |
| usage | `message_start` + `message_delta` | `response.completed` | the last chunk (`stream_options.include_usage`) |
| stop | `delta.stop_reason` | the response status, `incomplete_details` | `finish_reason` |

llama-server adds its own `timings` to an answer (the last chunk of a stream): `prompt_n`,
the prompt tokens it evaluated for *this* request (cache hits excluded), `cache_n`, and
`prompt_ms`, its prefill time. They are per request, so, unlike a `/metrics` counter read
before and after, they stay right when calls overlap. `SSEWatcher.timings` keeps them.
"""
from __future__ import annotations

import json
from typing import Any

__all__ = ["SSEWatcher", "api_of", "usage_tokens", "error_text", "GENERATING_APIS"]


def api_of(path: str) -> str:
    """The API a request path speaks."""
    p = path.split("?", 1)[0].rstrip("/")
    if p.endswith("/v1/messages/count_tokens"):
        return "anthropic-count"
    if p.endswith("/v1/messages"):
        return "anthropic"
    if p.endswith("/v1/responses"):
        return "openai-responses"
    if p.endswith("/v1/chat/completions"):
        return "openai-chat"
    return "other"


class SSEWatcher:
    """Reads an answer as it streams by (SSE or one JSON body) and keeps what the record needs:
    when the first output arrived, each output event's time, usage, stop reason, error, and
    the server's own `timings` (llama-server: `prompt_n`, `cache_n`, `prompt_ms`...).
    Framing: events end at a blank line, LF or CRLF; `event:` lines are optional."""

    def __init__(self, api: str):
        self.api, self.buf = api, b""
        self.first_t: float | None = None
        self.event_t: list[float] = []
        self.usage: dict[str, Any] = {}
        self.stop_reason: str | None = None
        self.error: str | None = None
        self.timings: dict[str, Any] = {}

    def feed(self, data: bytes, t: float) -> None:
        self.buf += data.replace(b"\r\n", b"\n")
        while b"\n\n" in self.buf:
            raw, self.buf = self.buf.split(b"\n\n", 1)
            self._event(raw, t)

    def close(self, t: float) -> None:
        if self.buf.strip():
            self._event(self.buf, t)
        self.buf = b""

    def whole_body(self, body: bytes) -> None:
        """A non-streaming answer: one JSON document."""
        try:
            doc = json.loads(body)
        except ValueError:
            return
        self._usage(doc.get("usage") or (doc.get("response") or {}).get("usage"))
        self._timings(doc.get("timings"))
        self.stop_reason = doc.get("stop_reason") or doc.get("status") or self.stop_reason
        for c in doc.get("choices") or []:
            self.stop_reason = c.get("finish_reason") or self.stop_reason
        if doc.get("error"):
            self.error = error_text(doc)

    def _event(self, raw: bytes, t: float) -> None:
        name, data = None, []
        for line in raw.decode("utf-8", "replace").split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        text = "\n".join(data)
        if not text or text == "[DONE]":
            return
        try:
            doc = json.loads(text)
        except ValueError:
            return
        kind = name or doc.get("type") or ""
        if kind == "error" or (isinstance(doc.get("error"), (dict, str)) and not doc.get("choices")):
            self.error = error_text(doc)
            return
        if self._is_output(kind, doc):
            self.first_t = self.first_t if self.first_t is not None else t
            self.event_t.append(t)
        msg = doc.get("message") or doc.get("response") or {}
        self._timings(doc.get("timings"))
        self._usage(doc.get("usage"))
        self._usage(msg.get("usage") if isinstance(msg, dict) else None)
        delta = doc.get("delta") if isinstance(doc.get("delta"), dict) else {}
        self.stop_reason = delta.get("stop_reason") or self.stop_reason
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            details = msg.get("incomplete_details") or {}
            self.stop_reason = details.get("reason") or msg.get("status") or kind.split(".")[1]
            if kind == "response.failed":
                self.error = error_text(msg) or "response.failed"
        for c in doc.get("choices") or []:
            self.stop_reason = c.get("finish_reason") or self.stop_reason

    def _is_output(self, kind: str, doc: dict) -> bool:
        """The first token of any kind: text, a tool call's start, its arguments, or thinking."""
        if kind == "content_block_start":
            return (doc.get("content_block") or {}).get("type") in ("tool_use", "server_tool_use")
        if kind == "content_block_delta":
            return True
        if kind.startswith("response."):
            return kind.endswith(".delta") or (kind == "response.output_item.added" and
                                               (doc.get("item") or {}).get("type") == "function_call")
        for c in doc.get("choices") or []:
            d = c.get("delta") or {}
            if d.get("content") or d.get("tool_calls") or d.get("reasoning_content"):
                return True
        return False

    def _usage(self, u: Any) -> None:
        if isinstance(u, dict):
            self.usage.update({k: v for k, v in u.items() if v is not None})

    def _timings(self, t: Any) -> None:
        if isinstance(t, dict):
            self.timings.update({k: v for k, v in t.items() if isinstance(v, (int, float))})

    def tokens(self) -> dict[str, int | None]:
        return usage_tokens(self.usage)


def usage_tokens(u: dict[str, Any]) -> dict[str, int | None]:
    """prompt (all of it), cached and output tokens from a usage block, whichever API's names
    the server used (Anthropic, OpenAI Responses, OpenAI chat)."""
    cached = u.get("cache_read_input_tokens")
    if cached is None:
        cached = (u.get("input_tokens_details") or u.get("prompt_tokens_details") or {}).get("cached_tokens")
    if "prompt_tokens" in u:
        prompt = u["prompt_tokens"]
    elif "cache_read_input_tokens" in u:   # Anthropic: input_tokens excludes the cache reads
        prompt = u.get("input_tokens", 0) + u.get("cache_read_input_tokens", 0) + \
            u.get("cache_creation_input_tokens", 0)
    else:
        prompt = u.get("input_tokens")
    return {"prompt_tokens": prompt, "cached_tokens": cached,
            "output_tokens": u.get("output_tokens", u.get("completion_tokens"))}


# the APIs whose calls generate (and carry a prompt worth dissecting)
GENERATING_APIS = ("anthropic", "openai-responses", "openai-chat")


def error_text(doc: Any) -> str:
    err = doc.get("error", doc) if isinstance(doc, dict) else doc
    if isinstance(err, dict):
        return str(err.get("message") or err.get("type") or err)[:500]
    return str(err)[:500]
