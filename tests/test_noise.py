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
    assert "".join(a for _, a in noise.schedule("AB", 3, "alternate")) == "ABABAB"    # not mirrored: 3 stays 3
    rot = noise.schedule(["A", "A2", "B"], 4, "rotate")
    # each rotation, then its mirror
    assert [a for _, a in rot] == ["A", "A2", "B", "B", "A2", "A", "A2", "B", "A", "A", "B", "A2"]
    # every block holds each arm once: block i is pair i
    for i in range(4):
        assert sorted(a for b, a in rot if b == i) == ["A", "A2", "B"]


def test_schedule_rounds_odd_repeats_up_to_mirrored_pairs():
    assert [b for b, _ in noise.schedule("AB", 3, "ABBA")] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert noise.schedule("ABC", 5, "rotate")[-1][0] == 5
    assert noise.schedule("AB", 1, "ABBA") == [(0, "A"), (0, "B")]         # one run: nothing to pair


def _drifting_pairs(arms, repeats, pattern, slope=0.05):
    """Stand-in machine: no noise, every arm identical, and a speed that drifts linearly in time
    (log value = slope x trial slot). {arm: values by block}."""
    vals = {a: {} for a in arms}
    for slot, (block, arm) in enumerate(noise.schedule(arms, repeats, pattern)):
        vals[arm][block] = np.exp(slope * slot)
    return {a: [v[i] for i in sorted(v)] for a, v in vals.items()}


@pytest.mark.parametrize("pattern", ["ABBA", "rotate"])
@pytest.mark.parametrize("arms", ["AB", "ABC", "ABCD"])
def test_a_linear_drift_does_not_bias_the_paired_ratio(pattern, arms):
    """Identical arms on a machine that slows steadily: every pair's ratio is off by the drift
    between the two trials, but mirrored blocks make the offsets cancel, in the median
    paired ratio and in the mean log ratio the test uses, for any repeat count."""
    for repeats in range(2, 8):
        v = _drifting_pairs(list(arms), repeats, pattern)
        for x in arms[1:]:
            assert noise.paired_interval(v[arms[0]], v[x]).median == pytest.approx(1.0, abs=1e-12), (repeats, x)
            assert np.mean(np.log(np.divide(v[x], v[arms[0]]))) == pytest.approx(0.0, abs=1e-12)


def test_without_mirroring_the_drift_leans_every_pair_one_way():
    """The check above can fail: A always first (alternate), or 3 ABBA blocks as the schedule
    ran before odd counts were made even, lean the median by the drift."""
    v = _drifting_pairs(["A", "B"], 4, "alternate")
    assert noise.paired_interval(v["A"], v["B"]).median == pytest.approx(np.exp(0.05))
    v = _drifting_pairs(["A", "B"], 4, "ABBA")
    first3 = noise.paired_interval(v["A"][:3], v["B"][:3]).median     # +, -, +: the median takes the lean
    assert first3 == pytest.approx(np.exp(0.05))


def test_schedule_rejects_unknown_pattern():
    with pytest.raises(ValueError):
        noise.schedule("AB", 2, "shuffled")


def test_the_default_schedule_shuffles_each_block_seeded():
    """Random within each block, every arm once per block, the same order for the same seed
    (a run can be repeated), another for another seed; odd repeats stay odd (no mirror)."""
    one = noise.schedule(["A", "A2", "B"], 12)
    assert one == noise.schedule(["A", "A2", "B"], 12, "random", 0) != noise.schedule(["A", "A2", "B"], 12, seed=1)
    assert [b for b, _ in one] == [i for i in range(12) for _ in range(3)]
    for i in range(12):
        assert sorted(a for b, a in one if b == i) == ["A", "A2", "B"]
    middles = {a for b, a in one[1::3]}
    assert len(middles) == 3                  # no arm owns the middle slot
    assert noise.schedule("AB", 3)[-1][0] == 2


def test_run_interleaved_records_the_order_it_ran():
    calls = []
    arms = {a: (lambda a=a: calls.append(a) or len(calls)) for a in ("A", "A2", "B")}
    out = noise.run_interleaved(arms, 4, warmup=0)
    assert [a for _, a in out.order] == calls and out.pattern == "random" and out.seed == 0
    slots = out.slots()
    for block in range(4):
        assert sorted(slots[a][block] for a in arms) == [0, 1, 2]
        assert calls[3 * block + slots["B"][block]] == "B"


