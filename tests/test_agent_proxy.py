"""A recorder in front of the learner's own server (`ops.agent_session`, `infercourse agent
proxy|report`) and what the recorder itself costs (`ops.recorder_cost`).

The sessions here are driven by the course's own client against `testing.SSESource` (an exact
clock, no model) and a real llama-server: no agent runs outside a namespace.
"""
from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pandas as pd
import pytest

from infercourse.core.errors import ServerLayerError
from infercourse.ops import agent_session, recorder_cost
from infercourse.ops.agent_capture import RecordingProxy
from infercourse.ops.agent_stream import SSEWatcher
from infercourse.servers import free_port
from infercourse.testing import SSESource


def _says(text: str, phrase: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(phrase)}(?!\w)", text) is not None


# -- the proxy's reach -----------------------------------------------------------------------------
def test_the_recorder_fronts_loopback_unless_told_otherwise():
    with pytest.raises(ServerLayerError, match="loopback servers only"):
        RecordingProxy("http://10.1.2.3:8080")
    RecordingProxy("http://10.1.2.3:8080", allow_remote=True)   # built, never started: no traffic


def test_agent_proxy_cli_refuses_a_remote_upstream_before_any_traffic(capsys, tmp_path):
    from infercourse.cli.agent import agent_main
    with pytest.raises(SystemExit) as e:
        agent_main(["proxy", "--upstream", "http://10.1.2.3:8080", "--out", str(tmp_path / "s")])
    assert e.value.code == 2 and "loopback" in capsys.readouterr().err and not (tmp_path / "s").exists()


def test_watcher_keeps_the_servers_own_timings():
    chunks = ('data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
              'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":50,'
              '"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":40}},'
              '"timings":{"prompt_n":10,"cache_n":40,"prompt_ms":12.5}}\n\ndata: [DONE]\n\n')
    w = SSEWatcher("openai-chat")
    w.feed(chunks.encode(), 1.0)
    w.close(2.0)
    assert w.timings == {"prompt_n": 10, "cache_n": 40, "prompt_ms": 12.5}
    assert w.tokens() == {"prompt_tokens": 50, "cached_tokens": 40, "output_tokens": 1}


# -- a session's totals ------------------------------------------------------------------------------
def _calls(side: bool, timed: bool = True) -> pd.DataFrame:
    systems = ["main", "side", "main"] if side else ["main", "main", "main"]
    return pd.DataFrame({"api": "openai-chat", "status": "ok", "system": systems, "body_bytes": [9000, 900, 9100],
                         "prompt_tokens": [1000, 100, 1010], "cached_tokens": [0, 0, 990 if not side else 0],
                         "evaluated_tokens": [1000, 100, 20 if not side else 1010],
                         "prefill_ms": [2000.0, 200.0, 40.0] if timed else [float("nan")] * 3,
                         "ttft_s": [2.1, 0.3, 0.1], "e2e_s": [3.0, 0.5, 1.0], "task": ["a", "a", "b"]})


def test_totals_sentence_flips_with_the_session(monkeypatch):
    monkeypatch.setattr("infercourse.ops.agent_lab.calls_table", lambda out: _calls(side=True))
    t = agent_session.session_totals("unused")
    assert t["side_calls"] == 1 and t["evaluated_after_side"] == 1010 and t["prefill_s"] == pytest.approx(2.24)
    s = agent_session.totals_sentence(t)
    assert _says(s, "1 side call(s) had another system prompt") and _says(s, "1,010 of their 1,010 prompt tokens")
    monkeypatch.setattr("infercourse.ops.agent_lab.calls_table", lambda out: _calls(side=False, timed=False))
    t = agent_session.session_totals("unused")
    s = agent_session.totals_sentence(t)
    assert t["side_calls"] == 0 and _says(s, "no side call") and "(summed TTFT, an upper bound)" in s
    assert _says(s, "990 from the cache (47%)") and t["prefill_s"] == pytest.approx(2.5)


