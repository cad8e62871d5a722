"""Stand-ins for tests and probes, in one clearly named place.

`SSESource` is a real process serving a fake model: an OpenAI-style streaming server on
127.0.0.1 that answers instantly and on an exact clock. It is what the client-ceiling probe
(`roofline.chunks_per_second`) reads from, and what the load-generator tests aim at. It is
never a model: nothing here pretends to generate text.

`ScriptedSSE` replays a fixed list of SSE events, byte for byte (any API, any line
endings), for tests of what sits between a client and a server.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from infercourse.core.errors import ServerLayerError
from infercourse.servers import free_port

__all__ = ["SSESource", "ScriptedSSE", "process_gone", "port_closed"]

_SSE_SERVER = r"""
import asyncio, json, sys
import os
TTFT, GAP, PER, KEY = float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), os.environ.get("SSE_KEY", "")

def chunk(obj):
    data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
    return b"%X\r\n%s\r\n" % (len(data), data)

def token(finish, k, logprobs):
    choice = {"index": 0, "delta": {"content": "tok " * k}, "text": "tok " * k, "finish_reason": finish}
    if logprobs:
        choice["logprobs"] = {"content": [{"token": "tok", "logprob": 0.0}] * k}
    return chunk({"choices": [choice]})

# serialised once: the source must be cheap. [logprobs][last]
TOKEN = {lp: (token(None, PER, lp), token("length", PER, lp)) for lp in (False, True)}

def reply(writer, status, obj):
    out = json.dumps(obj).encode()
    writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (status, len(out), out))

async def handle(reader, writer):
    try:
        while True:                                  # HTTP/1.1 keep-alive
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            length = next((int(h.split(":")[1]) for h in head if h.lower().startswith("content-length")), 0)
            body = json.loads(await reader.readexactly(length)) if length else {}
            auth = next((h.split(":", 1)[1].strip() for h in head if h.lower().startswith("authorization")), "")
            if KEY and auth != "Bearer " + KEY:
                reply(writer, 401, {"error": {"message": "Invalid API Key", "code": 401}})
            elif head[0].startswith("GET"):
                reply(writer, 200, {"data": [{"id": "sse-source"}]})
            elif head[0].startswith("POST /tokenize"):   # a toy count: BOS + one per word
                reply(writer, 200, {"tokens": list(range(1 + len(body.get("content", "").split())))})
            else:
                await stream(writer, int(body.get("max_tokens", 16)), bool(body.get("logprobs")))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()

async def stream(writer, n, logprobs):
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    await asyncio.sleep(TTFT)
    n_chunks = -(-n // PER)
    for i in range(n_chunks):
        writer.write(TOKEN[logprobs][i == n_chunks - 1])
        if GAP:
            await asyncio.sleep(GAP)
        if GAP or i % 64 == 63:
            await writer.drain()
    writer.write(chunk({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n_chunks * PER}}))
    writer.write(chunk(b"[DONE]") + b"0\r\n\r\n")

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]), backlog=1024)
    print("ready", flush=True)
    await server.serve_forever()

asyncio.run(main())
"""


class SSESource:
    """A stand-in OpenAI-style streaming server (a subprocess on 127.0.0.1): it answers
    every completion POST with `max_tokens` tokens in chunks of `tokens_per_chunk`, `ttft_s`
    after the request and `gap_s` apart (logprobs only when asked), then a usage block.
    Hand-written (~50 lines) because it must be faster than any real server, to probe the
    client alone, and exactly timed, to test load patterns. `POST /tokenize` answers a toy
    count (BOS + one per whitespace word), not a model's, so tests can check *which*
    tokenizer a client used.

    Args:
        ttft_s: delay before the first chunk.
        gap_s: delay between chunks (0: as fast as the socket takes them).
        tokens_per_chunk: tokens in each chunk (more than 1: a server that batches SSE).
        api_key: if given, every request without `Authorization: Bearer <key>` gets a 401.
    """

    def __init__(self, ttft_s: float = 0.0, gap_s: float = 0.0, tokens_per_chunk: int = 1,
                 api_key: str | None = None):
        self.port, self.ttft_s, self.gap_s = free_port(), ttft_s, gap_s
        self.tokens_per_chunk, self._key = tokens_per_chunk, api_key or ""
        self.url, self.proc = f"http://127.0.0.1:{self.port}", None

    def __enter__(self) -> "SSESource":
        self.proc = subprocess.Popen([sys.executable, "-c", _SSE_SERVER, str(self.port), str(self.ttft_s),
                                      str(self.gap_s), str(self.tokens_per_chunk)], stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "SSE_KEY": self._key})
        if self.proc.stdout.readline().strip() != "ready":
            self.stop()
            raise ServerLayerError("the SSE source did not start")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def process_gone(pid: int, within_s: float) -> bool:
    """True once `pid` has exited (or is a zombie awaiting its parent), polling for at most
    `within_s` seconds: a deadline for "did it die at all", not a speed bound."""
    import time

    import psutil
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def port_closed(port: int) -> bool:
    """True when nothing accepts connections on 127.0.0.1:`port`."""
    import socket
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


class ScriptedSSE:
    """A stand-in streaming server (a thread on 127.0.0.1) that replays the same SSE events,
    byte for byte, to every POST, one event per HTTP chunk, `gap_s` apart; `GET` lists one
    model ("scripted"). The events are raw bytes so a test picks the framing: OpenAI
    `data:` events, Anthropic `event:` + `data:` events, LF or CRLF line endings.

    Args:
        events: each event as sent, blank line included (e.g. b"data: {...}\\r\\n\\r\\n").
        gap_s: pause after each event, so a reader downstream gets them one at a time.
    """

    def __init__(self, events: list[bytes], gap_s: float = 0.01):
        self.events, self.gap_s = list(events), gap_s
        self.posts = 0
        self._server: Any = None

    def __enter__(self) -> "ScriptedSSE":
        import threading
        import time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                body = b'{"data": [{"id": "scripted"}]}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                owner.posts += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for ev in owner.events:
                        self.wfile.write(b"%X\r\n%s\r\n" % (len(ev), ev))
                        self.wfile.flush()
                        time.sleep(owner.gap_s)
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass   # the client (or a fault proxy) hung up mid-stream

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True, name="scripted-sse").start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
