"""llama-server's router mode (servers.llama_router) against the real binary: presets,
alias routing, an unknown model, LRU swap at models_max 1, both resident at 2, a killed
instance, a dead router, teardown on an exception; bench and the layer doctor through it.

Every router runs 1 thread per child and a small context. Waits end on events (a status
the router reports, a process gone); their deadlines are safety nets, never speed bounds.
"""
from __future__ import annotations

import json
import os
import signal

import psutil
import pytest

from infercourse.core.errors import BackendMissingError, ModelLayerError, ServerLayerError
from infercourse.servers import llama_router as lr
from infercourse.testing import port_closed, process_gone

KW = dict(threads=1, ctx_size=512, n_parallel=1)


def _presets():
    try:
        from infercourse.servers.llama import llama_server_binary
        llama_server_binary()
        return lr.course_presets()
    except BackendMissingError as e:   # the one reason to skip: no llama-server built here
        pytest.skip(f"cannot run here: {e}")


def test_preset_ini_has_global_flags_sections_and_aliases():
    from infercourse.models.embedded import resolve_model
    path = resolve_model(None).path
    ini = lr.preset_ini([lr.Preset("main", path, ("claude-sonnet-4-6",), True, {"ctx-size": 256}),
                         lr.Preset("fast", path)], {"threads": 1, "metrics": True})
    version, glob, main, fast = ini.split("\n\n")
    assert version == "version = 1" and glob.splitlines() == ["[*]", "threads = 1", "metrics = true"]
    assert main.splitlines() == ["[main]", f"model = {path}", "alias = claude-sonnet-4-6",
                                 "load-on-startup = true", "ctx-size = 256"]
    assert fast.split() == ["[fast]", "model", "=", str(path)]


@pytest.mark.parametrize("presets, match", [
    ([("a", ()), ("b", ("a",))], "given twice"),            # an alias that is another model's name
    ([("a", ("x",)), ("b", ("x",))], "given twice"),        # one alias for two models
    ([("a]\n[b", ())], "use letters"),                       # would open a section of its own
])
def test_preset_ini_refuses_names_the_router_would_reject(presets, match):
    with pytest.raises(ValueError, match=match):
        lr.preset_ini([lr.Preset(n, None, a) for n, a in presets])


def test_router_argv_stays_on_loopback_and_child_flags_go_in_the_preset():
    r = lr.LlamaRouter(_presets(), models_max=2, sleep_idle_s=30, **KW)
    argv = r.argv()
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--models-max") + 1] == "2" and "--models-autoload" in argv
    assert "-t" not in argv and "--threads" not in argv   # on the command line they would beat every preset
    assert "threads = 1" in r.ini and "sleep-idle-seconds = 30" in r.ini and "ctx-size = 512" in r.ini
    with pytest.raises(ValueError):
        lr.LlamaRouter(_presets(), sleep_idle_s=0)


def _pids(router):
    return {m["name"]: m["pid"] for m in router.models() if m["pid"]}


def test_lifecycle_alias_routing_unknown_model_swap_and_teardown():
    from infercourse.lessons.model_routing import ask
    with lr.LlamaRouter(_presets(), models_max=1, **KW) as r:
        assert {m["name"]: m["status"] for m in r.models()} == {"main": "unloaded", "fast": "unloaded"}
        assert r.model_status("claude-haiku-4-5")["name"] == "fast"
        assert ask(r, "claude-haiku-4-5")["status"] == "ok"          # cold load by alias
        fast_pid = _pids(r)["fast"]
        assert _pids(r).keys() == {"fast"} and psutil.pid_exists(fast_pid)
        assert ask(r, "claude-sonnet-4-6", api="chat")["status"] == "ok"   # swap: LRU evicts fast
        assert r.model_status("fast")["status"] == "unloaded" and _pids(r).keys() == {"main"}
        assert process_gone(fast_pid, 30.0) and not r.dead_instances()   # an eviction is not a death
        bad = ask(r, "nonexistent-model")
        assert bad["status"] == "error" and "400" in bad["error"] and "not found" in bad["error"]
        with pytest.raises(ModelLayerError, match="nonexistent-model"):
            r.model_status("nonexistent-model")
        pids = [r.pid, r.proc.pid, *_pids(r).values()]
        r.check()
    assert all(process_gone(p, 30.0) for p in pids) and port_closed(r.port)


