"""The Anthropic Messages route: parser, engine, workload, doctor checks.

Fast tests read scripted streams in the forms llama-server, vLLM and Ollama document
(their source: llama.cpp tools/server/server-task.cpp `to_json_anthropic*`, vLLM
vllm/entrypoints/anthropic/serving.py, Ollama anthropic/anthropic.go) and check our
shapes with the official `anthropic` SDK's types. Slow tests run a real llama-server.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from infercourse.core.errors import APILayerError, BackendMissingError, ContextLayerError
from infercourse.core.types import Request
from infercourse.engines import make_engine
from infercourse.engines.anthropic_http import AnthropicHTTPEngine, to_anthropic_messages
from infercourse.measure.agent_workload import APIS, coding_agent_session, static_block, tool_schemas
from infercourse.measure.workloads import DATA_DIR
from infercourse.ops.anthropic_probe import EXPECTED_EVENTS, grade_messages

TOOL = {"name": "read_file", "description": "Read a file.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


def _ev(kind, **data):
    return kind, {"type": kind, **data}


def _text(i, s):
    return _ev("content_block_delta", index=i, delta={"type": "text_delta", "text": s})


def _json(i, s):
    return _ev("content_block_delta", index=i, delta={"type": "input_json_delta", "partial_json": s})


# llama-server: usage in message_start (input = prompt - cached), only output in message_delta
LLAMA = [
    _ev("message_start", message={"id": "m1", "type": "message", "role": "assistant", "content": [],
                                  "model": "smol", "stop_reason": None, "stop_sequence": None,
                                  "usage": {"cache_read_input_tokens": 90, "input_tokens": 10, "output_tokens": 0}}),
    _ev("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    _text(0, "I'll read it."), _text(0, " Now."),
    _ev("content_block_start", index=1, content_block={"type": "tool_use", "id": "t1", "name": "read_file",
                                                       "input": {}}),
    _json(1, '{"path":'), _json(1, ' "a.py"}'),
    _ev("content_block_stop", index=0), _ev("content_block_stop", index=1),
    _ev("message_delta", delta={"stop_reason": "tool_use", "stop_sequence": None}, usage={"output_tokens": 5}),
    _ev("message_stop"),
]
# vLLM: message_start carries the whole prompt as input_tokens, message_delta repeats usage;
# no cache fields
VLLM = [
    _ev("message_start", message={"id": "chatcmpl-1", "type": "message", "role": "assistant", "content": [],
                                  "model": "m", "stop_reason": None, "stop_sequence": None,
                                  "usage": {"input_tokens": 100, "output_tokens": 0}}),
    _ev("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    _text(0, "Hello"), _text(0, " there"),
    _ev("content_block_stop", index=0),
    _ev("message_delta", delta={"stop_reason": "end_turn"}, usage={"input_tokens": 100, "output_tokens": 2}),
    _ev("message_stop"),
]
# Ollama: a ping, zero usage at the start, the counts in message_delta; input in one piece
OLLAMA = [
    _ev("message_start", message={"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                                  "model": "qwen3-coder", "usage": {"input_tokens": 0, "output_tokens": 0}}),
    _ev("ping"),
    _ev("content_block_start", index=0, content_block={"type": "tool_use", "id": "call_1", "name": "read_file",
                                                       "input": {}}),
    _json(0, '{"path":"b.py"}'),
    _ev("content_block_stop", index=0),
    _ev("message_delta", delta={"stop_reason": "tool_use"}, usage={"input_tokens": 57, "output_tokens": 9}),
    _ev("message_stop"),
]
AS_TEXT = [LLAMA[0], LLAMA[1], _text(0, '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}'),
           _text(0, "\n</tool_call>"), _ev("content_block_stop", index=0),
           _ev("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 3}), _ev("message_stop")]
# extended thinking (the Anthropic API's shape; llama-server sends the same blocks with an
# empty signature): a thinking block, its signature, then the answer
THINKING = [
    LLAMA[0],
    _ev("content_block_start", index=0, content_block={"type": "thinking", "thinking": "", "signature": ""}),
    _ev("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "The user"}),
    _ev("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": " wants hi."}),
    _ev("content_block_delta", index=0, delta={"type": "signature_delta", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA"}),
    _ev("content_block_stop", index=0),
    _ev("content_block_start", index=1, content_block={"type": "text", "text": ""}),
    _text(1, "Hi"), _text(1, "!"),
    _ev("content_block_stop", index=1),
    _ev("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 4}),
    _ev("message_stop"),
]
# a tool call with empty input, sent whole in content_block_start: no input_json_delta at all
EMPTY_CALL = [
    LLAMA[0],
    _ev("content_block_start", index=0, content_block={"type": "tool_use", "id": "t9", "name": "list_files",
                                                       "input": {}}),
    _ev("content_block_stop", index=0),
    _ev("message_delta", delta={"stop_reason": "tool_use"}, usage={"output_tokens": 1}),
    _ev("message_stop"),
]


def _sse(events, stop=True) -> bytes:
    return "".join(f"event: {k}\ndata: {json.dumps(d)}\n\n" for k, d in events
                   if stop or k != "message_stop").encode()


class _StandIn(BaseHTTPRequestHandler):
    """Scripted replies; the first path segment picks the script (as in test_openai_http)."""

    protocol_version = "HTTP/1.1"
    bodies: list[dict] = []
    scripts = {"llama": LLAMA, "vllm": VLLM, "ollama": OLLAMA, "astext": AS_TEXT, "thinking": THINKING}

    def log_message(self, *a):
        pass

    def _send(self, status, body: bytes, ctype="text/event-stream"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, json.dumps({"data": [{"id": "stand-in"}]}).encode(), "application/json")

    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(n))
        _StandIn.bodies.append({"path": self.path, "headers": dict(self.headers), "body": body})
        mode = self.path.split("/")[1]
        if self.path.endswith("/count_tokens"):
            self._send(200, b'{"input_tokens": 42}', "application/json")
        elif mode in self.scripts:
            self._send(200, _sse(self.scripts[mode]))
        elif mode == "nomessages":        # mlx_lm.server: no such route
            self._send(404, b'{"detail": "Not Found"}', "application/json")
        elif mode == "ctx":               # llama-server's overflow reply, Anthropic-wrapped
            self._send(400, json.dumps({"type": "error", "error": {"type": "exceed_context_size_error",
                       "message": "request (9000 tokens) exceeds the available context size (8192 tokens)"}}
                       ).encode(), "application/json")
        elif mode == "toolong":           # the Anthropic API's own overflow reply
            self._send(400, json.dumps({"type": "error", "error": {"type": "invalid_request_error",
                       "message": "prompt is too long: 208310 tokens > 200000 maximum"}}).encode(),
                       "application/json")
        elif mode == "nojinja":           # llama-server started with --no-jinja, asked for tools
            self._send(500, json.dumps({"error": {"code": 500, "type": "server_error",
                       "message": "tools param requires --jinja flag"}}).encode(), "application/json")
        elif mode == "badschema":         # an API error that names a tool but refuses nothing
            self._send(400, json.dumps({"type": "error", "error": {"type": "invalid_request_error",
                       "message": "tools.0.custom.input_schema: Field required"}}).encode(), "application/json")
        elif mode == "bareerror":         # an error event with no `event:` line, after two deltas
            self._send(200, _sse(LLAMA[:4], stop=False) + b'data: {"type": "error", "error": '
                       b'{"type": "overloaded_error", "message": "Overloaded"}}\n\n')
        elif mode == "miderror":
            self._send(200, _sse(LLAMA[:3], stop=False) + b'event: error\ndata: {"type": "error", "error": '
                       b'{"type": "api_error", "message": "slot crashed"}}\n\n')
        elif mode == "nostop":
            self._send(200, _sse(LLAMA, stop=False))


@pytest.fixture(scope="module")
def standin():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def _run(url, **kw):
    eng = AnthropicHTTPEngine(url, model="m", **kw)
    return list(eng.stream(Request(messages=[{"role": "user", "content": "hi"}], tools=[TOOL], max_tokens=8)))


def test_llama_server_stream_usage_and_tool_use(standin):
    events = _run(standin + "/llama")
    final, chunks = events[-1], events[:-1]
    assert "".join(e.text for e in chunks) == "I'll read it. Now."
    # the tool's name (content_block_start) and its input pieces count as tokens, as on the OpenAI API
    assert [e.n_tokens for e in chunks] == [1, 1, 1, 1, 1]
    assert all(a.t <= b.t for a, b in zip(events, events[1:]))
    u = final.usage
    assert (u.prompt_tokens, u.cached_tokens, u.completion_tokens, u.source) == (100, 90, 5, "server")
    assert final.finish_reason == "tool_calls" and final.timings["stop_reason"] == "tool_use"
    assert final.timings["tool_calls"] == [{"id": "t1", "name": "read_file", "input": {"path": "a.py"},
                                            "arguments": '{"path": "a.py"}', "error": None}]
    assert final.timings["event_types"] == list(EXPECTED_EVENTS)


def test_vllm_shape_whole_prompt_no_cache_fields(standin):
    final = _run(standin + "/vllm")[-1]
    assert (final.usage.prompt_tokens, final.usage.cached_tokens) == (100, None)
    assert final.finish_reason == "stop" and final.usage.source == "server"


def test_ollama_shape_usage_in_message_delta(standin):
    final = _run(standin + "/ollama")[-1]
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (57, 9)
    # one input piece for 9 tokens: chunks are not tokens, and the parser says so
    assert final.usage.source == "server, chunks not tokens"
    assert final.timings["tool_calls"][0]["input"] == {"path": "b.py"}
    assert "ping" in final.timings["event_types"]


def test_tool_call_written_as_text_is_flagged(standin):
    final = _run(standin + "/astext")[-1]
    assert final.timings["tool_calls"] == []
    assert final.timings["tool_call_as_text"] == "<tool_call>"


@pytest.mark.parametrize("mode, err, match", [
    ("nomessages", APILayerError, "no Anthropic Messages API"),
    ("ctx", ContextLayerError, "exceeds the available context"),
    ("toolong", ContextLayerError, "prompt is too long"),
    ("miderror", APILayerError, "slot crashed"),
    ("bareerror", APILayerError, "Overloaded"),
    ("nostop", APILayerError, "without message_stop"),
])
def test_failures_name_their_layer(standin, mode, err, match):
    with pytest.raises(err, match=match) as info:
        _run(standin + "/" + mode)
    if mode == "miderror":
        assert [e.text for e in info.value.partial] == ["I'll read it."]   # what arrived is kept
    if mode == "bareerror":
        assert [e.text for e in info.value.partial] == ["I'll read it.", " Now."]
    if mode == "nomessages":
        assert "proxy" in info.value.hint


def _feed(script, names=(), t0=1.0):
    """Feed a script to the parser (tools `names` offered), event i at time t0 + i;
    (events out, final event)."""
    from infercourse.engines.anthropic_stream import Parser
    p = Parser("stand-in", list(names))
    out = [ev for i, (k, d) in enumerate(script) if (ev := p.feed(k, json.dumps(d), t0 + i)) is not None]
    return out, p.final(t0 + len(script))


def test_thinking_is_tokens_not_answer_text():
    """Thinking deltas are tokens the model generated (they count for TTFT and the token
    check) but not the answer a user reads; the signature is the API's, not a token."""
    events, final = _feed(THINKING)
    assert "".join(e.text for e in events) == "Hi!"
    assert [(e.t, e.text, e.n_tokens) for e in events] == [(3.0, "", 1), (4.0, "", 1), (8.0, "Hi", 1),
                                                           (9.0, "!", 1)]
    assert final.usage.source == "server" and final.finish_reason == "stop"
    assert final.timings["tool_calls"] == [] and final.timings["tool_call_as_text"] is None


