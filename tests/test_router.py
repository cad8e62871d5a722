"""Replicas behind a real router (sglang-router) on loopback: the command it runs, the group
starting, serving and tearing down together, and what the policy does to a session's
cache (round-robin scatters its turns over replicas; cache-aware keeps them on one)."""
import importlib.util
import sys

import pytest

from infercourse.core.errors import BackendMissingError
from infercourse.servers import router as rt
from infercourse.servers.process import Server

needs_router = pytest.mark.skipif(not rt.router_installed("sglang"),
                                  reason="sglang-router not installed (pip install 'infercourse[router]')")


@needs_router
def test_router_argv_stays_on_loopback():
    r = rt.Router(["http://127.0.0.1:1", "http://127.0.0.1:2"], policy="round_robin", retries=0)
    argv = r.argv()
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"   # sglang's default is 0.0.0.0
    assert argv[argv.index("--policy") + 1] == "round_robin"
    assert "--disable-retries" in argv
    workers = argv[argv.index("--worker-urls") + 1: argv.index("--policy")]
    assert workers == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert "--retry-max-retries" in rt.Router(["http://127.0.0.1:1"], retries=2).argv()


def test_router_refuses_what_it_cannot_do(monkeypatch):
    with pytest.raises(ValueError, match="no policy"):
        rt.Router(["http://127.0.0.1:1"], policy="consistent_hash")      # vllm-router's, not sglang's
    with pytest.raises(ValueError, match="unknown router"):
        rt.Router(["http://127.0.0.1:1"], kind="nginx")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in rt.ROUTERS.values() else real(name, *a))
    with pytest.raises(BackendMissingError, match="infercourse\\[router\\]"):
        rt.Router(["http://127.0.0.1:1"])


def _group(policy, **kw):
    try:
        return rt.ReplicaGroup(2, policy, n_parallel=1, ctx_size=2048, threads=1, cache_ram_mib=0, **kw)
    except BackendMissingError as e:
        pytest.skip(f"cannot run here: {e}")


@pytest.mark.slow
@needs_router
def test_group_starts_serves_and_tears_down_together():
    from infercourse.core.types import generate
    from infercourse.testing import port_closed, process_gone
    g = _group("round_robin")
    with g:
        assert g.running
        eng = g.engine()
        answers = [generate(eng, "Say hi.", max_tokens=4) for _ in range(2)]
        pids = [s.pid for s in [g.router, *g.replicas]]
        ports = [s.port for s in [g.router, *g.replicas]]
    assert all(a.usage and a.usage.completion_tokens >= 1 for a in answers)
    assert all(process_gone(p, within_s=30) for p in pids)
    assert all(port_closed(p) for p in ports)


@pytest.mark.slow
@needs_router
def test_cache_aware_keeps_a_session_on_its_replica(tmp_path):
    """One session of four turns through two replicas. Round-robin sends turn 1 to the
    replica that never saw the session: it reuses at most the chat template's first
    tokens. Cache-aware sends it back where its prefix is."""
    pytest.importorskip("httpx_sse")
    from infercourse.measure import sessions as ss
    script = ss.agentic_script(n_turns=4)
    rates = {}
    for policy in ("round_robin", "cache_aware"):
        with _group(policy) as g:
            r = ss.run_sessions(g.engine(), script, 1, think_scale=0.0, warmup=0,
                                out_dir=tmp_path / policy, progress=False)
        ok = r.df[r.df["status"] == "ok"].set_index("turn")
        assert len(ok) == 4, r.df[["status", "error"]]
        rates[policy] = ss.sessions_summary(r.df)["cache_hit_rate_later"]
        if policy == "round_robin":
            assert ok.loc[1, "cached_tokens"] <= 8, ok[["prompt_tokens", "cached_tokens"]]
    assert rates["cache_aware"] > rates["round_robin"] + 0.2, rates


@needs_router
def test_serve_replicas_builds_a_group_on_loopback():
    """`infercourse serve llama --replicas 2 --policy round_robin` is a ReplicaGroup whose
    face (URL, port, name) is the router's; nothing is started here."""
    from infercourse.ops.serve import make_server, serve_parser
    a = serve_parser().parse_args(["llama", "--replicas", "2", "--policy", "round_robin", "--parallel", "1"])
    try:
        g = make_server(a, [])
    except BackendMissingError as e:
        pytest.skip(f"cannot run here: {e}")
    assert isinstance(g, rt.ReplicaGroup) and len(g.replicas) == 2
    assert g.url == g.router.url and g.port == g.router.port and "round_robin" in g.name
    assert all(s.url.startswith("http://127.0.0.1:") for s in g.replicas)
    assert g.router.workers == [s.url for s in g.replicas] and not g.running


# -- teardown: every child stops, whatever interrupts the group ------------------------------------
# STAND-INS, not llama-server or a router: Python's http.server answers GET / with 200, enough
# to start, watch and stop real processes in a second, without sglang-router installed.


class _StandIn(Server):
    """Not an inference server: Python's http.server on loopback."""

    name, health_path = "standin", "/"

    def argv(self):
        return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(self.port)]


class _CtrlCWhileStopping(_StandIn):
    """Stops, then raises KeyboardInterrupt once: a second Ctrl-C during the group's teardown."""

    def stop(self, timeout: float = 15.0) -> None:
        super().stop(timeout)
        if not getattr(self, "_raised", False):
            self._raised = True
            raise KeyboardInterrupt


class _CtrlCWhileStarting(_StandIn):
    """Ctrl-C while this replica loads its model: start() is interrupted before it launches."""

    def start(self):
        raise KeyboardInterrupt


def _standin_group(router, replicas):
    g = rt.ReplicaGroup.__new__(rt.ReplicaGroup)     # the real start/stop, without a router install
    g.router, g.replicas = router, replicas
    return g


def _all_gone(servers) -> bool:
    from infercourse.testing import port_closed, process_gone
    return all(process_gone(s.pid, within_s=30) and port_closed(s.port) for s in servers)


def test_a_second_ctrl_c_while_stopping_still_stops_every_replica():
    g = _standin_group(_CtrlCWhileStopping(), [_StandIn(), _StandIn()]).start()
    assert g.running and all(s.pid for s in g.replicas)
    with pytest.raises(KeyboardInterrupt):          # stopped everything, then re-raised
        g.stop()
    assert _all_gone([g.router, *g.replicas])


def test_a_partial_start_interrupted_twice_leaves_nothing_running():
    """Ctrl-C during replica 2's start, and again during the teardown that follows."""
    first = _StandIn()
    g = _standin_group(_CtrlCWhileStopping(), [first, _CtrlCWhileStarting()])
    with pytest.raises(KeyboardInterrupt):
        g.start()
    assert first.pid and _all_gone([first])


def test_an_exception_in_the_with_block_stops_the_group():
    g = _standin_group(_StandIn(), [_StandIn(), _StandIn()])
    with pytest.raises(RuntimeError, match="lesson failed"):
        with g:
            pids = [s.pid for s in [g.router, *g.replicas]]
            raise RuntimeError("lesson failed")
    assert all(pids) and _all_gone([g.router, *g.replicas])
