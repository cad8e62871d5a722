"""Ollama through its native API, where the server times itself.

Ollama (a Go server around llama.cpp) streams newline-delimited JSON from `/api/chat` and
`/api/generate`. Its last object (`"done": true`) carries the server's own clock, in
nanoseconds (docs/api.md in ollama/ollama):

    total_duration        the whole request, model load included
    load_duration         loading the model (0 when it was already in memory)
    prompt_eval_count     "number of tokens in the prompt" (see below)
    prompt_eval_cached_count  prompt tokens read from the cache (newer servers only)
    prompt_eval_duration  prefill time
    eval_count            tokens generated
    eval_duration         decode time -> decode tok/s = eval_count / eval_duration * 1e9

Counting the prompt: servers that send `prompt_eval_cached_count` define
`prompt_eval_count` as the whole prompt, cached tokens included, so we report both.
Older servers counted only the tokens they evaluated there, and left the field out
altogether when the whole prompt came from the cache (ollama/ollama#2068, #3427). From
such a server the prompt's length is unknown: we report `prompt_tokens=None`, never the
evaluated count and never 0, and keep `prompt_eval_count` in `timings` as what it is, the
server's prefill count (`reconcile` compares it with the uncached prompt).

We pass those on verbatim in the final Event's `timings`, so a lesson can set the server's
view beside the client's (TTFT measured here includes HTTP and queueing; theirs does not).
Each streamed object holds one token's text, so chunks count 1 token each.

Two limits to know: Ollama has no `ignore_eos` (a forced length is impossible: we warn
and record it), and a prompt longer than `num_ctx` is truncated silently, not refused.

Same weights: `ollama pull smollm2:135m` fetches the registry's file, not the course's.
`create_from_gguf` makes an Ollama model from the course's own GGUF instead: it uploads the
file as a blob (`POST /api/blobs/sha256:<digest>`) and creates a model from it
(`POST /api/create` with `files`), the API form of a Modelfile `FROM /path/to.gguf`.
`OllamaEngine.from_gguf` does that and opens the engine on it.
"""
from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import httpx

from infercourse import compat
from infercourse.core.errors import APILayerError, ModelLayerError
from infercourse.core.types import Event, Messages, Request, Usage, as_request

__all__ = ["OllamaEngine", "OLLAMA_TIMING_FIELDS", "prompt_counts", "create_from_gguf"]

OLLAMA_TIMING_FIELDS = ("total_duration", "load_duration", "prompt_eval_count",
                        "prompt_eval_cached_count", "prompt_eval_duration", "eval_count",
                        "eval_duration")
DEFAULT_HOST = "http://127.0.0.1:11434"


def prompt_counts(final: dict[str, Any]) -> tuple[int | None, int | None]:
    """(prompt tokens, cached prompt tokens) from a final object's fields.

    Only a server that reports `prompt_eval_cached_count` says how long the prompt was
    (`prompt_eval_count`, cached included). Without it, `prompt_eval_count` may count
    evaluated tokens only and vanishes when all were cached: (None, None), unknown.

    Args:
        final: the done object's fields (or `timings` of our done Event).
    """
    cached = final.get("prompt_eval_cached_count")
    if cached is None:
        return None, None
    return int(final.get("prompt_eval_count") or 0), int(cached)


def create_from_gguf(client: Any, gguf: str | Path, name: str | None = None) -> str:
    """Create an Ollama model from a local GGUF file; return its name.

    The name carries the first 12 hex digits of the file's SHA-256 (`infercourse-<stem>:<digest>`),
    so the same file always makes the same model and a different file never reuses it.

    Args:
        client: an `ollama.Client` (its `create_blob` hashes and uploads the file).
        gguf: the GGUF file, e.g. `models.embedded.embedded_gguf()`.
        name: the model name (None: derived from the file as above).
    """
    path = Path(gguf)
    digest = client.create_blob(path)          # "sha256:<hex>"; the server keeps one copy per digest
    name = name or f"infercourse-{path.stem.lower().replace('_', '-')}:{digest.split(':', 1)[1][:12]}"
    client.create(model=name, files={path.name: digest})
    return name


