"""Writing a run while it happens: the manifest first, then each finished request, on disk.

A number without its conditions (which machine, engine version, flags, model file, sampling,
load pattern) cannot be compared with anything, and a run that dies must not lose what it
already measured. `RunWriter` writes `manifest.json` *before* the first request, then appends
each finished request to `requests.jsonl` with flush + fsync, so a crash or a killed server
loses nothing already measured. During a load test the writing runs on a writer thread
(`start_thread` / `submit`): JSON encoding and fsync on the event loop would delay every
other stream's timestamps. `new_run_dir` gives each run a new folder. Reading runs back and
comparing them is `measure.results`, which also names everything here.
"""
from __future__ import annotations

import atexit
import datetime as _dt
import json
import os
import queue
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping

from infercourse.core.trace import RequestTrace
from infercourse.measure.hardware import environment_manifest, utc_now

__all__ = ["MANIFEST", "REQUESTS", "CONDITION_KEYS", "new_run_dir", "RunWriter"]

MANIFEST, REQUESTS = "manifest.json", "requests.jsonl"
# What a caller (bench) should record beside the machine facts; missing ones are warned.
CONDITION_KEYS = ("engine", "model", "sampling", "load", "workload")


def new_run_dir(results_root: str | os.PathLike | None, label: str) -> Path | None:
    """A new folder per run under `results_root` (None: bench's default under
    `cache_dir()/runs`), so re-running a notebook adds runs instead of overwriting them."""
    if results_root is None:
        return None
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    return Path(results_root) / f"{stamp}_{label}"


def _jsonable(o: Any) -> Any:
    """numpy scalars become numbers (not strings); anything else unknown becomes text."""
    return o.item() if hasattr(o, "item") and callable(o.item) else str(o)


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=_jsonable))
    os.replace(tmp, path)   # readers see the old manifest or the new one, never half


class RunWriter:
    """Write one run: the manifest first, then a line per finished request.

    Args:
        directory: a new (or empty) directory; an existing run is never overwritten.
        manifest: the run's conditions (engine, model, sampling, load, workload...);
            machine facts from `environment_manifest()` are added unless already given.

    `write(trace)` appends and fsyncs before returning. A load generator calls
    `start_thread()` once and then `submit(trace)`, which only queues the trace: a writer
    thread encodes it, appends it and fsyncs once per batch (whatever queued meanwhile),
    so a request is on disk one fsync after it finished. `close()` (also at interpreter
    exit) drains the queue first; only a `kill -9` can lose the few milliseconds queued.

    Use as a context manager: leaving the block closes the run, recording an error
    status if the block raised.
    """

    def __init__(self, directory: str | os.PathLike, manifest: Mapping[str, Any]):
        self.dir = Path(directory)
        if (self.dir / REQUESTS).exists() or (self.dir / MANIFEST).exists():
            raise FileExistsError(f"{self.dir} already holds a run; results are append-only, "
                                  "pick a new directory (re-running a notebook cell? run its set-up "
                                  "cell again: `results_dir()` gives a new folder each time)")
        self.dir.mkdir(parents=True, exist_ok=True)
        missing = [k for k in CONDITION_KEYS if k not in manifest]
        if missing:
            warnings.warn(f"manifest lacks conditions {missing}; the run will be hard to "
                          "compare", stacklevel=2)
        self.manifest = {**environment_manifest(), **manifest, "status": "running"}
        _atomic_json(self.dir / MANIFEST, self.manifest)
        self._f = open(self.dir / REQUESTS, "a", encoding="utf-8")
        self.n = 0
        self._q: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        _OPEN.add(self)

    def _append(self, traces: list[RequestTrace]) -> None:
        self._f.write("".join(json.dumps(t.as_row(), default=_jsonable) + "\n" for t in traces))
        self._f.flush()
        os.fsync(self._f.fileno())
        self.n += len(traces)

    def write(self, trace: RequestTrace) -> None:
        """Append one finished request and force it to disk before returning."""
        self._append([trace])

    def start_thread(self, on_written: Callable[[int], Any] | None = None) -> None:
        """Write from now on through `submit` on a writer thread.

        Args:
            on_written: called on the writer thread with the number of requests just
                made durable (e.g. a progress bar's `update`), so it costs the caller nothing.
        """
        if self._thread is not None:
            return
        self._q = queue.SimpleQueue()

        def loop() -> None:
            done = False
            while not done:
                batch = [self._q.get()]
                while True:                        # everything queued meanwhile: one fsync
                    try:
                        batch.append(self._q.get_nowait())
                    except queue.Empty:
                        break
                done = batch[-1] is None
                batch = [t for t in batch if t is not None]
                if batch and self._error is None:
                    try:
                        self._append(batch)
                        if on_written is not None:
                            on_written(len(batch))
                    except BaseException as e:  # noqa: BLE001 - raised in the caller by close()
                        self._error = e

        self._thread = threading.Thread(target=loop, name="infercourse-writer", daemon=True)
        self._thread.start()

    def submit(self, trace: RequestTrace) -> None:
        """Queue one finished request for the writer thread (nothing else happens here)."""
        if self._q is None:
            self.write(trace)
        else:
            self._q.put(trace)

    def flush(self) -> None:
        """Wait until every submitted request is on disk (stops the writer thread)."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread, self._q = None, None
        if self._error is not None:
            err, self._error = self._error, None
            raise OSError(f"writing {self.dir / REQUESTS} failed: {err}") from err

    def close(self, status: str = "ok") -> None:
        """Drain the writer thread, then record end time, status and request count."""
        if self._f.closed:
            return
        try:
            self.flush()
        finally:
            self._f.close()
            self.manifest.update(end_time=utc_now(), status=status, n_requests=self.n)
            _atomic_json(self.dir / MANIFEST, self.manifest)
            _OPEN.discard(self)

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, etype, exc, tb) -> None:
        self.close("ok" if exc is None else f"error: {etype.__name__}: {exc}")


_OPEN: "weakref.WeakSet[RunWriter]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # an interpreter leaving with a run still open: nothing finished is lost
    for w in list(_OPEN):
        w.close("error: interpreter exited before the run was closed")
