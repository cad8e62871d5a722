"""The tuning lesson: one knob at a time, stage shares from traces, keep/revert decisions
with intervals, the append-only log, KV-cache prediction and log parsing."""
import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from infercourse.core import summary
from infercourse.core.trace import RequestTrace
from infercourse.lessons import classic_problems as CP
from infercourse.lessons import tuning as T


def _trace(i, *, queue, prefill, decode, n=5):
    first = queue + prefill
    return RequestTrace(request_id=i, scheduled_t=0.0, sent_t=0.0,
                        chunk_t=list(np.linspace(first, first + decode, n)), chunk_tokens=[1] * n,
                        end_t=first + decode, prompt_tokens=10, completion_tokens=n,
                        engine_timings={"prompt_ms": 1e3 * prefill})


def test_config_changes_one_knob_only_and_builds_the_argv():
    c = T.ServerConfig(n_parallel=2, ctx_per_slot=1024)
    assert c.change(threads=1).threads == 1
    with pytest.raises(ValueError, match="one knob"):
        c.change(threads=1, ubatch=64)
    argv = c.change(cache_type_k="q8_0").server().argv()
    assert argv[argv.index("-c") + 1] == "2048"          # total context = per slot x slots
    assert argv[argv.index("-np") + 1] == "2" and argv[argv.index("-ctk") + 1] == "q8_0"
    assert argv[argv.index("-lv") + 1] == "4"         # buffer sizes are logged only above default verbosity


def test_stage_shares_split_e2e_and_find_the_bottleneck():
    traces = [_trace(0, queue=0.6, prefill=0.1, decode=0.3), _trace(1, queue=0.0, prefill=0.1, decode=0.3)]
    s = T.stage_shares(traces)
    assert s.loc[0, "queue_s"] == pytest.approx(0.6) and s.loc[0, "queue_share"] == pytest.approx(0.6)
    assert (s[["queue_share", "prefill_share", "decode_share"]].sum(axis=1)).tolist() == pytest.approx([1, 1])
    b = T.bottleneck(s)                 # totals: queue 0.6, prefill 0.2, decode 0.6 -> a tie
    assert b["shares"]["prefill"] == pytest.approx(0.2 / 1.4)
    s2 = T.stage_shares([_trace(0, queue=0.0, prefill=0.8, decode=0.2)])
    assert T.bottleneck(s2)["stage"] == "prefill" and "-ub" in T.bottleneck(s2)["advice"]


def test_stage_shares_without_server_timings_refuse_to_guess():
    tr = _trace(0, queue=0.1, prefill=0.1, decode=0.1)
    tr.engine_timings = {}
    s = T.stage_shares([tr])
    assert math.isnan(s.loc[0, "prefill_s"])
    with pytest.raises(ValueError, match="no stage timings"):
        T.bottleneck(s)


def _frame(values):
    # served in row order: place in the queue k = row k
    return pd.DataFrame({"status": "ok", "ttft_s": values, "first_token_t": np.arange(len(values), dtype=float)})


def test_decide_keeps_only_a_change_beyond_noise():
    rng = np.random.default_rng(0)
    slow, fast = _frame(1.0 + 0.05 * rng.random(40)), _frame(0.5 + 0.05 * rng.random(40))
    assert T.decide(slow, fast)["decision"] == "keep"
    worse = T.decide(fast, slow)
    assert worse["decision"] == "revert" and worse["why"].startswith("worse beyond noise (p = ")
    same = T.decide(slow, _frame(1.0 + 0.05 * rng.random(40)))
    assert same["decision"] == "revert" and "within noise" in same["why"]
    assert T.decide(_frame(fast.ttft_s * 10), fast, goal="higher")["decision"] == "revert"


