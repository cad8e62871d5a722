"""Hardware profiles: one parameter sizes every phase-3/4 lesson."""
import pytest

from infercourse.core.errors import HardwareLayerError
from infercourse.ops import profiles


def test_profiles_scale_up_from_cpu():
    cpu, mac, gpu = (profiles.profile(n) for n in ("cpu", "mac", "gpu"))
    assert cpu.needs is None and cpu.model is None             # the embedded model, anywhere
    assert max(cpu.concurrencies) < max(mac.concurrencies) < max(gpu.concurrencies)
    assert cpu.n_requests < mac.n_requests < gpu.n_requests
    assert "mlx" in mac.engines and "vllm" in gpu.servers


def test_overrides_and_bad_names():
    assert profiles.profile("cpu", n_requests=3).n_requests == 3
    assert profiles.profile("cpu").n_requests != 3               # the table is not mutated
    with pytest.raises(ValueError, match="unknown profile"):
        profiles.profile("tpu")


def test_require_names_the_hardware_layer(monkeypatch):
    monkeypatch.setattr(profiles, "_has", lambda needs: needs is None)   # a plain CPU box
    assert profiles.detect().name == "cpu"
    assert profiles.require(profiles.profile("cpu")).name == "cpu"
    with pytest.raises(HardwareLayerError, match=r"nvidia-gpu.*\(hardware layer\)"):
        profiles.require(profiles.profile("gpu"))
    monkeypatch.setattr(profiles, "_has", lambda needs: needs in (None, "apple-silicon"))
    assert profiles.detect().name == "mac"
