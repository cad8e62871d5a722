"""The latency lesson's library (notebook 10): definitions checked on synthetic traces with
hand-computed answers, and the overload runs against a stand-in server on an exact clock."""
import pandas as pd
import pytest

from infercourse.core import metrics, summary
from infercourse.core.trace import RequestTrace
from infercourse.lessons import latency as lesson, latency_dist as dist


def trace(i, sched, sent, ttft, gaps, tokens=None, status="ok"):
    t = [sent + ttft]
    for g in gaps:
        t.append(t[-1] + g)
    tokens = tokens or [1] * len(t)
    return RequestTrace(request_id=i, scheduled_t=sched, sent_t=sent, chunk_t=t, chunk_tokens=tokens,
                        end_t=t[-1], completion_tokens=sum(tokens), prompt_tokens=10, status=status)


def test_anatomy_of_one_request():
    tr = trace(0, 0.0, 0.0, 0.5, [0.1, 0.1, 0.3])        # 4 tokens, end at 1.0 s
    a = lesson.anatomy(tr)
    assert a["ttft_s"] == pytest.approx(0.5) and a["e2e_s"] == pytest.approx(1.0)
    assert a["tpot_s"] == pytest.approx(0.5 / 3) and a["itl_max_s"] == pytest.approx(0.3)
    assert a["e2e_tok_per_s"] == pytest.approx(4.0) and a["decode_tok_per_s"] == pytest.approx(3 / 0.5)


def test_peer_table_uses_each_tools_definition():
    # scheduled 1 s before the send; TTFT from send 0.5 s; 5 tokens, 0.1 s apart; end 0.9 s after send
    trs = [trace(0, 0.0, 1.0, 0.5, [0.1] * 4)]
    df, itl = metrics.per_request_frame(trs), metrics.itl_frame(trs)
    t = dist.peer_table(df, itl)
    assert t.loc["TTFT p50 (ms)", "infercourse"] == pytest.approx(1500)     # from the schedule
    assert t.loc["TTFT p50 (ms)", "vLLM bench serve"] == pytest.approx(500)  # from the send
    assert t.loc["TPOT p50 (ms)", "vLLM bench serve"] == pytest.approx(100)  # first token excluded
    assert t.loc["TPOT p50 (ms)", "GuideLLM"] == pytest.approx(900 / 5)      # first token included
    assert t.loc["ITL p50 (ms)", "GuideLLM"] == pytest.approx(100)           # a per-request mean
    assert t.loc["E2E p50 (ms)", "infercourse"] == pytest.approx(1900)


def test_rechunk_keeps_tokens_and_times_and_changes_only_chunk_metrics():
    trs = [trace(i, 0.0, 0.0, 0.2, [0.05] * 11) for i in range(3)]      # 12 tokens each
    four = dist.rechunk(trs, 4)
    assert four[0].chunk_tokens == [4, 4, 4] and four[0].chunk_t[-1] == trs[0].chunk_t[-1]
    assert metrics.output_tokens(four[0]) == 12 and metrics.e2e_s(four[0]) == metrics.e2e_s(trs[0])
    assert metrics.decode_tok_per_s(four[0]) == pytest.approx(metrics.decode_tok_per_s(trs[0]))
    assert metrics.itl_s(four[0]) == pytest.approx([0.2, 0.2])           # 4 gaps of 0.05 each
    assert metrics.ttft_s(four[0]) == pytest.approx(0.2 + 3 * 0.05)      # waits for its 4th token
    assert metrics.tpot_s(four[0]) == pytest.approx(0.4 / 11)            # (E2E - TTFT) / (n - 1)
    tab = dist.chunking_table(trs, 4)
    assert tab.loc["ITL p50, per chunk (ms)", "4 tokens per chunk"] == pytest.approx(200)
    assert tab.loc["ITL p50, per chunk (ms)", "as streamed"] == pytest.approx(50)
    assert tab.loc["E2E p50 (ms)"].nunique() == 1 and tab.loc["tokens per chunk"].tolist() == [1, 4]


