"""Capture every call a real coding agent makes: a recording pass-through proxy.

A coding agent is a client we did not write: to see what it sends we stand between it and
the server. `RecordingProxy` listens on 127.0.0.1, forwards each request unchanged to a
loopback server, streams the answer back chunk by chunk as it arrives, and records per call:

| column | where it comes from |
|---|---|
| path, api, model, status, error | the request line and body; the status; an error body or an SSE `error` event |
| ttft_s, e2e_s | the proxy's clock: request received -> first output event -> end (loopback: what the agent sees, less a copy) |
| prompt / cached / output tokens | the server's own usage block (Anthropic `usage`, Responses `usage`, chat `usage`) |
| evaluated_tokens | the server's `/metrics` counter of prompt tokens it evaluated, read before and after the call |
| stop_reason | `stop_reason`, the Responses status, or `finish_reason` |

Each call becomes a `RequestTrace` in a results folder (`RunWriter`: manifest first, a line
per call, fsynced), so `infercourse report` renders it like any bench run. The request bodies
go to `bodies/NNN.json` in that folder: they hold the vendors' prompt text, stay in the
learner's results folder and are never committed (only numbers derived from them are).

Written by hand on the standard library's `ThreadingHTTPServer` and `httpx` (both already
here) rather than on `ops.netfaults.FaultProxy`: a recorder must keep the client's
connections as they are (agents pool keep-alive connections; the fault proxy closes each
after one request, which is part of the faults it makes) and must see every call whole,
request and answer, including the GETs an agent makes on the side.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import httpx

from infercourse.core.errors import ServerLayerError
from infercourse.core.loopback import is_loopback
from infercourse.core.trace import RequestTrace
from infercourse.ops.probes import parse_metrics
from infercourse.servers.process import HOST

__all__ = ["RecordingProxy", "SSEWatcher", "api_of", "evaluated_count", "usage_tokens", "GENERATING_APIS",
           "EVALUATED"]

EVALUATED = "llamacpp:prompt_tokens_total"   # llama-server: prompt tokens it evaluated (cache hits excluded)
_HOP = {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "te",
        "trailer", "upgrade", "accept-encoding"}


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
    when the first output arrived, each output event's time, usage, stop reason, error.
    Framing: events end at a blank line, LF or CRLF; `event:` lines are optional."""

    def __init__(self, api: str):
        self.api, self.buf = api, b""
        self.first_t: float | None = None
        self.event_t: list[float] = []
        self.usage: dict[str, Any] = {}
        self.stop_reason: str | None = None
        self.error: str | None = None

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
        self.stop_reason = doc.get("stop_reason") or doc.get("status") or self.stop_reason
        for c in doc.get("choices") or []:
            self.stop_reason = c.get("finish_reason") or self.stop_reason
        if doc.get("error"):
            self.error = _error_text(doc)

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
            self.error = _error_text(doc)
            return
        if self._is_output(kind, doc):
            self.first_t = self.first_t if self.first_t is not None else t
            self.event_t.append(t)
        msg = doc.get("message") or doc.get("response") or {}
        self._usage(doc.get("usage"))
        self._usage(msg.get("usage") if isinstance(msg, dict) else None)
        delta = doc.get("delta") if isinstance(doc.get("delta"), dict) else {}
        self.stop_reason = delta.get("stop_reason") or self.stop_reason
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            details = msg.get("incomplete_details") or {}
            self.stop_reason = details.get("reason") or msg.get("status") or kind.split(".")[1]
            if kind == "response.failed":
                self.error = _error_text(msg) or "response.failed"
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


def _error_text(doc: Any) -> str:
    err = doc.get("error", doc) if isinstance(doc, dict) else doc
    if isinstance(err, dict):
        return str(err.get("message") or err.get("type") or err)[:500]
    return str(err)[:500]


def evaluated_count(url: str, client: httpx.Client | None = None, errors: list[str] | None = None) -> float | None:
    """llama-server's counter of prompt tokens it evaluated (`/metrics`); None where it has
    none or did not answer (why goes to `errors`). llama-server answers /metrics from its main
    loop, between batches, so the wait may be long: 60 s."""
    try:
        r = (client or httpx).get(url.rstrip("/") + "/metrics", timeout=60)
        if r.status_code != 200:
            (errors if errors is not None else []).append(f"HTTP {r.status_code}")
            return None
        return parse_metrics(r.text).get(EVALUATED)
    except (httpx.HTTPError, ValueError) as e:
        (errors if errors is not None else []).append(f"{type(e).__name__}: {e}")
        return None


