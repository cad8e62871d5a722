"""Network faults between client and server: the fault proxy on a stand-in SSE source
(fast, exact), then in front of a real llama-server, where the doctor must name the API
layer while the server behind it stays healthy."""
from __future__ import annotations

import json
import socket
import time

import pytest

from infercourse.core.errors import APILayerError, ServerLayerError
from infercourse.ops.netfaults import SYMPTOMS, FaultProxy, carries_data, client_engine, split_events
from infercourse.testing import ScriptedSSE, SSESource


@pytest.fixture(scope="module")
def source():
    with SSESource(ttft_s=0.0, gap_s=0.01) as src:
        yield src


def _stream(url, max_tokens=12, model=None):
    """model: the served name, so no /v1/models lookup (itself delayed by a delay fault) is timed."""
    engine = client_engine(url, timeout_s=20, model=model)
    t0 = time.perf_counter()
    try:
        events = list(engine.stream("hi", max_tokens=max_tokens))
    finally:
        engine.close()
    return t0, events


def test_pass_through_changes_nothing(source):
    with FaultProxy(source.url, None) as p:
        _, events = _stream(p.url)
    assert sum(e.n_tokens for e in events) == 12 and events[-1].done


@pytest.mark.parametrize("fault, match", [("reset", "cut mid-way"), ("cut", r"without data: \[DONE\]"),
                                          ("5xx", "HTTP 502")])
def test_breaking_faults_raise_api_layer_errors_with_what_was_received(source, fault, match):
    with FaultProxy(source.url, fault, after_events=3) as p:
        with pytest.raises(APILayerError, match=match) as info:
            _stream(p.url)
        assert p.counts["faulted"] >= 1
    if fault in ("reset", "cut"):   # exactly the events before the fault arrived
        assert len(info.value.partial) == 3


@pytest.mark.parametrize("fault", ["latency", "slow_first_byte"])
def test_delays_add_at_least_their_delay_to_the_first_token(source, fault):
    """Compared with a pass-through run in the same test: a delay can only add."""
    with FaultProxy(source.url, None) as p:
        _stream(p.url)                      # warm: /v1/models lookup and connection
        t0, base = _stream(p.url, model="sse-source")
    with FaultProxy(source.url, fault, delay_s=0.4) as p:
        t1, slow = _stream(p.url, model="sse-source")
    ttft_base, ttft_slow = base[0].t - t0, slow[0].t - t1
    assert ttft_slow - ttft_base >= 0.4 * 0.9
    assert sum(e.n_tokens for e in slow) == sum(e.n_tokens for e in base)


def test_slow_first_byte_adds_to_a_slow_upstream():
    """A streaming server sends its response head at once and the first token after its
    prefill: the delay must add to that prefill, not hide inside it (on the old proxy, which
    held back only the head, a 0.4 s delay on a 0.4 s prefill added ~0 s)."""
    with SSESource(ttft_s=0.4) as slow_upstream:
        with FaultProxy(slow_upstream.url, None) as p:
            _stream(p.url)
            t0, base = _stream(p.url, model="sse-source")
        with FaultProxy(slow_upstream.url, "slow_first_byte", delay_s=0.4) as p:
            t1, slow = _stream(p.url, model="sse-source")
    assert (slow[0].t - t1) - (base[0].t - t0) >= 0.4 * 0.9
    assert sum(e.n_tokens for e in slow) == sum(e.n_tokens for e in base) and slow[-1].done


def test_fault_lifts_after_max_s(source):
    with FaultProxy(source.url, "5xx", max_s=0.0) as p:
        _, events = _stream(p.url)          # the fault is over: traffic passes
    assert events[-1].done and p.counts["faulted"] == 0


def test_proxy_refuses_non_loopback_and_unknown_faults():
    with pytest.raises(ServerLayerError, match="loopback"):
        FaultProxy("http://10.1.2.3:8080", "5xx")
    with pytest.raises(ValueError, match="unknown network fault"):
        FaultProxy("http://127.0.0.1:8080", "dns")


def test_proxy_port_is_closed_after_exit(source):
    with FaultProxy(source.url, "latency") as p:
        port = p.port
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_events_split_on_every_blank_line_style():
    body = b"data: 1\n\nevent: e\r\ndata: 2\r\n\r\ndata: 3\r\rdata: 4\r\n"
    events, rest = split_events(body)
    assert events == [b"data: 1\n\n", b"event: e\r\ndata: 2\r\n\r\n", b"data: 3\r\r"]
    assert rest == b"data: 4\r\n"                       # not ended yet: kept for the next read
    assert split_events(rest + b"\r\n") == ([b"data: 4\r\n\r\n"], b"")
    assert [carries_data(e) for e in events] == [True, True, True]
    assert not carries_data(b": keep-alive\n\n") and not carries_data(b"event: ping\n\n")


