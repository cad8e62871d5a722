"""Load generation: when each request is due, and the loops that send them on time.

Schedules are offsets in seconds from the start of a run. The loops stamp every request's
*scheduled* send time before it goes out, so a client or server that falls behind shows
up as latency (dispatch delay), never as a silently lower request rate. HTTP engines run
on one asyncio event loop in a worker thread (`loop_in_thread`: the same code works in a
script and in a notebook, whose kernel already runs a loop, and Ctrl-C cancels cleanly);
in-process engines run one request at a time through `core.trace.record`.

Nothing the run started is dropped when it ends early. A request in flight when a
deadline, a stop (dead server) or Ctrl-C ends the run is recorded with status
"incomplete" and the chunks it had received; one that was due but still waiting at the
in-flight cap is recorded "incomplete" too, never sent (`sent_t` NaN, tag `sent=False`).
Finished requests go to the results writer's queue: its thread, not this loop, encodes,
fsyncs and moves the progress bar.

The closed loop hands requests to its N workers from one shared queue by default: the
next request goes to whichever worker is free (independent requests). With `lanes=True`
worker w takes requests w, w + N, w + 2N, ... in that order, so a sequence laid out that
way (a session's calls, each extending the last) is sent by one worker, call k + 1 only
after call k has finished; a shared queue would hand call k + 1 to the other worker while
call k still prefills, and its prefix could not be in any cache yet.

`bench` (run, sweep, replay) is the public face; this module is its machinery.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from urllib.parse import urlparse

import numpy as np
import psutil

from infercourse.core.trace import RequestTrace, record, trace_from_events
from infercourse.core.types import Request

__all__ = ["constant_schedule", "poisson_schedule", "loop_in_thread", "run_async", "run_sync",
           "self_check", "server_address", "State", "incomplete_trace", "send_one"]


# -- schedules: offsets in seconds from the start of the run ---------------------------------
def constant_schedule(n: int, rate_rps: float) -> np.ndarray:
    """`n` send offsets exactly 1/rate apart, starting at 0."""
    if rate_rps <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate_rps}")
    return np.arange(n) / rate_rps


def poisson_schedule(n: int, rate_rps: float, seed: int = 0) -> np.ndarray:
    """`n` send offsets of a Poisson process (exponential gaps, mean 1/rate), seeded.
    Real users arrive independently, so bursts happen: this is how they look."""
    if rate_rps <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate_rps}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_rps, n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


class State:
    """Shared between the dispatcher and the request coroutines (one thread at a time).

    Args:
        writer: a `results.RunWriter`; `submit` is used unless `inline`.
        pbar: a progress bar, updated here only when `inline` (else by the writer thread).
        inline: write and fsync on the caller's thread (the old way; benchmarks compare it).
    """

    def __init__(self, writer, pbar, inline: bool = False):
        self.writer, self.pbar, self.traces, self.inline = writer, pbar, [], inline
        self.in_flight = self.max_in_flight = 0
        self.t0: float | None = None
        self.cpu0 = 0.0
        self.stop_reason: str | None = None
        self.server_error: BaseException | None = None

    def start(self) -> float:
        """Mark the end of warm-up: the run's clock and the client's CPU count start here.
        `on_start` (if set) runs first: a server sample whose counters exclude the warm-up."""
        if getattr(self, "on_start", None):
            self.on_start()
        self.t0, self.cpu0 = time.perf_counter(), sum(psutil.Process().cpu_times()[:2])
        return self.t0

    def done(self, tr: RequestTrace) -> None:
        self.traces.append(tr)
        if self.inline:
            self.writer.write(tr)    # encode + append + fsync, on this thread
            self.pbar.update(1)
        else:
            self.writer.submit(tr)   # a queue put: the writer thread does the rest


def incomplete_trace(events, reason: str, *, request_id: int, scheduled_t: float, sent_t: float,
                     **tags) -> RequestTrace:
    """A request the run stopped before it finished: the chunks received so far, ended now.
    Its latencies are lower bounds (it would have taken at least this long)."""
    tr = trace_from_events(events, request_id=request_id, scheduled_t=scheduled_t, sent_t=sent_t,
                           end_t=time.perf_counter(), **tags)
    tr.status, tr.error = "incomplete", f"incomplete: {reason}"
    return tr


def server_address(engine) -> tuple[str, int] | None:
    url = getattr(engine, "root", None) or getattr(engine, "base_url", None)
    if not url:
        return None
    u = urlparse(str(url))
    return u.hostname or "", u.port or (443 if u.scheme == "https" else 80)


def _server_alive(addr: tuple[str, int] | None) -> bool:
    # After an error we ask the OS, not the engine: a refused TCP connect means the server
    # process is gone, whatever exception text the client library produced.
    if addr is None:
        return True
    try:
        socket.create_connection(addr, timeout=1.0).close()
        return True
    except OSError:
        return False


async def _one(engine, client, i: int, req: Request, scheduled_t: float, st: State, addr,
               tags: dict) -> None:
    events, sent, tr = [], time.perf_counter(), None
    st.in_flight += 1
    st.max_in_flight = max(st.max_in_flight, st.in_flight)
    tags = {**tags, "in_flight_at_send": st.in_flight}
    try:
        try:
            async for ev in engine.astream(req, client=client):
                events.append(ev)
            tr = trace_from_events(events, request_id=i, scheduled_t=scheduled_t, sent_t=sent, **tags)
        except asyncio.CancelledError:
            raise
        except Exception as e:   # noqa: BLE001 - every failure becomes an error trace
            tr = trace_from_events(events, request_id=i, scheduled_t=scheduled_t, sent_t=sent,
                                   error=e, end_t=time.perf_counter(), **tags)
            if st.server_error is None and not await asyncio.to_thread(_server_alive, addr):
                st.server_error, st.stop_reason = e, "server stopped answering"
    except asyncio.CancelledError:   # the run ended under it: keep what it had received
        st.done(tr or incomplete_trace(events, f"in flight when the run stopped ({st.stop_reason or 'cancelled'})",
                                       request_id=i, scheduled_t=scheduled_t, sent_t=sent, **tags))
        raise
    finally:
        st.in_flight -= 1
    st.done(tr)


send_one = _one   # one request on the loop, recorded into State (sessions send turn by turn)


async def _sleep_until(loop, when_loop: float, due: float) -> None:
    """Sleep until `when_loop` on the loop's clock, then until `due` on ours.

    An absolute deadline, not `asyncio.sleep(due - now)` computed when the task first runs:
    on a busy machine the tasks start late and unevenly, and relative sleeps can then wake
    a later request before an earlier one. Timers fire in the order they are due, so
    requests go out in schedule order however late; the last loop makes "never early"
    exact whatever the two clocks' grain."""
    fut = loop.create_future()
    handle = loop.call_at(when_loop, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        handle.cancel()
    while (left := due - time.perf_counter()) > 0:
        await asyncio.sleep(left)


def _never_sent(i: int, due: float, st: State, cap: int, tags: dict) -> RequestTrace:
    why = f"due, but waited at the in-flight cap ({cap}) until the run stopped ({st.stop_reason or 'cancelled'})"
    return incomplete_trace([], why, request_id=i, scheduled_t=due, sent_t=float("nan"),
                            **{**tags, "sent": False})


async def run_async(engine, reqs, offsets, concurrency, max_in_flight, deadline_s, warm, st, addr, tags,
                    lanes: bool = False):
    """Send `reqs` closed-loop (`offsets` None: `concurrency` workers; `lanes`: worker w sends
    w, w + N, ... in order, see the module docstring) or open-loop on `offsets`, recording
    every request into `st`."""
    pool = max_in_flight if offsets is not None else concurrency
    if hasattr(engine, "async_client"):
        client = engine.async_client(pool)
    else:
        import httpx
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=pool), timeout=600)
    tasks: list[asyncio.Task] = []
    try:
        async with client:
            for w in warm:       # warm-up: same path, nothing recorded
                async for _ in engine.astream(w, client=client):
                    pass
            t0 = st.start()
            over = lambda: st.stop_reason or (deadline_s and time.perf_counter() - t0 > deadline_s)  # noqa: E731
            if offsets is None:                      # closed loop: N workers
                shared = iter(range(len(reqs)))
                its = [iter(range(w, len(reqs), concurrency)) if lanes else shared for w in range(concurrency)]

                async def worker(it):
                    sched = t0
                    for i in it:
                        if over():
                            return
                        await _one(engine, client, i, reqs[i], sched, st, addr, tags[i])
                        sched = time.perf_counter()   # free now: the next one is due now
                tasks = [asyncio.create_task(worker(it)) for it in its]
            else:                                    # open loop: on schedule, capped
                gate, loop = asyncio.Semaphore(max_in_flight), asyncio.get_running_loop()
                shift = -(time.perf_counter() - loop.time())   # our clock -> the loop's, read once

                async def fire(i, off):
                    due = t0 + off
                    await _sleep_until(loop, due + shift, due)
                    if over():
                        return                   # not due before the run ended: not part of it
                    try:
                        await gate.acquire()
                    except asyncio.CancelledError:
                        st.done(_never_sent(i, due, st, max_in_flight, tags[i]))
                        raise
                    try:
                        if over():               # the run ended while it waited at the cap
                            st.done(_never_sent(i, due, st, max_in_flight, tags[i]))
                        else:
                            await _one(engine, client, i, reqs[i], due, st, addr, tags[i])
                    finally:
                        gate.release()
                tasks = [asyncio.create_task(fire(i, off)) for i, off in enumerate(offsets)]
            grace = None if not deadline_s else deadline_s + max(10.0, deadline_s)
            _, pending = await asyncio.wait(tasks, timeout=grace)
            if pending:   # past the deadline's grace: stop, record the rest as incomplete
                st.stop_reason = st.stop_reason or f"max duration {deadline_s}s reached"
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
    except asyncio.CancelledError:                   # Ctrl-C: stop, keep what finished
        st.stop_reason = "interrupted"
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def loop_in_thread(make_coro) -> bool:
    """Run a coroutine on a fresh event loop in a worker thread; returns True if the user
    interrupted. A KeyboardInterrupt in the main thread (Ctrl-C, Jupyter's stop button)
    cancels the task, which then stops cleanly."""
    loop, box, finished = asyncio.new_event_loop(), {}, threading.Event()

    def target():
        try:
            box["task"] = loop.create_task(make_coro())
            loop.run_until_complete(box["task"])
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e
        finally:  # finalise streams left open (an SSE reader stopped at [DONE]) before closing
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            finished.set()

    th, interrupted = threading.Thread(target=target, name="infercourse-bench", daemon=True), False
    th.start()
    # Wait on an Event, not on th.join(): a KeyboardInterrupt landing inside join() can
    # leave CPython's thread marked stopped while it still runs (and still writes results).
    while not finished.is_set():
        try:
            finished.wait(0.1)
        except KeyboardInterrupt:
            interrupted = True
            if "task" in box:
                try:
                    loop.call_soon_threadsafe(box["task"].cancel)
                except RuntimeError:  # the loop closed meanwhile: nothing left to cancel
                    pass
    th.join()
    if "error" in box and not isinstance(box["error"], asyncio.CancelledError):
        raise box["error"]
    return interrupted


