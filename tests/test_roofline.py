"""Roofline arithmetic against hand computation, and the machine probe's sanity."""
import math
from types import SimpleNamespace

import pytest

from infercourse.measure import machine_probe as mp
from infercourse.measure import roofline as rl

# SmolLM2-135M-like shape: 30 layers, 3 KV heads of 64 dims.
CARD = {"n_layers": 30, "n_kv_heads": 3, "head_dim": 64, "weight_bytes": 100_000_000, "n_params": 135_000_000}


def test_kv_bytes_per_token_by_hand():
    assert rl.kv_bytes_per_token(30, 3, 64, 2) == 2 * 30 * 3 * 64 * 2 == 23_040
    assert rl.kv_bytes_per_token(32, 8, 128, 1) == 65_536


def test_bytes_per_token_and_decode_ceiling_by_hand():
    assert rl.bytes_per_decoded_token(CARD, 0) == 100_000_000
    assert rl.bytes_per_decoded_token(CARD, 1000) == 100_000_000 + 23_040_000
    # 10 GB/s over 123.04 MB per token
    assert rl.decode_ceiling_tok_per_s(10.0, CARD, 1000) == pytest.approx(10e9 / 123_040_000)
    assert rl.decode_ceiling_tok_per_s(10.0, CARD, 0) == pytest.approx(100.0)


def test_prefill_ceiling_and_mbu_by_hand():
    assert rl.prefill_ceiling_tok_per_s(100.0, CARD) == pytest.approx(100e9 / 270e6)
    assert rl.mbu(40.0, 10.0, CARD) == pytest.approx(0.4)


def test_prefill_ceiling_leaves_out_the_embedding():
    """SmolLM2-135M: 49152 x 576 = 28.3M tied embedding parameters are looked up, not
    multiplied, for every prompt token but the last; the ceiling counts the rest."""
    card = {**CARD, "n_params": 134_515_008, "vocab_size": 49_152, "hidden_size": 576}
    assert rl.prefill_params_per_token(card) == 134_515_008 - 49_152 * 576
    assert rl.prefill_ceiling_tok_per_s(100.0, card) == pytest.approx(100e9 / (2 * 106_203_456))
    # counting every parameter would be ~21 % pessimistic for this shape
    assert 1.2 < rl.prefill_ceiling_tok_per_s(100.0, card) / (100e9 / (2 * 134_515_008)) < 1.3
    # an embedding as large as the model is no shape we can trust: keep every parameter
    assert rl.prefill_params_per_token({**card, "vocab_size": 10**9}) == 134_515_008


def test_modelcard_object_equals_dict():
    card = SimpleNamespace(n_layers=30, n_kv_heads=3, head_dim=64, n_params=135_000_000,
                           weight_bytes=lambda: 100_000_000)
    assert rl.bytes_per_decoded_token(card, 512) == rl.bytes_per_decoded_token(CARD, 512)
    c = rl.ceilings(card, {"bandwidth_gbs": 10.0, "matmul_gflops_f32": 100.0}, contexts=(0,))
    assert c["decode_ceiling_tok_per_s@0"] == pytest.approx(100.0)
    assert c["kv_bytes_per_token"] == 23_040


def test_bad_backend_is_rejected():
    with pytest.raises(ValueError, match="backend"):
        rl.matmul_gflops(64, backend="fortran")


def test_bandwidth_units(monkeypatch):
    """bytes / seconds / 1e9: a 64 MiB array read in 1 s is 0.067 GB/s, on each thread count."""
    monkeypatch.setattr(mp, "_best_time", lambda fn, **kw: (fn(), 1.0)[1])
    bw = rl.memory_bandwidth_gbs(64, threads=(1, 2))
    assert bw["read_gbs"] == pytest.approx(64 * 2**20 / 1e9) and bw["by_threads"][2] == pytest.approx(bw["read_gbs"])
    assert bw["size_mb"] == 64 and bw["threads"] == 1
    monkeypatch.setattr(mp, "_best_time", lambda fn, **kw: (fn(), 0.5)[1])
    assert rl.matmul_gflops(64) == pytest.approx(2 * 64**3 / 0.5 / 1e9)


