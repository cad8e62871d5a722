"""GPU and Apple Silicon detection, tested on recorded outputs (no GPU or Mac is lent here)."""
import sys
import types

import pytest

from infercourse.measure import hardware
from infercourse.ops import profiles

# `nvidia-smi --query-gpu=index,name,memory.total,memory.used,utilization.gpu,power.draw,
#  power.limit,driver_version --format=csv,noheader,nounits` on a 2-GPU box; the second GPU
# cannot report power (nvidia-smi then prints "[N/A]").
SMI = """0, NVIDIA H100 80GB HBM3, 81559, 71234, 97, 612.45, 700.00, 550.54.15
1, NVIDIA A10G, 23028, 1, 0, [N/A], [N/A], 550.54.15
"""

# `system_profiler SPDisplaysDataType -json` on a Mac Studio (M2 Max), trimmed.
APPLE = """{"SPDisplaysDataType": [{"_name": "kHW_AppleM2MaxItem", "sppci_bus": "spdisplays_builtin",
  "sppci_cores": "38", "sppci_device_type": "spdisplays_gpu", "sppci_model": "Apple M2 Max",
  "spdisplays_mtlgpufamilysupport": "spdisplays_metal3", "spdisplays_vendor": "sppci_vendor_Apple"}]}"""


def test_nvidia_smi_rows_parse_with_units_and_missing_values():
    gpus = hardware.parse_nvidia_smi(SMI)
    assert [g["index"] for g in gpus] == [0, 1]
    h100, a10 = gpus
    assert h100["name"] == "NVIDIA H100 80GB HBM3" and h100["driver"] == "550.54.15"
    assert h100["memory_total_mib"] == 81559 and h100["memory_used_mib"] == 71234
    assert h100["utilization_pct"] == 97 and h100["power_w"] == pytest.approx(612.45)
    assert a10["power_w"] is None and a10["power_limit_w"] is None     # "[N/A]" is not a number
    assert hardware.parse_nvidia_smi("") == [] and hardware.parse_nvidia_smi("garbage line") == []


class _Mem:
    total, used = 80 * 2**30, 20 * 2**30


def _fake_nvml(n_gpus=1, power_error=False):
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def power(h):
        if power_error:
            raise NVMLError("Not Supported")
        return 350_000                                # milliwatts

    m.NVMLError = NVMLError
    m.calls = []
    m.nvmlInit = lambda: m.calls.append("init")
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlSystemGetDriverVersion = lambda: b"550.54.15"
    m.nvmlDeviceGetCount = lambda: n_gpus
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: "NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetMemoryInfo = lambda h: _Mem()
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=42, memory=10)
    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    return m


def test_nvml_is_preferred_and_converts_units(monkeypatch):
    fake = _fake_nvml(n_gpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(hardware.shutil, "which", lambda name: pytest.fail("nvidia-smi must not run"))
    gpus = hardware.gpu_stats()
    assert len(gpus) == 2 and fake.calls == ["init", "shutdown"]
    g = gpus[0]
    assert g["memory_total_mib"] == 80 * 1024 and g["memory_used_mib"] == 20 * 1024
    assert g["power_w"] == 350 and g["power_limit_w"] == 700 and g["utilization_pct"] == 42
    assert g["driver"] == "550.54.15"                  # bytes from old NVML bindings decoded


def test_nvml_unsupported_query_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(power_error=True))
    assert hardware.gpu_stats()[0]["power_w"] is None


