"""Real coding agents in the lab: the sealed namespace, the recording proxy, the anatomy of a
request, `doctor agent`, and the sentences notebook 20 computes from a run.

The capture, report and doctor paths run with the course's stand-in agent
(`infercourse.testing_agent`) against a real llama-server; the real agents (Claude Code,
Codex CLI) run where `make agents` installed them, inside a loopback-only namespace, bounded
in time; elsewhere those tests skip with the reason.
"""
from __future__ import annotations

import errno
import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from infercourse.core.errors import AgentLayerError
from infercourse.lessons import real_agent as ra
from infercourse.lessons import real_agent_claims as rc
from infercourse.lessons import real_agent_session as rs
from infercourse.ops import agent_doctor, agent_growth, agents, chat_agent, chat_doctor, netns
from infercourse.ops.agent_anatomy import first_difference, parts
from infercourse.ops.agent_capture import SSEWatcher, api_of
from infercourse.ops.agent_lab import LabSpec, Task, calls_table, run_lab, tasks_table

words = lambda text: len(text.split())   # noqa: E731 - a stand-in token counter for pure tests
needs_netns = pytest.mark.skipif(not netns.available(), reason=f"no loopback-only namespace: {netns.why_not()}")


# -- the recording proxy's reading of a stream ----------------------------------------------
def _feed(w: SSEWatcher, text: str, crlf: bool = False) -> SSEWatcher:
    data = text.replace("\n", "\r\n") if crlf else text
    for i, chunk in enumerate([data[:17], data[17:60], data[60:]]):   # events split across chunks
        w.feed(chunk.encode(), float(i))
    w.close(9.0)
    return w


ANTHROPIC = """event: message_start
data: {"type":"message_start","message":{"usage":{"input_tokens":20,"cache_read_input_tokens":100,"output_tokens":0}}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"tool_use","id":"t","name":"Read","input":{}}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":"{}"}}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":7}}

"""


@pytest.mark.parametrize("crlf", [False, True])
def test_watcher_reads_anthropic_usage_first_output_and_stop(crlf):
    w = _feed(SSEWatcher("anthropic"), ANTHROPIC, crlf)
    assert w.tokens() == {"prompt_tokens": 120, "cached_tokens": 100, "output_tokens": 7}
    assert w.first_t is not None and len(w.event_t) == 2      # the tool call's start is the first output
    assert w.stop_reason == "tool_use" and w.error is None


def test_watcher_reads_responses_and_errors_without_event_lines():
    resp = ('data: {"type":"response.created","response":{"status":"in_progress"}}\n\n'
            'data: {"type":"response.output_text.delta","delta":"OK"}\n\n'
            'data: {"type":"response.completed","response":{"status":"completed","usage":{"input_tokens":50,'
            '"input_tokens_details":{"cached_tokens":40},"output_tokens":2}}}\n\n')
    w = _feed(SSEWatcher("openai-responses"), resp)
    assert w.tokens() == {"prompt_tokens": 50, "cached_tokens": 40, "output_tokens": 2}
    assert len(w.event_t) == 1 and w.stop_reason == "completed"
    err = _feed(SSEWatcher("anthropic"), 'data: {"type":"error","error":{"type":"overloaded_error","message":"busy"}}\n\n')
    assert err.error == "busy" and err.first_t is None


def test_api_of_paths():
    assert [api_of(p) for p in ("/v1/messages?beta=true", "/v1/messages/count_tokens", "/v1/responses",
                                "/v1/chat/completions", "/v1/models")] == \
        ["anthropic", "anthropic-count", "openai-responses", "openai-chat", "other"]


# -- anatomy: parts and the first difference -------------------------------------------------
def _claude_body(suffix: str, task: str, history: int = 0) -> dict:
    msgs = [{"role": "user", "content": task}, {"role": "system", "content": "env block one two"}]
    msgs += [{"role": "assistant", "content": f"step {k}"} for k in range(history)]
    return {"system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.328.{suffix};"},
                       {"type": "text", "text": "static instructions " * 5}],
            "tools": [{"name": "Read", "input_schema": {}}], "messages": msgs}


def test_parts_follow_template_order_for_each_api():
    kinds = [k for k, _, _ in parts(_claude_body("aaa", "t"), "anthropic")]
    assert kinds == ["system", "system", "tool", "message", "message"]
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert [lbl for _, lbl, _ in parts(chat, "openai-chat")] == ["message 0 (system)", "tool 0: f", "message 1 (user)"]
    resp = {"instructions": "i", "tools": [{"type": "function", "name": "shell"}], "input": "hi"}
    assert [k for k, _, _ in parts(resp, "openai-responses")] == ["system", "tool", "message"]
    with pytest.raises(ValueError):
        parts({}, "other")


def test_first_difference_finds_the_header_a_new_turn_and_nothing():
    a = parts(_claude_body("aaa", "task one"), "anthropic")
    new_task = first_difference(a, parts(_claude_body("bbb", "task two"), "anthropic"), words)
    # the same start: "x-anthropic-billing-header:" and "cc_version=2.1.328." (2 words), then the suffix
    assert new_task["part"] == "system 0" and new_task["tokens_before"] == 2
    grown = first_difference(parts(_claude_body("aaa", "t", 1), "anthropic"),
                             parts(_claude_body("aaa", "t", 2), "anthropic"), words)
    assert grown["part"] == "message 3 (assistant)" and grown["kind"] == "message"
    same = first_difference(a, a, words)
    assert same["part"] is None and same["kind"] == "identical" and same["tokens_before"] == same["tokens_total"]
    assert first_difference(None, a, words)["kind"] == "first call"


# -- the seal ----------------------------------------------------------------------------------
def test_wrap_refuses_without_a_namespace_unless_asked(monkeypatch):
    monkeypatch.setattr(netns, "why_not", lambda: "no unshare here")
    monkeypatch.setattr(sys, "platform", "linux")
    with pytest.raises(AgentLayerError, match="loopback-only network namespace"):
        netns.wrap(["agent"])
    assert netns.wrap(["agent"], host_network=True) == ["agent"]


def test_host_network_means_no_unshare_where_a_namespace_could_be_made(monkeypatch):
    """--no-netns is the host's network, not a namespace whose loopback nobody brings up (in
    which llama-server never becomes healthy): no `unshare` at all, and the child is told so."""
    monkeypatch.setattr(netns, "why_not", lambda: None)
    monkeypatch.setattr(netns, "_unshare_argv", lambda: ["unshare", "-n"])
    monkeypatch.setattr(sys, "platform", "linux")
    assert netns.wrap(["agent"]) == ["unshare", "-n", "agent"] and netns.isolates(False)
    assert netns.wrap(["agent"], host_network=True) == ["agent"] and not netns.isolates(True)


def test_macos_runs_an_agent_only_when_the_learner_opts_in(monkeypatch):
    """No network namespace on macOS: a sealed run cannot be made, so the lab refuses unless the
    learner asks for the host network (--no-netns), and the manifest then says what that means."""
    from infercourse.ops.agent_lab_child import _host_words
    monkeypatch.setattr(sys, "platform", "darwin")
    netns.why_not.cache_clear()
    try:
        with pytest.raises(AgentLayerError, match="macOS has no network namespaces") as e:
            netns.wrap(["agent"])
        assert "--no-netns" in e.value.hint and "unprivileged" not in e.value.hint
        assert netns.wrap(["agent"], host_network=True) == ["agent"] and not netns.isolates(False)
        words = _host_words(LabSpec("unused", [Task("t", "stand-in", "hi")], host_network=True))
        assert words.startswith("host (no namespace: --no-netns; macOS has none") and "reach the internet" in words
    finally:
        netns.why_not.cache_clear()


def test_the_manifest_names_the_host_network_and_why(tmp_path):
    from infercourse.ops.agent_lab_child import _host_words
    spec = LabSpec(str(tmp_path), [Task("t", "stand-in", "hi")], host_network=True)
    assert _host_words(spec).startswith("host (no namespace: --no-netns")
    assert "--no-netns" not in _host_words(LabSpec(str(tmp_path), [Task("t", "stand-in", "hi")]))


def test_run_lab_refuses_before_starting_anything(monkeypatch, tmp_path):
    monkeypatch.setattr(netns, "why_not", lambda: "no unshare here")
    monkeypatch.setattr(sys, "platform", "linux")
    with pytest.raises(AgentLayerError):
        run_lab(LabSpec(str(tmp_path / "run"), [Task("t", "stand-in", "hi")]))
    assert not (tmp_path / "run" / "manifest.json").exists()


