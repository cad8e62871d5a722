"""The layers lesson's library: the tools table, per-engine first answers, layer overheads."""
import pandas as pd
import pytest

from infercourse.core.errors import APILayerError
from infercourse.lessons.stack import (
    LAYERS,
    TOOLS,
    engine_factories,
    explain_layers,
    first_answers,
    layer_overheads,
    tools_frame,
)


def test_tools_frame_marks_layers_and_usability():
    status = {"llamacpp": {"usable": True, "why": "ok"}, "ollama": {"usable": False, "why": "no server"}}
    t = tools_frame(status)
    assert t.loc["llama.cpp (in process)", "here"] == "yes"
    assert t.loc["Ollama", "here"] == "no" and t.loc["Ollama", "why / what"] == "no server"
    assert t.loc["SGLang", "here"] == "no"
    for tool, info in TOOLS.items():
        assert [l for l in LAYERS if t.loc[tool, l] == "✓"] == [l for l in LAYERS if l in info["layers"]]


def _layers(runtime_ttfts, served_ttfts):
    rows = [{"layer": "runtime", "ttft_s": t, "decode_tok_per_s": 40.0, "e2e_s": 1.0} for t in runtime_ttfts]
    rows += [{"layer": "server", "ttft_s": t, "decode_tok_per_s": 39.0, "e2e_s": 1.1} for t in served_ttfts]
    return pd.DataFrame(rows)


def test_layer_overhead_beyond_noise_is_reported_as_a_cost():
    df = _layers([0.500, 0.502, 0.501], [0.530, 0.531, 0.529])
    assert layer_overheads(df).loc["server", "ttft_added_ms"] == pytest.approx(29.0)  # medians 501 vs 530 ms
    assert "adds **29.0 ms**" in explain_layers(df)


def test_layer_overhead_within_noise_is_called_noise():
    df = _layers([0.48, 0.52, 0.56], [0.49, 0.50, 0.51])   # server median lower, spread 80 ms
    text = explain_layers(df)
    assert "noise" in text and "-20.0 ms" in text


def test_explain_layers_says_which_part_of_ttft_was_larger_and_where_the_floor_sits():
    small = explain_layers(_layers([0.500, 0.502, 0.501], [0.530, 0.531, 0.529]), floor_ms=100.0)
    assert "runtime's own work (501 ms) was the larger part" in small and "**5.0×** the compute floor" in small
    big = explain_layers(_layers([0.010, 0.011, 0.012], [0.100, 0.101, 0.102]), floor_ms=20.0)
    assert "plumbing (90 ms) was not smaller" in big and "below it" in big
    assert "floor" not in explain_layers(_layers([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]))


def test_first_answers_records_why_an_engine_could_not_run():
    def unreachable():
        raise APILayerError("server at 127.0.0.1:9 not reachable")
    df = first_answers({"ghost": unreachable}, "hi")
    assert not df.loc["ghost", "ok"] and "(API layer)" in df.loc["ghost", "why"]


def test_engine_factories_reject_unknown_names():
    with pytest.raises(ValueError, match="unknown engine"):
        engine_factories(["llamacpp", "tensorrt"])


def test_ollama_row_marks_the_llama_cpp_runtime_inside():
    assert {"runtime", "backend"} <= set(TOOLS["Ollama"]["layers"])
    extra = set(TOOLS["Ollama"]["layers"]) - set(TOOLS["llama.cpp (in process)"]["layers"])
    assert extra == {"API", "server", "engine", "model manager"}


def test_weights_read_measures_torch_in_memory_and_counts_tied_weights_once():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from types import SimpleNamespace
    from infercourse.lessons.stack import weights_read
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    unique = {id(p): p for p in model.parameters()}
    nbytes, fmt = weights_read(SimpleNamespace(model=model))
    assert nbytes == 4 * sum(p.numel() for p in unique.values()) and fmt == "torch float32"
    assert weights_read(SimpleNamespace(model=model.to(torch.bfloat16)))[0] == nbytes / 2
    # a served name with no file here: no ceiling rather than a wrong one
    ghost = SimpleNamespace(describe=lambda: {"model": "smollm2:135m"})
    assert weights_read(ghost)[0] is None


