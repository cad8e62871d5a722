"""07's sentences and speed-ups come from the run's numbers: synthetic tables, both ways.

Every table here is made up (no model is loaded), so each test shows that a wording or a
ratio follows its inputs: flip the numbers and the sentence flips."""
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from infercourse.core.errors import ModelLayerError
from infercourse.lessons import quant_explain as qe
from infercourse.lessons.nf4_by_hand import nf4_text
from infercourse.lessons.quant_grid import fresh_round, grid_text
from infercourse.lessons.quant_methods import add_speedups


def _row(fmt, ref="fp32", verdict="within noise", speedup=1.0, lo=0.9, hi=1.1, bytes_speedup=2.0,
         weight=100e6, rss=110e6, nll=0.0, se=0.01, top1=0.99):
    return {"format": fmt, "speedup_vs": ref, "decode_verdict": verdict, "decode_speedup": speedup,
            "decode_speedup_lo": lo, "decode_speedup_hi": hi, "bytes_speedup": bytes_speedup,
            "weight_bytes": weight, "rss_bytes": rss, "nll_diff": nll, "nll_diff_2se": se,
            "top1_agreement": top1, "repeats": 4, "decode_floor": 0.05}


def _table(**bf16):
    ref = _row("fp32", verdict="reference", lo=math.nan, hi=math.nan, bytes_speedup=1.0, weight=500e6, rss=520e6)
    return pd.DataFrame([ref, _row("bf16", **bf16)])


@pytest.mark.parametrize("verdict, said", [("bf16 faster", "faster than fp32: bf16"),
                                           ("fp32 faster", "slower than fp32: bf16"),
                                           ("within noise", "within noise: bf16")])
def test_speed_text_follows_the_verdict(verdict, said):
    assert said in qe.speed_text(_table(verdict=verdict))


def test_speed_text_groups_each_runtime_against_its_own_reference():
    df = pd.concat([_table(verdict="fp32 faster"),
                    pd.DataFrame([_row("gguf F16", "gguf F16", "reference"),
                                  _row("gguf Q8_0", "gguf F16", "gguf Q8_0 faster", 1.6, 1.5, 1.7)])])
    text = qe.speed_text(df)
    assert "against fp32" in text and "against gguf F16" in text
    assert "faster than gguf F16: gguf Q8_0 1.60×" in text and "slower than fp32: bf16" in text


def test_speed_text_names_who_fell_short_of_the_bytes():
    assert "over the whole range: bf16" in qe.speed_text(_table(hi=1.5, bytes_speedup=2.0))
    assert "None fell below" in qe.speed_text(_table(hi=2.5, bytes_speedup=2.0))


@pytest.mark.parametrize("verdict, has, words", [
    ("fp32 faster", False, ["slower than fp32", "lists no bfloat16"]),
    ("bf16 faster", True, ["faster than fp32", "lists bfloat16 instructions"]),
    ("within noise", None, ["within noise of fp32", "could not be read"])])
def test_bf16_sentence_is_computed(verdict, has, words):
    text = qe.bf16_text(_table(verdict=verdict), has)
    assert all(w in text for w in words), text
    assert qe.bf16_text(_table().query("format != 'bf16'"), has) == ""


