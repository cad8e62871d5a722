"""Any agent by configuration (`ops.chat_agent`), side calls against the prefix cache
(`ops.side_calls`, the anatomy's same-system comparison) and `doctor agent --agent chat`
(`ops.chat_doctor`).

The generic path runs the course's chat stand-in (`infercourse.testing_chat_agent`) from a
copy of its spec file, so nothing but configuration tells the lab what to run; the real
chat agent (Qwen Code, pinned) runs in tests/test_real_agents.py where npm installed it.
"""
from __future__ import annotations

import json
import re
import shutil
import sys

import pandas as pd
import pytest

from infercourse.core.errors import AgentLayerError
from infercourse.ops import agents, chat_agent, chat_doctor, netns, side_calls
from infercourse.ops.agent_anatomy import write_anatomy

words = lambda text: len(text.split())   # noqa: E731 - a stand-in token counter for pure tests
needs_netns = pytest.mark.skipif(not netns.available(), reason=f"no loopback-only namespace: {netns.why_not()}")


def _says(text: str, phrase: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(phrase)}(?![\w-])", text) is not None


# -- specs ---------------------------------------------------------------------------------------
def test_shipped_specs_load_and_overlay():
    q = chat_agent.load_spec("qwen-code")
    assert q["api"] == "openai-chat" and q["package"] in agents.pinned_packages()
    ci = chat_agent.sized(q, "ci", "next-speaker")
    assert ci["argv"][:len(q["argv"])] == q["argv"] and "--core-tools" in ci["argv"]      # argv appended
    settings = ci["files"][".qwen/settings.json"]
    assert settings["telemetry"] == {"enabled": False} and settings["model"]["skipNextSpeakerCheck"] is False
    assert ci["label"] == "qwen-code+ci+next-speaker" and "model" not in q["files"][".qwen/settings.json"]
    with pytest.raises(AgentLayerError, match="no variant"):
        chat_agent.sized(q, "full", "nope")
    assert set(chat_agent.spec_names()) >= {"qwen-code", "stand-in-chat"}


def test_the_pinned_chat_agent_is_installed_with_the_others():
    """The lock pins it, `install` checks it, and the Node range named is its lock entry's."""
    assert "qwen-code" in agents.AGENTS and agents.PINS["qwen-code"] == agents.pinned_packages()["@qwen-code/qwen-code"]
    lock = json.loads((agents.SPEC_DIR / "package-lock.json").read_text())["packages"]
    entry = lock["node_modules/@qwen-code/qwen-code"]
    assert entry["version"] == agents.PINS["qwen-code"] and agents.node_needed()["qwen-code"] == entry["engines"]["node"]
    assert not entry.get("hasInstallScript")      # runs with npm ci --ignore-scripts as it is


BAD = [({"env": {"OPENAI_BASE_URL": "http://api.example.com/v1"}}, "literal URL"),
       ({"env": {"OPENAI_BASE_URL": "{model}"}}, "must start with {base_url}"),
       ({"env": {"HTTPS_PROXY": "{base_url}"}}, "HTTPS_PROXY"),
       ({"env": {"OPENAI_API_KEY": "sk-real"}}, "must be {api_key}"),
       ({"env": {"HOME": "/root"}}, "HOME"),
       ({"argv": ["{bin}", "--base-url", "https://api.example.com"]}, "literal URL"),
       ({"files": {"../escape.json": {}}}, "inside the throwaway home"),
       ({"files": {"cfg.json": {"provider": {"baseURL": "https://api.example.com"}}}}, "literal URL")]


@pytest.mark.parametrize("change, why", BAD)
def test_a_spec_that_could_route_around_the_recorder_is_refused(change, why, tmp_path):
    base = {"name": "x", "command": "true", "argv": ["{bin}", "{task}"], "env": {"OPENAI_BASE_URL": "{base_url}/v1"}}
    spec = {**base, **change}
    with pytest.raises(AgentLayerError, match=re.escape(why)) as e:
        chat_agent.load_spec(spec)
    assert e.value.layer == "agent"
    # a $schema URL in a config file is a name, not a route
    chat_agent.load_spec({**base, "files": {"cfg.json": {"$schema": "https://example.com/s.json"}}})


