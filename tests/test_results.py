"""Runs saved append-only, read back (even when cut short), and compared; other tools'
result files (fixtures shaped like vllm bench serve / GuideLLM output) read onto our axes."""
import json
import math
from pathlib import Path

import pytest

from infercourse.measure import importers
from infercourse.core import metrics, summary
from infercourse.measure import results as R
from infercourse.core.trace import RequestTrace

DATA = Path(__file__).parent / "data"


def trace(i, ttft, n=4, step=0.05, status="ok"):
    t0 = float(i)
    chunks = [t0 + ttft + k * step for k in range(n)]
    return RequestTrace(request_id=i, scheduled_t=t0, sent_t=t0, chunk_t=chunks,
                        chunk_tokens=[1] * n, end_t=chunks[-1], prompt_tokens=10,
                        completion_tokens=n, token_source="server", status=status,
                        tags={"turn": i % 2})


def manifest(**kw):
    m = {"engine": {"name": "llamacpp", "version": "0.3.36", "flags": {"n_threads": 2}},
         "model": {"file": "smollm2.gguf", "sha256": "ab" * 32, "quant": "Q4_1", "n_ctx": 2048},
         "sampling": {"temperature": 0.0, "seed": 0}, "load": {"concurrency": 1},
         "workload": {"name": "fixed-64", "hash": R.content_hash([1, 2, 3])}}
    for k, v in kw.items():
        m[k] = {**m[k], **v} if isinstance(v, dict) else v
    return m


def write_run(path, ttfts, **kw):
    with R.RunWriter(path, manifest(**kw)) as w:
        for i, t in enumerate(ttfts):
            w.write(trace(i, t))
    return path


def test_manifest_written_first_then_closed(tmp_path):
    w = R.RunWriter(tmp_path / "a", manifest())
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["status"] == "running" and "end_time" not in m
    assert m["hardware"]["cores_logical"] >= 1 and m["python"].count(".") == 2
    w.write(trace(0, 0.1))
    # already on disk before close: a crash now would keep it
    assert len((tmp_path / "a" / "requests.jsonl").read_text().splitlines()) == 1
    w.close()
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["status"] == "ok" and m["n_requests"] == 1 and "end_time" in m


def test_refuses_to_overwrite_and_warns_on_missing_conditions(tmp_path):
    write_run(tmp_path / "a", [0.1])
    with pytest.raises(FileExistsError, match="append-only"):
        R.RunWriter(tmp_path / "a", manifest())
    with pytest.warns(UserWarning, match="lacks conditions"):
        R.RunWriter(tmp_path / "b", {"engine": "x"}).close()


def test_context_manager_records_error(tmp_path):
    with pytest.raises(RuntimeError):
        with R.RunWriter(tmp_path / "a", manifest()) as w:
            w.write(trace(0, 0.1))
            raise RuntimeError("server died")
    run = R.load_run(tmp_path / "a")
    assert run.manifest["status"].startswith("error: RuntimeError: server died")
    assert len(run.df) == 1                      # the finished request survived


def test_round_trip(tmp_path):
    write_run(tmp_path / "a", [0.1, 0.2, 0.3])
    run = R.load_run(tmp_path / "a")
    assert len(run.traces) == 3 and run.traces[1] == trace(1, 0.2)
    assert run.df["ttft_s"].tolist() == pytest.approx([0.1, 0.2, 0.3])
    assert run.df["turn"].tolist() == [0, 1, 0]
    assert run.manifest["model"]["sha256"] == "ab" * 32


def test_numpy_tags_stay_numbers(tmp_path):
    import numpy as np
    with R.RunWriter(tmp_path / "a", manifest(load={"concurrency": np.int64(4)})) as w:
        tr = trace(0, 0.1)
        tr.tags = {"prompt_len": np.int64(128), "temp": np.float32(0.5)}
        w.write(tr)
    run = R.load_run(tmp_path / "a")
    assert run.df.loc[0, "prompt_len"] == 128 and run.manifest["load"]["concurrency"] == 4


def test_truncated_last_line_keeps_complete_ones(tmp_path):
    write_run(tmp_path / "a", [0.1, 0.2, 0.3])
    p = tmp_path / "a" / "requests.jsonl"
    text = p.read_text()
    p.write_text(text[: len(text) - 40])         # killed mid-write of the third line
    with pytest.warns(UserWarning, match="skipped 1 incomplete line"):
        run = R.load_run(tmp_path / "a")
    assert run.df["request_id"].tolist() == [0, 1]


