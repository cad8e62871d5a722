"""Notebook 11's library: batching ceilings, Little's law, the knee, goodput; a real -np sweep."""
import json
import types

import numpy as np
import pandas as pd
import pytest

from infercourse.lessons import concurrency as cc
from infercourse.lessons import goodput as gp
from infercourse.measure import roofline

CARD = {"n_params": 100e6, "weight_bytes": 50e6, "n_layers": 10, "n_kv_heads": 2, "head_dim": 64}
MACHINE = {"bandwidth_gbs": 10.0, "matmul_gflops_f32": 100.0}


def test_batch_ceiling_is_the_lower_of_memory_and_compute():
    t = roofline.batch_ceiling(CARD, {**MACHINE, "matmul_threads": 1}, [1, 2, 4, 8])
    assert t.attrs["compute_source"] == "float32 matmul, 100 GFLOP/s on 1 thread"
    per_token = 50e6                                          # context 0: weights only
    assert t.loc[1, "memory_bound_tok_per_s"] == pytest.approx(10e9 / per_token)        # 200 tok/s
    assert t.loc[8, "memory_bound_tok_per_s"] == pytest.approx(8 * 10e9 / per_token)    # linear in B
    assert t["compute_bound_tok_per_s"].tolist() == pytest.approx([500.0] * 4)   # FLOP/s / 2P: flat
    assert list(t["bound"]) == ["memory", "memory", "compute", "compute"]
    assert (t["ceiling_tok_per_s"] == t[["memory_bound_tok_per_s", "compute_bound_tok_per_s"]].min(axis=1)).all()
    assert t.loc[4, "flops_per_byte"] == pytest.approx(4 * t.loc[1, "flops_per_byte"])


def test_context_lowers_the_memory_ceiling():
    at0 = roofline.batch_ceiling(CARD, MACHINE, [1])["memory_bound_tok_per_s"].iloc[0]
    at4k = roofline.batch_ceiling(CARD, MACHINE, [1], context=4096)["memory_bound_tok_per_s"].iloc[0]
    kv = 2 * 10 * 2 * 64 * 2 * 4096
    assert at4k == pytest.approx(10e9 / (50e6 + kv)) and at4k < at0


def test_each_sequence_reads_its_own_kv_cache():
    """b·BW / (weights + b·KV·ctx): with a long context the KV reads, not the weights,
    bound the batch (the old formula shared one KV cache across the batch)."""
    ctx, kv = 1024, 2 * 10 * 2 * 64 * 2
    t = roofline.batch_ceiling(CARD, {**MACHINE, "matmul_gflops_f32": 1e9}, [1, 64], context=ctx)
    assert t.loc[64, "memory_bound_tok_per_s"] == pytest.approx(64 * 10e9 / (50e6 + 64 * kv * ctx))
    assert t.loc[64, "memory_bound_tok_per_s"] < 64 * t.loc[1, "memory_bound_tok_per_s"] / 2


def test_compute_ceiling_keeps_the_lm_head():
    """Decode multiplies by the LM head every token: a tied card's n_params, not n_params - vocab·hidden."""
    card = {**CARD, "vocab_size": 1000, "hidden_size": 20_000}       # a 20 M-parameter head
    t = roofline.batch_ceiling(card, MACHINE, [1])
    assert t.loc[1, "compute_bound_tok_per_s"] == pytest.approx(100e9 / (2 * 100e6))


def test_littles_law_against_the_servers_own_count():
    t = pd.DataFrame({"requests_per_s": [2.0, 3.0], "e2e_s_mean": [0.5, 1.0], "L_server": [0.9, 2.0]},
                     index=pd.Index([1, 3], name="concurrency"))
    law = cc.littles_law(t)
    assert law["law_vs_server"].tolist() == pytest.approx([1.0 / 0.9, 1.5])
    open_loop = cc.littles_law(t.rename_axis("offered_req_per_s"))
    assert "users" not in open_loop and "L_server" in open_loop


def test_scaled_slo():
    t = pd.DataFrame({"ttft_s_p50": [0.2, 0.5], "tpot_s_p50": [0.02, 0.03], "output_tok_per_s": [5.0, 6.0]},
                     index=pd.Index([1, 4], name="concurrency"))
    assert gp.scaled_slo(t, {"ttft_s": 3, "tpot_s": 2}) == pytest.approx({"ttft_s": 0.6, "tpot_s": 0.04})