def test_predicted_wait():
    assert lesson.predicted_wait(1, 3.0) == 1.0                   # the first never waits
    assert lesson.predicted_wait(8, 3.0) == pytest.approx(1 + 7 * 2 / 3)
    assert lesson.predicted_wait(8, 0.5) == 1.0                   # under capacity: no queue


def test_distribution_table_says_n_too_small():
    trs = [trace(i, float(i), float(i), 0.1 + 0.01 * i, [0.02] * 9) for i in range(20)]
    tab = dist.distribution_table(metrics.per_request_frame(trs), metrics.itl_frame(trs))
    assert tab.loc["ttft_s", "n"] == 20 and "n too small: need 368" in tab.loc["ttft_s", "p99 (ms)"]
    assert "[" in tab.loc["ttft_s", "p50 (ms)"]
    assert tab.loc["itl_s", "n"] == 180 and "n too small" not in tab.loc["itl_s", "p95 (ms)"]


def test_server_vs_client_reads_llama_server_timings():
    tr = trace(0, 0.0, 0.0, 0.5, [0.1] * 4)          # decode span 0.4 s, 5 tokens
    tr.engine_timings = {"prompt_n": 10, "prompt_ms": 450.0, "predicted_n": 5, "predicted_ms": 380.0}
    t = lesson.server_vs_client([tr, trace(1, 0, 0, 1, [1], status="error")])
    assert t.loc["prefill (ms)", "client"] == pytest.approx(500)
    assert t.loc["prefill (ms)", "server"] == pytest.approx(450)
    assert t.loc["decode (ms)", "client - server"] == pytest.approx(20)
    assert t.loc["decode_tokens", "agree"] == "100%"


@pytest.mark.slow
def test_overload_queue_moves_between_client_and_server():
    # A stand-in server with an exact clock: the two overload runs put the same queue in
    # the client, then in the server; only the scheduled-send clock sees both.
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    from infercourse.ops.profiles import profile
    from infercourse.testing import SSESource
    p = profile("cpu", prompt_tokens=6, max_tokens=4)
    with SSESource(ttft_s=0.05, gap_s=0.01) as src:
        eng = OpenAIHTTPEngine(src.url, api="completions")
        reqs = lesson.requests_for(eng, p, 2)
        seq = lesson.sequential(eng, reqs, 3)
        s = float(seq.df["e2e_s"].median())
        runs = {cq: lesson.overload(eng, reqs, s, factor=3.0, n=6, client_queue=cq) for cq in (True, False)}
    for cq, res in runs.items():
        d = res.df.sort_values("scheduled_t")
        assert summary.status_counts(d)["ok"] == 6
        # TTFT from the schedule = the wait before the send + TTFT from the send, per request
        assert (d["ttft_s"] - d["ttft_from_send_s"]).to_numpy() == pytest.approx(d["dispatch_delay_s"].to_numpy())
    client, on_time = runs[True].df.sort_values("scheduled_t"), runs[False].df
    # one in flight: the sends fall further behind schedule with every request, and only the
    # scheduled clock shows it (ratios within one run: no speed assumed). The stand-in
    # serves every stream at once, so sent on time nothing queues anywhere.
    w = lesson.measured_wait(runs[True])
    assert w["overload"] == pytest.approx(3.0 * w["service_s"] / s)
    assert "last dispatch delay (ms)" in lesson.wait_table({"a": w}).index
    assert w["last_ttft_s"] > 2 * client["ttft_s"].iloc[0]
    assert w["last_ttft_s"] > 2 * w["last_ttft_from_send_s"]
    assert client["dispatch_delay_s"].max() > 2 * on_time["dispatch_delay_s"].max()
    assert isinstance(dist.peer_table(client, metrics.itl_frame(runs[True].traces)), pd.DataFrame)


