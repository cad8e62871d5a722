"""Notebook 15's library: reading a soak (hit rate by context, drift in words, the plots, the drill)."""
import re

import matplotlib
import numpy as np
import pandas as pd

from infercourse.lessons import crash_drill, stability
from infercourse.ops.soak import SoakResult

matplotlib.use("Agg")


def _result():
    t = np.arange(0, 20, 0.5)
    samples = pd.DataFrame({"t_s": t, "time": 1e9 + t, "pid": np.where(t < 10, 11, 22),
                            "rss_mib": 200 + 0.01 * t, "kv_used_frac": 0.3, "up": t != 10,
                            "llamacpp:requests_processing": 2.0, "llamacpp:requests_deferred": 0.0})
    df = pd.DataFrame({"status": ["ok", "ok", "error", "ok"], "scheduled_t": [100.5, 101.0, 110.0, 112.0],
                       "end_t": [101.0, 109.9, 110.1, 113.0], "round": [0, 0, 0, 1],
                       "ttft_s": [0.2, 0.3, np.nan, 0.4], "e2e_s": [1.0, 1.1, np.nan, 1.2],
                       "prompt_tokens": [500, 1500, np.nan, 1500], "cached_tokens": [0, 1400, np.nan, 100]})
    events = [{"t_s": 0.0, "event": "soak_start", "pid": 11}, {"t_s": 9.9, "event": "drill_kill", "pid": 11},
              {"t_s": 10.0, "event": "crash", "pid": 11}, {"t_s": 10.6, "event": "restart", "took_s": 0.6, "pid": 22}]
    return SoakResult(dir=None, df=df, samples=samples, events=events,
                      summary={"duration_s": 20.0, "requests": 4, "incomplete_at_end": 0, "uptime_pct": 97.5}, t0=100.0)


def test_requests_share_the_samples_clock():
    assert stability.request_times(_result())["t_s"].tolist() == [0.5, 1.0, 10.0, 12.0]


def test_hit_rate_by_context():
    h = stability.hit_rate_by_context(_result().df, bins=2)
    assert h["requests"].sum() == 3                                  # the error is left out
    assert h["hit_rate"].iloc[-1] == (1400 + 100) / 3000 and h["hit_rate"].iloc[0] == 0


def _drift(s, lo, hi):
    return {"rss_drift_mib_per_h": s, "rss_drift_lo": lo, "rss_drift_hi": hi}


def test_drift_verdict_follows_one_rule_and_flips_with_the_interval():
    grows, flat, falls = _drift(12, 4, 20), _drift(3, -40, 46), _drift(-12, -20, -4)
    assert [stability.drift_class(x) for x in (grows, flat, falls, {})] == ["growing", "flat", "shrinking", None]
    up, level, down = (stability.drift_verdict(x, 30) for x in (grows, flat, falls))
    assert "**growing**" in up and "excludes zero" in up and "grew" in up
    assert "cannot tell a leak" in up and "too short to project" in up and "24 h would add" not in up
    assert "**no drift detectable**" in level and "includes zero" in level and "+46.0 MiB/h" in level
    assert "**shrinking**" in down and "fell" in down and "no leak claim" in down
    assert "Too few" in stability.drift_verdict({}, 30)


def test_drift_is_projected_to_a_day_only_from_a_long_enough_soak():
    short = stability.drift_verdict(_drift(12, 4, 20), stability.PROJECT_MIN_S - 1)
    long_ = stability.drift_verdict(_drift(12, 4, 20), stability.PROJECT_MIN_S)
    assert "too short to project" in short and "24 h would add" not in short
    assert "24 h would add +96 to +480 MiB" in long_ and "cannot tell a leak" in long_    # the caveat stays
    assert "Over 24 h that bound is +1104 MiB" in stability.drift_verdict(_drift(3, -40, 46), 7200)
    assert "Over 24 h" not in stability.drift_verdict(_drift(3, -40, 46), 60)