def test_littles_law_and_knee_on_a_table():
    t = pd.DataFrame({"requests_per_s": [2.0, 3.5, 4.0], "e2e_s_mean": [0.5, 0.57, 1.0],
                      "output_tok_per_s": [64.0, 112.0, 120.0]}, index=pd.Index([1, 2, 4], name="concurrency"))
    law = cc.littles_law(t)
    assert law["L_predicted"].tolist() == pytest.approx([1.0, 1.995, 4.0])
    assert gp.knee(t) == 2                                    # 2 -> 4 gained only 7 %
    assert gp.knee(t, min_gain=0.05) == 4


def test_staggered_varies_lengths_only():
    from infercourse.core.types import Request
    from infercourse.measure.workloads import Workload
    wl = Workload("w", tuple(Request(prompt=f"p{i}", max_tokens=8) for i in range(4)))
    st = cc.staggered(wl)
    assert [r.max_tokens for r in st.requests] == [2, 8, 16, 2]
    assert [r.prompt for r in st.requests] == [r.prompt for r in wl.requests] and st.name == "w-staggered"


def test_goodput_by_level_counts_requests_meeting_every_slo():
    df = pd.DataFrame({"status": ["ok", "ok", "ok", "error"], "ttft_s": [0.2, 0.9, 0.3, np.nan],
                       "tpot_s": [0.05, 0.05, 0.2, np.nan], "output_tokens": [8, 8, 8, 0],
                       "scheduled_t": [0.0, 0.0, 1.0, 1.0], "end_t": [1.0, 1.5, 2.0, 2.0],
                       "prompt_tokens": [10, 10, 10, 10]})
    run = types.SimpleNamespace(df=df, manifest={"label": "np4"})
    g = gp.goodput_by_level([run, types.SimpleNamespace(df=df, manifest={"label": "np4-r1"})],
                            {"ttft_s": 0.5, "tpot_s": 0.1})
    # goodput is a rate (1 good request over a 2 s window); attainment is the share, pooled over repeats
    assert list(g.index) == ["np4"] and g.loc["np4", "goodput_req_per_s"] == pytest.approx(0.5)
    assert g.loc["np4", "slo_attainment"] == 0.25


def test_fixed_workload_is_exact_and_distinct():
    from infercourse.models.embedded import vocab_tokenizer
    wl = cc.fixed_workload(48, 8, 3)
    tok = vocab_tokenizer()
    assert [len(tok(r.prompt)) for r in wl.requests] == [48, 48, 48]
    assert len({r.prompt.split()[0] for r in wl.requests}) == 3 and all(r.ignore_eos for r in wl.requests)


@pytest.mark.slow
def test_np_sweep_obeys_littles_law(tmp_path):
    wl = cc.fixed_workload(32, 8, 4)
    table, runs = cc.np_sweep(wl, [1, 2], requests_per_level=4, threads=1, ctx_per_slot=128, out_dir=tmp_path)
    assert list(table.index) == [1, 2] and (table["error_rate"] == 0).all()
    assert (table["requests"] == 4).all() and (tmp_path / "np2" / "manifest.json").exists()
    law = cc.littles_law(table)
    # closed loop: L = λW cannot exceed the users, and stays close to it
    assert (law["L_predicted"] <= law["users"] * 1.05).all() and (law["L_predicted"] >= 0.5 * law["users"]).all()
    # the server's own count of requests in it can never exceed its slots
    assert (law["L_server"].dropna() <= law["users"] + 1e-9).all()
    assert "-np" in runs[1].manifest["server"]["argv"] and runs[1].manifest["server"]["argv"][
        runs[1].manifest["server"]["argv"].index("-np") + 1] == "2"


@pytest.mark.slow
def test_np_sweep_repeats_with_an_aa_floor(tmp_path):
    wl = cc.fixed_workload(32, 4, 2)
    table, runs = cc.np_sweep(wl, [1, 2], requests_per_level=2, threads=1, ctx_per_slot=96, repeats=2)
    # two blocks of A, its A/A rerun and B give 3^2 relabellings: p >= 1/9, never a verdict
    assert len(runs) == 4 and set(table["verdict"]) == {"reference", "too few pairs"}
    assert table.attrs["noise_floor"] >= 0 and "A/A" in table.attrs["noise_floor_text"]
    assert table.loc[1, "gain"] == 1.0 and table.loc[2, "gain_lo"] <= table.loc[2, "gain"] <= table.loc[2, "gain_hi"]


