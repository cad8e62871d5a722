"""Every use of a third-party package's private parts, in one place.

llama-cpp-python's `Llama` exposes no public handle to the llama.cpp model, vocabulary or
context that its own C API functions take (`llama_model_size`, `llama_vocab_is_eog`,
`llama_perf_context`, `llama_state_get_size`), and the `ollama` client exposes no public
HTTP client for the endpoints it does not wrap (`/api/version`). Nor does `Llama` say how
much of a prompt `generate()` took from its KV cache: `llama_cached_prefix` reads the
state that decides it. Each accessor below is the
only place such an attribute is read; `tests/test_compat.py` calls every one against the
installed packages, so an upstream rename fails there, loudly, with the package version,
instead of deep inside a lesson.

Nothing here patches a third-party package.
"""
from __future__ import annotations

from importlib import metadata
from typing import Any

__all__ = ["UpstreamChanged", "llama_model_ptr", "llama_vocab_ptr", "llama_context_ptr",
           "llama_token_text", "llama_cached_prefix", "ggml_lib", "ollama_http_client"]


class UpstreamChanged(RuntimeError):
    """A private attribute this course relies on is gone: the upstream package changed."""


def _get(obj: Any, path: str, package: str) -> Any:
    cur = obj
    for name in path.split("."):
        try:
            cur = getattr(cur, name)
        except AttributeError:
            try:
                ver = metadata.version(package)
            except metadata.PackageNotFoundError:
                ver = "?"
            raise UpstreamChanged(
                f"{package} {ver} has no `{type(obj).__name__}.{path}` (runtime layer): "
                f"infercourse.compat needs updating for this version") from None
    return cur


def llama_model_ptr(llm: Any) -> Any:
    """The `llama_model *` behind a `llama_cpp.Llama` (for `llama_model_size` and friends)."""
    return _get(llm, "_model.model", "llama_cpp_python")


def llama_vocab_ptr(llm: Any) -> Any:
    """The `llama_vocab *` behind a `llama_cpp.Llama` (for `llama_vocab_is_eog`)."""
    return _get(llm, "_model.vocab", "llama_cpp_python")


def llama_context_ptr(llm: Any) -> Any:
    """The `llama_context *` behind a `llama_cpp.Llama` (perf counters, state size)."""
    return _get(llm, "_ctx.ctx", "llama_cpp_python")


def llama_token_text(llm: Any, token: int) -> str:
    """A token's text as the vocabulary stores it (e.g. "<|im_end|>")."""
    return _get(llm, "_model.token_get_text", "llama_cpp_python")(token)


def llama_cached_prefix(llm: Any, tokens: list[int]) -> int:
    """How many of `tokens` the next `llm.generate(tokens, reset=True)` takes from the KV
    cache instead of evaluating: read from the runtime's own state before the call.

    `Llama` keeps the tokens already in its KV cache (`input_ids[:n_tokens]`); generate()
    keeps their longest common prefix with the new prompt. When that prefix is the whole
    prompt it still re-evaluates the last token to get fresh logits (one token fewer
    reused), unless the cache holds exactly the prompt from a live decode
    (`_requires_eval` false), when nothing is evaluated. Recurrent and hybrid models cannot
    drop part of their memory, so they start over. This mirrors `Llama.generate` in
    llama-cpp-python 0.3.x; tests/test_compat.py checks it against the perf counters.

    Args:
        llm: a `llama_cpp.Llama`.
        tokens: the prompt about to be generated from.
    """
    import llama_cpp
    import numpy as np
    n = int(_get(llm, "n_tokens", "llama_cpp_python"))
    if n == 0:
        return 0
    m = min(n, len(tokens))
    differ = np.nonzero(np.asarray(_get(llm, "input_ids", "llama_cpp_python")[:m]) != np.asarray(tokens[:m]))[0]
    common = int(differ[0]) if len(differ) else m
    whole = common == len(tokens)
    if whole and n == len(tokens) and not _get(llm, "_requires_eval", "llama_cpp_python"):
        return len(tokens)
    model = llama_model_ptr(llm)
    if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
        return 0
    return max(0, common - 1 if whole else common)


def ggml_lib() -> Any:
    """ggml's C library as llama-cpp-python loaded it (`llama_cpp._ggml.libggml`, a private
    module), with the three functions an eval callback needs to read a tensor typed: its
    name, its data pointer and its element count (`measure.batch_steps` observes the MoE
    router's picks this way)."""
    import ctypes
    import importlib
    try:
        mod = importlib.import_module("llama_cpp._ggml")
    except ImportError:
        raise UpstreamChanged("llama_cpp_python has no `llama_cpp._ggml` (runtime layer): "
                              "infercourse.compat needs updating for this version") from None
    g = _get(mod, "libggml", "llama_cpp_python")
    for fn, res in (("ggml_get_name", ctypes.c_char_p), ("ggml_get_data", ctypes.c_void_p),
                    ("ggml_nelements", ctypes.c_int64)):
        f = _get(g, fn, "llama_cpp_python")
        f.restype, f.argtypes = res, [ctypes.c_void_p]
    return g


def ollama_http_client(client: Any) -> Any:
    """The httpx client inside an `ollama.Client`, already pointed at its host."""
    return _get(client, "_client", "ollama")
