"""Notebook 15's library: reading a soak (hit rate by context, drift in words, the plots)."""
import matplotlib
import numpy as np
import pandas as pd

from infercourse.lessons import stability
from infercourse.ops.soak import SoakResult

matplotlib.use("Agg")


def _result():
    t = np.arange(0, 20, 0.5)
    samples = pd.DataFrame({"t_s": t, "time": 1e9 + t, "pid": np.where(t < 10, 11, 22),
                            "rss_mib": 200 + 0.01 * t, "kv_used_frac": 0.3, "up": t != 10,
                            "llamacpp:requests_processing": 2.0, "llamacpp:requests_deferred": 0.0})
    df = pd.DataFrame({"status": ["ok", "ok", "error", "ok"], "scheduled_t": [100.5, 101.0, 110.0, 112.0],
                       "ttft_s": [0.2, 0.3, np.nan, 0.4], "e2e_s": [1.0, 1.1, np.nan, 1.2],
                       "prompt_tokens": [500, 1500, np.nan, 1500], "cached_tokens": [0, 1400, np.nan, 100]})
    events = [{"t_s": 0.0, "event": "soak_start"}, {"t_s": 10.0, "event": "crash"},
              {"t_s": 10.6, "event": "restart", "took_s": 0.6}]
    return SoakResult(dir=None, df=df, samples=samples, events=events, summary={}, t0=100.0)


def test_requests_share_the_samples_clock():
    assert stability.request_times(_result())["t_s"].tolist() == [0.5, 1.0, 10.0, 12.0]


def test_hit_rate_by_context():
    h = stability.hit_rate_by_context(_result().df, bins=2)
    assert h["requests"].sum() == 3                                  # the error is left out
    assert h["hit_rate"].iloc[-1] == (1400 + 100) / 3000 and h["hit_rate"].iloc[0] == 0


def test_drift_verdict_says_what_the_interval_allows():
    up = stability.drift_verdict({"rss_drift_mib_per_h": 12, "rss_drift_lo": 4, "rss_drift_hi": 20}, 600)
    flat = stability.drift_verdict({"rss_drift_mib_per_h": 3, "rss_drift_lo": -40, "rss_drift_hi": 46}, 30)
    assert "excludes zero" in up and "grows" in up and "+96 to +480 MiB" in up
    assert "includes zero" in flat
    assert "too few" in stability.drift_verdict({}, 30)


def test_plot_marks_restarts_on_every_panel():
    ax = stability.plot_soak(_result())
    assert len(ax) == 4
    for a in ax:
        assert any(len(ln.get_xdata()) == 2 and np.allclose(ln.get_xdata(), [10.6, 10.6]) for ln in a.get_lines())
    assert len([ln for ln in ax[0].get_lines() if ln.get_label().startswith("server pid")]) == 2
    assert ax[0].get_ylabel() == "server RSS (MiB)" and ax[2].get_xlabel() == "soak time (s)"


def test_recipe_is_one_parameter_away():
    cmd = stability.recipe("72h")
    assert "--duration 72h" in cmd and "infercourse report soak-72h" in cmd


def _drill(summary, events=None, df=None):
    r = _result()
    r.summary = {"duration_s": 20.0, "restarts": 1, **summary}
    if events is not None:
        r.events = events
    if df is not None:
        r.df = df
    return r


def test_drill_story_is_read_from_the_run_never_assumed():
    assert "No crash drill" in stability.drill_story(_drill({}), None)
    none = stability.drill_story(_drill({"drill_at_s": float("nan")}), 5)
    assert "did not fire" in none and "3 request(s) were answered" in none and "KILL_AFTER = 5" in none
    fired = stability.drill_story(_drill({"drill_at_s": 9.5}), 1)
    assert "fired at 9.5 s" in fired and "cost 1 request(s)" in fired and "restarted the server in 0.6 s" in fired
    assert "1 request(s) answered after the restart" in fired          # the ok at t = 12 s
    late = stability.drill_story(_drill({"drill_at_s": 19.9, "restarts": 0}, events=[]), 1)
    assert "not observed" in late and "restarts 0" in late


def test_drift_halves_compares_interval_widths():
    r = _result()
    t = np.arange(0, 40, 0.5)
    r.samples = pd.DataFrame({"t_s": t, "pid": 1, "up": True,
                              "rss_mib": 200 + 0.01 * t + np.random.default_rng(0).normal(0, 0.5, len(t))})
    h = stability.drift_halves(r)
    assert h["width_first_half"] > h["width_all"] > 0 and h["ratio"] == h["width_first_half"] / h["width_all"]