def test_launch_fills_the_placeholders_and_seals_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-the-users-real-key")
    spec = chat_agent.load_spec({"name": "mine", "command": "true", "argv": ["{bin}", "-p", "{task}", "--m", "{model}"],
                                 "env": {"OPENAI_BASE_URL": "{base_url}/v1", "OPENAI_API_KEY": "{api_key}"},
                                 "files": {".mine/cfg.json": {"home": "{home}", "n": 1}, "note.md": "work in {work}"}})
    home, work = tmp_path / "home", tmp_path / "home" / "work"
    argv, env = chat_agent.launch(spec, "do it", home, work, "http://127.0.0.1:9/", "m1", {"MY_SETTING": "1"})
    assert argv[1:] == ["-p", "do it", "--m", "m1"] and argv[0].endswith("true")
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1" and env["OPENAI_API_KEY"] == agents.DUMMY_KEY
    assert env["HOME"] == str(home) and env["MY_SETTING"] == "1"
    assert json.loads((home / ".mine/cfg.json").read_text()) == {"home": str(home), "n": 1}
    assert (home / "note.md").read_text() == f"work in {work}"
    with pytest.raises(AgentLayerError):          # the task's env may not move the route either
        chat_agent.launch(spec, "x", home, work, "http://127.0.0.1:9", "m", {"OPENAI_BASE_URL": "http://127.0.0.1:1"})


def test_a_missing_program_is_named_before_anything_starts(tmp_path):
    from infercourse.ops.agent_lab import LabSpec, run_lab
    t = chat_agent.task("t", "hi", {"name": "ghost", "command": "no-such-agent-here", "argv": ["{bin}", "{task}"]})
    with pytest.raises(AgentLayerError, match="not found"):
        run_lab(LabSpec(str(tmp_path / "run"), [t]))
    assert not (tmp_path / "run").exists()


def test_the_agents_own_json_output_is_read_as_one_array_too():
    from infercourse.ops.agent_lab_child import _agent_json
    out = json.dumps([{"type": "system"}, {"type": "result", "is_error": False, "num_turns": 2, "result": "hi"}])
    got = _agent_json("noise\n" + out + "\n")
    assert got["num_turns"] == 2 and got["is_error"] is False and got["result_preview"] == "hi"


# -- the anatomy: the previous call, and the previous one with the same system prompt -----------
def _chat(system: str, task: str) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": task}],
            "tools": [{"type": "function", "function": {"name": "read"}}]}


def test_a_side_call_is_named_apart_from_the_main_prompt(tmp_path):
    calls = [_chat("main rules " * 20, "task one"), _chat("title maker", "task one"),
             _chat("main rules " * 20, "task two")]
    (tmp_path / "bodies").mkdir()
    with open(tmp_path / "requests.jsonl", "w") as f:
        for i, body in enumerate(calls):
            (tmp_path / "bodies" / f"{i:03d}.json").write_text(json.dumps(body))
            f.write(json.dumps({"request_id": i, "tags": {"path": "/v1/chat/completions", "task": "t"}}) + "\n")
    rows = [json.loads(line) for line in write_anatomy(tmp_path, words).read_text().splitlines()]
    assert rows[0]["system_key"] == rows[2]["system_key"] != rows[1]["system_key"]
    third = rows[2]
    assert third["first_difference"]["part"] == "message 0 (system)"            # against the side call
    assert third["first_difference_same_system"]["part"] == "message 1 (user)"   # against its own last main call
    assert third["first_difference_same_system"]["tokens_before"] == 40 + 1 + 1   # system, tool, "task"


# -- side calls: which setting held the main prefix ------------------------------------------------
def _side_table(after_share: dict[str, float]) -> pd.DataFrame:
    rows = []
    for fix, share in after_share.items():
        rows += [{"fix": fix, "role": "main", "prompt_tokens": 1000, "evaluated_tokens": 1000, "status": "ok",
                  "after_side": False},
                 {"fix": fix, "role": "side", "prompt_tokens": 50, "evaluated_tokens": 50, "status": "ok",
                  "after_side": False},
                 {"fix": fix, "role": "main", "prompt_tokens": 1000, "evaluated_tokens": 1000 * share, "status": "ok",
                  "after_side": True}]
    return pd.DataFrame(rows)


def test_side_call_sentence_flips_with_the_numbers():
    s = side_calls.side_call_sentence(_side_table({"one slot": 0.99, "--cache-ram 8192": 0.01}))
    assert _says(s, "lost after a side call with `one slot`") and _says(s, "held with `--cache-ram 8192`")
    s = side_calls.side_call_sentence(_side_table({"one slot": 0.02, "--cache-ram 8192": 0.9}))
    assert _says(s, "lost after a side call with `--cache-ram 8192`") and _says(s, "held with `one slot`")
    none = side_calls.side_call_sentence(_side_table({"one slot": 0.5}).assign(after_side=False))
    assert none.startswith("No main call followed a side call")


