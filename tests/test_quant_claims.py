"""The ladder's sentences (lessons.quant_claims), fed synthetic numbers: memory against the
file size and what a second copy would take, repacked copies against speed, and F16's path
(conversion or 16-bit arithmetic) from the CPU's flags and the build's features."""
import re

import pandas as pd

from infercourse.lessons import quant_claims as qc

MB = 1e6
# tensor tables like the course's files (bytes from the real GGUFs, rounded)
TYPES = {"F16": {"F16": {"count": 211, "bytes": 268.96 * MB}, "F32": {"count": 61, "bytes": 0.14 * MB}},
         "Q8_0": {"Q8_0": {"count": 211, "bytes": 142.88 * MB}, "F32": {"count": 61, "bytes": 0.14 * MB}},
         "Q2_K": {"Q8_0": {"count": 1, "bytes": 30.08 * MB}, "Q4_0": {"count": 180, "bytes": 44.79 * MB},
                  "Q3_K": {"count": 30, "bytes": 11.40 * MB}, "F32": {"count": 61, "bytes": 0.14 * MB}}}
FILE = {"F16": 270.9 * MB, "Q8_0": 144.8 * MB, "Q2_K": 88.2 * MB}


def ladder(other, speeds, mapped=None):
    """A `measure_ladder`-shaped table: anonymous memory beside the mapped weights (fresh
    process per file), and decode rate, per file; `mapped` None: the weights fully mapped."""
    weights = {q: FILE[q] - 1.9 * MB for q in FILE}
    mapped = mapped or weights
    df = pd.DataFrame({"quant": list(FILE), "file_bytes": list(FILE.values()), "weight_bytes": list(weights.values()),
                       "mapped_bytes": [mapped[q] for q in FILE], "other_bytes": [other[q] for q in FILE],
                       "rss_delta_bytes": [mapped[q] + other[q] for q in FILE],
                       "decode_tok_per_s": [speeds[q] for q in FILE]})
    df.attrs["tensor_types"] = TYPES
    return df


# anonymous memory read on the course's machine: every load ~37 MB; Q2_K 44.9 MB more
OTHER = {"F16": 37.26 * MB, "Q8_0": 37.37 * MB, "Q2_K": 82.21 * MB}
SPEED = {"F16": 20, "Q8_0": 30, "Q2_K": 50}


def words(text, *ws):
    return all(re.search(rf"(?<!\w){re.escape(w)}(?!\w)", text) for w in ws)   # whole words only


def test_held_twice_finds_the_types_a_second_copy_would_take():
    assert qc.held_twice(44.3 * MB, TYPES["Q2_K"], 1.8 * MB) == (["Q4_0"], 44.79 * MB, 180)
    assert qc.held_twice(56.2 * MB, TYPES["Q2_K"], 1.8 * MB)[0] == ["Q4_0", "Q3_K"]
    assert qc.held_twice(20 * MB, TYPES["Q2_K"], 1.8 * MB) is None        # no set comes near


def test_memory_line_sets_growth_against_the_file_and_flips():
    """Issue 31: 06 said 'the weights plus KV and buffers that do not shrink' while F16, Q4_1
    and Q8_0 grew by exactly their file size and Q2_K's 44.3 MB excess was its Q4_0 copy."""
    text = qc.memory_line(ladder(OTHER, SPEED), repack=True)
    assert "as many bytes as each file's tensors" in text and words(text, "at least 37.3 MB", "F16")
    assert words(text, "Q2_K", "+45.0 MB", "180 Q4_0 tensors", "44.8 MB", "second copy", "REPACK")
    assert not words(text, "Q8_0 **+")
    # the other way: Q8_0 pays 20 MB more, which no tensor group takes; Q2_K pays what the others do
    other = {"F16": 37.26 * MB, "Q8_0": 57.3 * MB, "Q2_K": 37.5 * MB}
    text = qc.memory_line(ladder(other, SPEED), repack=False)
    assert words(text, "Q8_0", "+20.0 MB", "matching no group") and "Q2_K **+" not in text
    assert "REPACK" not in text and "second copy" not in text
    none = qc.memory_line(ladder({q: 37.3 * MB for q in FILE}, SPEED))
    assert "No file added more than 2%" in none
    short = qc.memory_line(ladder(OTHER, SPEED, mapped={"F16": 100 * MB, "Q8_0": 142.9 * MB, "Q2_K": 86.3 * MB}))
    assert words(short, "F16 only 100.0 of 269.0 MB", "not every page was touched")
    # without a mapping reading (not Linux): resident growth minus the weights stands in
    bare = ladder(OTHER, SPEED).assign(mapped_bytes=None, other_bytes=None)
    assert words(qc.memory_line(bare), "Q2_K", "+45.0 MB", "180 Q4_0 tensors")


