"""Load patterns: schedules, rates, concurrency, warm-up, interrupts and dead servers.

Timing-exact pattern tests run against `SSESource`, a loopback OpenAI-style server
with known per-request timing; one test runs the same path against llama.cpp's llama-server.
"""
import _thread
import json
import threading
import time

import numpy as np
import pandas as pd
import pytest

from infercourse.measure import bench, loadgen
from infercourse.measure import roofline
from infercourse.core.types import Event, Request, Usage
from infercourse.core.errors import APILayerError, EngineLayerError, ServerLayerError
from infercourse.measure.results import load_run
from infercourse.testing import SSESource

REQ = Request(prompt="hello", max_tokens=10)


def max_overlap(traces):
    """Most requests in flight at once, from the recorded send/end times alone."""
    marks = sorted([(t.sent_t, 1) for t in traces] + [(t.end_t, -1) for t in traces],
                   key=lambda x: (x[0], x[1]))
    best = cur = 0
    for _, d in marks:
        cur += d
        best = max(best, cur)
    return best


class FakeEngine:
    """In-process engine: `delay_s` per token; raises KeyboardInterrupt on call `interrupt_at`."""

    name = "fake"

    def __init__(self, delay_s=0.002, interrupt_at=None):
        self.calls, self.delay_s, self.interrupt_at = 0, delay_s, interrupt_at

    def stream(self, request):
        self.calls += 1
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        for _ in range(request.max_tokens):
            time.sleep(self.delay_s)
            yield Event(t=time.perf_counter(), text="x", n_tokens=1)
        yield Event(t=time.perf_counter(), done=True, usage=Usage(1, request.max_tokens), finish_reason="length")

    def describe(self):
        return {"engine": self.name}


def http_engine(url):
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    return OpenAIHTTPEngine(url, model="sse-source", api="completions")


def lines(result):
    return (result.dir / "requests.jsonl").read_text().splitlines()


# -- schedules ------------------------------------------------------------------------------
def test_poisson_schedule_rate_and_seed():
    s = bench.poisson_schedule(5000, 20.0, seed=0)
    assert s[0] == 0 and np.all(np.diff(s) > 0)
    assert 4999 / s[-1] == pytest.approx(20.0, rel=0.05)
    gaps = np.diff(s)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)   # exponential: CV = 1
    assert np.array_equal(s, bench.poisson_schedule(5000, 20.0, seed=0))
    assert not np.array_equal(s, bench.poisson_schedule(5000, 20.0, seed=1))


def test_constant_schedule_spacing():
    assert np.allclose(np.diff(bench.constant_schedule(50, 8.0)), 0.125)
    with pytest.raises(ValueError, match="rate"):
        bench.constant_schedule(5, 0)


# -- in-process engines ---------------------------------------------------------------------
def test_warmup_excluded_and_concurrency_downgraded(tmp_path):
    eng = FakeEngine()
    r = bench.run(eng, [REQ], pattern="concurrency", concurrency=4, warmup=2, max_requests=5,
                  out_dir=tmp_path / "run", progress=False)
    assert eng.calls == 7 and len(r.traces) == 5 and len(lines(r)) == 5
    assert [t.request_id for t in r.traces] == list(range(5))
    assert r.manifest["load"]["concurrency"] == 1
    assert any("downgraded to 1" in w for w in r.warnings)
    assert max_overlap(r.traces) == 1


def test_replay_offsets_respected(tmp_path):
    offsets = [0.0, 0.15, 0.2, 0.5]
    r = bench.replay(FakeEngine(delay_s=0.001), [(o, REQ) for o in offsets], warmup=0,
                     out_dir=tmp_path / "run", progress=False)
    t0 = r.traces[0].scheduled_t
    assert [round(t.scheduled_t - t0, 6) for t in r.traces] == offsets
    # never sent early (how late depends on how fast and how busy this machine is)
    assert all(t.sent_t >= t.scheduled_t for t in r.traces)
    assert [t.request_id for t in sorted(r.traces, key=lambda t: t.sent_t)] == [0, 1, 2, 3]