# -- doctor agent --agent chat: grading is pure ----------------------------------------------------
def _ev(after: int, control: int = 4, **kw) -> dict:
    calls = [("main", 600), ("main again", control), ("side", 120), ("main", after), ("side", 120), ("main", after)]
    return {"n_ctx_slot": 16384, "total_slots": 1, "n_predict": -1, "prefill_tok_per_s": 100.0, "decode_tok_per_s": 20.0,
            "kv_bytes_per_token": 23040.0, "n_ctx_train": 8192,
            "calls": [{"role": r, "evaluated": n, "prompt_tokens": 600} for r, n in calls], **kw}


SHAPE = {"first_request": {"prompt_tokens": 11000, "max_tokens": None, "bytes": 46000},
         "side_calls": {"per_task": 1.0, "prompt_tokens": 1500}, "across_tasks": {"first_diff": "message 3 (user)",
                                                                                   "kind": "message"},
         "timeout_s": None, "timeout_note": "covers headers only"}


def _statuses(checks, word):
    return [c.status for c in checks if word in c.summary]


def test_chat_grades_flip_with_the_evidence():
    evicted = chat_doctor.grade_chat_route(_ev(after=596), SHAPE)
    assert _statuses(evicted, "another system prompt") == ["fail"] and "evicts" in evicted[2].summary
    kept = chat_doctor.grade_chat_route(_ev(after=8), SHAPE)
    assert _statuses(kept, "another system prompt") == ["ok"] and any("keeps the main" in c.summary for c in kept)
    quiet = chat_doctor.grade_chat_route(_ev(after=596), {**SHAPE, "side_calls": {"per_task": 0}})
    assert _statuses(quiet, "another system prompt") == ["warn"]             # it evicts, but this agent sends none
    blind = chat_doctor.grade_chat_route(_ev(after=596, control=600), SHAPE)
    assert _statuses(blind, "no prefix reuse even for an identical call") == ["warn"]
    small = chat_doctor.grade_chat_route({**_ev(after=8), "n_ctx_slot": 8192}, SHAPE)
    assert small[0].status == "fail" and small[0].layer == "context"
    # no max_tokens and no -n: the answer can run to the window's end; a -n below that caps it
    assert _statuses(kept, "names no max_tokens") == ["warn"]
    assert _statuses(chat_doctor.grade_chat_route({**_ev(after=8), "n_predict": 512}, SHAPE), "caps the answer") == ["ok"]
    asks = {**SHAPE, "first_request": {**SHAPE["first_request"], "max_tokens": 32000}}
    assert _statuses(chat_doctor.grade_chat_route(_ev(after=8), asks), "does not cap a request") == ["warn"]
    busted = {**SHAPE, "across_tasks": {"first_diff": "message 0 (system)", "kind": "system or tool"}}
    assert _statuses(chat_doctor.grade_chat_route(_ev(after=8), busted), "busts the cache") == ["fail"]
    # a timeout that covers the prefill is graded against it; one that does not, says so
    assert _statuses(chat_doctor.grade_chat_route(_ev(after=8), {**SHAPE, "timeout_s": 60.0}), "cold first call") == ["fail"]
    assert "does not cover a streamed prefill" in " ".join(c.summary for c in kept)


