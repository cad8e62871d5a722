"""lessons.model_routing's sentences and lessons.capacity's per-model pools, on synthetic
tables: each sentence that states what a run showed must flip when its numbers flip.

Synthetic runs are hand-made stand-ins for `swap_trials` / `sleep_trials` / `mixed_trials`
results (same columns); the live router is exercised in tests/test_llama_router.py.
"""
from __future__ import annotations

import math

import pandas as pd
import pytest

from infercourse.lessons import capacity
from infercourse.lessons import model_failover as mf
from infercourse.lessons import model_routing as mr

# per-block jitter, so that the A/A rerun is not identical to A (a real floor, not zero)
JITTER = [1.00, 1.04, 0.97, 1.02, 0.99, 1.03]


def _trials(arms, a_s: float, b_s: float, *, blocks: int = 6, per_trial: int = 2, extra=None) -> pd.DataFrame:
    """Stand-in for a trials' request table: arms[0] and its A/A rerun arms[1] take ~a_s,
    arms[2] ~b_s, every request ok."""
    rows = []
    for blk in range(blocks):
        order = list(zip(arms, (a_s, a_s * (1.01 if blk % 2 else 0.99), b_s)))
        for arm, base in order[::-1] if blk % 2 else order:            # ABBA: odd blocks mirrored
            for i in range(per_trial):
                rows.append({"block": blk, "arm": arm, "status": "ok", "ttft_s": base * JITTER[blk] * (1 + 0.01 * i),
                             "e2e_s": base * 2, **(extra(arm) if extra else {})})
    return pd.DataFrame(rows)


def _swap(a_s, b_s, rss=(500.0, 300.0)):
    req = _trials(mr.SWAP_ARMS, a_s, b_s, extra=lambda arm: {"state": "swap" if arm == "swap" else "resident"})
    loads = pd.DataFrame({"model": ["fast", "main", "fast"], "port": [1, 2, 1], "loaded_s": [0.5, 1.5, 0.7]})
    return {"requests": req, "rss_mib": {2: rss[0], 1: rss[1]}, "held": {2: ["fast", "main"], 1: ["main"]},
            "loads": loads}


def test_per_trial_pairs_blocks_and_keeps_the_arms_order():
    req = _trials(mr.SWAP_ARMS, 0.2, 2.0, blocks=4)
    wide = mr.per_trial(req)
    assert list(wide.columns) == list(mr.SWAP_ARMS) and list(wide.index) == [0, 1, 2, 3]
    assert wide.loc[0, "swap"] == pytest.approx(2.0 * 1.005)        # the median of the trial's two requests
    req.loc[(req["block"] == 1) & (req["arm"] == "swap"), "status"] = "error"
    assert math.isnan(mr.per_trial(req).loc[1, "swap"])              # a trial with no ok request drops its pair
    mirrored = req[req["block"] % 2 == 1]                             # a frame whose first block ran B first
    assert list(mr.per_trial(mirrored, arms=mr.SWAP_ARMS).columns) == list(mr.SWAP_ARMS)
    assert list(mr.per_trial(mirrored).columns) == list(reversed(mr.SWAP_ARMS))


def test_swap_text_flips_with_the_verdict_and_the_memory():
    slow = mr.swap_text(_swap(0.2, 2.0))
    assert "**Swapping cost time**" in slow and "A/A noise floor" in slow and "resident faster" in slow
    assert "fast 0.6 s (median of 2), main 1.5 s (median of 1)" in slow
    assert "costs 200 MiB" in slow
    fast = mr.swap_text(_swap(2.0, 0.2, rss=(300.0, 300.0)))
    assert "**The swap arm came out faster**" in fast and "swap faster" in fast
    assert "no extra resident memory" in fast and "costs 200" not in fast
    same = mr.swap_text(_swap(0.2, 0.2))
    assert "did not clear the A/A floor" in same and "Swapping cost time" not in same


def test_swap_penalty_is_swapped_minus_resident_median():
    req = _swap(0.2, 2.0)["requests"]
    ok = req[req["status"] == "ok"]
    assert mr.swap_penalty_s(req) == pytest.approx(ok.loc[ok.state == "swap", "ttft_s"].median()
                                                   - ok.loc[ok.state == "resident", "ttft_s"].median())


@pytest.mark.parametrize("guess, floor, measured, says, not_says", [
    (None, 0.1, 1.0, "No guess recorded", "Your guess"),
    (2.0, 0.1, 1.0, "too high by x2", "too low"),
    (0.25, 0.1, 1.0, "too low by x4", "too high"),
    (1.2, 0.1, 1.0, "close (within x1.5)", "by x"),
    (1.0, 0.1, 1.0, "took 10x what reading the file costs", "beat a full read"),
    (0.05, 0.1, 0.05, "beat a full read", "took"),
    (1.0, 0.1, -0.2, "not a positive cost", "Your guess"),
])
def test_guess_text_scores_the_swap_guess(guess, floor, measured, says, not_says):
    text = mr.guess_text(guess, floor, measured)
    assert says in text and not_says not in text


