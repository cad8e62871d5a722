"""Load patterns: schedules, rates, concurrency, warm-up, interrupts and dead servers.

Timing-exact pattern tests run against `SSESource`, a loopback OpenAI-style server
with known per-request timing; one test runs the same path against llama.cpp's llama-server.

No test here assumes how fast this machine is, or how busy. A slow client sends late, and
that lateness is what bench must *report* (dispatch delay, warnings), never what a test
forbids. So tests assert what holds at any speed: the schedule itself, never early, in
order, the bookkeeping (`dispatch_delay_s == sent - scheduled`); kills and interrupts fire
on events (after N completions), not timers; counts are bounded by what the run recorded.
"""
import _thread
import asyncio
import json
import re
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
    """In-process engine: `delay_s` per token; raises KeyboardInterrupt on call `interrupt_at`
    after `interrupt_after` tokens. Keeps every prompt it was sent."""

    name = "fake"

    def __init__(self, delay_s=0.002, interrupt_at=None, interrupt_after=0):
        self.calls, self.delay_s, self.interrupt_at = 0, delay_s, interrupt_at
        self.interrupt_after, self.prompts = interrupt_after, []

    def stream(self, request):
        self.calls += 1
        self.prompts.append(request.prompt if request.prompt is not None else request.messages)
        for k in range(request.max_tokens):
            if self.calls == self.interrupt_at and k == self.interrupt_after:
                raise KeyboardInterrupt
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
    # call 1 is warm-up, calls 2-4 finish, call 5 is interrupted: kept, as incomplete
    assert [t.status for t in r.traces] == ["ok"] * 3 + ["incomplete"] and len(lines(r)) == 4
    assert r.manifest["stopped"] == "interrupted"
    assert json.loads((r.dir / "manifest.json").read_text())["status"].startswith("stopped")


def test_ctrl_c_mid_request_keeps_its_partial_timings(tmp_path):
    r = bench.run(FakeEngine(interrupt_at=3, interrupt_after=4), [REQ], max_requests=10, warmup=0,
                  out_dir=tmp_path / "run", progress=False)
    last = r.traces[-1]
    assert [t.status for t in r.traces] == ["ok", "ok", "incomplete"]
    assert len(last.chunk_t) == 4 and last.completion_tokens == 4       # the 4 chunks it received
    assert last.end_t >= last.chunk_t[-1] and "interrupted" in last.error
    assert r.df["status"].tolist() == ["ok", "ok", "incomplete"]         # in the frame...
    assert [t.status for t in load_run(r.dir).traces] == ["ok", "ok", "incomplete"]   # ...and on disk
    assert "1 incomplete" in r.report()


def test_warmup_shares_no_prefix_and_runs_are_salted(tmp_path):
    reqs = [Request(prompt=f"prompt number {i} about caching", max_tokens=3) for i in range(3)]
    runs = []
    for k in range(2):
        eng = FakeEngine()
        r = bench.run(eng, reqs, warmup=2, out_dir=tmp_path / f"run{k}", progress=False)
        runs.append((eng.prompts, r.manifest["workload"]["salt"]))
    (p0, salt0), (p1, salt1) = runs
    assert salt0 and salt1 and salt0 != salt1                            # a fresh salt per run
    warm, measured = p0[:2], p0[2:]
    assert measured == [f"{salt0}\n{q.prompt}" for q in reqs]           # the salt comes first
    assert all(w.split()[0] != m.split()[0] for w in warm for m in measured + [q.prompt for q in reqs])
    assert all(a[:9] != b[:9] for a, b in zip(p0[2:], p1[2:]))           # runs share no prefix
    chat = [Request(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])]
    eng = FakeEngine()
    r = bench.run(eng, chat, warmup=1, max_requests=1, out_dir=tmp_path / "chat", progress=False)
    salt = r.manifest["workload"]["salt"]
    assert eng.prompts[1][0]["content"] == f"{salt}\nbe brief" and eng.prompts[1][1]["content"] == "hi"
    assert not eng.prompts[0][0]["content"].startswith(salt)


