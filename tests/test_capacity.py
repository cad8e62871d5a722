"""Notebook 16's measured capacity: the largest session count whose later turns met the
TTFT SLO, on tables built from hand-made per-turn frames (no server): a count where every
turn failed is over capacity, however the fraction of an empty set reads."""
import math

import pandas as pd

from infercourse.lessons.capacity import measured_capacity
from infercourse.measure.sessions import sessions_summary


def _run(n_sessions, n_turns=4, ttft_s=0.5, refused=False):
    """A stand-in run of `n_sessions` sessions: every turn answered in `ttft_s`, or (refused)
    every session's first turn failed, so it sent no later one (a session stops at its first
    failure)."""
    rows, t = [], 0.0
    for k in range(n_sessions):
        for turn in range(1 if refused else n_turns):
            rows.append({"session": k, "turn": turn, "n_sessions": n_sessions,
                         "status": "error" if refused else "ok", "ttft_s": math.nan if refused else ttft_s,
                         "prompt_tokens": 600 + 150 * turn, "cached_tokens": 0 if turn == 0 else 590 + 150 * turn,
                         "output_tokens": 0 if refused else 16, "scheduled_t": t, "end_t": t + 1.0})
            t += 1.0
    return pd.DataFrame(rows)


def _table(runs, slo_ttft_s=2.0):
    return pd.DataFrame([sessions_summary(df, {"ttft_s": slo_ttft_s}) for df in runs]).set_index("n_sessions")


def test_a_count_where_every_turn_failed_is_over_capacity():
    """16's shape: 1-4 sessions; at 3 and 4 the server refused every session's first turn.
    Capacity is 2. (Before the fix the later-turn fraction of 3 and 4 was NaN, `NaN < 0.9`
    is False, and the table read capacity 4.)"""
    table = _table([_run(1), _run(2), _run(3, refused=True), _run(4, refused=True)])
    assert table["good_fraction_later"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert measured_capacity(table) == 2


def test_a_nan_fraction_fails_the_level():
    table = pd.DataFrame({"good_fraction_later": [1.0, 0.95, math.nan, 1.0]}, index=[1, 2, 3, 4])
    assert measured_capacity(table) == 2
    assert measured_capacity(table.iloc[:0]) == 0


def test_capacity_stops_at_the_first_count_under_the_slo():
    slow = _run(3, ttft_s=3.0)   # answered, but past a 2 s SLO
    table = _table([_run(1), _run(2), slow, _run(4)])
    assert table.loc[3, "good_fraction_later"] == 0.0 and table.loc[4, "good_fraction_later"] == 1.0
    assert measured_capacity(table) == 2
    assert measured_capacity(table, column="good_fraction") == 2
