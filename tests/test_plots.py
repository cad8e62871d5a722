"""Plot functions return Axes with one point per row, units on the axes, log where used."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from infercourse.core import metrics  # noqa: E402
from infercourse.measure import plots
from infercourse.core.trace import RequestTrace  # noqa: E402

@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def synthetic(n=12, seed=0):
    rng = np.random.default_rng(seed)
    trs = []
    for i in range(n):
        plen = int(rng.integers(10, 500))
        ttft = 0.02 + plen * 1e-4
        chunks = [i + ttft + k * 0.03 for k in range(5)]
        trs.append(RequestTrace(request_id=i, scheduled_t=float(i), sent_t=float(i),
                                chunk_t=chunks, chunk_tokens=[1] * 5, end_t=chunks[-1],
                                prompt_tokens=plen, cached_tokens=int(plen * rng.random()),
                                completion_tokens=5, status="ok" if i != 3 else "error",
                                tags={"concurrency": 1 + i % 2}))
    return trs


def _n_points(ax):
    return sum(len(c.get_offsets()) for c in ax.collections)


def test_token_timeline():
    tr = RequestTrace(request_id=7, scheduled_t=0.0, sent_t=0.1, chunk_t=[0.6, 0.7, 0.8],
                      chunk_tokens=[1, 2, 1], end_t=0.8)
    ax = plots.token_timeline(tr)
    x, y = ax.lines[0].get_data()
    assert list(y) == [0, 1, 3, 4]                                   # cumulative tokens
    assert x[1] == pytest.approx(500.0)                              # TTFT from send, ms
    assert "(ms)" in ax.get_xlabel() and "tokens" in ax.get_ylabel()


def test_scatter_plots_one_point_per_row():
    df = metrics.per_request_frame(synthetic())
    ax = plots.ttft_vs_prompt(df, log=True)
    assert _n_points(ax) == len(df)
    assert ax.get_xscale() == "log" and "(tokens)" in ax.get_xlabel() and "(ms)" in ax.get_ylabel()
    ax = plots.cache_hit_vs_ttft(df)
    assert _n_points(ax) == len(df) and "%" in ax.get_xlabel()
    ax = plots.decode_vs_context(df, ceiling_tok_per_s=lambda c: 100 - c / 10)
    assert _n_points(ax) == len(df) and "(tok/s)" in ax.get_ylabel()
    ceiling = ax.lines[0].get_ydata()
    assert ceiling[0] == pytest.approx(100) and ceiling[-1] < ceiling[0]


def test_latency_cdf_by_group_drops_errors():
    df = metrics.per_request_frame(synthetic())
    ax = plots.latency_cdf(df, "ttft_s", by="concurrency")
    curves = [ln for ln in ax.lines if len(ln.get_xdata()) > 1]
    assert len(curves) == 2
    assert sum(len(c.get_xdata()) for c in curves) == (df.status == "ok").sum()
    assert curves[0].get_ydata()[-1] == pytest.approx(1.0)
    assert ax.get_xscale() == "log" and "(ms)" in ax.get_xlabel()


def test_throughput_vs_latency_and_quant_tradeoff():
    runs = pd.DataFrame({"output_tok_per_s": [10.0, 30.0, 35.0], "ttft_s_p99": [0.1, 0.2, 0.9]},
                        index=["c1", "c4", "c16"])
    ax = plots.throughput_vs_latency(runs)
    assert list(ax.lines[0].get_ydata()) == pytest.approx([100, 200, 900])
    assert [t.get_text() for t in ax.texts] == ["c1", "c4", "c16"]
    q = pd.DataFrame({"quant": ["Q4_0", "Q8_0", "F16"], "size_gb": [0.09, 0.15, 0.27],
                      "decode_tok_per_s": [90, 70, 40], "perplexity": [12.1, 11.6, 11.5]})
    ax = plots.quant_tradeoff(q)
    assert _n_points(ax) == 3 and "(GB)" in ax.get_xlabel()
    assert {t.get_text() for t in ax.texts} == {"Q4_0", "Q8_0", "F16"}


def test_timeseries_marks_errors_and_memory():
    df = metrics.per_request_frame(synthetic())
    mem = pd.DataFrame({"t_s": [0, 5, 10], "rss_gb": [1.0, 1.1, 1.2]})
    ax = plots.timeseries(df, memory=mem)
    pts, errs = ax.lines[0], ax.lines[1]
    assert len(pts.get_xdata()) == 11 and len(errs.get_xdata()) == 1
    assert "(s)" in ax.get_xlabel() and "(ms)" in ax.get_ylabel()
    assert any("(GB)" in a.get_ylabel() for a in ax.figure.axes)


# ---- notebook 10 -------------------------------------------------------------------------
def test_latency_anatomy_marks_each_metric():
    tr = RequestTrace(request_id=3, scheduled_t=0.0, sent_t=0.1, chunk_t=[0.5, 0.6, 0.9, 1.0],
                      chunk_tokens=[1, 1, 1, 1], end_t=1.0, completion_tokens=4)
    ax = plots.latency_anatomy(tr)
    x, y = ax.lines[0].get_data()
    assert x[1] == pytest.approx(500.0) and list(y) == [0, 1, 2, 3, 4]     # ms since scheduled
    labels = " ".join(ax.get_legend_handles_labels()[1])
    assert "TTFT 500 ms" in labels and "E2E 1000 ms" in labels and "TPOT 166.7 ms" in labels
    assert any("longest ITL 300.0 ms" in t.get_text() for t in ax.texts)
    assert "(ms)" in ax.get_xlabel()


def test_mean_vs_percentiles_draws_mean_apart_from_median():
    x = np.r_[np.full(98, 0.010), 1.0, 1.0]                  # two stalls drag the mean
    ax = plots.mean_vs_percentiles(x, label="ITL")
    vals = {ln.get_label().split()[0]: ln.get_xdata()[0] for ln in ax.lines}
    assert vals["mean"] == pytest.approx(x.mean() * 1000) and vals["p50"] == pytest.approx(10.0)
    assert vals["mean"] > 2 * vals["p50"] and ax.get_xscale() == "log" and "(ms" in ax.get_xlabel()


def test_schedule_vs_send_and_client_vs_server():
    trs = [RequestTrace(request_id=i, scheduled_t=0.1 * i, sent_t=0.3 * i, chunk_t=[0.3 * i + 0.05],
                        chunk_tokens=[1], end_t=0.3 * i + 0.1) for i in range(5)]
    df = metrics.per_request_frame(trs)
    ax = plots.schedule_vs_send(df, "ttft", reference_s=0.05)
    sched, sent = ax.lines[0].get_ydata(), ax.lines[1].get_ydata()
    assert sent == pytest.approx([50.0] * 5) and sched[-1] == pytest.approx(50 + 800)
    assert ax.lines[2].get_ydata()[0] == pytest.approx(50.0) and "(ms)" in ax.get_ylabel()
    rec = pd.DataFrame({"quantity": ["prefill_s", "decode_s", "decode_tokens"], "client": [0.5, 0.4, 5],
                        "engine": [0.45, 0.38, 5]})
    ax = plots.client_vs_server(rec)
    assert _n_points(ax) == 2 and "(ms)" in ax.get_xlabel()
    line = ax.lines[0]
    assert line.get_xdata()[-1] == line.get_ydata()[-1]           # the y = x reference
