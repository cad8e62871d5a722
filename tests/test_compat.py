"""Every private attribute the course reads from a third-party package, checked against
the installed version: an upstream rename fails here, by name, not inside a lesson."""

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
