"""Hardware profiles: one `PROFILE` parameter that sizes every phase-3 and phase-4 lesson.

The same notebook must teach on a 2-core laptop CPU, a Mac Studio and a GPU box. What
changes between them is not the lesson but its sizes: which model, which engines and
servers exist, how many threads, how long a context, how many concurrent users, how many
requests, how long a soak. A profile is that list, in one frozen dataclass, so a learner
changes one word in the parameters cell (`PROFILE = "mac"`) and every cell scales.

- `cpu`: the embedded SmolLM2-135M Q4_1 on llama.cpp (in process and llama-server), small
  sweeps; runs anywhere, the course default and what CI runs.
- `mac`: Apple Silicon: MLX-LM on Metal and llama.cpp with Metal offload, bigger sweeps.
- `gpu`: an NVIDIA box: vLLM (or SGLang/TGI) behind an OpenAI URL, llama.cpp with CUDA
  offload, concurrency to 64.

`profile(name)` returns it; `detect()` picks the one this machine can run. A profile whose
hardware is absent is still returned (a learner may read it), and `require()` says, naming
the hardware layer, why it cannot run here.
"""
from __future__ import annotations

import importlib.util
import platform
import shutil
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from infercourse.core.errors import HardwareLayerError

__all__ = ["Profile", "PROFILES", "profile", "detect", "require"]


@dataclass(frozen=True)
class Profile:
    """The sizes one machine class runs the lessons at.

    Args:
        name: "cpu", "mac" or "gpu".
        needs: the hardware it needs: None, "apple-silicon" or "nvidia-gpu".
        model: a GGUF path or name for llama.cpp (None: the embedded model).
        engines: in-process engines to compare (names from `infercourse.engines.ENGINES`).
        servers: local servers the lessons may start ("llama", "mlx", "vllm").
        server_url: an already-running OpenAI-compatible server to use instead (e.g. vLLM).
        threads: CPU threads for llama.cpp (None: its own choice).
        n_gpu_layers: llama.cpp layers offloaded (0 on CPU, -1 = all).
        ctx_size: context window per server (tokens).
        parallel: llama-server slots (-np).
        concurrencies: load levels for concurrency sweeps.
        n_requests: requests per measured level.
        prompt_tokens, max_tokens: the synthetic request's prompt and forced output length.
        soak_s: default soak duration (seconds; 24 h = 86400 is one edit away).
        contexts: prompt lengths (tokens) for context-growth sweeps (notebook 12).
        kv_types: KV-cache element types to compare (llama.cpp `-ctk/-ctv`).
        memory_budget_mib: the memory a "when do I run out?" prediction plans for
            (on a GPU: its VRAM; None: this machine's available RAM).
    """

    name: str
    needs: str | None = None
    model: str | None = None
    engines: tuple[str, ...] = ("llamacpp",)
    servers: tuple[str, ...] = ("llama",)
    server_url: str | None = None
    threads: int | None = 2
    n_gpu_layers: int = 0
    ctx_size: int = 4096
    parallel: int = 4
    concurrencies: tuple[int, ...] = (1, 2, 4)
    n_requests: int = 16
    prompt_tokens: int = 128
    max_tokens: int = 32
    soak_s: float = 30.0
    contexts: tuple[int, ...] = (64, 512, 1536)
    kv_types: tuple[str, ...] = ("f16", "q8_0", "q4_0")
    memory_budget_mib: float | None = 512.0
    extra: dict[str, Any] = field(default_factory=dict)

    def with_(self, **changes: Any) -> "Profile":
        """A copy with some sizes changed: `profile("cpu").with_(n_requests=64)`."""
        return replace(self, **changes)


PROFILES: dict[str, Profile] = {
    "cpu": Profile("cpu"),
    "mac": Profile("mac", needs="apple-silicon", engines=("llamacpp", "mlx"), servers=("llama", "mlx"),
                   threads=None, n_gpu_layers=-1, ctx_size=16384, parallel=8,
                   concurrencies=(1, 2, 4, 8, 16), n_requests=64, prompt_tokens=512, max_tokens=128,
                   soak_s=600.0, contexts=(512, 4096, 12288), memory_budget_mib=None),
    "gpu": Profile("gpu", needs="nvidia-gpu", engines=("llamacpp",), servers=("llama", "vllm"),
                   threads=None, n_gpu_layers=-1, ctx_size=32768, parallel=16,
                   concurrencies=(1, 4, 16, 32, 64), n_requests=256, prompt_tokens=1024, max_tokens=256,
                   soak_s=1800.0, contexts=(1024, 8192, 28672), memory_budget_mib=None),
}


def profile(name: str = "cpu", **changes: Any) -> Profile:
    """The named profile, optionally with some sizes changed.

    Args:
        name: "cpu", "mac" or "gpu".
        **changes: fields to override, e.g. `n_requests=8`.
    """
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}")
    return PROFILES[name].with_(**changes) if changes else PROFILES[name]


def _has(needs: str | None) -> bool:
    if needs is None:
        return True
    if needs == "apple-silicon":
        return sys.platform == "darwin" and platform.machine() == "arm64"
    if needs == "nvidia-gpu":   # a driver tool alone is not a GPU: ask NVML / nvidia-smi for one
        if shutil.which("nvidia-smi") is None and importlib.util.find_spec("pynvml") is None:
            return False
        from infercourse.measure.hardware import gpu_stats
        return bool(gpu_stats())
    raise ValueError(f"unknown hardware requirement {needs!r}")


def detect() -> Profile:
    """The richest profile this machine can run: gpu, then mac, else cpu."""
    for name in ("gpu", "mac"):
        if _has(PROFILES[name].needs):
            return PROFILES[name]
    return PROFILES["cpu"]


def require(p: Profile) -> Profile:
    """Return `p` if this machine has its hardware, else raise, naming the hardware layer."""
    if not _has(p.needs):
        raise HardwareLayerError(f"profile {p.name!r} needs {p.needs}, which this machine lacks",
                                 hint="use PROFILE = 'cpu', or run on that hardware")
    return p