def test_chat_fixes_are_computed_from_the_probe():
    spec = chat_agent.load_spec("qwen-code")
    ev = _ev(after=596)
    text = chat_doctor.chat_fixes(ev, SHAPE, chat_doctor.grade_chat_route(ev, SHAPE), spec)
    need = -(-(11000 + 1024) // 256) * 256
    assert f"-np 2 -c {2 * 16384}" in text and "--slot-save-path" in text
    assert f"--cache-ram {chat_doctor.kv_mib(11000 + 1500, 23040.0)} " in text      # sized from the KV bytes per token
    settings = json.loads(text[text.index("{"):])["model"]["generationConfig"]
    assert settings["samplingParams"]["max_tokens"] == (16384 - 11000) // 256 * 256
    assert settings["contextWindowSize"] == 16384 and "timeout" not in settings   # its timeout covers headers only
    small = {**_ev(after=8), "n_ctx_slot": 8192}
    fixed = chat_doctor.chat_fixes(small, SHAPE, [], spec)
    assert f"-c {need} -np 1" in fixed and "--rope-scaling yarn" in fixed and "--cache-ram" not in fixed
    assert json.loads(fixed[fixed.index("{"):])["model"]["generationConfig"]["contextWindowSize"] == need
    timed = chat_doctor.chat_fixes(small, {**SHAPE, "timeout_s": 60.0}, [], None)
    assert "wait at least 330 s" in timed      # 3 x the cold prefill of 11,000 tokens at 100 tok/s


def test_the_fresh_server_doctor_sizes_its_checks_by_the_run_it_is_told(monkeypatch):
    """Notebook 20 ran the chat agent at full size (11,323 tokens, refused by the 8,192-token
    server) and fed the doctor the small side-call run (753 tokens): the doctor said "[ok] first
    request 753 of 8192" under a table of refusals (2026-12-06). `first_from` sizes the checks by
    the run at the learner's size; `capture` still gives the side calls."""
    import contextlib
    import infercourse.servers as servers
    shapes = {"side": {**SHAPE, "first_request": {**SHAPE["first_request"], "prompt_tokens": 753}},
              "full": {**SHAPE, "first_request": {**SHAPE["first_request"], "prompt_tokens": 11323},
                       "side_calls": {"per_task": 0.0, "prompt_tokens": None}}}
    monkeypatch.setattr(chat_doctor, "chat_shape", lambda agent, capture: shapes[str(capture)])
    monkeypatch.setattr(chat_doctor, "probe_chat_route", lambda url: {**_ev(after=596), "n_ctx_slot": 8192})

    @contextlib.contextmanager
    def fake_server(*a, **kw):
        yield type("S", (), {"url": "http://127.0.0.1:9"})()
    monkeypatch.setattr(servers, "LlamaServer", fake_server)
    small = chat_doctor.doctor_on_fresh_server(8192, "stand-in-chat", "side", extend=False)
    full = chat_doctor.doctor_on_fresh_server(8192, "stand-in-chat", "side", extend=False, first_from="full")
    assert "first request 753 of 8192" in small and "[fail] context" not in small
    assert "[fail] context" in full and "11323" in full and "753" not in full.split("settings")[0]
    assert "this agent sends 1 per task" in full       # the side calls still come from `capture`


def test_doctor_agent_chat_refuses_a_remote_url_before_any_traffic(capsys):
    from infercourse.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["doctor", "agent", "http://10.1.2.3:8080", "--agent", "chat"])
    assert e.value.code == 2 and "loopback" in capsys.readouterr().err


def test_shipped_chat_shapes_hold_numbers_only():
    shapes = json.loads(chat_doctor.CHAT_SHAPES.read_text())
    for name, shape in shapes.items():
        if name.startswith("_"):
            continue
        assert chat_agent.load_spec(name)["package"]
        assert shape["first_request"]["prompt_tokens"] > 1000
        for node in json.dumps(shape).split('"')[1::2]:       # every string: a key, a version, a part label
            assert len(node) < 60


# -- the generic path on a real llama-server, sealed -----------------------------------------------
@pytest.fixture(scope="module")
def side_runs(tmp_path_factory):
    """The stand-in-chat agent, from a copy of its spec file, on one fresh server per fix."""
    if not netns.available():
        pytest.skip(f"no loopback-only namespace: {netns.why_not()}")
    root = tmp_path_factory.mktemp("side")
    mine = root / "my-agent.json"
    shutil.copyfile(chat_agent.SPECS_DIR / "stand-in-chat.json", mine)
    tasks = [chat_agent.task("A", "Say hello.", str(mine), "ci", timeout_s=300),
             chat_agent.task("B", "Say thanks.", str(mine), "ci", timeout_s=300)]
    return side_calls.side_call_lab(root, "runs", tasks, ctx=2048)


@pytest.mark.slow
def test_a_second_agent_runs_from_configuration_alone(side_runs):
    from infercourse.ops.agent_lab import calls_table
    out = side_runs["one slot, --cache-ram 0"]
    calls = calls_table(out)
    assert list(calls["task"]) == ["A", "A", "B", "B"] and (calls["status"] == "ok").all()
    assert (calls["api"] == "openai-chat").all() and (calls["max_tokens"] == 4).all()
    # the server's own per-call count: what was not reused
    assert (calls["evaluated_tokens"] == calls["prompt_tokens"] - calls["cached_tokens"]).all()
    side, main = calls.iloc[2], calls.iloc[3]
    assert side["system"] != main["system"] and main["first_diff"] == "message 0 (system)"
    assert main["first_diff_same_system"] == "message 2 (user)"      # byte-stable up to the task's words
    man = json.loads((out / "manifest.json").read_text())
    assert man["network"]["namespace"] == "loopback-only" and man["load"]["cache_ram_mib"] == 0
    assert man["agents"] == {"stand-in-chat": "python -m infercourse.testing_chat_agent"}


