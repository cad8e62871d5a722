"""Stream from any OpenAI-compatible HTTP server: the wire format most engines speak.

llama.cpp's llama-server, vLLM, SGLang, TGI, LM Studio, mlx_lm.server and Ollama's /v1 all
take `POST /v1/chat/completions` (or `/v1/completions`) with `"stream": true` and answer
with Server-Sent Events: one `data: {json}` line per chunk, ending with `data: [DONE]`.

How each number is read, so a learner knows what to trust:
- **text**: `choices[0].delta.content` (chat) or `choices[0].text` (completions).
- **tokens per chunk**: we ask for `logprobs`, which lists one entry per token, so the
  count is exact; where a chunk carries none we count 1 per non-empty delta. The final
  event's `timings["chunk_tokens_from"]` says which ("logprobs", "deltas" or both).
  Tokens the server counted but never streamed (llama-server's EOS) sit on the done
  event (`timings["unstreamed_tokens"]`), so the events sum to the server's usage.
- **usage**: `stream_options.include_usage` makes the server send a last chunk with a
  `usage` block (source "server", with `prompt_tokens_details.cached_tokens`); without
  one we fall back to our own count (source "client", prompt_tokens unknown: None).
- **timings**: llama-server adds its per-request `timings` object (prompt_ms,
  predicted_per_second, cache_n...): passed on verbatim, plus the response id and model.

SSE framing is parsed by `httpx-sse` (small, well kept); the JSON inside each event is read
by one `_Parser` shared by the sync `stream()` and the async `astream()`.
"""
from __future__ import annotations

import json
import re
import time
from typing import Any, AsyncIterator, Iterator

import httpx
from httpx_sse import SSEError, aconnect_sse, connect_sse

from infercourse.core.errors import APILayerError, ContextLayerError, InferCourseError
from infercourse.core.types import Event, Messages, Request, Usage, as_request

__all__ = ["OpenAIHTTPEngine"]

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


def _server_error(where: str, status: int | None, body: Any, partial: list[Event] | None = None
                  ) -> InferCourseError:
    msg = _error_message(body)
    head = f"server at {where} answered HTTP {status}" if status else f"server at {where} sent an error"
    if _CONTEXT_RE.search(msg) or _CONTEXT_RE.search(str(body)):
        return ContextLayerError(f"{head}: {msg}", partial=partial,
                                 hint="shorten the prompt, lower max_tokens, or start the server "
                                      "with a larger context (llama-server: -c, per slot = c / np)")
    return APILayerError(f"{head}: {msg}", partial=partial)


def _count_logprobs(lp: Any) -> int | None:
    """Tokens in a chunk from its logprobs: chat uses {"content": [...]}, completions
    {"tokens": [...]} (llama-server uses "content" for both). None: no logprobs sent."""
    if isinstance(lp, dict):
        for key in ("content", "tokens"):
            if isinstance(lp.get(key), list):
                return len(lp[key])
    return None


class _Parser:
    """Turns the JSON payloads of one SSE stream into Events (shared by sync and async)."""

    def __init__(self, api: str, where: str):
        self.api, self.where = api, where
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
            raise _server_error(self.where, None, chunk, partial=list(self.events))
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
        event = Event(t=t, text=text, n_tokens=n)
        self.events.append(event)
        return event

    def final(self, t: float) -> Event:
        if not self.finished:
            raise APILayerError(f"stream from {self.where} ended without data: [DONE]",
                                partial=list(self.events),
                                hint="the server may have crashed; see its log")
        counted = sum(e.n_tokens for e in self.events)
        u, unstreamed = self.usage, 0
        if u and "completion_tokens" in u:
            details = u.get("prompt_tokens_details") or {}
            usage = Usage(prompt_tokens=u.get("prompt_tokens"),
                          completion_tokens=u["completion_tokens"],
                          cached_tokens=details.get("cached_tokens"), source="server")
            if self.sources == {"logprobs"}:
                # llama-server counts the EOS token it decoded but never streams it: it
                # arrives, textless, with the end of the stream
                unstreamed = max(0, usage.completion_tokens - counted)
        else:  # e.g. llama_cpp.server: no usage in streams; we cannot count the prompt
            usage = Usage(prompt_tokens=None, completion_tokens=counted, source="client")
        timings = dict(self.timings)
        timings.update(chunk_tokens_from="+".join(sorted(self.sources)) or None,
                       client_token_count=counted, unstreamed_tokens=unstreamed,
                       **{f"response_{k}": v for k, v in self.meta.items()})
        return Event(t=t, n_tokens=unstreamed, done=True, usage=usage,
                     finish_reason=self.finish_reason, timings=timings)


