"""OllamaEngine against a stand-in for Ollama's native API, then live when one answers.

No Ollama server can be installed on this machine, so most tests talk to a STAND-IN: an
`httpx.MockTransport` handed to the real `ollama` client. It replays streamed NDJSON
shaped exactly as Ollama's API reference documents it (ollama/ollama docs/api.md,
"Generate a completion" and "Generate a chat completion", streaming examples): objects
with `"done": false` and one token of text, then a final `"done": true` object carrying
`total_duration`, `load_duration`, `prompt_eval_count`, `prompt_eval_duration`,
`eval_count`, `eval_duration` (nanoseconds). The same checks run against a real server
when $OLLAMA_HOST answers (model from $OLLAMA_MODEL, else the first one it lists).
"""
from __future__ import annotations

import json
import os
import socket

import httpx
import pytest

from infercourse.core.types import Request, generate
from infercourse.engines.ollama import OLLAMA_TIMING_FIELDS, OllamaEngine, prompt_counts
from infercourse.core.errors import APILayerError, ModelLayerError

# The final object of docs/api.md's streaming chat example, field for field.
DONE_CHAT = {"model": "llama3.2", "created_at": "2023-08-04T19:22:45.499127Z",
             "message": {"role": "assistant", "content": ""}, "done": True,
             "done_reason": "stop", "total_duration": 4883583458, "load_duration": 1334875,
             "prompt_eval_count": 26, "prompt_eval_duration": 342546000, "eval_count": 3,
             "eval_duration": 4535599000}
DONE_GENERATE = {k: v for k, v in DONE_CHAT.items() if k != "message"} | {"response": "",
                                                                          "context": [1, 2, 3]}


def _chat_part(text):
    return {"model": "llama3.2", "created_at": "2023-08-04T08:52:19.385406455-07:00",
            "message": {"role": "assistant", "content": text}, "done": False}


def _gen_part(text):
    return {"model": "llama3.2", "created_at": "2023-08-04T08:52:19.385406455-07:00",
            "response": text, "done": False}


def _ndjson(objs) -> bytes:
    return "".join(json.dumps(o) + "\n" for o in objs).encode()


class StandIn:
    """Scripted replies for the real `ollama` client; records what it was sent."""

    def __init__(self, mode="ok"):
        self.mode, self.sent = mode, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/api/version":
            return httpx.Response(200, json={"version": "0.0.0-stand-in"})
        if path == "/api/show":
            return httpx.Response(200, json={  # docs/api.md "Show Model Information", trimmed
                "modelfile": "FROM /models/smollm2", "parameters": "", "template": "{{ .Prompt }}",
                "details": {"parent_model": "", "format": "gguf", "family": "llama",
                            "families": ["llama"], "parameter_size": "135M",
                            "quantization_level": "Q4_1"},
                "model_info": {"general.architecture": "llama", "llama.context_length": 8192}})
        body = json.loads(request.content)
        self.sent.append((path, body))
        if self.mode == "missing":
            return httpx.Response(404, json={"error": f"model '{body['model']}' not found"})
        part = _chat_part if path == "/api/chat" else _gen_part
        done = DONE_CHAT if path == "/api/chat" else DONE_GENERATE
        parts = [part("The"), part(" sky"), part(" is")]
        if self.mode == "ok":
            return httpx.Response(200, content=_ndjson(parts + [done]))
        if self.mode == "nodone":
            return httpx.Response(200, content=_ndjson(parts))
        if self.mode == "error":  # Ollama reports failures mid-stream as {"error": ...}
            return httpx.Response(200, content=_ndjson(parts[:2] + [{"error": "runner crashed"}]))
        if self.mode == "badjson":
            return httpx.Response(200, content=_ndjson(parts[:1]) + b"{oops\n")
        raise AssertionError(self.mode)