def test_cpu_bf16_flags_are_read_not_assumed(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor : 0\nflags : fpu sse avx2 avx512f\n")
    assert qe.cpu_has_bf16(f) is False
    f.write_text("processor : 0\nflags : fpu avx512f avx512_bf16\n")
    assert qe.cpu_has_bf16(f) is True
    assert qe.cpu_has_bf16(tmp_path / "absent") is None


def test_memory_text_names_the_heaviest_load_and_flips():
    df = pd.concat([_table(weight=100e6, rss=300e6)])
    assert qe.memory_text(df).startswith("- **Memory** (each format loaded in a fresh process). bf16 grew")
    assert "more than the packed weights" in qe.memory_text(df)
    lean = _table(weight=100e6, rss=101e6)
    lean.loc[lean.format == "fp32", "rss_bytes"] = 505e6
    assert "within 10%" in qe.memory_text(lean) and "fp32 grew" in qe.memory_text(lean)
    assert "not compared" in qe.memory_text(_table(rss=math.nan).assign(rss_bytes=math.nan))


def test_quality_text_classes_follow_the_standard_error():
    assert "within ± 2 s.e. of fp32: bf16" in qe.quality_text(_table(nll=0.005, se=0.01))
    assert "measurably worse: bf16" in qe.quality_text(_table(nll=0.05, se=0.01))
    assert "measurably better: bf16" in qe.quality_text(_table(nll=-0.05, se=0.01))
    assert "Q4_1 model dequantized" in qe.quality_text(_table())


@pytest.mark.parametrize("awq, how", [(0.05, "less than"), (0.30, "more than"), (0.19, "within noise of")])
def test_awq_against_round_to_nearest_is_judged_from_the_numbers(awq, how):
    df = pd.DataFrame([_row("fp32", verdict="reference"), _row("torchao-int4", nll=0.2, se=0.02),
                       _row("awq-int4", nll=awq, se=0.02)])
    assert f"Calibrated AWQ lost {how} round-to-nearest" in qe.quality_text(df)


def test_speedups_divide_each_runtime_by_its_own_reference():
    """The GGUF rows' bytes prediction is against GGUF F16, never against transformers' fp32."""
    df = pd.DataFrame([{"format": "fp32", "speedup_vs": "fp32", "weight_bytes": 400.0},
                       {"format": "bf16", "speedup_vs": "fp32", "weight_bytes": 200.0},
                       {"format": "gguf F16", "speedup_vs": "gguf F16", "weight_bytes": 300.0},
                       {"format": "gguf Q8_0", "speedup_vs": "gguf F16", "weight_bytes": 150.0}])
    s = add_speedups(df).set_index("format").bytes_speedup
    assert s["bf16"] == 2.0 and s["gguf Q8_0"] == 2.0 and s["gguf F16"] == 1.0


def test_request_trials_pairs_arms_and_judges_against_an_aa_rerun(monkeypatch):
    """Stand-in engines (labels with a fixed decode rate, no timing): the verdict, the ratio
    and the A/A arm come from the recorded values, and block k sends the same prompt to all."""
    from infercourse.core import metrics, trace
    from infercourse.measure import quant_speed
    sent = []

    def fake_record(engine, req, **kw):
        sent.append((kw["format"], req.messages[0]["content"]))
        return SimpleNamespace(rate=engine * (1 + 0.001 * len(sent)))   # a small drift, same for all
    monkeypatch.setattr(trace, "record", fake_record)
    for name, fn in {"decode_tok_per_s": lambda t: t.rate, "ttft_s": lambda t: 1 / t.rate,
                     "output_tokens": lambda t: 8, "e2e_s": lambda t: 8 / t.rate}.items():
        monkeypatch.setattr(metrics, name, fn)
    rows = quant_speed.request_trials({"ref": lambda: 100.0, "fast": lambda: 200.0, "same": lambda: 100.0},
                                      "ref", ["p0", "p1"], 8, repeats=4)
    assert rows["fast"]["decode_verdict"] == "fast faster"
    assert rows["fast"]["decode_speedup"] == pytest.approx(2.0, rel=0.02)
    assert rows["same"]["decode_verdict"] == "within noise"
    assert rows["ref"]["decode_verdict"] == "reference" and rows["ref"]["repeats"] == 4
    assert {f for f, _ in sent} == {"ref", "ref (A/A)", "fast", "same"}
    for label in ("ref", "fast", "same"):   # the k-th request of every arm sends the same prompt
        assert [p for f, p in sent if f == label] == [p for f, p in sent if f == "ref (A/A)"]


def test_a_fresh_rounding_must_straddle_the_original_blocks():
    """Min-max 4-bit rounding on Q4_1's own blocks rebuilds its grid; shifted, it re-rounds."""
    rng = np.random.default_rng(0)
    lo, step = rng.normal(0, 0.05, (4, 1)), rng.uniform(0.005, 0.01, (4, 1))
    w = (lo + step * rng.integers(0, 16, (4, 32))).reshape(1, -1)   # 4 Q4_1-like blocks of 32
    w[0, ::32], w[0, 1::32] = lo.ravel(), (lo + 15 * step).ravel()  # each block spans all 16 levels
    assert np.abs(fresh_round(w, 32, 4) - w).max() < 1e-12
    assert np.sqrt(np.mean((fresh_round(w, 32, 4, shift=16) - w) ** 2)) > 1e-3


@pytest.mark.parametrize("dist, words", [(0.001, "land close to the grid"), (0.007, "partly aligned"),
                                         (0.011, "does not hold")])
def test_grid_text_follows_the_measured_distance(dist, words):
    df = pd.DataFrame([{"tensor": "a", "type": "Q4_K", "bits": 4, "n": 1000, "rms_to_q4_1": dist, "rms_fresh": 0.01},
                       {"tensor": "b", "type": "Q6_K", "bits": 6, "n": 3000, "rms_to_q4_1": 0.001, "rms_fresh": 0.004}])
    text = grid_text(df)
    assert words in text and "75% at more than 4 bits" in text and "not 4-bit" in text


def test_nf4_sentence_follows_its_numbers():
    good = {"max_code_diff": 1e-8, "same_packed_bytes": 1.0, "rms_error_nf4": 0.1, "rms_error_int4_grid": 0.2}
    assert "matches" in nf4_text(good) and "every packed byte" in nf4_text(good) and "is smaller" in nf4_text(good)
    bad = {"max_code_diff": 0.1, "same_packed_bytes": 0.5, "rms_error_nf4": 0.3, "rms_error_int4_grid": 0.2}
    assert "differs" in nf4_text(bad) and "50.0%" in nf4_text(bad) and "not smaller" in nf4_text(bad)


def test_load_state_refuses_missing_and_unexpected_keys():
    torch = pytest.importorskip("torch")
    from infercourse.models.quant_tensors import load_state

    def stand_in(tied):   # a two-layer stand-in for a causal LM with a tied output layer
        m = torch.nn.Module()
        m.embed, m.lm_head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False)
        m.config = SimpleNamespace(tie_word_embeddings=tied)
        return m
    state = {"embed.weight": torch.ones(4, 4), "embed.bias": torch.zeros(4)}
    load_state(stand_in(True), {**state, "lm_head.weight": torch.ones(4, 4)})
    load_state(stand_in(True), dict(state))                  # the tied layer may be absent
    with pytest.raises(ModelLayerError, match=r"missing \['lm_head.weight'\].*\(model layer\)"):
        load_state(stand_in(False), dict(state))              # untied: it must be there
    with pytest.raises(ModelLayerError, match=r"missing \['embed.bias'\]"):
        load_state(stand_in(True), {"embed.weight": torch.ones(4, 4)})
    with pytest.raises(ModelLayerError, match=r"unexpected \['extra'\]"):
        load_state(stand_in(True), {**state, "extra": torch.ones(1)})