def test_ctrl_c_in_process_keeps_finished(tmp_path):
    r = bench.run(FakeEngine(interrupt_at=5), [REQ], max_requests=10, warmup=1,
                  out_dir=tmp_path / "run", progress=False)
    # call 1 is warm-up, calls 2-4 finish, call 5 is interrupted
    assert len(r.traces) == 3 and len(lines(r)) == 3
    assert r.manifest["stopped"] == "interrupted"
    assert json.loads((r.dir / "manifest.json").read_text())["status"].startswith("stopped")


def test_max_duration_bounds_the_run(tmp_path):
    r = bench.run(FakeEngine(delay_s=0.005), [REQ], max_requests=1000, max_duration_s=0.3, warmup=0,
                  out_dir=tmp_path / "run", progress=False)          # ~0.05 s per request
    assert 3 <= len(r.traces) < 20 and "max duration" in r.manifest["stopped"]
    assert max(t.sent_t for t in r.traces) - r.traces[0].scheduled_t <= 0.3


def test_engine_error_becomes_error_trace_and_run_goes_on(tmp_path):
    from infercourse.core.errors import ContextLayerError

    class Picky(FakeEngine):
        def stream(self, request):
            if request.max_tokens > 50:
                raise ContextLayerError("prompt + max_tokens exceed the context window")
            yield from super().stream(request)

    reqs = [REQ, Request(prompt="long", max_tokens=99), REQ]
    r = bench.run(Picky(), reqs, warmup=0, out_dir=tmp_path / "run", progress=False)
    assert [t.status for t in r.traces] == ["ok", "error", "ok"]
    assert "context layer" in r.traces[1].error and len(lines(r)) == 3


def test_sweep_refuses_in_process_engine(tmp_path):
    with pytest.raises(EngineLayerError, match="one request at a time"):
        bench.sweep(FakeEngine(), [REQ], (1, 2), out_dir=tmp_path)


def test_bad_inputs_are_clear():
    with pytest.raises(ValueError, match="unknown pattern"):
        bench.run(FakeEngine(), [REQ], pattern="burst", progress=False)
    with pytest.raises(ValueError, match="needs rate_rps"):
        bench.run(FakeEngine(), [REQ], pattern="poisson", progress=False)


def test_self_check_flags_a_slow_client():
    df = pd.DataFrame({"status": ["ok"] * 20, "dispatch_delay_s": [0.2] * 20, "ttft_from_send_s": [0.1] * 20})
    st = loadgen.State(None, None)
    out = loadgen.self_check(df, 0.95, True, st, 256, True)
    assert any("CPU core" in w for w in out) and any("dispatch delay" in w for w in out)
    df["dispatch_delay_s"] = 0.001
    assert loadgen.self_check(df, 0.2, True, st, 256, True) == []


def test_remote_server_refused():
    pytest.importorskip("httpx_sse")
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    with pytest.raises(APILayerError, match="loopback"):
        bench.run(OpenAIHTTPEngine("http://10.1.2.3:8000", model="m"), [REQ], progress=False)


# -- HTTP engines against a loopback SSE source ------------------------------------------------
@pytest.fixture
def source():
    pytest.importorskip("httpx_sse")
    with SSESource(ttft_s=0.05, gap_s=0.01) as src:    # ~0.15 s per 10-token request
        yield src


@pytest.mark.slow
def test_fixed_concurrency_hits_target(source, tmp_path):
    r = bench.run(http_engine(source.url), [REQ], pattern="concurrency", concurrency=4,
                  max_requests=16, warmup=1, out_dir=tmp_path / "run", progress=False)
    assert len(r.traces) == 16 and all(t.status == "ok" for t in r.traces)
    assert max_overlap(r.traces) == 4 == r.manifest["client"]["max_in_flight"]
    assert all(t.completion_tokens == 10 for t in r.traces)
    wall = max(t.end_t for t in r.traces) - min(t.scheduled_t for t in r.traces)
    per_req = np.median([t.end_t - t.sent_t for t in r.traces])
    assert 16 / wall == pytest.approx(4 / per_req, rel=0.3)          # 4 busy workers all the time


