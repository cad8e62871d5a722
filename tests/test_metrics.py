"""Metric definitions checked against hand-computed answers on synthetic traces."""
import math

import numpy as np
import pandas as pd
import pytest

from infercourse.core import metrics as M
from infercourse.core import reconcile as R
from infercourse.core import summary as S
from infercourse.core.types import Event, Usage
from infercourse.core.trace import RequestTrace, trace_from_events


def multi_chunk():
    # scheduled 10.0, sent 10.5 (0.5 s late); chunks of 1, 2, 3 tokens; end 11.7
    return RequestTrace(request_id=1, scheduled_t=10.0, sent_t=10.5,
                        chunk_t=[11.0, 11.2, 11.6], chunk_tokens=[1, 2, 3], end_t=11.7,
                        prompt_tokens=100, completion_tokens=6, cached_tokens=20,
                        token_source="server", tags={"prompt_len": 100})


def empty_first():
    # a chunk with text but 0 tokens (e.g. a role header) arrives first
    return RequestTrace(request_id=2, scheduled_t=0.0, sent_t=0.0,
                        chunk_t=[1.0, 1.5, 2.0], chunk_tokens=[0, 1, 1], end_t=2.0)


def errored():
    return RequestTrace(request_id=3, scheduled_t=0.0, sent_t=0.1, chunk_t=[0.3, 0.4],
                        chunk_tokens=[1, 1], end_t=0.9, status="error", error="ReadTimeout: x")


def zero_output():
    return RequestTrace(request_id=4, scheduled_t=0.0, sent_t=0.0, end_t=0.2,
                        prompt_tokens=5, completion_tokens=0)


def test_multi_token_chunks_scheduled_vs_sent():
    tr = multi_chunk()
    assert M.ttft_s(tr) == pytest.approx(1.0)
    assert M.ttft_from_send_s(tr) == pytest.approx(0.5)
    assert M.dispatch_delay_s(tr) == pytest.approx(0.5)
    assert M.e2e_s(tr) == pytest.approx(1.7)
    assert M.e2e_from_send_s(tr) == pytest.approx(1.2)
    assert M.tpot_s(tr) == pytest.approx(0.7 / 5)
    assert M.itl_s(tr) == pytest.approx([0.2, 0.4])
    assert M.tokens_per_chunk(tr) == pytest.approx(2.0)
    assert M.prefill_tok_per_s(tr) == pytest.approx(80 / 0.5)      # uncached only
    assert M.decode_tok_per_s(tr) == pytest.approx(5 / 0.6)         # 6 - first chunk's 1


def test_empty_first_chunk_is_not_the_first_token():
    tr = empty_first()
    assert M.output_tokens(tr) == 2                                  # no usage: chunk sum
    assert M.ttft_s(tr) == pytest.approx(1.5)
    assert M.itl_s(tr) == pytest.approx([0.5])
    assert M.tpot_s(tr) == pytest.approx(0.5)
    assert M.decode_tok_per_s(tr) == pytest.approx(2.0)


def test_trace_from_events_drops_keepalives_then_metrics():
    ev = [Event(t=0.5), Event(t=1.0, text="Hi", n_tokens=1), Event(t=1.25, text=" there", n_tokens=2),
          Event(t=1.3, done=True, usage=Usage(7, 3, 0, "server"), timings={"predicted_n": 3})]
    tr = trace_from_events(ev, request_id=0, scheduled_t=0.0, sent_t=0.2)
    assert M.ttft_s(tr) == pytest.approx(1.0) and M.ttft_from_send_s(tr) == pytest.approx(0.8)
    assert M.tpot_s(tr) == pytest.approx(0.3 / 2)
    assert M.decode_tok_per_s(tr) == pytest.approx(2 / 0.25)


def test_error_and_zero_output():
    e = errored()
    assert M.ttft_s(e) == pytest.approx(0.3)        # a token did arrive before the error
    assert M.e2e_s(e) == pytest.approx(0.9)
    z = zero_output()
    assert M.ttft_s(z) is None and M.tpot_s(z) is None and M.decode_tok_per_s(z) is None
    assert M.itl_s(z) == [] and M.tokens_per_chunk(z) is None
    assert M.e2e_s(z) == pytest.approx(0.2)
    one = RequestTrace(request_id=5, scheduled_t=0, sent_t=0, chunk_t=[0.1], chunk_tokens=[1],
                       end_t=0.1, completion_tokens=1)
    assert M.tpot_s(one) is None and M.decode_tok_per_s(one) is None


