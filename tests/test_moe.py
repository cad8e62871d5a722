"""The upcycled mixture of experts (models.moe, models.moe_hf), its measurements (lessons.moe, measure.batch_steps)
and its sentences (lessons.moe_claims).

Equality with the dense model is tested at three levels:
- construction, exactly: every expert is the dense FFN's bytes; the wide model's down
  projection, dequantized and summed over its tiles, is the dense one (numpy, float64);
- llama.cpp with k = 1: the router's single weight is exactly 1, so the logits are bit-identical
  to the dense model's and so is the greedy text;
- llama.cpp with k = 2 (and the wide model): the two weights sum to 1 only up to float rounding,
  and llama.cpp quantizes activations to 8 bits before each Q4_1 product, so a last-bit change
  can flip a rounding and grow through 30 layers. The dense model evaluated one token at a time
  instead of in one batch differs from itself by as much: that is the yardstick.
"""
import math
import re

import numpy as np
import pandas as pd
import pytest

from infercourse.lessons import moe as L
from infercourse.lessons import moe_claims as C
from infercourse.measure import noise
from infercourse.models import moe

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Water boils at", "The three primary colors are"]


def has(word: str, text: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text) is not None


# ---- arithmetic, no model ----------------------------------------------------------------------
def test_expected_experts_runs_from_k_to_e():
    assert L.expected_experts(8, 2, 1) == pytest.approx(2)
    assert L.expected_experts(8, 2, 8) == pytest.approx(8 * (1 - 0.75 ** 8))
    assert L.expected_experts(8, 2, 1000) == pytest.approx(8)
    assert np.allclose(L.expected_experts(128, 8, np.array([1, 2])), [8, 128 * (1 - (15 / 16) ** 2)])


def test_card_arithmetic_is_labelled_and_adds_up():
    c = C.card_arithmetic(30e9, 3e9, 4.5, 800, n_expert=128, n_used=8, batches=(1, 8))
    assert c["text"].startswith("Arithmetic, not a measurement")
    assert c["total_gb"] == pytest.approx(16.875) and c["active_gb"] == pytest.approx(1.6875)
    assert c["ceiling_active_tok_per_s"] == pytest.approx(800 / 1.6875)
    one, eight = c["batches"]
    assert one["step_gb"] == pytest.approx(c["active_gb"])           # batch 1 reads the active part
    assert c["active_gb"] < eight["step_gb"] < c["total_gb"]
    assert "batches" not in C.card_arithmetic(n_expert=None)
    with pytest.raises(ValueError):
        C.card_arithmetic(3e9, 30e9)


def test_divide_blocks_divides_every_weight():
    import gguf
    from gguf import quants
    x = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32) * 0.05
    for qt in ("Q4_1", "Q8_0", "Q4_0"):
        t = gguf.GGMLQuantizationType[qt]
        q = quants.quantize(x, t)
        tiled, bad = moe._divide_blocks(np.tile(q, (1, 4)), qt, 4)
        back = quants.dequantize(tiled, t).astype(np.float64).reshape(6, 4, 64).sum(1)
        assert bad == 0
        np.testing.assert_allclose(back, quants.dequantize(q, t), rtol=0, atol=1e-7)
    with pytest.raises(Exception, match="cannot divide"):
        moe._divide_blocks(np.zeros((2, 210), np.uint8), "Q6_K", 2)


