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