def _openai_feed(chunks, names=(), t0=1.0):
    from infercourse.engines.openai_stream import Parser
    p = Parser("chat", "stand-in", list(names))
    out = [ev for i, c in enumerate(chunks) if (ev := p.feed(c if isinstance(c, str) else json.dumps(c), t0 + i))]
    return out, p.final(t0 + len(chunks))


def _oa_call(**piece):
    return {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **piece}]}, "finish_reason": None}]}


# the same call on llama-server's OpenAI API: a role chunk, the name, the arguments in pieces
OA_CALL = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}]},
           _oa_call(id="t1", type="function", function={"name": "read_file", "arguments": ""}),
           _oa_call(function={"arguments": '{"path":'}), _oa_call(function={"arguments": ' "a.py"}'}),
           {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}, "[DONE]"]
AN_CALL = [LLAMA[0], LLAMA[4], LLAMA[5], LLAMA[6], _ev("content_block_stop", index=1),
           _ev("message_delta", delta={"stop_reason": "tool_use"}), _ev("message_stop")]


@pytest.mark.parametrize("empty", [False, True])
def test_tool_call_ttft_is_the_name_on_both_apis(empty):
    """On both APIs the first token of a tool call is the chunk that names the tool (time
    2.0 in both scripts), with or without input after it."""
    from infercourse.core.metrics import ttft_s
    from infercourse.core.trace import trace_from_events
    oa = OA_CALL[:2] + OA_CALL[4:] if empty else OA_CALL
    an = AN_CALL[:2] + AN_CALL[4:] if empty else AN_CALL
    got = {}
    fed = {"openai": _openai_feed(oa, ["read_file"]), "anthropic": _feed(an, ["read_file"])}
    for api, (events, final) in fed.items():
        call = final.timings["tool_calls"][0]
        assert (call["name"], call["input"], call["error"]) == ("read_file", {} if empty else {"path": "a.py"}, None)
        got[api] = ttft_s(trace_from_events(events + [final], request_id=0, scheduled_t=0.0, sent_t=0.0))
    assert got == {"openai": 2.0, "anthropic": 2.0}


