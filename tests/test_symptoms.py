"""Notebook 18's sentences: the retry tail, the costliest rows and the crash row's kill record,
written from the numbers (synthetic rows; the sentences must flip when the numbers do)."""
import re

import pandas as pd

from infercourse.lessons import retries, symptom_sheet
from infercourse.lessons import symptoms as lesson


def _tail(no_retry, with_retry):
    rows = [{"mode": "no retry", "ok": ok, "attempts": 1, "seconds": s} for ok, s in no_retry]
    rows += [{"mode": "4 retries", "ok": ok, "attempts": 2, "seconds": s} for ok, s in with_retry]
    df = pd.DataFrame(rows)
    df.attrs["outage_s"] = 2.0
    return df


def test_retry_sentence_follows_failures_and_the_slowest_request():
    moved = retries.retry_sentence(_tail([(False, 0.01), (False, 0.01), (True, 0.2)], [(True, 2.4), (True, 0.2), (True, 0.2)]))
    assert "2 of 3 requests failed" in moved and "turned 2 failure(s) into successes" in moved
    assert "grew by 2.20 s" in moved and "moved into the tail" in moved
    assert "without a slower request" in retries.retry_sentence(_tail([(False, 0.5)], [(True, 0.3)]))
    assert "nothing for the retries to do" in retries.retry_sentence(_tail([(True, 0.2)], [(True, 0.2)]))
    assert "did not change" in retries.retry_sentence(_tail([(False, 0.1)], [(False, 3.0)]))
    assert "more requests failed with retries" in retries.retry_sentence(_tail([(True, 0.1)], [(False, 3.0)]))


def test_costliest_names_the_longest_rows_and_which_wait():
    rows = [lesson.SymptomRow("agent stuck", ("context",), "frozen", seconds=12.0),
            lesson.SymptomRow("API failed", ("API",), "5xx", seconds=1.0),
            lesson.SymptomRow("API timeout", ("engine",), "overloaded", seconds=3.0),
            lesson.SymptomRow("tokens slow", ("hardware",), "cpu_contention", seconds=20.0),
            lesson.SymptomRow("streaming fails", ("API",), "cut", seconds=99.0, skipped="no proxy here")]
    text = symptom_sheet.costliest(rows, k=2)
    assert text.startswith("The costliest rows in this run: tokens slow (20.0 s); agent stuck (12.0 s, found only")
    assert "1 of these 2 wait on time" in text and "streaming" not in text
    assert "0 of these 1 wait" in symptom_sheet.costliest(rows[3:4], k=3)


def test_prefill_only_ratio_is_the_token_ratio_of_the_rows_lengths():
    assert lesson.growth_lengths() == (32, 320)   # context_growth's own default, read from its signature
    assert lesson.prefill_only_ratio() == lesson.prefill_only_ratio((32, 320)) == 321 / 33   # + BOS each
    assert lesson.prefill_only_ratio((10, 10)) == 1.0


def test_ttft_ms_refuses_a_prompt_longer_than_one_slot():
    from types import SimpleNamespace

    import pytest

    def no_engine(**_):
        raise AssertionError("a prompt that does not fit must not be sent")
    srv = SimpleNamespace(ctx_size=1024, n_parallel=2, engine=no_engine)   # 512 tokens per slot
    with pytest.raises(ValueError, match="512"):
        lesson.ttft_ms(srv, 510)


def test_detect_seconds_holds_the_fault_past_the_deadline(monkeypatch):
    from types import SimpleNamespace
    seen = []

    def fake_run_fault(name, server, *, seconds, timeout_s):
        seen.append((name, seconds, timeout_s))
        return SimpleNamespace(doctor_s=timeout_s + 0.1)
    monkeypatch.setattr(lesson, "run_fault", fake_run_fault)
    assert lesson.detect_seconds("srv", 10.0, seconds=10) == 10.1
    assert lesson.detect_seconds("srv", 2.0, seconds=30) == 2.1
    # a frozen server that resumed mid-probe would answer it: the fault outlasts the deadline
    assert seen == [("frozen", 20.0, 10.0), ("frozen", 30, 2.0)]


