"""OpenAIHTTPEngine: stream parsing and error paths against a scripted stand-in server,
then the real thing against llama.cpp's llama-server on the embedded model.

The stand-in (`_StandIn`, below) is NOT an inference server: it replays fixed SSE bytes
shaped like llama-server's /v1/chat/completions stream (chunks with `logprobs.content`,
a last `usage` chunk with `prompt_tokens_details.cached_tokens`, a `timings` object,
then `data: [DONE]`), or breaks that stream on purpose.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infercourse.core.types import Request, generate
from infercourse.engines.openai_http import OpenAIHTTPEngine
from infercourse.core.errors import APILayerError, BackendMissingError, ContextLayerError

LLAMA_TIMINGS = {"cache_n": 3, "prompt_n": 9, "prompt_ms": 12.5, "predicted_n": 3,
                 "predicted_ms": 30.0, "predicted_per_second": 100.0}


def _chunk(content=None, logprobs=None, finish=None, **extra):
    choice = {"index": 0, "delta": {} if content is None else {"content": content},
              "finish_reason": finish}
    if logprobs is not None:
        choice["logprobs"] = {"content": [{"token": t, "logprob": -0.1} for t in logprobs]}
    return {"id": "chatcmpl-1", "model": "stand-in", "object": "chat.completion.chunk",
            "choices": [choice], **extra}


GOOD = [
    _chunk(), _chunk("Hel", ["Hel"]), _chunk("lo wor", ["lo", " wor"]), _chunk("ld", ["ld"]),
    _chunk(finish="length"),
    {"id": "chatcmpl-1", "model": "stand-in", "choices": [], "timings": LLAMA_TIMINGS,
     "usage": {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16,
               "prompt_tokens_details": {"cached_tokens": 3}}},
]
NO_USAGE = [_chunk("a"), _chunk("bc"), _chunk(""), _chunk("d", finish="stop")]  # no logprobs


def _usage(n):
    return {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}}


# no logprobs: one delta per token, and the EOS counted in usage but never streamed
DELTAS_EOS = [_chunk(), _chunk("a"), _chunk("b"), _chunk("c", finish="stop"), _usage(4)]
# no logprobs: a server that packs 3 tokens into each of 2 chunks
DELTAS_PACKED = [_chunk("abc"), _chunk("def", finish="length"), _usage(6)]


def _sse(objs, done=True) -> bytes:
    body = "".join(f"data: {json.dumps(o)}\n\n" for o in objs)
    return (body + ("data: [DONE]\n\n" if done else "")).encode()


class _StandIn(BaseHTTPRequestHandler):
    """Scripted replies; the first path segment picks the script."""

    protocol_version = "HTTP/1.1"
    bodies: list[dict] = []

    def log_message(self, *a):
        pass

    def _send(self, status, body: bytes, ctype="text/event-stream", length=None):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(length if length is not None else len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def do_GET(self):
        self._send(200, json.dumps({"data": [{"id": "stand-in"}]}).encode(), "application/json")

    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0))
        _StandIn.bodies.append(json.loads(self.rfile.read(n)))
        mode = self.path.split("/")[1]
        if mode == "good":
            self._send(200, _sse(GOOD))
        elif mode == "nousage":
            self._send(200, _sse(NO_USAGE))
        elif mode == "deltaseos":
            self._send(200, _sse(DELTAS_EOS))
        elif mode == "deltaspacked":
            self._send(200, _sse(DELTAS_PACKED))
        elif mode == "http500":
            self._send(500, b'{"error": {"code": 500, "message": "boom: out of memory"}}',
                       "application/json")
        elif mode == "ctx":  # llama-server's reply when a prompt does not fit a slot
            self._send(400, json.dumps({"error": {
                "code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 5000,
                "n_ctx": 1024, "message": "request (5000 tokens) exceeds the available context "
                "size (1024 tokens), try increasing it"}}).encode(), "application/json")
        elif mode == "badjson":
            self._send(200, _sse(GOOD[1:3], done=False) + b"data: {not json\n\ndata: [DONE]\n\n")
        elif mode == "nodone":
            self._send(200, _sse(GOOD[1:3], done=False))
        elif mode == "miderror":
            self._send(200, _sse(GOOD[1:2], done=False)
                       + b'data: {"error": {"message": "slot crashed"}}\n\n')
        elif mode == "cut":  # promise 100 kB, send two chunks, hang up
            self._send(200, _sse(GOOD[1:3], done=False), length=100_000)
            self.close_connection = True
        elif mode == "html":
            self._send(200, b"<html>not an API</html>", "text/html")


@pytest.fixture(scope="module")
def standin():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_parses_llama_server_shaped_stream(standin):
    eng = OpenAIHTTPEngine(standin + "/good")
    events = list(eng.stream("hi", max_tokens=4, seed=7))
    chunks, last = events[:-1], events[-1]
    assert [e.text for e in chunks] == ["Hel", "lo wor", "ld"]          # role chunk dropped
    assert [e.n_tokens for e in chunks] == [1, 2, 1]                    # from logprobs, not deltas
    assert last.done and last.finish_reason == "length"
    assert last.usage.source == "server" and last.usage.completion_tokens == 4
    assert last.usage.prompt_tokens == 12 and last.usage.cached_tokens == 3
    assert {k: last.timings[k] for k in LLAMA_TIMINGS} == LLAMA_TIMINGS  # verbatim
    assert last.timings["chunk_tokens_from"] == "logprobs" and last.n_tokens == 0
    body = _StandIn.bodies[-1]
    assert body["model"] == "stand-in"                                  # asked /v1/models
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["seed"] == 7 and body["max_tokens"] == 4 and "logprobs" not in body   # off by default
    assert "ignore_eos" not in body
    list(OpenAIHTTPEngine(standin + "/good", logprobs=True).stream("hi"))
    assert _StandIn.bodies[-1]["logprobs"] is True                          # still available


def test_one_delta_per_token_is_checked_against_usage(standin):
    from infercourse.engines.openai_stream import CHUNKS_NOT_TOKENS
    *chunks, last = OpenAIHTTPEngine(standin + "/deltaseos", model="m").stream("hi")
    assert [e.n_tokens for e in chunks] == [1, 1, 1] and last.n_tokens == 1   # the unstreamed EOS
    assert last.usage.source == "server" and last.timings["chunks_are_tokens"] is True
    *chunks, last = OpenAIHTTPEngine(standin + "/deltaspacked", model="m").stream("hi")
    assert len(chunks) == 2 and last.usage.completion_tokens == 6
    assert last.usage.source == CHUNKS_NOT_TOKENS and last.timings["chunks_are_tokens"] is False
    assert last.n_tokens == 0                                # no invented tokens on the done event


def test_chunk_count_check_on_a_real_socket():
    """SSESource packs 3 tokens a chunk: a delta count is not a token count, and says so;
    with logprobs the per-chunk counts are exact."""
    from infercourse.core.trace import record
    from infercourse.engines.openai_stream import CHUNKS_NOT_TOKENS
    from infercourse.testing import SSESource
    req = Request(prompt="x", max_tokens=12)
    with SSESource(tokens_per_chunk=3) as src:
        plain = record(OpenAIHTTPEngine(src.url, model="m", api="completions"), req)
        exact = record(OpenAIHTTPEngine(src.url, model="m", api="completions", logprobs=True), req)
    assert plain.token_source == CHUNKS_NOT_TOKENS and plain.chunk_tokens == [1] * 4
    assert plain.completion_tokens == 12                     # the server's count still rules
    assert exact.token_source == "server" and exact.chunk_tokens == [3] * 4


def test_without_usage_counts_deltas_on_client(standin):
    c = generate(OpenAIHTTPEngine(standin + "/nousage", model="m"), "hi")
    assert c.text == "abcd" and c.n_tokens == 3                         # empty delta: 0 tokens
    assert c.usage.source == "client" and c.usage.completion_tokens == 3
    assert c.usage.prompt_tokens is None and c.timings["chunk_tokens_from"] == "deltas"


def test_request_body_options(standin):
    eng = OpenAIHTTPEngine(standin + "/good/v1", model="m", api="completions", logprobs=True,
                           extra_body={"cache_prompt": None, "top_k": 1})
    list(eng.stream(Request(prompt="x", ignore_eos=True, max_tokens=9)))
    body = _StandIn.bodies[-1]
    assert body["prompt"] == "x" and body["logprobs"] == 1
    assert body["ignore_eos"] is True and body["min_tokens"] == 9
    assert "cache_prompt" not in body and body["top_k"] == 1
    with pytest.raises(APILayerError, match="raw prompt"):
        eng.body(Request(messages=[{"role": "user", "content": "x"}]))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_port_names_the_address():
    port = _closed_port()
    eng = OpenAIHTTPEngine(f"http://127.0.0.1:{port}", model="m")
    with pytest.raises(APILayerError, match=f"127.0.0.1:{port} not reachable"):
        list(eng.stream("hi"))

    async def go():
        return [e async for e in eng.astream("hi")]
    with pytest.raises(APILayerError, match=f"127.0.0.1:{port} not reachable"):
        asyncio.run(go())


@pytest.mark.parametrize("mode, match, n_partial", [
    ("http500", "HTTP 500: boom: out of memory", 0),
    ("badjson", "malformed stream chunk", 2),
    ("nodone", r"without data: \[DONE\]", 2),
    ("cut", "cut mid-way", 2),
    ("miderror", "slot crashed", 1),
    ("html", "not answer with an SSE stream", 0),
])
def test_broken_streams_keep_partial_events(standin, mode, match, n_partial):
    eng = OpenAIHTTPEngine(standin + "/" + mode, model="m", timeout=10)
    with pytest.raises(APILayerError, match=match) as err:
        list(eng.stream("hi"))
    assert [e.text for e in err.value.partial or []] == ["Hel", "lo wor"][:n_partial]

    async def go():
        return [e async for e in eng.astream("hi")]
    with pytest.raises(APILayerError, match=match) as err:
        asyncio.run(go())
    assert len(err.value.partial or []) == n_partial


def test_context_overflow_reply_is_a_context_error(standin):
    with pytest.raises(ContextLayerError, match="exceeds the available context"):
        list(OpenAIHTTPEngine(standin + "/ctx", model="m").stream("hi"))


# ---- the real server: llama-server on the embedded model --------------------------------

@pytest.fixture(scope="module")
def llama():
    from infercourse.servers import LlamaServer
    try:
        # one thread: on a shared 2-core box, two spin-waiting threads stall each other
        srv = LlamaServer(n_parallel=4, ctx_size=4096, threads=1)
    except BackendMissingError as exc:
        pytest.skip(f"llama-server not installed: {exc}")
    with srv:
        yield srv


def _predicted_total(url) -> float:
    """llama-server's /metrics counter of generated tokens (started with --metrics)."""
    import httpx
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("llamacpp:tokens_predicted_total")))