def _anthropic_events(eol: bytes, n_text: int = 6) -> list[bytes]:
    """An Anthropic Messages stream, `event:`-framed, with line ending `eol`."""
    def ev(kind, **data):
        return b"event: %s%sdata: %s%s%s" % (kind.encode(), eol, json.dumps({"type": kind, **data}).encode(),
                                            eol, eol)
    text = [ev("content_block_delta", index=0, delta={"type": "text_delta", "text": f"t{i} "})
            for i in range(n_text)]
    return [ev("message_start", message={"id": "m", "type": "message", "role": "assistant", "content": [],
                                         "model": "scripted", "usage": {"input_tokens": 3, "output_tokens": 0}}),
            ev("content_block_start", index=0, content_block={"type": "text", "text": ""}), *text,
            ev("content_block_stop", index=0),
            ev("message_delta", delta={"stop_reason": "max_tokens"}, usage={"output_tokens": n_text}),
            ev("message_stop")]


def _openai_events(eol: bytes, n_text: int = 6) -> list[bytes]:
    """An OpenAI chat stream (`data:` only), with line ending `eol`."""
    def data(obj):
        return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + eol + eol
    return [*(data({"choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]})
              for i in range(n_text)),
            data({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": n_text}}), data(b"[DONE]")]


FRAMINGS = {"anthropic LF": ("anthropic", _anthropic_events(b"\n")),
            "anthropic CRLF": ("anthropic", _anthropic_events(b"\r\n")),
            "openai CRLF": ("openai", _openai_events(b"\r\n")),
            "openai CR": ("openai", _openai_events(b"\r"))}


def _scripted_stream(url, api):
    engine = client_engine(url, timeout_s=20, model="scripted", api=api)
    try:
        return list(engine.stream("hi", max_tokens=6))
    finally:
        engine.close()


@pytest.mark.parametrize("framing", sorted(FRAMINGS))
def test_pass_through_keeps_every_framing(framing):
    api, script = FRAMINGS[framing]
    with ScriptedSSE(script) as src, FaultProxy(src.url, None) as p:
        events = _scripted_stream(p.url, api)
    assert "".join(e.text for e in events) == "t0 t1 t2 t3 t4 t5 " and events[-1].done


@pytest.mark.parametrize("fault, match", [("reset", "cut mid-way"),
                                          ("cut", r"without (message_stop|data: \[DONE\])")])
@pytest.mark.parametrize("framing", sorted(FRAMINGS))
def test_breaking_faults_strike_on_every_framing(framing, fault, match):
    """`after_events` counts every event with data, `event:`-framed or not, whatever the
    line endings: on the Anthropic API the first 2 are message_start and content_block_start."""
    api, script = FRAMINGS[framing]
    after = 4 if api == "anthropic" else 2           # two text deltas through, either way
    with ScriptedSSE(script) as src, FaultProxy(src.url, fault, after_events=after) as p:
        with pytest.raises(APILayerError, match=match) as info:
            _scripted_stream(p.url, api)
        assert p.counts["faulted"] == 1
    # a CR that ends the bytes received may be half a CRLF, so the client holds back the blank
    # line of the 2nd event until more bytes come: after a reset none do (a cut's EOF settles it)
    held = framing == "openai CR" and fault == "reset"
    assert [e.text for e in info.value.partial] == (["t0 "] if held else ["t0 ", "t1 "])


@pytest.fixture(scope="module")
def server():
    from infercourse.ops.faults import small_server
    with small_server() as srv:
        yield srv


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(SYMPTOMS))
def test_doctor_names_the_api_layer_for_every_network_fault(server, fault):
    from infercourse.ops.faults import run_fault
    r = run_fault(fault, server, seconds=30, timeout_s=10)
    assert r.named == "API", str(r.report)
    api = r.report.check("API")
    if api.status == "fail":   # the walk stops here, having seen the server healthy behind the wire
        assert "server is healthy" in api.summary and r.report.check("server").status == "skip"
    else:                      # a slow wire only warns: the walk goes on, and the server is fine
        assert api.status == "warn" and r.report.check("server").status == "ok"
    if fault in ("latency", "slow_first_byte"):
        assert r.report.check("API").evidence["unexplained_s"] >= 0.9 * 1.5
    print(r.row())