def _position_cost_false_positives(arms, pattern, cost, trials=1500, n=6, sigma=0.1, seed=0):
    """Share of verdicts other than "within noise" when every arm is the same configuration
    and only the slot a run sits in costs something (`cost` x sigma on the middle slot of 3,
    the second of 2): the schedule's order, run on a machine with a position effect."""
    rng = np.random.default_rng(seed)
    bad = 0
    for t in range(trials):
        order = noise.schedule(arms, n, pattern, seed=t)
        vals: dict[str, dict[int, float]] = {a: {} for a in arms}
        pos: dict[int, int] = {}
        for block, arm in order:
            pos[block] = pos.get(block, -1) + 1
            vals[arm][block] = float(np.exp(rng.normal(0, sigma) + (cost * sigma if pos[block] == 1 else 0.0)))
        v = {a: [d[i] for i in sorted(d)] for a, d in vals.items()}
        if len(arms) == 3:
            a, a2, b = (v[x] for x in arms)
            c = noise.compare(a, b, noise.noise_floor(a, a2))
        else:
            c = noise.compare(v[arms[0]], v[arms[1]], 0.0)
        bad += c.decided
    return bad / trials


@pytest.mark.parametrize("arms", [["A", "B", "A2"], ["A", "A2", "B"], ["A", "B"]])
def test_a_position_cost_keeps_the_level_under_the_default_schedule(arms):
    """Issue 31 §1: with ABBA, B in the middle of every block and a middle-slot cost of 1σ, the
    relabelling test called a difference 10% of the time with no real one (16% at 2σ). The default
    (shuffled) schedule keeps the 5% level (2.5% per side against a number) whatever a
    slot costs, because the relabelling then matches how runs were assigned."""
    trials, level = 1500, 0.05          # the relabelling test; two sides of 2.5% for the sign flips
    allowance = 2.33 * math.sqrt(level * (1 - level) / trials)
    for cost in (0.0, 1.0, 2.0):
        assert _position_cost_false_positives(arms, "random", cost, trials) <= level + allowance, (arms, cost)


def test_a_fixed_order_lets_a_position_cost_read_as_an_effect():
    """The check above can fail: the same cost under ABBA, B always in the middle."""
    assert _position_cost_false_positives(["A", "B", "A2"], "ABBA", 2.0, 1500) > 0.05 + 2.33 * math.sqrt(0.05 * 0.95 / 1500)


def test_run_interleaved_pairs_by_block_and_warms_up():
    calls = []
    arms = {"A": lambda: calls.append("A") or len(calls), "B": lambda: calls.append("B") or len(calls)}
    out = noise.run_interleaved(arms, 3, pattern="ABBA", warmup=1)
    # warm-up A, B; then AB BA AB BA: 3 repeats made 4 so that every block has its mirror
    assert calls == ["A", "B", "A", "B", "B", "A", "A", "B", "B", "A"]
    assert out == {"A": [3.0, 6.0, 7.0, 10.0], "B": [4.0, 5.0, 8.0, 9.0]}
    assert out.order == noise.schedule("AB", 3, "ABBA")


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
    """The 1-minute load average lags: two seconds after two busy loops started, 11's gate
    read 'load 0.3, quiet'. Threads runnable at this instant do not lag."""
    c = noise.judge(0.3, 2, 0.9, runnable=2)
    assert c.busy and "2 other threads runnable right now on 2 cores" in c.message
    assert not noise.judge(0.3, 2, 0.9, runnable=1).busy      # a free core left
    n = noise.runnable_others()
    assert n is None or n >= 0


# ---- the test behind the verdict: its false-positive rate and its power ------------------------
def _triples(rng, n, effect, sigma=0.1):
    """Seeded synthetic blocks: a drift shared by the block, log-normal noise per trial; A and
    its A/A rerun at 1, B (a time) at `effect`."""
    level = rng.uniform(-0.3, 0.3, n)
    a, a2, b = (np.exp(level + rng.normal(0, sigma, n)) for _ in range(3))
    return a, a2, b * effect


def _verdict(a, a2, b):
    return noise.compare(a, b, noise.noise_floor(a, a2)).verdict     # as the lessons call it


@pytest.mark.parametrize("n", [3, 4, 5, 6])
def test_relabelling_test_has_its_stated_level_exactly(n):
    """Under "B is only A again" each of the 3^n ways to say which run of each block is B is
    equally likely; whatever the data, at most 5% of them may read as a difference."""
    rng = np.random.default_rng(n)
    x = np.exp(rng.normal(0, 0.1, (n, 3)))
    rows = np.arange(n)
    hits = 0
    for labels in np.array(np.meshgrid(*[range(3)] * n)).reshape(n, -1).T:     # which run is B, per block
        b = x[rows, labels]
        a, a2 = x[rows, (labels + 1) % 3], x[rows, (labels + 2) % 3]
        hits += "faster" in _verdict(a, a2, b)
    assert hits / 3 ** n <= 0.05
    assert n < 3 or hits > 0          # from 3 pairs on the most extreme labelling is called