def test_decide_pairs_requests_and_judges_against_the_aa_floor():
    # a wide spread between requests (queue position), the same 10% cut for each: per-run
    # intervals overlap, the paired ratio does not
    before = _frame(np.linspace(1.0, 3.0, 8))
    after = _frame(before.ttft_s * 0.9)
    d = T.decide(before, after)
    assert d["decision"] == "keep" and d["ratio"] == pytest.approx(0.9) and d["pairs"] == 8
    assert T.decide(before, after, floor=0.15)["decision"] == "revert"          # inside a ±15% floor
    wobble = _frame(before.ttft_s * np.where(np.arange(8) % 2, 1.2, 1 / 1.2))  # A/A moves x/÷ 1.2
    # B moving as the rerun does, centred on 0.9: no evidence against "the same config"
    noisy = _frame(before.ttft_s * np.array([1.08, 0.72, 1.1, 0.75, 1.05, 0.7, 1.12, 0.78]))
    aa = T.decide(before, noisy, aa=wobble)
    assert aa["decision"] == "revert" and "within noise" in aa["why"] and aa["floor"] == pytest.approx(0.2)
    # the same rerun, and B 10% lower in every request: the rerun is data (A, A2, B relabelled per
    # request), so a consistent cut is found even inside the ±20% band a bare floor would draw
    steady = T.decide(before, after, aa=wobble)
    assert steady["decision"] == "keep" and "relabelled" in steady["test"]
    assert T.decide(before, after, floor=0.2)["decision"] == "revert"          # the bare band cannot
    few = T.decide(before.iloc[:3], after.iloc[:3])                              # 3 pairs: a range, said so
    assert "not a 95% interval" in few["why"]


def test_decide_pairs_by_request_id_not_by_row_order():
    before = pd.DataFrame({"status": "ok", "request_id": [0, 1, 2, 3, 4, 5, 6], "ttft_s": np.arange(1.0, 8.0)})
    after = before.assign(ttft_s=before.ttft_s * 0.5).iloc[::-1]        # finished in another order
    after.loc[after.request_id == 3, "status"] = "error"                 # a failed request leaves no pair
    d = T.decide(before, after)
    assert d["pairs"] == 6 and d["ratio"] == pytest.approx(0.5) and d["decision"] == "keep"


def _session(tmp_path, name, config, users, *, kv=90.0):
    run = SimpleNamespace(df=_frame(users), dir=tmp_path / name)
    return {"config": config, "runs": {"users": run}, "kv_cache_mib": kv, "rss_mb": 200.0}


def test_tuning_log_appends_and_tracks_the_kept_config(tmp_path):
    rng = np.random.default_rng(1)
    noise = lambda: 0.05 * rng.random(30)   # noqa: E731
    base = T.ServerConfig()
    log = T.TuningLog(tmp_path, guard="users:ttft_s")
    with pytest.raises(ValueError, match="baseline first"):
        log.trial("threads", _session(tmp_path, "x", base.change(threads=1), [1.0]))
    log.baseline(_session(tmp_path, "b", base, 1.0 + noise()))
    np4 = base.change(n_parallel=4)
    kept = log.trial("n_parallel", _session(tmp_path, "t1", np4, 0.4 + noise()),
                     target="users:ttft_s", expected="queueing dominated")
    assert kept["decision"] == "keep" and log.current == np4
    with pytest.raises(ValueError, match="exactly 'threads'"):
        log.trial("threads", _session(tmp_path, "x", base.change(threads=1), [1.0]))
    reverted = log.trial("threads", _session(tmp_path, "t2", np4.change(threads=1), 0.9 + noise()),
                         target="users:ttft_s")
    assert reverted["decision"] == "revert" and log.current == np4
    # a scalar target (memory) that improves, with users unchanged: kept
    q8 = np4.change(cache_type_k="q8_0")
    mem = log.trial("cache_type_k", _session(tmp_path, "t3", q8, 0.4 + noise(), kv=68.0), target="kv_cache_mib")
    assert mem["decision"] == "keep" and mem["change"] == pytest.approx(68 / 90 - 1)
    # a scalar target that improves while the guard gets worse beyond noise: reverted, and why
    q4 = q8.change(cache_type_k="q4_0")
    slow = log.trial("cache_type_k", _session(tmp_path, "t4", q4, 2.0 + noise(), kv=60.0), target="kv_cache_mib")
    assert slow["decision"] == "revert" and "worse beyond noise" in slow["why"] and log.current == q8
    assert log.floor("users:ttft_s") == 0.0                    # no repeat of the baseline: no floor
    lines = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [x["trial"] for x in lines] == ["baseline", "n_parallel=4", "threads=1", "cache_type_k=q8_0",
                                           "cache_type_k=q4_0"]
    assert lines[1]["config"]["n_parallel"] == 4 and lines[1]["expected"] == "queueing dominated"
    assert T.TuningLog(tmp_path).frame()["decision"].tolist() == ["baseline", "keep", "revert", "keep", "revert"]
    text = T.explain_log(T.TuningLog(tmp_path).frame())
    assert text.count("\n") == 3 and "`cache_type_k=q8_0` on kv_cache_mib: 90 → 68 (-24%): **keep**" in text
    # a paired target says its change is the median paired ratio, not the ratio of the medians
    assert "`n_parallel=4` on users:ttft_s: " in text and "(medians; median paired change " in text


