"""Issue 32 §1: one stream's regime is read from the run (MBU, a compute roof of the kernel's own
data type, a thread check), never from arithmetic intensity alone; every branch flips.

Numbers are synthetic: 03's CI-machine reading (54.1 tok/s, 96.6 MB a token, 16.2 GB/s: 32 %
of the bandwidth roof) is the "neither" case. Labels are matched as whole bold words.
"""
from __future__ import annotations

import re

import pytest

from infercourse.measure import stream_regime as R

MB, GB = 1e6, 1e9
KW = dict(bytes_per_token=96.6 * MB, flops_per_token=2 * 134.5e6, bandwidth_gbs=16.2, compute_gflops=100.0,
          compute_source="the engine's own prefill", floor=0.05)


def says(text: str, label: str) -> bool:
    return re.search(rf"\*\*{re.escape(label)}\*\*", text) is not None


def rate_at(share: float) -> float:
    """The decode rate that reads `share` of the 16.2 GB/s roof at 96.6 MB a token."""
    return share * 16.2 * GB / (96.6 * MB)


def test_the_ci_reading_is_neither_roof_with_memory_idle_two_thirds():
    r = R.phase_regime("Decode", 54.1, **KW)
    assert r.label == R.NEITHER and says(r.text, R.NEITHER) and r.bound == "neither"
    assert not says(r.text, "bandwidth-bound") and not says(r.text, "compute-bound")
    assert re.search(r"\b32% of the 16\.2 GB/s probed\b", r.text)
    assert re.search(r"\bmemory idle about 68% of the time\b", r.text)
    assert r.memory_share == pytest.approx(54.1 * 96.6e6 / 16.2e9)


def test_bandwidth_and_compute_bound_only_near_their_roof():
    near_mem = R.phase_regime("Decode", rate_at(0.8), **KW)
    assert near_mem.label == "bandwidth-bound" and says(near_mem.text, "bandwidth-bound")
    assert near_mem.bound == "bandwidth" and not says(near_mem.text, R.NEITHER)
    # the same rate with a compute roof it nearly fills, and few bytes a token: compute-bound
    near_comp = R.phase_regime("Prefill", 300.0, **{**KW, "bytes_per_token": 0.2 * MB, "compute_gflops": 100.0})
    assert near_comp.compute_share == pytest.approx(300 * 2 * 134.5e6 / 100e9)
    assert near_comp.label == "compute-bound" and says(near_comp.text, "compute-bound")
    assert not says(near_comp.text, "bandwidth-bound")


def test_inside_the_band_of_half_a_roof_is_too_close_to_call():
    edge = R.phase_regime("Decode", rate_at(0.52), **{**KW, "floor": 0.10})
    assert edge.label == "too close to call" and says(edge.text, "too close to call")
    assert R.phase_regime("Decode", rate_at(0.52), **{**KW, "floor": 0.01}).label == "bandwidth-bound"


def test_a_rate_above_the_bandwidth_roof_is_not_judged():
    above = R.phase_regime("Decode", rate_at(1.3), **{**KW, "compute_gflops": 1000.0})
    assert above.label == "not judged" and says(above.text, "not judged") and "that roof is wrong" in above.text
    assert "memory idle" not in above.text


def test_without_a_compute_roof_of_its_data_type_the_rest_is_not_split():
    none = R.phase_regime("Decode", 54.1, **{**KW, "compute_gflops": None, "compute_source": "no int8 probe"})
    assert none.label == "not bandwidth-bound" and says(none.text, "not bandwidth-bound")
    assert not says(none.text, R.NEITHER) and "no int8 probe" in none.text and none.bound == "unknown"
    wrong = R.phase_regime("Decode", 54.1, **{**KW, "compute_gflops": 10.0})       # 145 % of a float32 roof
    assert wrong.label == "not bandwidth-bound" and "another data type" in wrong.text


def test_no_band_makes_the_label_a_reading():
    r = R.phase_regime("Decode", 54.1, **{**KW, "floor": None})
    assert r.label == R.NEITHER and not r.judged and "a reading" in r.text


def _check(ratio: float, bw_ratio: float | None, spread: float = 0.01):
    n = [50.0, 51.0, 49.5, 50.5]
    aa = [v * (1 + spread * (-1) ** i) for i, v in enumerate(n)]
    return R.thread_check(n, [v * ratio for v in n], aa, threads=(1, 2), bandwidth_ratio=bw_ratio)


def test_thread_check_verdict_and_its_comparison_with_the_bandwidth():
    fast = _check(1.9, 1.1)
    assert fast.gained and fast.beyond_bandwidth is True and fast.ratio == pytest.approx(1.9)
    assert "2 threads faster" in fast.text()
    same = _check(1.0, 1.1)
    assert not same.gained and same.beyond_bandwidth is False and "within noise" in same.text()
    assert _check(1.9, None).beyond_bandwidth is None
    assert _check(1.9, 1.9).beyond_bandwidth is False          # no more than the bandwidth it adds


def test_a_second_thread_beyond_its_bandwidth_contradicts_bandwidth_bound():
    """Near the bandwidth roof, yet 2 threads gave 1.9x for 1.1x the bandwidth: memory was not
    what held one thread. With 1.9x the bandwidth too, the label stands."""
    near = rate_at(0.7)
    contra = R.phase_regime("Decode", near, **{**KW, "threads": _check(1.9, 1.1)})
    assert contra.label == "too close to call" and "memory was not all that held one thread" in contra.text
    assert not says(contra.text, "bandwidth-bound")
    ok = R.phase_regime("Decode", near, **{**KW, "threads": _check(1.9, 1.9)})
    assert ok.label == "bandwidth-bound" and "Thread check:" in ok.text


def test_neither_says_whether_the_work_divides_among_threads():
    split = R.phase_regime("Decode", 54.1, **{**KW, "threads": _check(1.8, 1.0)})
    assert split.label == R.NEITHER and "the work divides among threads" in split.text
    serial = R.phase_regime("Decode", 54.1, **{**KW, "threads": _check(1.0, 1.0)})
    assert serial.label == R.NEITHER and "does not divide among threads" in serial.text
    assert "the work divides" not in serial.text


def test_a_thread_check_on_two_blocks_says_too_few_pairs_never_within_noise():
    few = R.thread_check([50.0, 51.0], [50.5, 50.0], [50.2, 50.8], threads=(1, 2), bandwidth_ratio=1.0)
    assert few.comparison.too_few and not few.gained
    assert "too few pairs" in few.text() and "within noise" not in few.text()
    r = R.phase_regime("Decode", 54.1, **{**KW, "threads": few})
    assert "(too few pairs)" in r.short and "does not divide among threads" not in r.text
