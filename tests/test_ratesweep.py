"""The open-loop rate sweep: every level kept up on an instant server; the sweep stops at
the first saturated level when the client can hold only one request at a time."""
from infercourse.core.types import Request
from infercourse.measure.ratesweep import rate_sweep, saturated
from infercourse.testing import SSESource


def test_saturation_rule():
    row = {"ideal_rps": 4.0, "requests_per_s": 3.9, "error_rate": 0.0, "dispatch_delay_s_p95": 0.01,
           "service_s": 0.2}
    assert saturated(row) is None
    assert "completed" in saturated({**row, "requests_per_s": 2.0})
    assert "error rate" in saturated({**row, "error_rate": 0.5})
    assert "waited" in saturated({**row, "dispatch_delay_s_p95": 0.5})


def test_sweep_stops_at_the_first_saturated_level(tmp_path):
    """0.5 s per request, one in flight at most: 0.5 req/s (a request every 2 s) keeps up
    with a wide margin; 25 req/s cannot (each waits for all before it), so 50 never runs."""
    reqs = [Request(prompt=f"q{i}", max_tokens=5) for i in range(4)]
    with SSESource(ttft_s=0.5, gap_s=0.001) as src:
        from infercourse.engines.openai_http import OpenAIHTTPEngine
        eng = OpenAIHTTPEngine(src.url, model="x", api="completions")
        table, runs = rate_sweep(eng, reqs, [0.5, 25, 50], pattern="rate", requests_per_level=3, warmup=0,
                                 max_in_flight=1, out_dir=tmp_path, progress=False, sample_s=None)
    assert list(table.index) == [0.5, 25] and len(runs) == 2, table
    assert table.loc[0.5, "saturated"] == "" and table.loc[25, "saturated"] != ""
    assert (tmp_path / "r25" / "manifest.json").is_file()


def test_cli_rate_sweep(tmp_path, capsys):
    from infercourse.cli import bench_main
    with SSESource(ttft_s=0.0, gap_s=0.001) as src:
        code = bench_main(["--engine", "http", "--url", src.url, "--pattern", "rate-sweep", "--rate-list", "2,4",
                           "--requests", "3", "--warmup", "0", "--no-progress", "--prompt-tokens", "8",
                           "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "offered_rps" in out and "saturated" in out, out
    assert (tmp_path / "r2" / "manifest.json").is_file()