# ---- sentences, on synthetic numbers -----------------------------------------------------------
def _sizes(shared=50e6, ffn=50e6, e=8, k=2, bw=10.0):
    rows = {"dense": dict(shared_bytes=shared + ffn, expert_bytes=0, router_bytes=0, n_expert=0, n_used=0),
            "moe": dict(shared_bytes=shared, expert_bytes=e * ffn, router_bytes=0.5e6, n_expert=e, n_used=k),
            "wide": dict(shared_bytes=shared + e * ffn, expert_bytes=0, router_bytes=0, n_expert=0, n_used=0)}
    for name, r in rows.items():
        share = r["n_used"] / r["n_expert"] if r["n_expert"] else 0
        r["total_bytes"] = r["shared_bytes"] + r["expert_bytes"] + r["router_bytes"]
        r["active_bytes"] = r["shared_bytes"] + r["router_bytes"] + share * r["expert_bytes"]
        r["total_params"], r["active_params"] = r["total_bytes"] * 1.6, r["active_bytes"] * 1.6
        r["file_bytes"] = r["total_bytes"] + 1e6
        r["ceiling_total_tok_per_s"] = bw * 1e9 / r["total_bytes"]
        r["ceiling_active_tok_per_s"] = bw * 1e9 / r["active_bytes"]
    return pd.DataFrame(rows).T


def _trials(wide_factor: float, dense_factor: float = 0.7, n: int = 6):
    base = 0.1 * (1 + 0.02 * np.sin(np.arange(n)))          # a drift between blocks, shared by all arms
    wobble = np.resize([1.02, 0.98], n)                     # run-to-run noise, no direction
    vals = {"moe@1": list(base), "moe@1 (A/A)": list(base * wobble),
            "wide@1": list(base * wide_factor * wobble[::-1]), "dense@1": list(base * dense_factor * wobble)}
    rows = [{"model": a.split("@")[0], "batch": 1, "arm": a, "block": i, "step_s": v}
            for a, vs in vals.items() for i, v in enumerate(vs)]
    df = pd.DataFrame(rows)
    df.attrs.update(values=vals, ref="moe", aa="moe@1 (A/A)")
    return df


def test_speed_sentence_flips_with_the_verdict():
    sizes = _sizes()
    fast = C.speed_sentence(C.batch1_comparisons(_trials(3.0)), sizes)
    assert has("moe faster", fast) and has("reads", fast) and not has("wide faster", fast)
    slow = C.speed_sentence(C.batch1_comparisons(_trials(0.5)), sizes)
    assert has("wide faster", slow) and "does not show the active-bytes advantage" in slow
    same = C.speed_sentence(C.batch1_comparisons(_trials(1.0)), sizes)
    assert "cannot rank the MoE against the wide model" in same
    few = C.speed_sentence(C.batch1_comparisons(_trials(3.0, n=2)), sizes)
    assert "too few pairs" in few and "cannot rank" in few
    c = C.batch1_comparisons(_trials(3.0))
    assert set(c) == {"floor", "wide", "dense"} and c["dense"].verdict == "dense faster"


def test_ceiling_sentence_flips_at_the_total_ceiling():
    sizes = _sizes(bw=10.0)
    tot = sizes.loc["moe", "ceiling_total_tok_per_s"]
    above = C.ceiling_sentence(sizes, 1.5 * tot, 10.0, llc_bytes=32 * 2**20)
    below = C.ceiling_sentence(sizes, 0.5 * tot, 10.0, llc_bytes=32 * 2**20)
    assert has("above", above) and "cannot have read every byte" in above and "34 MB last-level cache" in above
    assert has("below", below) and "cannot show" in below and not has("above", below)


def test_ceiling_sentence_above_the_total_ceiling_cannot_decide_when_the_file_fits_the_cache():
    """Issue 32: this CPU reports a 480 MiB last-level cache; a 450 MB MoE fits in it, so a rate
    above the total-bytes ceiling may be cache reads, not fewer bytes."""
    sizes = _sizes(bw=10.0)                                      # 450.5 MB in all
    tot = sizes.loc["moe", "ceiling_total_tok_per_s"]
    fits = C.ceiling_sentence(sizes, 1.5 * tot, 10.0, llc_bytes=480 * 2**20)
    assert "fit in this CPU's last-level cache" in fits and "cannot tell which ceiling applies" in fits
    assert "cannot have read every byte" not in fits
    bigger = C.ceiling_sentence(sizes, 1.5 * tot, 10.0, llc_bytes=400 * 2**20)
    assert "cannot have read every byte" in bigger and "fit in this CPU's" not in bigger
    unknown = C.ceiling_sentence(sizes, 1.5 * tot, 10.0, llc_bytes=None)
    assert "names no cache size" in unknown