def test_empty_input_call_sent_whole_has_a_first_token():
    events, final = _feed(EMPTY_CALL, ["read_file"])
    assert [(e.t, e.n_tokens) for e in events] == [(2.0, 1)]          # the name, at content_block_start
    assert final.timings["tool_calls"] == [{"id": "t9", "name": "list_files", "input": {}, "arguments": "",
                                            "error": None}]
    assert final.usage.source == "server"                              # one token event, one output token


def test_input_sent_whole_in_content_block_start_is_kept():
    """Some servers put the whole input in content_block_start and send no delta: it must
    survive content_block_stop (it used to become {})."""
    script = [LLAMA[0], _ev("content_block_start", index=0, content_block={
        "type": "tool_use", "id": "t2", "name": "read_file", "input": {"path": "c.py"}}),
        _ev("content_block_stop", index=0), _ev("message_delta", delta={"stop_reason": "tool_use"}),
        _ev("message_stop")]
    _, final = _feed(script, ["read_file"])
    call = final.timings["tool_calls"][0]
    assert call["input"] == {"path": "c.py"} and call["error"] is None
    assert json.loads(call["arguments"]) == {"path": "c.py"}
    # deltas, when sent, win over the placeholder {} of content_block_start
    assert _feed(AN_CALL, ["read_file"])[1].timings["tool_calls"][0]["input"] == {"path": "a.py"}


