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


def test_first_answers_records_why_an_engine_could_not_run():
    def unreachable():
        raise APILayerError("server at 127.0.0.1:9 not reachable")
    df = first_answers({"ghost": unreachable}, "hi")
    assert not df.loc["ghost", "ok"] and "(API layer)" in df.loc["ghost", "why"]


def test_engine_factories_reject_unknown_names():
    with pytest.raises(ValueError, match="unknown engine"):
        engine_factories(["llamacpp", "tensorrt"])