# -- the recorder's own cost: the sentence flips with the numbers -----------------------------------
def _cost(added_s: float, aa_s: float, n: int = 8, same: bool = True) -> recorder_cost.RecorderCost:
    base = [0.020 + 0.0001 * ((i * 7) % 5) for i in range(n)]
    jig = [aa_s * (1 if i % 2 else -1) for i in range(n)]
    ttft = {"direct": base, "direct again": [b + j for b, j in zip(base, jig)],
            "recorder": [b + added_s + j / 2 for b, j in zip(base, jig)]}
    chunks = {a: [[16, 16]] * n for a in recorder_cost.ARMS}
    if not same:
        chunks["recorder"] = [[16, 15]] + [[16, 16]] * (n - 1)
    return recorder_cost.RecorderCost(ttft_s=ttft, itl_s={a: [0.005] * n for a in recorder_cost.ARMS},
                                      chunks=chunks, texts={a: [["x", "x"]] * n for a in recorder_cost.ARMS})


@pytest.mark.parametrize("added, aa, words", [(0.0004, 0.00002, "met: the recorder adds 0.40 ms"),
                                              (0.004, 0.00002, "missed: the recorder adds 4.00 ms"),
                                              (0.0, 0.00002, "met: no difference beyond the noise"),
                                              (0.0, 0.003, "cannot be judged here")])
def test_recorder_sentence_flips_with_the_numbers(added, aa, words):
    s = recorder_cost.recorder_sentence(recorder_cost.compare(_cost(added, aa)))
    assert words in s, s
    assert _says(s, "none held back or merged")


def test_the_goal_is_judged_on_the_added_ms_not_on_its_median_alone():
    """Notebook 20's full run: +1.04 ms at p50 against an A/A spread of 1.72 ms read "missed: the
    recorder adds 1.04 ms, beyond the noise". The goal is judged on the added ms' own interval: a
    median just past 1 ms with blocks on both sides of it is neither met nor missed."""
    cost = _cost(0.0, 0.0002)
    for i, t in enumerate(cost.ttft_s["recorder"]):   # added ms per block: 1.04 +- 1.5
        cost.ttft_s["recorder"][i] = t + 0.00104 + 0.0015 * (1 if i % 2 else -1)
    s = recorder_cost.recorder_sentence(recorder_cost.compare(cost))
    assert "cannot be judged here: the recorder adds 1.04 ms per call (95% interval [-0.56, 2.64] ms)" in s, s
    assert "missed" not in s and "met:" not in s
    assert "cannot be judged: too few pairs (4) for an interval" in recorder_cost.recorder_sentence(
        recorder_cost.compare(_cost(0.004, 0.00002, n=4)))   # the test can rank 4 pairs; the interval needs 6


def test_the_added_ms_and_the_ratio_read_the_same_pairs():
    """Notebook 20's full run (course at d6879f3): "recorder ÷ direct = 1.09× (… 95% interval [1.03,
    1.21]): direct faster" beside "the recorder adds 2.89 ms per call (95% interval [-0.48, 4.90] ms)":
    the ms were taken against the mean of both direct runs, the ratio against direct alone, so a slow
    A/A rerun put a block below 0 that the ratio ranked slower. Both now read recorder less direct."""
    cost = _cost(0.002, 0.0)
    cost.ttft_s["direct again"] = [t + (0.006 if i < 3 else 0.0) for i, t in enumerate(cost.ttft_s["direct"])]
    c = recorder_cost.compare(cost)
    assert min(c["added_per_block_ms"]) == pytest.approx(2.0) and c["added_ms"] == pytest.approx(2.0)
    s = recorder_cost.recorder_sentence(c)
    assert "missed: the recorder adds 2.00 ms per call (95% interval [2.00, 2.00] ms)" in s, s


def test_recorder_sentence_says_when_chunks_differ_and_when_pairs_are_too_few():
    s = recorder_cost.recorder_sentence(recorder_cost.compare(_cost(0.0004, 0.00002, same=False)))
    assert _says(s, "1 of 8 trials got other chunks or text") and "none held back" not in s
    few = recorder_cost.recorder_sentence(recorder_cost.compare(_cost(0.004, 0.00002, n=2)))
    assert "cannot be judged: too few pairs" in few and "missed" not in few


# -- a recorded session, end to end (no agent: the course's client sends) ---------------------------
def _stream(url: str, system: str, task: str) -> int:
    body = {"model": "m", "stream": True, "max_tokens": 5, "messages": [{"role": "system", "content": system},
                                                                      {"role": "user", "content": task}]}
    n = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            n += line.startswith("data:")
    return n