def test_context_window_stop_reason_means_length():
    script = VLLM[:-2] + [_ev("message_delta", delta={"stop_reason": "model_context_window_exceeded"},
                              usage={"output_tokens": 2}), _ev("message_stop")]
    _, final = _feed(script)
    assert final.finish_reason == "length"
    assert final.timings["stop_reason"] == "model_context_window_exceeded"


def test_json_answer_is_a_text_call_only_when_tools_were_offered():
    script = VLLM[:3] + [_text(0, '{"name": "read_file", "path": "a.py"}')] + VLLM[4:]
    assert _feed(script)[1].timings["tool_call_as_text"] is None          # no tools: just an answer
    assert _feed(script, ["read_file"])[1].timings["tool_call_as_text"] == '{"name":'


def test_request_headers_body_and_count_tokens(standin):
    eng = make_engine("anthropic", base_url=standin + "/llama", api_key="sk-test")
    assert eng.count_tokens("hello") == 42
    list(eng.stream(Request(messages=[{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "hi"}], max_tokens=5)))
    sent = _StandIn.bodies[-1]
    assert sent["path"] == "/llama/v1/messages"
    assert sent["headers"]["anthropic-version"] == "2023-06-01" and sent["headers"]["x-api-key"] == "sk-test"
    assert sent["body"]["system"] == "be brief" and sent["body"]["messages"] == [{"role": "user", "content": "hi"}]
    assert sent["body"]["stream"] is True and sent["body"]["model"] == "stand-in"