def test_per_request_frame_and_itl_frame():
    trs = [multi_chunk(), empty_first(), errored(), zero_output()]
    df = M.per_request_frame(trs)
    assert len(df) == 4 and list(df["request_id"]) == [1, 2, 3, 4]
    assert df.loc[0, "prompt_len"] == 100                           # tag became a column
    assert df.loc[0, "cached_fraction"] == pytest.approx(0.2)
    assert math.isnan(df.loc[3, "ttft_s"]) and df.loc[3, "output_tokens"] == 0
    assert df.loc[0, "itl_max_s"] == pytest.approx(0.4)
    itl = M.itl_frame(trs)
    assert len(itl) == 2 + 1 + 1                                   # gaps per request
    assert itl[itl.request_id == 1]["tokens"].tolist() == [2, 3]
    pooled = S.summarize(itl, ["itl_s"]).loc["itl_s"]          # errored request's gap dropped
    assert pooled["count"] == 3 and pooled["max"] == pytest.approx(0.5)
    assert S.error_rate(df) == pytest.approx(0.25)
    assert list(df.columns[:len(M.FRAME_COLUMNS)]) == M.FRAME_COLUMNS


def test_empty_run_has_columns_and_no_crash():
    df = M.per_request_frame([])
    assert list(df.columns) == M.FRAME_COLUMNS and len(df) == 0
    assert S.throughput(df)["completed"] == 0 and math.isnan(S.error_rate(df))
    assert S.goodput(df, {"ttft_s": 1.0})["n_good"] == 0


def test_throughput_over_wall_window():
    df = M.per_request_frame([multi_chunk(), empty_first(), errored()])
    tp = S.throughput(df)
    assert tp["wall_s"] == pytest.approx(11.7 - 0.0)               # first scheduled -> last end
    assert tp["completed"] == 2
    assert tp["output_tok_per_s"] == pytest.approx((6 + 2) / 11.7)  # errored tokens don't count
    assert tp["requests_per_s"] == pytest.approx(2 / 11.7)


def test_order_statistic_interval_covers_at_the_nominal_rate():
    # §2.9: across many seeded samples from a known distribution, the interval holds the
    # true quantile at (at least, and about) the nominal 95%, with no assumption on shape
    rng = np.random.default_rng(1)
    n, trials = 120, 2000
    for p, true in [(50, math.log(2)), (90, math.log(10))]:
        l, u = S.order_stat_ci(n, p / 100, 0.95)
        x = np.sort(rng.exponential(1.0, (trials, n)), axis=1)
        cover = np.mean((x[:, l - 1] <= true) & (true <= x[:, u - 1]))
        assert 0.935 <= cover <= 0.99, (p, cover)
    # the interval is a pair of observed samples around the point estimate
    x = rng.exponential(1.0, 4000)
    row = S.summarize(pd.DataFrame({"status": "ok", "ttft_s": x}), ["ttft_s"]).loc["ttft_s"]
    for p in (50, 99):
        assert row[f"p{p}_lo"] <= row[f"p{p}"] <= row[f"p{p}_hi"]
        assert row[f"p{p}_lo"] in x and row[f"p{p}_hi"] in x
    assert row["n_too_small"] == "" and row["count"] == 4000 and row["max"] == x.max()


def test_the_median_interval_is_the_sorted_values_at_the_order_statistic_ranks():
    x = [5.0, -1.0, 3.0, 9.0, 0.5, 2.0, 7.0, 4.0]        # unsorted; n = 8: ranks (1, 8)
    assert S.order_stat_ci(8, 0.5) == (1, 8) and S.median_interval(x) == (-1.0, 9.0)
    l, u = S.order_stat_ci(40, 0.5)
    y = np.random.default_rng(2).normal(size=40)
    assert S.median_interval(y) == (np.sort(y)[l - 1], np.sort(y)[u - 1])
    assert S.median_interval(x[:5]) is None                 # under min_n(0.5) = 6: no interval


def test_n_too_small_gives_nan_bounds_a_flag_and_says_so():
    for q in (0.5, 0.9, 0.95, 0.99):
        need = S.min_n(q)
        assert S.order_stat_ci(need - 1, q) is None and S.order_stat_ci(need, q) is not None
    assert (S.min_n(0.5), S.min_n(0.95), S.min_n(0.99)) == (6, 72, 368)
    x = np.random.default_rng(0).exponential(1.0, 40)        # enough for p50 and p90 only
    s = S.summarize(pd.DataFrame({"status": "ok", "ttft_s": x}), ["ttft_s"])
    row = s.loc["ttft_s"]
    assert row["n_too_small"] == "p95,p99"
    assert math.isnan(row["p99_lo"]) and math.isnan(row["p99_hi"]) and not math.isnan(row["p99"])
    assert not math.isnan(row["p90_lo"])
    assert "n too small" in S.ci_text(s, "ttft_s", 99) and "368" in S.ci_text(s, "ttft_s", 99)
    assert "[" in S.ci_text(s, "ttft_s", 50)


