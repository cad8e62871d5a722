"""The fault lab: real faults on a real local server, each named by the symptom it causes.

A troubleshooting method is only learnt on faults that really happen. Each fault here is
done for real to a `LlamaServer` on 127.0.0.1 (or, for the network faults, to the wire in
front of it: `infercourse.ops.netfaults`), is bounded in time, and is always undone:

    with inject("frozen", server=srv) as f:     # SIGSTOP now, SIGCONT on exit (or after `seconds`)
        print(f.symptom, f.client_error)         # what a client saw
        print(f.doctor())                        # which layer the doctor names

| fault                  | what is done                                          | layer      |
|------------------------|-------------------------------------------------------|------------|
| `killed`               | SIGKILL to the server while it streams                | server     |
| `frozen`               | SIGSTOP (SIGCONT on exit, or after `seconds`)         | server     |
| `overloaded`           | 2x more streams than slots, held open                 | engine     |
| `memory_limited`       | RLIMIT_AS below what the requested context needs      | memory     |
| `memory_growth`        | RSS grows until an OOM-killer stand-in SIGKILLs it    | memory     |
| `model_missing`        | the model file disappears before start                | model      |
| `model_corrupt`        | a truncated copy of the model file                    | model      |
| `context_overflow`     | a prompt longer than the per-slot window              | context    |
| `template_breaks_tools`| a chat template that raises on tool turns             | model      |
| network faults         | latency, reset, cut, 5xx, slow first byte (netfaults) | API        |

Before each fault, `inject` reads the cgroup's OOM-kill counter (`ops.death`), so the doctor
can tell a kernel OOM kill (the counter rose) from any other SIGKILL, such as the stand-in's.

Undo, three times over: the `with` block's `finally`, an `atexit` hook (SIGCONT for every
pid still stopped), and the servers' own watchdog, which kills a server whose Python
parent died, stopped or not (SIGKILL needs no SIGCONT).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import httpx

from infercourse.core.errors import InferCourseError
from infercourse.ops import netfaults, startfaults
from infercourse.ops.death import oom_kills_now
from infercourse.ops.startfaults import small_server
from infercourse.servers.llama import LlamaServer

__all__ = ["Fault", "FAULTS", "Injected", "FaultRun", "inject", "run_fault", "small_server", "stopped_pids"]


@dataclass(frozen=True)
class Fault:
    """A fault of the lab: the symptom a user sees, and the layer where it lies."""

    name: str
    symptom: str
    layer: str
    how: str


FAULTS = {f.name: f for f in [
    Fault("killed", "the stream stops mid-answer; then nothing answers", "server", "SIGKILL while streaming"),
    Fault("frozen", "requests hang until the client times out", "server", "SIGSTOP, SIGCONT after"),
    Fault("overloaded", "first tokens take longer and longer", "engine", "2x more streams than slots"),
    Fault("memory_limited", "the server will not start (or dies under load)", "memory",
          "RLIMIT_AS below what the KV cache needs"),
    Fault("memory_growth", "it worked for a while, then the server died", "memory",
          "host prompt cache grows until an OOM-killer stand-in SIGKILLs it"),
    Fault("model_missing", "a new model will not run", "model", "model file deleted before start"),
    Fault("model_corrupt", "a new model will not run", "model", "model file truncated"),
    Fault("context_overflow", "long sessions fail with HTTP 400", "context", "prompt > per-slot window"),
    Fault("template_breaks_tools", "tool calling fails", "model", "chat template raises on tool turns"),
    *[Fault(n, s, "API", h) for n, (s, h) in netfaults.SYMPTOMS.items()],
]}

_STOPPED: set[int] = set()


def stopped_pids() -> set[int]:
    """Pids this process has SIGSTOPped and not yet resumed (should be empty)."""
    return set(_STOPPED)


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGCONT)
    _STOPPED.discard(pid)


@atexit.register
def _resume_all() -> None:
    for pid in list(_STOPPED):
        _resume(pid)


@dataclass
class Injected:
    """A fault in place: where to point a client, and what a client saw."""

    fault: Fault
    url: str
    server: Any = None
    prompt: str | None = None
    max_tokens: int = 0
    client_error: str | None = None
    client_layer: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    oom_before: int | None = None     # the cgroup's OOM-kill counter before the fault (None: unreadable)

    @property
    def symptom(self) -> str:
        return self.fault.symptom

    def doctor(self, **kw: Any):
        """`doctor_layers` on this fault's URL, with its server, prompt and max_tokens."""
        from infercourse.ops.layers import doctor_layers
        kw.setdefault("timeout_s", 3.0)
        kw.setdefault("oom_before", self.oom_before)
        return doctor_layers(self.url, server=self.server, prompt=self.prompt, max_tokens=self.max_tokens, **kw)

    def saw(self, exc: InferCourseError) -> None:
        """Record what the client saw: the message's first line as `client_error`, and the lines
        after it (a log tail a failed start appends, an error body) in notes["error_lines"]."""
        lines = [ln for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
        self.client_error, self.client_layer = lines[0][:300], exc.layer
        if len(lines) > 1:
            self.notes["error_lines"] = [ln[:300] for ln in lines[1:21]]


@contextlib.contextmanager
def _owned(server: LlamaServer | None, **kw: Any) -> Iterator[LlamaServer]:
    """The given running server, or a fresh small one stopped on exit."""
    if server is not None:
        yield server
        return
    srv = small_server(**kw).start()
    try:
        yield srv
    finally:
        srv.stop()


def _stream_until(srv, n_events: int, action) -> InferCourseError | None:
    """Stream a long answer; after `n_events` chunks (or a failure first) call `action()`
    exactly once; return the error the stream ended with."""
    engine, done = srv.engine(timeout=60.0), False
    try:
        for i, _ in enumerate(engine.stream("Tell a long story.", max_tokens=400, ignore_eos=True)):
            if i + 1 == n_events:
                done = True
                action()
    except InferCourseError as e:
        return e
    finally:
        engine.close()
        if not done:   # a slow machine must not leave the fault uninjected
            action()
    return None


@contextlib.contextmanager
def _killed(f: Injected, server, seconds: float):
    with _owned(server) as srv:
        pid = srv.pid
        err = _stream_until(srv, 2, lambda: os.kill(pid, signal.SIGKILL))
        if err:
            f.saw(err)
        with contextlib.suppress(Exception):
            srv.proc.wait(10)          # the watchdog logs the exit code, then exits
        f.url, f.server, f.notes = srv.url, srv, {"pid": pid, "signal": "SIGKILL"}
        try:
            yield
        finally:
            if server is not None:     # undo: a server we were lent is handed back running
                srv.stop()
                srv.start()


@contextlib.contextmanager
def _frozen(f: Injected, server, seconds: float):
    with _owned(server) as srv:
        pid = srv.pid
        os.kill(pid, signal.SIGSTOP)
        _STOPPED.add(pid)
        timer = threading.Timer(seconds, _resume, args=(pid,))   # bounded even if never exited
        timer.daemon = True
        timer.start()
        try:
            try:
                list(srv.engine(model="default", timeout=1.5).stream("Hi", max_tokens=4))
            except InferCourseError as e:
                f.saw(e)
            f.url, f.server, f.notes = srv.url, srv, {"pid": pid, "signal": "SIGSTOP", "auto_resume_s": seconds}
            yield
        finally:
            timer.cancel()
            _resume(pid)


@contextlib.contextmanager
def _overloaded(f: Injected, server, seconds: float):
    with _owned(server) as srv:
        slots = getattr(srv, "n_parallel", 2)
        stop, deadline = threading.Event(), time.monotonic() + seconds

        def one(i: int) -> None:
            engine = srv.engine(timeout=seconds + 5)
            with contextlib.suppress(InferCourseError):
                for _ in engine.stream(f"Story {i}: once upon a time", max_tokens=2000, ignore_eos=True):
                    if stop.is_set() or time.monotonic() > deadline:
                        break   # closing the stream makes llama-server drop the request
            engine.close()

        workers = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(2 * slots)]
        for w in workers:
            w.start()
        f.notes = {"slots": slots, "streams": len(workers), "all_busy": _wait_busy(srv.url, 15.0)}
        f.url, f.server = srv.url, srv
        try:   # what one more user sees: a request that waits for a slot until it gives up
            list(srv.engine(timeout=2.0).stream("Hi", max_tokens=4))
        except InferCourseError as e:
            f.saw(e)
        try:
            yield
        finally:
            stop.set()
            for w in workers:
                w.join(10)