def test_a_session_is_recorded_and_reported(tmp_path, capsys):
    out = tmp_path / "session"
    with SSESource(ttft_s=0.01, gap_s=0.002) as src, agent_session.SessionRecorder(src.url, out) as rec:
        direct = _stream(src.url, "main rules", "task one")
        assert [_stream(rec.url, s, t) for s, t in (("main rules", "task one"), ("a title", "task one"),
                                                    ("main rules", "task two"))] == [direct] * 3
    man = json.loads((out / "manifest.json").read_text())
    assert man["recorder"]["upstream_loopback"] and man["recorder"]["read_metrics"] is False
    assert man["network"]["namespace"].startswith("host: the learner's own agent") and man["n_requests"] == 3
    assert "/tokenize" in man["anatomy_tokenizer"] and len(list((out / "bodies").glob("*.json"))) == 3
    anat = [json.loads(line) for line in (out / "anatomy.jsonl").read_text().splitlines()]
    assert anat[2]["first_difference_same_system"]["part"] == "message 1 (user)"
    from infercourse.cli.agent import agent_main
    assert agent_main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "3 calls (0 failed)" in printed and "1 side call(s)" in printed and "first_diff_same_system" in printed


def test_agent_proxy_cli_records_until_its_duration(tmp_path, capsys):
    from infercourse.cli.agent import agent_main
    port, out, got = free_port(), tmp_path / "s", []
    with SSESource() as src:
        def client():
            deadline = time.monotonic() + 120   # until the recorder listens (its start is imports: slow
            while time.monotonic() < deadline:  # on a loaded machine, so bounded by time, never a count)
                try:
                    got.append(_stream(f"http://127.0.0.1:{port}", "main", "hi"))
                    return
                except httpx.ConnectError:
                    time.sleep(0.05)
        t = threading.Thread(target=client)
        t.start()
        assert agent_main(["proxy", "--upstream", src.url, "--port", str(port), "--out", str(out),
                           "--duration", "3"]) == 0
        t.join()
    printed = capsys.readouterr().out
    assert got and f"at http://127.0.0.1:{port}" in printed and "1 calls (0 failed)" in printed, printed


def test_recorder_cost_against_an_exact_clock():
    """Structure and the chunk check, never a speed: the same chunks and text through both."""
    with SSESource(ttft_s=0.005, gap_s=0.001) as src:
        cost = recorder_cost.measure(src.url, repeats=3, requests=2, max_tokens=8)
    c = recorder_cost.compare(cost)
    assert c["trials"] == 3 and c["same_chunks"] == 3 and c["chunks_per_request"] == [8]
    assert list(recorder_cost.cost_table(cost).index) == list(recorder_cost.ARMS)
    assert all(len(v) == 3 for v in cost.ttft_s.values()) and "recorder" in recorder_cost.recorder_sentence(c)


def test_a_connection_the_server_dropped_is_retried_once_and_never_doubled():
    """The recorder keeps its connection upstream between calls (a new one costs the agent's
    every call); a server that closes it while idle (llama-server does at 5 s) fails the next
    call before reading it: that call is sent again on a new connection, once."""
    import socket
    import socketserver
    seen = []

    class OneShot(socketserver.StreamRequestHandler):
        def handle(self):   # answer one request, keep-alive in the headers, then hang up anyway
            line = self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b""):
                pass
            seen.append(line.split()[1].decode())
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), OneShot) as srv:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        with RecordingProxy(f"http://127.0.0.1:{srv.server_address[1]}", read_metrics=False) as px:
            with httpx.Client() as c:
                got = [c.get(px.url + f"/v1/models?n={i}").status_code for i in range(3)]
        srv.shutdown()
    assert got == [200, 200, 200] and seen == ["/v1/models?n=0", "/v1/models?n=1", "/v1/models?n=2"]
    assert [t.status for t in px.traces] == ["ok"] * 3


def test_a_session_folder_is_written_once(tmp_path):
    with SSESource() as src:
        with agent_session.SessionRecorder(src.url, tmp_path / "s"):
            pass
        with pytest.raises(FileExistsError):
            agent_session.SessionRecorder(src.url, tmp_path / "s").start()