@needs_netns
def test_the_namespace_holds_only_loopback():
    """No route out: connecting to TEST-NET-1 fails at once with ENETUNREACH. On an ordinary
    host the same connect times out instead (or is refused), so the errno is what proves it."""
    probe = ("from infercourse.ops import netns; netns.bring_up_loopback(); netns.assert_only_loopback(); "
             "import socket; s = socket.socket(); s.settimeout(3)\n"
             "try:\n    s.connect(('192.0.2.1', 80)); print('REACHED')\n"
             "except OSError as e:\n    print('ERRNO', e.errno)")
    out = subprocess.run(netns.wrap([sys.executable, "-c", probe]), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ERRNO", str(errno.ENETUNREACH)], out.stdout


def test_the_agents_homes_lie_outside_a_git_repository_around_the_results(tmp_path):
    """Issue 33, the sandbox's edges: a results folder inside the course's clone handed Claude Code
    the clone's branch, status and recent commits (it finds the repository itself: a git ceiling
    did not stop it); the tasks' homes then live outside it, linked from the results folder."""
    from infercourse.ops.agent_lab_child import _homes
    plain = tmp_path / "plain" / "run"
    plain.mkdir(parents=True)
    assert _homes(plain) == plain / "homes" and not (plain / "homes").exists()
    subprocess.run(["git", "init", "-q", str(tmp_path / "clone")], check=True)
    out = tmp_path / "clone" / "build" / "results" / "run"
    out.mkdir(parents=True)
    homes = _homes(out).resolve()
    assert (out / "homes").is_symlink() and not homes.is_relative_to(tmp_path / "clone")
    assert not any((d / ".git").exists() for d in (homes, *homes.parents))
    assert _homes(out).resolve() == homes    # every task of the run: the same homes


def test_sealed_env_keeps_the_users_environment_and_keys_out(monkeypatch, tmp_path):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-real-key")
    monkeypatch.setenv("SECRET_OF_THE_USER", "x")
    env = agents.sealed_env(tmp_path / "home", route={"ANTHROPIC_BASE_URL": "http://127.0.0.1:1"})
    assert env["HOME"] == str(tmp_path / "home") and env["ANTHROPIC_API_KEY"] == agents.DUMMY_KEY
    assert "SECRET_OF_THE_USER" not in env and env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert env["DISABLE_AUTOUPDATER"] == "1"
    for k in ("HOME", "ANTHROPIC_API_KEY", "OPENAI_API_KEY"):
        with pytest.raises(AgentLayerError):
            agents.sealed_env(tmp_path / "h2", {k: "x"})
    # the lab's route is set last: the proxy's URL is what the agent gets
    routed = agents.sealed_env(tmp_path / "h3", {"ANTHROPIC_MODEL": "m"}, route={"ANTHROPIC_BASE_URL": "http://127.0.0.1:2"})
    assert routed["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:2" and routed["ANTHROPIC_MODEL"] == "m"


@pytest.mark.parametrize("name", ["ANTHROPIC_BASE_URL", "OPENAI_BASE_URL", "ANTHROPIC_BEDROCK_BASE_URL", "HTTPS_PROXY",
                                  "https_proxy", "ALL_PROXY", "NO_PROXY", "CLAUDE_CONFIG_DIR", "CODEX_HOME",
                                  "CLAUDE_CODE_USE_BEDROCK"])
def test_a_task_cannot_move_the_agent_off_the_recording_proxy(name, tmp_path):
    """A base URL, a proxy variable or a config folder in a task's env would send calls past the
    proxy ("every call captured" would not hold): refused by name, in the agent layer, before
    anything starts."""
    with pytest.raises(AgentLayerError, match=name) as e:
        run_lab(LabSpec(str(tmp_path / "run"), [Task("t", "stand-in", "hi", env={name: "http://127.0.0.1:1"})]))
    assert e.value.layer == "agent" and "recording proxy" in str(e.value)
    assert not (tmp_path / "run").exists()
    with pytest.raises(AgentLayerError):
        agents.sealed_env(tmp_path / "h", {name: "x"})
    agents.check_env({"CLAUDE_CODE_ATTRIBUTION_HEADER": "0", "API_TIMEOUT_MS": "1000"})   # the task's own settings pass


def test_agent_run_cli_refuses_an_env_that_moves_the_route(tmp_path, capsys):
    from infercourse.cli.agent import agent_main
    rc = agent_main(["run", "--agent", "stand-in", "--task", "x", "--out", str(tmp_path / "run"),
                     "--env", "ANTHROPIC_BASE_URL=http://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and "ANTHROPIC_BASE_URL" in err and "(agent layer)" in err
    assert not (tmp_path / "run").exists()


# -- the install: the lock's packages, scripts off ---------------------------------------------
def _fake_install(root, *, native=True, placeholder=True):
    """The tree `npm ci --ignore-scripts` leaves: Claude Code's placeholder, its platform package."""
    nm = root / "node_modules"
    for agent, (pkg, exe) in agents._PKG.items():
        (nm / pkg).mkdir(parents=True, exist_ok=True)
        (nm / pkg / "package.json").write_text(json.dumps({"version": agents.PINS[agent]}))
    (nm / ".bin").mkdir(exist_ok=True)
    for agent, (pkg, exe) in agents._PKG.items():
        if agent != "claude-code":     # node_modules/.bin launchers: Codex's and the spec-run agents'
            (nm / ".bin" / exe).write_text("#!/usr/bin/env node\n")
    if placeholder:
        (nm / ".bin" / "claude").write_text("placeholder: the postinstall never ran")
    if native:
        plat = nm / "@anthropic-ai" / "claude-code-linux-x64"
        plat.mkdir(parents=True)
        (plat / "claude").write_text("native")
        (plat / "package.json").write_text("{}")


def test_install_runs_npm_ci_with_scripts_off(monkeypatch, tmp_path):
    """npm runs on the host network, outside any namespace: no install script may run there."""
    monkeypatch.setattr(agents, "agents_dir", lambda: tmp_path)
    monkeypatch.setattr(agents.shutil, "which", lambda name: "/usr/bin/" + name)
    ran = []

    def npm(argv, cwd, **kw):
        ran.append(argv)
        _fake_install(Path(cwd))
        return subprocess.CompletedProcess(argv, 0, "", "")
    monkeypatch.setattr(agents.subprocess, "run", npm)
    assert "install scripts off" in agents.install()
    assert ran and ran[0][:2] == ["npm", "ci"] and "--ignore-scripts" in ran[0]


def test_claude_code_runs_from_its_platform_package(monkeypatch, tmp_path):
    """With scripts off, bin/claude stays a placeholder: the lab runs the platform package's binary."""
    monkeypatch.setattr(agents, "agents_dir", lambda: tmp_path)
    _fake_install(tmp_path)
    assert agents.binary("claude-code") == tmp_path / "node_modules/@anthropic-ai/claude-code-linux-x64/claude"
    assert agents.binary("codex") == tmp_path / "node_modules/.bin/codex" and agents.missing_reason("codex") is None
    (tmp_path / "node_modules/@anthropic-ai/claude-code-linux-x64/claude").unlink()
    assert agents.binary("claude-code") is None and "not installed" in agents.missing_reason("claude-code")


def test_the_node_version_named_is_the_locks(monkeypatch, tmp_path):
    lock = json.loads((agents.SPEC_DIR / "package-lock.json").read_text())["packages"]
    want = {a: lock[f"node_modules/{pkg}"]["engines"]["node"] for a, (pkg, _) in agents._PKG.items()}
    assert agents.node_needed() == want
    monkeypatch.setattr(agents, "agents_dir", lambda: tmp_path)
    monkeypatch.setattr(agents.shutil, "which", lambda name: None)
    for text in (agents.missing_reason("claude-code"), agents.install()):
        assert all(f"{r} for {a}" in text for a, r in want.items()) and ">= 20" not in text


def test_codex_config_is_toml_with_one_local_provider():
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads(agents.codex_config("http://127.0.0.1:9", "m", stream_max_retries=5,
                                            stream_idle_timeout_ms=4000, context_window=8192))
    p = cfg["model_providers"][cfg["model_provider"]]
    assert p["base_url"] == "http://127.0.0.1:9/v1" and p["wire_api"] == "responses"
    assert p["stream_max_retries"] == 5 and p["stream_idle_timeout_ms"] == 4000
    assert cfg["model_context_window"] == 8192 and cfg["model"] == "m"


# -- doctor agent: grading is pure ------------------------------------------------------------
GOOD = {"agent": "claude-code", "n_ctx_slot": 32768, "count_tokens_status": 200, "system_message_status": 200,
        "header_prompt_tokens": 600, "header_cached_tokens": 590, "control_prompt_tokens": 600,
        "control_cached_tokens": 599, "model_status": {"main": {"status": 200, "error": None}},
        "prefill_tok_per_s": 100.0, "served_models": ["smollm2-135m"]}
SHAPE = {"prompt_tokens": 10000, "max_tokens": 32000, "source": "test"}


def _status(checks, layer):
    return [c.status for c in checks if c.layer == layer]


def test_doctor_grades_flip_with_the_evidence():
    good = agent_doctor.grade_agent_route(GOOD, SHAPE)
    assert "fail" not in [c.status for c in good]
    small = agent_doctor.grade_agent_route({**GOOD, "n_ctx_slot": 8192}, SHAPE)
    assert _status(small, "context")[0] == "fail"
    busted = agent_doctor.grade_agent_route({**GOOD, "header_cached_tokens": 20}, SHAPE)
    assert _status(busted, "KV cache") == ["fail"]
    refused = agent_doctor.grade_agent_route({**GOOD, "system_message_status": 400,
                                              "model_status": {"haiku": {"status": 400, "error": "not found"}}}, SHAPE)
    assert _status(refused, "API").count("fail") == 2
    slow = agent_doctor.grade_agent_route({**GOOD, "prefill_tok_per_s": 10.0}, SHAPE)   # 1000 s > 600 s
    assert [c for c in slow if "cold first call" in c.summary][0].status == "fail"


def test_an_answer_that_begins_inside_a_character_warns_without_message_start():
    """Two stored CI runs of notebook 20 (2026-12-06): task C's first stream came without
    message_start, Claude Code cut it and sent the same body with stream: false. The doctor
    now asks for an answer that begins with an emoji and warns where message_start is missing."""
    from infercourse.ops.anthropic_probe import EXPECTED_EVENTS, grade_split_start
    full = list(EXPECTED_EVENTS)
    lost = {"ok": True, "begins": "\U0001f31f", "event_types": full[1:]}
    warned = [c for c in agent_doctor.grade_agent_route({**GOOD, "split_start": lost}, SHAPE)
              if "multi-byte" in c.summary]
    assert [(c.layer, c.status) for c in warned] == [("API", "warn")] and "without message_start" in warned[0].summary
    assert "sends the call again unstreamed" in warned[0].summary and warned[0].next_step is None
    assert grade_split_start({**lost, "event_types": full}).status == "ok"
    untried = grade_split_start({**lost, "begins": "Hello"})
    assert untried.status == "skip" and "'Hello'" in untried.summary            # the condition was never met
    assert grade_split_start({"ok": False, "error": "x"}) is None                 # the stream checks report that
    assert not [c for c in agent_doctor.grade_agent_route(GOOD, SHAPE) if "multi-byte" in c.summary]


def test_the_cold_prefill_forecast_follows_the_fitted_curve_not_one_rate():
    """Issue 32 §2: one short probe's rate forecast 34 s where 80 s were measured; the rate falls
    with length. Points from time = 0.05 + n/1000 + n²/1e7: the fit recovers the n² term."""
    from infercourse.ops.prefill_probe import cold_forecast, curve_lengths
    assert curve_lengths(8192) == [512, 1024, 2048] and curve_lengths(3000) == [250, 500, 1000]
    pts = [(n, 0.05 + n / 1000 + n * n / 1e7) for n in (512, 1024, 2048)]
    secs, how = cold_forecast(10_000, {"prefill_points": pts, "prefill_tok_per_s": 2048 / pts[-1][1]})
    assert abs(secs - 20.05) < 0.1 and "extrapolated" in how and "fitted to 3 cold prefills" in how
    assert re.search(r"at the longest probe's own rate it would be 12 s", how)      # 10,000 x 2.5 s / 2,048
    near, said_near = cold_forecast(3000, {"prefill_points": pts})
    assert "longest probe's own rate" not in said_near                               # 1.5x the longest: the fit alone
    one_rate, said = cold_forecast(10_000, {"prefill_tok_per_s": 2048 / pts[-1][1]})
    assert one_rate < 0.7 * secs and "lower bound" in said
    assert cold_forecast(10_000, {}) is None
    slow = agent_doctor.grade_agent_route({**GOOD, "prefill_points": pts}, {**SHAPE, "prompt_tokens": 10_000},
                                          timeout_s=30)
    line = [c for c in slow if "cold first call" in c.summary][0]
    assert line.status == "warn" and "about 20 s of prefill" in line.summary


def test_a_grown_step_is_priced_as_the_cold_prefill_of_its_whole_prompt():
    """The curve's steps grow one prompt: a step the server found cached up to the step before
    is that step's time plus the new tokens' (time = n/1000: each point equals a cold prefill)."""
    from infercourse.ops.prefill_probe import grown_point
    pts = [grown_point([], 512, 512, 0.512)]                              # nothing cached: as measured
    pts.append(grown_point(pts, 1024, 516, 0.516))                        # 508 cached: the template's end re-evaluated
    assert pts[-1][0] == 1024 and abs(pts[-1][1] - 1.024) < 1e-9
    assert grown_point(pts, 2048, 2048, 2.048) == (2048, 2.048)           # a server that reused nothing: cold
    assert grown_point([], 500, 490, 0.49) == (500, 0.5)                  # a few template tokens cached before the curve


@pytest.mark.slow
def test_the_prefill_curve_costs_one_prefill_of_its_longest_step():
    """Three cold probes evaluated 512 + 1,024 + 2,048 tokens on each doctor's server; grown from
    one prompt, the server evaluates about the longest, and each point still prices a cold prefill."""
    import httpx

    from infercourse.measure.server_samples import prometheus_values
    from infercourse.ops.prefill_probe import probe_curve
    from infercourse.servers import LlamaServer
    key = "llamacpp:prompt_tokens_total"
    with LlamaServer(n_parallel=1, ctx_size=2048, threads=1, jinja=True) as srv:
        evaluated = lambda: prometheus_values(httpx.get(srv.url + "/metrics").text)[key]   # noqa: E731
        before = evaluated()
        pts = probe_curve(srv.url, "m", [128, 256, 512])
        spent = evaluated() - before
    assert [n for n, _ in pts] == sorted(n for n, _ in pts) and 500 < pts[-1][0] < 650 and len(pts) == 3
    assert spent < 1.1 * pts[-1][0], f"the server evaluated {spent:.0f} tokens for a curve to {pts[-1][0]}"
    assert all(b[1] > a[1] for a, b in zip(pts, pts[1:]))       # a longer prompt's cold prefill takes longer


def test_the_doctor_prints_its_forecast_beside_the_cold_call_the_run_measured(monkeypatch):
    """Notebook 20 (2026-12-06): the doctor on the 32,768-token server forecast 72 s for the
    12,394-token first request, two cells after the run measured 102.6 s on a server of that size,
    and said nothing of it. The line puts the run's cold call beside the same fit's forecast."""
    import infercourse.ops.agent_lab as agent_lab
    from infercourse.ops.prefill_probe import forecast_against_capture
    pts = [(n, 0.05 + n / 1000 + n * n / 1e7) for n in (512, 1024, 2048)]     # 10,000 tokens: 20.05 s
    calls = pd.DataFrame({"status": ["error", "ok", "ok"], "cached_tokens": [None, 0, 9999],
                          "prompt_tokens": [None, 10_000, 10_000], "ttft_s": [None, 40.1, 0.2]})
    monkeypatch.setattr(agent_lab, "calls_table", lambda capture: calls)
    line, = forecast_against_capture({"prefill_points": pts}, "run")
    assert "its cold call of 10,000 tokens waited 40.1 s" in line and "forecast 20 s for it (0.50x)" in line
    monkeypatch.setattr(agent_lab, "calls_table", lambda capture: calls.iloc[[0, 2]])    # nothing cold answered
    assert forecast_against_capture({"prefill_points": pts}, "run") == []
    monkeypatch.setattr(agent_lab, "calls_table", lambda capture: calls)
    assert forecast_against_capture({}, "run") == []                                    # the probe gave no rate


def test_doctor_fixes_follow_the_findings():
    checks = agent_doctor.grade_agent_route({**GOOD, "header_cached_tokens": 20}, SHAPE)
    env = json.loads(agent_doctor.fixes("claude-code", "http://127.0.0.1:8", GOOD, SHAPE, checks))["env"]
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0" and env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768"
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in env       # read as >= 100k by the pinned client: no fix
    cap = int(env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"])            # the session grows before it compacts
    lim = agents.claude_window_limits(32768, cap)
    assert cap >= agents.CLAUDE_MIN_ANSWER_CAP and lim["compacts_above"] - int(SHAPE["prompt_tokens"]) >= agents.CLAUDE_GROWTH
    assert env["ANTHROPIC_AUTH_TOKEN"] and env["ANTHROPIC_DEFAULT_SONNET_MODEL"] == env["ANTHROPIC_MODEL"] \
        == env["ANTHROPIC_DEFAULT_OPUS_MODEL"]                 # a fresh install asks no login; subagents' aliases
    assert int(env["API_TIMEOUT_MS"]) >= 600000
    clean = json.loads(agent_doctor.fixes("claude-code", "http://127.0.0.1:8", GOOD, SHAPE,
                                          agent_doctor.grade_agent_route(GOOD, SHAPE)))["env"]
    assert "CLAUDE_CODE_ATTRIBUTION_HEADER" not in clean
    slow = {**GOOD, "prefill_tok_per_s": 5.0}   # a 2000 s cold prefill: the timeout must exceed it
    assert int(json.loads(agent_doctor.fixes("claude-code", "u", slow, SHAPE, []))["env"]["API_TIMEOUT_MS"]) > 2000_000
    assert "stream_idle_timeout_ms" in agent_doctor.fixes("codex", "http://127.0.0.1:8", GOOD, SHAPE, checks)


def test_the_printed_timeout_covers_the_curves_forecast_not_the_short_probes():
    """The settings' API_TIMEOUT_MS comes from the same fitted curve as the cold-prefill check
    beside it (it once came from one short probe's rate, and could sit below the forecast)."""
    from infercourse.ops.prefill_probe import cold_forecast
    pts = [(n, 0.05 + n / 1000 + n * n / 3.5e5) for n in (512, 1024, 2048)]
    ev, shape = {**GOOD, "prefill_points": pts, "prefill_tok_per_s": 2048 / pts[-1][1]}, {**SHAPE, "prompt_tokens": 10_000}
    curve = cold_forecast(10_000, ev)[0]
    assert 10_000 / ev["prefill_tok_per_s"] * 3 < 600 < curve * 3      # one rate: the default would do; the curve: not
    ms = int(json.loads(agent_doctor.fixes("claude-code", "u", ev, shape, []))["env"]["API_TIMEOUT_MS"])
    assert ms >= 3 * curve * 1000 - 1


def test_claude_budget_sizes_window_cap_and_compaction_line_together():
    """Issue 33 §3: the doctor's old window (first + 13,256) put the compaction line on the first
    request, and its cap (window - 13,000 - first) was 403 tokens: every call compacted, and tasks
    ended 'exceeded the 403 output token maximum'."""
    b = agents.claude_budget(10_636)
    assert b["window"] % 256 == 0 and b["answer_cap"] >= agents.CLAUDE_ANSWER_CAP and b["fits"]
    assert b["compacts_above"] - 10_636 >= agents.CLAUDE_GROWTH > 0 and b["refuses_above"] > b["compacts_above"]
    old = agents.claude_budget(10_636, 24_064)                   # the old doctor's window: no room for both
    assert not old["fits"] and old["answer_cap"] == agents.CLAUDE_MIN_ANSWER_CAP
    big = agents.claude_budget(10_636, 200_000)                  # a big window: the agent's own 32,000
    assert big["answer_cap"] == 32_000 and big["compacts_above"] == 200_000 - 20_000 - 13_000
    from infercourse.ops.agent_budget import budget_line
    line = budget_line(10_636, 65_536, label="30B at 64k")
    assert line.startswith("30B at 64k: window 65,536") and f"{65_536 - 20_000 - 13_000:,}" in line
    assert "too little" in budget_line(10_636, 24_064) and "too little" not in line


def test_doctor_names_the_servers_fix_with_the_window_the_agent_needs():
    # fits, with room under Claude Code's compaction line: nothing for the server to change
    assert agent_doctor.server_fix("claude-code", GOOD, SHAPE) is None
    need = agent_doctor.window_needed("claude-code", SHAPE)
    assert need == -(-(10000 + agents.CLAUDE_GROWTH + 13000 + agents.CLAUDE_ANSWER_CAP) // 256) * 256 and need % 256 == 0
    small = {**GOOD, "n_ctx_slot": 8192, "n_ctx_train": 8192}
    fix = agent_doctor.server_fix("claude-code", small, SHAPE)
    assert "does not fit the slot's 8,192" in fix and f"-c {need} -np 1" in fix and "--rope-scaling yarn" in fix
    # fits the first request, but the compaction line falls below it: the fix says so
    tight = agent_doctor.server_fix("claude-code", {**GOOD, "n_ctx_slot": 16384, "n_ctx_train": 65536}, SHAPE)
    assert "compacts after a step or two" in tight and "yarn" not in tight   # within the trained context
    assert agent_doctor.server_fix("codex", {**GOOD, "n_ctx_slot": 16384}, SHAPE) is None
    # the agent's settings go with the server as fixed
    env = json.loads(agent_doctor.fixes("claude-code", "u", small, SHAPE, []))["env"]
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(need)
    text = agent_doctor.report("claude-code", "u", small, SHAPE, agent_doctor.grade_agent_route(small, SHAPE))
    assert "[fail] context" in text and "server: " in text and "(with the server's fix)" in text
    assert f"Claude Code on the window the server's fix below asks for: window {need:,}" in text   # not "this window"
    ok = agent_doctor.report("claude-code", "u", GOOD, SHAPE, agent_doctor.grade_agent_route(GOOD, SHAPE))
    assert f"Claude Code on this server's window: window {GOOD['n_ctx_slot']:,}" in ok

    # a server already extended with YaRN reports the override as n_ctx_train; the fix reads the
    # model's file, so the YaRN it prints starts from what the model was trained on
    ext = {**small, "n_ctx_slot": 16384, "arch": "llama", "n_ctx_train": 8192, "trained_from": "its model file"}
    fix = agent_doctor.server_fix("claude-code", ext, SHAPE)
    assert "--yarn-orig-ctx 8192" in fix and "llama.context_length=int:" in fix and "ARCH" not in fix


def test_the_trained_context_comes_from_the_served_file_not_an_override(tmp_path):
    from infercourse.models.embedded import embedded_gguf
    from infercourse.ops.agent_lab import served_trained_context
    overridden = [{"id": "m", "meta": {"n_ctx_train": 32768}}]   # what --override-kv makes the server say
    assert served_trained_context({"model_path": str(embedded_gguf())}, overridden) == ("llama", 8192, "its model file")
    arch, trained, where = served_trained_context({"model_path": str(tmp_path / "elsewhere.gguf")}, overridden)
    assert (arch, trained) == (None, 32768) and "override" in where   # a file not on this machine: the server's word


# -- the sentences 20 computes -----------------------------------------------------------------
def _tab(**rows):
    return pd.DataFrame(rows).T


def _says(text: str, phrase: str) -> bool:
    return re.search(rf"\b{re.escape(phrase)}\b", text) is not None


def test_cold_warm_sentence_flips_with_the_aa_spread():
    base = dict(evaluated_tokens=1000, prompt_tokens=1000)
    tab = _tab(cold={**base, "ttft_s": 20.0}, warm={**base, "ttft_s": 1.0}, again={**base, "ttft_s": 1.1})
    s = rc.cold_warm_sentence(tab, "cold", "warm", "again")
    assert _says(s, "beyond it") and _says(s, "20x faster warm")
    assert "The cold call evaluated 1,000 prompt tokens" in s and "again evaluated 1,000 and waited" in s
    close = _tab(cold={**base, "ttft_s": 1.2}, warm={**base, "ttft_s": 1.0}, again={**base, "ttft_s": 1.5})
    s = rc.cold_warm_sentence(close, "cold", "warm", "again")
    assert _says(s, "within it") and not _says(s, "faster") and not _says(s, "slower")


@pytest.mark.parametrize("cold, fold, word", [(1.3, "1.3x", "faster"), (0.5, "2.0x", "slower"), (0.25, "4.0x", "slower"),
                                              (30.0, "30x", "faster")])
def test_cold_warm_sentence_names_the_fold_both_ways(cold, fold, word):
    """A ratio of 1.2-1.49 is not "1x", and a slower warm call is its inverse, never "0x slower"."""
    base = dict(evaluated_tokens=1000, prompt_tokens=1000)
    tab = _tab(cold={**base, "ttft_s": cold}, warm={**base, "ttft_s": 1.0}, again={**base, "ttft_s": 1.0})
    s = rc.cold_warm_sentence(tab, "cold", "warm", "again")
    assert _says(s, f"{fold} {word} warm"), s
    assert not re.search(r"(?<![\d.])[01]x\b", s) and _says(s, "beyond it")   # never a bare "0x" or "1x"


def test_header_sentence_flips():
    on = dict(evaluated_tokens=900, prompt_tokens=1000, first_diff="system 0")
    off = dict(evaluated_tokens=20, prompt_tokens=1000, first_diff="message 0 (user)")
    assert _says(rc.header_sentence(_tab(on=on, off=off), "on", "off"), "A larger share of its prompt with the header on")
    assert "evaluated 900 of its 1,000 prompt tokens (90%)" in rc.header_sentence(_tab(on=on, off=off), "on", "off")
    assert _says(rc.header_sentence(_tab(on=off, off=on), "on", "off"), "A smaller share of its prompt with the header on")
    same = rc.header_sentence(_tab(on=on, off=dict(off, evaluated_tokens=900)), "on", "off")
    assert _says(same, "The same share with the header on as off") and not re.search(r"\b(larger|smaller)\b", same)
    unknown = dict(off, prompt_tokens=float("nan"))
    assert "gave no prompt size" in rc.header_sentence(_tab(on=on, off=unknown), "on", "off")
    assert _says(rc.header_sentence(_tab(on=on, off=unknown), "on", "off"), "cannot compare the shares")


def test_header_sentence_compares_shares_across_sizes_and_prices_the_full_size():
    """C may run at the agent's small size beside a full-size B: fewer tokens but all of its prompt
    is a larger share, and at the full size that is the cold task's whole prefill, read from its row."""
    small_on = dict(evaluated_tokens=1055, prompt_tokens=1058, first_diff="system 0", ttft_s=5.0)
    big_off = dict(evaluated_tokens=2329, prompt_tokens=12389, first_diff="message 0 (user)", ttft_s=36.0)
    cold = dict(evaluated_tokens=12389, prompt_tokens=12389, first_diff="first call", ttft_s=109.48)
    s = rc.header_sentence(_tab(on=small_on, off=big_off, cold=cold), "on", "off", cold="cold")
    assert _says(s, "A larger share of its prompt with the header on"), s
    assert "at the full size (cold's 12,389 tokens) that is cold's cold prefill, 109.5 s" in s
    partial = rc.header_sentence(_tab(on=dict(small_on, evaluated_tokens=500), off=big_off, cold=cold), "on", "off", cold="cold")
    assert "cold prefill" not in partial   # only a request evaluated whole again is priced at the full size
    same_size = rc.header_sentence(_tab(on=dict(cold, first_diff="system 0"), off=big_off, cold=cold), "on", "off", cold="cold")
    assert "at the full size" not in same_size   # a full-size C measured its own cost


def test_claude_window_limits_follow_the_pinned_arithmetic():
    told = agents.claude_window_limits(16408, max_output=64)
    assert told["compacts_above"] == 16408 - 64 - 13000 and told["refuses_above"] == 16408 - 64 - 3000
    uncapped = agents.claude_window_limits(32768)          # 32,000 output tokens: 20,000 reserved
    assert uncapped["compacts_above"] == 32768 - 20000 - 13000 < 0


def test_compaction_plan_sizes_the_window_and_its_sentence_flips(monkeypatch):
    monkeypatch.setattr(agent_growth, "session_pastes", lambda turns, n, last=None: ["w " * n] * turns)
    up = lambda n: -(-n // 256) * 256   # noqa: E731 - the server's cache steps
    big = ra.compaction_plan(800, 6, 4000, max_output=64, growth_pastes=1.0, count=words)
    # the window is sized from the line: first turn + growth, plus the agent's reserves
    assert big["window"] == up(800 + 4000 + 4000 + 13064)
    assert big["first_turn"] + 4000 <= big["compacts_above"] < big["first_turn"] + 4000 + 256
    assert big["last_turn"] == 800 + 6 * 4000 > big["window"]
    s = rc.plan_sentence(big)
    assert "outgrows the server in its last turn" in s and "compacts once the session has grown" in s
    # short pastes: as is, the session stays inside the window; told, it compacts after 100 tokens
    small = ra.compaction_plan(800, 2, 200, max_output=64, growth_pastes=0.5, count=words)
    assert small["window"] == up(800 + 200 + 100 + 13064) and small["compacts_above"] >= 1100
    s = rc.plan_sentence(small)
    assert "does not outgrow this server" in s and "compacts once the session has grown" in s
    assert "compacts at every call" in rc.plan_sentence({**small, "compacts_above": 900})
    assert "refuses to send at all" in rc.plan_sentence({**small, "refuses_above": 900})
    assert ra.told_env(big) == {"CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(big["window"])}
    # issue 33: the told agent compacted at every turn with its line under a paste above the first
    # turn; the line is now set in pastes, and the plan says how many pastes up it sits
    every_second = ra.compaction_plan(800, 8, 2000, max_output=64, growth_pastes=2.0, count=words)
    assert every_second["growth"] == 4000 and every_second["window"] == up(800 + 2000 + 4000 + 13064)
    assert f"{every_second['compacts_above'] - 2800:,} tokens above the first turn" in rc.plan_sentence(every_second)
    assert f"(about {(every_second['compacts_above'] - 2800) / 2000:.1f} pastes)" in rc.plan_sentence(every_second)


def test_the_last_paste_outgrows_the_window_as_is_and_fits_the_told_agent_after_a_compaction(monkeypatch):
    # issue 33 (pace): grown in equal pastes, the session as is paid every turn past the told line and the
    # agent's 13,000-token buffer at the far end of the window; the last paste now takes it past the window
    def pastes(turns, n, last=None):
        return ["w " * n] * (turns - 1) + ["w " * (n if last is None else last)]
    monkeypatch.setattr(agent_growth, "session_pastes", pastes)
    plan = ra.compaction_plan(1000, 6, 1300, max_output=64, growth_pastes=2.0, outgrow=True, count=words)
    before = 1000 + 5 * 1300
    assert plan["last_paste_tokens"] == plan["last_words"] == plan["window"] - before + 650
    assert plan["last_turn"] == before + plan["last_paste_tokens"] > plan["window"]
    assert plan["told_last"] == 1000 + plan["last_paste_tokens"] < plan["refuses_above"]
    s = rc.plan_sentence(plan)
    assert "outgrows the server in its last turn" in s and f"the last {plan['last_paste_tokens']:,} at once" in s
    assert f"{plan['refuses_above'] - plan['told_last']:,} under its refuse line" in s
    assert "cannot send that turn either" in rc.plan_sentence({**plan, "refuses_above": plan["told_last"] - 1})
    same = ra.compaction_plan(1000, 6, 1300, max_output=64, growth_pastes=2.0, count=words)
    assert "last_paste_tokens" not in same and same["last_turn"] == 1000 + 6 * 1300 < plan["last_turn"]
    assert "at once" not in rc.plan_sentence(same)


def test_session_pastes_read_on_and_the_last_paste_can_be_longer():
    normal, longer = agent_growth.session_pastes(3, 50), agent_growth.session_pastes(3, 50, 400)
    assert [len(p.split()) for p in normal] == [50, 50, 50] and [len(p.split()) for p in longer] == [50, 50, 400]
    assert longer[:2] == normal[:2] and longer[2].startswith(normal[2])
    n, tokens = agent_growth.last_paste_words(3, 50, 300, words)
    assert n == tokens == 300


def _session_run(monkeypatch, message_tokens, prompts, errors, tasks, diffs=None, messages=None):
    """A synthetic lab folder's tables, for `session_view`: 500 tokens of tools, then one message
    (or `messages`: each call's messages, their tokens);
    each call's first difference (part, tokens kept before it) from `diffs`, or: a call whose
    messages shrink replaced the first message (a rewrite), any other appended to the history."""
    n = len(prompts)
    diffs = diffs or [("first call", 0)] + [("message 0 (user)", 500) if m < prev else ("message 2 (user)", 500 + prev)
                                            for prev, m in zip(message_tokens, message_tokens[1:])]
    calls = pd.DataFrame({"request_id": range(n), "task": [t for t, k in tasks for _ in range(k)], "api": "anthropic",
                          "status": ["error" if e else "ok" for e in errors], "error": errors,
                          "prompt_tokens": prompts, "cached_tokens": 0, "output_tokens": 8, "stop_reason": "end_turn",
                          "first_diff": [d for d, _ in diffs], "tokens_before_diff": [k for _, k in diffs]})
    monkeypatch.setattr(rs, "calls_table", lambda out: calls)
    turns = pd.DataFrame({"task": [t for t, _ in tasks], "exit": [0 if k else 1 for _, k in tasks],
                          "terminal_reason": [None if k else "blocking_limit" for _, k in tasks],
                          "assumed_context_window": [{"m": 1_000_000}] * len(tasks), "query_sources": [["sdk"]] * len(tasks)})
    monkeypatch.setattr(rs, "tasks_table", lambda out: turns)
    monkeypatch.setattr(rs, "anatomy", lambda out: [
        {"request_id": i, "parts": [{"kind": "tool", "tokens": 500}]
         + [{"kind": "message", "tokens": t} for t in (messages[i] if messages else [m])]}
        for i, m in enumerate(message_tokens)])
    return rs.session_view("unused")


def test_a_rewrite_that_adds_a_long_paste_is_one_and_a_summary_request_after_a_refused_paste_is_not(monkeypatch):
    # issue 33 (pace): the session's last turn pastes a long file. As is, the server refuses it; the agent's
    # summary request drops that paste (most of the refused call's messages) and keeps the history: not a
    # rewrite (it counted as one). Told, the call from the summary adds the paste, so its messages grow:
    # it is a rewrite (it was missed)
    refusal = "request (12600 tokens) exceeds the available context size (9000 tokens), try increasing it"
    as_is = _session_run(monkeypatch, [4000, 12000, 5400, 8300], [4500, None, 5900, 8800], [None, refusal, None, None],
                         [("t0", 1), ("t1", 3)], messages=[[4000], [4000, 8000], [4000, 1400], [300, 8000]],
                         diffs=[("first call", 0), ("message 1 (user)", 4500), ("message 1 (user)", 4500),
                                ("message 0 (user)", 500)])
    assert list(as_is["rewrote_history"]) == [False, False, False, True]
    told = _session_run(monkeypatch, [4000, 5400, 8300], [4500, 5900, 8800], [None] * 3, [("t0", 1), ("t1", 2)],
                        messages=[[4000], [4000, 1400], [300, 8000]],
                        diffs=[("first call", 0), ("message 1 (user)", 4500), ("message 0 (user)", 500)])
    assert list(told["rewrote_history"]) == [False, False, True]


def _two_sessions(monkeypatch):
    """As is: grows until the server refuses its last call. Told: rewritten in t2, then t4 not sent."""
    refusal = "request (9100 tokens) exceeds the available context size (9000 tokens), try increasing it"
    as_is = _session_run(monkeypatch, [2000, 4000, 6000, 8600], [2500, 4500, 6500, None], [None, None, None, refusal],
                         [("t0", 1), ("t1", 1), ("t2", 1), ("t3", 1)])
    told = _session_run(monkeypatch, [2000, 4000, 5400, 1500, 3500], [2500, 4500, 5900, 2000, 4000], [None] * 5,
                        [("t0", 1), ("t1", 1), ("t2", 2), ("t3", 1), ("t4", 0)])
    return as_is, told


def test_session_view_marks_the_rewrite_and_the_refusals(monkeypatch):
    as_is, told = _two_sessions(monkeypatch)
    assert not as_is["rewrote_history"].any() and as_is["prompt_tokens"].iloc[-1] == 9100   # the refusal's own count
    assert list(as_is["refused_by"].fillna("-")) == ["-", "-", "-", "server"]
    assert list(told["rewrote_history"].fillna(False)) == [False, False, False, True, False, False]
    # messages that shrink while the first one stays (a summary request dropping the newest turn), or
    # a first message edited past its start (a summary request's instructions reworded): no rewrite
    kept = _session_run(monkeypatch, [2000, 6000, 5000, 4900], [2500, 6500, 5500, 5400], [None] * 4,
                        [("t0", 1), ("t1", 3)], diffs=[("first call", 0), ("message 2 (user)", 2500),
                                                       ("message 2 (user)", 5000), ("message 0 (user)", 4000)])
    assert not kept["rewrote_history"].any()
    # a summary that came back word for word as the last one (greedy answers) keeps the first message:
    # the history after it was replaced all the same (issue 33: 20's told session, turns 4 and 6, unmarked)
    again = _session_run(monkeypatch, [2000, 6000, 2500, 6000, 2500], [2500, 6500, 3000, 6500, 3000], [None] * 5,
                         [("t0", 1), ("t1", 1), ("t2", 1), ("t3", 1), ("t4", 1)],
                         diffs=[("first call", 0), ("message 2 (user)", 2500), ("message 0 (user)", 500),
                                ("message 2 (user)", 3000), ("message 3 (user)", 800)])
    assert list(again["rewrote_history"]) == [False, False, True, False, True]
    header = _session_run(monkeypatch, [2000, 6000, 3000], [2500, 6500, 3500], [None] * 3, [("t0", 1), ("t1", 2)],
                          diffs=[("first call", 0), ("message 2 (user)", 2500), ("system 0", 20)])
    assert list(header["rewrote_history"]) == [False, False, True]   # the billing header follows the first message
    assert told["status"].iloc[-1] == "not sent" and told["refused_by"].iloc[-1] == "agent"


def test_compaction_sentence_flips_with_what_each_session_did(monkeypatch):
    as_is, told = _two_sessions(monkeypatch)
    told = told.iloc[:-1]
    s = rc.compaction_sentence(as_is, told, 9000)
    assert "the server refused 1 of its 4 calls, the first in t3" in s and "its history was never rewritten" in s
    assert "rewrote its history 1 time(s), in t2, and the prompt dropped: 5,900 tokens on the call before the " \
           "first, 2,000 on the rewritten call" in s
    twice = _session_run(monkeypatch, [2000, 4000, 1500, 3500, 1500], [2500, 4500, 2000, 4000, 2000], [None] * 5,
                         [("t0", 1), ("t1", 1), ("t2", 1), ("t3", 1), ("t4", 1)])
    assert "rewrote its history 2 time(s), in t2 and t4, and the prompt dropped" in rc.compaction_sentence(
        as_is, twice, 9000)   # each compaction's turn named, not only the first (issue 33: every turn or every second)
    assert s.endswith("the server refused none of its calls; as is, the session outgrew the server (refused for size in t3).")
    never_full = as_is.iloc[:-1]
    assert "does not show a refusal that compaction prevented" in rc.compaction_sentence(never_full, told, 9000)
    no_compaction = told.assign(rewrote_history=False)
    assert "did not compact in this run" in rc.compaction_sentence(as_is, no_compaction, 9000)
    late = _session_run(monkeypatch, [2000, 4000, 8600, 3000], [2500, 4500, None, 3500],
                        [None, None, "request (9100 tokens) exceeds the available context size (9000 tokens)", None],
                        [("t0", 1), ("t1", 1), ("t2", 2)])
    assert s.endswith("as is, the session outgrew the server (refused for size in t3).")
    assert rc.compaction_sentence(late, told, 9000).endswith(   # it compacted after the refusal, and went on
        "as is, the session outgrew the server (refused for size in t2), and the agent compacted only after that refusal.")
    grew_back = told.assign(prompt_tokens=[2500, 4500, 5900, 6000, 7000])
    assert "the prompt did not drop" in rc.compaction_sentence(as_is, grew_back, 9000)
    started = no_compaction.assign(compact_logged=no_compaction["turn"] == "t2", ended=["ok"] * 4 + ["timeout"])
    s = rc.compaction_sentence(as_is, started, 9000)
    assert "logged a compaction query in t2, but no call started from a summary" in s
    assert "1 turn(s) hit the task's time bound" in s and "did not finish a compaction in this run" in s


def test_each_task_ends_in_the_agents_own_words():
    """Issue 33 §2: a turn cut by the answer cap, a blocking_limit, a Codex failure and a lab
    timeout were all 'ended: error' or worse, 'completed'; the agent's own result says which."""
    from infercourse.ops.agent_lab import agent_outcome
    cut = {"exit": 1, "is_error": True, "subtype": "success",
           "result_preview": "API Error: Claude's response exceeded the 64 output token maximum."}
    assert agent_outcome(cut).startswith("api_error: API Error: Claude's response exceeded the 64")
    assert agent_outcome({"exit": 1, "terminal_reason": "blocking_limit", "result_preview": ""}) == "prompt_too_long"
    assert agent_outcome({"exit": 0, "is_error": False, "subtype": "success", "result_preview": "Done."}) == "completed"
    assert agent_outcome({"exit": 0, "is_error": False, "subtype": "success",
                          "result_preview": "I can't help with that."}) == "refused"
    assert agent_outcome({"exit": 1, "codex_last_event": "turn.failed", "codex_error": "stream disconnected"}) == \
        "api_error: stream disconnected"
    assert agent_outcome({"exit": 0, "codex_last_event": "turn.completed", "result_preview": ""}) == "completed"
    assert agent_outcome({"exit": "timeout"}) == "timeout" and agent_outcome({"exit": 3}) == "error (exit 3)"
    thrash = {"exit": 1, "is_error": True, "subtype": "success", "terminal_reason": "rapid_refill_breaker",
              "result_preview": "Autocompact is thrashing: the context refilled to the limit within 3 turns"}
    assert agent_outcome(thrash).startswith("rapid_refill_breaker: Autocompact is thrashing")
    # Qwen Code exits 0, calls it a success and answers with the server's refusal (seen on 20's default server)
    qwen = {"exit": 0, "is_error": False, "subtype": "success", "result_preview":
            "[API Error: 400 request (11313 tokens) exceeds the available context size (8192 tokens)]"}
    assert agent_outcome(qwen).startswith("api_error: [API Error: 400 request (11313 tokens)")
    assert agent_outcome({**qwen, "result_preview": "The log says: API Error 400."}) == "completed"


def test_the_compaction_sentence_reports_each_turns_end_in_the_agents_words(monkeypatch):
    as_is, told = _two_sessions(monkeypatch)
    told = told.iloc[:-1].assign(agent_said=lambda d: d["turn"].map(
        {"t0": "api_error: API Error: Claude's response exceeded the 64 output token maximum. To configure th",
         "t1": "completed", "t2": "api_error: stream disconnected", "t3": "completed"}))
    s = rc.compaction_sentence(as_is, told, 9000)
    assert "in the agent's words: t0 api_error (the answer cap), t1 completed, t2 api_error, t3 completed." in s
    assert re.search(r"\bagent compacted \(yet 2 of its turns did not complete\)", s)
    done = told.assign(agent_said="completed")
    assert "did not complete" not in rc.compaction_sentence(as_is, done, 9000)


def test_amplification_counts_identical_resends_of_the_first_request(tmp_path, monkeypatch):
    calls = pd.DataFrame({"task": ["short"] * 4 + ["long"] * 2, "api": "anthropic",
                          "first_diff": ["first call", "identical", "identical", "message 3 (user)", "system 0", "message 1"],
                          "status": ["error", "error", "ok", "ok", "ok", "ok"],
                          "prompt_tokens": [None, None, 1000, 1100, 1000, 1100],
                          "evaluated_tokens": [1000, 1000, 1000, 100, 1000, 100]})
    monkeypatch.setattr(ra, "calls_table", lambda out: calls)
    tab = ra.amplification(tmp_path)
    assert tab.loc["short", "copies"] == 3 and tab.loc["short", "amplification"] == 3.0
    assert tab.loc["long", "copies"] == 1 and tab.loc["long", "amplification"] == 1.0
    s = rc.amplification_sentence(tab, "short", "long")
    assert "short timeout the agent sent 3 copies of its first request, 1 answered" in s and "(3.0x)" in s
    assert "long one it sent its first request once (no retry)" in s and "(1.0x)" in s
    assert "the server evaluated 3,000 prompt tokens for a request of 1,000 (3.0x)" in s   # as every other sentence
    flipped = rc.amplification_sentence(tab, "long", "short")      # the numbers the other way round
    assert "short timeout the agent sent its first request once (no retry)" in flipped
    assert "long one it sent 3 copies of its first request" in flipped


def test_overlapping_copies_are_counted_once_from_the_task_counter(tmp_path, monkeypatch):
    """Issue 33 §2: Codex's two copies overlapped, each call's /metrics delta held copy 1's
    prefill, and the table said 2.0x where the server's log showed a 1-token second prefill.
    A cut, overlapped copy has no count of its own: the task's counter (every call a copy) holds both."""
    calls = pd.DataFrame({"task": ["codex"] * 2, "api": "openai-responses", "first_diff": ["first call", "identical"],
                          "status": ["error", "ok"], "prompt_tokens": [None, 5968], "evaluated_tokens": [None, 1]})
    monkeypatch.setattr(ra, "calls_table", lambda out: calls)
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"task": "codex", "exit": 0, "evaluated_tokens": 5969}) + "\n")
    tab = ra.amplification(tmp_path)
    assert tab.loc["codex", "server_evaluated"] == 5969 and round(tab.loc["codex", "amplification"], 3) == 1.0
    calls.loc[0, "evaluated_tokens"] = 5968              # a copy the server counted itself: the per-call sum
    assert ra.amplification(tmp_path).loc["codex", "server_evaluated"] == 5969


def test_a_first_call_without_usage_takes_its_size_from_its_identical_copy(tmp_path, monkeypatch):
    """Seen at the agent's small size (2026-12-06): the task's first stream was cut by the agent and
    sent again unchanged; the first call has the server's evaluated count but no usage, and the
    header sentence could not compare shares. The identical copy carries the same prompt."""
    calls = pd.DataFrame({"task": ["B", "C", "C"], "api": "anthropic", "status": "ok",
                          "first_diff": ["message 0 (user)", "system 0", "identical"],
                          "prompt_tokens": [1023, None, 1077], "cached_tokens": [744, None, 1076],
                          "evaluated_tokens": [279, 1074, 1], "ttft_s": [1.8, 7.0, None], "output_tokens": 3,
                          "max_tokens": 64})
    monkeypatch.setattr(ra, "calls_table", lambda out: calls)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"task": k, "agent": "claude-code", "exit": 0,
                                                              "evaluated_tokens": e, "wall_s": 1.0}) + "\n"
                                                  for k, e in (("B", 279), ("C", 1075))))
    tab = ra.evaluated_by_task(tmp_path)
    assert (tab.loc["C", "prompt_tokens"], tab.loc["C", "cached_tokens"], tab.loc["C", "evaluated_tokens"]) == (1077, 3, 1074)
    assert tab.loc["B", "prompt_tokens"] == 1023 and tab.loc["C", "calls"] == 2
    assert "cannot compare" not in rc.header_sentence(tab, "C", "B")
    calls.loc[2, "first_diff"] = "message 1 (user)"      # a later call with another prompt: not the same size
    assert pd.isna(ra.evaluated_by_task(tmp_path).loc["C", "prompt_tokens"])


def test_amplification_sizes_a_request_no_copy_answered(tmp_path, monkeypatch):
    """A client that gave up on every copy leaves no usage: the size comes from the server's
    refusal where it named one, else from the captured body's parts, and the sentence says so."""
    refusal = "request (1200 tokens) exceeds the available context size (1024 tokens)"
    calls = pd.DataFrame({"request_id": [0, 1, 2, 3], "task": ["cut", "cut", "refused", "refused"], "api": "anthropic",
                          "first_diff": ["first call", "identical", "first call", "identical"],
                          "status": ["error"] * 4, "error": ["timeout", "timeout", refusal, refusal],
                          "prompt_tokens": [None] * 4, "evaluated_tokens": [900, 900, 0, 0]})
    monkeypatch.setattr(ra, "calls_table", lambda out: calls)
    monkeypatch.setattr(ra, "anatomy", lambda out: [{"request_id": 0, "parts": [{"tokens": 600}, {"tokens": 300}]}])
    tab = ra.amplification(tmp_path)
    assert tab.loc["cut", "request_tokens"] == 900 and tab.loc["cut", "size_from"] == "request body"
    assert tab.loc["cut", "amplification"] == 2.0
    assert tab.loc["refused", "request_tokens"] == 1200 and tab.loc["refused", "size_from"] == "server refusal"
    s = rc.amplification_sentence(tab, "cut", "refused")
    assert "counted from the captured body: no copy was answered) (2.0x)" in s
    assert "the size the server's refusal named" in s
    monkeypatch.setattr(ra, "anatomy", lambda out: [])
    none = ra.amplification(tmp_path)
    assert none["amplification"].isna()["cut"] and "no amplification computed" in rc.amplification_sentence(none, "cut", "refused")


# -- the lab, end to end, with the stand-in agent on a real llama-server ----------------------
@pytest.fixture(scope="module")
def stand_in_run(tmp_path_factory):
    if not netns.available():
        pytest.skip(f"no loopback-only namespace: {netns.why_not()}")
    out = tmp_path_factory.mktemp("lab") / "run"
    off = {"CLAUDE_CODE_ATTRIBUTION_HEADER": "0", "STANDIN_MAX_TOKENS": "4"}
    on = {"STANDIN_MAX_TOKENS": "4"}
    tasks = [Task("A", "stand-in", "task A", env=on, timeout_s=300), Task("A again", "stand-in", "task A", env=on, timeout_s=300),
             Task("B", "stand-in", "task B", env=on, timeout_s=300), Task("C off", "stand-in", "task C", env=off, timeout_s=300),
             Task("D off", "stand-in", "task D", env=off, timeout_s=300)]
    return run_lab(LabSpec(str(out), tasks, ctx=2048))


@pytest.mark.slow
def test_lab_captures_every_call_with_the_servers_own_counts(stand_in_run):
    calls = calls_table(stand_in_run).set_index("task")
    assert list(calls.index) == ["A", "A again", "B", "C off", "D off"] and (calls["status"] == "ok").all()
    # the server's evaluated-token counter agrees with its usage block, call by call
    assert (calls["evaluated_tokens"] == calls["prompt_tokens"] - calls["cached_tokens"]).all()
    assert calls.loc["A again", "first_diff"] == "identical"
    assert calls.loc["B", "first_diff"] == "system 0" and calls.loc["D off", "first_diff"].startswith("message")
    # the finder's position is what the server could reuse, give or take the template's markup
    assert abs(calls.loc["B", "cached_tokens"] - calls.loc["B", "tokens_before_diff"]) <= 8
    assert calls.loc["D off", "evaluated_tokens"] < calls.loc["B", "evaluated_tokens"] / 3
    assert (calls["ttft_s"] > 0).all() and (calls["e2e_s"] >= calls["ttft_s"]).all()


@pytest.mark.slow
def test_lab_run_keeps_its_conditions_and_bodies_in_the_results(stand_in_run):
    man = json.loads((stand_in_run / "manifest.json").read_text())
    assert man["network"] == {"namespace": "loopback-only", "interfaces": ["lo"]}
    assert len(man["model"]["sha256"]) == 64 and "llama-server" in man["engine"]["server"]
    assert all(k in man for k in ("hardware", "sampling", "load", "workload"))
    assert len(list((stand_in_run / "bodies").glob("*.json"))) == 5
    tasks = tasks_table(stand_in_run)
    assert (tasks["exit"] == 0).all() and (tasks["assumed_context_window"].map(lambda d: max(d.values())) > 0).all()
    # the CLI renders it, and so does the generic report
    from infercourse.cli import report_main
    from infercourse.cli.agent import agent_main
    assert agent_main(["report", str(stand_in_run)]) == 0
    assert report_main([str(stand_in_run)]) == 0


@pytest.mark.slow
def test_doctor_agent_on_a_real_server(stand_in_run):
    text = ra.doctor_on_fresh_server(1024, stand_in_run)
    # the stand-in's first request fits 1024 with room; this llama-server keeps a cc_version suffix
    # in the prompt (it normalises only cch=), so a new suffix busts the cache
    assert "[fail] KV cache" in text and '"CLAUDE_CODE_ATTRIBUTION_HEADER": "0"' in text
    assert "a role: system message is accepted" in text and "count_tokens answers" in text
    # greedy SmolLM2 begins its emoji with a partial character: llama-server sends no message_start
    assert "[warn] API      an answer that begins with a multi-byte character" in text, (
        "llama-server now sends message_start before a split first character: see tests/test_anthropic.py")
    small = ra.doctor_on_fresh_server(256, stand_in_run)
    assert "[fail] context" in small


# -- the real agents, where installed: sealed, bounded, small ----------------------------------
def _real(agent: str):
    why = netns.why_not() or agents.missing_reason(agent)
    return pytest.mark.skipif(why is not None, reason=why or "")


@pytest.mark.slow
@_real("claude-code")
def test_claude_code_first_request_is_captured_in_the_namespace(tmp_path):
    out = run_lab(LabSpec(str(tmp_path / "cc"), [ra.claude_task("hello", "Say hello.", "ci",
                                                                env=ra.SHORT_ANSWER, timeout_s=900)], ctx=4096))
    calls = calls_table(out)
    gen = calls[calls["api"] == "anthropic"]
    assert len(gen) >= 1 and gen["status"].iloc[0] == "ok" and gen["max_tokens"].iloc[0] == 64
    body = json.loads((out / "bodies" / f"{int(gen['request_id'].iloc[0]):03d}.json").read_text())
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header:")
    assert any(m["role"] == "system" for m in body["messages"])            # the env block as a message
    assert ra.first_call_parts(out, int(gen["request_id"].iloc[0]))["tokens"].sum() > 0


def _reported_windows(out) -> pd.Series:
    t = tasks_table(out).set_index("task")
    assert "assumed_context_window" in t, (
        "no task produced the agent's JSON result (agent layer): " + t[["exit", "wall_s"]].to_string())
    return t["assumed_context_window"].map(lambda d: max(d.values()) if isinstance(d, dict) and d else None)


@pytest.mark.slow
@_real("claude-code")
def test_claude_code_takes_its_window_from_max_context_tokens(tmp_path):
    """The pinned version reports the window CLAUDE_CODE_MAX_CONTEXT_TOKENS names; an
    auto-compact window under its 100,000-token floor leaves the 1,000,000 it assumes. The tasks
    run with the lab's answer stop, which reaches the server on every call and says so."""
    task = lambda label, **env: ra.claude_task(label, "Say hello.", "ci", env={**ra.SHORT_ANSWER, **env},  # noqa: E731
                                               timeout_s=300, answer_stop=ra.ANSWER_STOP)
    out = run_lab(LabSpec(str(tmp_path / "w"), [task("as is"), task("max context", CLAUDE_CODE_MAX_CONTEXT_TOKENS="4096"),
                                                task("auto compact", CLAUDE_CODE_AUTO_COMPACT_WINDOW="4096")], ctx=4096))
    win = _reported_windows(out)
    assert win["as is"] == agents.CLAUDE_ASSUMED_WINDOW and win["max context"] == 4096
    assert win["auto compact"] == agents.CLAUDE_ASSUMED_WINDOW
    gen = calls_table(out).query("api == 'anthropic'")
    assert len(gen) >= 3 and gen["answer_stop"].notna().all()
    for rid in gen["request_id"]:
        body = json.loads((out / "bodies" / f"{int(rid):03d}.json").read_text())
        assert body["stop_sequences"][-len(ra.ANSWER_STOP):] == ra.ANSWER_STOP   # recorded as sent


@pytest.mark.slow
@_real("codex")
def test_codex_speaks_responses_in_the_namespace(tmp_path):
    out = run_lab(LabSpec(str(tmp_path / "cx"), [ra.codex_task("hello", "Say hello.", "ci",
                                                               timeout_s=900)], ctx=8192))
    calls = calls_table(out)
    gen = calls[calls["api"] == "openai-responses"]
    assert len(gen) >= 1 and gen["status"].iloc[0] == "ok" and gen["prompt_tokens"].iloc[0] > 0


@pytest.mark.slow
@_real("qwen-code")
def test_qwen_code_speaks_chat_completions_in_the_namespace(tmp_path):
    """The pinned chat agent, run from its spec alone, at the CI size (its own flags: a short
    system prompt file, one tool), bounded in time."""
    out = run_lab(LabSpec(str(tmp_path / "qw"), [chat_agent.task("hello", "Say hello.", "qwen-code", "ci",
                                                                 timeout_s=300)], ctx=4096))
    calls = calls_table(out)
    gen = calls[calls["api"] == "openai-chat"]
    assert len(gen) >= 1 and gen["status"].iloc[0] == "ok" and gen["prompt_tokens"].iloc[0] > 0
    assert gen["first_diff"].iloc[0] == "first call" and gen["evaluated_tokens"].iloc[0] > 0
    body = json.loads((out / "bodies" / f"{int(gen['request_id'].iloc[0]):03d}.json").read_text())
    assert [t["function"]["name"] for t in body["tools"]] == ["read_file"] and body["stream"] is True
    assert tasks_table(out)["exit"].iloc[0] == 0
    assert json.loads((out / "manifest.json").read_text())["agents"] == {"qwen-code": agents.PINS["qwen-code"]}


# -- what the repository may hold: numbers derived from captures, never their text --------------
def test_committed_shapes_hold_numbers_and_field_names_only():
    shapes = json.loads(agent_doctor.SHAPES.read_text())
    allowed_strings = {"version", "api", "tokenizer", "first_diff", "kind"}   # names and part labels, no text

    def walk(node, key=""):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, list):
            assert key == "fields" and all(isinstance(x, str) and x.isidentifier() for x in node)
        elif isinstance(node, str):
            assert key in allowed_strings and len(node) < 60, (key, node[:80])
    chat = json.loads(chat_doctor.CHAT_SHAPES.read_text())
    for agent in agents.AGENTS:   # every pinned agent has a shape: its own API's, or a chat agent's
        if agent in chat:
            walk(chat[agent])
            continue
        walk(shapes[agent])
        assert agent_doctor.agent_shape(agent)["prompt_tokens"] > 1000