def test_models_max_2_keeps_both_models_resident():
    from infercourse.lessons.model_routing import ask
    with lr.LlamaRouter(_presets(), models_max=2, **KW) as r:
        assert ask(r, "fast-model")["status"] == ask(r, "main-model")["status"] == "ok"
        pids = _pids(r)
        assert pids.keys() == {"main", "fast"} and pids["main"] != pids["fast"]
        mem = r.memory()
        assert mem.keys() == {"router", "main", "fast"} and all(v > 0 for v in mem.values())
        assert ask(r, "fast")["status"] == "ok" and _pids(r) == pids   # no reload: the same processes


def test_a_killed_instance_says_so_and_the_next_request_reloads_it():
    from infercourse.lessons.model_routing import ask
    with lr.LlamaRouter(_presets(), models_max=1, **KW) as r:
        assert ask(r, "main")["status"] == "ok"
        old = r.kill_instance("main")
        assert process_gone(old, 30.0)
        m = r.wait_status("main", ("unloaded",))
        assert m["failed"] and m["exit_code"] not in (None, 0)
        with pytest.raises(ServerLayerError, match=r"instance\(s\) died: main"):
            r.check()
        assert r.running   # the router itself survived its child
        assert ask(r, "main")["status"] == "ok"           # autoload starts a fresh instance
        assert _pids(r)["main"] != old
        r.check()                                          # loaded again: nothing is dead now
        assert "exited with status" in r.log_path.read_text()   # the router's log says so too


def test_a_dead_router_says_so_and_takes_its_children_along():
    from infercourse.lessons.model_routing import ask
    with lr.LlamaRouter(_presets(), models_max=1, **KW) as r:
        ask(r, "fast")
        child = _pids(r)["fast"]
        os.kill(r.pid, signal.SIGKILL)
        assert process_gone(r.pid, 30.0) and process_gone(child, 60.0)   # the watchdog ends the group; a child also exits on EOF of its stdin
        with pytest.raises(ServerLayerError, match="not running|not answering"):
            r.check()


def test_an_exception_in_the_with_block_stops_router_and_children():
    from infercourse.lessons.model_routing import ask
    r = lr.LlamaRouter(_presets(), models_max=2, **KW)
    with pytest.raises(RuntimeError, match="boom"):
        with r:
            ask(r, "fast")
            ask(r, "main")
            pids = [r.pid, r.proc.pid, *_pids(r).values()]
            assert len(pids) == 4
            raise RuntimeError("boom")
    assert all(process_gone(p, 30.0) for p in pids) and port_closed(r.port)


def test_load_on_startup_and_a_model_that_fails_to_load(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)   # a header and nothing else: llama.cpp refuses it
    main = _presets()[0]
    with lr.LlamaRouter([lr.Preset("main", main.model, load_on_startup=True), lr.Preset("broken", bad)],
                        models_max=2, **KW) as r:
        assert r.model_status("main")["status"] == "loaded"   # ready when start() returned
        for _ in range(2):   # a second try fails anew: not mistaken for the first failure
            with pytest.raises(ModelLayerError, match="broken.*failed to load"):
                r.load("broken")
            assert [m["name"] for m in r.dead_instances()] == ["broken"]


def _counter(router, model, name):
    from infercourse.ops.probes import parse_metrics
    text = router._call("GET", f"/metrics?model={model}&autoload=false").text
    return parse_metrics(text).get(name)