@pytest.mark.slow
def test_cb_compare_runs_both_settings(tmp_path):
    wl = cc.fixed_workload(32, 8, 2)
    t = cc.cb_compare(cc.staggered(wl), 2, requests=2, threads=1, ctx_per_slot=128, out_dir=tmp_path)
    assert list(t["flag"]) == ["-cb", "-nocb"] and (t["error_rate"] == 0).all()
    # each setting's run is saved under its arm's name (repeats=1: no -r<rep> suffix),
    # with the server's own argv in its manifest: the flag really reached the server
    for folder, flag in [("continuous_batching", "-cb"), ("no_continuous_batching", "-nocb")]:
        manifest = json.loads((tmp_path / folder / "manifest.json").read_text())
        assert flag in manifest["server"]["argv"]


def test_np_sweep_and_cb_compare_repeat_with_an_aa_arm(monkeypatch):
    """The sweep's bookkeeping on a stand-in server (no llama-server): every level and the
    A/A rerun run `repeats` times, the A/A rerun leaves no row, and the verdicts exist."""
    import contextlib

    from infercourse.core.types import Request
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    from infercourse.measure.workloads import Workload
    from infercourse.testing import SSESource
    started = []

    @contextlib.contextmanager
    def stand_in(model, n, ctx, threads, extra):
        started.append((n, tuple(extra)))
        with SSESource() as src:
            yield types.SimpleNamespace(url=src.url, describe=lambda: {"argv": ["stand-in", "-np", str(n)]},
                                        engine=lambda api="completions": OpenAIHTTPEngine(src.url, api=api))
    monkeypatch.setattr(cc, "_server", stand_in)
    wl = Workload("w", tuple(Request(prompt=f"p{i} x", max_tokens=4) for i in range(4)))
    table, runs = cc.np_sweep(wl, [1, 2], requests_per_level=2, repeats=2)
    assert sorted(n for n, _ in started) == [1, 1, 1, 1, 2, 2] and len(runs) == 4
    assert list(table.index) == [1, 2] and table.loc[1, "verdict"] == "reference"
    assert table.loc[2, "verdict"] == "too few pairs"          # 2 blocks: the joint test needs 3
    assert "A/A" in table.attrs["noise_floor_text"] and "L_server" in table
    started.clear()
    cb = cc.cb_compare(wl, 2, requests=2, repeats=2)
    assert [e for _, e in started].count(("-cb",)) == 4 and list(cb["flag"]) == ["-cb", "-nocb"]
    assert cb.attrs["verdict"].startswith("TTFT p50: ")    # a p95 of two requests has no interval
    assert set(cb.attrs["comparisons"]) == {"ttft_s_p50", "e2e_s_p50", "output_tok_per_s"}
    assert {"decode_tok_per_s", "prefill_share", "decode_verdict"} <= set(table.columns)
    assert table.attrs["decode_noise_floor"] >= 0      # the decode rate's own A/A band, for the limit sentence
    # medians over trials of N / TPOT p50: positive, and a share of time before the first token
    assert (table["decode_tok_per_s"] > 0).all() and table["prefill_share"].between(0, 1).all()


@pytest.mark.slow
def test_one_level_measures_a_level_outside_the_sweep(tmp_path):
    """A level the sweep did not run, on a real llama-server: its slots are the level (from the
    server's own argv), every user sends at least two requests, all of one shape (one prompt
    length, the asked answer length), and the row holds the sweep's columns."""
    row = cc.one_level(3, prompt_tokens=24, max_tokens=6, requests=2, threads=1, out_dir=tmp_path)
    assert row.name == 3 and row["requests"] == 6 and row["error_rate"] == 0
    assert {"output_tok_per_s", "decode_tok_per_s", "ttft_s_p50", "tpot_s_p50", "prefill_share"} <= set(row.index)
    manifest = json.loads((tmp_path / "np3" / "manifest.json").read_text())
    argv = manifest["server"]["argv"]
    assert argv[argv.index("-np") + 1] == "3"
    recs = [json.loads(x) for x in (tmp_path / "np3" / "requests.jsonl").read_text().splitlines()]
    assert len({r["prompt_tokens"] for r in recs}) == 1 and {r["completion_tokens"] for r in recs} == {6}
