"""Stand-ins for tests and probes, in one clearly named place.

`SSESource` is a real process serving a fake model: an OpenAI-style streaming server on
127.0.0.1 that answers instantly and on an exact clock. It is what the client-ceiling probe
(`roofline.chunks_per_second`) reads from, and what the load-generator tests aim at. It is
never a model: nothing here pretends to generate text.
"""
from __future__ import annotations

import subprocess
import sys
from typing import Any

from infercourse.core.errors import ServerLayerError
from infercourse.servers import free_port

__all__ = ["SSESource"]

_SSE_SERVER = r"""
import asyncio, json, sys
TTFT, GAP = float(sys.argv[2]), float(sys.argv[3])

def chunk(obj):
    data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
    return b"%X\r\n%s\r\n" % (len(data), data)

def token(finish):
    return chunk({"choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": finish,
                               "logprobs": {"content": [{"token": "tok", "logprob": 0.0}]}}]})

TOKEN, LAST = token(None), token("length")   # serialised once: the source must be cheap

async def handle(reader, writer):
    try:
        while True:                                  # HTTP/1.1 keep-alive
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            length = next((int(h.split(":")[1]) for h in head if h.lower().startswith("content-length")), 0)
            body = json.loads(await reader.readexactly(length)) if length else {}
            if head[0].startswith("GET"):
                out = json.dumps({"data": [{"id": "sse-source"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(out), out))
                continue
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            n = int(body.get("max_tokens", 16))
            await asyncio.sleep(TTFT)
            for i in range(n):
                writer.write(LAST if i == n - 1 else TOKEN)
                if GAP:
                    await asyncio.sleep(GAP)
                if GAP or i % 64 == 63:
                    await writer.drain()
            writer.write(chunk({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n}}))
            writer.write(chunk(b"[DONE]") + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    print("ready", flush=True)
    await server.serve_forever()

asyncio.run(main())
"""


class SSESource:
    """A stand-in OpenAI-style streaming server (a subprocess on 127.0.0.1): it answers
    every POST with `max_tokens` one-token chunks, `ttft_s` after the request and
    `gap_s` apart. Hand-written (~40 lines) because it must be faster than any real
    server, to probe the client alone, and exactly timed, to test load patterns.

    Args:
        ttft_s: delay before the first chunk.
        gap_s: delay between chunks (0: as fast as the socket takes them).
    """

    def __init__(self, ttft_s: float = 0.0, gap_s: float = 0.0):
        self.port, self.ttft_s, self.gap_s = free_port(), ttft_s, gap_s
        self.url, self.proc = f"http://127.0.0.1:{self.port}", None

    def __enter__(self) -> "SSESource":
        self.proc = subprocess.Popen([sys.executable, "-c", _SSE_SERVER, str(self.port), str(self.ttft_s),
                                      str(self.gap_s)], stdout=subprocess.PIPE, text=True)
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
