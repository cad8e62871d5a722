"""What llama-server's own log says about its memory: the buffers it allocated and the KV
caches it made, read from its text (`-lv 4`: this build logs buffer sizes only above the
default verbosity).

A model with sliding-window attention gets two KV caches (`llama_kv_cache_iswa`): one of
`ctx` cells for its global layers and one of about window + batch cells for its local
layers, unless `--swa-full` makes the second one full size too. `kv_caches` returns each,
so a lesson can put the memory `--swa-full` costs beside the prefill it saves.

Parsed by hand: the log is llama.cpp's free text, with no machine-readable form.
"""
from __future__ import annotations

import re

__all__ = ["VERBOSE_ARGS", "log_buffers", "kv_caches"]

VERBOSE_ARGS = ("-lv", "4")      # the flags under which the sizes below are logged
_BUF = re.compile(r"(model|KV|compute) buffer size =\s*([\d.]+) MiB")
_KV_LINE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers")
_ISWA = re.compile(r"llama_kv_cache_iswa: creating\s+(non-SWA|SWA) KV cache, size = (\d+) cells")


def _last_load(log_text: str) -> str:
    """Only the last model load counts (a log may hold several)."""
    return log_text[log_text.rfind("llama_model_loader"):] if "llama_model_loader" in log_text else log_text


def log_buffers(log_text: str) -> dict[str, float]:
    """MiB of each buffer kind a llama.cpp log reports (summed over devices), plus the KV
    cache's cell count (the first cache's, for a model with one)."""
    text = _last_load(log_text)
    out = {"model_mib": 0.0, "kv_mib": 0.0, "compute_mib": 0.0}
    for kind, mib in _BUF.findall(text):
        out[{"model": "model_mib", "KV": "kv_mib", "compute": "compute_mib"}[kind]] += float(mib)
    if m := _KV_LINE.search(text):
        out["kv_cells"] = int(m.group(2))
    return out


def kv_caches(log_text: str) -> list[dict]:
    """Each KV cache the last load made: {"kind": "full" | "global" | "local (SWA)",
    "cells", "layers", "mib"}. A model without sliding windows has one ("full")."""
    text = _last_load(log_text)
    kinds = ["global" if k == "non-SWA" else "local (SWA)" for k, _ in _ISWA.findall(text)]
    sizes = _KV_LINE.findall(text)
    return [{"kind": kinds[i] if i < len(kinds) else "full", "cells": int(c), "layers": int(n), "mib": float(m)}
            for i, (m, c, n) in enumerate(sizes)]