def _engine(mode="ok", **kw):
    standin = StandIn(mode)
    eng = OllamaEngine("llama3.2", host="http://127.0.0.1:11434",
                       transport=httpx.MockTransport(standin), **kw)
    return eng, standin


@pytest.mark.parametrize("api, req", [("chat", "Why is the sky blue?"),
                                      ("generate", Request(prompt="Why is the sky blue?"))])
def test_stream_and_server_timings(api, req):
    eng, standin = _engine(api=api, num_ctx=2048)
    events = list(eng.stream(req, max_tokens=5, seed=3, temperature=0.0))
    chunks, last = events[:-1], events[-1]
    assert [e.text for e in chunks] == ["The", " sky", " is"] and all(e.n_tokens == 1 for e in chunks)
    assert last.done and last.finish_reason == "stop"
    assert {k: last.timings[k] for k in OLLAMA_TIMING_FIELDS} == {k: DONE_CHAT.get(k) for k in OLLAMA_TIMING_FIELDS}
    assert last.usage.source == "server"
    # docs/api.md's shape has no cached count: the prompt's length is unknown (older
    # servers count only evaluated tokens in prompt_eval_count), never guessed
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (None, 3)
    assert last.timings["prompt_eval_count"] == 26 and "unknown" in last.timings["prompt_tokens_from"]
    path, body = standin.sent[-1]
    assert path == f"/api/{api}" and body["stream"] is True
    assert body["options"] == {"num_predict": 5, "temperature": 0.0, "seed": 3, "num_ctx": 2048}
    if api == "generate":
        assert body["raw"] is True and body["prompt"] == "Why is the sky blue?"


# The final object as servers that report cache hits send it (Ollama's OpenAPI spec,
# docs.ollama.com/openapi.yaml: `prompt_eval_cached_count` on ChatResponse and
# GenerateStreamEvent; `prompt_eval_count` then includes the cached tokens), and as older
# servers sent it when the whole prompt was cached: `prompt_eval_count` left out
# (ollama/ollama#2068).
DONE_CACHED = DONE_CHAT | {"prompt_eval_count": 21, "prompt_eval_cached_count": 16}
DONE_ALL_CACHED_OLD = {k: v for k, v in DONE_CHAT.items() if k != "prompt_eval_count"}


@pytest.mark.parametrize("done, prompt, cached", [(DONE_CACHED, 21, 16), (DONE_ALL_CACHED_OLD, None, None),
                                                  (DONE_CHAT | {"prompt_eval_cached_count": 0}, 26, 0)])
def test_prompt_counted_with_its_cached_tokens(done, prompt, cached):
    # §2.8: prompt_eval_count alone excluded cached tokens on older servers and vanished
    # when all were cached; the prompt was reported as 0 tokens
    class Cached(StandIn):
        def __call__(self, request):
            if request.url.path != "/api/chat":
                return super().__call__(request)
            return httpx.Response(200, content=_ndjson([_chat_part("Hi"), done]))
    eng = OllamaEngine("llama3.2", host="http://127.0.0.1:11434", transport=httpx.MockTransport(Cached()))
    c = generate(eng, "hi")
    assert (c.usage.prompt_tokens, c.usage.cached_tokens) == (prompt, cached)
    assert prompt_counts(dict(done)) == (prompt, cached)


def test_generate_folds_the_stream():
    c = generate(_engine()[0], "hi")
    assert c.text == "The sky is" and c.n_tokens == 3 and c.usage.completion_tokens == 3


def test_ignore_eos_is_unsupported_and_says_so():
    eng, _ = _engine()
    with pytest.warns(UserWarning, match="no ignore_eos"):
        c = generate(eng, "hi", ignore_eos=True)
    assert c.timings["ignore_eos"] == "unsupported"