def test_no_captured_body_is_tracked_by_git():
    root = agent_doctor.SHAPES.parents[1]
    out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    tracked = out.stdout.splitlines()
    assert not [f for f in tracked if "/bodies/" in f or "/homes/" in f or "node_modules" in f]
    check = subprocess.run(["git", "check-ignore", "-q", "elsewhere/run/bodies/000.json"], cwd=root)
    assert check.returncode == 0   # a results folder's bodies are ignored wherever they land


@pytest.mark.slow
def test_doctor_agent_cli_names_the_failing_layers_and_prints_settings(capsys):
    from infercourse.__main__ import main
    from infercourse.servers import LlamaServer
    with LlamaServer(n_parallel=1, ctx_size=4096, threads=1, jinja=True) as srv:
        rc = main(["doctor", "agent", srv.url, "--agent", "claude-code"])
        out = capsys.readouterr().out
    # the committed shape of the pinned Claude Code's first request does not fit 4096 tokens
    assert rc == 1 and "[fail] context" in out and "does not fit the slot (4096 tokens)" in out
    env = json.loads(out[out.index("{"):])["env"]
    need = agent_doctor.window_needed("claude-code", agent_doctor.agent_shape("claude-code"))
    # the server's fix names the window the agent needs, extended past the model's 8,192
    assert f"slot window of at least {need:,} tokens: -c {need}" in out and "--rope-scaling yarn" in out
    assert env["ANTHROPIC_BASE_URL"] == srv.url and env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(need)


