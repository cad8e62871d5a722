"""The fair-benchmark lesson: refusing unfair comparisons, labelling allowed differences,
routes that cannot run, the engine table, a peer tool's file beside our runs."""
import math
import re

import pandas as pd
import pytest

from infercourse.core.trace import RequestTrace
from infercourse.lessons import fair
from infercourse.measure import results as R


def _run(path, label, *, quant="Q4_1", threads=1, cpu="cpu-A", ttft=0.1, ttfts=None, **extra):
    manifest = {"label": label, "engine": {"engine": label}, "model": "m", "sampling": {"max_tokens": 4},
                "load": {"pattern": "sequential", "concurrency": 1, "max_requests": 3, "max_duration_s": None},
                "workload": {"sha256": "w1"}, "hardware": {"cpu": cpu},
                "fair": {"weights": "W", "quantization": quant, "threads": threads, "context_tokens": 2048}, **extra}
    with R.RunWriter(path, manifest) as w:
        for i, t in enumerate(ttfts or [ttft] * 3):
            w.write(RequestTrace(request_id=i, scheduled_t=0.0, sent_t=0.0, chunk_t=[t, t + 0.05],
                                 chunk_tokens=[1, 1], end_t=t + 0.05, prompt_tokens=10,
                                 completion_tokens=2, cached_tokens=4))
    return R.load_run(path)


def test_differing_conditions_refuses_and_names_the_condition(tmp_path):
    a = _run(tmp_path / "a", "llama.cpp")
    b = _run(tmp_path / "b", "transformers", quant="float32")
    assert "fair.quantization" in R.differing_conditions([a, b]).index   # default: just lists
    with pytest.raises(R.UnfairComparisonError) as e:
        R.differing_conditions([a, b], must_match=fair.FAIR_KEYS)
    msg = str(e.value)
    assert "fair.quantization differs" in msg and "'Q4_1'" in msg and "'float32'" in msg
    assert "measurement layer" in msg
    diff = R.differing_conditions([a, b], must_match=fair.FAIR_KEYS, allow=["fair.quantization"])
    assert diff.loc["fair.quantization"].tolist() == ["Q4_1", "float32"]


def test_a_required_condition_no_run_records_is_refused(tmp_path):
    a, b = _run(tmp_path / "a", "x"), _run(tmp_path / "b", "y")
    R.differing_conditions([a, b], must_match=["hardware", "fair.weights"])   # fair: no raise
    with pytest.raises(R.UnfairComparisonError, match="fair.gpu is recorded by no run"):
        R.differing_conditions([a, b], must_match=["fair.gpu"])


def test_allowed_differences_do_not_excuse_others(tmp_path):
    a = _run(tmp_path / "a", "x")
    b = _run(tmp_path / "b", "y", quant="float32", cpu="cpu-B")
    with pytest.raises(R.UnfairComparisonError, match=r"hardware\.cpu differs") as e:
        R.differing_conditions([a, b], must_match=fair.FAIR_KEYS, allow=fair.LABELLED)
    assert "quantization" not in str(e.value)


def test_fair_table_labels_what_differs_from_the_reference(tmp_path):
    runs = {"llama.cpp": _run(tmp_path / "a", "llama.cpp", ttft=0.1),
            "same": _run(tmp_path / "b", "same", ttft=0.2),
            "transformers": _run(tmp_path / "c", "transformers", quant="float32", threads=2, ttft=0.4)}
    with pytest.raises(R.UnfairComparisonError):
        fair.fair_table(runs, allow=())
    t = fair.fair_table(runs)
    col = "differs from llama.cpp"
    assert t.loc["llama.cpp", col] == "reference" and t.loc["same", col] == "same conditions"
    assert "quantization=float32" in t.loc["transformers", col] and "threads=2" in t.loc["transformers", col]
    assert t.loc["transformers", "ttft_first_s"] == pytest.approx(0.4)


def test_fair_table_keeps_the_cold_call_apart_and_prints_no_p50_over_both(tmp_path):
    """Issue 31, 13: the notebook said a p50 over a cold and a warm call describes neither, then
    printed it (2.721 s) in this table. Call 1 and the later calls' p50 are printed apart."""
    runs = {"a": _run(tmp_path / "a", "a", ttfts=[5.0, 0.4, 0.6]), "b": _run(tmp_path / "b", "b", ttfts=[4.0, 2.0])}
    t = fair.fair_table(runs)
    assert not [c for c in t.columns if c.startswith(("ttft_s_", "e2e_s_"))]
    assert t.loc["a", "ttft_first_s"] == pytest.approx(5.0) and t.loc["a", "ttft_later_p50_s"] == pytest.approx(0.5)
    assert t.loc["b", "ttft_first_s"] == pytest.approx(4.0) and t.loc["b", "ttft_later_p50_s"] == pytest.approx(2.0)
    assert 3.0 not in t.round(6).to_numpy().tolist()                 # b's mean of cold and warm, nowhere