@pytest.mark.parametrize("mode, err, match, n_partial", [
    ("missing", ModelLayerError, "does not have model 'llama3.2'", 0),
    ("nodone", APILayerError, "without a done object", 3),
    ("error", APILayerError, "runner crashed", 2),
    ("badjson", APILayerError, "malformed stream", 1),
])
def test_errors_name_the_layer_and_keep_partial(mode, err, match, n_partial):
    eng, _ = _engine(mode)
    with pytest.raises(err, match=match) as e:
        list(eng.stream("hi"))
    assert len(e.value.partial or []) == n_partial


def test_unreachable_host_names_the_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    eng = OllamaEngine("llama3.2", host=f"127.0.0.1:{port}")
    with pytest.raises(APILayerError, match=f"127.0.0.1:{port} not reachable"):
        list(eng.stream("hi"))


def test_describe_reports_server_and_model():
    info = _engine()[0].describe()
    assert info["server_version"] == "0.0.0-stand-in"
    assert info["model_details"]["quantization_level"] == "Q4_1"


# ---- live, when a real Ollama answers ----------------------------------------------------

@pytest.fixture(scope="module")
def live():
    host = os.environ.get("OLLAMA_HOST")
    if not host:
        pytest.skip("OLLAMA_HOST is not set: no live Ollama server (none can be installed here)")
    try:
        import ollama
        models = [m.model for m in ollama.Client(host=host).list().models]
    except (ConnectionError, httpx.HTTPError) as exc:
        pytest.skip(f"Ollama at {host} does not answer: {exc}")
    model = os.environ.get("OLLAMA_MODEL") or (models[0] if models else None)
    if not model:
        pytest.skip(f"Ollama at {host} has no models pulled")
    return OllamaEngine(model, host=host)


@pytest.mark.slow
def test_live_stream_and_timings(live):
    c = generate(live, "Name three colors.", max_tokens=16)
    assert c.text and c.usage.source == "server"
    assert c.usage.completion_tokens == c.timings["eval_count"] <= 16
    assert c.timings["eval_duration"] > 0 and c.timings["total_duration"] >= c.timings["eval_duration"]
    assert live.describe()["server_version"]


class CreateStandIn:
    """STAND-IN for Ollama's blob and create endpoints (docs/api.md "Push a Blob", "Create a
    Model" with `files`): records each request; `refuse` answers /api/create with HTTP 400."""

    def __init__(self, refuse: bool = False):
        self.refuse, self.sent = refuse, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((request.method, request.url.path, request.read()))
        if request.url.path.startswith("/api/blobs/"):
            return httpx.Response(201)
        if request.url.path == "/api/create":
            if self.refuse:
                return httpx.Response(400, json={"error": "invalid file magic"})
            return httpx.Response(200, json={"status": "success"})
        raise AssertionError(request.url.path)


def test_from_gguf_creates_the_model_from_the_course_file(tmp_path):
    """The request Ollama would get: the file's bytes as a blob under their SHA-256, then a
    create naming that blob, the API form of `FROM /path/to.gguf` (no registry pull)."""
    import hashlib
    gguf = tmp_path / "SmolLM2_135M.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    digest = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
    standin = CreateStandIn()
    eng = OllamaEngine.from_gguf(gguf, host="http://127.0.0.1:11434", transport=httpx.MockTransport(standin))
    (m1, path1, body1), (m2, path2, body2) = standin.sent
    assert (m1, path1, body1) == ("POST", f"/api/blobs/{digest}", gguf.read_bytes())
    assert (m2, path2) == ("POST", "/api/create")
    assert json.loads(body2) == {"model": eng.model, "files": {gguf.name: digest}, "stream": False}
    assert eng.model == f"infercourse-smollm2-135m.q4-1:{digest[7:19]}" and eng.gguf == gguf


def test_from_gguf_refused_names_the_model_layer(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not a gguf")
    with pytest.raises(ModelLayerError, match="could not create a model from .*invalid file magic"):
        OllamaEngine.from_gguf(gguf, host="http://127.0.0.1:11434", transport=httpx.MockTransport(CreateStandIn(True)))