def test_too_few_pairs_say_so_instead_of_a_bare_within_noise():
    """Two pairs can never pass the three-arm relabelling test (it needs three): the lab's
    evidence says so, and its default repeats reach the test's level."""
    import inspect

    from infercourse.measure import noise
    short, aa, long_ = [1.0, 1.1, 0.9, 1.05], [1.02, 1.08, 0.95, 1.0], [5.0, 5.5, 4.8, 5.2]
    two = noise.compare(short[:2], long_[:2], noise.noise_floor(short[:2], aa[:2]), labels=("short", "long"))
    four = noise.compare(short, long_, noise.noise_floor(short, aa), labels=("short", "long"))
    assert two.verdict == "too few pairs" and "2 pairs cannot pass a test that needs 3" in two.said
    assert four.verdict == "short faster" and four.said == "short faster"
    for fn in (lesson.context_growth, lesson.cpu_contention):
        assert inspect.signature(fn).parameters["repeats"].default >= two.fewest


def _crash(layer, server_said, memory_said="not reached (stopped at server)", skipped=None):
    return lesson.SymptomRow("crash after a long run", ("memory", "KV cache"), "memory_growth", layer=layer,
                             skipped=skipped, values={"doctor_server": server_said, "doctor_memory": memory_said})


def test_kill_record_says_whether_the_kernel_recorded_an_oom_kill():
    """Issue 31: an OOM kill leaves no line in the log; the sentence follows what the doctor read of
    the kernel's records, both ways, and says so where they cannot be read."""
    stand_in = symptom_sheet.kill_record([_crash(
        "server", "process 7 is gone (exit code -9); not the OOM killer: this cgroup's oom_kill counter stayed at 0 "
        "(memory.oom_control); the kernel log names no OOM kill of pid 7")])
    assert re.search(r"\bthe doctor named \*\*server\*\*", stand_in) and "stayed at 0" in stand_in
    assert re.search(r"\bshow no OOM kill\b.*\bstand-in\b", stand_in)
    oom = symptom_sheet.kill_record([_crash(
        "memory", "process 7 is gone (exit code -9); the kernel's record names the memory layer",
        "the server died of it: killed by the OOM killer: this cgroup's oom_kill counter rose 0 → 1 (memory.events)")])
    assert re.search(r"\bThe kernel recorded an OOM kill\b.*\bnamed \*\*memory\*\*.*rose 0 → 1", oom)
    assert "stand-in" not in oom and "show no OOM kill" not in oom
    blind = symptom_sheet.kill_record([_crash(
        "server", "process 7 is gone (exit code -9); the cgroup's OOM-kill counter is not readable here (no /proc)")])
    assert "cannot be read here" in blind and "show no OOM kill" not in blind
    unknown = symptom_sheet.kill_record([_crash("server", "process 7 is gone (exit code -9); this cgroup's oom_kill "
                                                "counter reads 2 (memory.events), with no reading from before")])
    assert "cannot say whether it rose" in unknown
    assert "did not run here (no RLIMIT)" in symptom_sheet.kill_record([_crash(None, "", skipped="no RLIMIT")])
    assert "did not run here" in symptom_sheet.kill_record([])


def test_the_crash_row_keeps_what_the_doctor_said_of_the_server_and_memory(monkeypatch):
    from types import SimpleNamespace
    checks = [SimpleNamespace(layer="API", summary="a"), SimpleNamespace(layer="server", summary="gone; stayed at 0"),
              SimpleNamespace(layer="memory", summary="not reached")]
    monkeypatch.setattr(lesson, "run_fault", lambda how, server, **kw: SimpleNamespace(
        report=SimpleNamespace(failed=checks[1], checks=checks), named="server", doctor_s=0.1, client_error="x",
        notes={}))
    row = lesson.reproduce("crash after a long run", SimpleNamespace(url="http://stand-in"))
    assert row.values["doctor_server"] == "gone; stayed at 0" and row.values["doctor_memory"] == "not reached"
