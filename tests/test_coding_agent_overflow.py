"""Notebook 19's overflow finder: the first call of a session that no longer fits the
server's window. llama-server refuses a prompt of exactly n_ctx tokens (no room for one
new token), so that call is the first overflow; checked on a stand-in, then against a real
llama-server's own boundary."""
from types import SimpleNamespace

import pytest

from infercourse.core.errors import ContextLayerError
from infercourse.lessons import coding_agent


class _WindowStandIn:
    """A stand-in engine with a `window`-token slot: `count_tokens` reads each request's
    size from its `n` field; `stream` refuses, as llama-server does, any prompt >= window."""

    root = "http://stand-in"

    def __init__(self, window):
        self.window, self.sent = window, []

    def count_tokens(self, req):
        return req.n

    def stream(self, req):
        self.sent.append(req.n)
        if req.n >= self.window:
            raise ContextLayerError(f"request ({req.n} tokens) exceeds the available context size ({self.window})")
        yield from ()


@pytest.mark.parametrize("sizes, call", [([300, 512, 700], 1), ([300, 511, 700], 2), ([100, 200], None)])
def test_a_prompt_that_fills_the_window_is_the_first_overflow(monkeypatch, sizes, call):
    eng = _WindowStandIn(512)
    monkeypatch.setattr(coding_agent, "slot_view", lambda url: {"n_ctx": 512})
    out = coding_agent.first_overflow(eng, SimpleNamespace(requests=[SimpleNamespace(n=n) for n in sizes]))
    assert out["call"] == call, out
    if call is None:
        assert out["error"] == "every call fit" and not eng.sent
    else:   # the call it names is one the server refuses, and the one before is not
        assert out["layer"] == "context" and eng.sent == [sizes[call]]
        assert out["last_fitting_call"] == call - 1 and sizes[call - 1] < 512


@pytest.mark.slow
def test_llama_server_refuses_a_prompt_of_exactly_its_window():
    """The boundary `first_overflow` relies on, read from the server itself: a prompt of
    n_ctx - 1 tokens is answered, one of n_ctx tokens is refused as too long."""
    import httpx

    from infercourse.core.errors import BackendMissingError
    from infercourse.servers import LlamaServer
    try:
        srv = LlamaServer(n_parallel=1, ctx_size=256, threads=1)
    except BackendMissingError as e:
        pytest.skip(f"llama-server not built here: {e}")
    with srv:
        n_ctx = coding_agent.slot_view(srv.url)["n_ctx"]
        tok = httpx.post(srv.url + "/tokenize", json={"content": "hello"}, timeout=30).json()["tokens"][0]

        def send(n):
            return httpx.post(srv.url + "/completion", json={"prompt": [tok] * n, "n_predict": 1,
                                                             "cache_prompt": False}, timeout=120)
        below, at = send(n_ctx - 1), send(n_ctx)
    assert below.status_code == 200, below.text
    assert at.status_code == 400 and "context size" in at.text, at.text