def test_tuning_workloads_are_the_same_requests_every_time():
    tok = lambda text: text.split()          # noqa: E731 - one token per word
    w = T.tuning_workloads(tok, n_requests=3, concurrency=2, prompt_tokens=20, max_tokens=5, long_tokens=40)
    users, kw = w["users"]
    assert len(users) == 3 and kw == {"pattern": "concurrency", "concurrency": 2}
    assert len({u.messages[0]["content"] for u in users}) == 3 and users[0].max_tokens == 5
    assert not any(u.cache_prompt for u in users)          # every users' prompt prefilled in full
    (first, second), kw = w["shift"]
    assert kw["warmup"] == 0
    doc2 = second.messages[0]["content"].split("\n\n")[0]
    assert doc2 in first.messages[0]["content"] and not first.messages[0]["content"].startswith(doc2)
    again = T.tuning_workloads(tok, n_requests=3, concurrency=2, prompt_tokens=20, max_tokens=5, long_tokens=40)
    assert again["users"][0] == users


def test_kv_cache_from_log_and_prediction():
    log = ("llama_kv_cache:        CPU KV buffer size =    90.00 MiB\n"
           "llama_kv_cache: size =   90.00 MiB (  4096 cells,  30 layers,  1/1 seqs), K (f16):   45.00 MiB, V (f16):   45.00 MiB\n")
    assert T.kv_cache_mib_from_log(log) == pytest.approx(90.0)
    assert math.isnan(T.kv_cache_mib_from_log("nothing here"))
    assert T.compute_mib_from_log("sched_reserve:        CPU compute buffer size =    15.16 MiB") == pytest.approx(15.16)
    card = SimpleNamespace(kv_bytes_per_token=lambda b: 2 * 30 * 3 * 64 * b, tensor_bytes=100 * 2**20)
    f16 = CP.predicted_kv_mib(card, 4096)
    assert f16 == pytest.approx(2 * 30 * 3 * 64 * 2 * 4096 / 2**20)           # = 90 MiB
    q8 = CP.predicted_kv_mib(card, 4096, cache_type_k="q8_0")
    assert q8 / f16 == pytest.approx((34 / 32 + 2) / 4)
    with pytest.raises(ValueError, match="unknown cache type"):
        CP.predicted_kv_mib(card, 4096, cache_type_k="q3")
    # 1 GiB free, 100 MiB of weights, 24 MiB of compute: (1024 - 124) MiB / 23,040 B per token
    assert CP.max_context_tokens(card, free_bytes=2**30, compute_mib=24) == (900 * 2**20) // 23040
    assert CP.max_context_tokens(card, free_bytes=50 * 2**20) == 0


def test_problems_frame_has_six_and_places_evidence():
    t = CP.problems_frame({"P95 jitter": "p95/p50 = 3.1 at -np 1"})
    assert len(t) == 6 and t.loc["P95 jitter", "measured here"].startswith("p95/p50")
    assert t.loc["out of memory", "measured here"] == "not measured here"
    with pytest.raises(ValueError, match="unknown problem"):
        CP.problems_frame({"slow disks": "x"})