def _sleep(a_s, b_s, awake=180.0, asleep=50.0, dozed=False):
    def found(arm):
        return {"found": "sleeping" if arm == "after sleep" or dozed else "loaded"}
    return {"requests": _trials(mr.SLEEP_ARMS, a_s, b_s, extra=found), "rss_awake_mib": awake,
            "rss_asleep_mib": asleep, "sleep_idle_s": 5}


def test_sleep_text_flips_with_the_verdict_and_the_memory():
    stall = mr.sleep_text(_sleep(0.15, 2.0))
    assert "**A user back from a break waits**: after 5 idle s" in stall and "awake faster" in stall
    assert "holds 130 MiB that sleep frees" in stall and "found the model" not in stall
    odd = mr.sleep_text(_sleep(2.0, 0.15, awake=50.0, asleep=50.0, dozed=True))
    assert "came out faster" in odd and "sleep freed no resident memory" in odd
    assert "'awake' request(s) found the model sleeping" in odd
    flat = mr.sleep_text(_sleep(0.15, 0.15))
    assert "did not clear the A/A floor" in flat


def _mix(a_s, b_s, per_trial=72):
    return _trials(mr.MIX_ARMS, a_s, b_s, per_trial=per_trial,
                   extra=lambda arm: {"model": "main", "models_max": 1 if arm == "models_max 1" else 2})


def test_mixed_text_judges_p50_and_p95_and_flips():
    worse = mr.mixed_text(_mix(0.3, 1.5))
    assert worse.count("**Both resident beat swapping**") == 2 and "TTFT p50" in worse and "TTFT p95" in worse
    better = mr.mixed_text(_mix(1.5, 0.3))
    assert better.count("**Swapping came out faster**") == 2 and "Both resident" not in better
    assert mr.mixed_text(_mix(0.3, 0.3)).count("No difference beyond the A/A floor") == 2


def test_mixed_text_judges_no_p95_from_ten_requests_a_trial():
    """16 printed "TTFT p95 (median over trials)" from 10 requests per trial: the p95 of 10 is
    their maximum. Below the 72 a p95's interval needs, the p95 line says n too small."""
    few = mr.mixed_text(_mix(0.3, 1.5, per_trial=10))
    assert few.count("**Both resident beat swapping**") == 1 and "the mix's TTFT p50" in few
    assert "n too small for a p95" in few and "as few as 10 ok request(s)" in few and "needs 72" in few
    two = mr.mixed_text(_mix(0.3, 1.5, per_trial=10).query("block < 2"))     # 2 blocks: no verdict, one "the"
    assert "**No verdict on the mix's TTFT p50" in two and "the the" not in two
    df = _mix(0.3, 1.5, per_trial=72)
    df.loc[df.index[-1], "status"] = "error"                      # one trial down to 71 ok requests
    assert "n too small for a p95" in mr.mixed_text(df)
    col = "ttft_s_p95 (NaN: n < 72)"

    def table(per_trial):
        df = _mix(0.3, 1.5, per_trial=per_trial)
        return mr.mixed_table(df.assign(scheduled_t=0.0, end_t=1.0, output_tokens=8, prompt_tokens=10))
    few_t = table(10)                                                 # 60 pooled requests an arm
    assert few_t[col].isna().all() and "ttft_s_p95" not in few_t.columns and few_t["ttft_s_p50"].notna().all()
    assert table(12)[col].notna().all()                               # 72 pooled: a p95 with its interval


def test_service_by_model_reads_the_resident_arm_only():
    df = pd.DataFrame({"arm": ["models_max 2"] * 3 + ["models_max 1"], "status": ["ok", "ok", "error", "ok"],
                       "model": ["main", "fast", "main", "main"], "e2e_s": [1.0, 0.5, 9.0, 7.0]})
    assert mr.service_by_model(df) == {"fast": 0.5, "main": 1.0}


def test_alias_text_names_the_model_reached_and_the_failing_layer():
    t = pd.DataFrame({"status": ["ok", "ok", "error"], "served_by": ["main", "fast", None],
                      "error": [None, None, "HTTP 400: model 'x' not found"], "layer": [None, None, "API"]},
                     index=pd.Index(["claude-sonnet-4-6", "claude-haiku-4-5", "x"], name="asked"))
    text = mr.alias_text(t)
    assert text.startswith("2 of 3 names answered")
    assert "`claude-sonnet-4-6` reached **main**" in text and "`x` **failed** at the API layer" in text
    t.loc["x", ["status", "layer"]] = ["ok", None]
    assert mr.alias_text(t).startswith("3 of 3") and "failed" not in mr.alias_text(t)


def test_load_times_reads_each_childs_own_clock_and_follows_a_reused_port():
    log = "\n".join([
        "0.00.154.769 I srv          load: spawning server instance with name=fast on port 59011",
        "[59011] 0.00.005.943 I srv    load_model: loading model '/x/fast.gguf'",
        "[59011] 0.00.572.054 I srv  llama_server: model loaded",
        "0.01.264.159 I srv          load: spawning server instance with name=main on port 39427",
        "[39427] 0.01.429.716 I srv  llama_server: model loaded",
        "0.02.000.000 I srv          load: spawning server instance with name=main on port 59011",
        "[59011] 1.02.000.500 I srv  llama_server: model loaded",
    ])
    t = mr.load_times(log)
    assert list(t["model"]) == ["fast", "main", "main"] and list(t["port"]) == [59011, 39427, 59011]
    assert list(t["loaded_s"]) == pytest.approx([0.572054, 1.429716, 62.0005])
    assert mr.load_times("no loads here").empty


