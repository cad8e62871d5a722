"""Content hashes: the same workload or file gives the same hash on every machine, so two
runs can tell they used the same inputs without storing them twice."""
from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["content_hash"]


def content_hash(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj` (e.g. a workload's prompts and lengths),
    so two runs can tell they used the same workload without storing it twice."""
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()
