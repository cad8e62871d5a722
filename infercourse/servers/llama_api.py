"""llama-server's own endpoints beside the OpenAI API, for looking under a request.

A chat request becomes tokens in two steps the OpenAI API hides: the chat template renders
the messages (and tools) into one prompt string, and the tokenizer cuts that string into the
ids the model reads and the slot caches. llama-server exposes both steps: `POST /apply-template`
(the prompt a chat request would get, nothing generated) and `POST /tokenize` / `/detokenize`.
With them a lesson can say *which token* of a new prompt first differs from what a slot
holds, and what text sits there. `completion` is the raw `/completion` endpoint (a prompt as
text or token ids, the server's `timings` in the answer).
"""
from __future__ import annotations

from typing import Any, Sequence

import httpx

from infercourse.core.errors import ServerLayerError

__all__ = ["post_json", "apply_template", "tokenize", "detokenize", "completion"]


def post_json(url: str, path: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    """POST `body` to `url + path`; the JSON answer, or a server-layer error with the status."""
    r = httpx.post(url.rstrip("/") + path, json=body, timeout=timeout)
    if r.status_code != 200:
        raise ServerLayerError(f"{path} at {url} answered HTTP {r.status_code}: {r.text[:200]}")
    return r.json()


def apply_template(url: str, messages: list, tools: list | None = None, **kwargs: Any) -> str:
    """The prompt string the server's chat template makes of `messages` (and `tools`).

    Args:
        kwargs: more request fields, e.g. `chat_template_kwargs={...}` (variables the
            template reads) or `add_generation_prompt=False`.
    """
    body = {"messages": messages, **({"tools": tools} if tools else {}), **kwargs}
    return post_json(url, "/apply-template", body)["prompt"]


def tokenize(url: str, text: str) -> list[int]:
    """The ids the server makes of `text`, special tokens parsed as a rendered prompt's are."""
    return post_json(url, "/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]


def detokenize(url: str, ids: Sequence[int]) -> str:
    """The text of token ids."""
    return post_json(url, "/detokenize", {"tokens": list(ids)})["content"]


def completion(url: str, prompt: str | Sequence[int], **fields: Any) -> dict[str, Any]:
    """`POST /completion` with a raw prompt (text, or token ids used as given) and any of its
    fields (`n_predict`, `cache_prompt`, `stop`, `return_tokens`...); the server's answer."""
    return post_json(url, "/completion", {"prompt": prompt if isinstance(prompt, str) else list(prompt), **fields})