def test_route_status_and_unusable_routes_get_a_reason(tmp_path):
    status = {c: {"usable": False, "why": f"no {c} here"} for c in
              ("llamacpp", "llama-server", "transformers", "mlx", "vllm", "ollama")}
    with pytest.raises(ValueError, match="unknown route"):
        fair.route_status(["nope"], status)
    rows, runs = fair.measure_routes(["vLLM CPU", "Ollama"], fair.agent_calls(2, 4), threads=1,
                                     ctx_size=2048, results_root=tmp_path, status=status)
    assert runs == {} and not rows["ran"].any()
    assert rows.loc["Ollama", "why"] == "no ollama here"
    table = fair.engine_table(rows)
    assert table.loc["vLLM CPU", "api"].startswith("OpenAI") and table.loc["vLLM CPU", "why"] == "no vllm here"
    assert math.isnan(table.loc["Ollama", "ttft_first_s"])


def test_agent_calls_force_the_same_length_and_grow():
    wl = fair.agent_calls(3, 8)
    assert len(wl.requests) == 3
    assert all(r.max_tokens == 8 and r.ignore_eos for r in wl.requests)
    lens = [len(r.messages) for r in wl.requests]
    assert lens == sorted(lens) and lens[0] < lens[-1]          # an agent's context grows
    assert wl.sha256 == fair.agent_calls(3, 8).sha256 != fair.agent_calls(3, 9).sha256


def test_peer_file_beside_ours_lists_what_it_does_not_record(tmp_path):
    ours = _run(tmp_path / "a", "ours")
    peer = fair.peer_run()
    assert peer.manifest["fair"]["weights"] == "smollm2-135m"
    assert len(peer.df) == 4 and (peer.df["status"] != "ok").sum() == 1
    with pytest.raises(R.UnfairComparisonError, match="hardware.cpu differs"):
        R.differing_conditions([ours, peer], must_match=fair.FAIR_KEYS)
    side = fair.peer_beside_ours(ours, peer)
    assert list(side.index) == ["ours, call 1 (cold)", peer.label]
    assert side.loc["ours, call 1 (cold)", "completed"] == 1     # our call 1 only: no p50 over cold and warm
    assert side.loc[peer.label, "error_rate"] == pytest.approx(0.25)
    assert side.loc["ours, call 1 (cold)", "conditions that differ"] > 0


@pytest.mark.slow
def test_llamacpp_route_measures_every_column(tmp_path):
    status = {"llamacpp": {"usable": True, "why": "ok"}}
    rows, runs = fair.measure_routes(["llama.cpp in process"], fair.agent_calls(2, 4), threads=1,
                                     ctx_size=2048, results_root=tmp_path, status=status)
    row = rows.loc["llama.cpp in process"]
    assert row["ran"], row["why"]
    assert row["quantization"] == "Q4_1" and row["error_rate"] == 0
    assert row["calls"] == 2 and row["memory_mb"] > 0
    assert 0 < row["cache_hit"] < 1        # call 2 extends call 1: its prefix is reused
    assert row["cache_hit_later"] > row["cache_hit_first"]
    assert row["ttft_first_s"] > 0 and row["ttft_later_p50_s"] > 0 and row["prefill_first_tok_per_s"] > 0
    assert runs["llama.cpp in process"].manifest["fair"]["threads"] == 1


