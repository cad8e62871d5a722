"""The agent lab's options: what the recorder changes in a call before the server sees it.

A lab run records what the agent sends; an option changes it, and says so on the call it
changed (a tag the calls table shows), so no table passes a changed call off as the agent's.
Three options, each a task's field (`ops.agent_lab.Task`):

    force_first_tool   the task's first call that offers a tool asks for it alone: a tool-call
                       round trip with a model that calls no tool on its own   (tag `forced`)
    answer_stop        stop sequences added to every call: answers end on their own, where a
                       small model under a long agent prompt rarely writes its end-of-turn
                       token before the agent's answer cap, which the agent treats as an
                       API error (Claude Code: "exceeded the N output token maximum")
                                                                                (tag `answer_stop`)
    greedy             temperature 0 on every call: the same prompt gets the same answer each
                       run, where the agent sends no temperature and the server's default
                       sampling makes an answer's length vary (measured 2026-12-05: 1 of 5
                       sampled answers to 20's captured clip request ended before the room did;
                       at temperature 0 it ran to the room)                      (tag `greedy`)

Each option is a rewrite `(body, tags) -> body` the recorder (`ops.agent_capture`) applies to
generating calls only (`tags` name the task, the agent and the API the call's path speaks);
`lab_rewrite` composes a task's options. Hand-written: they edit the agent's JSON body field by
field, which no proxy library does for these APIs' fields.
"""
from __future__ import annotations

import json
from typing import Any, Callable

__all__ = ["first_tool_forcer", "answer_stopper", "greedy_sampler", "lab_rewrite", "Rewrite", "OPTION_TAGS"]

Rewrite = Callable[[bytes, dict[str, Any]], bytes]
STOP_FIELD = {"anthropic": "stop_sequences", "openai-chat": "stop"}   # per API (ops.agent_stream.api_of)
OPTION_TAGS = ("forced", "answer_stop", "greedy")   # the tags the options put on a call: the calls tables' columns


def _json_object(body: bytes) -> dict[str, Any] | None:
    """The call's body as a JSON object, or None (not JSON, or not an object): every option
    passes such a body on unchanged."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def first_tool_forcer(name: str) -> Rewrite:
    """The recorder's rewrite for `Task.force_first_tool`: the first request of each task that
    offers the tool `name` is sent with that tool alone and `tool_choice` {"type": "any"}
    (Anthropic tools: `input_schema`) or "required" (OpenAI's), the course's tools template's
    call opening prefilled as the answer's start and its closing tag as a stop (this build's
    grammar lets a small model write text before a call, and call again and again: notebook
    19), greedy (temperature 0: the agent's own sampling let the model's arguments run on past the
    answer cap now and then), and tagged `forced`; every other body passes unchanged."""
    from infercourse.measure.tool_calls import CALL_CLOSE, CALL_OPEN
    done: set[Any] = set()

    def rewrite(body: bytes, tags: dict[str, Any]) -> bytes:
        doc = _json_object(body)
        if doc is None or tags.get("task") in done:
            return body
        tools = [t for t in (doc.get("tools") or []) if isinstance(t, dict)
                 and (t.get("name") or (t.get("function") or {}).get("name")) == name]
        if not tools:
            return body
        done.add(tags.get("task"))
        anthropic = "input_schema" in tools[0]
        choice = {"type": "any"} if anthropic else "required"
        tags["forced"] = f"{name} alone, tool_choice {choice}, call opening prefilled, greedy"
        messages = [*doc.get("messages", []), {"role": "assistant", "content": CALL_OPEN}]
        stop = {"stop_sequences" if anthropic else "stop": [CALL_CLOSE]}
        return json.dumps({**doc, "tools": tools, "tool_choice": choice, "messages": messages, **stop,
                           "temperature": 0}).encode()
    return rewrite


def answer_stopper(stops: list[str]) -> Rewrite:
    """The recorder's rewrite for `Task.answer_stop`: `stops` added to each call's own stop
    sequences (Anthropic's `stop_sequences`, chat completions' `stop`: the API the recorder read
    from the call's path, `tags["api"]`), so the server ends an answer at the first of them with
    stop reason `end_turn` / `stop`, not at the agent's cap. Tagged `answer_stop` (the sequences
    added). Unchanged: a call the lab forced (its stop is the call's closing tag), a Responses API
    call (the API has no stop parameter), a body that is not a JSON object."""
    def rewrite(body: bytes, tags: dict[str, Any]) -> bytes:
        key = STOP_FIELD.get(tags.get("api"))
        if key is None or tags.get("forced"):
            return body
        doc = _json_object(body)
        if doc is None:
            return body
        own = doc.get(key) or []
        own = [own] if isinstance(own, str) else list(own)
        added = [s for s in stops if s not in own]
        if not added:
            return body
        tags["answer_stop"] = json.dumps(added)
        return json.dumps({**doc, key: own + added}).encode()
    return rewrite


def greedy_sampler() -> Rewrite:
    """The recorder's rewrite for `Task.greedy`: `temperature` 0 on every call (all three APIs
    name it so), tagged `greedy` with the temperature the agent had sent ("default": none, so
    the server's own sampling). Unchanged: a body that is not a JSON object, one already at 0."""
    def rewrite(body: bytes, tags: dict[str, Any]) -> bytes:
        doc = _json_object(body)
        if doc is None or doc.get("temperature") == 0:
            return body
        tags["greedy"] = f"temperature 0 (sent: {doc.get('temperature', 'default')})"
        return json.dumps({**doc, "temperature": 0}).encode()
    return rewrite


def lab_rewrite(force_first_tool: str | None, answer_stop: list[str] | None, greedy: bool = False) -> Rewrite | None:
    """A task's options as one rewrite (None: the task has none): the forcer first, so the
    stopper leaves the call it forced alone (the forced call is greedy already)."""
    steps = [*([first_tool_forcer(force_first_tool)] if force_first_tool else []),
             *([answer_stopper(answer_stop)] if answer_stop else []),
             *([greedy_sampler()] if greedy else [])]
    if not steps:
        return None

    def rewrite(body: bytes, tags: dict[str, Any]) -> bytes:
        for step in steps:
            body = step(body, tags)
        return body
    return rewrite
