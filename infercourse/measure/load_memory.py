"""What loading a GGUF costs in resident memory, measured in a fresh process and split in two.

llama.cpp maps a GGUF file into memory: the weights' pages become resident as they are
touched, and they count in the process's resident set (RSS) as *file-backed* pages. What
else the load adds is *anonymous* memory: the KV cache and compute buffers for the context,
the runtime's own set-up, and any copy it makes of tensors (its CPU backend keeps some block
types a second time, rearranged for kernels that multiply several rows at once).

Measured inside a long-lived process, one file after another, the growth of RSS mixes in
whatever the previous file left: freed heap that the allocator hands to the next load
without growing RSS, pages released late. So `gguf_load_memory` loads the file in a new
Python process (llama-cpp-python imported before the first reading: the library is not
the file), runs one short request, and reports the growth of RSS and, on Linux, the bytes
resident through the file's own mapping (`/proc/self/smaps`); the rest is anonymous.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

__all__ = ["gguf_load_memory", "mapped_bytes"]


def mapped_bytes(smaps: str, path: str | Path) -> int | None:
    """Bytes resident through every mapping of `path`, from the text of /proc/<pid>/smaps
    (the `Rss:` lines under each mapping whose pathname is that file). None when no mapping
    names the file.

    Args:
        smaps: the text of /proc/self/smaps.
        path: the mapped file (compared after resolving symlinks).
    """
    want, current, total, seen = str(Path(path).resolve()), None, 0, False
    for line in smaps.splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:   # a mapping's header line
            current = head[5].strip() if len(head) == 6 else ""
            seen |= current == want
        elif current == want and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024                              # smaps counts kB
    return total if seen else None


_CHILD = """
import json, sys
from pathlib import Path
import llama_cpp
from infercourse.measure.load_memory import mapped_bytes
from infercourse.measure.quant_speed import rss_now
args = json.loads(sys.stdin.read())
before = rss_now()
llm = llama_cpp.Llama(model_path=args["path"], n_ctx=args["n_ctx"], n_threads=args["n_threads"], verbose=False)
llm.create_completion("One short request.", max_tokens=4)
after = rss_now()
smaps = Path("/proc/self/smaps")
mapped = mapped_bytes(smaps.read_text(), args["path"]) if smaps.exists() else None
print(json.dumps({"rss_delta_bytes": after - before, "mapped_bytes": mapped}))
"""


def gguf_load_memory(path: str | Path, *, n_ctx: int = 512, n_threads: int = 1,
                     timeout_s: float = 600) -> dict[str, int | None]:
    """{"rss_delta_bytes", "mapped_bytes", "other_bytes"}: the resident growth of loading
    `path` with llama.cpp and running one 4-token request, in a new process; the part
    resident through the file's mapping (None where the OS does not say: not Linux); and the
    rest (anonymous: KV cache, buffers, set-up, copies of tensors).

    Args:
        path: a GGUF file.
        n_ctx: context window (the KV cache is allocated for all of it).
        n_threads: llama.cpp threads.
        timeout_s: give up on a child that hangs.
    """
    from infercourse.core.errors import ModelLayerError
    p = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=timeout_s,
                       input=json.dumps({"path": str(path), "n_ctx": n_ctx, "n_threads": n_threads}))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise ModelLayerError(f"loading {path} in a fresh process failed (exit {p.returncode}): "
                              f"{p.stderr.strip()[-400:]}")
    out = json.loads(lines[-1])
    mapped = out["mapped_bytes"]
    return {"rss_delta_bytes": int(out["rss_delta_bytes"]), "mapped_bytes": mapped,
            "other_bytes": None if mapped is None else int(out["rss_delta_bytes"]) - int(mapped)}