def test_production_workloads_and_overflow():
    users = [SimpleNamespace(i=i) for i in range(4)]
    w = CP.production_workloads(users, 2.0, load=0.5, seed=3)
    assert w["local"] == (users, {"pattern": "sequential"})
    assert w["production"][1] == {"pattern": "poisson", "rate_rps": 1.0, "seed": 3, "warmup": 0}
    with pytest.raises(ValueError):
        CP.production_workloads(users, 0.0)
    assert CP.production_workloads(users, 2.0, n_local=2)["local"][0] == users[:2]
    tok = lambda text: text.split()          # noqa: E731
    r = CP.overflow_request(tok, 100, extra=10)
    assert len(tok(r.messages[0]["content"])) == 110


def test_tail_text_gives_no_p95_from_a_handful_of_requests():
    few = pd.DataFrame({"status": "ok", "ttft_s": [1.0, 1.1, 1.2, 1.3, 1.4, 6.0]})
    t = CP.tail_text(few)
    need = summary.min_n(0.95)                  # the rule of core.summary (and notebook 10)
    assert f"p95: n too small (an interval needs {need} requests, have 6)" in t and "p95/p50" not in t
    assert "p50 1.25 s [1, 6]" in t and "the slowest of these 6 took 4.8× their median" in t
    many = pd.DataFrame({"status": "ok", "ttft_s": np.r_[np.ones(95), np.full(5, 3.0)]})
    t = CP.tail_text(many)
    assert "n too small" not in t and "p95/p50 = " in t
    three = pd.DataFrame({"status": "ok", "ttft_s": [1.0, 2.0, 3.0]})
    assert CP.tail_text(three).startswith("TTFT p50: n too small (an interval needs 6 requests, have 3)")
    assert CP.median_text(three) == "p50: n too small (an interval needs 6 requests, have 3)"
    assert CP.median_text(few) == "p50 1.25 s [1, 6]"


def _run(df, **load):
    return SimpleNamespace(df=df, manifest={"load": load, "sampling": {"max_tokens": 8}})


def test_like_for_like_says_when_counts_differ_and_flips_with_the_numbers():
    ids = np.arange(6)
    base = pd.DataFrame({"status": "ok", "request_id": ids, "first_token_t": ids * 1.0,
                         "e2e_s": 1.0 + 0.1 * ids})
    users = _run(base, pattern="concurrency", concurrency=4)
    cut = _run(base.assign(e2e_s=base.e2e_s * 0.5), pattern="concurrency", concurrency=4)
    longer = _run(base.assign(e2e_s=base.e2e_s * 2.0), pattern="concurrency", concurrency=4)
    same = CP.like_for_like({"users": users, "short": cut}, "e2e_s", floor=0.1)
    assert same.startswith("users and short each sent 6 requests from 4 users at once") and "short faster" in same
    worse = CP.like_for_like({"users": users, "short": longer}, "e2e_s", floor=0.1)
    assert "users faster" in worse and "short faster" not in worse
    noisy = CP.like_for_like({"users": users, "short": _run(base.assign(e2e_s=base.e2e_s * 1.02),
                                                             pattern="concurrency", concurrency=4)}, floor=0.1)
    assert "within noise" in noisy and "faster" not in noisy.split(":", 2)[-1]
    fewer = CP.like_for_like({"users": users, "short": _run(cut.df.iloc[:4], pattern="concurrency", concurrency=4)})
    assert fewer.startswith("Not like with like: users sent 6 requests and short sent 4") and "longer queue" in fewer
    local = _run(base, pattern="sequential")
    prod = _run(base, pattern="poisson", rate_rps=1.5)
    mixed = CP.like_for_like({"one user": local, "production": prod}, "e2e_s", by="request")
    assert "one user sent them one at a time, production as independent arrivals at 1.5 requests/s" in mixed


