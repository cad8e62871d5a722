"""Notebook 18's sentences: the retry tail and the costliest rows, written from the numbers
(synthetic rows; the sentences must flip when the numbers do)."""
import pandas as pd

from infercourse.lessons import symptoms as lesson


def _tail(no_retry, with_retry):
    rows = [{"mode": "no retry", "ok": ok, "attempts": 1, "seconds": s} for ok, s in no_retry]
    rows += [{"mode": "4 retries", "ok": ok, "attempts": 2, "seconds": s} for ok, s in with_retry]
    df = pd.DataFrame(rows)
    df.attrs["outage_s"] = 2.0
    return df


def test_retry_sentence_follows_failures_and_the_slowest_request():
    moved = lesson.retry_sentence(_tail([(False, 0.01), (False, 0.01), (True, 0.2)], [(True, 2.4), (True, 0.2), (True, 0.2)]))
    assert "2 of 3 requests failed" in moved and "turned 2 failure(s) into successes" in moved
    assert "grew by 2.20 s" in moved and "moved into the tail" in moved
    assert "without a slower request" in lesson.retry_sentence(_tail([(False, 0.5)], [(True, 0.3)]))
    assert "nothing for the retries to do" in lesson.retry_sentence(_tail([(True, 0.2)], [(True, 0.2)]))
    assert "did not change" in lesson.retry_sentence(_tail([(False, 0.1)], [(False, 3.0)]))
    assert "more requests failed with retries" in lesson.retry_sentence(_tail([(True, 0.1)], [(False, 3.0)]))


def test_costliest_names_the_longest_rows_and_which_wait():
    rows = [lesson.SymptomRow("agent stuck", ("context",), "frozen", seconds=12.0),
            lesson.SymptomRow("API failed", ("API",), "5xx", seconds=1.0),
            lesson.SymptomRow("API timeout", ("engine",), "overloaded", seconds=3.0),
            lesson.SymptomRow("tokens slow", ("hardware",), "cpu_contention", seconds=20.0),
            lesson.SymptomRow("streaming fails", ("API",), "cut", seconds=99.0, skipped="no proxy here")]
    text = lesson.costliest(rows, k=2)
    assert text.startswith("The costliest rows in this run: tokens slow (20.0 s); agent stuck (12.0 s, found only")
    assert "1 of these 2 wait on time" in text and "streaming" not in text
    assert "0 of these 1 wait" in lesson.costliest(rows[3:4], k=3)
