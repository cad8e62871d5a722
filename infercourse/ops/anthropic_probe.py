"""The Anthropic surface of a server: can a coding agent such as Claude Code talk to it?

`doctor layers URL --api anthropic` adds three checks to the layer walk, each against
what the agent will actually do:
- `POST /v1/messages` answers and **streams the event types** an Anthropic client expects
  (`message_start`, `content_block_start`, `content_block_delta`, `content_block_stop`,
  `message_delta`, `message_stop`). A server without the route (`mlx_lm.server`) fails at
  the **API layer**, and the report says what to put in front of it.
- `POST /v1/messages/count_tokens` exists (agents size their context with it; a missing
  one is a warning, not a failure).
- **the tools reach the model**: `count_tokens` with and without the tool must differ. A
  chat template with no place for tools (the embedded SmolLM2's own) makes llama-server
  drop them silently: the agent's tools never reach the model. A tool call that comes
  back parsed outranks this check: it proves the tools arrived, whatever the server's
  `count_tokens` counts (it may leave the tools out of its count).
- **a tool call parses**: the probe offers one tool and asks for it (`tool_choice: any`);
  it must come back as a `tool_use` block with JSON input. A call that arrives as text,
  a model that answers in prose, or a server that refuses tools (llama-server without
  `--jinja`: "tools param requires --jinja flag"; vLLM without `--enable-auto-tool-choice`;
  an Ollama model "does not support tools") fails at the **model layer**: the model and
  its chat template decide whether tools are rendered, called and parsed. Only those
  refusals are read as such: any other error that happens to mention a tool is an API
  failure, reported as it came.
- **an answer that begins inside a character** (`probe_split_start`, used by `doctor agent`):
  one greedy streamed answer asked to be a single emoji. llama-server sends `message_start`
  with its first emitted token, but holds back a token that ends inside a UTF-8 character;
  when that is the first token, no `message_start` is ever sent. The SDK Claude Code is built
  on fails such a stream, and the pinned Claude Code then sends the same call again with
  `stream: false` (seen in notebook 20's captures): the answer is generated twice. A warning
  at the **API layer**, not a failure: the agent recovers.

Probing talks to the server (`probe_messages`); grading is pure (`grade_messages`), so each
rule is tested on synthetic evidence like the rest of the doctor. `cache_buster_check` and
`tool_check` reproduce the route's two symptoms ("the agent is slow on every call", "tool
calling fails") for the symptom lab and the capstone.
"""
from __future__ import annotations

import re
from typing import Any

from infercourse.core.errors import InferCourseError
from infercourse.core.types import Request
from infercourse.ops.layers import NEXT_STEP, LayerCheck, LayerReport

__all__ = ["EXPECTED_EVENTS", "PROBE_TOOL", "post_messages", "probe_messages", "grade_messages", "with_anthropic",
           "PROXY_HINT", "cache_buster_check", "tool_check", "SPLIT_PROMPT", "probe_split_start", "grade_split_start"]

EXPECTED_EVENTS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                   "message_delta", "message_stop")
PROBE_TOOL = {"name": "get_time", "description": "Return the current UTC time.",
              "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}},
                               "required": ["zone"]}}
PROXY_HINT = ("point the agent at a server that serves /v1/messages (llama-server, vLLM, Ollama), or put "
              "a translating proxy in front of this one (LiteLLM, claude-code-router) that speaks "
              "Anthropic to the agent and OpenAI to the server")
_RANK = {"skip": 0, "ok": 1, "warn": 2, "fail": 3}
# how servers refuse tools: llama-server without --jinja ("tools param requires --jinja flag",
# "tool_choice param requires --jinja flag"), vLLM without auto tool choice ('"auto" tool
# choice requires --enable-auto-tool-choice and --tool-call-parser to be set'), Ollama with
# a model whose template has no tools ("... does not support tools")
_TOOLS_REFUSED = re.compile(r"requires --jinja|--enable-auto-tool-choice|--tool-call-parser|"
                            r"does not support tools", re.I)