def test_doctor_agent_cli_refuses_a_remote_url_before_any_traffic(capsys):
    from infercourse.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["doctor", "agent", "http://10.1.2.3:8080", "--agent", "codex"])
    assert e.value.code == 2 and "loopback" in capsys.readouterr().err


@pytest.mark.slow
@needs_netns
def test_agent_run_cli_with_the_stand_in(tmp_path, capsys):
    from infercourse.cli.agent import agent_main
    out = tmp_path / "run"
    assert agent_main(["run", "--agent", "stand-in", "--task", "Say hello.", "--ctx", "1024", "--out", str(out),
                       "--env", "STANDIN_MAX_TOKENS=4"]) == 0
    printed = capsys.readouterr().out
    assert "first call" in printed and f"results: {out}" in printed
    assert "network: loopback-only (interfaces: lo)" in printed
    assert json.loads((out / "manifest.json").read_text())["network"]["namespace"] == "loopback-only"
    with pytest.raises(SystemExit):
        agent_main(["run", "--agent", "stand-in", "--task", "x", "--env", "NOEQUALS"])


@pytest.mark.slow
def test_agent_run_cli_with_no_netns_runs_on_the_host_and_says_so(tmp_path, capsys):
    """--no-netns where a namespace could be made: no unshare (the server becomes healthy on the
    host's loopback, the stand-in's call is answered), and the output and manifest say host."""
    from infercourse.cli.agent import agent_main
    out = tmp_path / "run"
    assert agent_main(["run", "--agent", "stand-in", "--task", "Say hello.", "--ctx", "1024", "--out", str(out),
                       "--env", "STANDIN_MAX_TOKENS=4", "--no-netns"]) == 0
    printed = capsys.readouterr().out
    assert "network: host (no namespace: --no-netns" in printed
    net = json.loads((out / "manifest.json").read_text())["network"]
    assert net["namespace"].startswith("host (no namespace: --no-netns") and net["interfaces"] == netns.interfaces()
    assert (calls_table(out)["status"] == "ok").all()