def test_long_series_interval_is_tight():
    x = np.random.default_rng(3).exponential(1.0, 50_000)
    s = S.summarize(pd.DataFrame({"status": "ok", "itl_s": x}), ["itl_s"])
    assert s.loc["itl_s", "p50_lo"] <= math.log(2) <= s.loc["itl_s", "p50_hi"]
    assert s.loc["itl_s", "p50_hi"] - s.loc["itl_s", "p50_lo"] < 0.05


def test_summarize_excludes_errors_visibly():
    df = M.per_request_frame([multi_chunk(), errored()])
    s = S.summarize(df, ["ttft_s"])
    assert s.loc["ttft_s", "count"] == 1 and s.loc["ttft_s", "excluded"] == 1
    assert S.summarize(df, ["ttft_s"], failures="inf").loc["ttft_s", "count"] == 2


def test_summary_counts_every_status_and_offers_a_conservative_view():
    # §2.2: ok / error / incomplete counted; failures="inf" keeps them at the tail
    cut = RequestTrace(request_id=9, scheduled_t=0.0, sent_t=0.0, chunk_t=[2.0], chunk_tokens=[1],
                       end_t=5.0, status="incomplete")
    df = M.per_request_frame([multi_chunk(), empty_first(), errored(), cut])
    s = S.summarize(df, ["ttft_s", "e2e_s", "decode_tok_per_s"])
    assert s.attrs["status_counts"] == {"ok": 2, "error": 1, "incomplete": 1, "total": 4}
    assert s.loc["ttft_s", "count"] == 2 and s.loc["ttft_s", "excluded"] == 2
    c = S.summarize(df, ["ttft_s", "e2e_s", "decode_tok_per_s"], failures="inf")
    assert c.loc["e2e_s", "count"] == 4 and c.loc["e2e_s", "excluded"] == 0
    assert c.loc["e2e_s", "p99"] == math.inf and c.loc["e2e_s", "max"] == math.inf
    assert c.loc["e2e_s", "p50"] > s.loc["e2e_s", "p50"]          # the tail moved right
    assert c.loc["decode_tok_per_s", "min"] == 0.0                # speeds: failures count as 0
    with pytest.raises(ValueError, match="failures"):
        S.summarize(df, failures="drop")


def test_pooled_itl_is_not_a_mean_of_means():
    # §2.10: one request with a single 1.0 s gap, one with nine 0.1 s gaps
    a = RequestTrace(request_id=0, scheduled_t=0, sent_t=0, chunk_t=[0.1, 1.1], chunk_tokens=[1, 1],
                     end_t=1.1)
    b = RequestTrace(request_id=1, scheduled_t=0, sent_t=0, chunk_t=[0.1 * k for k in range(1, 11)],
                     chunk_tokens=[1] * 10, end_t=1.0)
    trs = [a, b, errored()]
    s = S.summarize(M.per_request_frame(trs), ["itl_mean_s"], itl=M.itl_frame(trs))
    assert s.loc["itl_mean_s", "p50"] == pytest.approx(0.55)      # mean of per-request means
    assert s.loc["itl_s", "count"] == 10 and s.loc["itl_s", "excluded"] == 1
    assert s.loc["itl_s", "p50"] == pytest.approx(0.1)             # pooled gaps: vLLM's ITL
    assert s.loc["itl_s", "max"] == pytest.approx(1.0)


def test_prefill_speed_undefined_when_the_whole_prompt_was_cached():
    # §2.6: no prefill work done: no speed (None), never 0.0
    tr = multi_chunk()
    tr.cached_tokens = tr.prompt_tokens
    assert M.prefill_tok_per_s(tr) is None
    assert math.isnan(M.per_request_frame([tr]).loc[0, "prefill_tok_per_s"])