def test_openai_shaped_turns_convert_to_blocks():
    system, msgs = to_anthropic_messages([
        {"role": "system", "content": "S"}, {"role": "user", "content": "task"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": '{"pattern":"x"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py:1: x"}])
    assert system == "S"
    assert msgs[1]["content"][1] == {"type": "tool_use", "id": "c1", "name": "grep", "input": {"pattern": "x"}}
    assert msgs[2] == {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                                    "content": "a.py:1: x"}]}


# -- the workload -----------------------------------------------------------------------------
def test_one_session_two_shapes_same_text():
    a, o = (coding_agent_session(api=api, n_calls=4) for api in APIS)
    assert len(a.requests) == len(o.requests) == 4 and a.offsets_s == o.offsets_s
    sys_a = "".join(b["text"] for b in a.requests[3].messages[0]["content"])
    assert sys_a == o.requests[3].messages[0]["content"]           # llama-server joins blocks as is
    assert len(a.requests[3].tools) == len(o.requests[3].tools) == 15
    blocks = [b["type"] for m in a.requests[3].messages[2:] for b in m["content"]]
    assert blocks.count("tool_use") == blocks.count("tool_result") == 3
    assert [m["role"] for m in o.requests[3].messages[2:]] == ["assistant", "tool"] * 3


def test_header_variants_and_the_buster():
    first = [r.messages[0]["content"][0]["text"] for r in coding_agent_session(n_calls=3).requests]
    bust = [r.messages[0]["content"][0]["text"] for r in coding_agent_session(n_calls=3, bust=True).requests]
    assert len(set(first)) == 1 and len(set(bust)) == 3
    after = coding_agent_session(n_calls=2, bust=True, header="after").requests[1].messages[0]["content"]
    assert after[0]["text"] == static_block() and "cache_control" in after[0]
    none = coding_agent_session(n_calls=2, header="none").requests[1].messages[0]["content"]
    assert len(none) == 1
    assert coding_agent_session(n_calls=2, salt="s1").sha256 != coding_agent_session(n_calls=2, salt="s2").sha256


def test_profiles_size_the_static_block():
    from infercourse.measure.agent_workload import estimate_tokens
    cpu, gpu = (estimate_tokens(static_block(p) + json.dumps(tool_schemas())) for p in ("cpu", "gpu"))
    # gpu/mac: as big as the real Claude Code's system blocks + tools (measured, data/agent_shapes.json)
    from infercourse.measure.agent_workload import real_agent_static_tokens
    real = real_agent_static_tokens()
    assert cpu < 4000 and real > 5000 and abs(gpu - real) <= 0.05 * real
    assert len(coding_agent_session(profile="gpu").requests) > len(coding_agent_session().requests)


def test_warmup_and_salt_keep_block_structure():
    from infercourse.measure.bench import salted, warmup_request
    req = coding_agent_session(n_calls=3).requests[2]
    warm = warmup_request(req, 0)
    ids = lambda r: [b.get("id") or b.get("tool_use_id") for m in r.messages[1:]  # noqa: E731
                     if isinstance(m["content"], list) for b in m["content"]]
    assert ids(warm) == ids(req) and warm.messages[0]["content"][1]["text"] != req.messages[0]["content"][1]["text"]
    assert salted(req, "abc").messages[0]["content"][0] == {"type": "text", "text": "abc\n"}


# -- checked against the official SDK's types --------------------------------------------------
def _sdk_validate(body):
    """Validate a request body with the SDK's own types. Its TypedDicts type lists as
    Iterable, which pydantic checks lazily, so each part is validated on its own."""
    anthropic = pytest.importorskip("anthropic")
    from anthropic.types.message_create_params import MessageCreateParamsStreaming
    from pydantic import TypeAdapter
    t = anthropic.types
    TypeAdapter(MessageCreateParamsStreaming).validate_python(body)
    for block in body["system"] if isinstance(body.get("system"), list) else []:
        TypeAdapter(t.TextBlockParam).validate_python(block)
    for tool in body.get("tools", []):
        TypeAdapter(t.ToolParam).validate_python(tool)
    for m in body["messages"]:
        TypeAdapter(t.MessageParam).validate_python(m)
        for block in m["content"] if isinstance(m["content"], list) else []:
            TypeAdapter(t.ContentBlockParam).validate_python(block)