class OllamaEngine:
    """One model on an Ollama server: the official `ollama` Python client for its host and
    metadata, its HTTP client for the stream (read line by line, every field kept).

    Args:
        model: an Ollama model name, e.g. "smollm2:135m".
        host: server URL; None reads $OLLAMA_HOST, else http://127.0.0.1:11434.
        api: "chat" (`/api/chat`, the model's template applied) or "generate"
            (`/api/generate` with `raw: true`, the prompt sent as is).
        num_ctx: context window Ollama allocates (None: the model's default).
        keep_alive: how long the model stays loaded after a request (e.g. "5m", 0).
        **client_kwargs: passed to `ollama.Client` and on to `httpx.Client`.
    """

    name = "ollama"

    def __init__(self, model: str, host: str | None = None, api: str = "chat",
                 num_ctx: int | None = None, keep_alive: str | int | None = None,
                 **client_kwargs: Any):
        import ollama  # lazy: the client is only needed when Ollama is used

        if api not in ("chat", "generate"):
            raise ValueError(f"api must be 'chat' or 'generate', got {api!r}")
        self.model, self.api, self.num_ctx, self.keep_alive = model, api, num_ctx, keep_alive
        host = host or os.environ.get("OLLAMA_HOST") or DEFAULT_HOST
        self.host = host if "://" in host else f"http://{host}"
        url = httpx.URL(self.host)
        self.where = f"{url.host}:{url.port or 11434}"
        self._ollama = ollama
        self.client = ollama.Client(host=self.host, **client_kwargs)

    @classmethod
    def from_gguf(cls, gguf: str | Path | None = None, **kwargs: Any) -> "OllamaEngine":
        """An engine on an Ollama model created from `gguf` (None: the course's embedded GGUF),
        so that Ollama serves the same weights as every other route (`create_from_gguf`).

        Args:
            gguf: the GGUF file.
            **kwargs: as `OllamaEngine` (host, api, num_ctx, keep_alive, client options).
        """
        if gguf is None:
            from infercourse.models.embedded import embedded_gguf
            gguf = embedded_gguf()
        engine = cls("", **kwargs)
        try:
            engine.model = create_from_gguf(engine.client, gguf)
        except engine._ollama.ResponseError as exc:   # the server refused the file: the model layer
            raise ModelLayerError(f"Ollama at {engine.where} could not create a model from {gguf}: "
                                  f"HTTP {exc.status_code}: {exc.error}") from exc
        except (ConnectionError, httpx.HTTPError) as exc:
            raise engine._error(exc, []) from exc
        engine.gguf = Path(gguf)
        return engine

    def options(self, request: Request) -> dict[str, Any]:
        """The `options` object sent with every request (Modelfile parameter names)."""
        opts = {"num_predict": request.max_tokens, "temperature": request.temperature,
                "seed": request.seed}
        if self.num_ctx:
            opts["num_ctx"] = self.num_ctx
        return opts

    def body(self, request: Request) -> tuple[str, dict[str, Any]]:
        """The path and JSON sent for `request` (what the official client would send)."""
        common = {"model": self.model, "stream": True, "options": self.options(request),
                  "keep_alive": self.keep_alive}
        if self.api == "chat":
            messages = request.messages if request.messages is not None else [
                {"role": "user", "content": request.prompt}]
            return "/api/chat", {**common, "messages": messages}
        if request.prompt is None:
            raise APILayerError("api='generate' takes a raw prompt, got chat messages",
                                hint="use api='chat', or Request(prompt=...)")
        return "/api/generate", {**common, "prompt": request.prompt, "raw": True}

    def _call(self, req: Request) -> Iterator[dict[str, Any]]:
        # The NDJSON lines as the server sent them, through the official client's own
        # httpx client (host, headers, transport): `ollama` 0.6.3 parses each line into a
        # model that silently drops fields it does not declare, prompt_eval_cached_count
        # among them, and the prompt cannot be counted without it.
        path, body = self.body(req)
        http = compat.ollama_http_client(self.client)
        with http.stream("POST", path, json={k: v for k, v in body.items() if v is not None}) as r:
            if r.status_code >= 400:
                r.read()
                raise self._ollama.ResponseError(r.text, r.status_code)
            for line in r.iter_lines():
                if not line.strip():
                    continue
                part = json.loads(line)
                if not isinstance(part, dict):
                    raise ValueError(f"not a JSON object: {line[:200]!r}")
                if part.get("error"):     # Ollama reports failures mid-stream this way
                    raise self._ollama.ResponseError(str(part["error"]))
                yield part

    def _error(self, exc: Exception, events: list[Event]) -> Exception:
        ollama = self._ollama
        if isinstance(exc, ollama.ResponseError):
            if exc.status_code == 404 or "not found" in str(exc.error).lower():
                return ModelLayerError(f"Ollama at {self.where} does not have model {self.model!r}: "
                                       f"{exc.error}", hint=f"run `ollama pull {self.model}`",
                                       partial=events)
            return APILayerError(f"Ollama at {self.where} answered HTTP {exc.status_code}: {exc.error}",
                                 partial=events)
        if isinstance(exc, (ConnectionError, httpx.ConnectError)):
            return APILayerError(f"server at {self.where} not reachable",
                                 hint="start it with `ollama serve`, or set OLLAMA_HOST")
        if isinstance(exc, ValueError):  # a malformed NDJSON line
            return APILayerError(f"malformed stream from Ollama at {self.where}: {exc}", partial=events)
        return APILayerError(f"stream from Ollama at {self.where} was cut mid-way "
                             f"({type(exc).__name__}: {exc})", partial=events)

    def stream(self, request: Request | str | Messages, **overrides: Any) -> Iterator[Event]:
        """Yield one Event per streamed object, then the done Event with Ollama's timings."""
        req = as_request(request, **overrides)
        if req.ignore_eos:
            warnings.warn("Ollama has no ignore_eos: generation may stop before max_tokens",
                          stacklevel=2)
        events: list[Event] = []
        last = None
        try:
            for part in self._call(req):
                t = time.perf_counter()
                src = (part.get("message") or {}) if self.api == "chat" else part
                text = src.get("content" if self.api == "chat" else "response") or ""
                thinking = src.get("thinking") or ""
                if text or thinking:  # one token per object; thinking tokens carry no text
                    events.append(Event(t=t, text=text, n_tokens=1))
                    yield events[-1]
                if part.get("done"):
                    last = part
                    break
        except (self._ollama.ResponseError, ConnectionError, httpx.HTTPError,
                ValueError) as exc:  # ValueError: a line that is not JSON
            raise self._error(exc, events) from exc
        if last is None:
            raise APILayerError(f"stream from Ollama at {self.where} ended without a done object",
                                partial=events, hint="the server may have crashed; see its log")
        timings: dict[str, Any] = {k: last.get(k) for k in OLLAMA_TIMING_FIELDS}
        timings.update(done_reason=last.get("done_reason"), response_model=last.get("model"),
                       created_at=last.get("created_at"), chunk_tokens_from="deltas",
                       ignore_eos="unsupported" if req.ignore_eos else None)
        prompt, cached = prompt_counts(timings)
        timings["prompt_tokens_from"] = ("prompt_eval_count (cached included)" if prompt is not None
                                         else "unknown: this server counts evaluated tokens only")
        usage = Usage(prompt_tokens=prompt,
                      completion_tokens=last["eval_count"] if last.get("eval_count") is not None
                      else sum(e.n_tokens for e in events),
                      cached_tokens=cached, source="server" if last.get("eval_count") is not None else "client")
        yield Event(t=time.perf_counter(), done=True, usage=usage,
                    finish_reason=last.get("done_reason"), timings=timings)

    def describe(self) -> dict[str, Any]:
        """Host, model, and what the server says about both (version, format, quantization)."""
        info: dict[str, Any] = {"engine": self.name, "host": self.host, "model": self.model,
                                "api": self.api, "num_ctx": self.num_ctx}
        try:
            # the client has no version() call; its httpx client knows the host
            info["server_version"] = compat.ollama_http_client(self.client).get("/api/version").json().get("version")
        except (httpx.HTTPError, ValueError, compat.UpstreamChanged):
            info["server_version"] = None
        try:
            details = self.client.show(self.model).details
            info["model_details"] = details.model_dump() if details else None
        except (self._ollama.ResponseError, ConnectionError, httpx.HTTPError, ValueError):
            info["model_details"] = None
        return info