def test_an_exercise_rerun_gets_a_fresh_lab_folder(tmp_path):
    """A lab folder is written once: the exercises' runs (20's tools and header reruns) take the
    first `name-k` not yet there, so a learner can run the cell again."""
    assert ra._unused(tmp_path, "tools") == "tools-1"
    (tmp_path / "tools-1").mkdir()
    (tmp_path / "tools-2").mkdir()
    assert ra._unused(tmp_path, "tools") == "tools-3" and ra._unused(tmp_path, "rerun") == "rerun-1"


def _replay(evaluated, rewrites, prompt=3000):
    return pd.DataFrame({"request_id": range(len(evaluated)), "task": "t", "rewrote_history": rewrites, "status": 200,
                         "prompt_tokens": prompt, "reused": [prompt - e for e in evaluated], "evaluated": evaluated,
                         "seconds": [e / 1000 for e in evaluated]})


def test_rewrite_sentence_flips_with_what_each_family_paid():
    """Issue 34 §3: the told session replayed on both families; where a rewrite's change lies past
    the sliding window, Gemma 3 re-evaluates the whole prompt and --swa-full does not. Each rewrite
    is its own row (a median of two rewrites hid the one where the families part ways)."""
    flags = [False, False, True, False, True]
    t = rs.rewrite_table({"full attention": _replay([3000, 100, 2990, 90, 2500], flags),
                          "sliding window": _replay([3000, 100, 2999, 90, 3000], flags),
                          "--swa-full": _replay([3000, 100, 2995, 90, 2550], flags)})
    assert list(t.index.get_level_values("rewrite")) == [1, 2] * 3
    assert t.loc[("sliding window", 2), "reused"] == 0 and t.loc[("full attention", 2), "reused_share"] == 500 / 3000
    s = rc.rewrite_sentence(t)
    assert "**Rewrite 1** (t): full attention reused 10 of 3,000 prompt tokens (0%) and evaluated 2,990" in s
    assert "reused almost nothing: the change sat at the top of the prompt, and every family evaluated it whole" in s
    assert re.search(r"\*\*Rewrite 2\*\* \(t\): [^*]*sliding window reused 0 of 3,000[^*]* sliding window lost the "
                     r"prefix full attention kept and evaluated the prompt again from the top; --swa-full kept it\.", s)
    same = rs.rewrite_table({"full attention": _replay([3000, 100, 2990, 90, 2500], flags),
                             "sliding window": _replay([3000, 100, 2990, 90, 2600], flags)})
    assert "No replay lost the prefix full attention kept." in rc.rewrite_sentence(same)
    top = rs.rewrite_table({"full attention": _replay([3000, 100, 2990], flags[:3]),
                            "other": _replay([3000, 100, 2000], flags[:3])})
    assert "reused almost nothing: the change sat at the top of the prompt, and other kept more." in rc.rewrite_sentence(top)
    none = rs.rewrite_table({"full attention": _replay([3000, 100], [False, False])})
    assert "no call of the 2 replayed rewrote the history" in rc.rewrite_sentence(none)