def test_back_to_back_calls_share_one_connection_upstream(monkeypatch):
    """A client that sends its next call the moment the last one ends must find the recorder's
    connection already pooled: a second connection can be dropped unanswered by a server with few
    HTTP threads (llama-server on 2 cores: 'RemoteDisconnected' in 20's recorder run)."""
    import socketserver
    conns = []

    class KeepAlive(socketserver.StreamRequestHandler):
        def handle(self):
            conns.append(1)
            while (line := self.rfile.readline()) not in (b"", b"\r\n"):
                while self.rfile.readline() not in (b"\r\n", b""):
                    pass
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
                self.wfile.flush()

    release = RecordingProxy._release
    def slow_release(self, conn, reusable):   # a busy machine: the pooling thread loses the CPU for a while
        time.sleep(0.2)
        return release(self, conn, reusable)
    monkeypatch.setattr(RecordingProxy, "_release", slow_release)
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), KeepAlive) as srv:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        with RecordingProxy(f"http://127.0.0.1:{srv.server_address[1]}", read_metrics=False) as px:
            # a new client connection per call (as the course's engines send): its handler thread
            # races the last call's, which must have pooled the upstream connection already
            got = [httpx.get(px.url + f"/v1/models?n={i}").status_code for i in range(5)]
        srv.shutdown()
    assert got == [200] * 5 and len(conns) == 1


def test_the_recorder_ends_on_ctrl_c_even_started_with_sigint_ignored(tmp_path):
    """A shell's background job starts with SIGINT ignored, and Python keeps it so: the recorder
    ignored Ctrl-C, and `recorder_process` waited 60 s for it, then killed it, its tables unprinted
    (the recorder-cost test took 61 s inside a backgrounded `make test`)."""
    import signal
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)     # what the child inherits, as from `cmd &`
    try:
        with SSESource() as src, recorder_cost.recorder_process(src.url, tmp_path) as url:
            assert url.startswith("http://127.0.0.1:")
    finally:
        signal.signal(signal.SIGINT, before)
    log = (tmp_path / "recorder.log").read_text()
    assert "results:" in log, log[-500:]          # it ended through its own report, not a kill


def test_a_ctrl_c_while_the_session_folder_is_written_still_ends_in_the_report(tmp_path, monkeypatch, capsys):
    """The recorder listens before its folder exists: a Ctrl-C in those seconds (a slow or busy
    machine widens them) broke the session with a traceback and no folder; it is held until the
    folder is written, then ends the session through its report."""
    import os
    import signal
    from infercourse.cli.agent import agent_main
    from infercourse.measure import results
    real = results.RunWriter.__init__

    def interrupted_init(self, *a, **k):
        os.kill(os.getpid(), signal.SIGINT)      # Ctrl-C arrives while the manifest is being written
        time.sleep(0.2)
        real(self, *a, **k)
    monkeypatch.setattr(results.RunWriter, "__init__", interrupted_init)
    with SSESource() as src:
        t0 = time.monotonic()
        assert agent_main(["proxy", "--upstream", src.url, "--port", "0", "--out", str(tmp_path / "s"),
                           "--duration", "60"]) == 0
    assert time.monotonic() - t0 < 30                     # it ended on the Ctrl-C, not the duration
    assert (tmp_path / "s" / results.MANIFEST).is_file() and "results:" in capsys.readouterr().out


def test_a_call_made_while_the_session_folder_is_written_is_recorded(tmp_path, monkeypatch):
    """The recorder listens before its run's folder exists (the manifest reads the machine, for
    seconds); an agent that calls at once had its call answered and never written (the proxy
    CLI's test lost it now and then). Such a call is held, then written first."""
    from infercourse.measure import results
    listening, called = threading.Event(), threading.Event()
    real = results.RunWriter.__init__

    def slow_init(self, *a, **k):
        listening.set()
        called.wait(30)
        real(self, *a, **k)
    monkeypatch.setattr(results.RunWriter, "__init__", slow_init)
    with SSESource() as src:
        rec = agent_session.SessionRecorder(src.url, tmp_path / "s")
        t = threading.Thread(target=rec.start)
        t.start()
        assert listening.wait(30)
        assert _stream(rec.proxy.url, "main", "hi") > 0      # answered while the folder is not there yet
        called.set()
        t.join(30)
        rec.stop()
    lines = (tmp_path / "s" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 1
