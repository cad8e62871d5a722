"""Every use of a third-party package's private parts, in one place.

llama-cpp-python's `Llama` exposes no public handle to the llama.cpp model, vocabulary or
context that its own C API functions take (`llama_model_size`, `llama_vocab_is_eog`,
`llama_perf_context`, `llama_state_get_size`), and the `ollama` client exposes no public
HTTP client for the endpoints it does not wrap (`/api/version`). Each accessor below is the
only place such an attribute is read; `tests/test_compat.py` calls every one against the
installed packages, so an upstream rename fails there, loudly, with the package version,
instead of deep inside a lesson.

Nothing here patches a third-party package.
"""
from __future__ import annotations

from importlib import metadata
from typing import Any

__all__ = ["UpstreamChanged", "llama_model_ptr", "llama_vocab_ptr", "llama_context_ptr",
           "llama_token_text", "ollama_http_client"]


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


def ollama_http_client(client: Any) -> Any:
    """The httpx client inside an `ollama.Client`, already pointed at its host."""
    return _get(client, "_client", "ollama")