def test_bench_dataset_with_per_line_models_splits_by_model(tmp_path):
    from infercourse.measure import bench
    from infercourse.measure.datasets import dataset_workload
    from infercourse.measure.results import compare, load_run, report_lines
    lines = [{"prompt": f"Say a colour, number {i}.", "max_tokens": 6,
              "model": "claude-sonnet-4-6" if i % 4 else "claude-haiku-4-5"} for i in range(8)]
    f = tmp_path / "mix.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines))
    with lr.LlamaRouter(_presets(), models_max=2, **KW) as r:
        res = bench.run(r.engine(api="completions"), dataset_workload(f), warmup=0, progress=False,
                        out_dir=tmp_path / "run", sample_s=None)
        t = res.by_model
        assert t["n_ok"].to_dict() == {"claude-haiku-4-5": 2, "claude-sonnet-4-6": 6}
        # each child generated exactly the tokens of the rows tagged with its model: the
        # router really sent every request to the model its line named
        for name, alias in (("fast", "claude-haiku-4-5"), ("main", "claude-sonnet-4-6")):
            rows = res.df[res.df["model"] == alias]
            assert _counter(r, name, "llamacpp:tokens_predicted_total") == rows["output_tokens"].sum()
    out = report_lines(res.df)
    assert any(s.startswith("model claude-haiku-4-5: 2 ok of 2") for s in out)
    table = compare([load_run(tmp_path / "run")])
    assert {"run [claude-haiku-4-5]", "run [claude-sonnet-4-6]"} <= set(table.index)
    assert res.manifest["workload"]["models"] == {"claude-sonnet-4-6": 6, "claude-haiku-4-5": 2}


def test_doctor_layers_probe_the_named_model_through_the_router():
    from infercourse.ops.layers import doctor_layers
    from infercourse.ops.probes import collect_http
    with lr.LlamaRouter(_presets(), models_max=2, **KW) as r:
        # timeout_s: each probe's deadline, a safety net on a busy machine (not a speed bound)
        ev = collect_http(r.url, server=r, model="fast", timeout_s=60.0)
        assert ev["api"]["stream"]["ok"]
        assert ev["model"]["model_path"] == str(r.presets[1].model)   # /props?model=fast, not the router's
        assert ev["engine"]["metrics"] and ev["engine"]["slots"], ev["engine"]
        assert ev["model"]["tool_turn"]["ok"]                          # the POST carried the model
        # no model named: the one loaded now (fast) is probed, and main is not loaded by a probe
        ev = collect_http(r.url, server=r, timeout_s=60.0)
        assert ev["model"]["model_path"] == str(r.presets[1].model)
        assert r.model_status("main")["status"] == "unloaded"
        report = doctor_layers(r.url, server=r, model="fast", timeout_s=60.0)
        assert report.checks[0].status == "ok"


def test_router_replicas_behind_sglang_route_by_model_on_each_replica():
    from infercourse.core.trace import record
    from infercourse.core.types import Request
    from infercourse.servers.router import router_installed
    if not router_installed("sglang"):
        pytest.skip("sglang-router is not installed (pip install 'infercourse[router]')")
    from infercourse.servers.router import RouterReplicas
    g = RouterReplicas(_presets(), 2, policy="round_robin", models_max=2, **KW)
    with g:
        for m in ("claude-haiku-4-5", "claude-sonnet-4-6", "claude-haiku-4-5", "claude-sonnet-4-6"):
            assert record(g.engine(m), Request(prompt="hi", max_tokens=3)).status == "ok"
        bad = record(g.engine("nonexistent-model"), Request(prompt="hi", max_tokens=3))
        assert bad.status == "error" and "not found" in bad.error   # the replica's router answered
        loaded = [{m["name"] for m in r.models() if m["status"] == "loaded"} for r in g.replicas]
        assert set().union(*loaded) == {"main", "fast"} and all(loaded)   # both replicas served
        pids = [p for s in (g.front, *g.replicas) for p in (s.pid, s.proc.pid)]
    assert all(process_gone(p, 30.0) for p in pids)


