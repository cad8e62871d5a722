"""Quantization formats beyond GGUF: NF4's code book by hand, the cache key, what cannot
run here, and (slow) each derived format's quality against the float32 model it came from.

Bounds on the mean per-token NLL difference from float32 (nats), on the first 120 words of
the course's eval text (~130 tokens), measured here with ~10× margin where the bits allow:
bf16 moved it by < 0.002 and int8 by < 0.01; 4-bit by 0.06–0.25 (one 4-bit level is a
sixteenth of a block's range, and the model is small), so 4-bit gets 0.5. These catch a
broken format (a reload that forgets its scales scores ~17 nats, not ~3.7), not a slightly
worse one. The two methods of a library keep the rest of the model in the same float
type (torchao bfloat16, bitsandbytes float32). No timings: machines differ 4×."""
import numpy as np
import pytest

from infercourse.core.errors import ModelLayerError
from infercourse.models import quant_formats as qf

EVAL_WORDS = 120
BOUND = {"bf16": 0.01, "torchao-int8": 0.05, "bnb-int8": 0.05,
         "torchao-int4": 0.5, "bnb-nf4": 0.5, "awq-int4": 0.5}


def test_nf4_code_book_by_hand_equals_bitsandbytes():
    bf = pytest.importorskip("bitsandbytes.functional")
    from infercourse.lessons.nf4_by_hand import nf4_code_book
    theirs = bf.get_4bit_type("nf4", device="cpu").numpy()
    assert np.abs(nf4_code_book() - theirs).max() < 1e-6
    assert nf4_code_book()[7] == 0.0 and nf4_code_book().min() == -1.0   # exact zero, spans [-1, 1]


def test_nf4_blocks_by_hand_equal_bitsandbytes_bytes():
    pytest.importorskip("bitsandbytes")
    from infercourse.lessons.nf4_by_hand import compare_with_bitsandbytes
    w = np.random.default_rng(0).normal(0, 0.02, size=(8, 576)).astype(np.float32)
    r = compare_with_bitsandbytes(w)
    assert r["same_packed_bytes"] == 1.0 and r["same_absmax"] == 1.0
    assert r["rms_error_nf4"] < r["rms_error_int4_grid"]   # quantile levels fit normal weights better


def test_a_method_that_cannot_run_here_says_why_and_names_the_layer():
    with pytest.raises(ModelLayerError, match=r"gptq-int4.*CUDA.*\(model layer\)"):
        qf.derive_method("gptq-int4")
    with pytest.raises(ModelLayerError, match="unknown method"):
        qf.derive_method("int3-magic")


def test_cache_key_follows_the_calibration_text():
    a, b = qf._target("awq-int4", "one sample text", None), qf._target("awq-int4", "another sample", None)
    assert a != b and a.parent == b.parent
    assert qf._target("awq-int4", "one sample text", None) == a          # same text, same folder
    assert qf._target("torchao-int4", "ignored", None) == qf._target("torchao-int4", None, None)
    with pytest.raises(ValueError, match="calibrated"):
        qf._target("awq-int4", None, None)


def test_eval_and_calibration_text_never_overlap():
    text = " ".join(f"w{i}" for i in range(500))
    ev, cal = qf.split_eval_text(text, 120)
    assert set(ev.split()).isdisjoint(cal.split()) and len(ev.split()) == 120
    with pytest.raises(ValueError):
        qf.split_eval_text(text, qf.CALIBRATION_START_WORD + 1)


@pytest.fixture(scope="module")
def scored():
    """{method: (ids, nll, argmax)} on the eval text, each format loaded on its own."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("torchao")
    from infercourse.lessons.quant_methods import score_hf
    from infercourse.measure.workloads import eval_text
    ev, cal = qf.split_eval_text(eval_text(), EVAL_WORDS)
    out = {}
    for name in ["fp32", *BOUND]:
        model, tok = qf.load_method(name, calibration=cal, n_threads=1)
        out[name] = score_hf(model, tok, ev)
        del model
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", list(BOUND))
def test_each_format_stays_near_float32(scored, method):
    from infercourse.lessons.quant_methods import quality_row
    row = quality_row(scored[method], scored["fp32"])
    assert abs(row["nll_diff"]) < BOUND[method], row
    assert row["top1_agreement"] > 0.5, row   # the same model, not noise (~1/50k by chance)


PAIRS = [("torchao-int8", "torchao-int4"), ("bnb-int8", "bnb-nf4")]


@pytest.mark.parametrize("eight, four", PAIRS)
def test_paired_methods_differ_only_in_their_bits(eight, four):
    """The 8- vs 4-bit comparison below is fair only if everything left unquantized (the
    embedding, norms, activations) is kept in the same float type on both sides."""
    a, b = qf.METHODS[eight], qf.METHODS[four]
    assert (a.library, a.dtype, a.calibrated) == (b.library, b.dtype, b.calibrated)


@pytest.mark.slow
@pytest.mark.parametrize("eight, four", PAIRS)
def test_eight_bits_lose_less_than_four(scored, eight, four):
    """Where the same library rounds the same layers and keeps the rest in the same float
    type (checked above), more bits must not lose more."""
    from infercourse.lessons.quant_methods import quality_row
    q8, q4 = (quality_row(scored[m], scored["fp32"]) for m in (eight, four))
    assert abs(q8["nll_diff"]) <= abs(q4["nll_diff"])
    assert q8["top1_agreement"] >= q4["top1_agreement"]


@pytest.mark.slow
def test_derived_folders_carry_their_conditions():
    from infercourse.models.derive import manifest
    pytest.importorskip("torchao")
    m = manifest(qf.derive_method("torchao-int4", n_threads=1))
    assert m["tool"] == "torchao" and m["version"] == "0.18.0" and m["args"]["group_size"] == 64
    assert m["source_sha256"] and m["output_bytes"] > 0