class OpenAIHTTPEngine:
    """A client for one model on an OpenAI-compatible server.

    Args:
        base_url: server root, with or without `/v1` (e.g. "http://127.0.0.1:8080").
        model: model name the server knows; None asks `/v1/models` for its one model.
        api: "chat" (server applies the chat template) or "completions" (raw prompt).
        api_key: sent as `Authorization: Bearer ...` when given.
        extra_body: extra JSON fields merged last; a value of None removes a field
            (e.g. `{"cache_prompt": None}` for a strict server that rejects unknown keys).
        timeout: seconds to wait for any one read (prefill of a long prompt included).
        logprobs: ask for logprobs so per-chunk token counts are exact.
    """

    name = "openai_http"

    def __init__(self, base_url: str, model: str | None = None, api: str = "chat",
                 api_key: str | None = None, extra_body: dict[str, Any] | None = None,
                 timeout: float = 600.0, logprobs: bool = True):
        if api not in ("chat", "completions"):
            raise ValueError(f"api must be 'chat' or 'completions', got {api!r}")
        root = base_url.rstrip("/")
        self.root = root[:-3] if root.endswith("/v1") else root
        self.base_url = self.root + "/v1"
        url = httpx.URL(self.root)
        self.where = f"{url.host}:{url.port or (443 if url.scheme == 'https' else 80)}"
        self.api, self.extra_body, self.logprobs = api, dict(extra_body or {}), logprobs
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = httpx.Timeout(timeout, connect=10.0)
        self._model = model
        self._client: httpx.Client | None = None

    # -- plumbing ---------------------------------------------------------------------
    @property
    def client(self) -> httpx.Client:
        if self._client is None:  # one pooled connection: TTFT should not include a TCP connect
            self._client = httpx.Client(timeout=self.timeout, headers=self.headers)
        return self._client

    def async_client(self, concurrency: int = 16) -> httpx.AsyncClient:
        """An AsyncClient whose pool fits `concurrency` streams at once (for load tests)."""
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        return httpx.AsyncClient(timeout=self.timeout, headers=self.headers, limits=limits)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _unreachable(self, exc: Exception) -> APILayerError:
        return APILayerError(f"server at {self.where} not reachable ({type(exc).__name__})",
                             hint="start one, e.g. `with infercourse.servers.LlamaServer() as s:`, "
                                  "or check the URL and port")

    def _get_json(self, path: str) -> Any:
        try:
            r = self.client.get(self.root + path, timeout=10.0)
        except httpx.ConnectError as exc:
            raise self._unreachable(exc) from None
        if r.status_code >= 400:
            raise _server_error(self.where, r.status_code, r.text)
        return r.json()

    @property
    def model(self) -> str:
        if self._model is None:
            try:
                ids = [m["id"] for m in self._get_json("/v1/models").get("data", [])]
            except (ValueError, AttributeError, KeyError, TypeError):
                ids = []
            if len(ids) != 1:
                raise APILayerError(f"server at {self.where} lists models {ids}: cannot pick one",
                                    hint="pass model=... to OpenAIHTTPEngine")
            self._model = ids[0]
        return self._model

    def body(self, request: Request) -> dict[str, Any]:
        """The JSON sent for `request` (public so lessons can show the wire format)."""
        body: dict[str, Any] = {
            "model": self.model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": request.max_tokens, "temperature": request.temperature,
            "seed": request.seed,
            "cache_prompt": request.cache_prompt,  # llama-server's prefix reuse; others ignore it
        }
        if self.api == "chat":
            body["messages"] = (request.messages if request.messages is not None
                                else [{"role": "user", "content": request.prompt}])
            if self.logprobs:
                body["logprobs"] = True
        else:
            if request.prompt is None:
                raise APILayerError("api='completions' takes a raw prompt, got chat messages",
                                    hint="use api='chat', or Request(prompt=...)")
            body["prompt"] = request.prompt
            if self.logprobs:
                body["logprobs"] = 1
        if request.ignore_eos:  # llama-server and vLLM; vLLM also honours min_tokens
            body.update(ignore_eos=True, min_tokens=request.max_tokens)
        body.update(self.extra_body)
        return {k: v for k, v in body.items() if v is not None}

    def _url(self) -> str:
        return self.base_url + ("/chat/completions" if self.api == "chat" else "/completions")

    def _transport_error(self, exc: Exception, parser: _Parser) -> APILayerError:
        if isinstance(exc, httpx.ConnectError):
            return self._unreachable(exc)
        if isinstance(exc, httpx.TimeoutException):
            return APILayerError(f"server at {self.where} sent nothing for {self.timeout.read}s",
                                 partial=list(parser.events), hint="raise timeout= or check the server")
        if isinstance(exc, SSEError):
            return APILayerError(f"server at {self.where} did not answer with an SSE stream: {exc}",
                                 partial=list(parser.events))
        return APILayerError(f"stream from {self.where} was cut mid-way ({type(exc).__name__}: {exc})",
                             partial=list(parser.events), hint="the server may have crashed; see its log")

    # -- the interface ----------------------------------------------------------------
    def stream(self, request: Request | str | Messages, **overrides: Any) -> Iterator[Event]:
        """Yield one Event per chunk as it arrives, then the done Event."""
        req = as_request(request, **overrides)
        body, parser = self.body(req), _Parser(self.api, self.where)
        try:
            with connect_sse(self.client, "POST", self._url(), json=body) as source:
                if source.response.status_code >= 400:
                    raise _server_error(self.where, source.response.status_code,
                                        _json_or_text(source.response.read()))
                for sse in source.iter_sse():
                    event = parser.feed(sse.data, time.perf_counter())
                    if event is not None:
                        yield event
                    if parser.finished:
                        break
        except (httpx.HTTPError, SSEError) as exc:
            raise self._transport_error(exc, parser) from exc
        yield parser.final(time.perf_counter())

    async def astream(self, request: Request | str | Messages, client: httpx.AsyncClient | None = None,
                      **overrides: Any) -> AsyncIterator[Event]:
        """Async twin of `stream()`, for many concurrent requests on one event loop.

        Args:
            client: a shared `httpx.AsyncClient` (see `async_client(concurrency)`); None
                opens one for this request only.
        """
        req = as_request(request, **overrides)
        body, parser = self.body(req), _Parser(self.api, self.where)
        own = client is None
        client = client or self.async_client(1)
        try:
            async with aconnect_sse(client, "POST", self._url(), json=body) as source:
                if source.response.status_code >= 400:
                    raise _server_error(self.where, source.response.status_code,
                                        _json_or_text(await source.response.aread()))
                async for sse in source.aiter_sse():
                    event = parser.feed(sse.data, time.perf_counter())
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

    def describe(self) -> dict[str, Any]:
        """Where and what: URL, API, model, and what the server says about itself."""
        info: dict[str, Any] = {"engine": self.name, "base_url": self.base_url, "api": self.api,
                                "model": self._model}
        for key, path in (("served_models", "/v1/models"), ("props", "/props"), ("version", "/version")):
            try:
                got = self._get_json(path)
            except (InferCourseError, ValueError, httpx.HTTPError):
                continue
            if key == "served_models" and isinstance(got, dict):
                got = [m.get("id") for m in got.get("data", [])]
            elif key == "props" and isinstance(got, dict):  # llama-server: keep the identifying bits
                got = {k: got.get(k) for k in ("build_info", "model_path", "total_slots")} | {
                    "n_ctx": (got.get("default_generation_settings") or {}).get("n_ctx")}
            info[key] = got
        return info


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")