def test_doctor_layers_cli_passes_the_model_name(monkeypatch, capsys):
    """`doctor layers URL --model NAME` asks for NAME (a stand-in doctor records its arguments)."""
    from infercourse.ops import faultlab, layers
    seen = {}

    class _Report:
        failed = False

        def __str__(self):
            return "stand-in report"

    def fake(url, **kw):
        seen.update(kw, url=url)
        return _Report()

    monkeypatch.setattr(layers, "doctor_layers", fake)
    assert faultlab.layers_main(["http://127.0.0.1:9", "--model", "claude-haiku-4-5"]) == 0
    assert seen["url"] == "http://127.0.0.1:9" and seen["model"] == "claude-haiku-4-5"
    assert faultlab.layers_main(["http://127.0.0.1:9"]) == 0 and seen["model"] is None


def test_load_times_reads_one_row_per_load_from_the_routers_own_log():
    from infercourse.lessons.model_routing import ask, load_times
    with lr.LlamaRouter(_presets(), models_max=1, **KW) as r:
        for m in ("fast", "main", "fast"):       # cold, swap, swap: three loads
            assert ask(r, m)["status"] == "ok"
        t = load_times(r.log_path.read_text())
    assert list(t["model"]) == ["fast", "main", "fast"] and (t["loaded_s"] > 0).all()
    assert t["port"].nunique() >= 2              # each load a new child


def test_sleep_trials_wait_for_sleep_then_wake_the_model():
    from infercourse.lessons.model_routing import SLEEP_ARMS, sleep_trials
    from infercourse.measure import noise
    res = sleep_trials(_presets(), model="fast", sleep_idle_s=1, repeats=2, **KW)
    req = res["requests"]
    assert list(req["arm"]) == [a for _, a in noise.schedule(SLEEP_ARMS, 2)] and (req["status"] == "ok").all()
    assert (req.loc[req["arm"] == "after sleep", "found"] == "sleeping").all()   # they waited for the event
    assert res["rss_asleep_mib"] < res["rss_awake_mib"]                        # sleep freed the weights


def test_killed_instance_keeps_the_router_and_the_other_model():
    from infercourse.lessons.model_failover import killed_instance, killed_text
    s = killed_instance(_presets(), model="main", n_after=2, **KW)
    assert s["killed_pid"] and s["router_up"] and s["kept"] == ["fast"]
    assert s["signal"] == "SIGKILL" and s["router_failed"] and s["router_exit_code"] not in (None, 0)
    assert f"exit code {s['router_exit_code']}" in killed_text(s).splitlines()[0]   # what the router said
    assert "main" in s["router_said"] and s["next_found"] == "unloaded"
    assert s["after_ok"] == 2 and s["status_now"] == "loaded"


@pytest.mark.slow
def test_each_family_preset_carries_its_own_chat_template_and_gemma_without_one_gets_chatml():
    import httpx

    from infercourse.lessons.families import family_presets
    from infercourse.measure.workloads import DATA_DIR
    from infercourse.models import gemma3
    ok, why = gemma3.available()
    if not ok:
        pytest.skip(f"Gemma 3 not here: {why}")
    presets = family_presets()
    sections = {s.splitlines()[0]: s for s in lr.preset_ini(presets).split("\n\n")[2:]}
    assert f"chat-template-file = {DATA_DIR / 'gemma3_tools.jinja'}" in sections["[gemma3]"]
    assert not any("chat-template-file" in sections[s] for s in ("[smollm2]", "[gemma3-chatml]"))
    with lr.LlamaRouter(presets, models_max=len(presets), **KW) as r:
        for p in presets:
            r.load(p.name)
        props = {p.name: httpx.get(r.url + "/props", params={"model": p.name}, timeout=30).json() for p in presets}
    assert "<start_of_turn>" in props["gemma3"]["chat_template"]
    assert "<|im_start|>" in props["gemma3-chatml"]["chat_template"]      # llama-server's fallback: ChatML
    caps = {n: p["chat_template_caps"]["supports_tools"] for n, p in props.items()}
    assert caps == {"smollm2": False, "smollm2-tools": True, "gemma3": True, "gemma3-chatml": False}