def test_kernel_speedup_divides_by_the_first_row_of_its_runtime():
    """A real-kernels table's first row is the 16-bit reference on that runtime; flip the rates
    and the speed-up flips with them."""
    from infercourse.lessons.quant_methods import kernel_speedup
    k = pd.DataFrame({"format": ["mlx f16", "mlx q8", "mlx q4"], "decode_tok_per_s": [100.0, 150.0, 250.0]})
    assert kernel_speedup(k, "mlx q4") == pytest.approx(2.5) and kernel_speedup(k, "mlx f16") == 1.0
    k["decode_tok_per_s"] = [250.0, 150.0, 100.0]
    assert kernel_speedup(k, "mlx q4") == pytest.approx(0.4)
    with pytest.raises(ValueError, match="vllm fp8"):
        kernel_speedup(k, "vllm fp8")


def test_gguf_rung_speedup_serves_the_rung_beside_f16_and_returns_its_row(monkeypatch):
    """The exercise's rung is measured like the table's GGUF rows: against GGUF F16 on the same
    llama-server build (one slot each here); the rung's row comes back, not the reference's."""
    from infercourse.lessons import quant_methods as qm
    from infercourse.measure import quant_speed
    seen = {}

    def fake_serve(paths, ref, prompts, max_tokens, **kw):
        seen.update(paths=dict(paths), ref=ref, **kw)
        return {k: {"decode_speedup": 1.0 if k == ref else 1.7, "decode_verdict": "v"} for k in paths}
    monkeypatch.setattr(quant_speed, "serve_gguf", fake_serve)
    row = qm.gguf_rung_speedup("Q3_K_M", "Q3_K_M.gguf", "f16.gguf", ["p"], 8, n_threads=1, repeats=2)
    assert row["decode_speedup"] == 1.7
    assert seen["paths"] == {"gguf F16": "f16.gguf", "gguf Q3_K_M": "Q3_K_M.gguf"} and seen["ref"] == qm.GGUF_REF
    assert seen["concurrency"] == 1 and seen["repeats"] == 2


@pytest.mark.slow
def test_gguf_rung_bits_reads_what_llama_cpp_wrote():
    """Q8_0 stores 34 bytes per 32 weights (8.5 bits) in every weight matrix: the measured bits
    per weight of the derived file say so, whatever its name says."""
    from infercourse.lessons.quant_methods import gguf_rung_bits
    from infercourse.lessons.quantization import ladder_paths
    assert 8.4 < gguf_rung_bits(ladder_paths(["Q8_0"], include_original=False)["Q8_0"]) < 8.7
