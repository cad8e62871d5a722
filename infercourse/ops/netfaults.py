"""Network faults between client and server: a small fault-injecting reverse proxy.

Between an agent and its model server there is a wire, and sometimes a proxy, a tunnel or
a load balancer. Faults there look like model or server faults to the user ("it hangs",
"the answer stops halfway") while the server is perfectly healthy. `FaultProxy` sits on
127.0.0.1 in front of a local server and breaks the wire in one named way:

| fault             | what the proxy does                                   | what a client sees          |
|-------------------|-------------------------------------------------------|-----------------------------|
| `latency`         | delivers every chunk `delay_s` late (a longer wire)    | TTFT up, token gaps unchanged |
| `slow_first_byte` | holds the response back `delay_s` past its first byte | TTFT up by `delay_s`, then normal speed |
| `reset`           | TCP RST after `after_events` SSE events               | "connection reset" mid-answer |
| `cut`             | ends the stream cleanly after `after_events` events   | an answer with no end event |
| `5xx`             | answers 502 Bad Gateway, like nginx with no upstream  | HTTP 502 on every call      |

It acts on the SSE stream event by event. An SSE event is a group of lines ended by a blank
line, and the SSE spec lets a line end in LF, CRLF or CR: the upstream body is split
at whichever blank line comes, and every event that carries a `data:` line counts, whether
it opens with `data:` (OpenAI APIs) or with an `event:` line naming it (Anthropic Messages:
`event: content_block_delta` then `data: {...}`). Comment lines (`: keep-alive`) carry no
data and do not count. So "after 3 events" means 3 events' worth of answer on either API;
on the Anthropic API the first events are `message_start` and `content_block_start`. A cut
stream lacks its end event: `data: [DONE]` (OpenAI) or `message_stop` (Anthropic).
Faults stop after `max_s` (the proxy then passes traffic through), and the proxy itself
stops on `with` exit and at interpreter exit.

Why not mitmproxy (evaluated first, as a well-kept intercepting proxy): its reverse mode
and `flow.response.stream` callables can rewrite an SSE stream chunk by chunk, but (1)
mitmproxy >= 11.1 needs Python >= 3.12 and this course supports 3.10; (2) 11.0.2, the last
for 3.11, pins `h11<=0.14` while httpx's httpcore needs h11 >= 0.16, and pulls 37 packages
(Flask, tornado, cryptography, aioquic, urwid...) into the course environment; (3) the
stream callable is synchronous, so a per-chunk delay would block every other flow, and no
addon hook sends a TCP RST mid-body. This proxy is ~150 lines on asyncio and `h11` (the
HTTP/1.1 state machine httpx itself uses), and does exactly these five faults.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import re
import socket
import struct
import threading
import time
from typing import Any

import h11

from infercourse.core.errors import ServerLayerError
from infercourse.servers.process import HOST, free_port

__all__ = ["SYMPTOMS", "FaultProxy", "client_engine", "split_events", "carries_data"]

SYMPTOMS = {  # name -> (what the user sees, what is done)
    "latency": ("everything arrives late: TTFT up by a constant", "+delay on every chunk"),
    "slow_first_byte": ("long wait before anything, then normal speed", "response head held back"),
    "reset": ("the answer stops mid-stream: connection reset", "TCP RST after a few events"),
    "cut": ("the answer ends early, with no end event ([DONE], message_stop)",
            "stream closed cleanly after a few events"),
    "5xx": ("every call fails with HTTP 502", "502 Bad Gateway instead of forwarding"),
}
DEFAULT_DELAY_S = {"latency": 1.5, "slow_first_byte": 2.0}
_NOTHING = object()   # "no first chunk taken yet" (None is the end of the body)
_LIVE: set["FaultProxy"] = set()
# the blank line that ends an SSE event, in each line-ending style the spec allows (CRLF
# first: its "\r\n\r\n" must not be read as a lone "\r" line end)
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_DATA_LINE = re.compile(rb"(?:^|[\r\n])data:")


def client_engine(url: str, timeout_s: float = 10.0, model: str | None = None, api: str = "openai"):
    """An HTTP engine for a client of the proxy (short read timeout).

    Args:
        model: the served name, which spares the `/v1/models` lookup (a delay fault slows it too).
        api: "openai" (chat completions) or "anthropic" (Messages, the coding agents' route).
    """
    if api == "anthropic":
        from infercourse.engines.anthropic_http import AnthropicHTTPEngine
        return AnthropicHTTPEngine(url, model=model, timeout=timeout_s)
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    return OpenAIHTTPEngine(url, model=model, timeout=timeout_s)


def split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """(whole SSE events, each with its blank line, and the unfinished rest) of `buf`."""
    events = []
    while (m := _EVENT_END.search(buf)) is not None:
        events.append(buf[:m.end()])
        buf = buf[m.end():]
    return events, buf


def carries_data(event: bytes) -> bool:
    """Whether an SSE event has a `data:` line (at its start, or after `event:`/`id:` lines)."""
    return _DATA_LINE.search(event) is not None


async def _next(reader: asyncio.StreamReader, conn: h11.Connection):
    """The next h11 event, reading more bytes as needed (b"" at EOF)."""
    while True:
        ev = conn.next_event()
        if ev is not h11.NEED_DATA:
            return ev
        conn.receive_data(await reader.read(65536))


class FaultProxy:
    """A reverse proxy on 127.0.0.1 that breaks the wire in one named way.

    Args:
        upstream: the server root, e.g. "http://127.0.0.1:8080" (loopback only).
        fault: one of `SYMPTOMS`, or None to pass everything through.
        delay_s: the delay of `latency` and `slow_first_byte` (defaults 1.5 s, 2 s).
        after_events: SSE events delivered before `reset` or `cut` strikes.
        max_s: the fault lasts this long, then the proxy passes traffic through.
    """

    def __init__(self, upstream: str, fault: str | None, *, delay_s: float | None = None,
                 after_events: int = 3, max_s: float = 60.0):
        if fault is not None and fault not in SYMPTOMS:
            raise ValueError(f"unknown network fault {fault!r}; choose one of {sorted(SYMPTOMS)}")
        host_port = upstream.split("://", 1)[-1].rstrip("/").removesuffix("/v1")
        self.up_host, _, port = host_port.partition(":")
        if self.up_host not in ("127.0.0.1", "localhost", "::1"):
            raise ServerLayerError(f"the fault proxy only fronts loopback servers, not {self.up_host}")
        self.up_port = int(port or 80)
        self.fault, self.after_events, self.max_s = fault, after_events, max_s
        self.delay_s = delay_s if delay_s is not None else DEFAULT_DELAY_S.get(fault or "", 0.0)
        self.port = free_port()
        self.counts = {"requests": 0, "faulted": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._until = 0.0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def active(self) -> bool:
        return self.fault is not None and time.monotonic() < self._until

    def describe(self) -> dict[str, Any]:
        return {"fault": self.fault, "url": self.url, "upstream": f"http://{self.up_host}:{self.up_port}",
                "delay_s": self.delay_s, "after_events": self.after_events, "max_s": self.max_s, **self.counts}

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> "FaultProxy":
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, HOST, self.port))
            ready.set()
            try:
                self._loop.run_forever()
            finally:
                self._loop.close()

        self._until = time.monotonic() + self.max_s
        self._thread = threading.Thread(target=run, daemon=True, name=f"fault-proxy-{self.port}")
        self._thread.start()
        if not ready.wait(10):
            raise ServerLayerError(f"fault proxy did not start on {self.url}")
        _LIVE.add(self)
        return self

    async def _shutdown(self) -> None:
        """Stop accepting, then cancel and await every connection still being served."""
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        if self._loop is not None and self._loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        _LIVE.discard(self)

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- one client connection: one request, then close -----------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        down = h11.Connection(h11.SERVER)
        try:
            req, body = await _next(reader, down), b""
            if not isinstance(req, h11.Request):
                return
            while not isinstance(ev := await _next(reader, down), h11.EndOfMessage):
                body += ev.data if isinstance(ev, h11.Data) else b""
            self.counts["requests"] += 1
            active = self.active
            if active and self.fault == "5xx":
                self.counts["faulted"] += 1
                page = b"<html><body><h1>502 Bad Gateway</h1></body></html>"
                writer.write(down.send(h11.Response(status_code=502, headers=[
                    ("content-type", "text/html"), ("content-length", str(len(page))), ("connection", "close")])))
                writer.write(down.send(h11.Data(data=page)) + down.send(h11.EndOfMessage()))
                await writer.drain()
                return
            await self._forward(req, body, down, writer, active)
        except (ConnectionError, h11.ProtocolError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass   # a client or upstream that went away, or the proxy stopping: nothing to answer
        finally:
            writer.close()

    async def _forward(self, req: h11.Request, body: bytes, down: h11.Connection,
                       writer: asyncio.StreamWriter, active: bool) -> None:
        ur, uw = await asyncio.open_connection(self.up_host, self.up_port)
        up = h11.Connection(h11.CLIENT)
        headers = [(k, v) for k, v in req.headers if k not in (b"host", b"connection")]
        headers += [(b"host", f"{self.up_host}:{self.up_port}".encode()), (b"connection", b"close")]
        uw.write(up.send(h11.Request(method=req.method, target=req.target, headers=headers)))
        uw.write(up.send(h11.Data(data=body)) + up.send(h11.EndOfMessage()))
        await uw.drain()
        resp = await _next(ur, up)
        sse = any(k == b"content-type" and b"event-stream" in v for k, v in resp.headers)
        queue: asyncio.Queue = asyncio.Queue()   # read on while the head is held back
        reading = asyncio.ensure_future(self._read_body(ur, up, sse, queue))
        try:
            # slow_first_byte waits for the first body bytes, then delay_s more: the delay adds to
            # the upstream's own time to first byte. (Holding back only the head, which a streaming
            # server sends at once, hid the delay inside a slow prefill: the capstone's fault of
            # one baseline E2E moved its route's E2E by 9%.)
            first = await queue.get() if active and self.fault == "slow_first_byte" else _NOTHING
            if active and self.fault in ("slow_first_byte", "latency"):
                self.counts["faulted"] += 1
                await asyncio.sleep(self.delay_s)
            keep = [(k, v) for k, v in resp.headers if k not in (b"transfer-encoding", b"content-length", b"connection")]
            writer.write(down.send(h11.Response(status_code=resp.status_code,
                                                headers=keep + [(b"connection", b"close")])))
            n_events = 0
            item = first if first is not _NOTHING else await queue.get()
            while item is not None:
                t, data = item
                if active and self.fault == "latency":   # each chunk delay_s after it came in
                    await asyncio.sleep(max(0.0, t + self.delay_s - time.monotonic()))
                if sse and carries_data(data):
                    n_events += 1
                if active and sse and self.fault in ("reset", "cut") and n_events > self.after_events:
                    self.counts["faulted"] += 1
                    if self.fault == "reset":   # linger 0: close() sends RST, not FIN
                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        writer.transport.abort()
                        return
                    break
                writer.write(down.send(h11.Data(data=data)))
                await writer.drain()
                item = await queue.get()
            writer.write(down.send(h11.EndOfMessage()))
            await writer.drain()
        finally:
            reading.cancel()
            uw.close()

    @staticmethod
    async def _read_body(ur: asyncio.StreamReader, up: h11.Connection, sse: bool, queue: asyncio.Queue) -> None:
        """Upstream body -> queue of (arrival time, bytes): whole SSE events when `sse`."""
        buf = b""
        try:
            while isinstance(ev := await _next(ur, up), h11.Data):
                if not sse:
                    await queue.put((time.monotonic(), bytes(ev.data)))
                    continue
                events, buf = split_events(buf + ev.data)
                for event in events:
                    await queue.put((time.monotonic(), event))
            if buf:
                await queue.put((time.monotonic(), buf))
        finally:
            await queue.put(None)


@atexit.register
def _stop_all() -> None:
    for proxy in list(_LIVE):
        proxy.stop()