def test_memory_sentence_follows_the_nearer_prediction():
    sizes = _sizes()
    total = {"dense": {"after_eval_bytes": 100e6}, "moe": {"after_eval_bytes": 450e6},
             "wide": {"after_eval_bytes": 450e6}}
    active = {**total, "moe": {"after_eval_bytes": 160e6}}
    assert "followed the **total**" in C.memory_sentence(sizes, total)
    assert "followed the **active**" in C.memory_sentence(sizes, active)


def test_routing_sentence_flips():
    def table(obs):
        df = pd.DataFrame([{"batch": 1, "experts_read": 2.0, "experts_read_uniform": 2.0, "n_expert": 8, "n_used": 2},
                           {"batch": 2, "experts_read": obs, "experts_read_uniform": 3.5, "n_expert": 8, "n_used": 2}])
        df.attrs["expert_share"] = [0.125] * 8
        return df
    said = {obs: C.routing_sentence(table(obs)) for obs in (2.5, 3.45, 4.0)}
    assert has("fewer", said[2.5]) and not has("more", said[2.5])
    assert has("as uniform", said[3.45]) and not has("fewer", said[3.45])
    assert has("more", said[4.0]) and not has("fewer", said[4.0])


def test_batch_sentence_tells_bytes_from_arithmetic():
    def table(ratio):
        return pd.DataFrame({"moe_over_dense": [1.5, ratio], "bytes_model": [1.5, 3.2], "arithmetic_model": [1.6, 1.6],
                             "experts_read": [2.0, 5.3]}, index=pd.Index([1, 8], name="batch"))
    assert "closer to **bytes**" in C.batch_sentence(table(3.0), 0.1)
    assert "closer to **arithmetic**" in C.batch_sentence(table(1.7), 0.1)
    above = C.batch_sentence(table(3.5), 0.1)
    assert "closer to **bytes**" in above and "between" not in above
    assert "between the two" in C.batch_sentence(table(1.7), 0.1)
    assert "between" not in C.batch_sentence(table(1.5), 0.01)      # below both predictions
    assert "cannot say" in C.batch_sentence(table(2.2), 0.9)     # a band wide enough to hold both


def test_batch_table_predicts_bytes_from_the_experts_read():
    sizes = _sizes(shared=50e6, ffn=50e6)
    rows = [{"model": m, "batch": b, "arm": f"{m}@{b}", "block": i, "step_s": s * b ** 0.5}
            for m, s in (("dense", 0.01), ("moe", 0.015)) for b in (1, 4) for i in range(3)]
    rows += [{"model": "wide", "batch": 1, "arm": "wide@1", "block": i, "step_s": 0.04} for i in range(3)]
    t = L.batch_table(pd.DataFrame(rows), sizes)
    assert t.loc[1, "experts_read"] == pytest.approx(2)
    moe_, dense = sizes.loc["moe"], sizes.loc["dense"]
    assert t.loc[1, "bytes_model"] == pytest.approx(moe_["active_bytes"] / dense["total_bytes"])
    assert t.loc[4, "moe_bytes_per_step"] == pytest.approx(50.5e6 + L.expected_experts(8, 2, 4) * 50e6)
    assert t.loc[4, "moe_over_dense"] == pytest.approx(1.5)
    assert math.isnan(t.loc[4, "wide_step_ms"])


def test_plot_steps_draws_every_model():
    import matplotlib
    matplotlib.use("Agg")
    t = pd.DataFrame({"experts_read": [2, 5.3], "experts_read_uniform": [2, 7.2], "dense_step_ms": [20, 40],
                      "moe_step_ms": [30, 80], "wide_step_ms": [90, np.nan]}, index=pd.Index([1, 8], name="batch"))
    ax = L.plot_steps(t)
    assert {"dense step", "moe step", "wide step"} <= set(ax.get_legend_handles_labels()[1])


# ---- the files (derived once; slow) ------------------------------------------------------------
@pytest.fixture(scope="module")
def paths():
    return L.moe_models()