def test_explain_says_the_server_cost_only_from_the_interleaved_comparison(tmp_path):
    from infercourse.measure import noise
    base = _run(tmp_path / "a", "llama.cpp in process", ttfts=[0.10, 0.20, 0.30])
    slower = _run(tmp_path / "b", "llama-server", ttfts=[0.11, 0.22, 0.31])
    rows = pd.DataFrame({"ran": [True, True], "decode_tok_per_s": [20.0, 19.0], "quantization": ["Q4_1"] * 2,
                         "cache_hit": [0.5, 0.5], "memory_mb": [100.0, 120.0], "why": ["", ""]},
                        index=["llama.cpp in process", "llama-server"])
    text = FC.explain(rows, {"llama.cpp in process": base, "llama-server": slower}, 5.0)
    assert "no verdict here" in text and "sooner" not in text and "adds" not in text   # one run each: no claim
    a, a2 = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95], [1.02, 1.08, 0.93, 0.98, 1.04, 0.97]
    floor = noise.noise_floor(a, a2)
    far = {"floor": floor, "comparison": noise.compare(a, [2 * x for x in a], floor, labels=("in process", "llama-server"))}
    assert "**in process faster**" in FC.explain(rows, {}, 5.0, paired=far)
    near = {"floor": floor, "comparison": noise.compare(a, a2, floor, labels=("in process", "llama-server"))}
    text = FC.explain(rows, {}, 5.0, paired=near)
    assert "**within noise**" in text and "A/A noise floor" in text


def test_explain_never_ranks_or_judges_single_runs_with_another_experiments_band():
    """Issue 31, 13: "Fastest decode: llama-server at 47 tok/s" on 47.13 against 46.74, and a
    decode ratio judged against the A/A band of the interleaved TTFT comparison."""
    from infercourse.measure import noise
    rows = pd.DataFrame({"ran": [True, True], "decode_tok_per_s": [46.74, 47.13], "quantization": ["Q4_1"] * 2,
                         "cache_hit": [0.5, 0.5], "memory_mb": [100.0, 120.0], "why": ["", ""]},
                        index=["llama.cpp in process", "llama-server"])
    text = FC.explain(rows, {}, 5.0)
    assert "Highest decode rate in this run: **llama-server** at 47.1 tok/s" in text and "not a ranking" in text
    assert "then llama.cpp in process at 46.7 (1.01×)" in text and not re.search(r"\b[Ff]astest\b", text)
    flipped = FC.explain(rows.assign(decode_tok_per_s=[47.13, 46.74]), {}, 5.0)
    assert "in this run: **llama.cpp in process**" in flipped
    two = pd.DataFrame({"ran": [True, True], "decode_tok_per_s": [40.0, 10.0], "quantization": ["Q4_1", "F32"],
                        "cache_hit": [0.5, 0.0], "memory_mb": [100.0, 300.0], "why": ["", ""]},
                       index=["llama.cpp in process", "transformers"])
    a, a2 = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95], [1.02, 1.08, 0.93, 0.98, 1.04, 0.97]
    floor = noise.noise_floor(a, a2)
    paired = {"floor": floor, "comparison": noise.compare(a, a2, floor)}
    for p in (None, paired):                         # the TTFT comparison's band judges no decode ratio
        t = FC.explain(two, {}, 5.0, paired=p)
        assert "llama.cpp in process ÷ transformers: 4.00× (one run each, not judged)" in t
        assert not re.search(r"\b(outside|inside) the A/A noise band", t)


def _params(notebook: str) -> dict:
    """The values of a notebook's parameters cell, executed on its own."""
    import json
    from pathlib import Path
    nb = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / notebook).read_text(encoding="utf-8"))
    cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    ns: dict = {}
    exec("".join(cell["source"]), ns)
    return ns


def test_notebook_13_runs_every_route_that_can_run_here_by_default():
    """13's defaults skip nothing that runs here: MLX's and vLLM's CPU builds included (a
    stand-in status says every route is usable, as on a machine with mlx[cpu] and `make vllm`)."""
    p = _params("13_fair_benchmark.ipynb")
    usable = {c: {"usable": True, "why": f"{c} 1.0"} for c in
              ("llamacpp", "llama-server", "transformers", "mlx", "vllm", "ollama")}
    todo = fair.plan(p["ROUTES"], usable, skip=p["SKIP"])
    assert {"mlx_lm.server", "vLLM CPU"} <= set(p["ROUTES"]) and todo["run"].all()
    assert todo.loc["vLLM CPU", "why"] == "runs: vllm 1.0"


def test_a_route_is_skipped_only_with_its_computed_reason_or_yours():
    status = {c: {"usable": True, "why": "ok"} for c in
              ("llamacpp", "llama-server", "transformers", "mlx", "vllm", "ollama")}
    status["vllm"] = {"usable": False, "why": "no vLLM here; `make vllm` builds the CPU build's own env at /x/vllm-cpu"}
    todo = fair.plan(["mlx_lm.server", "vLLM CPU", "transformers"], status, skip={"transformers": "too slow for me"})
    assert todo["run"].tolist() == [True, False, False]
    assert todo.loc["vLLM CPU", "why"] == status["vllm"]["why"]
    assert todo.loc["transformers", "why"] == "skipped by you: too slow for me"
    with pytest.raises(ValueError, match="not in the list"):
        fair.plan(["transformers"], status, skip={"Ollama": "x"})