@pytest.mark.slow
def test_sweep_one_row_per_level(source, tmp_path):
    table, runs = bench.sweep(http_engine(source.url), [REQ], (1, 4), requests_per_level=8, warmup=0,
                              out_dir=tmp_path, progress=False)
    assert list(table.index) == [1, 4] and list(table["max_in_flight"]) == [1, 4]
    assert table.loc[4, "requests_per_s"] > 2 * table.loc[1, "requests_per_s"]   # not saturated yet
    assert (tmp_path / "c4" / "requests.jsonl").read_text().count("\n") == 8


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["rate", "poisson"])
def test_open_loop_hits_target_rate(source, tmp_path, pattern):
    r = bench.run(http_engine(source.url), [REQ], pattern=pattern, rate_rps=20.0, seed=3,
                  max_requests=30, warmup=1, out_dir=tmp_path / "run", progress=False)
    sched = np.array(sorted(t.scheduled_t for t in r.traces))
    expected = (bench.constant_schedule if pattern == "rate" else
                lambda n, rate: bench.poisson_schedule(n, rate, seed=3))(30, 20.0)
    assert np.allclose(sched - sched[0], expected)
    delays = np.array([t.sent_t - t.scheduled_t for t in r.traces])
    # never early, and late by less than one inter-arrival gap (else the loop is not open)
    assert np.all(delays >= 0) and np.percentile(delays, 95) < 1 / 20.0
    sent = np.sort([t.sent_t for t in r.traces])
    if pattern == "rate":
        assert 29 / (sent[-1] - sent[0]) == pytest.approx(20.0, rel=0.1)
    assert max_overlap(r.traces) >= 2          # open loop: does not wait for earlier requests


@pytest.mark.slow
def test_killed_server_keeps_finished_requests(tmp_path):
    pytest.importorskip("httpx_sse")
    src = SSESource(ttft_s=0.0, gap_s=0.02)                  # 0.6 s per 30-token request
    with src:
        threading.Timer(1.5, src.stop).start()
        with pytest.raises(ServerLayerError, match="stopped answering mid-run") as ei:
            bench.run(http_engine(src.url), [Request(prompt="hi", max_tokens=30)], pattern="concurrency",
                      concurrency=2, max_requests=20, warmup=0, out_dir=tmp_path / "run", progress=False)
    err = ei.value
    assert "server layer" in str(err)
    part = err.partial
    ok = [t for t in part.traces if t.status == "ok"]
    bad = [t for t in part.traces if t.status == "error"]
    # in flight at the kill (<= 2) plus at most one per worker sent before the kill was seen
    assert len(ok) >= 2 and 1 <= len(bad) <= 4 and len(part.traces) < 20
    first_fail = min(t.end_t for t in bad)
    assert all(t.sent_t <= first_fail + 1.5 for t in part.traces), "kept sending after the server died"
    run = load_run(tmp_path / "run")                                  # readable afterwards
    assert len(run.traces) == len(part.traces)
    assert sorted(t.request_id for t in run.traces if t.status == "ok") == sorted(t.request_id for t in ok)
    assert run.manifest["status"].startswith("error: server stopped answering")


@pytest.fixture
def python_sigint_handler():
    """A shell that starts us in the background (as CI may) leaves SIGINT ignored, and then
    `interrupt_main()` does nothing. A terminal or a Jupyter kernel has Python's handler:
    install it for the test, restore what was there after."""
    import signal
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, prev)


@pytest.mark.slow
def test_ctrl_c_async_keeps_finished_requests(source, tmp_path, python_sigint_handler):
    # The run is bounded far beyond the interrupt (30 s, 100k requests) so that on a fast,
    # quiet machine it cannot finish before the Ctrl-C lands at 0.8 s.
    threading.Timer(0.8, _thread.interrupt_main).start()
    r = bench.run(http_engine(source.url), [REQ], pattern="concurrency", concurrency=2,
                  max_requests=100_000, max_duration_s=30, warmup=0, out_dir=tmp_path / "run",
                  progress=False)
    assert r.manifest["stopped"] == "interrupted"
    assert 4 <= len(r.traces) < 100_000 and all(t.status == "ok" for t in r.traces)
    assert len(load_run(r.dir).traces) == len(r.traces)