def test_our_request_is_a_valid_sdk_request():
    eng = AnthropicHTTPEngine("http://127.0.0.1:9", model="local-model")
    body = eng.body(coding_agent_session(n_calls=4).requests[3])
    _sdk_validate(body)
    for bad in ({"role": "robot", "content": "x"}, {"role": "user", "content": [{"type": "tool_use", "id": "x"}]}):
        with pytest.raises(Exception):   # the check does bite: a wrong role, a block missing fields
            _sdk_validate({**body, "messages": [bad]})


@pytest.mark.parametrize("script", [LLAMA, VLLM, OLLAMA, THINKING, EMPTY_CALL])
def test_documented_streams_parse_as_sdk_events(script):
    anthropic = pytest.importorskip("anthropic")
    from pydantic import TypeAdapter
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for kind, data in script:
        if kind != "ping":
            assert adapter.validate_python(data).type == kind


# -- the doctor's grading (pure) ---------------------------------------------------------------
def test_grade_no_route_fails_at_api_with_the_fix():
    api, model = grade_messages({"stream": {"ok": False, "no_route": True, "error": "404"}})
    assert (api.layer, api.status, model) == ("API", "fail", None) and "proxy" in api.next_step


def test_grade_tool_call_as_text_fails_at_model():
    ok_stream = {"ok": True, "event_types": list(EXPECTED_EVENTS), "tool_calls": [],
                 "tool_call_as_text": "<tool_call>"}
    api, model = grade_messages({"stream": ok_stream, "count_tokens": {"ok": True, "input_tokens": 9}})
    assert api.status == "ok" and (model.layer, model.status) == ("model", "fail")
    api, _ = grade_messages({"stream": {**ok_stream, "event_types": ["message_start"]}, "count_tokens": {}})
    assert api.status == "fail" and "message_stop" in api.summary
    good = {**ok_stream, "tool_calls": [{"name": "get_time", "input": {"zone": "UTC"}, "error": None}]}
    api, model = grade_messages({"stream": good, "count_tokens": {"ok": False}})
    assert api.status == "warn" and model.status == "ok"


def test_grade_parsed_call_outranks_an_equal_count():
    """A server whose count_tokens ignores tools, with a call that parsed: the tools reached
    the model, so the model check passes (and says the count leaves them out)."""
    ok_stream = {"ok": True, "event_types": list(EXPECTED_EVENTS),
                 "tool_calls": [{"name": "get_time", "input": {"zone": "UTC"}, "error": None}]}
    _, model = grade_messages({"stream": ok_stream, "count_tokens": {"ok": True, "tools_in_prompt": False}})
    assert model.status == "ok" and "leaves the tools out" in model.summary
    _, model = grade_messages({"stream": {**ok_stream, "tool_calls": []},
                               "count_tokens": {"ok": True, "tools_in_prompt": False}})
    assert model.status == "fail" and "drops the tools" in model.summary   # no call: still the template


def test_probe_sends_no_tool_choice_without_tools(standin):
    """The probe's tool-less count_tokens carries no tool_choice (the API refuses one with no
    tools); and the stand-in, which counts 42 with or without tools, still passes the model
    check because the call parsed."""
    from infercourse.ops.anthropic_probe import probe_messages
    _StandIn.bodies.clear()
    api, model = grade_messages(probe_messages(standin + "/llama"))
    sent = {(b["path"], "tools" in b["body"]): b["body"] for b in _StandIn.bodies}
    assert sent[("/llama/v1/messages", True)]["tool_choice"] == {"type": "any"}
    assert sent[("/llama/v1/messages/count_tokens", True)]["tool_choice"] == {"type": "any"}
    assert "tool_choice" not in sent[("/llama/v1/messages/count_tokens", False)]
    assert (api.status, model.status) == ("ok", "ok") and "read_file" in model.summary