def test_compare_and_differing_conditions(tmp_path):
    a = R.load_run(write_run(tmp_path / "c1", [0.1, 0.1, 0.1], load={"concurrency": 1}))
    b = R.load_run(write_run(tmp_path / "c4", [0.4, 0.5, 0.6], load={"concurrency": 4}))
    cmp = R.compare([a, b])
    assert list(cmp.index) == ["c1", "c4"]
    assert cmp.loc["c1", "ttft_s_p50"] == pytest.approx(0.1)
    assert cmp.loc["c4", "ttft_s_p50"] == pytest.approx(0.5)
    assert cmp.loc["c4", "error_rate"] == 0 and cmp.loc["c1", "completed"] == 3
    assert cmp.loc["c1", ["n_ok", "n_error", "n_incomplete"]].tolist() == [3, 0, 0]
    diff = R.differing_conditions([a, b])
    assert list(diff.index) == ["load.concurrency"]      # times ignored, all else equal
    assert diff.loc["load.concurrency"].tolist() == [1, 4]


def test_writer_thread_writes_everything_off_the_callers_thread(tmp_path):
    import threading
    seen = []                                # (thread, count) of each on_written call
    w = R.RunWriter(tmp_path / "a", manifest())
    w.start_thread(on_written=lambda k: seen.append((threading.current_thread().name, k)))
    for i in range(200):
        w.submit(trace(i, 0.1))              # a queue put: returns before anything is written
    w.flush()                                # waits for the writer thread to drain
    assert len((tmp_path / "a" / "requests.jsonl").read_text().splitlines()) == 200
    assert sum(k for _, k in seen) == 200 and {t for t, _ in seen} == {"infercourse-writer"}
    assert len(seen) <= 200                  # batched: one fsync per batch, never one per line lost
    w.close()
    run = R.load_run(tmp_path / "a")
    assert run.manifest["n_requests"] == 200 and sorted(run.df["request_id"]) == list(range(200))