def test_bursty_stalls_widen_the_block_interval():
    """Stalls that hit whole requests: resampling requests as blocks gives a wider p99
    interval than the order-statistic one, which treats 400 gaps as independent."""
    import numpy as np
    rng = np.random.default_rng(0)
    traces = [trace(i, 0.0, 0.0, 0.1, list(rng.uniform(0.009, 0.011, 40) * (5 if i % 5 == 0 else 1)))
              for i in range(10)]
    itl = metrics.itl_frame(traces)
    blocks = dist.pooled_tail_by_blocks(itl, 99)
    s = summary.summarize(pd.DataFrame({"status": ["ok"]}), [], itl=itl).loc["itl_s"]
    assert blocks["blocks"] == 10 and blocks["lo"] <= blocks["p"] <= blocks["hi"]
    assert blocks["hi"] - blocks["lo"] > s["p99_hi"] - s["p99_lo"]
    assert blocks["lo"] < 0.02       # resamples without the stalled requests exist: the tail is uncertain


def test_distribution_table_keeps_one_number_format():
    traces = [trace(i, 0.0, 0.0, 10.94 + i, [0.01] * 8) for i in range(8)]
    tab = dist.distribution_table(metrics.per_request_frame(traces), metrics.itl_frame(traces))
    assert not tab.astype(str).apply(lambda c: c.str.contains("e+", regex=False)).any().any()
    assert tab.loc["ttft_s", "p50 (ms)"].startswith("14,440")      # thousands separated, no decimals


def test_clock_verdicts_catch_coordinated_omission():
    import numpy as np
    rng = np.random.default_rng(1)
    base = [trace(i, 10.0 * i, 10.0 * i, 0.1 * rng.uniform(0.95, 1.05), [0.01] * 4) for i in range(12)]
    # overload: each request sent 1 s later than the one before was due, then served like unloaded
    late = [trace(i, 0.3 * i, 1.0 * i, 0.1 * rng.uniform(0.95, 1.05), [0.01] * 4) for i in range(1, 12)]
    v = lesson.clock_verdicts(metrics.per_request_frame(base), metrics.per_request_frame(late))
    assert v.loc["TTFT from the scheduled send", "verdict"] == "overload slower"
    assert v.loc["TTFT from the actual send", "verdict"] == "within noise"
    assert "A/A" in v.attrs["noise_floor_text"]


def test_pooled_tail_note_says_which_interval_to_trust():
    import numpy as np
    rng = np.random.default_rng(0)
    bursty = [trace(i, 0.0, 0.0, 0.1, list(rng.uniform(0.009, 0.011, 40) * (5 if i % 5 == 0 else 1)))
              for i in range(10)]
    assert "trust the block interval" in dist.pooled_tail_note(metrics.itl_frame(bursty))
    few = metrics.itl_frame(bursty[:3])
    assert "too few for a p99 interval" in dist.pooled_tail_note(few) and "(3)" in dist.pooled_tail_note(few)


@pytest.mark.slow
def test_exercise_reruns_change_one_setting_on_a_fresh_server():
    """The exercises' reruns on a stand-in with an exact clock. Its sleeps are lower bounds
    (a busy machine only adds), so no speed is assumed: 16 forced tokens cannot arrive
    before 15 gaps have passed, which 4 tokens (the profile's length) would; and with one
    request in flight at 3x the rate the last one waits for the five before it."""
    from infercourse.ops.profiles import profile
    from infercourse.testing import SSESource
    ttft, gap = 0.05, 0.01
    with SSESource(ttft_s=ttft, gap_s=gap) as src:
        p = profile("cpu", prompt_tokens=6, max_tokens=4, server_url=src.url)
        e16 = lesson.e2e_p50_s(p, 3, max_tokens=16)
        # the rate is set from the shortest possible request, so it is at least 3x what one slot serves
        wait = lesson.overload_wait(p, ttft + 3 * gap, factor=3.0, n=6, client_queue=True)
    assert e16 >= ttft + 15 * gap
    # last E2E >= first request + the 3 longest of 5 completion gaps - its 5/3 S head start:
    # at least 3 - 2/3 of the median gap, whatever the machine's speed
    assert wait > 2.0