def test_exercise_5_scores_the_ratio_its_row_prints():
    """14: exercise 5 scored p50 ÷ p50 (1.444 / 0.857 = 1.685) while the row it points to printed
    the median of the paired ratios (1.56×). The exercise's number is the row's number."""
    ids = np.arange(7)
    local = _run(pd.DataFrame({"status": "ok", "request_id": ids, "ttft_s": [0.5, 0.6, 0.8, 0.857, 0.9, 1.0, 1.2]}),
                 pattern="sequential")
    prod = _run(local.df.assign(ttft_s=local.df.ttft_s * [3.0, 2.5, 1.2, 1.56, 1.1, 1.5, 2.0]),
                pattern="poisson", rate_rps=1.0)
    runs = {"one user": local, "production": prod}
    iv = CP.paired_ratio(runs, "ttft_s", by="request")
    row = CP.like_for_like(runs, "ttft_s", floor=0.05, by="request", what="TTFT")
    assert f"production ÷ one user = {iv.median:.2f}×" in row and iv.median == pytest.approx(1.56)
    assert prod.df.ttft_s.median() / local.df.ttft_s.median() != pytest.approx(iv.median, rel=0.01)
    assert CP.paired_ratio({"a": local, "b": _run(local.df.assign(status="error"))}, "ttft_s", by="request") is None


def test_a_verdict_that_prints_p_names_its_threshold():
    """14 printed "p = 0.031 … within noise" beside "p = 0.025 → faster": the band test is
    one-sided on each side (0.025), the A/A relabelling test two-sided (0.05)."""
    before = _frame(np.ones(6))
    after = _frame([0.5] * 5 + [1.3])                  # one pair reversed: p = 1/32 on its side
    d = T.decide(before, after, floor=0.0)
    assert d["decision"] == "revert" and "p = 0.031, above this test's 0.025 per side" in d["why"]
    kept = T.decide(before, _frame([0.5] * 6), floor=0.0)
    assert kept["decision"] == "keep" and "p = 0.016, at or under this test's 0.025 per side" in kept["why"]
    from infercourse.measure import noise, tuning_log
    a = np.linspace(1.0, 1.2, 6)
    joint = noise.compare(a, a * 0.5, noise.noise_floor(a, a * 1.01))
    assert re.search(r"this test's 0\.05$", tuning_log.p_text(joint))        # two-sided: no "per side"


@pytest.mark.slow
def test_serve_and_measure_logs_the_kv_cache_it_predicts(tmp_path):
    from infercourse import Request
    from infercourse.models.modelcard import model_card
    cfg = T.ServerConfig(n_parallel=2, ctx_per_slot=512, threads=1)
    wl = [Request(messages=[{"role": "user", "content": "Count to five."}], max_tokens=4, ignore_eos=True)]
    out = T.serve_and_measure(cfg, {"one": (wl, {"max_requests": 2})}, results_root=tmp_path, warmup=1)
    assert out["config"] == cfg
    run = out["runs"]["one"]
    assert run.manifest["server_config"]["n_parallel"] == 2 and len(run.df) == 2
    assert out["rss_mb"] > 0
    # llama-server may round the cache up (padding), never below the formula
    assert out["kv_cache_mib"] >= CP.predicted_kv_mib(model_card(None), 1024) * 0.99
    assert out["one_cached_tokens"] >= 0
    shares = T.stage_shares(run.traces)
    assert (shares[["queue_share", "prefill_share", "decode_share"]].sum(axis=1) - 1).abs().max() < 1e-9


def test_predicted_queue_share_by_hand():
    # C=4, N=8, S=1: waits 0,1,2,3 then 3 each for the second round: 18 of 18 + 8
    assert T.predicted_queue_share(4, 8) == pytest.approx(18 / 26)
    assert T.predicted_queue_share(1, 8) == 0
    assert T.predicted_queue_share(4, 4) == pytest.approx(6 / 10)
    assert set(T.TARGETS) <= set(T.ServerConfig.__dataclass_fields__)