def test_probe_reads_only_real_refusals_as_tools_refused(standin):
    from infercourse.ops.anthropic_probe import probe_messages
    api, model = grade_messages(probe_messages(standin + "/nojinja"))
    assert api.status == "ok" and model.status == "fail" and "--jinja" in model.summary
    # an error that names a tool but refuses nothing is an API failure, as it came
    api, model = grade_messages(probe_messages(standin + "/badschema"))
    assert (api.status, model) == ("fail", None) and "input_schema" in api.summary


# -- against a real llama-server ---------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    from infercourse.servers import LlamaServer
    try:
        # the course's ChatML-with-tools template: SmolLM2's own has no place for tools
        srv = LlamaServer(n_parallel=1, ctx_size=8192, threads=1, jinja=True,
                          extra_args=["--chat-template-file", str(DATA_DIR / "chatml_tools.jinja")])
    except BackendMissingError as exc:
        pytest.skip(f"llama-server not installed: {exc}")
    with srv:
        yield srv


def _evaluated(url) -> float:
    from infercourse.ops.probes import parse_metrics
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)["llamacpp:prompt_tokens_total"]


@pytest.mark.slow
def test_llama_server_streams_every_event_type_and_counts_tokens(llama):
    eng = AnthropicHTTPEngine(llama.url)
    req = Request(messages=[{"role": "system", "content": "You are terse."},
                            {"role": "user", "content": "Name three colours."}], max_tokens=12)
    final = list(eng.stream(req))[-1]
    assert set(EXPECTED_EVENTS) <= set(final.timings["event_types"])
    assert final.usage.source == "server" and final.usage.completion_tokens >= 1
    assert eng.count_tokens(req) == final.usage.prompt_tokens      # two routes to one count


@pytest.mark.slow
def test_llama_server_tool_use_parses(llama):
    """The 135M model does not start a call by itself, so the assistant turn is prefilled
    with the call's opening (in the template's format) and the model completes it: the
    server's parser streams it as tool_use + input_json_delta, and we assemble the input."""
    eng = AnthropicHTTPEngine(llama.url)
    prefill = '<tool_call>\n{"name": "read_file", "arguments": {"path": "'
    final = list(eng.stream(Request(messages=[{"role": "user", "content": "Read a.py"},
                                              {"role": "assistant", "content": prefill}],
                                    tools=[TOOL], max_tokens=12)))[-1]
    calls = final.timings["tool_calls"]
    assert calls and calls[0]["name"] == "read_file" and calls[0]["id"]
    assert calls[0]["arguments"].startswith("{")   # assembled from the input_json_delta pieces
    assert calls[0]["error"] is None and isinstance(calls[0]["input"], dict) and "path" in calls[0]["input"]


@pytest.mark.slow
def test_llama_server_cached_tokens_match_metrics(llama):
    eng = AnthropicHTTPEngine(llama.url)
    assert eng.count_tokens(coding_agent_session().requests[-1]) + 64 <= 8192   # cpu default fits
    # the size knobs keep its shape (header, static block, tools, steps) at a fraction of the prefill
    work = coding_agent_session(n_calls=3, max_tokens=4, n_tools=3, static_chars=1500)
    for req in work.requests:
        before = _evaluated(llama.url)
        final = list(eng.stream(req))[-1]
        evaluated = _evaluated(llama.url) - before
        # an independent count: the tokens the server says it evaluated are the ones not cached
        assert final.usage.prompt_tokens - final.usage.cached_tokens == evaluated
    assert final.usage.cached_tokens > 0.8 * final.usage.prompt_tokens        # later calls reuse the prefix
    busted = coding_agent_session(n_calls=2, max_tokens=4, bust=True, salt="t", n_tools=3,
                                  static_chars=1500).requests[1]
    final = list(eng.stream(busted))[-1]
    assert final.usage.cached_tokens < 30    # a new header at the top: nothing past it is reused


