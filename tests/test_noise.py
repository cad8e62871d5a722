"""The noise module on synthetic data: no timing is asserted, only readings we inject."""
import math

import numpy as np
import pytest

from infercourse.measure import noise


# ---- the contention gate -------------------------------------------------------------------
def test_gate_quiet_machine():
    c = noise.judge(0.5, 4, 0.97)
    assert not c.busy and "quiet" in c.message and str(c) == c.message


def test_gate_busy_on_load_per_core():
    c = noise.judge(4.7, 2, 0.95)
    assert c.busy and "BUSY" in c.message and "2.4 per core" in c.message


def test_gate_busy_on_cpu_share_alone():
    c = noise.judge(0.1, 8, 0.45)
    assert c.busy and "45% of a core" in c.message and "load" not in c.message.split(".")[0].lower()


def test_gate_missing_readings_are_not_busy():
    c = noise.judge(None, 2, None)
    assert not c.busy and "n/a" in c.message


def test_gate_thresholds_are_parameters():
    assert noise.judge(1.5, 2, 1.0, max_load_per_core=0.5).busy
    assert not noise.judge(1.5, 2, 0.6, min_cpu_share=0.5).busy


def test_contention_reads_the_machine():
    c = noise.contention(probe_s=0.02)
    # whatever the load: a share is a fraction and the cores are counted
    assert c.cores >= 1 and (c.cpu_share is None or 0 <= c.cpu_share <= 1)


# ---- scheduling ---------------------------------------------------------------------------
def test_schedule_abba_reverses_every_other_block():
    order = [a for _, a in noise.schedule(["A", "B"], 4, "ABBA")]
    assert "".join(order) == "ABBAABBA"


def test_schedule_alternate_and_rotate():
    assert "".join(a for _, a in noise.schedule("AB", 3, "alternate")) == "ABABAB"
    rot = noise.schedule(["A", "A2", "B"], 3, "rotate")
    assert [a for _, a in rot] == ["A", "A2", "B", "A2", "B", "A", "B", "A", "A2"]
    # every block holds each arm once: block i is pair i
    for i in range(3):
        assert sorted(a for b, a in rot if b == i) == ["A", "A2", "B"]


def test_schedule_rejects_unknown_pattern():
    with pytest.raises(ValueError):
        noise.schedule("AB", 2, "random")


def test_run_interleaved_pairs_by_block_and_warms_up():
    calls = []
    arms = {"A": lambda: calls.append("A") or len(calls), "B": lambda: calls.append("B") or len(calls)}
    out = noise.run_interleaved(arms, 3, pattern="ABBA", warmup=1)
    assert calls == ["A", "B", "A", "B", "B", "A", "A", "B"]      # warm-up A, B; then ABBAAB
    assert out == {"A": [3.0, 6.0, 7.0], "B": [4.0, 5.0, 8.0]}


# ---- paired intervals ----------------------------------------------------------------------
def test_paired_interval_coverage_is_at_least_nominal():
    """Seeded: the interval for the median ratio covers the true median >= ~95% of the time,
    on a skewed, heavy-tailed distribution (the order-statistic rule does not care)."""
    rng = np.random.default_rng(0)
    true_median, hits, trials = 0.8, 0, 2000
    for _ in range(trials):
        a = rng.lognormal(0, 0.3, 12)
        # log ratio symmetric around log(0.8): the ratio's median is 0.8
        b = a * true_median * np.exp(rng.standard_t(3, 12) * 0.1)
        iv = noise.paired_interval(a, b)
        hits += iv.lo <= true_median <= iv.hi
    assert iv.exact and hits / trials >= 0.94


def test_paired_interval_too_few_pairs_gives_the_range_and_says_so():
    iv = noise.paired_interval([1, 1, 1], [0.9, 1.2, 1.0])
    assert not iv.exact and (iv.lo, iv.hi) == (0.9, 1.2) and "range" in iv.text()


def test_paired_interval_drops_failed_trials_and_checks_lengths():
    iv = noise.paired_interval([1, 2, math.nan, 4, 1, 1, 1], [1, 2, 3, 4, 1, 1, 1])
    assert iv.n == 6
    with pytest.raises(ValueError):
        noise.paired_interval([1, 2], [1])