def test_cache_workloads_and_replays_are_not_salted(tmp_path):
    from infercourse.measure.workloads import Workload, shared_prefix_workload
    assert shared_prefix_workload(2).cache_workload
    reqs = (Request(prompt="a shared prefix, then task one"), Request(prompt="a shared prefix, then task two"))
    for k, (work, kw) in enumerate([(Workload("cache", reqs, cache_workload=True), {}),
                                    (list(reqs), {"salt": False})]):
        eng = FakeEngine()
        r = bench.run(eng, work, warmup=0, out_dir=tmp_path / f"r{k}", progress=False, **kw)
        assert eng.prompts == [q.prompt for q in reqs] and r.manifest["workload"]["salt"] is None
    eng = FakeEngine()
    bench.replay(eng, [(0.0, reqs[0]), (0.01, reqs[1])], warmup=0, out_dir=tmp_path / "rp", progress=False)
    assert eng.prompts == [q.prompt for q in reqs]
    eng = FakeEngine()                       # nothing may be cached: nothing to salt away
    bench.run(eng, [Request(prompt="x", cache_prompt=False)], warmup=0, out_dir=tmp_path / "nc", progress=False)
    assert eng.prompts == ["x"]


def test_write_inline_still_writes_everything(tmp_path):
    r = bench.run(FakeEngine(delay_s=0), [REQ], max_requests=20, warmup=0, write_inline=True,
                  out_dir=tmp_path / "run", progress=False)
    assert len(lines(r)) == 20 == r.manifest["n_requests"]


def test_max_duration_bounds_the_run(tmp_path):
    r = bench.run(FakeEngine(delay_s=0.005), [REQ], max_requests=1000, max_duration_s=0.3, warmup=0,
                  out_dir=tmp_path / "run", progress=False)          # ~0.05 s per request when idle
    # how many fit in 0.3 s depends on the machine; that the deadline ended the run does not
    assert 1 <= len(r.traces) < 1000 and "max duration" in r.manifest["stopped"]
    assert r.manifest["client"]["wall_s"] > 0.3                         # it ran until the deadline...
    t0 = r.traces[0].scheduled_t
    # ...and no further: sequential, so each request went out only after the previous one had
    # ended, and only if that end came before the deadline
    assert all(b.sent_t >= a.end_t for a, b in zip(r.traces, r.traces[1:]))
    assert all(t.end_t - t0 <= 0.3 for t in r.traces[:-1])


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
    by_due = sorted(r.traces, key=lambda t: t.scheduled_t)
    assert sum(t.scheduled_t == by_due[0].scheduled_t for t in r.traces) == 4   # each worker's first, at t0
    # closed loop: a worker's next request is due when its previous one ends, so the k-th
    # later request cannot be due before k requests have ended (at any speed)
    ends = np.sort([t.end_t for t in r.traces])
    assert all(np.sum(ends <= t.scheduled_t) >= k for k, t in enumerate(by_due[4:], start=1))


@pytest.mark.slow
def test_sweep_one_row_per_level(source, tmp_path):
    table, runs = bench.sweep(http_engine(source.url), [REQ], (1, 4), requests_per_level=8, warmup=0,
                              out_dir=tmp_path, progress=False)
    from infercourse.core.summary import throughput
    assert list(table.index) == [1, 4] and list(table["max_in_flight"]) == [1, 4]
    # each row is its own run's numbers (how far 4 beats 1 depends on this machine's spare CPU)
    for level, run in zip((1, 4), runs):
        assert table.loc[level, "requests_per_s"] == pytest.approx(throughput(run.df)["requests_per_s"])
        assert max_overlap(run.traces) == level
    assert (tmp_path / "c4" / "requests.jsonl").read_text().count("\n") == 8


