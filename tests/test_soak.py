"""The soak: samplers and drift on recorded data; short soaks against a real llama-server,
one of them with the server killed mid-run (restart counted, nothing measured lost)."""
import json
import math
import os
import signal
import threading
import time

import numpy as np
import pandas as pd
import pytest

from infercourse.core.types import Request
from infercourse.measure.results import load_run
from infercourse.measure.workloads import Workload
from infercourse.ops import sampling, soak

# llama-server (this build) `GET /metrics` with --metrics, trimmed.
METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1536
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 1024
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 812.5
"""
# vLLM labels its series per engine/model: summed.
VLLM = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
"""
SLOTS = [
    {"id": 0, "n_ctx": 1024, "is_processing": True, "n_prompt_tokens": 300,
     "next_token": [{"has_next_token": True, "n_decoded": 20, "n_remain": 12}]},
    {"id": 1, "n_ctx": 1024, "is_processing": False, "n_prompt_tokens": 180,
     "next_token": [{"has_next_token": False, "n_decoded": 4}]},
    {"id": 2, "n_ctx": 1024, "is_processing": False},                    # never used
]


def test_prometheus_values_keep_counters_and_gauges():
    v = sampling.prometheus_values(METRICS)
    assert v["llamacpp:prompt_tokens_total"] == 1536 and v["llamacpp:prompt_tokens_cached_total"] == 1024
    assert v["llamacpp:requests_processing"] == 2 and v["llamacpp:requests_deferred"] == 1
    assert "llamacpp:prompt_tokens_seconds" not in v                      # not asked for
    assert sampling.prometheus_values(VLLM)["vllm:num_requests_waiting"] == 5


def test_slots_usage_counts_prompt_and_generated_tokens():
    u = sampling.slots_usage(SLOTS)
    assert u["kv_used_tokens"] == 300 + 20 + 180 + 4 and u["kv_ctx_tokens"] == 3072
    assert u["kv_used_frac"] == pytest.approx(504 / 3072) and u["slots_busy"] == 1


def test_drift_finds_a_leak_and_not_a_flat_line():
    rng = np.random.default_rng(1)
    t = np.arange(600.0)                                   # ten minutes, one sample a second
    noise = np.cumsum(rng.normal(0, 0.05, t.size))         # correlated, like a real heap
    leak = sampling.drift(t, 200 + t * (30 / 3600) + noise)   # +30 MiB/h
    flat = sampling.drift(t, 200 + noise - noise.mean())
    assert leak["lo_per_h"] <= 30 <= leak["hi_per_h"] and leak["lo_per_h"] > 0
    assert flat["lo_per_h"] < 0 < flat["hi_per_h"] or abs(flat["slope_per_h"]) < leak["slope_per_h"] / 3
    assert leak["n"] == 480                                # first 20 % skipped as warm-up
    assert np.isnan(sampling.drift([0, 1], [1, 2])["slope_per_s"])        # too few samples


def test_durations_and_sampling_interval():
    assert soak.parse_duration("90") == 90 and soak.parse_duration("5m") == 300
    assert soak.parse_duration("24h") == 86400 and soak.parse_duration(30) == 30
    with pytest.raises(ValueError, match="not a duration"):
        soak.parse_duration("soon")
    assert soak.default_interval(30) == 1 and soak.default_interval(72 * 3600) == pytest.approx(129.6)


def test_mix_interleaves_short_chats():
    agentic = soak.soak_workload("agentic", max_calls=4)
    mix = soak.soak_workload("mix", max_calls=4)
    assert len(agentic.requests) == 4 and len(mix.requests) == 8
    assert mix.requests[0] == agentic.requests[0] and len(mix.requests[1].messages) == 1
    with pytest.raises(ValueError, match="unknown soak workload"):
        soak.soak_workload("chaos")


