"""Capture every call a real coding agent makes: a recording pass-through proxy.

A coding agent is a client we did not write: to see what it sends we stand between it and
the server. `RecordingProxy` listens on 127.0.0.1, forwards each request unchanged (but for
a lab's `rewrite`, tagged on the call) to a loopback server (another host only when the caller
says so: `allow_remote`), streams the answer back chunk by chunk as it arrives, and records:

| column | where it comes from |
|---|---|
| path, api, model, status, error | the request line and body; the status; an error body or an SSE `error` event |
| ttft_s, e2e_s | the proxy's clock: request received -> first output event -> end (loopback: what the agent sees, less a copy) |
| prompt / cached / output tokens | the server's own usage block (Anthropic `usage`, Responses `usage`, chat `usage`) |
| evaluated_tokens | the server's own per-request `timings.prompt_n`; for a call cut before its timings, the `/metrics` counter read around it (`read_metrics`, the lab), unless another call overlapped it |
| server_prompt_n, server_cache_n, prefill_ms | llama-server's `timings` of this request: tokens evaluated, reused, and its prefill time |
| stop_reason | `stop_reason`, the Responses status, or `finish_reason` |

Each call becomes a `RequestTrace` in a results folder (`RunWriter`: manifest first, a line
per call, fsynced), rendered by `infercourse report` like any bench run. The request bodies go
to `bodies/NNN.json` there: the vendors' prompt text, never committed (only numbers from it).

Written by hand on the standard library's `ThreadingHTTPServer` and `http.client`, not on
`ops.netfaults.FaultProxy`: a recorder keeps the client's keep-alive connections as they are
(the fault proxy closes each after one request, one of its faults) and sees every call whole,
the GETs on the side too. What it adds to each call is measured (`ops.recorder_cost`), and
kept small: every write leaves at once (TCP_NODELAY), the connection upstream is kept between
calls, and a call's bookkeeping runs on its own thread after its answer went out. How each
answer is read (usage, first output, timings) is `ops.agent_stream`.
"""
from __future__ import annotations

import http.client
import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import httpx

from infercourse.core.errors import ServerLayerError
from infercourse.core.loopback import is_loopback
from infercourse.core.trace import RequestTrace
from infercourse.ops.agent_stream import GENERATING_APIS, SSEWatcher, api_of, error_text, usage_tokens
from infercourse.ops.probes import parse_metrics
from infercourse.servers.process import HOST

__all__ = ["RecordingProxy", "SSEWatcher", "api_of", "evaluated_count", "usage_tokens", "GENERATING_APIS", "EVALUATED"]

EVALUATED = "llamacpp:prompt_tokens_total"   # llama-server: prompt tokens it evaluated (cache hits excluded)
KEEP_IDLE_S = 2.0   # reuse a connection upstream idle for less than this (llama-server drops them at 5 s)
_HOP = {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "te",
        "trailer", "upgrade", "accept-encoding"}


class _UpstreamError(Exception):
    """The server failed the call (not reachable, or it broke the answer off)."""


def _read(r: http.client.HTTPResponse) -> bytes:
    """What has arrived of the answer (chunked or not), b"" at its end."""
    try:
        return r.read1(65536)
    except (OSError, http.client.HTTPException) as e:
        raise _UpstreamError(f"{type(e).__name__}: {e}") from e