def test_writer_thread_drained_at_close_and_at_interpreter_exit(tmp_path):
    import subprocess
    import sys
    w = R.RunWriter(tmp_path / "a", manifest())
    w.start_thread()
    for i in range(50):
        w.submit(trace(i, 0.1))
    w.close("stopped: interrupted")          # a run cut short: close drains the queue first
    assert R.load_run(tmp_path / "a").manifest["n_requests"] == 50
    # a process that exits with a run still open (no close): atexit drains and closes it
    code = (f"from tests.test_results import trace, manifest\nfrom infercourse.measure import results as R\n"
            f"w = R.RunWriter({str(tmp_path / 'b')!r}, manifest()); w.start_thread()\n"
            f"[w.submit(trace(i, 0.1)) for i in range(300)]\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1], timeout=120)
    run = R.load_run(tmp_path / "b")
    assert len(run.traces) == 300 and run.manifest["status"].startswith("error: interpreter exited")


def test_writer_thread_error_surfaces_at_close(tmp_path):
    w = R.RunWriter(tmp_path / "a", manifest())
    w.start_thread()
    bad = trace(0, 0.1)
    loop = {}
    loop["self"] = loop
    bad.as_row = lambda: loop                # a circular row: json.dumps fails on the writer thread
    w.submit(bad)
    with pytest.raises(OSError, match="writing .*requests.jsonl failed"):
        w.close()


def test_report_lines_count_statuses_cache_and_goodput():
    trs = [trace(i, 0.1 * (i + 1)) for i in range(4)]
    trs[0].cached_tokens, trs[1].cached_tokens = 10, 0          # 10 of 20 known prompt tokens
    trs[2].status, trs[2].error = "incomplete", "incomplete: in flight when the run stopped"
    trs[3].status = "error"
    lines = R.report_lines(metrics.per_request_frame(trs), {"ttft_s": 0.15})
    assert lines[0] == "requests: 2 ok, 1 error, 1 incomplete"
    assert "10 of 20 prompt tokens cached (50%) over 2 requests" in lines[1]
    assert lines[2].startswith("goodput: 1 of 4 requests met every SLO (ttft_s <= 0.15)")
    trs = [trace(i, 0.1) for i in range(2)]                     # an engine that reports no cache
    assert "not reported" in R.report_lines(metrics.per_request_frame(trs))[1]


def test_content_hash_is_order_independent_for_keys():
    assert R.content_hash({"a": 1, "b": 2}) == R.content_hash({"b": 2, "a": 1})
    assert R.content_hash({"a": 1}) != R.content_hash({"a": 2})


# ---- importers --------------------------------------------------------------------
def test_load_vllm_bench_fixture():
    df = importers.load_vllm_bench(DATA / "vllm_bench_serve_detailed.json")
    assert len(df) == 4 and df.status.tolist() == ["ok", "ok", "ok", "error"]
    r1 = df.iloc[1]                                  # waited 0.05 s for the semaphore
    assert r1.ttft_from_send_s == pytest.approx(0.20) and r1.ttft_s == pytest.approx(0.25)
    assert r1.e2e_s == pytest.approx(0.35) and r1.dispatch_delay_s == pytest.approx(0.05)
    assert r1.tpot_s == pytest.approx(0.10 / 4) and r1.decode_tok_per_s == pytest.approx(40)
    r2 = df.iloc[2]                                  # 3 tokens in 2 chunks
    assert r2.n_chunks == 2 and r2.tokens_per_chunk == pytest.approx(1.5)
    assert r2.decode_tok_per_s == pytest.approx(2 / 0.05)
    assert math.isnan(df.iloc[3].ttft_s)             # vLLM writes 0.0 for failures
    assert summary.error_rate(df) == pytest.approx(0.25)
    ours = set(metrics.per_request_frame([trace(0, 0.1)]).columns)
    assert ours >= {c for c in df.columns if c not in ("run", "label", "max_concurrency", "request_rate")}


def test_load_vllm_bench_appended_results(tmp_path):
    # --append-result writes one JSON document per line
    one = json.dumps(json.loads((DATA / "vllm_bench_serve_detailed.json").read_text()))
    p = tmp_path / "appended.json"
    p.write_text(one + "\n" + one.replace('"max_concurrency": 2', '"max_concurrency": 4') + "\n")
    df = importers.load_vllm_bench(p)
    assert len(df) == 8 and df.groupby("run")["max_concurrency"].first().tolist() == [2, 4]


def test_load_vllm_bench_without_queue_times_refuses_to_guess(tmp_path):
    res = json.loads((DATA / "vllm_bench_serve_detailed.json").read_text())
    del res["queue_times"]
    p = tmp_path / "old.json"
    p.write_text(json.dumps(res))
    with pytest.warns(UserWarning, match="no queue_times"):
        df = importers.load_vllm_bench(p)
    assert df.ttft_s.isna().all() and df.ttft_from_send_s.iloc[1] == pytest.approx(0.2)
    res["max_concurrency"] = None                   # uncapped: sent on arrival, no wait
    p.write_text(json.dumps(res))
    assert importers.load_vllm_bench(p).ttft_s.iloc[1] == pytest.approx(0.2)


def test_load_guidellm_fixture():
    df = importers.load_guidellm(DATA / "guidellm_benchmarks.json")
    assert df.status.tolist() == ["ok", "ok", "error"]
    a = df.iloc[0]
    assert a.ttft_s == pytest.approx(0.4) and a.ttft_from_send_s == pytest.approx(0.3)
    assert a.dispatch_delay_s == pytest.approx(0.1) and a.e2e_s == pytest.approx(0.85)
    assert a.tpot_s == pytest.approx(0.45 / 4) and a.decode_tok_per_s == pytest.approx(10)
    assert a.prefill_tok_per_s == pytest.approx(40 / 0.3) and a.itl_mean_s == pytest.approx(0.1)
    b = df.iloc[1]                                   # 7 tokens over 4 iterations
    assert b.tpot_s == pytest.approx(0.3 / 6) and b.decode_tok_per_s == pytest.approx(6 / 0.3)
    assert df.iloc[2].output_tokens == 0 and math.isnan(df.iloc[2].ttft_s)
    assert df.strategy.unique().tolist() == ["constant"]
    ours = set(metrics.per_request_frame([trace(0, 0.1)]).columns)
    assert ours >= {c for c in df.columns if c not in ("benchmark", "strategy")}
    g = summary.goodput(df, {"ttft_s": 0.5})
    assert g["n_good"] == 2


def test_importers_reject_wrong_files(tmp_path):
    p = tmp_path / "summary.json"
    p.write_text('{"duration": 1.0, "completed": 3, "mean_ttft_ms": 12.0}')
    with pytest.raises(ValueError, match="--save-detailed"):
        importers.load_vllm_bench(p)
    with pytest.raises(ValueError, match="not a GuideLLM report"):
        importers.load_guidellm(p)


def test_compare_counts_a_request_cut_at_the_end_apart_from_errors(tmp_path):
    """14 printed a soak's error rate as 75% (cut-off requests apart) and the same run's
    report as 83% (cut-off counted as errors): one definition now."""
    with R.RunWriter(tmp_path / "soak", manifest()) as w:
        for i, status in enumerate(["ok", "error", "error", "error", "incomplete", "incomplete"]):
            w.write(trace(i, 0.1, status=status))
    row = R.compare([R.load_run(tmp_path / "soak")]).iloc[0]
    assert row["error_rate"] == pytest.approx(3 / 4) and row["n_incomplete"] == 2