def test_soak_refuses_a_remote_server(tmp_path):
    from infercourse.core.errors import APILayerError
    with pytest.raises(APILayerError, match="loopback"):
        soak.soak("http://10.1.2.3:8000", duration_s=1, out_dir=tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()                                 # refused before anything ran


def test_soak_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        soak.soak_main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--duration" in out and "24h" in out and "--kill-at" in out


# Short chats keep the real-server tests light (the agentic calls prefill ~600 tokens each).
LIGHT = Workload("light", tuple(Request(messages=[{"role": "user", "content": q}], max_tokens=8)
                               for q in ("Say hi.", "Name a colour.", "Count to three.")))


@pytest.fixture
def server():
    from infercourse.servers import LlamaServer
    srv = LlamaServer(n_parallel=2, ctx_size=4096, threads=1)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_short_soak_writes_a_folder_report_reads(server, tmp_path, capsys):
    r = soak.soak(server, LIGHT, duration_s=8, concurrency=2,
                  interval_s=0.5, out_dir=tmp_path / "soak", progress=False)
    assert (r.df["status"] == "ok").sum() >= 1 and r.summary["requests"] == len(r.df)
    assert r.summary["restarts"] == 0 and r.summary["error_rate"] == 0
    assert len(r.samples) >= 2 and (r.samples["rss_mib"] > 0).all()
    assert {"llamacpp:requests_processing", "kv_used_frac"} <= set(r.samples.columns)
    man = json.loads((r.dir / "manifest.json").read_text())
    assert man["status"] == "ok" and man["soak"]["duration_s"] == 8 and "soak_summary" in man
    from infercourse.cli import report_main
    assert report_main([str(r.dir)]) == 0 and "ttft_s_p50" in capsys.readouterr().out


def _kill_after(srv, path, n_done, fired):
    """Kill the server once `n_done` requests are on disk: no assumption about speed."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n_done:
            fired["pid"] = srv.pid
            os.kill(srv.pid, signal.SIGKILL)
            return
        time.sleep(0.05)


@pytest.mark.slow
def test_killed_server_is_restarted_and_nothing_is_lost(server, tmp_path):
    out, fired = tmp_path / "soak", {}
    server.start()
    killer = threading.Thread(target=_kill_after, args=(server, out / "requests.jsonl", 1, fired), daemon=True)
    killer.start()
    r = soak.soak(server, LIGHT, duration_s=30, concurrency=2,
                  interval_s=0.5, out_dir=out, progress=False)
    killer.join(1)
    assert fired, "the server was never killed"
    assert r.summary["restarts"] == 1 and [e["event"] for e in r.events].count("crash") == 1
    assert server.pid != fired["pid"] and server.running              # a new process serves
    kept = load_run(out)
    rounds = kept.df["round"].tolist()
    assert rounds.count(0) >= 1                                       # measured before the kill: kept
    assert (kept.df[kept.df["round"] == 0]["status"] == "ok").any()
    assert kept.df["request_id"].is_unique
    assert set(r.samples["pid"].dropna().astype(int)) >= {fired["pid"], server.pid}
    events = [json.loads(x)["event"] for x in (out / "events.jsonl").read_text().splitlines()]
    assert events[-2:] == ["crash", "restart"]


@pytest.mark.slow
def test_crash_drill_after_n_answers(server, tmp_path):
    r = soak.soak(server, LIGHT, duration_s=20, concurrency=1, interval_s=0.5, kill_after_ok=2,
                  out_dir=tmp_path / "soak", progress=False)
    crash = next(e for e in r.events if e["event"] == "crash")
    assert r.summary["restarts"] == 1 and crash["pid"] != server.pid
    assert 0 < r.summary["drill_at_s"] <= crash["t_s"]                # the drill fired, and said when
    first_life = r.df[r.df["round"] == 0]
    assert (first_life["status"] == "ok").sum() == 2                  # killed right after the 2nd answer
    from infercourse.lessons.crash_drill import crash_split, drill_cost
    split = crash_split(r)                                            # the drill is planned, not a crash rate
    assert split["planned"] == 1 and split["unplanned"] == 0
    assert drill_cost(r) == int((first_life["status"] == "error").sum())   # one user: its request in flight


def test_soak_summary_names_crash_rate_error_rate_and_uptime_with_units():
    from infercourse.ops.sampling import headline, soak_summary
    df = pd.DataFrame({"status": ["ok", "ok", "error", "incomplete"], "ttft_s": [0.1, 0.2, None, None],
                       "e2e_s": [1.0, 1.1, None, None], "prompt_tokens": [10, 10, None, None],
                       "cached_tokens": [0, 5, None, None], "output_tokens": [4, 4, 0, 0],
                       "scheduled_t": [0.0, 1.0, 2.0, 3.0], "end_t": [1.0, 2.1, 2.5, 3.5]})
    samples = pd.DataFrame({"t_s": [0.0, 1.0, 2.0, 3.0], "up": [True, False, True, True], "rss_mib": 100.0,
                            "pid": [1, 1, 2, 2]})
    events = [{"t_s": 1.0, "event": "drill_kill", "pid": 1}, {"t_s": 1.2, "event": "crash", "pid": 1},
              {"t_s": 1.8, "event": "restart", "took_s": 0.6}]
    s = soak_summary(df, samples, events, duration_s=360.0)
    # the drill's kill is a crash, but not an unplanned one: 15 printed crash_rate_per_h 120 beside "0 unplanned"
    assert s["crashes"] == 1 and s["drill_kills"] == 1 and s["crash_rate_per_h"] == 0.0
    assert "crash rate 0 /h (0 unplanned crash(es) in 0.1 h, plus 1 planned drill kill(s))" in headline(s)
    events += [{"t_s": 2.5, "event": "crash", "pid": 2}]
    s = soak_summary(df, samples, events, duration_s=360.0)
    assert s["crashes_unplanned"] == 1 and s["crash_rate_per_h"] == pytest.approx(10.0)      # 1 crash in 0.1 h
    assert s["incomplete_at_end"] == 1 and s["error_rate_pct"] == pytest.approx(100 / 3)   # cut-off not counted
    assert s["uptime_pct"] == pytest.approx(75.0) and s["drill_at_s"] == 1.0
    line = headline(s)
    assert "crash rate 10 /h" in line and "error rate 33.3 % of 3 requests" in line and "uptime 75.0 %" in line
    assert math.isnan(soak_summary(df, samples, [], 360.0)["drill_at_s"])      # no drill: said, not assumed


class _Watch:
    """A stand-in async engine that notes, as each request starts, which requests are still in
    flight (events, not timings: each request yields to the loop a few times before it ends)."""

    def __init__(self):
        self.in_flight, self.overlaps = set(), []

    async def astream(self, request, client=None):
        import asyncio

        from infercourse.core.types import Event
        user, call = request.prompt.split("-")
        earlier = {p for p in self.in_flight if p.startswith(user + "-") and int(p.split("c")[-1]) < int(call[1:])}
        self.overlaps += [(p, request.prompt) for p in earlier]
        self.in_flight.add(request.prompt)
        for _ in range(3 + int(call[1:])):                 # later calls are longer, as an agent's are
            await asyncio.sleep(0)
        self.in_flight.discard(request.prompt)
        yield Event(t=time.perf_counter(), text="x", n_tokens=1)
        yield Event(t=time.perf_counter(), done=True)


def _closed_loop(layout, lanes, users=2, n_calls=3, user=lambda i, users: i % users):
    from infercourse.measure import loadgen
    n = users * n_calls * 2                                 # each user runs the workload twice
    reqs = [Request(prompt=f"u{user(i, users)}-c{layout(i, n_calls, users)}") for i in range(n)]
    eng, sink = _Watch(), type("Sink", (), {"submit": lambda self, tr: None})()
    st = loadgen.State(sink, None)
    loadgen.loop_in_thread(lambda: loadgen.run_async(eng, reqs, None, users, 256, None, [], st, None,
                                                     [{}] * n, lanes=lanes))
    return eng, st


def test_each_soak_user_sends_its_session_in_order():
    """15: the closed loop handed one recorded session's calls to two workers from one list, so
    call k + 1 went out while call k still prefilled (its prefix could not be cached yet). Each
    user now runs the workload as one session: no call of a user starts while its earlier one
    is in flight."""
    eng, st = _closed_loop(soak.user_position, lanes=True)
    assert not eng.overlaps and len(st.traces) == 12 and all(t.status == "ok" for t in st.traces)
    for user, calls in ((0, [0, 1, 2, 0, 1, 2]), (1, [1, 2, 0, 1, 2, 0])):   # in order, out of phase
        mine = sorted(t.request_id for t in st.traces if t.request_id % 2 == user)
        assert [soak.user_position(i, 3, 2) for i in mine] == calls
    # the old way: one session's list (c0 c1 c2 c0 ...) through one queue, two workers
    shared, _ = _closed_loop(lambda i, n, users: i % n, lanes=False, user=lambda i, users: 0)
    assert ("u0-c0", "u0-c1") in shared.overlaps                           # call 1 sent while call 0 ran
