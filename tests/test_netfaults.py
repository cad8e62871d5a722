"""Network faults between client and server: the fault proxy on a stand-in SSE source
(fast, exact), then in front of a real llama-server, where the doctor must name the API
layer while the server behind it stays healthy."""
from __future__ import annotations

import socket
import time

import pytest

from infercourse.core.errors import APILayerError, ServerLayerError
from infercourse.ops.netfaults import SYMPTOMS, FaultProxy, client_engine
from infercourse.testing import SSESource


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
