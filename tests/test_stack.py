"""The layers lesson's library: the tools table, per-engine first answers, layer overheads."""
import pandas as pd
import pytest

from infercourse.core.errors import APILayerError
from infercourse.lessons.plumbing import explain_layers, layer_overheads
from infercourse.lessons.stack import LAYERS, TOOLS, engine_factories, explain_first_answers, first_answers, tools_frame


def test_tools_frame_marks_layers_and_usability():
    status = {"llamacpp": {"usable": True, "why": "ok"}, "ollama": {"usable": False, "why": "no server"}}
    t = tools_frame(status)
    assert t.loc["llama.cpp (in process)", "here"] == "yes"
    assert t.loc["Ollama", "here"] == "no" and t.loc["Ollama", "why / what"] == "no server"
    assert t.loc["SGLang", "here"] == "no"
    for tool, info in TOOLS.items():
        assert [l for l in LAYERS if t.loc[tool, l] == "✓"] == [l for l in LAYERS if l in info["layers"]]


def _layers(runtime, again, served, *, decode=(40.0, 40.0, 40.0), prompt_ms=None, shuffle=True):
    """`through_layers`-shaped rows: block i holds runtime[i], its A/A rerun again[i] and the
    server's served[i] (TTFT in s); rows in a shuffled order, as `run_arms` leaves them."""
    import random
    rows = []
    for rep, trio in enumerate(zip(runtime, again, served)):
        for arm, t, d in zip(("runtime", "runtime A/A", "server"), trio, decode):
            rows.append({"arm": arm, "rep": rep, "ttft_s": t, "decode_tok_per_s": d + 0.01 * rep, "e2e_s": 1.0,
                         "prompt_ms": prompt_ms if prompt_ms is not None else 1e3 * t * 0.9})
    if shuffle:
        random.Random(1).shuffle(rows)
    df = pd.DataFrame(rows)
    from infercourse.lessons.plumbing import ARMS
    df["layer"] = df["arm"].map(ARMS)
    return df


RT = [0.500, 0.503, 0.498, 0.501, 0.502, 0.499]
AA = [0.501, 0.500, 0.502, 0.499, 0.503, 0.500]


def test_layer_overheads_put_the_runtime_first_whatever_the_row_order():
    med = layer_overheads(_layers(RT, AA, [t + 0.030 for t in RT]))
    assert list(med.index) == ["runtime (llama.cpp in process)", "runtime again (A/A rerun)",
                               "server + API (llama-server over HTTP)"]
    assert med["ttft_added_ms"].iloc[-1] == pytest.approx(30.0, abs=0.01)


def test_the_server_is_judged_against_the_runtimes_aa_rerun_and_flips():
    """Issue 31: 01 compared the server with the runtime's range, not with an A/A test."""
    import re
    slower = explain_layers(_layers(RT, AA, [t + 0.030 for t in RT]))
    assert re.search(r"TTFT: server ÷ runtime = 1\.06×", slower) and re.search(r"\bruntime faster\b", slower)
    assert "A/A rerun" in slower and not re.search(r"\bserver faster\b", slower)
    quicker = explain_layers(_layers(RT, AA, [t - 0.030 for t in RT]))
    assert re.search(r"\bserver faster\b", quicker) and not re.search(r"\bruntime faster\b", quicker)
    same = explain_layers(_layers(RT, AA, [AA[i] + (0.001 if i % 2 else -0.001) for i in range(6)]))
    assert "within noise" in same and "cannot rank" in same
    few = explain_layers(_layers(RT[:1], AA[:1], [0.6]))
    assert "no test was run" in few and "faster" not in few


def test_decode_speed_gets_its_own_verdict():
    import re
    text = explain_layers(_layers(RT, AA, RT, decode=(40.0, 40.0, 44.0)))
    assert re.search(r"decode tok/s: server ÷ runtime = 1\.10×", text) and re.search(r"\bserver faster\b", text)


def test_explain_layers_says_which_part_of_ttft_was_larger_and_splits_the_floor():
    small = explain_layers(_layers(RT, AA, [t + 0.030 for t in RT], prompt_ms=450.0), floor_ms=100.0)
    assert "runtime's own work (500 ms) was the larger part" in small and "**5.0×** the compute floor" in small
    assert "**450.0 ms** of it in prompt evaluation" in small and "the prompt evaluation itself" in small
    assert "1/4.5 of the float32 matmul speed" in small
    outside = explain_layers(_layers(RT, AA, RT, prompt_ms=100.0), floor_ms=100.0)
    assert "outside the prompt evaluation" in outside and "prompt evaluation itself" not in outside
    fast = [0.010, 0.011, 0.012]
    big = explain_layers(_layers(fast, fast, [0.100, 0.101, 0.102]), floor_ms=20.0)
    assert "plumbing (90 ms) was not smaller" in big and "below it" in big
    assert "floor" not in explain_layers(_layers(RT, AA, RT))


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
    df = pd.DataFrame([{"engine": "llamacpp", "ok": True, "decode_tok_per_s": 60.0, "weights": "Q4_1",
                        "weight_mb": 100.0, "ceiling_tok_per_s": 100.0, "pct_of_ceiling": 60.0},
                       {"engine": "transformers", "ok": True, "decode_tok_per_s": 10.0, "weights": "torch float32",
                        "weight_mb": 500.0, "ceiling_tok_per_s": 20.0, "pct_of_ceiling": 50.0}]).set_index("engine")
    text = explain_first_answers(df)
    assert "60% of its own 100 tok/s ceiling" in text and "50% of its own 20 tok/s ceiling" in text
    assert "6.0× below" in text