def post_messages(url: str, body: dict[str, Any], timeout: float,
                  route: str = "/v1/messages") -> tuple[int, dict[str, Any]]:
    """One non-streamed `POST /v1/messages` (or `route`: /v1/messages/count_tokens) with a
    dummy key (a local server checks none): (HTTP status, the JSON answer, or {"error":
    {"message": the text}} where it is not JSON). The doctors' probes, a captured session's
    replay and its tool results' count send through it."""
    import httpx
    r = httpx.post(url.rstrip("/") + route, json=body, timeout=timeout,
                   headers={"x-api-key": "dummy", "anthropic-version": "2023-06-01"})
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {"error": {"message": r.text[:300]}}


def probe_messages(url: str, *, model: str | None = None, timeout_s: float = 5.0,
                   max_tokens: int = 48) -> dict[str, Any]:
    """Evidence of the Anthropic surface: one streamed tool request, one count_tokens.

    Args:
        url: server root, e.g. "http://127.0.0.1:8080".
        model: model name to send (None: the server's only one, or "local-model").
        timeout_s: seconds each read may wait (a cold prefill included).
        max_tokens: output cap of the probe request.
    """
    from infercourse.engines.anthropic_http import AnthropicHTTPEngine
    engine = AnthropicHTTPEngine(url, model=model, timeout=timeout_s,
                                 extra_body={"tool_choice": {"type": "any"}})
    req = Request(messages=[{"role": "user", "content": "What time is it in UTC? Call the tool."}],
                  tools=[PROBE_TOOL], max_tokens=max_tokens)
    ev: dict[str, Any] = {"url": url}
    try:
        final = list(engine.stream(req))[-1]
        t = final.timings
        ev["stream"] = {"ok": True, "event_types": t.get("event_types"), "stop_reason": t.get("stop_reason"),
                        "usage_fields": t.get("usage_fields"), "tool_calls": t.get("tool_calls"),
                        "tool_call_as_text": t.get("tool_call_as_text")}
    except InferCourseError as e:
        ev["stream"] = {"ok": False, "error": e.message, "error_layer": e.layer,
                        "no_route": "no Anthropic Messages API" in e.message,
                        "tools_refused": bool(_TOOLS_REFUSED.search(e.message))}
    try:
        bare = engine.count_tokens(req.messages)   # no tools: the engine sends no tool_choice
        ev["count_tokens"] = {"ok": True, "input_tokens": bare,
                              "tools_in_prompt": engine.count_tokens(req) > bare}
    except InferCourseError as e:
        ev["count_tokens"] = {"ok": False, "error": e.message}
    finally:
        engine.close()
    return ev


SPLIT_PROMPT = "Reply with only one emoji."   # greedy SmolLM2 begins with an emoji's first byte