class HoldFirstUntilSecond:
    """Wraps an HTTP engine: the first measured request does not finish until the second
    has reached the engine. An open loop sends the second when it is due anyway; a loop
    that waited for earlier requests would stall here (the hold gives up after 60 s and
    says so). An event, not a timer: it proves the loop open at any machine speed."""

    def __init__(self, inner):
        self.inner, self.entered, self.second, self.overlapped = inner, 0, asyncio.Event(), None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def astream(self, request, client=None):
        measured = not request.prompt.startswith("Warm-up")
        k, self.entered = self.entered, self.entered + measured
        if measured and k == 1:
            self.second.set()
        async for ev in self.inner.astream(request, client=client):
            if measured and k == 0 and ev.done and self.overlapped is None:
                try:
                    await asyncio.wait_for(self.second.wait(), 60)
                    self.overlapped = True
                except asyncio.TimeoutError:
                    self.overlapped = False
            yield ev


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["rate", "poisson"])
def test_open_loop_keeps_its_schedule(source, tmp_path, pattern):
    eng = HoldFirstUntilSecond(http_engine(source.url))
    r = bench.run(eng, [REQ], pattern=pattern, rate_rps=20.0, seed=3,
                  max_requests=30, warmup=1, out_dir=tmp_path / "run", progress=False)
    assert len(r.traces) == 30 and all(t.status == "ok" for t in r.traces)
    by_id = sorted(r.traces, key=lambda t: t.request_id)
    sched = np.array([t.scheduled_t for t in by_id])
    expected = (bench.constant_schedule if pattern == "rate" else
                lambda n, rate: bench.poisson_schedule(n, rate, seed=3))(30, 20.0)
    assert np.allclose(sched - sched[0], expected)                     # the schedule, exactly
    sent = np.array([t.sent_t for t in by_id])
    assert np.all(sent >= sched)                                       # never early
    assert np.all(np.diff(sent) >= 0)                                  # in schedule order
    df = r.df.set_index("request_id").loc[[t.request_id for t in by_id]]
    assert np.allclose(df["dispatch_delay_s"], sent - sched, rtol=0, atol=1e-9)   # latency from the schedule
    assert np.allclose(df["ttft_s"] - df["ttft_from_send_s"], sent - sched, rtol=0, atol=1e-9)
    assert eng.overlapped is True and max_overlap(r.traces) >= 2         # open: sent before 0 ended
    # How late this machine sent is reported, not forbidden: a client that fell behind its
    # schedule says so in the result, one that kept up does not
    ok = r.df[r.df["status"] == "ok"]
    behind = ok["dispatch_delay_s"].quantile(0.95) > max(0.005, 0.25 * ok["ttft_from_send_s"].median())
    assert behind == any("fell behind its schedule" in w for w in r.warnings)


class KillAfterN:
    """Wraps an HTTP engine: kills the server the moment the `n`-th request has finished
    (an event, where a timer would fire before any request had finished on a slow machine)."""

    def __init__(self, inner, n, kill):
        self.inner, self.n, self.kill, self.finished = inner, n, kill, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def astream(self, request, client=None):
        async for ev in self.inner.astream(request, client=client):
            yield ev
        self.finished += 1
        if self.finished == self.n:
            self.kill()