def test_the_drill_is_counted_apart_from_unplanned_crashes():
    r = _result()
    assert crash_drill.crash_split(r) == {"planned": 1, "unplanned": 0, "drill_errors": 1, "other_errors": 0}
    line = crash_drill.headline(r)
    assert line.startswith("0 unplanned crashes in 0.00556 h") and "up to 540 /h is not ruled out" in line
    assert "1 planned kill(s) not counted" in line and "error rate 0.0 % of 3 requests outside the drill" in line
    assert "1 cut by the drill" in line and "(the drill's restart included)" in line
    late = _result()                                 # a drill that fired as the window closed: no restart to include
    late.events = late.events[:2]
    line = crash_drill.headline(late)
    assert "1 planned kill(s) not counted" in line and "restart included" not in line
    # the same crash without a drill is unplanned: counted as a rate, its error too
    r.events = [e for e in r.events if e["event"] != "drill_kill"]
    assert crash_drill.crash_split(r) == {"planned": 0, "unplanned": 1, "drill_errors": 0, "other_errors": 1}
    line = crash_drill.headline(r)
    assert line.startswith("1 unplanned crash(es) in 0.00556 h (180 /h)") and "planned kill" not in line
    assert "error rate 25.0 % of 4 requests" in line and "restart included" not in line


def test_an_error_before_the_drill_is_not_the_drills():
    r = _result()
    r.df.loc[2, "end_t"] = 100.9                 # failed before the last answer of that server life
    assert crash_drill.drill_cost(r) == 0 and crash_drill.crash_split(r)["other_errors"] == 1


def test_hit_rate_story_flips_with_the_numbers():
    df = pd.DataFrame({"status": "ok", "prompt_tokens": [100] * 5 + [2000] * 5,
                       "cached_tokens": [0] * 5 + [1900] * 5})
    long_hits = stability.hit_rate_story(df, bins=2)
    assert "served 90% of the prompt tokens of the 10 answered request(s)" in long_hits
    assert "longest prompts (2000 tokens)" in long_hits and "(most of them)" in long_hits
    assert "drew more from the cache than the short ones" in long_hits and "hint" not in long_hits
    df["cached_tokens"] = [90] * 5 + [20] * 5
    short_hits = stability.hit_rate_story(df, bins=2)
    assert "(almost none of them)" in short_hits and "drew less from the cache" in short_hits
    df["cached_tokens"] = [50] * 5 + [1000] * 5
    assert "about as much from the cache as the short ones" in stability.hit_rate_story(df, bins=2)
    few = stability.hit_rate_story(_result().df, bins=2)
    assert "(under half of them)" in few and "only 1 request(s)" in few and "a hint, not a trend" in few
    assert "No request was answered" in stability.hit_rate_story(df.assign(status="error"))


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
    assert "No crash drill" in crash_drill.drill_story(_drill({}), None)
    none = crash_drill.drill_story(_drill({"drill_at_s": float("nan")}), 5)
    assert "did not fire" in none and "3 request(s) were answered" in none and "KILL_AFTER = 5" in none
    fired = crash_drill.drill_story(_drill({"drill_at_s": 9.9}), 1)
    assert "fired at 9.9 s" in fired and "cost 1 request(s)" in fired and "restarted the server in 0.6 s" in fired
    assert "1 request(s) answered after the restart" in fired          # the ok at t = 12 s
    late = crash_drill.drill_story(_drill({"drill_at_s": 19.9, "restarts": 0}, events=[]), 1)
    assert "not observed" in late and "restarts 0" in late


def test_a_soak_folder_reads_back(tmp_path):
    """`load_soak` rebuilds a result from the files a soak writes (the learner's own, exercise 5)."""
    import json
    from infercourse.core.trace import RequestTrace
    from infercourse.measure.results import RunWriter
    r = _result()
    w = RunWriter(tmp_path, {"label": "soak", "engine": {}, "model": "m", "sampling": {}, "load": {}, "workload": {},
                             "soak": {"duration_s": 20.0, "t0_perf_counter": 100.0}})
    for i, x in enumerate(r.df.itertuples()):
        w.write(RequestTrace(i, x.scheduled_t, x.scheduled_t, end_t=x.end_t, status=x.status,
                             prompt_tokens=None if x.status != "ok" else int(x.prompt_tokens),
                             tags={"round": x.round}))
    w.close("ok")
    r.samples.to_json(tmp_path / "samples.jsonl", orient="records", lines=True)
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in r.events))
    back = stability.load_soak(tmp_path)
    assert len(back.df) == 4 and len(back.samples) == len(r.samples) and back.t0 == 100.0
    assert back.summary["duration_s"] == 20.0 and back.summary["crashes"] == 1
    assert crash_drill.crash_split(back)["planned"] == 1 and crash_drill.drill_cost(back) == 1