@pytest.mark.slow
def test_chunks_per_second_probe():
    pytest.importorskip("httpx_sse")
    got = roofline.chunks_per_second(n_chunks=3000, n_requests=2)
    assert got["chunks"] == 3000
    # No speed bound holds on every machine; the probe's own arithmetic does.
    assert got["chunks_per_s"] > 0 and got["cpu_s_per_chunk"] > 0
    assert got["client_ceiling_chunks_per_s"] == pytest.approx(1 / got["cpu_s_per_chunk"])
    assert got["client_cpu_frac"] == pytest.approx(got["chunks_per_s"] * got["cpu_s_per_chunk"])
    assert got["client_cpu_frac"] <= 1.05     # one thread's CPU time cannot outrun the wall clock


# -- the real thing ---------------------------------------------------------------------------
@pytest.mark.slow
def test_concurrency_against_llama_server(tmp_path):
    pytest.importorskip("httpx_sse")
    from infercourse.core.errors import BackendMissingError
    from infercourse.servers import LlamaServer
    try:
        srv = LlamaServer(n_parallel=2, ctx_size=2048, threads=1)
    except BackendMissingError as e:
        pytest.skip(f"llama-server not built here: {e}")
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    with srv:
        eng = OpenAIHTTPEngine(srv.url)
        reqs = [Request(messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=12) for i in range(3)]
        r = bench.run(eng, reqs, pattern="concurrency", concurrency=2, max_requests=6, warmup=1,
                      ignore_eos=True, out_dir=tmp_path / "run", progress=False)
    assert all(t.status == "ok" for t in r.traces), [t.error for t in r.traces]
    assert [t.completion_tokens for t in r.traces] == [12] * 6          # forced length honoured
    assert {t.token_source for t in r.traces} == {"server"}
    assert max_overlap(r.traces) == 2 == r.manifest["client"]["max_in_flight"]
    assert r.manifest["workload"]["sha256"] and r.manifest["load"]["pattern"] == "concurrency"
    assert r.summary.loc["ttft_s", "count"] == 6


# -- the command line ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0"], "must be > 0"),
    (["--pattern", "rate"], "needs --rate"),
    (["--engine", "http"], "needs --url"),
    (["--pattern", "sweep"], "needs a server"),
    (["--pattern", "replay"], "replays the timing"),
    (["--concurrency-list", "1,x", "--pattern", "sweep"], "comma-separated"),
    (["--frobnicate"], "unrecognized arguments"),
    (["--engine", "http", "--url", "http://127.0.0.1:1", "--roofline"], "--roofline needs"),
])
def test_cli_rejects_bad_usage(argv, message, capsys):
    from infercourse.cli import bench_main
    with pytest.raises(SystemExit) as ei:
        bench_main(argv)
    assert ei.value.code == 2 and message in capsys.readouterr().err


def test_cli_help_documents_every_option(capsys):
    from infercourse.cli import bench_parser
    p = bench_parser()
    for action in p._actions:
        assert action.help, f"{action.option_strings} has no help"


@pytest.mark.slow
def test_cli_bench_then_report(source, tmp_path, capsys):
    from infercourse.cli import bench_main, report_main
    common = ["--engine", "http", "--url", source.url, "--model", "sse-source", "--no-progress",
              "--max-tokens", "8", "--requests", "6"]
    assert bench_main(common + ["--out", str(tmp_path / "a"), "--label", "seq"]) == 0
    assert bench_main(common + ["--out", str(tmp_path / "b"), "--label", "c3", "--pattern", "concurrency",
                                "--concurrency", "3"]) == 0
    out = capsys.readouterr().out
    assert "6/6 ok" in out and "ttft_s" in out
    assert report_main([str(tmp_path / "a"), str(tmp_path / "b"), "--plot", str(tmp_path / "cdf.png")]) == 0
    out = capsys.readouterr().out
    assert "load.concurrency" in out and "load.pattern" in out       # the conditions that differ
    assert (tmp_path / "cdf.png").stat().st_size > 1000
    with pytest.raises(SystemExit) as ei:
        report_main([str(tmp_path)])                                 # not a run folder
    assert ei.value.code == 2


def test_unreachable_server_fails_before_the_run(tmp_path):
    pytest.importorskip("httpx_sse")
    from infercourse.servers import free_port
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    engine = OpenAIHTTPEngine(f"http://127.0.0.1:{free_port()}")   # no model name: must ask the server
    with pytest.raises(APILayerError, match="not reachable"):
        bench.run(engine, [REQ], out_dir=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()          # nothing half-written