def test_falls_back_to_nvidia_smi_then_to_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)          # import pynvml -> ImportError
    monkeypatch.setattr(hardware.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(hardware, "_run", lambda cmd: SMI)
    assert [g["name"] for g in hardware.gpu_stats()] == ["NVIDIA H100 80GB HBM3", "NVIDIA A10G"]
    # manifests keep static facts only: live load would make every two runs "differ"
    assert set(hardware._gpus()[0]) == {"name", "memory_total_mib", "driver"}
    monkeypatch.setattr(hardware.shutil, "which", lambda name: None)
    assert hardware.gpu_stats() == []


def test_apple_gpu_facts_parse():
    facts = hardware.parse_apple_displays(APPLE)
    assert facts == {"gpu": "Apple M2 Max", "gpu_cores": 38, "metal": "spdisplays_metal3"}
    assert hardware.parse_apple_displays("not json") == {}
    assert hardware.parse_apple_displays('{"SPDisplaysDataType": []}') == {}


def test_apple_silicon_reads_sysctl(monkeypatch):
    monkeypatch.setattr(hardware.sys, "platform", "darwin")
    monkeypatch.setattr(hardware.platform, "machine", lambda: "arm64")
    answers = {"machdep.cpu.brand_string": "Apple M2 Max", "hw.memsize": str(64 * 2**30),
               "hw.perflevel0.physicalcpu": "8", "hw.perflevel1.physicalcpu": "4"}
    monkeypatch.setattr(hardware, "_run", lambda cmd: APPLE if cmd[0] == "system_profiler" else answers[cmd[-1]])
    info = hardware.apple_silicon()
    assert info["chip"] == "Apple M2 Max" and info["unified_memory_gb"] == 64.0
    assert (info["p_cores"], info["e_cores"], info["gpu_cores"]) == (8, 4, 38)


def test_not_a_mac_here_is_none(monkeypatch):
    monkeypatch.setattr(hardware.sys, "platform", "linux")
    assert hardware.apple_silicon() is None


def test_gpu_profile_needs_a_gpu_not_just_the_tool(monkeypatch):
    monkeypatch.setattr(profiles.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(hardware, "gpu_stats", lambda: [])          # driver tool, no GPU
    assert not profiles._has("nvidia-gpu")
    monkeypatch.setattr(hardware, "gpu_stats", lambda: hardware.parse_nvidia_smi(SMI))
    assert profiles._has("nvidia-gpu") and profiles.detect().name == "gpu"


def test_doctor_prints_the_accelerator(monkeypatch, capsys):
    from infercourse.ops import doctor
    monkeypatch.setattr(doctor, "gpu_stats", lambda: hardware.parse_nvidia_smi(SMI))
    doctor.print_report(doctor.env_report(engines=False))
    out = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3: 71234 MiB used of 81559 MiB, 97 % busy, 612 W of 700 W" in out
    assert "A10G" in out and "- of -" in out                        # power unknown, said so


X86_CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512_fp16 amx_tile
"""
ARM_CPUINFO = """processor\t: 0
Features\t: fp asimd evtstrm aes crc32 atomics fphp asimdhp asimddp i8mm
"""


def test_fp16_flags_reach_the_report_on_x86_and_arm(monkeypatch):
    """Issue 31: a CPU with avx512_fp16 was said to lack 16-bit arithmetic; doctor's flag
    filter hid the flag (and ARM's fphp/asimdhp)."""
    x86, arm = hardware.parse_cpu_flags(X86_CPUINFO), hardware.parse_cpu_flags(ARM_CPUINFO)
    assert hardware.fp16_support(x86) == {"convert": ["f16c"], "arithmetic": ["avx512_fp16"]}
    assert hardware.fp16_support(arm) == {"convert": ["fp"], "arithmetic": ["fphp", "asimdhp"]}
    assert hardware.fp16_support({"avx2", "f16c"}) == {"convert": ["f16c"], "arithmetic": []}
    for text, shown in ((X86_CPUINFO, {"avx512_fp16", "f16c"}), (ARM_CPUINFO, {"fphp", "asimdhp", "asimddp", "i8mm"})):
        monkeypatch.setattr(hardware, "cpu_flags_all", lambda t=text: hardware.parse_cpu_flags(t))
        assert shown <= set(hardware.hardware_info()["cpu_flags"])


def test_mac_flags_come_from_sysctl(monkeypatch):
    monkeypatch.setattr(hardware.sys, "platform", "darwin")
    on = {"hw.optional.AdvSIMD", "hw.optional.arm.FEAT_FP16", "hw.optional.arm.FEAT_DotProd"}
    monkeypatch.setattr(hardware, "_run", lambda cmd: "1" if cmd[-1] in on else "0")
    assert hardware.fp16_support() == {"convert": ["fp"], "arithmetic": ["fphp", "asimdhp"]}
    assert "asimddp" in hardware.cpu_flags_all() and "i8mm" not in hardware.cpu_flags_all()


def test_llamacpp_build_features_parse():
    text = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | REPACK = 1 | \nMetal : EMBED_LIBRARY = 1 | "
    got = hardware.parse_system_info(text)
    assert got["AVX2"] == "1" and got["REPACK"] == "1" and got["EMBED_LIBRARY"] == "1" and "AVX512" not in got
    assert hardware.parse_system_info("NEON = 1 | FP16_VA = 1 | SVE_CNT = 16 |")["SVE_CNT"] == "16"


def test_doctor_shows_fp16_support_and_the_build(monkeypatch, capsys):
    from infercourse.ops import doctor
    monkeypatch.setattr(hardware, "cpu_flags_all", lambda: hardware.parse_cpu_flags(X86_CPUINFO))
    monkeypatch.setattr(doctor, "llamacpp_features", lambda: {"AVX2": "1", "F16C": "1", "AVX512": "0"})
    monkeypatch.setattr(doctor, "CHECKS", {"llamacpp": lambda: (True, "llama-cpp-python x")})
    doctor.print_report(doctor.env_report(engines=True))
    out = capsys.readouterr().out
    assert "convert: f16c; 16-bit arithmetic: avx512_fp16" in out
    assert "llama.cpp built" in out and "AVX2 F16C" in out and "AVX512" not in out.split("llama.cpp built")[1].splitlines()[0]


# -- the last-level cache, which sizes the bandwidth probe (issue 32) --------------------------------
def _sys_cache(root, entries):
    for i, (level, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
    return root


def test_llc_from_sys_names_the_file_it_read(monkeypatch, tmp_path):
    """This course's VM: L1d 48K, L1i 64K, L2 2048K, L3 491520K (480 MiB)."""
    root = _sys_cache(tmp_path / "cache", [(1, "48K"), (1, "64K"), (2, "2048K"), (3, "491520K")])
    monkeypatch.setattr(hardware, "_SYS_CACHE", root)
    llc = hardware.last_level_cache()
    assert llc["bytes"] == 480 * 2**20 and llc["level"] == 3
    assert "index3" in llc["source"] and "491520K" in llc["source"]
    assert hardware.last_level_cache_bytes() == 480 * 2**20


def test_llc_falls_back_to_lscpu_then_sysctl_then_says_none(monkeypatch, tmp_path):
    monkeypatch.setattr(hardware, "_SYS_CACHE", tmp_path / "absent")
    out = {"lscpu": "L1d cache: 96 KiB (2 instances)\nL2 cache: 4 MiB (2 instances)\nL3 cache: 32 MiB (1 instance)\n"}
    monkeypatch.setattr(hardware, "_run", lambda cmd: out.get(cmd[0]) if cmd[0] == "lscpu" else out.get(cmd[-1]))
    llc = hardware.last_level_cache()
    assert llc == {"bytes": 32 * 2**20, "level": 3, "source": "lscpu (L3 cache, all instances)"}
    # an Apple Silicon Mac: no lscpu, no L3, the performance cores' L2
    out = {"hw.perflevel0.l2cachesize": "16777216"}
    llc = hardware.last_level_cache()
    assert llc["bytes"] == 16 * 2**20 and llc["level"] == 2 and llc["source"] == "sysctl hw.perflevel0.l2cachesize"
    out = {}
    assert hardware.last_level_cache()["bytes"] is None and "no cache size" in hardware.last_level_cache()["source"]


def test_lscpu_cache_lines_parse():
    text = "L1d cache:  96 KiB (2 instances)\nL1i cache: 128 KiB (2 instances)\nL2 cache:   4 MiB (2 instances)\n" \
           "L3 cache:   480 MiB (1 instance)\n"
    assert hardware.parse_lscpu_caches(text) == {1: 96 * 1024, 2: 4 * 2**20, 3: 480 * 2**20}
    assert hardware.parse_lscpu_caches("") == {}
