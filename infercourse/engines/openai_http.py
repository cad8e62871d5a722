"""Stream from any OpenAI-compatible HTTP server: the wire format most engines speak.

llama.cpp's llama-server, vLLM, SGLang, TGI, LM Studio, mlx_lm.server and Ollama's /v1 all
take `POST /v1/chat/completions` (or `/v1/completions`) with `"stream": true` and answer
with Server-Sent Events: one `data: {json}` line per chunk, ending with `data: [DONE]`.

How each number is read (tokens per chunk, usage, timings) is in `openai_stream`, the
parser shared by the sync `stream()` and the async `astream()`; SSE framing is parsed by
`httpx-sse` (small, well kept). By default we do not ask for logprobs: on servers that
stream one token per chunk they add nothing but server time, and every request's chunk
count is checked against the server's usage (see `openai_stream`).
"""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable, Iterator

import httpx
from httpx_sse import SSEError, aconnect_sse, connect_sse

from infercourse.core.errors import APILayerError, InferCourseError
from infercourse.core.types import Event, Messages, Request, as_request
from infercourse.engines.openai_stream import Parser as _Parser
from infercourse.engines.openai_stream import json_or_text as _json_or_text
from infercourse.engines.openai_stream import server_error as _server_error
from infercourse.engines.tools import to_openai_tools, tool_names

__all__ = ["OpenAIHTTPEngine"]


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
        logprobs: ask for logprobs, so per-chunk token counts are exact even where a server
            packs several tokens in one chunk. Off by default: it costs the server time per
            token, and one token per chunk is checked against usage at the end anyway.
    """

    name = "openai_http"

    def __init__(self, base_url: str, model: str | None = None, api: str = "chat",
                 api_key: str | None = None, extra_body: dict[str, Any] | None = None,
                 timeout: float = 600.0, logprobs: bool = False):
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

    def server_tokenizer(self) -> Callable[[str], list]:
        """The served model's own tokenizer, through the server's `/tokenize`: llama-server
        takes {"content", "add_special"}, vLLM {"model", "prompt", "add_special_tokens"}.
        Counts include what the server adds to a raw prompt (BOS), like a local tokenizer.
        Raises APILayerError when the server has neither (count with a local file instead)."""
        forms = (lambda text: {"content": text, "add_special": True},
                 lambda text: {"model": self.model, "prompt": text, "add_special_tokens": True})
        for form in forms:
            try:
                r = self.client.post(self.root + "/tokenize", json=form("probe"), timeout=10.0)
                if r.status_code in (401, 403):   # it has one, and refuses us: say why
                    raise _server_error(self.where, r.status_code, _json_or_text(r.content))
                ok = r.status_code == 200 and isinstance(r.json().get("tokens"), list)
            except httpx.ConnectError as exc:
                raise self._unreachable(exc) from None
            except (httpx.HTTPError, ValueError, AttributeError):
                ok = False
            if ok:
                def tokenize(text: str, form=form) -> list:
                    got = self.client.post(self.root + "/tokenize", json=form(text), timeout=10.0)
                    got.raise_for_status()
                    return got.json()["tokens"]
                return tokenize
        raise APILayerError(f"server at {self.where} has no /tokenize endpoint: cannot count "
                            "prompt tokens with the served model's tokenizer",
                            hint="give the model's tokenizer file (--tokenizer PATH: a .gguf, or an "
                                 "HF folder with tokenizer.json)")

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
            if request.tools:   # llama-server needs --jinja (its default) to parse calls
                body["tools"] = to_openai_tools(request.tools)
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
        body, parser = self.body(req), _Parser(self.api, self.where, tool_names(req.tools))
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
        body, parser = self.body(req), _Parser(self.api, self.where, tool_names(req.tools))
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