def probe_split_start(url: str, model: str | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
    """One greedy streamed answer that should begin with a multi-byte character: the event
    types it came with and its first characters (the text is a model's emoji, not the agent's)."""
    from infercourse.engines.anthropic_http import AnthropicHTTPEngine
    engine = AnthropicHTTPEngine(url, model=model, timeout=timeout_s, extra_body={"temperature": 0})
    try:
        events = list(engine.stream(Request(messages=[{"role": "user", "content": SPLIT_PROMPT}], max_tokens=4)))
    except InferCourseError as e:
        return {"ok": False, "error": e.message}
    finally:
        engine.close()
    return {"ok": True, "event_types": events[-1].timings.get("event_types"),
            "begins": "".join(e.text for e in events)[:8]}


def grade_split_start(ev: dict[str, Any]) -> LayerCheck | None:
    """Pure: `probe_split_start`'s evidence -> the API check, or None where the stream failed
    (the other checks report that). No next step: the layer walk's API hint (the URL, the port)
    is not what a warning here needs; the summary says what does."""
    if not ev.get("ok"):
        return None
    begins, types = ev.get("begins") or "", ev.get("event_types") or []
    if not begins or begins[0].isascii():
        return LayerCheck("API", "skip", f"an answer that begins inside a character was not tried: asked for "
                          f"one emoji, the model began with {begins!r}", {"begins": begins})
    if "message_start" in types:
        return LayerCheck("API", "ok", f"an answer that begins with a multi-byte character ({begins[0]!r}) still "
                          "streams message_start first", {"event_types": types})
    return LayerCheck("API", "warn", f"an answer that begins with a multi-byte character ({begins[0]!r}) streams "
                      "without message_start: llama-server holds back a first token that ends inside a character "
                      "and sends message_start with the first token it emits. Claude Code's client fails such a "
                      "stream and sends the call again unstreamed (the answer generated twice); no server flag "
                      "avoids it", {"event_types": types})


def _c(layer: str, status: str, summary: str, **evidence: Any) -> LayerCheck:
    return LayerCheck(layer, status, summary, {k: v for k, v in evidence.items() if v is not None},
                      NEXT_STEP[layer] if status in ("warn", "fail") else None)


def grade_messages(ev: dict[str, Any]) -> tuple[LayerCheck, LayerCheck | None]:
    """(API check, model check or None) from `probe_messages` evidence: pure."""
    st, ct = ev.get("stream") or {}, ev.get("count_tokens") or {}
    if not st.get("ok"):
        if st.get("no_route"):
            return (LayerCheck("API", "fail", "no Anthropic Messages API: POST /v1/messages is not served, "
                               "so a coding agent (Claude Code) gets 'API Error' on its first call",
                               {"error": st.get("error")}, PROXY_HINT), None)
        if st.get("tools_refused") and st.get("error_layer") == "API":
            err = str(st.get("error"))
            fix = ("llama-server: start it with --jinja, and a chat template that renders tools"
                   if "jinja" in err.lower() else "vLLM: --enable-auto-tool-choice --tool-call-parser; "
                   "Ollama: a model whose template supports tools")
            return (_c("API", "ok", "/v1/messages answers"),
                    _c("model", "fail", f"the server refused the tools: {err[:120]} ({fix})", error=err))
        return _c("API", "fail", f"/v1/messages failed: {str(st.get('error'))[:140]}", error=st.get("error"),
                  error_layer=st.get("error_layer")), None
    missing = [e for e in EXPECTED_EVENTS if e not in (st.get("event_types") or [])]
    if missing:
        return _c("API", "fail", f"/v1/messages streams without {', '.join(missing)}: an Anthropic client "
                  "will not accept it", event_types=st.get("event_types")), None
    note = "" if ct.get("ok") else "; no /v1/messages/count_tokens (agents that size context with it fall back)"
    api = _c("API", "warn" if note else "ok", "/v1/messages streams every Anthropic event type" + note,
             event_types=st.get("event_types"), count_tokens=ct.get("input_tokens"),
             usage_fields=st.get("usage_fields"))
    calls = st.get("tool_calls") or []
    if calls and all(c.get("error") is None for c in calls):
        # a parsed call proves the tools reached the model: an equal count_tokens is the count's quirk
        note = ("" if ct.get("tools_in_prompt") is not False else
                "; count_tokens leaves the tools out of its count, so an agent sizing its context with it "
                "undercounts")
        return api, _c("model", "ok", f"tool call parsed: {calls[0].get('name')}({calls[0].get('input')})"
                       + note, tools_in_prompt=ct.get("tools_in_prompt"))
    if ct.get("tools_in_prompt") is False:
        return api, _c("model", "fail", "the chat template drops the tools: count_tokens is the same with and "
                       "without them, so the model never sees them (give the server a template that renders "
                       "tools: llama-server --chat-template-file)", tools_in_prompt=False)
    if calls:
        return api, _c("model", "fail", f"tool call input is not JSON: {calls[0].get('error')}", calls=calls)
    if st.get("tool_call_as_text"):
        return api, _c("model", "fail", f"the tool call came back as text ({st['tool_call_as_text']!r}), "
                       "not a tool_use block: the server did not parse it (llama-server: --jinja; a chat "
                       "template with tool support)", marker=st["tool_call_as_text"])
    return api, _c("model", "fail", "asked to call a tool, the model answered without one "
                   f"(stop_reason {st.get('stop_reason')!r}): an agent would stall", stop_reason=st.get("stop_reason"))


def with_anthropic(report: LayerReport, url: str, **kw: Any) -> LayerReport:
    """`report` (from `layers.doctor_layers`) with the Anthropic checks merged in: each
    replaces its layer's check when it is worse; the walk still stops at the first failure.

    Args:
        kw: passed to `probe_messages` (model=, timeout_s=).
    """
    api, model = grade_messages(probe_messages(url, **kw))
    checks = list(report.checks)
    for new in (api, model):
        if new is None:
            continue
        i = next(k for k, c in enumerate(checks) if c.layer == new.layer)
        old = checks[i]
        if _RANK[new.status] >= _RANK[old.status] or old.status == "skip":
            checks[i] = new
    first = next((i for i, c in enumerate(checks) if c.status == "fail"), None)
    if first is not None:   # the walk stops at the first failure, as in layers.grade
        checks = checks[:first + 1] + [LayerCheck(c.layer, "skip", f"not reached (stopped at "
                                                  f"{checks[first].layer})", c.evidence)
                                       for c in checks[first + 1:]]
    return LayerReport(report.target, checks, report.seconds)


def cache_buster_check(url: str, *, n_calls: int = 2, **size: Any) -> tuple[str | None, str, dict[str, Any]]:
    """"The agent is slow on every call": the coding-agent session's last call sent twice
    over /v1/messages, after its predecessor, with a fixed header and with the cache
    buster (a new header value every call). (layer or None, evidence, values): "KV cache"
    when the busted call reuses almost nothing of a prompt the fixed one mostly reuses.

    Args:
        n_calls: calls of the session (>= 2: the last one is measured).
        size: `coding_agent_session` sizes (n_tools=, static_chars=, max_tokens=).
    """
    from infercourse.core.metrics import ttft_s
    from infercourse.core.trace import record
    from infercourse.engines.anthropic_http import AnthropicHTTPEngine
    from infercourse.measure.agent_workload import coding_agent_session
    size = {"n_tools": 3, "static_chars": 400, "max_tokens": 4, **size}   # fits a 512-token slot
    eng, got = AnthropicHTTPEngine(url, timeout=600.0), {}
    try:
        for name, bust in (("fixed", False), ("busted", True)):
            reqs = coding_agent_session(n_calls=n_calls, bust=bust, salt=name, **size).requests
            for req in reqs[:-1]:
                record(eng, req)
            tr = record(eng, reqs[-1])
            got[name] = {"prompt": tr.prompt_tokens, "cached": tr.cached_tokens, "ttft_s": ttft_s(tr)}
    finally:
        eng.close()
    f, b = got["fixed"], got["busted"]
    if None in (f["cached"], b["cached"], f["ttft_s"], b["ttft_s"]):
        return None, f"no cached-token count from the server: {got}", got
    busted = b["cached"] < 0.2 * b["prompt"] <= f["cached"]
    evidence = (f"same call, fixed header: {f['cached']}/{f['prompt']} prompt tokens from cache, TTFT "
                f"{1e3 * f['ttft_s']:.0f} ms; a new header value first: {b['cached']}/{b['prompt']}, TTFT "
                f"{1e3 * b['ttft_s']:.0f} ms ({b['ttft_s'] / f['ttft_s']:.1f}x)")
    return ("KV cache" if busted else None), evidence, got


def tool_check(url: str) -> tuple[str | None, str, dict[str, Any]]:
    """"Tool calling fails" over /v1/messages: the doctor's Anthropic checks on `url`.
    (the failing layer or None, evidence, the probe's evidence)."""
    ev = probe_messages(url, timeout_s=600.0, max_tokens=16)
    api, model = grade_messages(ev)
    bad = next((c for c in (api, model) if c is not None and c.status == "fail"), None)
    return (bad.layer if bad else None), (bad or model or api).summary, ev