# ---- the A/A floor and the verdict ---------------------------------------------------------
def _aa(rng, n=10, jitter=0.05):
    base = rng.uniform(1.0, 2.0, n)            # the machine drifts between blocks...
    return base * np.exp(rng.normal(0, jitter, n)), base * np.exp(rng.normal(0, jitter, n))


def test_noise_floor_definition():
    f = noise.noise_floor([1, 1, 1, 1, 1, 1], [0.97, 1.0, 1.02, 1.05, 0.99, 1.01])
    # n = 6: the 95% interval of the median is the whole range [0.97, 1.05]
    assert f.floor == pytest.approx(0.05) and "±5.0%" in f.text()


def test_verdict_on_known_shifts():
    rng = np.random.default_rng(1)
    a1, a2 = _aa(rng)
    floor = noise.noise_floor(a1, a2)
    assert 0 < floor.floor < 0.2
    a, _ = _aa(rng)
    # B takes half the time: B faster; B takes 1.6x: A faster; B the same: within noise
    assert noise.compare(a, a * 0.5, floor).verdict == "B faster"
    assert noise.compare(a, a * 1.6, floor).verdict == "A faster"
    same = noise.compare(a, a * np.exp(rng.normal(0, 0.03, len(a))), floor)
    assert same.within_noise and "within noise" in same.text


def test_verdict_direction_for_speeds_and_labels():
    a = np.array([10.0, 11, 9, 10, 12, 10, 11, 9])
    c = noise.compare(a, a * 2, 0.05, higher_is_better=True, labels=("1 thread", "2 threads"))
    assert c.verdict == "2 threads faster" and "2 threads/1 thread" in c.text


def test_a_shift_inside_the_floor_is_noise():
    """An interval that excludes 1 is not enough: it must clear the A/A floor too."""
    a = np.ones(8)
    b = np.array([0.90, 0.91, 0.92, 0.92, 0.93, 0.93, 0.94, 0.95])
    assert noise.compare(a, b, 0.0).verdict == "B faster"
    assert noise.compare(a, b, 0.10).within_noise


def test_compare_rejects_negative_floor():
    with pytest.raises(ValueError):
        noise.compare([1, 2], [1, 2], -0.1)


def test_verdict_is_the_same_for_times_and_speeds():
    """A time ratio r is a speed ratio 1/r: both must get the same verdict against the same
    A/A floor (with a linear band 1 ± floor a 0.58x speed-up against a ±54% floor was
    'within noise' as a speed and 'slower' as a time)."""
    rng = np.random.default_rng(3)
    floor = noise.noise_floor(np.ones(8), np.exp(rng.normal(0, 0.2, 8)))
    for factor in (0.58, 0.7, 0.9, 1.3, 1.8):
        t = rng.uniform(1.0, 2.0, 12)
        t_b = t * factor * np.exp(rng.normal(0, 0.02, 12))
        as_time = noise.compare(t, t_b, floor, labels=("A", "B"))
        as_speed = noise.compare(1 / t, 1 / t_b, floor, higher_is_better=True, labels=("A", "B"))
        assert as_time.verdict == as_speed.verdict, factor
    f = noise.noise_floor([1.0] * 6, [0.5, 1, 1, 1, 1, 1.2])     # 2x slower one way beats 1.2x the other
    assert f.floor == pytest.approx(1.0) and "[0.50, 2.00]" in f.text()


def test_threads_runnable_now_make_a_busy_machine_before_the_load_average_rises():
    """The 1-minute load average lags: two seconds after two busy loops started, 10's gate
    read 'load 0.3, quiet'. Threads runnable at this instant do not lag."""
    c = noise.judge(0.3, 2, 0.9, runnable=2)
    assert c.busy and "2 other threads runnable right now on 2 cores" in c.message
    assert not noise.judge(0.3, 2, 0.9, runnable=1).busy      # a free core left
    n = noise.runnable_others()
    assert n is None or n >= 0
