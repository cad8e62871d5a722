"""Reading an Anthropic Messages SSE stream: typed events in, timestamped `Event`s out.

`POST /v1/messages` with `"stream": true` answers with named SSE events, in this order:
`message_start` (the message shell and, on most servers, its input `usage`), then per
content block `content_block_start`, `content_block_delta`... and `content_block_stop`,
then `message_delta` (`stop_reason` and the output `usage`) and `message_stop`. `ping`
may come at any time; an `error` event ends a stream that failed after it began.

How each number is read, so a learner knows what to trust:
- **text and tokens per chunk**: each `text_delta`, `thinking_delta` or `input_json_delta`
  counts as one token, which is exact on servers that send one token per delta
  (llama-server, vLLM); at the end that count is checked against `usage.output_tokens`,
  and `token_source` says "server, chunks not tokens" when they disagree.
- **the first token of a tool call** is the `content_block_start` of its `tool_use` block:
  it carries the tool's name, which the model has just written. llama-server sends it
  from the same parser step that sends the OpenAI API's first `tool_calls` chunk (the
  name), which the OpenAI parser counts as a token; so it counts as one token here too,
  and TTFT means the same moment on both APIs, even for a call with empty input (no
  `input_json_delta` at all).
- **thinking** (`thinking` blocks: `thinking_delta`, then a `signature_delta`): each
  `thinking_delta` is a token the model generated, so it counts for TTFT and token counts,
  but it is not answer *text* (`Event.text` stays empty, as the OpenAI parser does with
  `reasoning_content`): a user waits through it, yet it is not what they read.
  `signature_delta` is a checksum from the API, not model output: no token.
- **prompt tokens**: Anthropic splits them: `input_tokens` are the ones *not* read from
  cache, `cache_read_input_tokens` the ones that were, `cache_creation_input_tokens` the
  ones written to it. The prompt is their sum; `cached_tokens` is the cache read.
  What servers fill in: llama-server sends `cache_read_input_tokens` (its slot's reused
  prefix, `n_prompt_tokens_cache`) and `input_tokens` = prompt - cached in `message_start`
  (which it sends with the first generated token), and only `output_tokens` in
  `message_delta`; vLLM puts `input_tokens` in `message_start` and may repeat usage in
  `message_delta`; Ollama sends `input_tokens` in `message_delta`. We take the last value
  seen of each field. llama-server sends no `message_start` at all when the first token
  it generates ends inside a character (the first byte of an emoji): the prompt's size is
  then unknown (None, not 0), and `event_types` shows what was missing.
- **tool calls**: a `tool_use` block's input arrives as `input_json_delta` pieces, joined
  and parsed at `content_block_stop`; a server that sends the input whole in
  `content_block_start` (and no deltas) is taken at its word. The calls are in the final
  event's `timings["tool_calls"]`. When tools were offered, a call written as text
  instead is flagged in `timings["tool_call_as_text"]` (see `engines.tools`); without
  tools, JSON in an answer is just an answer.
- **finish reason**: `stop_reason` mapped to the OpenAI words every metric uses
  (end_turn/stop_sequence -> stop, max_tokens and model_context_window_exceeded ->
  length, tool_use -> tool_calls); the raw value is kept in `timings["stop_reason"]`.
- **errors**: the Anthropic API says "prompt is too long: N tokens > M maximum" when the
  prompt does not fit; that is a context-layer error like llama-server's and vLLM's.
"""
from __future__ import annotations

import json
import re
from typing import Any

from infercourse.core.errors import APILayerError, ContextLayerError, InferCourseError
from infercourse.core.types import Event, Usage
from infercourse.engines.openai_stream import CHUNKS_NOT_TOKENS, server_error
from infercourse.engines.tools import parse_arguments, text_tool_call

__all__ = ["Parser", "STOP_REASONS", "EVENT_TYPES", "anthropic_error"]

EVENT_TYPES = ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
               "message_delta", "message_stop", "ping", "error")
STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                "tool_use": "tool_calls", "refusal": "stop", "pause_turn": "stop",
                # the API stopped because the context window is full: cut short, like max_tokens
                "model_context_window_exceeded": "length"}
_DELTA_TEXT = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
_USAGE_KEYS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
# the Anthropic API's own overflow message: "prompt is too long: 208310 tokens > 200000 maximum"
_CONTEXT_RE = re.compile(r"prompt is too long|model_context_window_exceeded", re.I)


def anthropic_error(where: str, status: int | None, body: Any, partial: list[Event] | None = None
                    ) -> InferCourseError:
    """`openai_stream.server_error`, plus the Anthropic API's wording for a context overflow."""
    err = server_error(where, status, body, partial=partial)
    if not isinstance(err, ContextLayerError) and _CONTEXT_RE.search(str(body)):
        return ContextLayerError(err.message, partial=partial,
                                 hint="shorten the prompt, lower max_tokens, or serve the model "
                                      "with a larger context")
    return err


