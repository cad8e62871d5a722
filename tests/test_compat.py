"""Every private attribute the course reads from a third-party package, checked against
the installed version: an upstream rename fails here, by name, not inside a lesson."""

import ctypes

import pytest

from infercourse import compat


def test_missing_attribute_names_package_and_path():
    class Llama:  # what a future llama-cpp-python without `_ctx` would look like
        pass
    with pytest.raises(compat.UpstreamChanged, match=r"llama_cpp_python .* `Llama._ctx.ctx` .*runtime layer"):
        compat.llama_context_ptr(Llama())


@pytest.mark.slow
def test_llama_cpp_private_handles_work_with_the_installed_version():
    llama_cpp = pytest.importorskip("llama_cpp")
    from infercourse.models import embedded_gguf
    llm = llama_cpp.Llama(model_path=str(embedded_gguf()), n_ctx=64, verbose=False)
    try:
        model, vocab, ctx = compat.llama_model_ptr(llm), compat.llama_vocab_ptr(llm), compat.llama_context_ptr(llm)
        # each handle is accepted by the C function the course passes it to, with a real answer
        assert llama_cpp.llama_model_n_params(model) > 100_000_000
        assert llama_cpp.llama_vocab_is_eog(vocab, llm.token_eos())
        assert not llama_cpp.llama_vocab_is_eog(vocab, llm.tokenize(b"hello", add_bos=False)[0])
        before = int(llama_cpp.llama_state_get_size(ctx))
        llm.eval(llm.tokenize(b"The sky is blue because", add_bos=True))
        assert int(llama_cpp.llama_state_get_size(ctx)) > before     # the KV cache grew
        assert llama_cpp.llama_perf_context(ctx).n_p_eval > 0
        assert compat.llama_token_text(llm, llm.token_eos()) == "<|im_end|>"
    finally:
        llm.close()


def test_ollama_client_has_an_httpx_client_at_its_host():
    ollama = pytest.importorskip("ollama")
    import httpx
    client = compat.ollama_http_client(ollama.Client(host="http://127.0.0.1:9"))
    assert isinstance(client, httpx.Client) and str(client.base_url).startswith("http://127.0.0.1:9")


@pytest.mark.slow
def test_llama_cached_prefix_matches_what_generate_evaluates():
    # The accessor predicts, from the runtime's state, how much of a prompt generate()
    # reuses; llama.cpp's perf counters, read at the first token, say how much it really
    # evaluated. The two must add up to the prompt for every kind of match.
    llama_cpp = pytest.importorskip("llama_cpp")
    from infercourse.models import embedded_gguf
    llm = llama_cpp.Llama(model_path=str(embedded_gguf()), n_ctx=256, n_threads=1, verbose=False)
    ctx = compat.llama_context_ptr(llm)
    tok = lambda s: llm.tokenize(s.encode(), add_bos=True)  # noqa: E731
    a = tok("The sky is blue because of Rayleigh scattering of sunlight")
    cases = [("cold", a, 0),
             ("exactly the cache, from a live decode: nothing evaluated", a, len(a)),
             ("extended by one token", a + tok(" in")[-1:], len(a)),
             ("a prefix of the cache: last token replayed for logits", a, len(a) - 1),
             ("diverges early", tok("The sea is green"), None)]
    try:
        llm.reset()
        for name, prompt, expected in cases:
            predicted = compat.llama_cached_prefix(llm, prompt)
            llama_cpp.llama_perf_context_reset(ctx)
            gen = llm.generate(prompt, top_k=1, reset=True)
            next(gen)
            perf = llama_cpp.llama_perf_context(ctx)
            gen.close()
            # counts are reported as max(1, n): a phase with no time spent ran 0 tokens
            evaluated = sum(n if ms > 0 else 0 for n, ms in ((perf.n_p_eval, perf.t_p_eval_ms),
                                                             (perf.n_eval, perf.t_eval_ms)))
            assert predicted + evaluated == len(prompt), name
            if expected is not None:
                assert predicted == expected, name
    finally:
        llm.close()


def test_ggml_lib_reads_a_tensors_name():
    """The ggml library llama-cpp-python loaded, with its tensor readers typed: the MoE lesson
    observes the router through them."""
    from infercourse.compat import ggml_lib
    g = ggml_lib()
    assert all(hasattr(g, f) for f in ("ggml_get_name", "ggml_get_data", "ggml_nelements"))
    assert g.ggml_get_name.restype is ctypes.c_char_p and g.ggml_nelements.restype is ctypes.c_int64