@pytest.mark.slow
def test_llama_server_greedy_stream(llama):
    eng = OpenAIHTTPEngine(llama.url)
    before = _predicted_total(llama.url)
    t0 = time.perf_counter()
    events = list(eng.stream("Name three colors.", max_tokens=48))
    chunks, last = events[:-1], events[-1]
    ts = [t0] + [e.t for e in events]
    assert all(a <= b for a, b in zip(ts, ts[1:]))                     # monotonic arrival
    assert last.usage.source == "server" and last.usage.prompt_tokens > 0
    # Independent of the usage block: llama-server's Prometheus counter of tokens predicted
    # moved by exactly what we counted as streamed chunks, plus the EOS it never streams.
    predicted = _predicted_total(llama.url) - before
    assert len(chunks) + (1 if last.finish_reason == "stop" else 0) == predicted
    assert last.usage.completion_tokens == predicted and last.timings["chunks_are_tokens"] is True
    assert last.timings["predicted_n"] == last.usage.completion_tokens  # llama-server timings
    c = generate(eng, "Name three colors.", max_tokens=48)              # greedy: same again
    assert c.text == "".join(e.text for e in chunks) and c.text.strip()
    print(f"\nllama-server decode: {last.timings['predicted_per_second']:.1f} tok/s (server timings)")


