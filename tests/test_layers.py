"""The layer doctor: its grading rules on synthetic evidence (fast), then the walk on a real
llama-server (embedded model, 1 thread) and on an in-process engine."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from infercourse.core.errors import LAYERS
from infercourse.ops.layers import LayerReport, classify_log, grade


def healthy_evidence(**changes):
    """A snapshot of a healthy llama-server, as probes.collect_http returns it."""
    ev = {
        "kind": "http", "target": "http://127.0.0.1:1",
        "api": {"models": {"ok": True, "status": 200, "seconds": 0.01},
                "stream": {"ok": True, "chunks": 4, "usage_source": "server", "ttft_s": 0.05,
                           "e2e_s": 0.1, "server_s": 0.08, "server_prompt_s": 0.04}},
        "server": {"health": {"ok": True, "status": 200, "seconds": 0.01}, "direct_health": None,
                   "process": {"pid": 42, "alive": True, "status": "sleeping"}, "log_tail": "", "exit_code": None},
        "engine": {"slots": [{"is_processing": False}, {"is_processing": False}],
                   "metrics": {"llamacpp:requests_deferred": 0.0}},
        "runtime": {"build_info": "b1", "cmdline": ["llama-server", "-t", "1"]},
        "model": {"model_path": "m.gguf", "chat_template": "x", "tool_turn": {"ok": True, "status": 200}, "n_ctx": 512},
        "context": {"n_ctx_slot": 512, "max_tokens": 0, "prompt_tokens": None},
        "kv": {"usage_ratio": None},
        "memory": {"rss_bytes": 2**27, "total_bytes": 2**34, "available_bytes": 2**33, "swap_total_bytes": 0,
                   "swap_used_bytes": 0, "load_1m": 0.5, "cores": 2, "gpus": []},
    }
    for path, value in changes.items():
        node = ev
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return ev


def test_healthy_evidence_names_no_layer_and_reports_every_layer_in_order():
    r = grade(healthy_evidence())
    assert [c.layer for c in r.checks] == list(LAYERS)
    assert r.failed is None and r.layer is None
    assert "every layer answered" in str(r)


@pytest.mark.parametrize("changes, layer, status", [
    ({"server.process": {"pid": 42, "alive": False, "status": "gone"},
      "server.health": {"ok": False, "error": "refused"},
      "api.stream": {"ok": False, "error": "not reachable", "error_layer": "API", "refused": True}}, "server", "fail"),
    ({"server.process": {"pid": 42, "alive": True, "status": "stopped"},
      "server.health": {"ok": False, "error": "timeout"},
      "api.stream": {"ok": False, "error": "sent nothing", "error_layer": "API", "timed_out": True}}, "server", "fail"),
    ({"api.stream": {"ok": False, "error": "ended without data: [DONE]", "error_layer": "API"}}, "API", "fail"),
    ({"api.stream.ttft_s": 2.0}, "API", "warn"),
    ({"engine.slots": [{"is_processing": True}] * 2, "engine.metrics": {"llamacpp:requests_deferred": 3.0},
      "api.stream": {"ok": False, "error": "sent nothing", "error_layer": "API", "timed_out": True}}, "engine", "fail"),
    ({"api.stream": {"ok": False, "error": "sent nothing", "error_layer": "API", "timed_out": True}},
     "engine", "fail"),   # healthy, nothing queued, yet no first token: generation stuck or too slow
    ({"server.direct_health": {"ok": True, "status": 200}, "api.direct_stream": {"ok": True, "chunks": 4},
      "api.stream": {"ok": False, "error": "cut mid-way", "error_layer": "API"}}, "API", "fail"),
    ({"server.direct_health": {"ok": True, "status": 200},
      "api.direct_stream": {"ok": False, "error": "sent nothing", "error_layer": "API", "timed_out": True},
      "api.stream": {"ok": False, "error": "sent nothing", "error_layer": "API", "timed_out": True}}, "engine", "fail"),
    ({"model.tool_turn": {"ok": False, "status": 500, "body": "no tool role"}}, "model", "fail"),
    ({"context.prompt_tokens": 600, "context.max_tokens": 16}, "context", "fail"),
    ({"kv.usage_ratio": 0.99}, "KV cache", "warn"),
    ({"memory.available_bytes": 2**28}, "memory", "fail"),
    ({"memory.load_1m": 9.0}, "hardware", "warn"),
    ({"runtime.cmdline": ["llama-server", "-t", "16"]}, "runtime", "warn"),
])
def test_each_rule_names_its_layer(changes, layer, status):
    r = grade(healthy_evidence(**changes))
    assert r.layer == layer
    assert r.check(layer).status == status and r.check(layer).next_step


def test_the_walk_stops_at_the_first_failure():
    r = grade(healthy_evidence(**{"model.tool_turn": {"ok": False, "status": 500, "body": "boom"},
                                  "memory.available_bytes": 1}))
    assert r.layer == "model"
    after = r.checks[LAYERS.index("model") + 1:]
    assert after and all(c.status == "skip" and "not reached" in c.summary for c in after)


@pytest.mark.parametrize("line, layer", [
    ("ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 1610612736", "memory"),
    ("terminate called after throwing an instance of 'std::bad_alloc'", "memory"),
    ("gguf_init_from_file: failed to open GGUF file 'x.gguf' (No such file or directory)", "model"),
    ("llama_model_load: error loading model: tensor data is not within the file bounds", "model"),
    ("[watchdog] server exited by itself with code -4", "hardware"),
    ("GGML_ASSERT(n_tokens > 0) failed", "runtime"),
])
def test_a_dead_servers_log_names_the_layer_it_died_of(line, layer):
    assert classify_log("loading...\n" + line + "\n[watchdog] bye")[0] == layer


def test_a_log_with_no_known_cause_names_nothing():
    assert classify_log("[watchdog] server exited by itself with code -9") is None
    assert classify_log(None) is None


def test_dead_server_whose_log_names_memory_points_below_the_server():
    r = grade(healthy_evidence(**{
        "server.process": {"pid": None, "alive": None}, "server.health": {"ok": False, "error": "refused"},
        "server.log_tail": "llama_kv_cache: failed to allocate buffer\n[watchdog] server exited by itself with code 1",
        "api.stream": {"ok": False, "error": "refused", "refused": True}}))
    assert r.layer == "memory"
    assert r.check("server").status == "warn" and r.check("API").status == "warn"


def _killed(oom):
    """A server gone with SIGKILL and no line in its log, and what the kernel's records said."""
    return healthy_evidence(**{
        "server.process": {"pid": 4242, "alive": False, "status": "gone"},
        "server.health": {"ok": False, "error": "refused"},
        "server.log_tail": "[watchdog] server exited by itself with code -9", "server.exit_code": -9, "server.oom": oom,
        "api.stream": {"ok": False, "error": "refused", "refused": True}})