def test_explain_first_answers_never_ranks_one_run_per_engine():
    """Issue 31: 'Fastest decode: llama-server' from 55.9 against 52.5 tok/s, one run each."""
    import re
    df = pd.DataFrame([{"engine": "llamacpp", "ok": True, "decode_tok_per_s": 52.5, "ttft_s": 0.0898, "weights": "Q4_1",
                        "weight_mb": 96.6, "ceiling_tok_per_s": 100.0, "pct_of_ceiling": 52.5},
                       {"engine": "llama-server", "ok": True, "decode_tok_per_s": 55.9, "ttft_s": 0.0581,
                        "weights": "Q4_1", "weight_mb": 96.6, "ceiling_tok_per_s": 100.0, "pct_of_ceiling": 55.9}]
                      ).set_index("engine")
    text = explain_first_answers(df)
    assert not re.search(r"\b[Ff]astest\b", text) and "not a ranking" in text
    assert "52.5 vs 55.9 tok/s" in text and "89.8 vs 58.1 ms TTFT" in text and "A/A rerun" in text
    alone = explain_first_answers(df.drop(index="llama-server"))
    assert "same llama.cpp code" not in alone and "Lowest" not in alone


def test_raw_exchange_shows_the_request_and_every_sse_line():
    from infercourse.lessons.plumbing import raw_exchange
    from infercourse.testing import SSESource
    with SSESource() as src:
        ex = raw_exchange(src.url, "hi", max_tokens=3)
    assert ex["request"].startswith("POST /v1/chat/completions HTTP/1.1") and '"stream": true' in ex["request"]
    assert ex["status"] == 200 and "text/event-stream" in ex["content_type"]
    data = [l for l in ex["lines"] if l.startswith("data:")]
    assert data[-1].strip() == "data: [DONE]" and len(ex["events"]) == len(data) - 1
    assert sum(1 for t in ex["texts"] if t) == 3


def test_raw_exchange_names_the_api_layer_when_nothing_listens():
    from infercourse.lessons.plumbing import raw_exchange
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


class _Recorder:
    """An engine that answers one token a chunk and keeps every request it got."""
    name = "rec"

    def __init__(self):
        self.seen = []

    def stream(self, request):
        import time
        from infercourse.core.types import Event, Usage
        self.seen.append(request)
        for _ in range(request.max_tokens):
            yield Event(t=time.perf_counter(), text="x", n_tokens=1)
        yield Event(t=time.perf_counter(), done=True, finish_reason="length",
                    usage=Usage(5, request.max_tokens, source="engine"))

    def describe(self):
        return {"engine": self.name, "model": "none"}


def test_first_answers_warms_each_engine_up_before_the_timed_answer():
    """Issue 31: llama.cpp in process paid its first call inside the timed answer (the server
    warms itself up at start), so its TTFT read 31.7 ms above the server's."""
    eng = _Recorder()
    df = first_answers({"rec": lambda: eng}, "hi", max_tokens=4)
    assert [r.max_tokens for r in eng.seen] == [1, 4] and df.loc["rec", "completion_tokens"] == 4


def test_the_transformers_factory_silences_the_loading_bar(monkeypatch):
    """The frozen "Loading weights 0/272" bar of 00: quiet() runs before transformers loads."""
    tlog = pytest.importorskip("transformers.utils.logging")
    import infercourse.engines
    monkeypatch.setattr(infercourse.engines, "make_engine", lambda name, **kw: (name, tlog.is_progress_bar_enabled()))
    tlog.enable_progress_bar()
    try:
        assert engine_factories(["transformers"])["transformers"]() == ("transformers", False)
    finally:
        tlog.enable_progress_bar()


@pytest.mark.slow
def test_through_layers_runs_an_aa_block_per_repeat(llamacpp_engine):
    """Both engines loaded at once; each block holds runtime, its A/A rerun and the server,
    in a shuffled order; every answer forced to the same length."""
    from infercourse.lessons.plumbing import ARMS, through_layers
    df = through_layers("Say hi.", max_tokens=3, repeats=2)
    assert sorted(df.groupby("rep")["arm"].apply(sorted).tolist()) == [sorted(ARMS)] * 2
    assert df["layer"].tolist() == df["arm"].map(ARMS).tolist() and (df["prompt_ms"] > 0).all()
    assert df["prompt_tokens"].nunique() == 1 and (df["ttft_s"] > 0).all()