def _story(**kw):
    base = {"model": "main", "killed_pid": 1, "signal": "SIGKILL", "signal_number": 9, "router_failed": True,
            "router_exit_code": 1, "in_flight_status": "error", "in_flight_tokens": 4,
            "in_flight_error": "stream ended without message_stop", "router_said": "instance(s) died: main",
            "router_up": True, "kept": ["fast"], "next_found": "unloaded", "resident_ttft_s": 0.1,
            "after_ttft_s": [1.7, 0.2], "after_ok": 2, "status_now": "loaded"}
    return mf.killed_text({**base, **kw})


def test_killed_text_follows_what_happened():
    text = _story()
    assert "ended **error** after 4 tokens" in text and "**stayed up**" in text and "said: instance(s) died" in text
    assert "fast went on in the same process" in text and "found it **unloaded** and started a fresh instance" in text
    other = _story(router_up=False, kept=[], next_found="loaded", router_said=None, in_flight_status="ok",
                   in_flight_error=None)
    assert "**went down with its child**" in other and "named no dead instance" in other
    assert "no other instance survived" in other and "started a fresh instance" not in other
    assert "ended **ok**" in other


def test_the_kill_drill_says_what_the_router_reported_not_what_a_kill_would():
    """16 said the child was SIGKILLed "as the OOM killer would" while the router reported exit
    code 1 (18's supervisor reports -9): the line is written from the router's own row."""
    one = _story().splitlines()[0]
    assert "sent SIGKILL (signal 9)" in one and "**exit code 1**, not the signal" in one and "reads as a crash" in one
    nine = _story(router_exit_code=-9).splitlines()[0]
    assert "exit code -9: the signal's own number" in nine and "not the signal" not in nine
    assert "exit code 137: the signal's own number" in _story(router_exit_code=137)
    quiet = _story(router_failed=False, router_exit_code=0).splitlines()[0]
    assert "did **not** mark it failed" in quiet and "exit code 0" in quiet
    assert "with no exit code" in _story(router_exit_code=None)


def test_router_notes_label_each_observation_with_versions():
    seen = {pkg: v for pkg, (v, _) in mf.OBSERVED_ROUTERS.items()}
    same = mf.router_notes(seen)
    assert all(f"**{pkg} {v}** (the version installed here)" in same for pkg, v in seen.items())
    newer = mf.router_notes({"sglang-router": "9.9.9"})
    assert "installed here: 9.9.9, so it may no longer hold" in newer
    assert "vllm-router 0.1.17** (not installed here)" in newer
    assert set(mf.router_versions()) == set(mf.OBSERVED_ROUTERS)


def test_pool_capacity_by_hand_and_the_team_table():
    pools = capacity.pool_capacity({"main": 1.0, "fast": 0.5}, {"main": 8, "fast": 2}, think_s=4.0,
                                   kv_limit={"main": 2})
    cycle = 4.0 + 0.8 * 1.0 + 0.2 * 0.5
    assert pools.loc["main", "cycle_s"] == pytest.approx(cycle)
    assert pools.loc["main", "throughput_limit"] == pytest.approx(0.7 * cycle / 0.8)
    assert pools.loc["fast", "throughput_limit"] == pytest.approx(0.7 * cycle / 0.1)
    assert pools.loc["main", "per_replica"] == 2 and math.isinf(pools.loc["fast", "kv_limit"])
    table = capacity.team_table(pools, [5, 20])
    assert table.loc[20, "main"] == 10 and table.loc[20, "fast"] == math.ceil(20 / (0.7 * cycle / 0.1))
    with pytest.raises(ValueError):
        capacity.pool_capacity({"main": 1.0}, {"main": 0.8, "fast": 0.2}, think_s=1.0)


def test_pool_text_names_the_binding_pool_and_flips():
    main_binds = capacity.pool_capacity({"main": 1.0, "fast": 0.5}, {"main": 0.8, "fast": 0.2}, 4.0,
                                        kv_limit={"main": 2})
    text = capacity.pool_text(main_binds, 20)
    assert text.startswith("The **main** pool binds") and "main 2 (its KV limit)" in text and "10 of main" in text
    fast_binds = capacity.pool_capacity({"main": 0.1, "fast": 5.0}, {"main": 0.8, "fast": 0.2}, 4.0)
    assert capacity.pool_text(fast_binds, 20).startswith("The **fast** pool binds")
    assert "(its throughput)" in capacity.pool_text(fast_binds, 20)
    even = capacity.pool_capacity({"main": 1.0, "fast": 4.0}, {"main": 0.8, "fast": 0.2}, 4.0)
    assert capacity.pool_text(even, 20).startswith("Both pools serve as many")