def test_explain_first_answers_uses_each_engines_own_ceiling():
    from infercourse.lessons.stack import explain_first_answers
    df = pd.DataFrame([{"engine": "llamacpp", "ok": True, "decode_tok_per_s": 60.0, "weights": "Q4_1",
                        "weight_mb": 100.0, "ceiling_tok_per_s": 100.0, "pct_of_ceiling": 60.0},
                       {"engine": "transformers", "ok": True, "decode_tok_per_s": 10.0, "weights": "torch float32",
                        "weight_mb": 500.0, "ceiling_tok_per_s": 20.0, "pct_of_ceiling": 50.0}]).set_index("engine")
    text = explain_first_answers(df)
    assert "60% of its own 100 tok/s ceiling" in text and "50% of its own 20 tok/s ceiling" in text
    assert "6.0× slower" in text


def test_raw_exchange_shows_the_request_and_every_sse_line():
    from infercourse.lessons.stack import raw_exchange
    from infercourse.testing import SSESource
    with SSESource() as src:
        ex = raw_exchange(src.url, "hi", max_tokens=3)
    assert ex["request"].startswith("POST /v1/chat/completions HTTP/1.1") and '"stream": true' in ex["request"]
    assert ex["status"] == 200 and "text/event-stream" in ex["content_type"]
    data = [l for l in ex["lines"] if l.startswith("data:")]
    assert data[-1].strip() == "data: [DONE]" and len(ex["events"]) == len(data) - 1
    assert sum(1 for t in ex["texts"] if t) == 3


def test_raw_exchange_names_the_api_layer_when_nothing_listens():
    from infercourse.lessons.stack import raw_exchange
    from infercourse.servers.process import free_port
    with pytest.raises(APILayerError):
        raw_exchange(f"http://127.0.0.1:{free_port()}", "hi")


def test_draw_stack_labels_every_layer_and_notebook(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    from infercourse.lessons.stack import STACK, WALK, draw_stack
    ax = draw_stack(tmp_path / "stack.png")
    texts = {t.get_text() for t in ax.texts}
    assert {name for name, _, _ in STACK} <= texts
    assert {nb for _, _, nbs in STACK for nb in nbs} | set(WALK) <= texts
    assert (tmp_path / "stack.png").stat().st_size > 10_000


def test_timed_answer_needs_exactly_one_prompt():
    from infercourse.lessons.stack import timed_answer
    with pytest.raises(ValueError, match="either prompt or n_prompt_tokens"):
        timed_answer()
    with pytest.raises(ValueError, match="either prompt or n_prompt_tokens"):
        timed_answer("hi", n_prompt_tokens=40)


@pytest.mark.slow
def test_timed_answer_forces_the_length_and_counts_the_prompt_it_sent(llamacpp_engine):
    from infercourse.lessons.stack import timed_answer
    r = timed_answer(n_prompt_tokens=40, max_tokens=3, repeats=1)
    assert r["prompt_tokens"] == 40 and r["completion_tokens"] == 3     # exact-length raw prompt, forced answer
    assert 0 < r["ttft_s"] <= r["e2e_s"]
    q, system = "What is a GPU?", "Be brief."
    plain = timed_answer(q, max_tokens=1, repeats=1)
    with_system = timed_answer(q, system=system, max_tokens=1, repeats=1)
    assert with_system["prompt_tokens"] == len(llamacpp_engine.prompt_tokens(
        [{"role": "system", "content": system}, {"role": "user", "content": q}]))
    # SmolLM2's template writes its default system message only when none is sent: a short one replaces it
    assert with_system["prompt_tokens"] < plain["prompt_tokens"]
