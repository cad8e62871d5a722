"""Derive a file once, safely: a locked, atomic build with a manifest of its conditions.

A derived model (a converted folder, a re-quantized GGUF) takes seconds to minutes to
build and is then read by every notebook, so a half-built one must never be taken for a
finished one. `derive(target, build)`:

1. takes a file lock beside `target` (two notebooks converting at once: one builds, the
   other waits and then finds it done);
2. builds into a temporary sibling `.name.tmp-<pid>`, sweeping any left by a crash;
3. writes `manifest.json`: source and its sha256, tool, version, arguments, output sha256
   and bytes, seconds taken;
4. renames the folder into place (atomic on one filesystem).

So `target` exists only when complete, and `manifest(target)` says how it was made. A
SIGKILL mid-build leaves only a `.tmp-` folder, which the next build sweeps away.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from infercourse.core.errors import ModelLayerError
from infercourse.models.embedded import cache_dir, embedded_gguf, file_sha256

__all__ = ["derive", "derived_dir", "manifest", "source_gguf", "hash_folder"]


def derived_dir(source: str | Path | None = None) -> Path:
    """Folder holding everything derived from `source` (default: the embedded GGUF)."""
    src = source_gguf(source)
    return cache_dir() / "derived" / file_sha256(src)[:16]


def manifest(path: str | Path) -> dict:
    """The manifest of a derived output (a folder, or a file inside one)."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    try:
        return json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLayerError(f"{folder} has no readable manifest.json: not a finished derivation",
                              hint="delete it and derive again") from e


def source_gguf(source: str | Path | None) -> Path:
    """The GGUF every format derives from (None: the embedded model), checked by its magic bytes."""
    src = embedded_gguf() if source is None else Path(source)
    if not src.is_file():
        raise ModelLayerError(f"source GGUF {src} not found")
    with open(src, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLayerError(f"source {src} is not a GGUF file (bad magic bytes)")
    return src


def derive(target: Path, build: Callable[[Path], dict], *, source: Path | None = None) -> Path:
    """Build the folder `target` once: under a lock, into a temp sibling, then rename.

    Args:
        target: final folder; it exists only when it is complete (holds manifest.json).
        build: writes the output into the (empty, existing) folder it is given and
            returns {"tool", "version", "args"} for the manifest.
        source: the file the output derives from, recorded by its sha256.
    """
    from filelock import FileLock

    if (target / "manifest.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "manifest.json").is_file():  # another process finished it meanwhile
            return target
        if target.exists():  # no manifest: a leftover of a crash before atomic writes
            shutil.rmtree(target)
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        tmp.mkdir()
        try:
            t0 = time.perf_counter()
            info = build(tmp)
            seconds = time.perf_counter() - t0
            record = {"output": target.name, **info, "seconds": round(seconds, 2),
                      "source": str(source) if source else None,
                      "source_sha256": file_sha256(source) if source else None,
                      "output_sha256": hash_folder(tmp),
                      "output_bytes": sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()),
                      "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            (tmp / "manifest.json").write_text(json.dumps(record, indent=2))
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def hash_folder(folder: Path) -> str:
    """sha256 over a folder's files (names and bytes), manifest.json excluded."""
    import hashlib
    h = hashlib.sha256()
    for p in sorted(q for q in folder.rglob("*") if q.is_file() and q.name != "manifest.json"):
        h.update(p.relative_to(folder).as_posix().encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