def test_false_positives_at_most_5_percent_and_power_rises_with_pairs():
    """Seeded, at 3, 6, 10 and 20 pairs, sigma = 0.1: with no effect, verdicts other than
    "within noise" stay within 5% (plus 2.33 binomial standard errors of the 2,000-trial
    estimate); with B x1.35 slower, "A faster" never gets rarer as pairs are added (minus
    the same sampling allowance), and reaches 80% at 20 pairs. The rule this replaced found
    53% at 3 pairs and 19% at 6 (benchmarks/noise_power.py)."""
    rng = np.random.default_rng(25)
    trials, power = 2000, {}
    allowance = 2.33 * math.sqrt(0.05 * 0.95 / trials)
    for n in (3, 6, 10, 20):
        false = np.mean(["faster" in _verdict(*_triples(rng, n, 1.0)) for _ in range(trials)])
        assert false <= 0.05 + allowance, (n, false)
        power[n] = np.mean([_verdict(*_triples(rng, n, 1.35)) == "A faster" for _ in range(500)])
    assert all(power[m] >= power[n] - 2 * math.sqrt(0.25 / 500) for n, m in [(3, 6), (6, 10), (10, 20)]), power
    assert power[20] >= 0.8 and power[6] >= 0.8, power


def test_the_aa_rerun_joins_the_test_only_when_it_was_measured_on_these_trials():
    a, a2 = np.array([1.0, 1.1, 0.9]), np.array([1.02, 1.08, 0.93])
    c = noise.compare(a, a * 1.5, noise.noise_floor(a, a2))
    # 3 blocks: B the slowest in each, by far: 1 of 27 relabellings, p = 0.037
    assert c.verdict == "A faster" and c.p == pytest.approx(1 / 27) and "relabelled" in c.text
    other = noise.compare(a * 1.01, a * 1.5, noise.noise_floor(a, a2))     # an A/A of other trials
    assert other.verdict == "too few pairs" and not other.within_noise and not other.decided
    assert "sign flips" in other.test and "3 pairs cannot pass a test that needs 6" in other.text
    assert other.fewest == 6                                               # 1/64 <= 2.5% per side


def test_too_few_pairs_is_never_called_within_noise():
    """Issue 31 §2: 10 printed "within noise" for 4 pairs of a test that needs 6. Below a
    test's fewest pairs, the verdict itself says so, whatever the ratio."""
    for n, floor in ((2, 0.0), (5, 0.05), (5, 0.0)):
        for r in (0.5, 1.0, 3.0):
            c = noise.compare(np.ones(n), np.full(n, r), floor)
            assert c.verdict == noise.TOO_FEW and c.too_few and f"{n} pairs cannot pass" in c.said
    a = np.linspace(1, 1.2, 2)
    c = noise.compare(a, a * 3, noise.noise_floor(a, a * 1.01))
    assert c.verdict == noise.TOO_FEW and c.fewest == 3
    assert noise.compare(np.ones(6), np.ones(6) * 1.001, 0.05).verdict == "within noise"


def test_band_test_keeps_its_level_at_the_band_edge():
    """With a number for the floor, B must clear the band: a true change exactly at the edge
    (x1.10 against a 10% floor) is called at most 2.5% of the time (plus sampling allowance)."""
    rng = np.random.default_rng(7)
    calls = [noise.compare(a, a * 1.1 * np.exp(rng.normal(0, 0.1, 10)), 0.10).verdict != "within noise"
             for a in rng.uniform(1, 2, (2000, 10))]
    assert np.mean(calls) <= 0.025 + 2.33 * math.sqrt(0.025 * 0.975 / 2000)
    assert noise.compare(np.ones(10), np.full(10, 1.3), 0.10).verdict == "A faster"     # well beyond: found


def test_even_median_is_the_same_either_way_round():
    a, b = [1.0, 1.0, 1.0, 1.0], [0.8, 0.9, 1.2, 1.5]
    assert noise.paired_interval(a, b).median == pytest.approx(1 / noise.paired_interval(b, a).median)


def test_an_infinite_band_is_never_cleared_and_a_failed_aa_trial_drops_its_block():
    assert noise.compare(np.ones(8), np.full(8, 3.0), math.inf).within_noise
    floor = noise.noise_floor(np.ones(6), [0.0, 1, 1, 1, 1, 1])        # a2 = 0: floor inf, block 0 unusable
    c = noise.compare(np.ones(6), np.full(6, 3.0), floor)
    assert c.verdict == "A faster" and c.p == pytest.approx(1 / 3 ** 5)