def _oom(before, now, lines=(), error=None):
    return {"before": before, "now": {"oom_kill": now, "file": "/sys/fs/cgroup/s/memory.events", "error": None},
            "kernel": {"lines": list(lines), "error": error}}


def test_an_oom_kill_the_kernel_recorded_names_memory_and_a_plain_sigkill_does_not():
    """Issue 31: the OOM killer's SIGKILL leaves no line in the log; the cgroup's oom_kill counter,
    read before and after, says whether it was the kernel. The doctor's words flip with it."""
    import re
    oom = grade(_killed(_oom(0, 1)))
    assert oom.layer == "memory" and oom.check("server").status == "warn"
    assert re.search(r"\bthe kernel's record names the memory layer\b", oom.check("server").summary)
    assert re.search(r"\bkilled by the OOM killer\b.*rose 0 → 1", oom.check("memory").summary)
    plain = grade(_killed(_oom(0, 0)))
    assert plain.layer == "server" and plain.check("server").status == "fail"
    assert re.search(r"\(exit code -9\); not the OOM killer: this cgroup's oom_kill counter stayed at 0\b",
                     plain.check("server").summary)
    assert "killed by the OOM killer" not in str(plain)
    said = grade(_killed(_oom(0, 0, lines=["Out of memory: Killed process 4242 (llama-server)"])))
    assert said.layer == "memory" and "the kernel log says" in said.check("memory").summary
    refused = "the kernel log is not readable here: dmesg: Operation not permitted"
    forbidden = grade(_killed(_oom(None, 0, error=refused)))
    assert forbidden.layer == "server" and "Operation not permitted" in forbidden.check("server").summary
    assert grade(_killed(None)).check("server").summary == "process 4242 is gone (exit code -9)"   # nothing gathered