def test_tail_table_predicts_the_cap_from_medians():
    traces = [_trace(i, queue=0.0, prefill=0.2, decode=0.4, n=5) for i in range(6)]
    from infercourse.core.metrics import per_request_frame
    run = SimpleNamespace(df=per_request_frame(traces), manifest={"sampling": {"max_tokens": 5}})
    empty = SimpleNamespace(df=per_request_frame([]), manifest={"sampling": {"max_tokens": 5}})
    t = CP.tail_table({"a": run, "nothing": empty})
    assert list(t.index) == ["a"]
    assert t.loc["a", "tpot_p50_s"] == pytest.approx(0.1)          # 0.4 s over 4 gaps
    assert t.loc["a", "e2e_at_cap_s"] == pytest.approx(0.2 + 4 * 0.1) == t.loc["a", "e2e_p50_s"]
    assert t.loc["a", "requests"] == 6 and t.loc["a", "e2e_p50_interval"] == "[0.6, 0.6]"
    assert t.loc["a", "e2e_p95"] == f"p95: n too small (an interval needs {summary.min_n(0.95)} requests, have 6)"


def test_tuning_log_judges_trials_against_the_baselines_aa_repeat(tmp_path):
    base = T.ServerConfig()
    x = np.linspace(1.0, 2.0, 8)
    session = _session(tmp_path, "b", base, x)
    session["runs"]["users A/A"] = SimpleNamespace(df=_frame(x * np.where(np.arange(8) % 2, 1.3, 1 / 1.3)),
                                                   dir=tmp_path / "aa")
    log = T.TuningLog(tmp_path, guard="users:ttft_s")
    log.baseline(session)
    assert float(log.floor("users:ttft_s")) == pytest.approx(0.3) and f"{log.floor('users:ttft_s'):.0%}" == "30%"
    within = log.trial("n_parallel", _session(tmp_path, "t", base.change(n_parallel=2),
                                              x * np.where(np.arange(8) % 2, 1.25, 0.62)), target="users:ttft_s")
    assert within["decision"] == "revert" and "within noise" in within["why"]
    clear = log.trial("n_parallel", _session(tmp_path, "t2", base.change(n_parallel=4), x * 0.5),
                      target="users:ttft_s")
    assert clear["decision"] == "keep" and clear["floor"] == pytest.approx(0.3)


def test_the_log_passes_the_floor_object_so_its_rerun_is_data(tmp_path):
    """Four requests, a quiet A/A rerun, a halving: the joint test (A, its rerun and B relabelled
    in each request) finds it; a bare band's sign-flip test cannot at 4 pairs (its smallest
    p-value is 1/16). The log must pass the NoiseFloor, not its band."""
    base, x = T.ServerConfig(), np.array([1.0, 1.3, 1.7, 2.2])
    session = _session(tmp_path, "b", base, x)
    session["runs"]["users A/A"] = SimpleNamespace(df=_frame(x * np.array([1.01, 0.99, 1.005, 0.995])),
                                                   dir=tmp_path / "aa")
    log = T.TuningLog(tmp_path, guard="users:ttft_s")
    log.baseline(session)
    nf = log.floor("users:ttft_s")
    after = _session(tmp_path, "t", base.change(n_parallel=2), x * 0.5)
    bare = T.decide(session["runs"]["users"].df, after["runs"]["users"].df, "ttft_s", floor=float(nf))
    assert bare["decision"] == "revert" and "too few pairs" in bare["why"] and "either way" in bare["why"]
    kept = log.trial("n_parallel", after, target="users:ttft_s")
    assert kept["decision"] == "keep" and "relabelled" in kept["test"]


# ---- the queue race: one slot, C users sending at once, a different order every run ----------
def _one_slot_run(rng, *, order_seed, n=6, c=4, service=1.0, sigma=0.03, prefill=0.3, speed=1.0):
    """A closed-loop run against ONE slot: requests 0..c-1 are sent at t=0 and queue in an order
    that is a race (`order_seed` shuffles it); each later request is sent when a user's last
    one ends. Every request has the same work (equal prompts and answers), times `speed` and
    a lognormal noise of `sigma`. Returns the per-request frame with the stage columns."""
    from infercourse.core.metrics import per_request_frame
    work = service * speed * np.exp(rng.normal(0, sigma, n))
    queue = list(np.random.default_rng(order_seed).permutation(c))
    arrival, t_free, nxt, traces = {i: 0.0 for i in range(c)}, 0.0, c, []
    while queue:
        i = queue.pop(0)
        start = max(t_free, arrival[i])
        first, end = start + prefill * work[i], start + work[i]
        traces.append(RequestTrace(request_id=int(i), scheduled_t=arrival[i], sent_t=arrival[i],
                                   chunk_t=list(np.linspace(first, end, 5)), chunk_tokens=[1] * 5, end_t=end,
                                   prompt_tokens=10, completion_tokens=5,
                                   engine_timings={"prompt_ms": 1e3 * prefill * work[i]}))
        t_free = end
        if nxt < n:                      # that user sends its next request now
            arrival[nxt] = end
            queue.append(nxt)
            nxt += 1
    run = SimpleNamespace(traces=traces, df=per_request_frame(traces))
    T.add_stages(run)
    return run.df


