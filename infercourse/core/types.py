"""The one interface every engine speaks: a stream of timestamped events.

An engine turns a `Request` into a generator of `Event`s. Each chunk event records when it
arrived (`time.perf_counter()`), its text, and how many tokens it holds; the last event
(`done=True`) carries usage, the finish reason and whatever timings the engine itself
reported (llama.cpp perf counters, Ollama durations, llama-server `timings`...).

Engines never time themselves: the caller notes the send time just before iterating, and
`infercourse.core.metrics` computes TTFT, decode speed and the rest from the events alone.
`generate()` is a fold over `stream()`, so the two can never disagree.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Protocol, runtime_checkable

__all__ = [
    "Request", "Usage", "Event", "Completion", "Engine",
    "as_request", "fold", "generate",
]

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Request:
    """What to generate. The same options mean the same thing on every engine.

    Args:
        prompt: raw text (completion API). Give `prompt` or `messages`, not both.
        messages: chat messages; the engine applies the model's chat template.
        max_tokens: cap on generated tokens.
        temperature: 0.0 means greedy (argmax), the default for reproducible lessons.
        seed: sampling seed, recorded with every result.
        ignore_eos: force exactly `max_tokens` tokens where the engine supports it.
        cache_prompt: allow reuse of cached prefix state (prefix / prompt cache).
        tools: tool schemas the model may call (OpenAI `{"type": "function", ...}` or
            Anthropic `{"name", "input_schema"}`; HTTP engines convert between the two).
    """

    prompt: str | None = None
    messages: Messages | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    cache_prompt: bool = True
    tools: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("Request needs exactly one of prompt= or messages=")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    def sampling(self) -> dict[str, Any]:
        """The sampling conditions, as recorded in result manifests."""
        return {"temperature": self.temperature, "seed": self.seed,
                "max_tokens": self.max_tokens, "ignore_eos": self.ignore_eos,
                "cache_prompt": self.cache_prompt}


def as_request(request: Request | str | Messages, **overrides: Any) -> Request:
    """Accept a Request, a chat-message list, or a plain user message string.

    A plain string becomes one user chat message: small instruct models given a raw
    prompt often stop at once with EOS, so chat is the safe default.
    """
    if isinstance(request, Request):
        return replace(request, **overrides) if overrides else request
    if isinstance(request, str):
        return Request(messages=[{"role": "user", "content": request}], **overrides)
    return Request(messages=list(request), **overrides)


@dataclass(frozen=True)
class Usage:
    """Token counts for one request, and who counted them.

    `source` is "engine" (in-process tokenizer), "server" (HTTP usage block) or
    "client" (counted by infercourse from chunks); `cached_tokens` is None when the
    engine does not report prompt-cache hits, `prompt_tokens` None when a server sends
    no usage at all. Like OpenAI-compatible servers, `completion_tokens` counts the
    end-of-generation token when the model stopped by itself; that token is never shown
    as text, so it rides on the final event (`n_tokens=1`, no text).
    """

    prompt_tokens: int | None
    completion_tokens: int
    cached_tokens: int | None = None
    source: str = "engine"


@dataclass(frozen=True)
class Event:
    """One streamed chunk, or (done=True) the end of the stream."""

    t: float                      # time.perf_counter() when the chunk reached the caller
    text: str = ""
    n_tokens: int = 0             # tokens in this chunk
    done: bool = False
    usage: Usage | None = None
    finish_reason: str | None = None
    timings: dict[str, Any] = field(default_factory=dict)  # the engine's own numbers


@runtime_checkable
class Engine(Protocol):
    """Anything with `stream(request) -> Iterator[Event]` and a `describe()` dict."""

    name: str

    def stream(self, request: Request | str | Messages, **overrides: Any) -> Iterator[Event]: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass
class Completion:
    """A finished request: the folded text plus every event, for metrics."""

    t_start: float
    events: list[Event]
    text: str
    usage: Usage | None
    finish_reason: str | None
    timings: dict[str, Any]

    @property
    def n_tokens(self) -> int:
        return sum(e.n_tokens for e in self.events)


def fold(events: list[Event], t_start: float) -> Completion:
    """Fold recorded events into a Completion (no timing of its own)."""
    last = events[-1] if events and events[-1].done else None
    return Completion(
        t_start=t_start,
        events=events,
        text="".join(e.text for e in events),
        usage=last.usage if last else None,
        finish_reason=last.finish_reason if last else None,
        timings=dict(last.timings) if last else {},
    )


def generate(engine: Engine, request: Request | str | Messages, **overrides: Any) -> Completion:
    """Run one request to the end. A generator does no work until iterated, so the
    send time is taken just before the first `next()`."""
    t_start = time.perf_counter()
    events = list(engine.stream(request, **overrides))
    return fold(events, t_start)