def test_goodput_all_slos_must_hold():
    df = M.per_request_frame([multi_chunk(), empty_first(), errored(), zero_output()])
    # ttft: 1.0, 1.5, (error), None(zero output fails ttft); tpot: 0.14, 0.5
    g = S.goodput(df, {"ttft_s": 1.2, "tpot_s": 0.2})
    assert g["n_good"] == 1 and g["good_fraction"] == pytest.approx(0.25)
    assert S.goodput(df, {"ttft_s": 2.0})["n_good"] == 2
    assert S.goodput(df, {"ttft_s": 2.0, "tpot_s": 0.2})["n_good"] == 1
    assert S.goodput(df, {"decode_tok_per_s": 5})["n_good"] == 1    # lower bound: 8.3 vs 2
    assert g["n_failed"] == 1 and g["n_unmeasurable"] == 1          # zero_output: no TTFT


def test_goodput_undefined_is_not_met():
    # §2.1: a server that buffers 200 tokens into one chunk has no ITL and no decode
    # speed; that must not pass an ITL or decode SLO
    buffered = RequestTrace(request_id=1, scheduled_t=0.0, sent_t=0.0, chunk_t=[0.3],
                            chunk_tokens=[200], end_t=0.3, completion_tokens=200)
    one = RequestTrace(request_id=2, scheduled_t=0, sent_t=0, chunk_t=[0.1], chunk_tokens=[1],
                       end_t=0.1, completion_tokens=1)
    df = M.per_request_frame([buffered, one, multi_chunk()])
    for slo in ({"itl_max_s": 0.5}, {"decode_tok_per_s": 1.0}, {"tpot_s": 1.0, "itl_mean_s": 1.0}):
        g = S.goodput(df, slo)
        assert g["n_good"] == 1 and g["n_unmeasurable"] == 2, slo
    assert S.goodput(df, {"ttft_s": 2.0})["n_unmeasurable"] == 0


def test_goodput_validation():
    df = M.per_request_frame([multi_chunk()])
    with pytest.raises(ValueError, match="unknown SLO metric 'ttft'"):
        S.goodput(df, {"ttft": 0.5})
    for bad in (0, -1, float("nan"), float("inf"), "0.5"):
        with pytest.raises(ValueError, match="positive finite"):
            S.goodput(df, {"ttft_s": bad})
    with pytest.warns(UserWarning, match="no request met SLO ttft_s"):
        g = S.goodput(df, {"ttft_s": 1e-9})
    assert g["n_good"] == 0 and g["goodput_requests_per_s"] == 0


def consistent_llamaserver():
    tr = multi_chunk()   # ttft from send 0.5 s, decode 0.6 s, 6 tokens, 80 uncached
    tr.engine_timings = {"prompt_n": 80, "prompt_ms": 470.0, "predicted_n": 6,
                         "predicted_ms": 580.0, "cache_n": 20}
    return tr


def test_reconcile_passes_consistent_and_flags_disagreement():
    rec = R.reconcile(consistent_llamaserver())
    assert set(rec["quantity"]) == {"prefill_tokens", "decode_tokens", "prefill_s", "decode_s"}
    assert rec["ok"].all()
    bad = consistent_llamaserver()
    bad.engine_timings["predicted_n"] = 9            # engine says 9 tokens, client saw 6
    bad.engine_timings["prompt_ms"] = 100.0          # engine prefill far below client TTFT
    rec = R.reconcile(bad).set_index("quantity")
    assert not rec.loc["decode_tokens", "ok"] and not rec.loc["prefill_s", "ok"]
    assert rec.loc["decode_s", "ok"] and rec.loc["prefill_tokens", "ok"]


def test_engine_view_units():
    v = R.engine_view({"prompt_eval_duration": 2_000_000_000, "eval_count": 5, "t_eval_ms": 40,
                       "unrelated": 1})
    assert v == {"prefill_s": 2.0, "decode_tokens": 5.0, "decode_s": 0.04}


def test_check_identity():
    tr = multi_chunk()               # last chunk 11.6, end 11.7: a 0.1 s tail
    out = R.check_identity(tr, atol_s=0.0, rtol=0.01)
    assert out["residual_s"] == pytest.approx(0.1) and out["ok"] is False
    tr.end_t = 11.6
    assert R.check_identity(tr)["ok"] is True
    assert R.check_identity(zero_output())["ok"] is None


def test_engine_view_ollama_prefill_excludes_the_cache_when_the_server_counts_it():
    # servers that send prompt_eval_cached_count count the whole prompt in prompt_eval_count
    v = R.engine_view({"prompt_eval_count": 21, "prompt_eval_cached_count": 16})
    assert v == {"prefill_tokens": 5.0, "cached_tokens": 16.0}
    assert R.engine_view({"prompt_eval_count": 21}) == {"prefill_tokens": 21.0}