def test_service_time_is_e2e_minus_the_wait_for_a_slot():
    df = _one_slot_run(np.random.default_rng(0), order_seed=1, sigma=0.0)
    assert df["service_s"].to_numpy() == pytest.approx(np.ones(6))          # the same work, wherever it queued
    assert sorted(df["queue_s"].round(6)) == pytest.approx([0, 1, 2, 3, 3, 3])
    assert (df["e2e_s"] - df["queue_s"] - df["service_s"]).abs().max() < 1e-12


def test_pairing_by_place_gives_the_true_noise_when_the_queue_order_is_shuffled():
    """The same config twice (A/A), 3% noise per request, the queue race turned out differently:
    pairing a queued time by request compares the first in line with the last and reports a
    floor of hundreds of percent; by place (and the service time by request) it finds the 3%."""
    from infercourse.measure import noise as N
    from infercourse.measure.tuning_log import pairs, queue_order
    rng = np.random.default_rng(7)
    a, a2 = _one_slot_run(rng, order_seed=1), _one_slot_run(rng, order_seed=2)
    assert queue_order(a)[:4] != queue_order(a2)[:4]
    old = N.noise_floor(*pairs(a, a2, "ttft_s", "request")).floor
    new = {m: N.noise_floor(*pairs(a, a2, m, by)).floor
           for m, by in (("ttft_s", "place"), ("e2e_s", "place"), ("service_s", "request"))}
    assert old > 1.0                                       # the race, read as noise
    assert all(f < 0.2 for f in new.values()), new         # sigma = 3% per run: the range of 6 ratios
    text = T.pairing_text(a, a2)
    assert "places changed hands" in text and "mostly the race for the slot" in text
    same = T.pairing_text(a, _one_slot_run(rng, order_seed=1))
    assert "The same order both times" in same and "changed hands" not in same


def test_the_log_keeps_a_real_service_cut_that_the_queue_race_hid(tmp_path):
    """Baseline, its A/A rerun and a trial 20% faster per request, each with its own queue order:
    the log (service time by request, E2E by place) keeps it; pairing E2E by request, the same
    data say nothing."""
    rng = np.random.default_rng(3)
    runs = [_one_slot_run(rng, order_seed=s, speed=v) for s, v in ((1, 1.0), (2, 1.0), (3, 0.8))]
    dirs = lambda name: tmp_path / name          # noqa: E731
    base = T.ServerConfig(n_parallel=1, threads=1)
    session = {"config": base, "runs": {"users": SimpleNamespace(df=runs[0], dir=dirs("a")),
                                        "users A/A": SimpleNamespace(df=runs[1], dir=dirs("aa"))}}
    log = T.TuningLog(tmp_path)                  # guard: users:e2e_s, paired by place
    log.baseline(session)
    trial = {"config": base.change(threads=2), "runs": {"users": SimpleNamespace(df=runs[2], dir=dirs("b"))}}
    target, goal, _ = T.TARGETS["threads"]
    kept = log.trial("threads", trial, target=target, goal=goal)
    assert target == "users:service_s" and kept["decision"] == "keep" and kept["paired_by"] == "request"
    assert "(better beyond noise)" in kept["guard"]
    by_request = T.decide(runs[0], runs[2], "e2e_s", aa=runs[1], pair_by="request")
    assert by_request["decision"] == "revert" and by_request["floor"] > 1.0
    assert "paired change by request" in T.explain_log(log.frame())
