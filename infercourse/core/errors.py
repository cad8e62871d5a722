"""Errors that say which layer of the stack failed, and what to do about it.

Troubleshooting in this course goes layer by layer (API -> server -> engine -> runtime ->
model -> context -> KV cache -> memory -> hardware), so every error infercourse raises
names its layer. An error raised mid-run carries what was already measured in `partial`,
so nothing finished is lost.
"""
from __future__ import annotations

from typing import Any

__all__ = [
    "InferCourseError", "APILayerError", "ServerLayerError", "EngineLayerError",
    "RuntimeLayerError", "ModelLayerError", "ContextLayerError", "BackendMissingError",
    "KVCacheLayerError", "MemoryLayerError", "HardwareLayerError", "AgentLayerError", "LAYERS",
]

# The order a symptom is located in (see notebook 17): the first failing layer is the answer.
LAYERS = ("API", "server", "engine", "runtime", "model", "context", "KV cache", "memory", "hardware")


class InferCourseError(Exception):
    """Base class: `layer` names where in the stack the fault lies."""

    layer = "unknown"

    def __init__(self, message: str, *, hint: str | None = None, partial: Any = None):
        self.message, self.hint, self.partial = message, hint, partial
        text = f"{message} ({self.layer} layer)"
        if hint:
            text += f". {hint}"
        super().__init__(text)


class APILayerError(InferCourseError):
    """Nothing answered, or the answer was not the API we speak (bad status, bad stream)."""

    layer = "API"


class ServerLayerError(InferCourseError):
    """A server process failed to start, died, or never became healthy."""

    layer = "server"


class EngineLayerError(InferCourseError):
    """The engine (scheduler, batching, caches) refused or failed a request."""

    layer = "engine"


class RuntimeLayerError(InferCourseError):
    """The runtime (llama.cpp, MLX, torch) failed."""

    layer = "runtime"


class BackendMissingError(RuntimeLayerError):
    """An optional backend is not installed, or cannot run on this hardware."""


class ModelLayerError(InferCourseError):
    """Model file missing, corrupt, or of an unknown name or format."""

    layer = "model"


class ContextLayerError(InferCourseError):
    """The prompt (plus the tokens asked for) does not fit the context window."""

    layer = "context"


class KVCacheLayerError(InferCourseError):
    """The KV cache is full or was sized too small for the requests in flight."""

    layer = "KV cache"


class MemoryLayerError(InferCourseError):
    """The process ran out of RAM / VRAM, or was killed for using too much."""

    layer = "memory"


class HardwareLayerError(InferCourseError):
    """The hardware a step needs (a GPU, Apple Silicon, an instruction set) is absent."""

    layer = "hardware"


class AgentLayerError(InferCourseError):
    """The coding agent (the client above the API: Claude Code, Codex CLI) failed, could not be
    started, or may not be run here. Not in `LAYERS`: the layer walk starts at the API, and the
    agent is what sends the symptom down it."""

    layer = "agent"