def evaluated_count(url: str, client: httpx.Client | None = None, errors: list[str] | None = None) -> float | None:
    """llama-server's counter of prompt tokens it evaluated (`/metrics`); None where it has
    none or did not answer (why goes to `errors`). llama-server answers /metrics from its main
    loop, between batches, so the wait may be long: 60 s."""
    try:
        r = (client or httpx).get(url.rstrip("/") + "/metrics", timeout=60)
        if r.status_code == 200:
            return parse_metrics(r.text).get(EVALUATED)
        why = f"HTTP {r.status_code}"
    except (httpx.HTTPError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
    (errors if errors is not None else []).append(why)
    return None


class RecordingProxy:
    """A pass-through proxy on 127.0.0.1 in front of a server, recording each call.

    Args:
        upstream: the server root, e.g. "http://127.0.0.1:8080" (loopback unless `allow_remote`).
        on_call: called with each finished call's `RequestTrace` (the lab writes it to its
            `RunWriter`); the bodies go to `bodies_dir` when given.
        bodies_dir: where each request body is saved as NNN.json (a results folder).
        read_metrics: read the upstream's /metrics around each generating call (the lab's
            llama-server), before it is forwarded: a round trip added to every TTFT, so off for
            a learner's session, where the server's per-request timings give the evaluated tokens.
        port: the port to listen on (0: any free one).
        allow_remote: forward to a server that is not on loopback (the learner's explicit
            choice; the bodies it sees then cross the network).
    """

    def __init__(self, upstream: str, on_call: Callable[[RequestTrace], Any] | None = None, *,
                 bodies_dir: str | Path | None = None, read_metrics: bool = True, port: int = 0,
                 allow_remote: bool = False):
        self.upstream = upstream.rstrip("/")
        host = httpx.URL(self.upstream).host
        if not (is_loopback(host) or allow_remote):
            raise ServerLayerError(f"the recording proxy fronts loopback servers only, not {host}",
                                   hint="pass allow_remote (the CLI's --allow-remote) to record a remote server")
        self.port, self._up = port, urlsplit(self.upstream)
        self.on_call, self.read_metrics = on_call, read_metrics
        self.bodies_dir = Path(bodies_dir) if bodies_dir else None
        self.tags: dict[str, Any] = {}       # added to every call from now on (the lab sets task, agent)
        self.rewrite: Callable[[bytes, dict], bytes] | None = None   # a lab's option: (body, tags) -> body; tags hold api
        self.traces: list[RequestTrace] = []
        self.metrics_errors: list[str] = []
        self._lock, self._n, self._in_flight, self._open = threading.Lock(), 0, 0, 0
        self._pool: list[tuple[http.client.HTTPConnection, float]] = []   # idle connections upstream
        self._records: queue.SimpleQueue = queue.SimpleQueue()   # finished calls, recorded on their own thread
        self._client = httpx.Client(timeout=httpx.Timeout(None, connect=10.0),   # the /metrics reads only
                                    limits=httpx.Limits(max_keepalive_connections=0))
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self._server.server_address[1]}"

    def start(self) -> "RecordingProxy":
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # TCP_NODELAY: each chunk leaves as it is written. With Nagle on, a chunk written
            # right after the headers (or another chunk) waits for the client's delayed ACK:
            # measured, 44 ms added to the first token of a fast server (ops.recorder_cost)
            disable_nagle_algorithm = True

            def log_message(self, *a: Any) -> None:   # nothing on the learner's cell
                pass

            def do_POST(self) -> None:
                proxy._relay(self)
            do_GET = do_HEAD = do_DELETE = do_PUT = do_POST

        self._server = ThreadingHTTPServer((HOST, self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True, name="agent-capture").start()
        threading.Thread(target=self._recorder, daemon=True, name="agent-capture-records").start()
        return self

    def stop(self, drain_s: float = 30.0) -> None:
        """Stop listening, then let the calls in flight finish and be recorded (at most
        `drain_s`) before the connections upstream close under them."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.settle(drain_s)
        self._records.put(None)
        with self._lock:
            pool, self._pool = self._pool, []
        for conn, _ in pool:
            conn.close()
        self._client.close()

    def __enter__(self) -> "RecordingProxy":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _evaluated(self) -> float | None:
        return evaluated_count(self.upstream, self._client, self.metrics_errors)

    def settle(self, timeout_s: float = 30.0) -> bool:
        """Wait until every call received so far is recorded (in `traces`, and given to
        `on_call`); False if some were still not after `timeout_s`."""
        t_end = time.monotonic() + timeout_s
        while self._open and time.monotonic() < t_end:
            time.sleep(0.005)
        return not self._open

    def _recorder(self) -> None:
        """The recording thread: a call's bookkeeping (its body to disk, its trace) happens
        here, after its answer went out, so the agent's next call on the same connection is
        read at once, not after it."""
        while (item := self._records.get()) is not None:
            try:
                self._record(*item)
            finally:
                with self._lock:
                    self._open -= 1

    def _relay(self, h: BaseHTTPRequestHandler) -> None:
        with self._lock:
            self._open += 1       # received, not yet recorded: `settle` and `stop` wait for these
        queued = False
        try:
            queued = self._relay_one(h)
        finally:
            if not queued:
                with self._lock:
                    self._open -= 1

    def _relay_one(self, h: BaseHTTPRequestHandler) -> bool:
        n = int(h.headers.get("content-length") or 0)
        body = h.rfile.read(n) if n else b""
        t0 = time.perf_counter()
        api = api_of(h.path)
        tags = {**self.tags, "api": api}   # the task the call came in under, and the API its path speaks
        generating = h.command == "POST" and api in GENERATING_APIS
        body = self.rewrite(body, tags) if generating and self.rewrite else body   # recorded as sent, tagged
        with self._lock:
            rid, self._n = self._n, self._n + 1
            self._in_flight += 1
            overlapped = self._in_flight > 1
        before = self._evaluated() if generating and self.read_metrics else None
        watch, status, err_body, cut, conn = SSEWatcher(api), None, b"", None, None
        headers = [(k, v) for k, v in h.headers.items() if k.lower() not in _HOP]
        try:
            conn, r = self._open_upstream(h.command, h.path, headers, body)
            status = r.status
            sse = "event-stream" in (r.getheader("content-type") or "")
            h.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in _HOP:
                    h.send_header(k, v)
            h.send_header("transfer-encoding", "chunked")
            h.end_headers()
            whole = b""
            while chunk := _read(r):   # to its end: only then may the connection carry another call
                t = time.perf_counter()
                h.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))   # on its way first, read after
                h.wfile.flush()
                if sse:
                    watch.feed(chunk, t)
                else:
                    whole += chunk
            r.close()                  # read whole (a sized body is not closed by its last read)
            # pooled before the client hears the end: its next call, sent at once, must not open a second
            conn = self._release(conn, not r.will_close)   # (llama-server's few HTTP threads drop it); None
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
            watch.close(time.perf_counter())
            if not sse:
                watch.whole_body(whole)
                err_body = whole if status >= 400 else b""
        except _UpstreamError as e:
            cut = f"upstream: {e}"
            if status is None:
                h.send_error(502, "upstream not reachable")
        except (BrokenPipeError, ConnectionResetError) as e:
            cut = f"client went away: {type(e).__name__}"   # the agent hung up (its own timeout)
        finally:
            if conn is not None:   # a call that did not reach its end: the connection is not reused
                conn.close()
        end = time.perf_counter()
        with self._lock:
            self._in_flight -= 1
            overlapped = overlapped or self._in_flight > 0
        after = self._evaluated() if generating and self.read_metrics else None
        self._records.put((rid, h.path, h.command, tags, body, api, t0, end, status, watch, err_body, cut, overlapped,
                           before, after))
        return True

    def _connection(self, fresh: bool = False) -> tuple[http.client.HTTPConnection, bool]:
        """A connection upstream and whether it was used before: the last one released, if it
        has been idle under `KEEP_IDLE_S` (and not `fresh`), else a new one. llama-server
        (cpp-httplib) closes a connection idle for 5 s; a request sent on one it has just closed is lost."""
        with self._lock:
            conn, idle = self._pool.pop() if self._pool and not fresh else (None, 0.0)
            stale, self._pool = (self._pool, []) if not fresh else ([], self._pool)
        for c, _ in stale:
            c.close()
        if conn is not None and time.monotonic() - idle < KEEP_IDLE_S:
            return conn, True
        if conn is not None:
            conn.close()
        u = self._up
        return (http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection)(
            u.hostname, u.port or (443 if u.scheme == "https" else 80), timeout=10), False

    def _release(self, conn: http.client.HTTPConnection, reusable: bool) -> None:
        if reusable:
            with self._lock:
                self._pool.append((conn, time.monotonic()))
        else:
            conn.close()

    def _open_upstream(self, method: str, path: str, headers: list, body: bytes):
        """Send the request upstream; (connection, response) once the status line is in.
        http.client on a kept-alive connection, not httpx on a new one: ~1 ms less per call,
        and every call's time through the recorder is added to what the agent sees
        (`ops.recorder_cost`). A kept connection the server closed meanwhile fails before the
        server read the request: that one failure is retried once on a new connection."""
        u = self._up
        for attempt in range(2):
            conn, reused = self._connection(fresh=attempt > 0)      # the retry: a new connection, never a kept one
            try:
                conn.putrequest(method, u.path.rstrip("/") + path, skip_host=True, skip_accept_encoding=True)
                conn.putheader("Host", u.netloc)
                for k, v in headers:
                    conn.putheader(k, v)
                if body or method in ("POST", "PUT"):
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body or None)
                conn.sock.settimeout(None)      # the first byte may follow a prefill of minutes
                return conn, conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                conn.close()
                if not reused:
                    raise _UpstreamError(f"{type(e).__name__}: {e}") from e
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                raise _UpstreamError(f"{type(e).__name__}: {e}") from e
        raise _UpstreamError("no connection upstream")

    def _record(self, rid, path, command, tags, body, api, t0, end, status, watch, err_body, cut, overlapped,
                before, after):
        if self.bodies_dir is not None and body:   # written after the call: a file write is no part of its TTFT
            self.bodies_dir.mkdir(parents=True, exist_ok=True)
            (self.bodies_dir / f"{rid:03d}.json").write_bytes(body)
        try:
            doc = json.loads(body) if body else {}
        except ValueError:
            doc = {}
        tok, tim = watch.tokens(), watch.timings
        metered = (after - before) if before is not None and after is not None else None
        error = watch.error or (error_text(json.loads(err_body)) if err_body.strip().startswith(b"{")
                                else err_body.decode("utf-8", "replace")[:500] or None) or cut
        ok = status is not None and status < 400 and not watch.error and not cut
        tags = {**tags, "path": path, "method": command, "api": api, "http_status": status,
                "model": doc.get("model") if isinstance(doc, dict) else None,
                "stream": bool(doc.get("stream")) if isinstance(doc, dict) else False,
                "max_tokens": next((doc[k] for k in ("max_tokens", "max_output_tokens", "max_completion_tokens")
                                    if doc.get(k)), None) if isinstance(doc, dict) else None,
                "body_bytes": len(body), "stop_reason": watch.stop_reason, "overlapped": overlapped,
                # its own count; the /metrics delta only for a cut call overlapping none (overlaps double-count)
                "evaluated_tokens": tim["prompt_n"] if tim.get("prompt_n") is not None else None if overlapped else metered,
                "server_prompt_n": tim.get("prompt_n"), "server_cache_n": tim.get("cache_n"),
                "prefill_ms": tim.get("prompt_ms"), "output_events": len(watch.event_t)}
        tr = RequestTrace(request_id=rid, scheduled_t=t0, sent_t=t0, chunk_t=list(watch.event_t),
                          chunk_tokens=[1] * len(watch.event_t), end_t=end,
                          prompt_tokens=tok["prompt_tokens"], completion_tokens=tok["output_tokens"],
                          cached_tokens=tok["cached_tokens"], token_source="server" if watch.usage else None,
                          finish_reason=watch.stop_reason, engine_timings=dict(tim), status="ok" if ok else "error",
                          error=None if ok else (error or f"HTTP {status}"), tags=tags)
        with self._lock:
            self.traces.append(tr)
        if self.on_call is not None:
            self.on_call(tr)