# ---- issue 31 §2: a verdict the notebook's own sizes can reach, and a sentence from it --------
def _frames(n_unloaded: int, n_loaded: int, seed: int = 0, send_slow: float = 1.0):
    """An unloaded run and a client-queued overload run: request i of the overload is sent
    i × 0.7 s after its schedule, then served like an unloaded one (× `send_slow`)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    base = [trace(i, 10.0 * i, 10.0 * i, 0.1 * rng.uniform(0.95, 1.05), [0.01] * 4) for i in range(n_unloaded)]
    late = [trace(i, 0.3 * i, 1.0 * i, 0.1 * send_slow * rng.uniform(0.95, 1.05), [0.01] * 4)
            for i in range(n_loaded)]
    return metrics.per_request_frame(base), metrics.per_request_frame(late)


def _notebook_sizes() -> dict[str, tuple[int, int]]:
    """(unloaded requests, overload requests) of notebook 10 at its full size and at CI size."""
    import json
    from pathlib import Path
    from infercourse.ops.profiles import profile
    root = Path(__file__).resolve().parents[1]
    nb = json.loads((root / "notebooks" / "10_latency_metrics.ipynb").read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    full: dict = {}
    exec("".join(cell["source"]), {}, full)
    ci = {**full, **json.loads((root / "notebooks" / "ci_params.json").read_text())["10_latency_metrics"]}
    return {name: (v["N_REQUESTS"] or profile(v["PROFILE"]).n_requests, v["CO_REQUESTS"])
            for name, v in (("full", full), ("ci", ci))}


@pytest.mark.parametrize("size", ["full", "ci"])
def test_clock_verdicts_can_pass_at_the_notebooks_own_sizes(size):
    """The old band test needed 6 pairs and 10 judged 4: 'too few pairs' by construction.
    At the notebook's parameters the scheduled clock must be able to call the overload."""
    from infercourse.measure import noise
    n_un, n_co = _notebook_sizes()[size]
    assert lesson.clock_blocks(n_un, n_co) >= 3
    v = lesson.clock_verdicts(*_frames(n_un, n_co))
    assert v["verdict"].tolist() == ["overload slower", "within noise"], v
    assert (v["needs"] <= v["blocks"]).all() and noise.TOO_FEW not in v["verdict"].tolist()


def test_clock_sentence_says_which_clock_saw_the_overload():
    import re
    hid = lesson.clock_sentence(lesson.clock_verdicts(*_frames(16, 8)))
    both = lesson.clock_sentence(lesson.clock_verdicts(*_frames(16, 8, send_slow=3.0)))
    few = lesson.clock_sentence(lesson.clock_verdicts(*_frames(4, 8)))
    idle = lesson.clock_sentence(lesson.clock_verdicts(*_frames(16, 8, send_slow=1.0))
                                 .assign(verdict=["within noise", "within noise"]))
    assert re.search(r"\bsend clock hides it\b", hid) and "coordinated omission" in hid
    assert "**saw the overload**" in hid and "**did not see it**" in hid
    assert re.search(r"\bBoth clocks saw\b", both) and "hides it" not in both
    assert re.search(r"\bcannot say which clock\b", few) and "**cannot tell**" in few and "hides it" not in few
    assert re.search(r"\bdoes not show one clock hiding\b", idle) and "hides it" not in idle


def test_pooled_tail_note_compares_like_with_like():
    """10 printed 'no wider: this run's stalls did not cluster' from a 16-block bootstrap set
    beside an order-statistic interval. Here every slow gap sits in one request: the note
    counts that, and compares the block bootstrap with the same bootstrap drawn gap by gap."""
    import numpy as np
    rng = np.random.default_rng(0)

    def run(burst: int, who=(3,)):
        trs = []
        for i in range(16):
            g = rng.uniform(0.009, 0.011, 31)
            if i in who:
                g[5:5 + burst] *= rng.uniform(3, 6, burst)
            trs.append(trace(i, 0.0, 0.0, 0.1, list(g)))
        return dist.pooled_tail_note(metrics.itl_frame(trs))
    one = run(6)
    assert "did not cluster" not in one and "came from 1 of the 16 requests" in one
    assert "gaps one by one" in one and "overstated nothing" in one
    wide = run(12)
    assert "trust the block interval" in wide and "overstated nothing" not in wide
    b = dist.pooled_tail_by_blocks(metrics.itl_frame([trace(i, 0, 0, 0.1, [0.01] * 30) for i in range(4)]))
    assert {"iid_lo", "iid_hi", "lo", "hi"} <= set(b)