def _wait_busy(url: str, within_s: float) -> bool:
    """Wait until every slot of the server is processing (its /slots says so)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
            slots = httpx.get(url + "/slots", timeout=2).json()
            if slots and all(s.get("is_processing") for s in slots):
                return True
        time.sleep(0.2)
    return False


@contextlib.contextmanager
def _context_overflow(f: Injected, server, seconds: float):
    with _owned(server) as srv:
        window = srv.ctx_size // srv.n_parallel
        f.prompt, f.max_tokens = " ".join(["word"] * int(window * 1.3)), 16
        try:
            list(srv.engine(timeout=30).stream(f.prompt, max_tokens=f.max_tokens))
        except InferCourseError as e:
            f.saw(e)
        f.url, f.server, f.notes = srv.url, srv, {"window": window}
        yield


@contextlib.contextmanager
def _network(f: Injected, server, seconds: float, delay_s: float | None = None):
    with _owned(server) as srv, netfaults.FaultProxy(srv.url, f.fault.name, max_s=seconds, delay_s=delay_s) as proxy:
        f.url, f.server, f.notes = proxy.url, srv, {"proxy": proxy.describe()}
        err, t0 = None, time.perf_counter()
        engine = netfaults.client_engine(proxy.url)
        try:
            events = list(engine.stream("Say hello.", max_tokens=16))
            f.notes["client_ttft_s"] = events[0].t - t0
        except InferCourseError as e:
            err = e
        finally:
            engine.close()
        if err:
            f.saw(err)
        yield


_RUN = {"killed": _killed, "frozen": _frozen, "overloaded": _overloaded,
        "memory_limited": startfaults.memory_limited, "memory_growth": startfaults.memory_growth,
        "model_missing": functools.partial(startfaults.model_file, corrupt=False),
        "model_corrupt": functools.partial(startfaults.model_file, corrupt=True),
        "context_overflow": _context_overflow, "template_breaks_tools": startfaults.template_breaks_tools,
        **{n: _network for n in netfaults.SYMPTOMS}}


@contextlib.contextmanager
def inject(name: str, server: LlamaServer | None = None, *, seconds: float = 20.0,
           delay_s: float | None = None) -> Iterator[Injected]:
    """Put one fault in place for the `with` block, then undo it.

    Args:
        name: a key of `FAULTS`.
        server: a running LlamaServer to fault (handed back healthy); None starts a small one.
            Faults at start (memory_limited, model_*, template_breaks_tools) start their own.
        seconds: the longest the fault may last (a frozen server resumes, load stops, a proxy
            passes traffic through) even if the block never ends.
        delay_s: the size of a delay fault (`latency`, `slow_first_byte`; None: netfaults'
            default), e.g. scaled to the route's own baseline so that it shows on any machine.
    """
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; choose one of {sorted(FAULTS)}")
    if delay_s is not None and name not in netfaults.DEFAULT_DELAY_S:
        raise ValueError(f"delay_s sizes only {sorted(netfaults.DEFAULT_DELAY_S)}, not {name!r}")
    f = Injected(FAULTS[name], url="", oom_before=oom_kills_now()["oom_kill"])   # before: "did it rise?"
    with _RUN[name](f, server, seconds, **({"delay_s": delay_s} if delay_s is not None else {})):
        yield f


@dataclass(frozen=True)
class FaultRun:
    """One fault injected and diagnosed: what the client saw, which layer the doctor
    named, and how long the diagnosis took (the doctor alone, and inject + undo)."""

    fault: str
    symptom: str
    expected: str
    named: str | None
    client_error: str | None
    doctor_s: float
    total_s: float
    report: Any
    notes: dict = field(default_factory=dict)     # what the fault itself recorded (sizes, readings)

    @property
    def correct(self) -> bool:
        return self.named == self.expected

    def row(self) -> dict[str, Any]:
        return {"fault": self.fault, "symptom": self.symptom, "expected": self.expected, "named": self.named,
                "correct": self.correct, "client_error": self.client_error, "doctor_s": round(self.doctor_s, 2),
                "total_s": round(self.total_s, 2)}


def run_fault(name: str, server: LlamaServer | None = None, *, seconds: float = 20.0,
              timeout_s: float = 3.0) -> FaultRun:
    """Inject one fault, run the doctor on it, undo it; return what happened.

    Args:
        name: a key of `FAULTS`.
        server: a running LlamaServer to reuse (handed back healthy); None: the fault starts its own.
        seconds: the longest the fault may last.
        timeout_s: how long each doctor probe waits.
    """
    t0 = time.perf_counter()
    with inject(name, server, seconds=seconds) as f:
        report = f.doctor(timeout_s=timeout_s)
    return FaultRun(name, f.symptom, f.fault.layer, report.layer, f.client_error, report.seconds,
                    time.perf_counter() - t0, report, dict(f.notes or {}))
