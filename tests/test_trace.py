"""core.trace.record_stream: the one timing path bench and the lessons share."""
import time

import pytest

from infercourse.core.errors import EngineLayerError
from infercourse.core.trace import record, record_stream
from infercourse.core.types import Event, Usage


def _stream(n, fail_after=None, clock=None):
    for i in range(n):
        if fail_after is not None and i == fail_after:
            raise EngineLayerError("engine died mid-stream")
        if clock is not None:
            clock.append(time.perf_counter())
        yield Event(t=time.perf_counter(), text=f"t{i}", n_tokens=1)
    yield Event(t=time.perf_counter(), done=True, usage=Usage(prompt_tokens=5, completion_tokens=n),
                finish_reason="length")


def test_send_time_is_taken_before_the_generator_starts():
    started = []
    tr = record_stream(_stream(3, clock=started), request_id=7, pattern="x")
    # the send stamp precedes the first line of engine work, and the first chunk follows it
    assert tr.sent_t <= started[0] <= tr.chunk_t[0]
    assert tr.scheduled_t == tr.sent_t                     # no schedule given: due when sent
    assert (tr.request_id, tr.completion_tokens, tr.text, tr.status) == (7, 3, "t0t1t2", "ok")
    assert tr.tags == {"pattern": "x"}


def test_error_keeps_partial_chunks_or_reraises():
    tr = record_stream(_stream(5, fail_after=2), scheduled_t=0.0)
    assert tr.status == "error" and "engine died" in tr.error and len(tr.chunk_t) == 2
    assert tr.end_t >= tr.chunk_t[-1] and tr.scheduled_t == 0.0
    got = []
    with pytest.raises(EngineLayerError):
        record_stream(_stream(5, fail_after=2), raise_errors=True, events=got)
    assert [e.text for e in got] == ["t0", "t1"]


def test_record_calls_engine_stream():
    class E:
        name = "fake"

        def stream(self, request):
            return _stream(request)
    tr = record(E(), 4)
    assert tr.completion_tokens == 4 and len(tr.chunk_t) == 4


def test_incomplete_keeps_partial_timings_unless_the_stream_ended():
    from infercourse.core.trace import STATUSES, trace_from_events
    got = [Event(t=1.0, text="a", n_tokens=1), Event(t=1.2, text="b", n_tokens=1)]
    tr = trace_from_events(got, request_id=1, scheduled_t=0.0, sent_t=0.5, incomplete=True, end_t=3.0)
    assert tr.status == "incomplete" and tr.error is None and tr.end_t == 3.0
    assert tr.chunk_t == [1.0, 1.2] and tr.completion_tokens == 2 and tr.status in STATUSES
    done = got + [Event(t=1.3, done=True, usage=Usage(prompt_tokens=3, completion_tokens=2))]
    assert trace_from_events(done, request_id=1, scheduled_t=0.0, sent_t=0.5, incomplete=True).status == "ok"
