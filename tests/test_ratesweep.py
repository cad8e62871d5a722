"""The open-loop rate sweep: saturation judged by the backlog (earlier requests unfinished
when each one was due), on recorded-time frames built by hand (exact), then end to end: the
sweep stops at the first saturated level when the client can hold only one request at a time."""
import numpy as np
import pandas as pd

from infercourse.core.types import Request
from infercourse.measure.ratesweep import backlog, level_row, rate_sweep, saturated
from infercourse.testing import SSESource


def _level(sched, service, slots=1):
    """A hand-built level: requests due at `sched`, each taking `service` s once one of
    `slots` servers is free (FIFO). Returns a frame with the columns a level row reads."""
    free, rows = [0.0] * slots, []
    for i, (s, d) in enumerate(zip(sched, service)):
        k = int(np.argmin(free))
        start = max(s, free[k])
        free[k] = start + d
        rows.append({"request_id": i, "status": "ok", "scheduled_t": s, "sent_t": s, "end_t": start + d,
                     "e2e_s": start + d - s, "e2e_from_send_s": start + d - s, "ttft_s": start + d / 2 - s,
                     "dispatch_delay_s": 0.0, "output_tokens": 8, "prompt_tokens": 8})
    return pd.DataFrame(rows)


def test_one_slow_last_request_is_not_saturation():
    """Eight requests a second apart, each served in 0.2 s, the last in 5 s. Nothing was ever
    waiting, so the level kept up. (The old rule, completed rate against the span plus the
    fastest service time, read 8/12 s = 0.67 req/s < 90 % of 8/7.2 s and called it saturated.)"""
    df = _level(np.arange(8.0), [0.2] * 7 + [5.0])
    assert list(backlog(df)) == [0] * 8
    row = level_row(df, 1.0)
    assert row["requests_per_s"] < 0.9 * len(df) / (7 + 0.2)        # the old rule's trigger is there
    assert saturated(row) is None, row


def test_a_server_slower_than_the_rate_builds_a_backlog():
    """2 s of work arriving every second on one server: the backlog climbs by about half a
    request per arrival, whatever the last request did."""
    df = _level(np.arange(8.0), [2.0] * 8)
    b = backlog(df)
    assert b[-1] > b[len(b) // 2] > b[0] == 0, b
    row = level_row(df, 1.0)
    assert 0.4 < row["backlog_slope"] < 0.6 and "backlog grew" in saturated(row)


def test_overlap_on_a_server_with_slots_is_not_a_queue():
    """1.5 s requests every second on two slots: each arrival finds the previous one still
    running (backlog 1), but nothing piles up."""
    df = _level(np.arange(8.0), [1.5] * 8, slots=2)
    assert set(backlog(df)[1:]) == {1}
    assert saturated(level_row(df, 1.0)) is None


def test_one_slow_request_mid_level_is_not_saturation():
    """A single 4.5 s answer in a level of 0.2 s ones holds the backlog at 1 for four arrivals:
    the growth it fits stays under two requests."""
    df = _level(np.arange(10.0), [0.2, 0.2, 0.2, 4.5, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2], slots=2)
    assert backlog(df).max() == 1
    assert saturated(level_row(df, 1.0)) is None


def test_errors_and_client_waits_still_saturate():
    row = level_row(_level(np.arange(8.0), [0.2] * 8), 1.0)
    assert saturated(row) is None
    assert "error rate" in saturated({**row, "error_rate": 0.5})
    assert "waited" in saturated({**row, "dispatch_delay_s_p95": 0.5})


def test_sweep_stops_at_the_first_saturated_level(tmp_path):
    """0.2 s per request, one in flight at most. At 25 req/s each request is due 40 ms after
    the one before, which cannot have finished (the stand-in waits 0.2 s before its first
    token on any machine): the backlog climbs and the sweep stops, so 50 never runs. At 0.5
    req/s a request is due every 2 s: the backlog grows by two only if answers take about ten
    times the stand-in's own delay, and a single slow answer leaves the level kept up."""
    reqs = [Request(prompt=f"q{i}", max_tokens=5) for i in range(4)]
    with SSESource(ttft_s=0.2, gap_s=0.001) as src:
        from infercourse.engines.openai_http import OpenAIHTTPEngine
        eng = OpenAIHTTPEngine(src.url, model="x", api="completions")
        table, runs = rate_sweep(eng, reqs, [0.5, 25, 50], pattern="rate", requests_per_level=3, warmup=0,
                                 max_in_flight=1, out_dir=tmp_path, progress=False, sample_s=None)
    assert list(table.index) == [0.5, 25] and len(runs) == 2, table
    assert list(backlog(runs[1].df)) == [0, 1, 2]      # recorded: every earlier request still waiting
    assert table.loc[0.5, "saturated"] == "" and "backlog grew" in table.loc[25, "saturated"], table
    assert (tmp_path / "r25" / "manifest.json").is_file()


def test_cli_rate_sweep(tmp_path, capsys):
    from infercourse.cli import bench_main
    with SSESource(ttft_s=0.0, gap_s=0.001) as src:
        code = bench_main(["--engine", "http", "--url", src.url, "--pattern", "rate-sweep", "--rate-list", "2,4",
                           "--requests", "3", "--warmup", "0", "--no-progress", "--prompt-tokens", "8",
                           "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "offered_rps" in out and "saturated" in out, out
    assert (tmp_path / "r2" / "manifest.json").is_file()