@pytest.mark.slow
def test_killed_server_keeps_finished_requests(tmp_path):
    pytest.importorskip("httpx_sse")
    src = SSESource(ttft_s=0.0, gap_s=0.02)                  # >= 0.6 s per 30-token request
    with src:
        with pytest.raises(ServerLayerError, match="stopped answering mid-run") as ei:
            bench.run(KillAfterN(http_engine(src.url), 3, src.stop), [Request(prompt="hi", max_tokens=30)],
                      pattern="concurrency", concurrency=2, max_requests=20, warmup=0,
                      out_dir=tmp_path / "run", progress=False)
    err = ei.value
    assert "server layer" in str(err)
    part = err.partial
    ok = [t for t in part.traces if t.status == "ok"]
    bad = [t for t in part.traces if t.status == "error"]
    # the 3 that finished before the kill are kept; each worker stops at its first failure
    # (a refused connect means the server is gone), so at most one error per worker
    assert len(ok) >= 3 and 1 <= len(bad) <= 2 and len(ok) + len(bad) == len(part.traces) < 20
    first_fail = min(t.end_t for t in bad)
    # after the first failure only the other worker may still send, once
    assert sum(t.sent_t > first_fail for t in part.traces) <= 1, "kept sending after the server died"
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
    # Ctrl-C lands when the 7th request starts (so >= 5 finished), whatever the machine's
    # speed; the run is bounded far beyond it (30 s, 100k requests).
    class CtrlCAtSeventh(EntryClock):
        async def astream(self, request, client=None):
            if len(self.entered) == 6:
                _thread.interrupt_main()
            self.entered[len(self.entered)] = time.perf_counter()
            async for ev in self.inner.astream(request, client=client):
                yield ev

    r = bench.run(CtrlCAtSeventh(http_engine(source.url)), [REQ], pattern="concurrency", concurrency=2,
                  max_requests=100_000, max_duration_s=30, warmup=0, out_dir=tmp_path / "run",
                  progress=False)
    assert r.manifest["stopped"] == "interrupted"
    ok = [t for t in r.traces if t.status == "ok"]
    cut = [t for t in r.traces if t.status == "incomplete"]
    assert 4 <= len(ok) < 100_000 and len(ok) + len(cut) == len(r.traces)
    # both workers were mid-request (a worker sends its next request without yielding):
    # kept as incomplete, with the chunks they had, not dropped
    assert len(cut) == 2 and all(len(t.chunk_t) <= 10 and t.end_t >= t.sent_t for t in cut)
    assert all((t.completion_tokens or 0) == len(t.chunk_t) and t.finish_reason is None for t in cut)
    assert all("in flight when the run stopped (interrupted)" in t.error for t in cut)
    assert sorted(t.status for t in load_run(r.dir).traces) == sorted(t.status for t in r.traces)


@pytest.mark.slow
def test_deadline_keeps_requests_queued_at_the_cap(tmp_path):
    pytest.importorskip("httpx_sse")
    # The server holds every request >= 1 s, past the 0.6 s deadline, so whatever this
    # machine's speed the cap (2) stays full until after the deadline: the first two are
    # the only ones ever sent, and every later one that fell due is queued.
    with SSESource(ttft_s=1.0, gap_s=0.01) as src:
        r = bench.run(http_engine(src.url), [REQ], pattern="rate", rate_rps=50.0, max_requests=60,
                      max_in_flight=2, max_duration_s=0.6, warmup=0, salt=False,
                      out_dir=tmp_path / "run", progress=False)
    t0 = min(t.scheduled_t for t in r.traces)
    sent = [t for t in r.traces if t.tags.get("sent") is not False]
    queued = [t for t in r.traces if t.status == "incomplete"]
    assert sorted(t.request_id for t in sent) == [0, 1] and all(t.status == "ok" for t in sent)
    # how many fell due before the deadline depends on speed; the run's own record does not:
    # every one recorded past the cap is queued, never sent, and none is silently dropped
    assert len(queued) == len(r.traces) - 2 >= 1
    assert all(t.tags["sent"] is False and t.sent_t != t.sent_t for t in queued)
    assert sorted(t.request_id for t in r.traces) == list(range(len(r.traces)))
    assert all(t.scheduled_t - t0 <= 0.6 for t in r.traces)             # only what was due
    assert r.df["e2e_s"][r.df["status"] == "incomplete"].notna().all()   # waited at least this long
    assert f"{len(queued)} incomplete" in r.report()
    assert len(load_run(r.dir).traces) == len(r.traces)


class EntryClock:
    """Wraps an HTTP engine and notes when each request reaches the engine: a clock of
    the wait at the in-flight cap independent of the load generator's own stamps."""

    def __init__(self, inner):
        self.inner, self.entered = inner, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def astream(self, request, client=None):
        self.entered[request.prompt] = time.perf_counter()
        async for ev in self.inner.astream(request, client=client):
            yield ev