@pytest.mark.slow
def test_official_sdk_accepts_the_stream(llama):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=llama.url, api_key="local", max_retries=0)
    # greedy, so the first token is always the same whole word: a sampled first token that
    # is part of a character loses message_start (next test), and the SDK then fails
    # (extra_body: this SDK version has no temperature argument on stream())
    with client.messages.stream(model="local-model", max_tokens=8, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Say hi."}]) as stream:
        message = stream.get_final_message()
    assert message.type == "message" and message.usage.output_tokens >= 1
    assert message.usage.cache_read_input_tokens is not None


@pytest.mark.slow
def test_a_first_token_that_splits_a_character_loses_message_start(llama):
    """llama-server sends message_start with the partial whose n_decoded == 1
    (server-task.cpp `to_json_anthropic`), but holds back a token that ends in an incomplete
    UTF-8 character (server-context.cpp `process_token`). When the first token is the first
    byte of an emoji, no message_start is ever sent: the official SDK's get_final_message
    fails (a CI run hit it with a sampled "Say hi."), and the prompt's usage is lost.
    Our parser keeps the text and says the prompt size is unknown rather than 0."""
    req = Request(messages=[{"role": "user", "content": "Reply with only one emoji."}], max_tokens=4)
    events = list(AnthropicHTTPEngine(llama.url).stream(req))
    final, said = events[-1], events[-1].timings
    text = "".join(e.text for e in events)
    assert text and not text.isascii()           # the emoji arrived, whole, in a later delta
    assert "message_start" not in said["event_types"], (
        "llama-server now sends message_start before a split first character: drop this test "
        "and the temperature=0 in the one above")
    assert "content_block_delta" in said["event_types"] and "message_stop" in said["event_types"]
    assert final.usage.prompt_tokens is None and final.usage.cached_tokens is None
    assert final.usage.completion_tokens >= 1
    api, _ = grade_messages({"stream": {"ok": True, "event_types": said["event_types"]}, "count_tokens": {}})
    assert api.status == "fail" and "message_start" in api.summary
    from infercourse.ops.anthropic_probe import grade_split_start, probe_split_start
    assert grade_split_start(probe_split_start(llama.url)).status == "warn"     # the doctor's probe sees it too


@pytest.mark.slow
def test_openai_tool_calls_on_the_same_server(llama):
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    eng = OpenAIHTTPEngine(llama.url)
    prefill = '<tool_call>\n{"name": "read_file", "arguments": {"path": "'
    final = list(eng.stream(Request(messages=[{"role": "user", "content": "Read a.py"},
                                              {"role": "assistant", "content": prefill}],
                                    tools=[TOOL], max_tokens=12)))[-1]
    assert final.timings["tool_calls"][0]["name"] == "read_file"
    assert final.timings["tool_calls"][0]["error"] is None


@pytest.mark.slow
def test_doctor_anthropic_route_healthy_then_without_jinja(llama):
    from infercourse.ops.anthropic_probe import probe_messages
    from infercourse.servers import LlamaServer
    ev = probe_messages(llama.url, timeout_s=120)
    api, model = grade_messages(ev)
    assert api.status == "ok" and ev["count_tokens"]["tools_in_prompt"] is True
    # the 135M model answers in prose when asked for a tool: an agent would stall
    assert model.status == "fail" and "without one" in model.summary
    with LlamaServer(n_parallel=1, ctx_size=2048, threads=1, jinja=True) as own:   # SmolLM2's template
        api, model = grade_messages(probe_messages(own.url, timeout_s=120))
    assert api.status == "ok" and "drops the tools" in model.summary
    with LlamaServer(n_parallel=1, ctx_size=2048, threads=1, jinja=False) as plain:
        api, model = grade_messages(probe_messages(plain.url, timeout_s=120))
    assert model.status == "fail" and "refused the tools" in model.summary


@pytest.mark.slow
def test_symptom_checks_name_their_layers(llama):
    """The route's two symptom rows (notebooks 18/21): a busted cache names the KV cache;
    the 135M model asked for a tool answers without one (model layer)."""
    from infercourse.ops.anthropic_probe import cache_buster_check, tool_check
    layer, evidence, got = cache_buster_check(llama.url)
    assert layer == "KV cache", evidence
    assert got["busted"]["cached"] < got["fixed"]["cached"]
    layer, evidence, _ = tool_check(llama.url)
    assert layer == "model", evidence
