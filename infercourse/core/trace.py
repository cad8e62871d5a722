"""One record per request: what was scheduled, what was sent, what arrived and when.

A `RequestTrace` is the raw material every metric is computed from. It keeps the
*scheduled* send time next to the actual one, because a load generator that falls behind
(or a saturated server) delays the send: measuring latency from the actual send would hide
that queueing (the "coordinated omission" trap). It keeps every chunk's arrival time and
token count, so stalls in the tail stay visible instead of vanishing into an average.

Every request sent is recorded, whatever became of it. `status` is "ok" (the stream
ended normally), "error" (the engine or server failed it) or "incomplete" (still in
flight when the run was cut short by a deadline, a stop or Ctrl-C: its partial timings are
kept, `end_t` is when it was cut). Dropping the last two would remove exactly the slowest
requests from the tail (survivorship bias); `summary` counts them apart instead.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from infercourse.core.types import Event

__all__ = ["STATUSES", "RequestTrace", "trace_from_events", "record_stream", "record"]

STATUSES = ("ok", "error", "incomplete")


@dataclass
class RequestTrace:
    """Everything measured about one request. All times are `time.perf_counter()` seconds.

    `token_source` says who counted `completion_tokens`: "engine" (in-process tokenizer),
    "server" (HTTP usage block) or "client" (infercourse counted chunks).
    """

    request_id: int
    scheduled_t: float                 # when the load pattern wanted it sent
    sent_t: float                      # when the client actually sent it
    chunk_t: list[float] = field(default_factory=list)      # arrival of each chunk with text
    chunk_tokens: list[int] = field(default_factory=list)   # tokens in each chunk
    end_t: float | None = None         # arrival of the final event (or of the error)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    token_source: str | None = None
    finish_reason: str | None = None
    engine_timings: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"                 # "ok", "error" or "incomplete" (see STATUSES)
    error: str | None = None
    text: str = ""
    tags: dict[str, Any] = field(default_factory=dict)       # workload labels (prompt_len, turn...)

    def as_row(self) -> dict[str, Any]:
        return asdict(self)


def trace_from_events(events: list[Event], *, request_id: int, scheduled_t: float,
                      sent_t: float, error: BaseException | None = None,
                      end_t: float | None = None, incomplete: bool = False,
                      **tags: Any) -> RequestTrace:
    """Build a trace from recorded events (a finished stream, or the part received before
    an error or a cut). Chunks with no tokens and no text (role headers, keep-alives) are
    dropped so TTFT means the first *token*, not the first byte.

    Args:
        events: what arrived, in order.
        request_id, scheduled_t, sent_t: identity and the two send times.
        error: the exception that ended the stream (status "error").
        end_t: when the stream ended or was cut (default: the last event).
        incomplete: the request was still in flight when the run stopped (status
            "incomplete"; pass `end_t` = the moment it was cut).
        **tags: workload labels kept on the trace.
    """
    tr = RequestTrace(request_id=request_id, scheduled_t=scheduled_t, sent_t=sent_t, tags=tags)
    for e in events:
        if e.done:
            tr.end_t = e.t
            tr.finish_reason = e.finish_reason
            tr.engine_timings = dict(e.timings)
            if e.usage is not None:
                tr.prompt_tokens = e.usage.prompt_tokens
                tr.completion_tokens = e.usage.completion_tokens
                tr.cached_tokens = e.usage.cached_tokens
                tr.token_source = e.usage.source
        elif e.n_tokens or e.text:
            tr.chunk_t.append(e.t)
            tr.chunk_tokens.append(e.n_tokens)
            tr.text += e.text
    if tr.completion_tokens is None and tr.chunk_tokens:
        tr.completion_tokens, tr.token_source = sum(tr.chunk_tokens), "client"
    if error is not None:
        tr.status, tr.error = "error", f"{type(error).__name__}: {error}"
        tr.end_t = end_t if end_t is not None else (tr.chunk_t[-1] if tr.chunk_t else sent_t)
    elif incomplete and not any(e.done for e in events):   # a stream that reached its end was not cut
        tr.status = "incomplete"
        tr.end_t = end_t if end_t is not None else (tr.chunk_t[-1] if tr.chunk_t else sent_t)
    elif tr.end_t is None:
        tr.end_t = end_t if end_t is not None else (tr.chunk_t[-1] if tr.chunk_t else sent_t)
    return tr


def record_stream(stream: Iterable[Event], *, request_id: int = 0, scheduled_t: float | None = None,
                  raise_errors: bool = False, events: list | None = None, **tags: Any) -> RequestTrace:
    """Consume one stream of events and record it: the one timing path. bench's in-process
    runner and every lesson that times a request come through here.

    The send time is noted just before the first event is asked for (a generator does no
    work before that), so TTFT covers everything the engine does for the request.

    Args:
        stream: the events (e.g. `engine.stream(request)`, not yet started).
        scheduled_t: when a load pattern wanted it sent (default: the send time).
        raise_errors: re-raise an engine error after recording (lessons); bench keeps going
            with an error trace instead.
        events: a list to receive the raw events (e.g. for per-token text).
    """
    got: list[Event] = [] if events is None else events
    sent, err = time.perf_counter(), None
    try:
        for ev in stream:
            got.append(ev)
    except Exception as e:  # noqa: BLE001 - recorded; re-raised below when asked
        err = e
    tr = trace_from_events(got, request_id=request_id, scheduled_t=sent if scheduled_t is None else scheduled_t,
                           sent_t=sent, error=err, end_t=time.perf_counter() if err else None, **tags)
    if err is not None and raise_errors:
        raise err
    return tr


def record(engine: Any, request: Any, **kw: Any) -> RequestTrace:
    """`record_stream(engine.stream(request), ...)`: one request, timed the way bench times it."""
    return record_stream(engine.stream(request), **kw)