def test_probe_array_is_several_times_the_last_level_cache():
    """Issue 32: a 480 MiB L3 held every probe array (64-256 MB), so 06 read 29 GB/s and 03
    16 GB/s for one thread. The array is CACHE_FACTOR x the cache, at least MIN_MB, in 64 MiB
    steps, and at most half the memory available."""
    assert mp.probe_size_mb(480 * 2**20) == 4 * 480 == 1920
    assert mp.probe_size_mb(32 * 2**20) == mp.MIN_MB                       # a small cache: the floor
    assert mp.probe_size_mb(None) == mp.MIN_MB
    assert mp.probe_size_mb(100 * 2**20) == 448                           # 400 MiB, up to a 64 MiB step
    assert mp.probe_size_mb(480 * 2**20, available_bytes=2 * 2**30) == 1024   # half of 2 GiB free


def test_probe_text_flips_with_the_array_against_the_cache():
    base = {"by_threads": {1: 15.3}, "llc_bytes": 480 * 2**20, "llc_source": "/sys/.../index3/size = 491520K"}
    big = rl.probe_text({**base, "size_mb": 1920, "array_over_llc": 4.0})
    small = rl.probe_text({**base, "size_mb": 64, "array_over_llc": 64 / 480})
    assert "from memory, not the cache" in big and "may have come from the cache" not in big
    assert "may have come from the cache" in small and "not the cache" not in small
    assert "480 MiB" in big and "index3" in big and "1,920 MiB" in big and "15.3 GB/s" in big
    none = rl.probe_text({**base, "size_mb": 256, "llc_bytes": None, "llc_source": "no cache size found"})
    assert "could not be sized against the cache" in none


def test_achieved_gflops_by_hand():
    card = {**CARD, "vocab_size": 1000, "hidden_size": 100}
    assert rl.achieved_gflops(10.0, card) == pytest.approx(10 * 2 * 135e6 / 1e9)
    assert rl.achieved_gflops(10.0, card, "prefill") == pytest.approx(10 * 2 * (135e6 - 1e5) / 1e9)
    with pytest.raises(ValueError):
        rl.achieved_gflops(10.0, card, "verify")


def test_matmul_runs_on_the_threads_it_is_given(monkeypatch):
    """Issue 31: 11's f32 roof read 13 GFLOP/s, ~9x below torch on the same VM. numpy's BLAS
    spread over every core, and collapses when any core is busy; the server it is a roof for
    runs 1 thread. With `threads`, the matmul runs in a child whose BLAS starts with that many."""
    seen = {}

    def fake_run(argv, env, **kw):
        seen.update(argv=argv, env=env)
        return SimpleNamespace(stdout="123.5\n")
    monkeypatch.setattr(mp.subprocess, "run", fake_run)
    assert rl.matmul_gflops(256, threads=1) == 123.5
    assert all(seen["env"][v] == "1" for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"))
    assert seen["argv"][-3] == "256"


def test_probe_measures_the_matmul_on_the_engines_threads(monkeypatch):
    calls, sized = [], []
    monkeypatch.setattr(mp, "memory_bandwidth_gbs", lambda size=None, *, threads, budget_s: sized.append(size) or {
        "by_threads": {t: 10.0 * t for t in threads}, "size_mb": 1920, "llc_bytes": 1, "llc_source": "x"})
    monkeypatch.setattr(mp, "matmul_gflops", lambda n, threads=None, **kw: calls.append(threads) or 100.0)
    one = rl.probe(threads=1, quick=True)
    assert calls == [1] and one["matmul_threads"] == 1 and one["bandwidth_gbs"] == 10.0
    assert sized == [None] and one["array_mb"] == 1920                # quick keeps the cache-sized array
    two = rl.probe(threads=2, quick=True)
    assert two["matmul_threads"] == 2 and calls[-1] == 2 and two["bandwidth_gbs"] == 20.0


@pytest.mark.slow
def test_matmul_on_one_thread_is_positive_and_torch_keeps_its_setting():
    assert 0 < rl.matmul_gflops(128, threads=1, repeats=5, budget_s=0.2) < math.inf
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    assert rl.matmul_gflops(128, threads=1, backend="torch", repeats=3, budget_s=0.2) > 0
    assert torch.get_num_threads() == before


@pytest.mark.slow
def test_probe_positive_finite_and_consistent():
    a = rl.probe(quick=True, threads=2)
    assert a["matmul_threads"] == 2
    for key in ("read_gbs_1t", "read_gbs_mt", "matmul_gflops_f32", "bandwidth_gbs"):
        assert math.isfinite(a[key]) and a[key] > 0, key
    # the ceiling used downstream is the best read probe, whatever this machine's speed
    assert a["bandwidth_gbs"] == max(a["read_gbs_1t"], a["read_gbs_mt"])
