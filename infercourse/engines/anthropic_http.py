"""Stream from a server that speaks the Anthropic Messages API: the route coding agents take.

Claude Code and other agents built on the Anthropic SDK send `POST /v1/messages`: a
`system` prompt (a string or a list of text blocks, some marked `cache_control`), the
`messages` (content blocks: `text`, `tool_use`, `tool_result`), `tools` with an
`input_schema`, and `"stream": true`. llama-server (since late 2025), vLLM and Ollama
serve it beside their OpenAI API; `mlx_lm.server` does not, and answers 404.

This engine sends any `Request` that way: a system message in `messages` becomes
`system` (its blocks kept as they are, so `cache_control` markers reach the server),
OpenAI-shaped tool turns (`tool_calls`, `role: "tool"`) become `tool_use` / `tool_result`
blocks, tools in either shape become Anthropic tools. What it reads from the stream, and
how far to trust each number, is in `anthropic_stream`.

Options a Request carries that this API has no field for: `seed`, `ignore_eos` and
`cache_prompt` (llama-server passes only temperature, top_p, top_k, stream and
chat_template_kwargs from a Messages request; its prompt cache is on by default). Forced
output lengths are therefore not available here: compare APIs on the same greedy outputs.
"""
from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Iterator

import httpx
from httpx_sse import SSEError, aconnect_sse, connect_sse

from infercourse.core.errors import APILayerError
from infercourse.core.types import Event, Messages, Request, as_request
from infercourse.engines.anthropic_stream import Parser, anthropic_error
from infercourse.engines.openai_http import OpenAIHTTPEngine
from infercourse.engines.openai_stream import json_or_text
from infercourse.engines.tools import to_anthropic_tools, tool_names

__all__ = ["AnthropicHTTPEngine", "to_anthropic_messages", "ANTHROPIC_VERSION"]

ANTHROPIC_VERSION = "2023-06-01"   # the API version header every Anthropic client sends


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return list(content)
    return [{"type": "text", "text": content}] if content else []


def to_anthropic_messages(messages: list[dict[str, Any]]) -> tuple[Any, list[dict[str, Any]]]:
    """(system, messages) for the Messages API from chat messages in either shape.

    System messages are lifted into `system` (one kept as is; several joined as blocks);
    `tool_calls` become `tool_use` blocks; `role: "tool"` results become `tool_result`
    blocks in a user turn (consecutive results share one turn, as the API requires).
    """
    system: list[Any] = []
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "system":
            system.append(m["content"])
            continue
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": m.get("tool_call_id"), "content": m.get("content", "")}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list) \
                    and all(b.get("type") == "tool_result" for b in out[-1]["content"]):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
            continue
        if role == "assistant" and m.get("tool_calls"):
            content = _blocks(m.get("content"))
            for c in m["tool_calls"]:
                args = c["function"].get("arguments") or "{}"
                content.append({"type": "tool_use", "id": c.get("id"), "name": c["function"]["name"],
                                "input": json.loads(args) if isinstance(args, str) else args})
            out.append({"role": "assistant", "content": content})
            continue
        out.append({"role": role, "content": m.get("content", "")})
    if not system:
        return None, out
    if len(system) == 1:
        return system[0], out
    return [b for s in system for b in _blocks(s)], out


