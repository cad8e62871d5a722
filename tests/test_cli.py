"""`infercourse bench` as a benchmarker uses it: SLOs and goodput, prompt lengths counted by
the served model's tokenizer, API keys that never reach disk, and exit codes.

Every test calls the CLI functions in process (`bench_main(argv)` returns the exit code)
against `SSESource`, a loopback stand-in server, or llama.cpp's llama-server.
"""
from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from infercourse.cli import bench_main, parse_slos
from infercourse.testing import SSESource

pytest.importorskip("httpx_sse")


def common(url, out, *extra):
    return ["--engine", "http", "--url", url, "--model", "sse-source", "--no-progress",
            "--max-tokens", "4", "--requests", "3", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def source():
    with SSESource() as src:
        yield src


def all_text(folder: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file())


# -- --slo and goodput -----------------------------------------------------------------------
def test_parse_slos_names_and_values():
    assert parse_slos("ttft=0.5,tpot=0.05") == {"ttft_s": 0.5, "tpot_s": 0.05}
    assert parse_slos("decode_tok_per_s=20, e2e_s=2") == {"decode_tok_per_s": 20.0, "e2e_s": 2.0}


@pytest.mark.parametrize("text, message", [
    ("ttft", "NAME=VALUE"), ("latency=1", "NAME=VALUE"), ("ttft=fast", "not a number"),
    ("ttft=0", "positive"), ("ttft=-1", "positive"), ("ttft=nan", "positive"), ("ttft=inf", "positive"),
    (",", "at least one"),
])
def test_bad_slo_is_a_usage_error(text, message, capsys):
    with pytest.raises(SystemExit) as ei:
        bench_main(["--slo", text])
    assert ei.value.code == 2 and message in capsys.readouterr().err


def test_summary_prints_counts_cache_and_goodput(source, tmp_path, capsys):
    assert bench_main(common(source.url, tmp_path / "a", "--slo", "ttft=30,e2e=60")) == 0
    out = capsys.readouterr().out
    assert "requests: 3 ok, 0 error, 0 incomplete" in out
    assert "prompt cache: not reported" in out             # the stand-in sends no cached_tokens
    assert "goodput: 3 of 3 requests met every SLO (ttft_s <= 30, e2e_s <= 60): 100%" in out


# -- --prompt-tokens: counted by the served model's tokenizer --------------------------------
@pytest.fixture
def sent_bodies(monkeypatch):
    from infercourse.engines.openai_http import OpenAIHTTPEngine
    got, body = [], OpenAIHTTPEngine.body

    def spy(self, request):
        out = body(self, request)
        got.append(out)
        return out
    monkeypatch.setattr(OpenAIHTTPEngine, "body", spy)
    return got


def test_prompt_tokens_counted_by_the_servers_tokenize(source, tmp_path, sent_bodies):
    # SSESource's /tokenize counts BOS + one per word, which no real tokenizer does: a
    # prompt of exactly 20 by that count proves the server's count was used, salt included
    assert bench_main(common(source.url, tmp_path / "a", "--api", "completions", "--prompt-tokens", "20",
                             "--warmup", "0")) == 0
    prompts = [b["prompt"] for b in sent_bodies]
    salt = json.loads((tmp_path / "a" / "manifest.json").read_text())["workload"]["salt"]
    assert len(prompts) == 3 and all(p.startswith(salt + "\n") for p in prompts)
    assert all(1 + len(p.split()) == 20 for p in prompts)


def test_prompt_tokens_with_a_tokenizer_file(source, tmp_path, sent_bodies):
    from infercourse.cli.workload import file_tokenizer as _file_tokenizer
    from infercourse.models.embedded import embedded_gguf
    gguf = embedded_gguf()
    assert bench_main(common(source.url, tmp_path / "a", "--api", "completions", "--prompt-tokens", "24",
                             "--tokenizer", str(gguf), "--warmup", "0")) == 0
    tok = _file_tokenizer(gguf)
    assert [len(tok(b["prompt"])) for b in sent_bodies] == [24] * 3


class NoTokenize(BaseHTTPRequestHandler):
    """A server that lists a model and has no /tokenize (as most OpenAI-compatible ones)."""

    def log_message(self, *a):
        pass

    def do_GET(self):
        body = b'{"data": [{"id": "other-model"}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_no_tokenize_no_tokenizer_is_a_clean_error(tmp_path, capsys):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), NoTokenize)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        code = bench_main(["--engine", "http", "--url", url, "--no-progress", "--out", str(tmp_path / "a")])
    finally:
        srv.shutdown()
    err = capsys.readouterr().err
    assert code == 1 and "has no /tokenize" in err and "--tokenizer" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists()                 # never ran with a wrong count


# -- the key: from a file or the environment, never from argv ------------------------------------
def test_api_key_sent_never_written(tmp_path, capsys, monkeypatch):
    for var in ("INFERCOURSE_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    key = "sk-test-" + os.urandom(8).hex()
    (tmp_path / "key").write_text(key + "\n")
    with SSESource(api_key=key) as src:
        assert bench_main(common(src.url, tmp_path / "no-key")) == 1      # 401: a clean error
        assert "401" in capsys.readouterr().err
        assert bench_main(common(src.url, tmp_path / "file", "--api-key-file", str(tmp_path / "key"))) == 0
        monkeypatch.setenv("INFERCOURSE_API_KEY", key)                  # a room's key, as serve reads it
        assert bench_main(common(src.url, tmp_path / "room")) == 0
        monkeypatch.delenv("INFERCOURSE_API_KEY")
        monkeypatch.setenv("OPENAI_API_KEY", key)
        assert bench_main(common(src.url, tmp_path / "env")) == 0
    assert "3 ok" in capsys.readouterr().out
    for run in ("file", "room", "env"):
        assert key not in all_text(tmp_path / run)


@pytest.mark.parametrize("flag", [["--api-key", "sk-on-argv"], ["--api-key=sk-on-argv"]])
def test_a_key_on_benchs_command_line_is_refused(tmp_path, capsys, flag):
    """`ps` shows every user of the machine bench's argv: the key is refused there, before
    anything is sent, and the message says where it goes instead."""
    with pytest.raises(SystemExit) as e:
        bench_main(["--engine", "http", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "a"), *flag])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "visible to every user" in err and "--api-key-file" in err
    assert not (tmp_path / "a").exists()


def test_api_key_file_must_hold_one_key(tmp_path, capsys):
    (tmp_path / "two").write_text("a\nb\n")
    with pytest.raises(SystemExit):
        bench_main(["--engine", "http", "--url", "http://127.0.0.1:9", "--api-key-file", str(tmp_path / "two")])
    assert "--api-key-file" in capsys.readouterr().err


@pytest.mark.slow
def test_api_key_against_llama_server(tmp_path, capsys, monkeypatch):
    from infercourse.core.errors import BackendMissingError
    from infercourse.servers import LlamaServer
    key = "sk-test-" + os.urandom(8).hex()
    try:
        srv = LlamaServer(n_parallel=1, ctx_size=512, threads=1, extra_args=("--api-key", key))
    except BackendMissingError as e:
        pytest.skip(f"llama-server not built here: {e}")
    with srv:
        base = ["--engine", "http", "--url", srv.url, "--no-progress", "--max-tokens", "2",
                "--requests", "2", "--prompt-tokens", "16"]
        assert bench_main(base + ["--out", str(tmp_path / "bad")]) == 1   # the server wants the key
        monkeypatch.setenv("OPENAI_API_KEY", key)
        assert bench_main(base + ["--out", str(tmp_path / "run")]) == 0
        info = srv.describe()
    out, err = capsys.readouterr()
    assert "2 ok" in out and "Traceback" not in err
    assert key not in all_text(tmp_path) and key not in srv.log_path.read_text()
    assert key not in json.dumps(info) and "***" in info["argv"]


# -- exit codes ------------------------------------------------------------------------------
def test_unreachable_server_is_one_line_and_exit_1(tmp_path, capsys):
    from infercourse.servers import free_port
    code = bench_main(["--engine", "http", "--url", f"http://127.0.0.1:{free_port()}", "--no-progress",
                       "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: server at 127.0.0.1:") and "(API layer)" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_bug_keeps_its_traceback(source, tmp_path, monkeypatch):
    from infercourse.measure import bench

    def broken(*a, **k):
        raise ZeroDivisionError("a bug, not a named failure")
    monkeypatch.setattr(bench, "run", broken)
    with pytest.raises(ZeroDivisionError):
        bench_main(common(source.url, tmp_path / "a"))


def test_report_of_a_broken_run_is_exit_1_not_a_traceback(tmp_path, capsys):
    from infercourse.core.errors import InferCourseError
    from infercourse.measure import results
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "manifest.json").write_text("{}")

    def named(*a, **k):
        raise InferCourseError("run folder unreadable")
    import infercourse.cli as cli
    orig = results.load_run
    results.load_run = named
    try:
        assert cli.report_main([str(tmp_path / "r")]) == 1
    finally:
        results.load_run = orig
    assert capsys.readouterr().err.startswith("error: run folder unreadable")


def test_a_percentile_too_few_requests_support_is_printed_as_n_below(source, tmp_path, capsys):
    """15 printed a p99 of 20 requests: bench and report show "n<N" where a percentile's
    interval needs more samples than the run has (`summary.min_n`: 72 for a p95, 368 for a p99)."""
    from infercourse.cli import report_main
    from infercourse.core.summary import min_n
    assert bench_main(common(source.url, tmp_path / "a", "--requests", "6")) == 0
    out = capsys.readouterr().out
    assert f"n<{min_n(0.99)}" in out and f"n<{min_n(0.95)}" in out and "not printed" in out
    assert report_main([str(next((tmp_path / "a").rglob("manifest.json")).parent)]) == 0
    rep = capsys.readouterr().out
    assert f"n<{min_n(0.99)}" in rep and "not printed as an estimate" in rep


def test_shown_masks_only_the_named_percentiles():
    from infercourse.core.summary import shown
    assert shown(1.5, "p99", "p95,p99") == "n<368" and shown(1.5, "p50", "p95,p99") == 1.5
    assert shown(1.5, "p99", "") == 1.5 and shown(1.5, "p99", float("nan")) == 1.5