# ---- cold and warm calls apart; sentences that flip with the numbers (issue 26) -------------------
from contextlib import contextmanager  # noqa: E402

from infercourse.lessons import fair_claims as FC  # noqa: E402
from infercourse.measure import noise  # noqa: E402


def test_row_keeps_the_cold_call_apart_from_the_warm_ones(tmp_path):
    manifest = {"label": "r", "engine": {}, "model": "m", "sampling": {}, "load": {}, "workload": {},
                "fair": {"quantization": "Q4_1"}}
    with R.RunWriter(tmp_path / "r", manifest) as w:
        for i, (t, prompt, cached) in enumerate([(2.0, 100, 0), (0.2, 120, 100), (0.4, 150, 120)]):
            w.write(RequestTrace(request_id=i, scheduled_t=0.0, sent_t=0.0, chunk_t=[t, t + 0.05],
                                 chunk_tokens=[1, 1], end_t=t + 0.05, prompt_tokens=prompt,
                                 completion_tokens=2, cached_tokens=cached))
    row = fair._row("r", R.load_run(tmp_path / "r"), 1e6)
    assert row["calls"] == 3 and row["ttft_first_s"] == pytest.approx(2.0)
    assert row["ttft_later_p50_s"] == pytest.approx(0.3)            # p50 of calls 2 and 3 only
    assert row["prefill_first_tok_per_s"] == pytest.approx(100 / 2.0)
    assert row["e2e_first_s"] == pytest.approx(2.05) and "e2e_p50_s" not in row     # no p50 over cold and warm
    assert row["cache_hit_first"] == 0 and row["cache_hit_later"] == pytest.approx(220 / 270)
    assert row["cache_hit"] == pytest.approx(220 / 370)


def _rows(**cols) -> pd.DataFrame:
    base = {"ran": [True, True], "quantization": ["Q4_1", "F32"], "calls": [2, 2]}
    return pd.DataFrame({**base, **cols}, index=["llama.cpp in process", "transformers"])


# the issue's run: transformers prefills faster (no cache), llama.cpp reuses call 1 on call 2
ISSUE = dict(ttft_first_s=[5.0, 2.5], ttft_later_p50_s=[0.6, 3.0], prefill_first_tok_per_s=[108.0, 244.0],
             cache_hit_first=[0.0, 0.0], cache_hit_later=[0.9, 0.0], decode_tok_per_s=[40.0, 12.0])


def test_ttft_sentence_names_the_lowest_route_and_what_goes_with_it():
    text = FC.ttft_sentence(_rows(**ISSUE))
    first, later = text.splitlines()
    assert "lowest in this run was **transformers** (F32) at 2.5 s" in first and "its prefill rate explains it" in first
    assert "one run per route, not judged" in first and "If the gap is more than noise" in first
    assert "**llama.cpp in process** (Q4_1) at 0.6 s" in later and "its prefix cache explains it" in later
    # flipped: llama.cpp prefills faster and transformers wins the later calls on rate alone
    flip = _rows(**{**ISSUE, "ttft_first_s": [2.5, 5.0], "prefill_first_tok_per_s": [244.0, 108.0]})
    first = FC.ttft_sentence(flip).splitlines()[0]
    assert "**llama.cpp in process** (Q4_1) at 2.5 s" in first and "its prefill rate explains it" in first
    # later calls won by transformers, with no cache on either side: its rate, not a cache
    rate = _rows(**{**ISSUE, "ttft_later_p50_s": [3.0, 0.6], "cache_hit_later": [0.0, 0.0]})
    later = FC.ttft_sentence(rate).splitlines()[1]
    assert "**transformers** (F32) at 0.6 s" in later and "its prefill rate explains it, not a prefix cache" in later
    # ... and by a route with neither more hits nor a higher rate: neither goes with it
    neither = _rows(**{**ISSUE, "ttft_later_p50_s": [3.0, 0.6], "cache_hit_later": [0.5, 0.0],
                       "prefill_first_tok_per_s": [244.0, 108.0]})
    assert "Neither more cache hits nor a higher prefill rate" in FC.ttft_sentence(neither)