@pytest.mark.slow
def test_saturation_wait_at_the_cap_is_in_ttft(tmp_path):
    """Coordinated omission: open loop far beyond what 2 slots serve. Each request that
    found the cap full is late by exactly its wait, and TTFT (from the schedule) carries
    that wait while TTFT from send does not."""
    pytest.importorskip("httpx_sse")
    reqs = [Request(prompt=f"r{i}", max_tokens=10) for i in range(14)]
    with SSESource(ttft_s=0.05, gap_s=0.01) as src:          # ~0.15 s a request: ~13 req/s max
        eng = EntryClock(http_engine(src.url))
        r = bench.run(eng, reqs, pattern="rate", rate_rps=40.0, max_in_flight=2, warmup=0, salt=False,
                      out_dir=tmp_path / "run", progress=False)
    assert len(r.traces) == 14 and all(t.status == "ok" for t in r.traces)
    assert r.manifest["client"]["max_in_flight"] == 2 and any("cap (2)" in w for w in r.warnings)
    df = r.df.set_index("request_id")
    for t in r.traces:
        wait, row = t.sent_t - t.scheduled_t, df.loc[t.request_id]
        assert row.ttft_s - row.ttft_from_send_s == pytest.approx(wait, abs=1e-9)
        assert row.dispatch_delay_s == pytest.approx(wait, abs=1e-9)
        # the engine (its own clock) got it no earlier than its recorded send, and before its
        # first chunk: the recorded wait is a wait the request really had
        assert t.sent_t <= eng.entered[reqs[t.request_id].prompt] <= t.chunk_t[0]
        busy = [o for o in r.traces if o is not t and o.sent_t <= t.scheduled_t < o.end_t]
        if len(busy) >= 2:                                     # due with both slots taken:
            assert t.sent_t >= min(o.end_t for o in busy)      # it went only once a slot freed
    assert max_overlap(r.traces) == 2
    # The queue grew, by a bound from this run's own record: each request held its slot at
    # least s_min, so the k-th sent cannot leave before (k // 2) * s_min, whatever the speed.
    s_min = min(t.end_t - t.sent_t for t in r.traces)
    t0 = min(t.scheduled_t for t in r.traces)
    by_sent = sorted(r.traces, key=lambda t: t.sent_t)
    assert all(t.sent_t - t0 >= (k // 2) * s_min - 1e-9 for k, t in enumerate(by_sent))
    last = by_sent[-1]
    must_wait = (len(by_sent) - 1) // 2 * s_min - (last.scheduled_t - t0)   # ~6 x 0.15 - 0.325 s
    assert must_wait > 0 and df.loc[last.request_id].ttft_s >= must_wait    # and TTFT shows it


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


@pytest.mark.slow
def test_salt_keeps_a_second_run_off_a_real_servers_cache(tmp_path):
    """Two identical runs back to back on one llama-server (whose host-RAM prompt cache
    keeps every prompt it saw): salted by default, the second reuses nothing; as a cache
    workload (not salted), the second is served from the cache, and the summary says so."""
    pytest.importorskip("httpx_sse")
    from infercourse.core.errors import BackendMissingError
    from infercourse.measure.workloads import Workload, eval_text
    from infercourse.servers import LlamaServer
    try:
        srv = LlamaServer(n_parallel=1, ctx_size=1024, threads=1)
    except BackendMissingError as e:
        pytest.skip(f"llama-server not built here: {e}")
    words = eval_text().split()
    reqs = tuple(Request(prompt=" ".join(words[80 * i: 80 * i + 80]), max_tokens=2) for i in range(3))
    with srv:
        from infercourse.engines.openai_http import OpenAIHTTPEngine
        eng = OpenAIHTTPEngine(srv.url, api="completions")

        def twice(name, work):
            return [bench.run(eng, work, warmup=1, out_dir=tmp_path / f"{name}{k}", progress=False)
                    for k in range(2)]
        default, cache = twice("default", list(reqs)), twice("cache", Workload("c", reqs, cache_workload=True))
    second = default[1].df
    assert (second["prompt_tokens"] > 80).all()
    # only the run's own salt can match (the previous request of the same run): BOS, at most
    # one token per hex digit of the 8-digit salt, and the newline after it
    assert (second["cached_tokens"] <= 1 + 8 + 1).all(), second[["prompt_tokens", "cached_tokens"]]
    assert (cache[1].df["cached_fraction"] > 0.9).all()                 # served from the cache
    assert "prompt cache: " in default[1].report()
    shown = re.search(r"cached \((\d+)%\)", cache[1].report()).group(1)
    assert int(shown) >= 90


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


# -- a mix of models: each request names its model (model_mix) ----------------------------------
def test_mix_gives_exact_shares_seeded():
    from infercourse.measure.model_mix import mix
    reqs = [Request(prompt=f"q{i}") for i in range(10)]
    a, b = mix(reqs, {"main": 0.8, "fast": 0.2}, seed=1), mix(reqs, {"main": 4, "fast": 1}, seed=1)
    assert [r.model for r in a] == [r.model for r in b]                    # shares are normalised
    assert sorted(r.model for r in a).count("fast") == 2
    assert [r.prompt for r in a] == [r.prompt for r in reqs]               # order kept, models assigned
    assert [r.model for r in mix(reqs, {"main": 0.8, "fast": 0.2}, seed=2)] != [r.model for r in a]
    assert sum(r.model == "c" for r in mix(reqs[:7], {"a": 1, "b": 1, "c": 1})) in (2, 3)
    with pytest.raises(ValueError):
        mix(reqs, {"a": 0})


def test_model_dispatch_puts_each_requests_model_in_its_body():
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    from infercourse.measure.model_mix import ModelDispatch, with_model
    base = OpenAIHTTPEngine("http://127.0.0.1:9", model="default")
    d = ModelDispatch(base, ["fast", None])
    assert d.model == ["fast"] and d.root == base.root
    fast = with_model(REQ, "fast")
    assert d.for_model("fast").body(fast)["model"] == "fast" and base.body(fast)["model"] == "default"
    assert d.for_model(None) is base and d.for_model("main").body(fast)["model"] == "main"
    salted = bench.salted(fast, "abcd")               # what bench does to a request keeps its model
    assert salted.model == "fast" and bench.warmup_request(salted).model == "fast"
    with pytest.raises(EngineLayerError, match="per-request models need a server"):
        ModelDispatch(object())


def test_bench_tags_and_splits_a_mix(source, tmp_path):
    from infercourse.measure.model_mix import mix
    reqs = mix([Request(prompt=f"q{i}", max_tokens=4) for i in range(6)], {"a": 2, "b": 1})
    r = bench.run(http_engine(source.url), reqs, pattern="concurrency", concurrency=2, warmup=1,
                  out_dir=tmp_path / "run", progress=False, sample_s=None)
    assert sorted(r.df["model"]) == ["a"] * 4 + ["b"] * 2
    t = r.by_model
    assert t["n_ok"].to_dict() == {"a": 4, "b": 2}
    for m in ("a", "b"):   # each model's percentiles are of its own rows only
        assert t.loc[m, "ttft_s_p50"] == pytest.approx(r.df[r.df["model"] == m]["ttft_s"].median())
    assert r.manifest["workload"]["models"] == {"a": 4, "b": 2} and r.manifest["model"] == ["a", "b"]
    assert any(line.startswith("model b: 2 ok of 2") for line in r.report().splitlines())
    plain = bench.run(http_engine(source.url), [REQ], max_requests=2, warmup=0, out_dir=tmp_path / "p",
                      progress=False, sample_s=None)
    assert "model" not in plain.df and not any(s.startswith("model ") for s in plain.report().splitlines())