def test_drift_halves_compares_interval_widths():
    r = _result()
    t = np.arange(0, 40, 0.5)
    r.samples = pd.DataFrame({"t_s": t, "pid": 1, "up": True,
                              "rss_mib": 200 + 0.01 * t + np.random.default_rng(0).normal(0, 0.5, len(t))})
    h = stability.drift_halves(r)
    assert h["width_first_half"] > h["width_all"] > 0 and h["ratio"] == h["width_first_half"] / h["width_all"]


def test_the_drift_verdict_says_the_mib_it_amounts_to():
    """15: "growing +124.9 MiB/h" beside a plot that moved by about 1 MiB after the restart: the
    verdict now says what the slope amounts to over the life it was fitted on."""
    r = _result()                                    # pid 11 answered 0-9.5 s, RSS 200.000-200.095 MiB
    text = stability.drift_verdict(_drift(124.9, 100, 150), 20, r.samples)
    assert "over the 10 s the longest-lived server was sampled, that slope amounts to +0.3 MiB" in text
    assert "its RSS ranged 200-200 MiB" in text and "**growing**" in text
    assert "amounts to" not in stability.drift_verdict(_drift(124.9, 100, 150), 20)


def test_guesses_are_scored_after_the_soak_and_not_before(capsys):
    r = _result()
    r.summary.update(_drift(12, 4, 20), drill_at_s=9.9)
    assert stability.drift_guess_text(None, r.summary).startswith("Not answered yet")
    assert re.search(r"\binside this run's interval\b", stability.drift_guess_text(10, r.summary))
    assert re.search(r"\babove this run's interval\b", stability.drift_guess_text(50, r.summary))
    assert re.search(r"\bbelow this run's interval\b", stability.drift_guess_text(0, r.summary))
    assert crash_drill.lost_guess_text(None, r, 2).startswith("Not answered yet")
    one = crash_drill.lost_guess_text(1, r, 2)                      # the drill cost 1 here; 2 users predicted 2
    assert "drill cost 1" in one and "exactly right" in one and "predicts 2" in one
    assert re.search(r"\babove it by 2\b", crash_drill.lost_guess_text(3, r, 2))
    r.summary["drill_at_s"] = float("nan")
    assert "did not fire" in crash_drill.lost_guess_text(1, r, 2)


def test_the_summary_table_splits_the_crash_rate_and_hides_a_p95_of_few():
    """15: `crash_rate_per_h 120` beside "0 unplanned crashes", and a p95 of 20 requests."""
    r = _result()
    r.summary.update(crash_rate_per_h=180.0, ttft_s_p95=0.39, e2e_s_p95=1.19)
    t = crash_drill.summary_table(r)
    assert "crash_rate_per_h" not in t and t["crashes_unplanned"] == 0 and t["drill_kills"] == 1
    assert t["crash_rate_unplanned_per_h"] == 0 and t["ttft_s_p95"].startswith("n too small (3 ok requests")
    r.events = [e for e in r.events if e["event"] != "drill_kill"]
    assert crash_drill.summary_table(r)["crash_rate_unplanned_per_h"] == 180.0


def test_latency_text_gives_a_p95_only_from_enough_requests():
    few = crash_drill.latency_text(_result().df)
    assert "n too small for a p95 (an interval needs 72 requests, have 3)" in few and "TTFT p50 0.30 s (range" in few
    many = pd.DataFrame({"status": "ok", "ttft_s": np.linspace(0.1, 1.0, 100), "e2e_s": np.linspace(1, 2, 100)})
    text = crash_drill.latency_text(many)
    assert "n too small" not in text and re.search(r"TTFT p50 0\.55 s \[\S+, \S+\], p95 0\.95 s \[", text)
