"""Reading an OpenAI-style SSE stream: JSON chunks in, timestamped `Event`s out.

How each number is read, so a learner knows what to trust:
- **text**: `choices[0].delta.content` (chat) or `choices[0].text` (completions).
- **tokens per chunk**: by default we count 1 per non-empty delta, which is exact on
  servers that stream one token per chunk (llama-server, vLLM, SGLang) and costs the
  server nothing. At the end of each request that count is checked against the server's
  `usage.completion_tokens`: when they disagree beyond the one end-of-generation token a
  server counts but never streams, the chunks held several tokens (or none), and
  `token_source` says so ("server, chunks not tokens"). Asking for `logprobs` instead
  lists one entry per token, so per-chunk counts are exact even then, at a price: the
  server computes a softmax per token (+~4 ms/token on llama-server on this CPU).
  `timings["chunk_tokens_from"]` says which count was used ("deltas", "logprobs").
- **usage**: `stream_options.include_usage` makes the server send a last chunk with a
  `usage` block (source "server", with `prompt_tokens_details.cached_tokens`); without
  one we fall back to our own count (source "client", prompt_tokens unknown: None).
- **timings**: llama-server's per-request `timings` object (prompt_ms, cache_n...) is
  passed on verbatim, plus the response id and model.
- **tool calls**: `delta.tool_calls` pieces (name first, then the arguments as string
  fragments) are joined per call index and parsed at the end into `timings["tool_calls"]`;
  each piece counts as a token, like a text delta. A call the model wrote as plain text
  (no tool parsing on the server) is flagged in `timings["tool_call_as_text"]`.
"""
from __future__ import annotations

import json
import re
from typing import Any

from infercourse.core.errors import APILayerError, ContextLayerError, InferCourseError
from infercourse.core.types import Event, Usage
from infercourse.engines.tools import parse_arguments, text_tool_call

__all__ = ["Parser", "server_error", "json_or_text", "CHUNKS_NOT_TOKENS"]

# token_source when the server counted the tokens but our per-chunk counts (one per delta)
# do not add up to its count: chunk-level numbers (ITL, tokens per chunk) are per chunk.
CHUNKS_NOT_TOKENS = "server, chunks not tokens"

# Phrases servers use when prompt + max_tokens do not fit: llama-server
# ("exceed_context_size_error", "exceeds the available context size"), vLLM and OpenAI
# ("maximum context length", "context_length_exceeded"), TGI ("must have less than").
_CONTEXT_RE = re.compile(r"exceed_context_size|exceeds the available context|maximum context "
                         r"length|context_length_exceeded|larger than the max context|context "
                         r"window|must have less than \d+ tokens", re.I)


def _error_message(body: Any) -> str:
    """The human part of an error body: {"error": {"message"}}, {"error": str}, {"detail"}."""
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message")))
        if isinstance(err, dict):
            return str(err.get("message") or err)
        if err is not None:
            return str(err)
    return str(body)[:500]


def server_error(where: str, status: int | None, body: Any, partial: list[Event] | None = None
                 ) -> InferCourseError:
    """The layer-named error for a server's error reply (context overflow or API)."""
    msg = _error_message(body)
    head = f"server at {where} answered HTTP {status}" if status else f"server at {where} sent an error"
    if _CONTEXT_RE.search(msg) or _CONTEXT_RE.search(str(body)):
        return ContextLayerError(f"{head}: {msg}", partial=partial,
                                 hint="shorten the prompt, lower max_tokens, or start the server "
                                      "with a larger context (llama-server: -c, per slot = c / np)")
    return APILayerError(f"{head}: {msg}", partial=partial)


def json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def _count_logprobs(lp: Any) -> int | None:
    """Tokens in a chunk from its logprobs: chat uses {"content": [...]}, completions
    {"tokens": [...]} (llama-server uses "content" for both). None: no logprobs sent."""
    if isinstance(lp, dict):
        for key in ("content", "tokens"):
            if isinstance(lp.get(key), list):
                return len(lp[key])
    return None