@pytest.fixture(scope="module")
def files(paths):
    """{model: (GGUFReader, {tensor name: tensor})}, each file parsed once."""
    import gguf
    out = {}
    for m, p in paths.items():
        r = gguf.GGUFReader(p)
        out[m] = r, {t.name: t for t in r.tensors}
    return out


@pytest.mark.slow
def test_moe_file_holds_the_dense_ffn_e_times(files):
    r, t = files["moe"]
    d = files["dense"][1]
    assert int(r.fields["llama.expert_count"].contents()) == 8
    assert int(r.fields["llama.expert_used_count"].contents()) == 2
    for layer in (0, 29):
        for w in ("gate", "up", "down"):
            stack = np.asarray(t[f"blk.{layer}.ffn_{w}_exps.weight"].data)
            assert stack.shape[0] == 8 and all(np.array_equal(s, d[f"blk.{layer}.ffn_{w}.weight"].data) for s in stack)
        router = t[f"blk.{layer}.ffn_gate_inp.weight"]
        assert router.tensor_type.name == "F32" and router.data.shape == (8, 576)
        np.testing.assert_array_equal(router.data, moe.router_weights(30, 8, 576)[layer])
    for name in d:          # everything outside the FFN is the dense file's own bytes
        if not re.search(r"ffn_(gate|up|down)\.", name):
            assert np.array_equal(t[name].data, d[name].data), name


@pytest.mark.slow
def test_sizes_relate_as_total_and_active_bytes_predict(paths, files):
    s = {m: moe.weight_split(p) for m, p in paths.items()}
    ffn = s["moe"]["expert_bytes"] / 8
    assert s["moe"]["shared_bytes"] + ffn == s["dense"]["total_bytes"]
    assert s["moe"]["active_bytes"] == s["dense"]["total_bytes"] + ffn + s["moe"]["router_bytes"]
    assert s["moe"]["total_bytes"] == s["dense"]["total_bytes"] + 7 * ffn + s["moe"]["router_bytes"]
    assert s["wide"]["total_bytes"] == s["dense"]["total_bytes"] + 7 * ffn
    # the files add only their headers (a few kB) to the tensor bytes
    for m in s:
        assert 0 < s[m]["file_bytes"] - s[m]["total_bytes"] < 4e6
    r = files["moe"][0]                      # the fast header reader agrees with gguf's
    assert s["moe"]["total_bytes"] == sum(int(t.n_bytes) for t in r.tensors)
    assert s["moe"]["total_params"] == sum(int(t.n_elements) for t in r.tensors)


@pytest.mark.slow
def test_wide_down_projection_sums_to_the_dense_one(paths, files):
    import gguf
    from gguf import quants

    from infercourse.models.derive import manifest
    w, d = files["wide"][1], files["dense"][1]
    assert manifest(paths["wide"])["args"]["inexact_scale_fields"] == 0
    for layer in (0, 17):
        gate = np.asarray(w[f"blk.{layer}.ffn_gate.weight"].data)
        assert np.array_equal(gate, np.tile(d[f"blk.{layer}.ffn_gate.weight"].data, (8, 1)))
        down = quants.dequantize(np.asarray(w[f"blk.{layer}.ffn_down.weight"].data), gguf.GGMLQuantizationType.Q4_1)
        ref = quants.dequantize(np.asarray(d[f"blk.{layer}.ffn_down.weight"].data), gguf.GGMLQuantizationType.Q4_1)
        np.testing.assert_allclose(down.astype(np.float64).reshape(576, 8, 1536).sum(1), ref, rtol=0, atol=1e-6)


def _logits(path, seqs, **kw):
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=1, logits_all=True, verbose=False, **kw)
    out = []
    for s in seqs:
        llm.reset()
        llm.eval(s)
        out.append(np.array(llm.scores[:len(s)]))
    llm.close()
    return out