@pytest.mark.slow
def test_llama_server_ignore_eos_gives_exact_length(llama):
    for api, req in (("chat", Request(messages=[{"role": "user", "content": "Hi"}])),
                     ("completions", Request(prompt="Hi"))):
        c = generate(OpenAIHTTPEngine(llama.url, api=api), req, max_tokens=40, ignore_eos=True)
        assert c.usage.completion_tokens == 40 and c.n_tokens == 40, api
        assert c.finish_reason == "length"


@pytest.mark.slow
def test_llama_server_reuses_a_shared_prefix(llama):
    eng = OpenAIHTTPEngine(llama.url)
    prefix = "You are a careful assistant. " + " ".join(f"Fact {i}: the sky is blue." for i in range(40))
    first = generate(eng, [{"role": "system", "content": prefix},
                           {"role": "user", "content": "What color is grass?"}], max_tokens=8)
    second = generate(eng, [{"role": "system", "content": prefix},
                            {"role": "user", "content": "What color is snow?"}], max_tokens=8)
    assert first.usage.prompt_tokens > 300
    assert second.usage.cached_tokens > 300                            # the prefix was not recomputed
    assert second.timings["cache_n"] == second.usage.cached_tokens


@pytest.mark.slow
def test_llama_server_four_concurrent_requests_overlap(llama):
    eng = OpenAIHTTPEngine(llama.url)

    async def run(n):
        async with eng.async_client(n) as client:
            async def one(i):
                return [e async for e in eng.astream(f"Count to ten, run {i}.", client=client,
                                                     max_tokens=48, ignore_eos=True)]
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(i) for i in range(n)))
            return time.perf_counter() - t0, results

    wall1, _ = asyncio.run(run(1))
    wall4, results = asyncio.run(run(4))
    assert all(r[-1].usage.completion_tokens == 48 for r in results)
    first_token = [r[0].t for r in results]
    last_token = [r[-2].t for r in results]
    assert max(first_token) < min(last_token)                           # all four in flight together
    print(f"\n4 concurrent x 48 tokens: {wall4:.2f}s vs one: {wall1:.2f}s "
          f"(aggregate {4 * 48 / wall4:.0f} vs {48 / wall1:.0f} tok/s)")


