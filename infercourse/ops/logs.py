"""Native logs go to a file, never into the notebook.

llama.cpp, ggml and torch write straight to file descriptors 1 and 2 from C/C++, below
Python's `sys.stdout`, so Python-level redirection cannot catch them, and Jupyter copies
whatever reaches those descriptors into the cell output (llama.cpp's quantizer alone
prints ~1,500 lines). `native_logs_to_file()` points descriptors 1 and 2 at a log file for
the rest of the process (or of a `with` block); Python's own `print` in a notebook goes
through the kernel's `sys.stdout` object, not through descriptor 1, so the learner still
sees every line the lesson prints. Child processes inherit the file too.

A few Python loggers write to the kernel's `sys.stderr` object on import, above the
descriptors: torchao (CUDA-only extensions that fail to load on a CPU), torch's pytree
deprecation notes, bitsandbytes (a missing optional CPU kernel). Their records go to the
same file (`models.quiet.CHATTY_LOGGERS`), set before those libraries are imported.

Hand-written because it is the `dup2` of two descriptors: no library does less.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

from infercourse.models.embedded import cache_dir

__all__ = ["native_log_path", "native_logs_to_file"]

_ACTIVE: dict[str, object] = {}


def native_log_path() -> Path:
    """Where native logs of this process go: `cache_dir()/logs/native-<pid>.log`."""
    return cache_dir() / "logs" / f"native-{os.getpid()}.log"


@contextlib.contextmanager
def _redirected(path: Path) -> Iterator[Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):     # anything Python buffered goes out first
        with contextlib.suppress(Exception):
            stream.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield path
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def native_logs_to_file(path: str | Path | None = None, *, block: bool = False):
    """Send what native code writes to descriptors 1 and 2 into a log file.

    Called plainly (a notebook's first cell), it stays in force for the whole process and
    returns the log path; calling it again returns the same path. With `block=True` it
    returns a context manager that restores the descriptors on exit.

    Args:
        path: the log file (default: `native_log_path()`).
        block: return a context manager instead of redirecting for good.
    """
    path = Path(path) if path else native_log_path()
    if block:
        return _redirected(path)
    if "path" not in _ACTIVE:
        cm = _redirected(path)
        _ACTIVE["path"] = cm.__enter__()     # held for the life of the process
        _ACTIVE["cm"] = cm
        _python_loggers_to(_ACTIVE["path"])
    return _ACTIVE["path"]


def _python_loggers_to(path: Path) -> None:
    # the loggers whose import-time chatter reached notebook cells (04 printed four lines)
    import logging

    from infercourse.models.quiet import CHATTY_LOGGERS
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in CHATTY_LOGGERS:
        log = logging.getLogger(name)
        log.addHandler(handler)
        log.propagate = False      # not up to a handler that writes to the notebook's stderr