def test_ttft_sentence_judges_no_gap_and_says_when_there_is_no_later_call():
    """Issue 31, 13: "later calls ... 1.15×, outside the band": one call per route against the A/A
    band of another experiment. A single value per route is given, never judged."""
    text = FC.ttft_sentence(_rows(**{**ISSUE, "ttft_later_p50_s": [0.6, 0.69]}))
    assert "(1.15×; one run per route, not judged)" in text.splitlines()[1]
    assert not re.search(r"\b(outside|inside) the A/A noise band\b", text)
    one = _rows(**{**ISSUE, "ttft_later_p50_s": [math.nan, math.nan], "calls": [1, 1]})
    assert "none here (one call per route)" in FC.ttft_sentence(one)


# decode ceilings (tok/s) per weight format: 15-30 % of them, as in the issue's run
CEIL = {"Q4_1": 160.0, "F32": 80.0}


def test_rates_sentence_reads_decode_and_prefill_separately():
    text = FC.rates_sentence(_rows(**ISSUE), CEIL)
    assert "Prefill rate of call 1, tok/s, highest first in this run: transformers (F32) 244, llama.cpp" in text
    assert "4-bit led decode and trailed prefill" in text and "one run per route, not judged" in text
    flip = _rows(**{**ISSUE, "prefill_first_tok_per_s": [244.0, 108.0], "decode_tok_per_s": [12.0, 40.0]})
    assert "4-bit trailed decode and led prefill" in FC.rates_sentence(flip, CEIL)
    both = _rows(**{**ISSUE, "prefill_first_tok_per_s": [300.0, 108.0]})
    assert "4-bit led both phases" in FC.rates_sentence(both, CEIL)
    no_float = _rows(**ISSUE, quantization=["Q4_1", "Q8_0"])
    assert "cannot set the two bounds side by side" in FC.rates_sentence(no_float, CEIL)


def test_rates_sentence_says_bandwidth_bound_only_from_the_measured_share():
    """Issue 31, 13: "fewer bytes help bandwidth-bound decode" at 15-30 % of the ceilings."""
    low = FC.rates_sentence(_rows(**ISSUE), CEIL)                  # 40/160 = 25 %, 12/80 = 15 %
    assert "llama.cpp in process 25% (not bandwidth-bound here)" in low and "transformers 15%" in low
    assert "do not explain a decode gap here" in low and not re.search(r"(?<!not )\bbandwidth-bound here", low)
    high = FC.rates_sentence(_rows(**{**ISSUE, "decode_tok_per_s": [120.0, 50.0]}), CEIL)   # 75 %, 62 %
    assert "llama.cpp in process 75% (bandwidth-bound here)" in high and "fewer bytes per token do help" in high
    assert "not bandwidth-bound" not in high
    none = FC.rates_sentence(_rows(**ISSUE))
    assert "not measured" in none and "% (bandwidth-bound here)" not in none
    shares = FC.ceiling_shares(_rows(**ISSUE), CEIL)
    assert shares.tolist() == pytest.approx([0.25, 0.15])


def test_format_names():
    assert all(map(FC.is_4bit, ["Q4_1", "Q4_K_M", "MLX 4-bit g64"])) and not FC.is_4bit("F32")
    assert all(map(FC.is_float, ["F32", "float32", "BF16", "fp16"])) and not FC.is_float("Q4_1")


def test_sign_test():
    assert FC.sign_test_p(6, 6) == pytest.approx(2 / 64) and FC.sign_test_p(0, 6) == pytest.approx(2 / 64)
    assert FC.sign_test_p(5, 6) == pytest.approx(2 * 7 / 64) and FC.sign_test_p(1, 2) == 1.0


def _paired(a, a2, repeats=6):
    arms = ["in process", "llama-server", "in process (A/A)"]
    return {"values": {"in process": a, "in process (A/A)": a2}, "order": noise.schedule(arms, repeats, "ABBA")}


def test_order_sentence_tells_a_label_effect_from_a_position_effect_from_noise():
    a = [1.0] * 6
    issue = FC.order_sentence(_paired(a, [1.13, 1.20, 1.01, 1.15, 1.18, 1.11]))   # the rerun always slower
    assert "in 6 of 6 pairs" in issue and "differ systematically" in issue
    # the later reference in each block slower: the rerun is later in even blocks (ABBA, mirrored)
    late = FC.order_sentence(_paired(a, [1.1, 0.9, 1.1, 0.9, 1.1, 0.9]))
    assert "A position effect" in late and "takes longer" in late and "in 3 of 6 pairs" in late
    mixed = FC.order_sentence(_paired(a, [1.1, 1.1, 0.9, 1.1, 0.9, 0.9]))
    assert "no sign of an order effect" in mixed
    few = FC.order_sentence(_paired([1.0, 1.0], [1.2, 1.1], repeats=2))
    assert "cannot tell an order effect from noise" in few