@pytest.fixture(scope="module")
def dense_runs(paths):
    """Prompts plus the dense model's 12 greedy tokens, and its logits batched and token by token."""
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(paths["dense"]), n_ctx=256, n_threads=1, verbose=False)
    seqs = []
    for p in PROMPTS[:3]:
        toks = llm.tokenize(p.encode(), add_bos=True)
        gen = []
        for t in llm.generate(toks, top_k=1, temp=0, reset=True):
            gen.append(t)
            if len(gen) == 12:
                break
        seqs.append(toks + gen)
    llm.close()
    return seqs, _logits(paths["dense"], seqs), _logits(paths["dense"], seqs, n_batch=1, n_ubatch=1)


@pytest.mark.slow
def test_top1_moe_is_bit_identical_to_the_dense_model(paths, dense_runs):
    seqs, dense, _ = dense_runs
    one = _logits(paths["moe"], seqs, kv_overrides={"llama.expert_used_count": 1})
    for a, b in zip(dense, one):
        np.testing.assert_array_equal(a, b)      # same logits, so the same greedy text


@pytest.mark.slow
def test_top2_moe_and_wide_match_within_the_runtimes_own_rounding(paths, dense_runs):
    seqs, dense, dense_tokenwise = dense_runs
    own = np.mean([np.abs(a - b).mean() for a, b in zip(dense, dense_tokenwise)])
    assert own > 0          # the yardstick exists: batching alone changes the dense logits
    for name in ("moe", "wide"):
        got = _logits(paths[name], seqs)
        diff = np.mean([np.abs(a - b).mean() for a, b in zip(dense, got)])
        agree = np.mean(np.concatenate([a.argmax(1) == b.argmax(1) for a, b in zip(dense, got)]))
        assert diff < 2.5 * own, (name, diff, own)
        assert agree >= 0.9, (name, agree)


@pytest.mark.slow
def test_hf_mixtral_equals_the_dense_hf_model():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infercourse.models.formats import hf_folder
    from infercourse.models.moe_hf import moe_hf_folder
    folder = moe_hf_folder()
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok(PROMPTS[2], return_tensors="pt").input_ids
    with torch.no_grad():
        m = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        assert type(m).__name__ == "MixtralForCausalLM" and m.config.num_local_experts == 8
        out = m(ids, output_router_logits=True)
        del m
        ref = AutoModelForCausalLM.from_pretrained(str(hf_folder()), dtype=torch.float32)(ids).logits
    torch.testing.assert_close(out.logits, ref, rtol=0, atol=1e-3)
    picks = torch.stack(out.router_logits).topk(2, dim=-1).indices      # layers, tokens, k
    assert len(picks.unique()) > 2          # a random router: tokens use different experts


# ---- the measurements, tiny (slow) -------------------------------------------------------------
@pytest.mark.slow
def test_observed_routing_reads_k_experts_alone_and_more_in_a_batch(paths):
    r = L.observed_routing(paths["moe"], (1, 4), prompt_tokens=8, n_steps=2)
    assert r.loc[0, "experts_read"] == 2 and 2 <= r.loc[1, "experts_read"] <= 8
    assert sum(r.attrs["expert_share"]) == pytest.approx(1)


@pytest.mark.slow
def test_step_trials_interleave_every_arm(paths, tmp_path):
    t = L.step_trials(paths, (1, 2), prompt_tokens=8, n_steps=2, repeats=2, only={"wide": (1,)},
                      results_root=tmp_path, tables={"sizes": L.size_table(paths)})
    assert sorted(t["arm"].unique()) == ["dense@1", "dense@2", "moe@1", "moe@1 (A/A)", "moe@2", "wide@1"]
    assert (t["step_s"] > 0).all() and len(t) == 6 * 2
    run = next(tmp_path.glob("*_moe_steps"))
    assert {"manifest.json", "steps.csv", "sizes.csv"} <= {p.name for p in run.iterdir()}
    assert t.attrs["run_dir"] == str(run)
    c = C.batch1_comparisons(t)
    assert isinstance(c["floor"], noise.NoiseFloor) and c["wide"].too_few      # 2 pairs never decide