@pytest.mark.slow
def test_which_setting_holds_the_main_prefix(side_runs):
    table = side_calls.side_call_table(side_runs)
    after = table[table["after_side"]].set_index("fix")
    assert after.loc["one slot, --cache-ram 0", "evaluated_tokens"] > 0.9 * after.loc["one slot, --cache-ram 0",
                                                                                      "prompt_tokens"]
    for fix in ("--cache-ram 8192", "-np 2, --cache-ram 0"):
        assert after.loc[fix, "evaluated_tokens"] < 0.1 * after.loc[fix, "prompt_tokens"]
    s = side_calls.side_call_sentence(table)
    assert _says(s, "lost after a side call with `one slot, --cache-ram 0`")


@pytest.mark.slow
@needs_netns
def test_agent_run_cli_takes_an_agent_as_a_command_line(tmp_path, capsys):
    from infercourse.cli.agent import agent_main
    out = tmp_path / "run"
    cmd = f"{sys.executable} -m infercourse.testing_chat_agent {{task}} --base-url {{base_url}}/v1 --model {{model}} " \
          "--side none --max-tokens 4"
    rc = agent_main(["run", "--agent", "chat", "--cmd", cmd, "--route-env", "STANDIN_CHAT_KEY={api_key}",
                     "--name", "my-cli", "--task", "Say hello.", "--ctx", "1024", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0 and "Every call had the agent's main system prompt: no side call." in printed
    assert json.loads((out / "manifest.json").read_text())["workload"]["tasks"][0]["agent"] == "my-cli"
    assert agent_main(["run", "--agent", "chat", "--cmd", "x {task}", "--route-env", "OPENAI_API_KEY=sk-real",
                       "--task", "t", "--out", str(tmp_path / "r2")]) == 2


@pytest.mark.slow
def test_doctor_agent_chat_on_a_real_server(side_runs, capsys):
    """On one slot with --cache-ram 0 the probe sees the side call evict; the settings follow."""
    from infercourse.__main__ import main
    from infercourse.servers import LlamaServer
    with LlamaServer(n_parallel=1, ctx_size=2048, threads=1, jinja=True, cache_ram_mib=0) as srv:
        rc = main(["doctor", "agent", srv.url, "--agent", "chat", "--spec", "stand-in-chat",
                   "--capture", str(side_runs["one slot, --cache-ram 0"])])
        out = capsys.readouterr().out
    assert rc == 1 and "[fail] KV cache" in out and "evicts the main prefix" in out
    assert "--cache-ram" in out and "-np 2 -c 4096" in out
    assert re.search(r"evaluated tokens per probe call: main \d+, main again \d+, side \d+", out)


@pytest.mark.slow
def test_the_chat_probe_reads_the_trained_context_so_the_fix_extends_past_it():
    """Notebook 20's chat doctor, fed the agent's 11,323-token first request on an 8,192-token
    server, printed "-c 12544 -np 1" alone (2026-12-06): its probe never read the trained
    context, so the fix carried no YaRN flags where the Claude Code doctor's did."""
    from infercourse.servers import LlamaServer
    with LlamaServer(n_parallel=1, ctx_size=1024, threads=1, jinja=True, cache_ram_mib=0) as srv:
        ev = chat_doctor.probe_chat_route(srv.url, probe_tokens=64, side_tokens=16)
    assert ev["arch"] == "llama" and ev["n_ctx_train"] == 8192 and ev["trained_from"] == "its model file"
    shape = {**SHAPE, "first_request": {**SHAPE["first_request"], "prompt_tokens": 11323}}
    text = chat_doctor.chat_fixes(ev, shape, chat_doctor.grade_chat_route(ev, shape), None)
    assert "--rope-scaling yarn" in text and "--yarn-orig-ctx 8192" in text and "past the 8,192 tokens" in text


def test_skip_reason_names_the_namespace_or_the_program(monkeypatch):
    monkeypatch.setattr(netns, "why_not", lambda: "no unshare here")
    assert "no loopback-only network namespace here (no unshare here)" in chat_agent.skip_reason("stand-in-chat")
    monkeypatch.setattr(netns, "why_not", lambda: None)
    assert chat_agent.skip_reason("stand-in-chat") is None      # the course's own stand-in needs no npm
    assert "not found" in chat_agent.skip_reason({"name": "g", "command": "no-such-agent", "argv": ["{bin}"]})