def test_the_session_s_own_server_is_read_not_replayed(tmp_path, monkeypatch):
    """Issue 33 §5: the embedded model's replay repeated the told session on the same kind of
    server (127 s at full size, the same counts); its calls are read in the replay's columns,
    through the same rewrite, and a refused call carries no usage."""
    calls = pd.DataFrame({"request_id": range(4), "task": ["t0", "t1", "t1", "t2"], "api": "anthropic",
                          "path": "/v1/messages?beta=true", "status": ["ok", "error", "ok", "ok"],
                          "prompt_tokens": [5000, None, 5800, 7000], "cached_tokens": [0, None, 25, 5800],
                          "evaluated_tokens": [5000, None, 5775, 1200], "ttft_s": [30.0, None, 31.0, 8.0]})
    monkeypatch.setattr(rs, "calls_table", lambda out: calls)
    monkeypatch.setattr(rs, "_rewrites", lambda gen, out: gen.assign(rewrote_history=[False, False, True, False][:len(gen)]))
    own = rs.session_calls(tmp_path, through_rewrites=1)
    assert list(own["request_id"]) == [0, 1, 2] and list(own["status"]) == [200, 400, 200]
    assert own.loc[2, "reused"] == 25 and own.loc[2, "evaluated"] == 5775 and own.loc[2, "seconds"] == 31.0
    t = rs.rewrite_table({"own": own})
    assert t.loc[("own", 1), "calls"] == 2 and t.loc[("own", 1), "turn"] == "t1"
    assert len(rs.session_calls(tmp_path)) == 4