def run_sync(engine, reqs, offsets, deadline_s, warm, st, tags) -> None:
    for w in warm:
        for _ in engine.stream(w):
            pass
    t0 = st.start()
    st.max_in_flight = 1
    for i, req in enumerate(reqs):
        if deadline_s and time.perf_counter() - t0 > deadline_s:
            st.stop_reason = f"max duration {deadline_s}s reached"
            break
        sched, events, sent = (t0 + offsets[i] if offsets is not None else time.perf_counter()), [], None
        try:
            time.sleep(max(0.0, sched - time.perf_counter()))
            sent = time.perf_counter()   # record() notes its own send time a few us later
            # an engine error is recorded as an error trace, and the run goes on
            st.done(record(engine, req, request_id=i, scheduled_t=sched, events=events,
                           in_flight_at_send=1, **tags[i]))
        except KeyboardInterrupt:    # Ctrl-C: the request in progress is kept as incomplete
            st.stop_reason = "interrupted"
            if sent is not None:
                st.done(incomplete_trace(events, "in progress when the run was interrupted", request_id=i,
                                         scheduled_t=sched, sent_t=sent, in_flight_at_send=1, **tags[i]))
            break


def self_check(df, cpu_frac: float, is_async: bool, st: State, max_in_flight: int,
                open_loop: bool) -> list[str]:
    """Warnings for when the client, not the server, limited what was measured."""
    out = []
    if is_async and cpu_frac >= 0.9:
        out.append(f"client used {cpu_frac:.0%} of a CPU core: the load generator may be the "
                   "bottleneck; run it on a less loaded machine or lower the rate")
    ok = df[df["status"] == "ok"] if len(df) else df
    if len(ok):
        p95_delay, ttft = ok["dispatch_delay_s"].quantile(0.95), ok["ttft_from_send_s"].median()
        if p95_delay > max(0.005, 0.25 * (ttft if ttft == ttft else 0.0)):
            out.append(f"p95 dispatch delay {p95_delay * 1e3:.1f} ms vs median TTFT {ttft * 1e3:.1f} ms: "
                       "the client fell behind its schedule (latencies include that queueing)")
    if open_loop and st.max_in_flight >= max_in_flight:
        out.append(f"the in-flight cap ({max_in_flight}) was reached: later requests waited in the client")
    return out