class Parser:
    """Turns the JSON payloads of one SSE stream into Events (shared by sync and async)."""

    def __init__(self, api: str, where: str, tool_names: list[str] | None = None):
        self.api, self.where, self.tool_names = api, where, tool_names or []
        self.calls: dict[int, dict[str, Any]] = {}  # streamed tool_calls, by index
        self.text = ""
        self.events: list[Event] = []
        self.finished = False                      # saw data: [DONE]
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] = {}
        self.meta: dict[str, Any] = {}
        self.sources: set[str] = set()

    def feed(self, data: str, t: float) -> Event | None:
        if data.strip() == "[DONE]":
            self.finished = True
            return None
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):
            raise APILayerError(f"malformed stream chunk from {self.where}: {data[:200]!r}",
                                partial=list(self.events))
        if "error" in chunk:  # llama-server and vLLM report mid-stream failures this way
            raise server_error(self.where, None, chunk, partial=list(self.events))
        for key in ("id", "model", "system_fingerprint"):
            if chunk.get(key) is not None:
                self.meta[key] = chunk[key]
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]        # the last one is the whole request's
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        text, n = "", 0
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            if self.api == "chat":
                delta = choice.get("delta") or {}
                piece = delta.get("content") or ""
                # reasoning models stream thinking apart from the answer: tokens, not text
                thinking = delta.get("reasoning_content") or delta.get("reasoning") or ""
                thinking += self._take_calls(delta.get("tool_calls"))   # tool input: tokens too
            else:
                piece, thinking = choice.get("text") or "", ""
            k = _count_logprobs(choice.get("logprobs"))
            if k is not None:
                n += k
                self.sources.add("logprobs")
            elif piece or thinking:
                n += 1
                self.sources.add("deltas")
            text += piece
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if not text and n == 0:
            return None                            # role-only or usage-only chunk
        self.text += text
        event = Event(t=t, text=text, n_tokens=n)
        self.events.append(event)
        return event

    def _take_calls(self, pieces: Any) -> str:
        got = ""
        for piece in pieces or []:
            call = self.calls.setdefault(piece.get("index", len(self.calls)), {"arguments": ""})
            fn = piece.get("function") or {}
            for key in ("id", "type"):
                if piece.get(key):
                    call[key] = piece[key]
            if fn.get("name"):
                call["name"] = fn["name"]
            call["arguments"] += fn.get("arguments") or ""
            got += (fn.get("name") or "") + (fn.get("arguments") or "")
        return got

    def tool_calls(self) -> list[dict[str, Any]]:
        """Calls received: id, name, arguments (text), input (parsed, None if it did not), error."""
        out = []
        for _, c in sorted(self.calls.items()):
            value, error = parse_arguments(c["arguments"])
            out.append({"id": c.get("id"), "name": c.get("name"), "input": value,
                        "arguments": c["arguments"], "error": error})
        return out

    def final(self, t: float) -> Event:
        if not self.finished:
            raise APILayerError(f"stream from {self.where} ended without data: [DONE]",
                                partial=list(self.events),
                                hint="the server may have crashed; see its log")
        counted = sum(e.n_tokens for e in self.events)
        u, unstreamed, chunks_are_tokens = self.usage, 0, None
        if u and "completion_tokens" in u:
            details = u.get("prompt_tokens_details") or {}
            gap = u["completion_tokens"] - counted
            if self.sources == {"logprobs"}:
                # exact per chunk: what the server counted beyond them was never streamed
                # (llama-server's EOS; tokens held back as a possible stop string)
                chunks_are_tokens, unstreamed = True, max(0, gap)
            else:
                # one per delta is a token count only if it matches, allowing for the EOS
                # token a server counts when the model stopped by itself but never streams
                chunks_are_tokens = gap == 0 or (gap == 1 and self.finish_reason == "stop")
                unstreamed = gap if chunks_are_tokens else 0
            usage = Usage(prompt_tokens=u.get("prompt_tokens"), completion_tokens=u["completion_tokens"],
                          cached_tokens=details.get("cached_tokens"),
                          source="server" if chunks_are_tokens else CHUNKS_NOT_TOKENS)
        else:  # e.g. llama_cpp.server: no usage in streams; we cannot count the prompt
            usage = Usage(prompt_tokens=None, completion_tokens=counted, source="client")
        timings = dict(self.timings)
        calls = self.tool_calls()
        if calls or self.tool_names:
            timings.update(tool_calls=calls,
                           tool_call_as_text=None if calls else text_tool_call(self.text, self.tool_names))
        timings.update(chunk_tokens_from="+".join(sorted(self.sources)) or None,
                       client_token_count=counted, unstreamed_tokens=unstreamed,
                       chunks_are_tokens=chunks_are_tokens,
                       **{f"response_{k}": v for k, v in self.meta.items()})
        return Event(t=t, n_tokens=unstreamed, done=True, usage=usage,
                     finish_reason=self.finish_reason, timings=timings)