def test_a_lab_cell_run_again_writes_a_new_folder(tmp_path, monkeypatch):
    """Issue 33 §4: rerunning 20's exercise 2 raised FileExistsError (results are append-only)."""
    monkeypatch.setattr(ra, "run_lab", lambda spec: Path(spec.out))
    first = ra.lab(tmp_path, "clip", [], ctx=512)
    first.mkdir()
    again = ra.lab(tmp_path, "clip", [], ctx=512)
    assert first.name == "clip" and again.name == "clip-1"


def test_ends_sentence_counts_the_agents_own_words_and_names_the_cap():
    """Issue 33 §2: five of six main tasks ended in the 64-token cap's API error while the
    notebook read them as finished; the sentence counts ends by the agent's own result."""
    tab = pd.DataFrame({"agent_said": ["api_error: Claude's response exceeded the 64 output token maximum.",
                                       "completed", "completed", None]}, index=list("ABCD"))
    s = rc.ends_sentence(tab)
    assert "the 4 tasks ended: 2 completed, 1 api_error, 1 not recorded." in s
    assert "1 of them ended in the API error the answer cap makes" in s
    done = rc.ends_sentence(tab.assign(agent_said=["completed", "api_error: 400 request too long", "completed",
                                                   "prompt_too_long"]))
    assert "answer cap" not in done and "1 api_error, 1 prompt_too_long" in done
    codex = pd.DataFrame({"agent_said": ["completed", "completed"], "cut_by_server": [True, False]})
    assert "1 task(s) the agent reports completed ended on an answer the server cut" in rc.ends_sentence(codex)
    assert "server cut" not in rc.ends_sentence(codex.assign(cut_by_server=False))