@pytest.mark.slow
def test_llama_server_prompt_longer_than_context(llama):
    eng = OpenAIHTTPEngine(llama.url)   # 4096 over 4 slots: 1024 tokens each
    with pytest.raises(ContextLayerError, match="context"):
        list(eng.stream("word " * 3000, max_tokens=8))


@pytest.mark.slow
def test_llama_server_describe(llama):
    info = OpenAIHTTPEngine(llama.url).describe()
    assert info["served_models"] and info["props"]["total_slots"] == 4
    assert info["props"]["model_path"].endswith(".gguf")


def test_streamed_tool_calls_are_joined_and_parsed():
    """OpenAI `tool_calls` deltas (name first, arguments in pieces) become one parsed call;
    each piece counts as a token, and a call written as text is flagged instead."""
    from infercourse.engines.openai_stream import Parser
    p = Parser("chat", "h:1", tool_names=["read_file"])
    pieces = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": ""}},
              {"index": 0, "function": {"arguments": '{"path": '}}, {"index": 0, "function": {"arguments": '"a.py"}'}}]
    for i, piece in enumerate(pieces):
        chunk = {"choices": [{"index": 0, "delta": {"tool_calls": [piece]}}]}
        assert p.feed(json.dumps(chunk), i).n_tokens == 1
    p.feed(json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
                       "usage": {"prompt_tokens": 20, "completion_tokens": 3}}), 9)
    p.feed("[DONE]", 10)
    final = p.final(11)
    assert final.timings["tool_calls"] == [{"id": "call_1", "name": "read_file", "input": {"path": "a.py"},
                                            "arguments": '{"path": "a.py"}', "error": None}]
    assert final.finish_reason == "tool_calls" and final.usage.source == "server"
    q = Parser("chat", "h:1", tool_names=["read_file"])
    q.feed(json.dumps({"choices": [{"index": 0, "delta": {"content": '{"name": "read_file", "arguments": {}}'},
                                    "finish_reason": "stop"}]}), 0)
    q.feed("[DONE]", 1)
    assert q.final(2).timings["tool_call_as_text"] == '{"name":'