class AnthropicHTTPEngine(OpenAIHTTPEngine):
    """A client for one model behind `POST /v1/messages` (same plumbing as the OpenAI one).

    Args:
        base_url: server root, with or without `/v1` (e.g. "http://127.0.0.1:8080").
        model: model name to send (the API requires one); None asks `/v1/models`, and
            falls back to "local-model" for a server that serves one model and lists none.
        api_key: sent as `x-api-key` (and as a Bearer token: Ollama and gateways take either).
        timeout: seconds to wait for any one read (prefill of a long prompt included).
        extra_body: extra JSON fields merged last; None as a value removes a field.
    """

    name = "anthropic_http"

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 extra_body: dict[str, Any] | None = None, timeout: float = 600.0):
        super().__init__(base_url, model=model, api_key=api_key, extra_body=extra_body, timeout=timeout)
        self.api = "anthropic"
        self.headers = {"anthropic-version": ANTHROPIC_VERSION, "content-type": "application/json"}
        if api_key:
            self.headers.update({"x-api-key": api_key, "Authorization": f"Bearer {api_key}"})

    @property
    def model(self) -> str:
        if self._model is None:
            try:
                return super().model
            except APILayerError:
                self._model = "local-model"   # llama-server serves its one model whatever the name
        return self._model

    def body(self, request: Request) -> dict[str, Any]:
        """The JSON sent for `request` (public so lessons can show the wire format)."""
        messages = (request.messages if request.messages is not None
                    else [{"role": "user", "content": request.prompt}])
        system, msgs = to_anthropic_messages(messages)
        body: dict[str, Any] = {"model": self.model, "max_tokens": request.max_tokens, "stream": True,
                                "temperature": request.temperature, "system": system, "messages": msgs}
        if request.tools:
            body["tools"] = to_anthropic_tools(request.tools)
        body.update(self.extra_body)
        if not body.get("tools"):   # the API refuses a tool_choice with no tools to choose from
            body.pop("tool_choice", None)
        return {k: v for k, v in body.items() if v is not None}

    def _url(self) -> str:
        return self.base_url + "/messages"

    def _status_error(self, status: int, raw: bytes) -> Exception:
        if status in (404, 405):   # mlx_lm.server and older servers: no such route
            return APILayerError(
                f"server at {self.where} has no Anthropic Messages API (POST /v1/messages answered "
                f"HTTP {status})", hint="use its OpenAI API (engine 'http'), or put a translating proxy "
                "in front of it (LiteLLM, claude-code-router); llama-server, vLLM and Ollama serve "
                "/v1/messages themselves")
        return anthropic_error(self.where, status, json_or_text(raw))

    def count_tokens(self, request: Request | str | Messages, **overrides: Any) -> int:
        """Prompt tokens of `request` by the server's own count (`/v1/messages/count_tokens`)."""
        body = self.body(as_request(request, **overrides))
        for key in ("stream", "max_tokens", "temperature"):
            body.pop(key, None)
        try:
            r = self.client.post(self.base_url + "/messages/count_tokens", json=body, timeout=60.0)
        except httpx.ConnectError as exc:
            raise self._unreachable(exc) from None
        if r.status_code >= 400:
            raise self._status_error(r.status_code, r.content)
        return int(r.json()["input_tokens"])

    # -- the interface ----------------------------------------------------------------
    def stream(self, request: Request | str | Messages, **overrides: Any) -> Iterator[Event]:
        """Yield one Event per delta as it arrives, then the done Event."""
        req = as_request(request, **overrides)
        body, parser = self.body(req), Parser(self.where, tool_names(req.tools))
        try:
            with connect_sse(self.client, "POST", self._url(), json=body) as source:
                if source.response.status_code >= 400:
                    raise self._status_error(source.response.status_code, source.response.read())
                for sse in source.iter_sse():
                    # httpx-sse names an event without an `event:` line "message"
                    event = parser.feed("" if sse.event == "message" else sse.event, sse.data,
                                        time.perf_counter())
                    if event is not None:
                        yield event
                    if parser.finished:
                        break
        except (httpx.HTTPError, SSEError) as exc:
            raise self._transport_error(exc, parser) from exc
        yield parser.final(time.perf_counter())

    async def astream(self, request: Request | str | Messages, client: httpx.AsyncClient | None = None,
                      **overrides: Any) -> AsyncIterator[Event]:
        """Async twin of `stream()` (see `OpenAIHTTPEngine.astream`)."""
        req = as_request(request, **overrides)
        body, parser = self.body(req), Parser(self.where, tool_names(req.tools))
        own = client is None
        client = client or self.async_client(1)
        try:
            async with aconnect_sse(client, "POST", self._url(), json=body) as source:
                if source.response.status_code >= 400:
                    raise self._status_error(source.response.status_code, await source.response.aread())
                async for sse in source.aiter_sse():
                    event = parser.feed("" if sse.event == "message" else sse.event, sse.data,
                                        time.perf_counter())
                    if event is not None:
                        yield event
                    if parser.finished:
                        break
        except (httpx.HTTPError, SSEError) as exc:
            raise self._transport_error(exc, parser) from exc
        finally:
            if own:
                await client.aclose()
        yield parser.final(time.perf_counter())