class Parser:
    """Turns one Anthropic SSE stream into Events (shared by sync and async streams).

    Args:
        where: "host:port", for error messages.
        tool_names: names of the tools offered, to spot a call written as text.
    """

    def __init__(self, where: str, tool_names: list[str] | None = None):
        self.where, self.tool_names = where, tool_names or []
        self.events: list[Event] = []
        self.finished = False                       # saw message_stop
        self.seen: list[str] = []                   # event types, in order of first arrival
        self.usage: dict[str, Any] = {}
        self.stop_reason: str | None = None
        self.meta: dict[str, Any] = {}
        self.blocks: dict[int, dict[str, Any]] = {}
        self.text = ""

    def feed(self, event: str, data: str, t: float) -> Event | None:
        """One SSE event (its `event:` name, possibly empty, and its `data:`) at time t."""
        try:
            payload = json.loads(data) if data.strip() else {}
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            raise APILayerError(f"malformed stream event from {self.where}: {data[:200]!r}",
                                partial=list(self.events))
        kind = event or payload.get("type", "")
        if kind and kind not in self.seen:
            self.seen.append(kind)
        if kind == "error" or (not event and "error" in payload):
            raise anthropic_error(self.where, None, payload, partial=list(self.events))
        if kind == "message_start":
            msg = payload.get("message") or {}
            self.meta.update({k: msg[k] for k in ("id", "model") if msg.get(k) is not None})
            self._take_usage(msg.get("usage"))
        elif kind == "content_block_start":
            block = dict(payload.get("content_block") or {})
            block["_json"], block["_start_input"] = "", block.pop("input", None)
            self.blocks[payload.get("index", len(self.blocks))] = block
            if block.get("type") == "tool_use" and block.get("name"):
                return self._token(t, "")            # the name: the call's first token (see above)
        elif kind == "content_block_delta":
            return self._delta(payload, t)
        elif kind == "content_block_stop":
            block = self.blocks.get(payload.get("index", -1))
            if block is not None and block.get("type") == "tool_use":
                whole = block.get("_start_input")
                if not block["_json"] and isinstance(whole, dict) and whole:
                    # input sent whole in content_block_start, no deltas: keep it
                    block["_json"], block["input"], block["_error"] = json.dumps(whole), whole, None
                else:
                    block["input"], block["_error"] = parse_arguments(block["_json"])
        elif kind == "message_delta":
            self.stop_reason = (payload.get("delta") or {}).get("stop_reason") or self.stop_reason
            self._take_usage(payload.get("usage"))
        elif kind == "message_stop":
            self.finished = True
        return None

    def _take_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self.usage.update({k: usage[k] for k in _USAGE_KEYS if usage.get(k) is not None})

    def _delta(self, payload: dict[str, Any], t: float) -> Event | None:
        delta = payload.get("delta") or {}
        key = _DELTA_TEXT.get(delta.get("type", ""))
        if key is None:                              # signature_delta etc.: no tokens
            return None
        piece = delta.get(key) or ""
        if key == "partial_json":
            block = self.blocks.setdefault(payload.get("index", -1), {"type": "tool_use", "_json": ""})
            block["_json"] += piece
        if not piece:
            return None
        return self._token(t, piece if key == "text" else "")   # thinking, tool input: tokens, not text

    def _token(self, t: float, text: str) -> Event:
        self.text += text
        ev = Event(t=t, text=text, n_tokens=1)
        self.events.append(ev)
        return ev

    def tool_calls(self) -> list[dict[str, Any]]:
        """The tool_use blocks received: id, name, input (None when it did not parse), error."""
        return [{"id": b.get("id"), "name": b.get("name"), "input": b.get("input"),
                 "arguments": b.get("_json", ""), "error": b.get("_error")}
                for _, b in sorted(self.blocks.items()) if b.get("type") == "tool_use"]

    def final(self, t: float) -> Event:
        if not self.finished:
            raise APILayerError(f"stream from {self.where} ended without message_stop",
                                partial=list(self.events),
                                hint="the server may have crashed or cut the stream; see its log")
        counted = sum(e.n_tokens for e in self.events)
        u, chunks_are_tokens, unstreamed = self.usage, None, 0
        if "output_tokens" in u:
            gap = u["output_tokens"] - counted
            # one delta per token, allowing for the end-of-generation token some servers count
            chunks_are_tokens = gap == 0 or (gap == 1 and self.stop_reason in ("end_turn", "stop_sequence"))
            unstreamed = gap if chunks_are_tokens else 0
            parts = [u.get(k) for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")]
            prompt = sum(p for p in parts if p is not None) if parts[0] is not None else None
            usage = Usage(prompt_tokens=prompt, completion_tokens=u["output_tokens"],
                          cached_tokens=u.get("cache_read_input_tokens"),
                          source="server" if chunks_are_tokens else CHUNKS_NOT_TOKENS)
        else:
            usage = Usage(prompt_tokens=None, completion_tokens=counted, source="client")
        calls = self.tool_calls()
        # a call written as text is a failure only when tools were offered
        as_text = None if calls or not self.tool_names else text_tool_call(self.text, self.tool_names)
        timings = {"api": "anthropic", "stop_reason": self.stop_reason, "event_types": list(self.seen),
                   "usage_fields": dict(u), "tool_calls": calls,
                   "tool_call_as_text": as_text,
                   "chunk_tokens_from": "deltas" if self.events else None,
                   "client_token_count": counted, "unstreamed_tokens": unstreamed,
                   "chunks_are_tokens": chunks_are_tokens,
                   **{f"response_{k}": v for k, v in self.meta.items()}}
        return Event(t=t, n_tokens=unstreamed, done=True, usage=usage,
                     finish_reason=STOP_REASONS.get(self.stop_reason or "", self.stop_reason),
                     timings=timings)