def test_prefill_ledger_counts_the_big_prefills_run_by_run(tmp_path, monkeypatch):
    """Issue 33 §5: the notebook's pace is its cold prefills; the ledger counts, per lab run in
    the order they ran, the calls that made the server evaluate a thousand tokens or more."""
    import os
    for k, name in enumerate(("main", "retry")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
        os.utime(tmp_path / name / "manifest.json", (1000 - k, 1000 - k))     # retry ran first
        (tmp_path / name / "tasks.jsonl").write_text(json.dumps({"task": "t", "wall_s": 10.0 * (k + 1)}) + "\n")
    calls = {"main": pd.DataFrame({"api": ["anthropic", "anthropic", "count_tokens"], "evaluated_tokens": [12000, 40, 9000]}),
             "retry": pd.DataFrame({"api": ["anthropic"] * 2, "evaluated_tokens": [12000, 999]})}
    monkeypatch.setattr(rs, "calls_table", lambda d: calls[Path(d).name])
    led = rs.prefill_ledger(tmp_path)
    assert list(led.index) == ["retry", "main"]
    assert led.loc["main", "big_prefills"] == 1 and led.loc["main", "model_calls"] == 2     # count_tokens is not a call
    assert led.loc["retry", "big_prefills"] == 1 and led.loc["retry", "evaluated_tokens"] == 12999
    assert led.loc["retry", "wall_s"] == 20.0
    s = rc.ledger_sentence(led)
    assert "The 2 lab runs sent 4 model calls; 2 of them" in s and "took 30 s" in s and "most such calls: retry" in s
    assert "No lab run" in rc.ledger_sentence(led.iloc[:0])


def test_the_ledger_counts_a_prefill_the_client_gave_up_on(tmp_path, monkeypatch):
    """A copy the client cut has no count of its own, yet the server prefilled it (Codex's retry on
    2026-12-04: the copy's 6,597 tokens were in the task's counter only, and the ledger said 0 big
    prefills): the task counter's excess over its calls is that prefill."""
    (tmp_path / "retry").mkdir()
    (tmp_path / "retry" / "manifest.json").write_text("{}")
    tasks = [{"task": "t", "wall_s": 40.0, "evaluated_tokens": 6598}, {"task": "u", "wall_s": 1.0, "evaluated_tokens": 8}]
    (tmp_path / "retry" / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    calls = pd.DataFrame({"api": ["openai-responses"] * 3, "task": ["t", "t", "u"], "evaluated_tokens": [None, 1, 8]})
    monkeypatch.setattr(rs, "calls_table", lambda d: calls)
    led = rs.prefill_ledger(tmp_path)
    assert led.loc["retry", "big_prefills"] == 1 and led.loc["retry", "evaluated_tokens"] == 6606
    calls.loc[0, "evaluated_tokens"] = 6597          # the server answered it: nothing beyond the calls
    led = rs.prefill_ledger(tmp_path)
    assert led.loc["retry", "big_prefills"] == 1 and led.loc["retry", "evaluated_tokens"] == 6606


def test_the_ledger_keeps_a_run_that_made_no_call(tmp_path, monkeypatch):
    """A lab run whose agent never reached the server (or one still starting) has no calls and no
    task times: the ledger lists it with none, and keeps the runs before it (it raised a
    TypeError on 2026-12-06, read while notebook 20's told session was starting)."""
    import os
    for k, name in enumerate(("main", "session-told")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
        os.utime(tmp_path / name / "manifest.json", (1000 + k, 1000 + k))
    (tmp_path / "main" / "tasks.jsonl").write_text(json.dumps({"task": "t", "wall_s": 5.0}) + "\n")
    calls = {"main": pd.DataFrame({"api": ["anthropic"], "task": ["t"], "evaluated_tokens": [12000]}),
             "session-told": pd.DataFrame()}
    monkeypatch.setattr(rs, "calls_table", lambda d: calls[Path(d).name])
    led = rs.prefill_ledger(tmp_path)
    assert list(led.index) == ["main", "session-told"]
    assert led.loc["main", "big_prefills"] == 1 and led.loc["main", "evaluated_tokens"] == 12000
    assert led.loc["session-told", "model_calls"] == 0 and led.loc["session-told", "big_prefills"] == 0
    assert pd.isna(led.loc["session-told", "evaluated_tokens"]) and pd.isna(led.loc["session-told", "wall_s"])
    assert "The 2 lab runs sent 1 model calls" in rc.ledger_sentence(led)


def test_the_forcer_asks_the_first_call_for_one_tool_and_says_so():
    """Issue 33 §1: the lab option that forces a tool round trip changes one call per task, the
    first that offers the tool, and tags it; Anthropic and OpenAI bodies get their own shapes."""
    from infercourse.measure.tool_calls import CALL_CLOSE, CALL_OPEN
    from infercourse.ops.lab_options import first_tool_forcer
    anth = {"model": "m", "tools": [{"name": "Placeholder", "input_schema": {}}, {"name": "Read", "input_schema": {}}],
            "messages": [{"role": "user", "content": "hi"}]}
    rw, tags = first_tool_forcer("Read"), {"task": "t"}
    sent = json.loads(rw(json.dumps(anth).encode(), tags))
    assert [t["name"] for t in sent["tools"]] == ["Read"] and sent["tool_choice"] == {"type": "any"}
    assert sent["messages"][-1] == {"role": "assistant", "content": CALL_OPEN} and sent["stop_sequences"] == [CALL_CLOSE]
    assert tags["forced"].startswith("Read alone") and sent["temperature"] == 0 and tags["forced"].endswith("greedy")
    again = {"task": "t"}
    assert rw(json.dumps(anth).encode(), again) == json.dumps(anth).encode() and "forced" not in again   # once a task
    oai = {"tools": [{"type": "function", "function": {"name": "Read"}}], "messages": []}
    sent = json.loads(first_tool_forcer("Read")(json.dumps(oai).encode(), {"task": "u"}))
    assert sent["tool_choice"] == "required" and sent["stop"] == [CALL_CLOSE]
    assert first_tool_forcer("Bash")(json.dumps(anth).encode(), {"task": "v"}) == json.dumps(anth).encode()
    assert first_tool_forcer("Read")(b"not json", {"task": "w"}) == b"not json"


def test_tool_sentence_follows_the_round_trip_and_what_the_template_rendered(tmp_path, monkeypatch):
    from infercourse.lessons import real_agent_tools as rt
    (tmp_path / "bodies").mkdir()
    (tmp_path / "bodies" / "000.json").write_text(json.dumps({"tools": [{"name": "Read"}], "messages": []}))
    (tmp_path / "bodies" / "001.json").write_text(json.dumps({"tools": [{"name": "P"}, {"name": "Read"}], "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "content": "File does not exist.", "is_error": True}]}]}))
    calls = pd.DataFrame({"request_id": [0, 1], "task": "t", "api": "anthropic", "forced": ["Read alone", None],
                          "stop_reason": ["tool_use", "end_turn"], "prompt_tokens": [900, 1000],
                          "evaluated_tokens": [900, 950], "first_diff": ["first call", "tool 0: P"]})
    monkeypatch.setattr(rt, "calls_table", lambda out: calls)
    trip = rt.tool_round_trip(tmp_path)
    assert list(trip["tool_results_sent"]) == [0, 1] and trip["results_marked_error"].iloc[1] == 1
    seen = {"request_id": 1, "results": 1, "result_chars": 20, "prompt_tokens": 1000, "results_emptied": 994,
            "rendered_tokens": 6}
    s = rt.tool_sentence(trip, seen)
    assert "carried 1 tool result(s) (1 marked as the tool's error)" in s and "rendered 6 tokens" in s
    dropped = rt.tool_sentence(trip, {**seen, "results_emptied": 1000, "rendered_tokens": 0})
    assert "the template dropped them" in dropped and "rendered 6" not in dropped
    assert "did not close" in rt.tool_sentence(trip.iloc[:1], seen)
    assert "No call was forced" in rt.tool_sentence(trip.assign(forced=None), seen)


@pytest.mark.slow
@_real("claude-code")
def test_a_forced_read_closes_a_tool_round_trip_through_the_server(tmp_path):
    """The forced first call comes back as one tool call, the agent runs it and sends the
    result, and the course's template renders the result (the server counts it)."""
    from infercourse.lessons import real_agent_tools as rt
    out = run_lab(LabSpec(str(tmp_path / "tool"), [ra.tool_task("ci", timeout_s=300)], ctx=4096))
    trip = rt.tool_round_trip(out)
    assert trip["forced"].notna().sum() == 1 and trip["stop_reason"].iloc[0] == "tool_use"
    assert (trip["tool_results_sent"] > 0).any()
    assert trip["stop_reason"].iloc[-1] == "end_turn"   # the answer after the result ends at the lab's stop
    assert rt.tool_result_rendered(out, ctx=4096)["rendered_tokens"] > 0


def test_template_line_names_the_template_and_flags_a_dropped_part(tmp_path, monkeypatch):
    """Issue 33 §1: a template with no place for a mid-conversation system message dropped
    2,432 tokens silently (the server counted 10,661 against parts adding up to 12,652)."""
    from infercourse.lessons import real_agent_tools as rt
    (tmp_path / "manifest.json").write_text(json.dumps({"engine": {"argv": ["llama-server", "--chat-template-file",
                                                                            "/x/chatml_tools.jinja"]}}))
    calls = pd.DataFrame({"request_id": [0], "api": "anthropic", "prompt_tokens": [10_661]})
    monkeypatch.setattr(rt, "calls_table", lambda out: calls)
    monkeypatch.setattr(rt, "anatomy", lambda out: [{"request_id": 0, "parts": [{"tokens": 10_220}, {"tokens": 2_432}]}])
    s = rt.template_line(tmp_path)
    assert "chatml_tools.jinja" in s and "1,991 fewer: the template dropped" in s
    calls.loc[0, "prompt_tokens"] = 12_700
    assert "48 more: the template's markup" in rt.template_line(tmp_path)


def test_the_doctor_warns_of_the_agents_own_max_tokens_not_the_labs_cap(tmp_path):
    """Issue 33 §3: on the 8k server the doctor warned 'max_tokens 64 ... clips it' under a
    refusal, and from the lab's cap, hiding what the agent's default 32,000 meets."""
    (tmp_path / "requests.jsonl").write_text(json.dumps(
        {"prompt_tokens": 10_661, "tags": {"api": "anthropic", "max_tokens": 64, "body_bytes": 5}}) + "\n")
    shape = agent_doctor.agent_shape("claude-code", tmp_path)
    assert shape["max_tokens"] == 32000 and shape["captured_max_tokens"] == 64
    refused = agent_doctor.grade_agent_route({**GOOD, "n_ctx_slot": 8192}, shape)
    assert not [c for c in refused if "max_tokens" in c.summary]          # the refusal says it all
    fits = agent_doctor.grade_agent_route({**GOOD, "n_ctx_slot": 24_576}, shape)
    assert [c for c in fits if "asks for max_tokens 32000" in c.summary]


def test_a_replay_stops_after_the_rewrite_it_was_asked_for(tmp_path, monkeypatch):
    """Issue 33 §5: each replayed call after the first rewrite is another prefill that shows
    nothing new; `through_rewrites` ends the replay at that call, and a session with fewer
    rewrites is replayed whole."""
    import infercourse.servers as servers
    n, flags = 6, [False, False, True, False, True, False]
    (tmp_path / "bodies").mkdir()
    for i in range(n):
        (tmp_path / "bodies" / f"{i:03d}.json").write_text(json.dumps({"messages": [], "max_tokens": 64}))
    calls = pd.DataFrame({"request_id": range(n), "task": "t", "api": "anthropic", "path": "/v1/messages"})
    monkeypatch.setattr(rs, "calls_table", lambda out: calls)
    monkeypatch.setattr(rs, "_rewrites", lambda gen, out: gen.assign(rewrote_history=flags[:len(gen)]))
    sent = []

    class Server:
        url = "http://127.0.0.1:1"
        def __init__(self, *a, **k): pass
        def __enter__(self): return self
        def __exit__(self, *a): return False
    monkeypatch.setattr(servers, "LlamaServer", Server)
    monkeypatch.setattr(rs, "post_messages", lambda url, body, timeout: sent.append(body) or (
        200, {"usage": {"input_tokens": 10, "cache_read_input_tokens": 90}}))
    first = rs.replay_session(tmp_path, through_rewrites=1)
    assert list(first["request_id"]) == [0, 1, 2] and first["rewrote_history"].iloc[-1]
    assert all(b["max_tokens"] == 1 and b["stream"] is False for b in sent)
    assert list(rs.replay_session(tmp_path, through_rewrites=2)["request_id"]) == [0, 1, 2, 3, 4]
    assert len(rs.replay_session(tmp_path, through_rewrites=3)) == n == len(rs.replay_session(tmp_path))


def test_the_first_request_at_another_size_is_measured_once(tmp_path, monkeypatch):
    """Issue 33 §5: the clip and the sessions run at the agent's small configuration; their first
    request is measured at that size (one fresh lab run, shared), and read from B header off where the
    main run had that size: with the billing header off, as the sessions run."""
    ra.first_tokens_at.cache_clear()
    runs = []
    monkeypatch.setattr(ra, "first_request_tokens", lambda root, tools, size, **kw: runs.append(
        (tools, size, kw.get("env"))) or 1033.0)
    calls = pd.DataFrame({"task": ["A cold", "B header off", "B header off", "C header on"],
                          "status": ["ok", "error", "ok", "ok"],
                          "prompt_tokens": [13306, None, 13306, 13341]})   # a copy the client cut: no usage
    monkeypatch.setattr(ra, "_model_calls", lambda main: calls)
    assert ra.first_tokens_at(tmp_path, "ci", "main", "full") == 1033
    # sized as the sessions run: with the billing header off (on, it adds a system block)
    assert ra.first_tokens_at(tmp_path, "ci", "main", "full") == 1033 and runs == [("Read", "ci", ra.HEADER_OFF)]
    # at the main run's size: its new task with the billing header off, as the sessions run (C's is on)
    assert ra.first_tokens_at(tmp_path, "full", "main", "full") == 13306 and len(runs) == 1
    calls.loc[2, "status"] = "error"     # no answered call of B at all: sized by a refusal instead
    assert ra.first_tokens_at(tmp_path / "other", "full", "main", "full") == 1033 and runs[-1] == (None, "full", ra.HEADER_OFF)
    ra.first_tokens_at.cache_clear()


def test_a_first_request_is_sized_by_a_refusal_not_a_prefill(tmp_path, monkeypatch):
    """Issue 33 §5: sizing a first request costs no cold prefill: by default the lab's server is
    too small for it (`SIZING_CTX`), and the size is the one the server's refusal names."""
    specs, tasks = [], []

    def fake_lab(root, name, run, *, ctx, **kw):
        specs.append(ctx)
        tasks.extend(run)
        return tmp_path
    monkeypatch.setattr(ra, "lab", fake_lab)
    monkeypatch.setattr(ra, "_first_call", lambda out: pd.Series(
        {"prompt_tokens": float("nan"), "error": "request (5519 tokens) exceeds the available context size (512 tokens)"}))
    assert ra.first_request_tokens(tmp_path, "Read", "ci") == 5519 and specs == [ra.SIZING_CTX]
    assert ra.first_request_tokens(tmp_path, "Read", "ci", env=ra.HEADER_OFF) == 5519
    assert tasks[0].env == ra.SHORT_ANSWER and tasks[1].env == {**ra.SHORT_ANSWER, **ra.HEADER_OFF}
    assert ra.SIZING_CTX < 1000   # under every first request the lab sizes (the ci size's: ~1,000 tokens)


def test_clip_sentence_reports_the_agents_escalation_and_flips_when_nothing_was_clipped():
    cols = ["task", "status", "max_tokens", "prompt_tokens", "output_tokens", "stop_reason", "first_diff", "error"]
    refusal = lambda n: f"request ({n} tokens) exceeds the available context size (1536 tokens), try increasing it"  # noqa: E731
    clipped = pd.DataFrame([["t", "ok", 32000, 1067.0, 469, "max_tokens", "first call", None],
                            ["t", "error", 128000, None, 0, None, "message 1 (system)", refusal(1587)],
                            ["t", "error", 32000, None, 0, None, "identical", refusal(1587)],
                            ["t", "error", 32000, None, 0, None, "system 0", refusal(2694)]], columns=cols)
    s = rc.clip_sentence(clipped, "prompt_too_long: Prompt is too long")
    assert "stopped its answer at 469 tokens" in s and "all the room its 1,536-token window left" in s
    assert "Then 3 more call(s)" in s and "1 with max_tokens raised to 128,000" in s
    assert "3 refused by the server for size (requests of 1,587 to 2,694 tokens" in s
    assert "1 sent again with the same prompt" in s
    assert "1 starting from another system prompt" in s and s.endswith("in the agent's words: prompt_too_long.")
    ended = pd.DataFrame([["t", "ok", 32000, 1067.0, 120, "end_turn", "first call", None]], columns=cols)
    s = rc.clip_sentence(ended, "completed")
    assert "did not clip it" in s and "Then" not in s and "all the room" not in s and s.endswith("completed.")


# -- the clipped answer: a room the rounded window really leaves ------------------------------
def test_the_window_is_rounded_as_llama_cpp_rounds_it():
    from infercourse.ops.agent_budget import padded_window
    assert [padded_window(n) for n in (1, 256, 257, 1053 + 100, 1280)] == [256, 256, 512, 1280, 1280]


def test_a_padded_prompt_takes_the_fewest_filler_words_that_make_it_long_enough():
    from infercourse.ops.agent_anatomy import padded_prompt
    assert padded_prompt(ra.LONG_ANSWER, 0, words) == ra.LONG_ANSWER
    for extra in (12, 40, 127):
        p = padded_prompt(ra.LONG_ANSWER, extra, words)
        assert p.endswith(ra.LONG_ANSWER) and words(p) - words(ra.LONG_ANSWER) == extra


def test_the_clip_lab_pads_the_task_so_that_its_first_request_and_the_room_fill_a_rounded_window(tmp_path, monkeypatch):
    """Asked for a room of 100 after a 1,053-token first request, `-c 1153` would give a 1,280-token
    window and leave 227: the run sizes the task on a refusing server, then pads the prompt by 127."""
    runs = []

    def fake_lab(root, name, tasks, *, ctx, **kw):
        runs.append((name, ctx, tasks[0].prompt))
        return tmp_path / name
    monkeypatch.setattr(ra, "lab", fake_lab)
    monkeypatch.setattr(ra, "first_request_size", lambda out: 1053.0)
    monkeypatch.setattr(ra, "padded_prompt", lambda prompt, extra: padded_prompt(prompt, extra, words))
    from infercourse.ops.agent_anatomy import padded_prompt
    ra.clip_lab(tmp_path, 100, "ci")
    (sized, size_ctx, plain), (name, ctx, padded) = runs
    assert (sized, size_ctx, plain) == ("clip-size", ra.SIZING_CTX, ra.LONG_ANSWER)
    assert name == "clip" and ctx == 1280 and words(padded) - words(plain) == 1280 - 100 - 1053
    runs.clear()
    monkeypatch.setattr(ra, "first_request_size", lambda out: 1276.0)   # 4 tokens short of a window: the next one
    ra.clip_lab(tmp_path, 0, "ci")
    assert runs[1][1] == 1536 and words(runs[1][2]) - words(ra.LONG_ANSWER) == 1536 - 1276


def test_a_changed_tool_schema_is_named_with_its_sizes_and_the_sentence_flips_when_only_messages_differ():
    """qwen-code's second task sent its `task` tool with another description (1,090 tokens, then 150):
    the prefix cache lost everything from tool 0 on; the sentence must name the part, not the messages."""
    part = lambda name, n: {"part": name, "kind": name.split()[0], "tokens": n}   # noqa: E731
    diff = lambda p, k: {"part": p, "kind": k}   # noqa: E731
    recs = [{"request_id": 0, "task": "A", "system_key": "s", "parts": [part("system 0", 5125), part("tool 0: task", 1090),
                                                                         part("message 0", 20)],
             "first_difference_same_system": diff(None, "first call")},
            {"request_id": 1, "task": "A2", "system_key": "s", "parts": [part("system 0", 5125), part("tool 0: task", 150),
                                                                          part("message 0", 20)],
             "first_difference_same_system": diff("tool 0: task", "tool")}]
    calls = pd.DataFrame({"request_id": [0, 1], "prompt_tokens": [11675.0, 10736.0], "evaluated_tokens": [11675.0, 5568.0]})
    s = rc.changed_part_sentence(recs, calls)
    assert "Call 1 (A2) first differed from call 0 (A) inside tool 0: task" in s
    assert "1,090 tokens there, 150 here" in s and "evaluated 5,568 of its 10,736" in s
    recs[1]["parts"][1] = part("tool 0: task", 1090)
    recs[1]["first_difference_same_system"] = diff("message 0", "message")
    s = rc.changed_part_sentence(recs, calls)
    assert "The one call compared with an earlier one of the same system prompt did not first differ" in s
    assert "stayed the same" in s and "its first difference lay in the messages" in s and "tool 0" not in s
    side = {**recs[1], "request_id": 2, "system_key": "other", "first_difference_same_system": diff(None, "first call")}
    assert "The one call compared" in rc.changed_part_sentence([recs[0], side, recs[1]], calls)   # a side call: not compared
    two = rc.changed_part_sentence([*recs, {**recs[1], "request_id": 3}], calls)
    assert "None of the 2 calls compared with an earlier one of the same system prompt first differed" in two
    assert "each first difference lay in the messages" in two