def _fake_engines(monkeypatch, cost):
    """open_route and record replaced: each call's TTFT = cost(engine, call index)."""
    calls = []

    @contextmanager
    def fake_open(name, *, threads, ctx_size):
        yield (name, threads), {}, (lambda: 0.0)

    def fake_record(engine, request, raise_errors=True):
        t = cost(engine, len(calls))
        calls.append(engine)
        return RequestTrace(request_id=0, scheduled_t=0.0, sent_t=0.0, chunk_t=[t, t + 0.1, t + 0.2],
                            chunk_tokens=[1, 1, 1], end_t=t + 0.2, prompt_tokens=10, completion_tokens=3)
    monkeypatch.setattr(fair, "open_route", fake_open)
    monkeypatch.setattr(fair, "record", fake_record)
    return calls


@pytest.mark.parametrize("repeats", [2, 4, 6])
def test_the_trials_run_in_the_recorded_shuffled_order(monkeypatch, repeats):
    """Issue 31 §1: ABBA put the server in the middle of every block, so a middle-slot cost read as
    the server's. The blocks are shuffled (seeded) and the order returned is the order that ran;
    a cost of the last slot is then found by the A/A order check, not called a server cost."""
    def cost(engine, i):
        k = i - 6                                     # after the 3 arms' warm-ups (2 calls each)
        return 1.0 + (0.1 * ((k // 2) % 3) if k >= 0 else 0.0)      # each later slot in a block is slower
    calls = _fake_engines(monkeypatch, cost)
    out = fair.server_vs_in_process(fair.WARMUP, threads=1, ctx_size=512, repeats=repeats)
    order = out["order"]
    assert len(calls) == 2 * 3 * (repeats + 1)                    # warm-up + call, per trial
    route = {"in process": "llama.cpp in process", "in process (A/A)": "llama.cpp in process",
             "llama-server": "llama-server"}
    assert [calls[6 + 2 * k][0] for k in range(len(order))] == [route[a] for _, a in order]
    assert [b for b, _ in order] == [i for i in range(repeats) for _ in range(3)]
    if repeats >= 4:
        assert len({a for _, a in order[1::3]}) > 1              # no arm owns the middle slot
    if repeats == 6:
        assert "A position effect" in FC.order_sentence(out)


def test_thread_scaling_reads_speedups_from_paired_trials(monkeypatch):
    _fake_engines(monkeypatch, lambda engine, i: 2.0 / engine[1])      # twice the threads, half the TTFT
    out = fair.thread_scaling(fair.WARMUP, (1, 2), ctx_size=512, repeats=2)
    assert out["ttft_speedup"] == pytest.approx(2.0) and out["pairs"] == 2
    assert out["decode_speedup"] == pytest.approx(1.0)     # the fake's token gaps do not change


def test_later_calls_set_a_route_without_a_cache_beside_the_two_lowest():
    """The full-size run's shape: two cached routes close together, transformers re-prefilling."""
    rows = pd.DataFrame({"ran": [True] * 3, "quantization": ["Q4_1", "Q4_1", "F32"], "calls": [2] * 3,
                         "ttft_first_s": [13.8, 12.5, 5.2], "ttft_later_p50_s": [2.66, 3.18, 6.15],
                         "prefill_first_tok_per_s": [42.0, 46.0, 113.0], "cache_hit_first": [0.01, 0.01, 0.0],
                         "cache_hit_later": [0.83, 0.83, 0.0]},
                        index=["llama.cpp in process", "llama-server", "transformers"])
    later = FC.ttft_sentence(rows).splitlines()[1]
    assert "warm: call 2, one per route" in later and "(1.20×; one run per route, not judged)" in later
    assert "transformers, which reused no prefix (0% cached), took 6.15 s on them, 2.31× the lowest" in later
    cached = FC.ttft_sentence(rows.assign(cache_hit_later=[0.83, 0.83, 0.5]))
    assert "reused no prefix" not in cached
    three = FC.ttft_sentence(rows.assign(calls=[3] * 3))
    assert "calls 2 to 3, their TTFT p50 per route" in three