class RecordingProxy:
    """A pass-through proxy on 127.0.0.1 in front of a loopback server, recording each call.

    Args:
        upstream: the server root, e.g. "http://127.0.0.1:8080" (loopback only).
        on_call: called with each finished call's `RequestTrace` (the lab writes it to its
            `RunWriter`); the bodies go to `bodies_dir` when given.
        bodies_dir: where each request body is saved as NNN.json (a results folder).
        read_metrics: read the upstream's /metrics around each generating call (llama-server).
    """

    def __init__(self, upstream: str, on_call: Callable[[RequestTrace], Any] | None = None, *,
                 bodies_dir: str | Path | None = None, read_metrics: bool = True):
        self.upstream = upstream.rstrip("/")
        host = httpx.URL(self.upstream).host
        if not is_loopback(host):
            raise ServerLayerError(f"the recording proxy fronts loopback servers only, not {host}")
        self.on_call, self.read_metrics = on_call, read_metrics
        self.bodies_dir = Path(bodies_dir) if bodies_dir else None
        self.tags: dict[str, Any] = {}       # added to every call from now on (the lab sets task, agent)
        self.traces: list[RequestTrace] = []
        self.metrics_errors: list[str] = []
        self._lock, self._n, self._in_flight = threading.Lock(), 0, 0
        # no pooled keep-alive upstream: llama-server closes idle connections, and a request
        # sent on one it just closed fails ("Server disconnected without sending a response")
        self._client = httpx.Client(timeout=httpx.Timeout(None, connect=10.0),
                                    limits=httpx.Limits(max_keepalive_connections=0))
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self._server.server_address[1]}"

    def start(self) -> "RecordingProxy":
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:   # nothing on the learner's cell
                pass

            def do_GET(self) -> None: proxy._relay(self)
            def do_POST(self) -> None: proxy._relay(self)
            def do_HEAD(self) -> None: proxy._relay(self)
            def do_DELETE(self) -> None: proxy._relay(self)
            def do_PUT(self) -> None: proxy._relay(self)

        self._server = ThreadingHTTPServer((HOST, 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True, name="agent-capture").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._client.close()

    def __enter__(self) -> "RecordingProxy":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _evaluated(self) -> float | None:
        return evaluated_count(self.upstream, self._client, self.metrics_errors)

    def _relay(self, h: BaseHTTPRequestHandler) -> None:
        n = int(h.headers.get("content-length") or 0)
        body = h.rfile.read(n) if n else b""
        t0 = time.perf_counter()
        api = api_of(h.path)
        generating = h.command == "POST" and api in GENERATING_APIS
        with self._lock:
            rid, self._n = self._n, self._n + 1
            self._in_flight += 1
            overlapped = self._in_flight > 1
        before = self._evaluated() if generating and self.read_metrics else None
        if self.bodies_dir is not None and body:
            self.bodies_dir.mkdir(parents=True, exist_ok=True)
            (self.bodies_dir / f"{rid:03d}.json").write_bytes(body)
        watch, status, err_body, cut = SSEWatcher(api), None, b"", None
        headers = [(k, v) for k, v in h.headers.items() if k.lower() not in _HOP]
        try:
            with self._client.stream(h.command, self.upstream + h.path, headers=headers, content=body) as r:
                status = r.status_code
                sse = "event-stream" in r.headers.get("content-type", "")
                h.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in _HOP:
                        h.send_header(k, v)
                h.send_header("transfer-encoding", "chunked")
                h.end_headers()
                whole = b""
                for chunk in r.iter_raw():
                    t = time.perf_counter()
                    if sse:
                        watch.feed(chunk, t)
                    else:
                        whole += chunk
                    h.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    h.wfile.flush()
                h.wfile.write(b"0\r\n\r\n")
                h.wfile.flush()
                watch.close(time.perf_counter())
                if not sse:
                    watch.whole_body(whole)
                    err_body = whole if status >= 400 else b""
        except httpx.HTTPError as e:
            cut = f"upstream: {type(e).__name__}: {e}"
            if status is None:
                h.send_error(502, "upstream not reachable")
        except (BrokenPipeError, ConnectionResetError) as e:
            cut = f"client went away: {type(e).__name__}"   # the agent hung up (its own timeout)
        end = time.perf_counter()
        with self._lock:
            self._in_flight -= 1
            overlapped = overlapped or self._in_flight > 0
        after = self._evaluated() if generating and self.read_metrics else None
        self._record(rid, h, body, api, t0, end, status, watch, err_body, cut, overlapped, before, after)

    def _record(self, rid, h, body, api, t0, end, status, watch, err_body, cut, overlapped, before, after):
        try:
            doc = json.loads(body) if body else {}
        except ValueError:
            doc = {}
        tok = watch.tokens()
        error = watch.error or (_error_text(json.loads(err_body)) if err_body.strip().startswith(b"{")
                                else err_body.decode("utf-8", "replace")[:500] or None) or cut
        ok = status is not None and status < 400 and not watch.error and not cut
        tags = {**self.tags, "path": h.path, "method": h.command, "api": api, "http_status": status,
                "model": doc.get("model") if isinstance(doc, dict) else None,
                "stream": bool(doc.get("stream")) if isinstance(doc, dict) else False,
                "max_tokens": (doc.get("max_tokens") or doc.get("max_output_tokens")) if isinstance(doc, dict) else None,
                "body_bytes": len(body), "stop_reason": watch.stop_reason, "overlapped": overlapped,
                "evaluated_tokens": (after - before) if before is not None and after is not None else None,
                "output_events": len(watch.event_t)}
        tr = RequestTrace(request_id=rid, scheduled_t=t0, sent_t=t0, chunk_t=list(watch.event_t),
                          chunk_tokens=[1] * len(watch.event_t), end_t=end,
                          prompt_tokens=tok["prompt_tokens"], completion_tokens=tok["output_tokens"],
                          cached_tokens=tok["cached_tokens"], token_source="server" if watch.usage else None,
                          finish_reason=watch.stop_reason, status="ok" if ok else "error",
                          error=None if ok else (error or f"HTTP {status}"), tags=tags)
        with self._lock:
            self.traces.append(tr)
        if self.on_call is not None:
            self.on_call(tr)