def test_report_round_trips_to_json():
    r = grade(healthy_evidence(**{"context.prompt_tokens": 600}))
    d = json.loads(r.to_json())
    assert d["layer"] == "context" and len(d["checks"]) == len(LAYERS)
    assert isinstance(r, LayerReport)


def test_cli_help():
    for argv in (["doctor", "layers", "--help"], ["faults", "--help"], ["faults", "run", "--help"]):
        out = subprocess.run([sys.executable, "-m", "infercourse", *argv], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "usage" in out.stdout.lower(), out.stderr


def test_cli_rejects_no_target():
    out = subprocess.run([sys.executable, "-m", "infercourse", "doctor", "layers"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "URL" in out.stderr


@pytest.mark.slow
def test_doctor_on_a_real_healthy_server_fails_no_layer():
    from infercourse.ops.faults import small_server
    from infercourse.ops.layers import doctor_layers
    with small_server() as srv:
        r = doctor_layers(srv.url, server=srv, timeout_s=30)
        assert r.failed is None, str(r)
        assert r.check("API").evidence["ttft_s"] > 0
        assert r.check("server").evidence["pid"] == srv.pid
        assert r.check("engine").evidence["slots"] == srv.n_parallel
        long = " ".join(["word"] * srv.ctx_size)
        r2 = doctor_layers(srv.url, server=srv, prompt=long, max_tokens=8, timeout_s=30)
        assert r2.layer == "context" and r2.check("context").evidence["prompt_tokens"] > srv.ctx_size // 2
        out = subprocess.run([sys.executable, "-m", "infercourse", "doctor", "layers", srv.url, "--json",
                              "--timeout", "30"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        assert [c["layer"] for c in json.loads(out.stdout)["checks"]] == list(LAYERS)


@pytest.mark.slow
def test_doctor_on_an_in_process_engine(llamacpp_engine):
    from infercourse.ops.layers import doctor_engine
    r = doctor_engine(llamacpp_engine, prompt="word " * 3000, max_tokens=8)
    assert r.check("API").status == "skip" and r.check("engine").status == "ok"
    assert r.layer == "context"     # 3000 words do not fit the fixture's 2048-token window


def test_a_long_metrics_page_is_read_whole():
    """/metrics bodies were cut at 300 characters; where the cut fell depended on how many digits
    the counters had, so under load the page sometimes parsed to nothing (a flaky router test)."""
    import http.server
    import threading

    import httpx

    from infercourse.ops.probes import _get, parse_metrics
    page = "".join(f"# HELP llamacpp:m{i} a counter\n# TYPE llamacpp:m{i} counter\nllamacpp:m{i} {i * 1234.5}\n"
                   for i in range(40)).encode()

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *a):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with httpx.Client(timeout=10) as c:
            got = _get(c, f"http://127.0.0.1:{srv.server_port}/metrics")
        assert len(page) > 300 and parse_metrics(got["body"])["llamacpp:m39_total"] == pytest.approx(39 * 1234.5)
    finally:
        srv.shutdown()