def test_repack_line_names_the_copies_and_does_not_rank():
    fast = qc.repack_line(ladder(OTHER, SPEED))
    assert words(fast, "Q2_K 52%", "Q4_0", "is one of them") and "decoded faster than every file without" in fast
    assert "not a ranking" in fast
    slow = qc.repack_line(ladder(OTHER, {"F16": 60, "Q8_0": 70, "Q2_K": 50}))
    assert words(slow, "is not one of them") and "decoded slower than every file without" in slow
    mixed = qc.repack_line(ladder(OTHER, {"F16": 20, "Q8_0": 70, "Q2_K": 50}))
    assert "overlap" in mixed and not re.search(r"\bfaster than every\b", mixed)
    assert qc.repack_line(ladder({q: 37.3 * MB for q in FILE}, SPEED)) == ""


X86_AVX2 = {"AVX2": "1", "F16C": "1", "REPACK": "1"}
CPU_FP16 = {"convert": ["f16c"], "arithmetic": ["avx512_fp16"]}


def test_f16_path_reads_the_cpu_and_the_build():
    """Issue 31: 'a CPU without 16-bit float arithmetic' on a CPU with avx512_fp16: the build,
    compiled for AVX2, is what converts."""
    assert qc.f16_path(CPU_FP16, X86_AVX2) == "convert"
    assert qc.f16_path(CPU_FP16, {**X86_AVX2, "AVX512": "1"}) == "unknown"
    assert qc.f16_path({"convert": ["f16c"], "arithmetic": []}, {**X86_AVX2, "AVX512": "1"}) == "convert"
    assert qc.f16_path({"convert": ["fp"], "arithmetic": ["fphp", "asimdhp"]}, {"NEON": "1", "FP16_VA": "1"}) == "16-bit"
    assert qc.f16_path({"convert": ["fp"], "arithmetic": []}, {"NEON": "1"}) == "convert"
    line = qc.f16_line(CPU_FP16, X86_AVX2)
    assert words(line, "f16c", "avx512_fp16", "compiled without the CPU's avx512_fp16", "converts every F16 weight")
    plain = qc.f16_line({"convert": ["f16c"], "arithmetic": []}, X86_AVX2)
    assert "no 16-bit arithmetic" in plain and "runs on a CPU without 16-bit arithmetic" in plain
    arm = qc.f16_line({"convert": ["fp"], "arithmetic": ["asimdhp"]}, {"NEON": "1", "FP16_VA": "1"})
    assert "in 16 bits" in arm and "converts" not in arm


def test_f16_exercise_reason_follows_cache_and_build():
    """Issue 31: 'the weights are many times the cache' with 269 MB of weights and a 503 MB cache."""
    correct, why = qc.f16_exercise(CPU_FP16, X86_AVX2, 503 * 2**20, 269e6)
    assert correct == "b" and "would fit" in why and "many times" not in why and "converts" in why
    correct, why = qc.f16_exercise(CPU_FP16, X86_AVX2, 32 * 2**20, 269e6)
    assert correct == "b" and re.search(r"\b8\.0× this CPU's largest cache\b", why)
    correct, why = qc.f16_exercise({"convert": ["fp"], "arithmetic": ["asimdhp"]}, {"NEON": "1", "FP16_VA": "1"},
                                   None, 269e6)
    assert correct == "d" and "no cache size" in why


def test_ladder_reading_names_conversion_only_when_the_build_converts():
    df = pd.DataFrame({"quant": ["F16", "Q8_0"], "weight_bytes": [270e6, 145e6], "bits_per_weight": [16.0, 8.5],
                       "decode_tok_per_s": [20.0, 40.0], "mbu": [0.2, 0.6], "greedy_agreement": [1.0, 1.0]})
    assert "converts each of its weights" in qc.ladder_reading(df, f16="convert")
    sixteen = qc.ladder_reading(df, f16="16-bit")
    assert "without conversion" in sixteen and "converts each" not in sixteen
