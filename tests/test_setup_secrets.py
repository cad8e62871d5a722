"""Set-up that survives a failed or changed build, and secrets that stay out of `ps`.

Set-up: the Makefile's install stamp names the llama.cpp flags it was built with (so other
flags rebuild, the same ones do nothing); the build script re-configures after a configure
that failed; torch is pinned on every branch; the README's rows say what the Makefile does.
Secrets: a server's key travels in the variable the server reads, never in argv; the same
variable in the learner's shell never reaches a course server started without a key.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def _build_script():
    spec = importlib.util.spec_from_file_location("build_llamacpp", ROOT / "tools" / "build_llamacpp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _make(*args: str, venv: Path) -> str:
    """`make ARGS` in the repo with VENV= a temp folder; no LLAMA_CMAKE_ARGS inherited
    (`make test` exports it, and an inherited value would hide the Makefile's defaults)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_CMAKE_ARGS", "MAKEFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), f"VENV={venv}", *args],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _var(name: str, venv: Path, *args: str) -> str:
    return _make("-s", "--eval", f"_print: ; @echo '$({name})'", "_print", *args, venv=venv).strip()


# -- the Makefile's stamp --------------------------------------------------------------------

@needs_make
def test_the_stamp_names_the_llama_cpp_flags(tmp_path):
    cpu = _var("STAMP", tmp_path, "LLAMA_CMAKE_ARGS=-DGGML_NATIVE=OFF")
    cuda = _var("STAMP", tmp_path, "LLAMA_CMAKE_ARGS=-DGGML_CUDA=ON")
    assert cpu != cuda, "a CUDA install after a CPU one would rebuild nothing"
    assert _var("STAMP", tmp_path, "LLAMA_CMAKE_ARGS=-DGGML_CUDA=ON") == cuda      # stable


@needs_make
def test_same_flags_do_nothing_other_flags_rebuild(tmp_path):
    """A stamp for the flags in use, newer than its prerequisites: `make -n install` has
    nothing to do, twice; other flags run the recipe, which first removes every stamp."""
    stamp = Path(_var("STAMP", tmp_path, "LLAMA_CMAKE_ARGS=-DA=1"))
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.touch()
    future = time.time() + 3600        # newer than pyproject.toml, even if someone edits it now
    os.utime(stamp, (future, future))
    for _ in range(2):
        assert "pip install" not in _make("-n", "install", "LLAMA_CMAKE_ARGS=-DA=1", venv=tmp_path)
    rebuild = _make("-n", "install", "LLAMA_CMAKE_ARGS=-DB=1", venv=tmp_path)
    assert "build_llamacpp.py" in rebuild
    # switching back to -DA=1 later must rebuild too: the recipe drops every old stamp
    assert re.search(rf"rm -f .*{re.escape(str(tmp_path))}/\.installed-\*", rebuild), rebuild


@needs_make
def test_the_last_installs_flags_are_kept_until_given_again(tmp_path):
    """`make install LLAMA_CMAKE_ARGS=-DGGML_CUDA=ON`, then a plain `make test`, must not
    rebuild for the default flags; `LLAMA_CMAKE_ARGS=` (given, empty) still means empty."""
    default = _var("LLAMA_CMAKE_ARGS", tmp_path)
    (tmp_path / ".llama-cmake-args").write_text("-DGGML_CUDA=ON\n")
    assert _var("LLAMA_CMAKE_ARGS", tmp_path) == "-DGGML_CUDA=ON"
    assert _var("STAMP", tmp_path) == _var("STAMP", tmp_path, "LLAMA_CMAKE_ARGS=-DGGML_CUDA=ON")
    assert _var("LLAMA_CMAKE_ARGS", tmp_path, "LLAMA_CMAKE_ARGS=") == ""
    assert "-DGGML_CUDA=ON" not in default


@needs_make
def test_torch_is_pinned_on_every_branch(tmp_path):
    """torchao and bitsandbytes are pinned, so the torch beside them must be too: on a
    CUDA box (nvidia-smi found) as on a CPU one."""
    lines = _make("-n", "-B", "install", venv=tmp_path).splitlines()
    recipe = "\n".join(ln for ln in lines if not ln.lstrip().startswith("#"))   # make's comments
    version = _var("TORCH_VERSION", tmp_path)
    installs = [seg for seg in re.split(r";|\|\||\bthen\b|\belse\b|\n", recipe)
                if "pip install" in seg and re.search(r"\btorch\b(?![-_a-z])", seg)]
    assert len(installs) >= 2, recipe               # both branches are there to check
    for seg in installs:
        assert f"torch=={version}" in seg, seg


# -- the build script's configure decision -----------------------------------------------------

def test_configure_is_judged_by_the_generators_file_not_the_cache(tmp_path):
    bl = _build_script()
    assert not bl.configured(tmp_path, ninja=True)
    (tmp_path / "CMakeCache.txt").write_text("GGML_CUDA:BOOL=ON\n")    # what a failed configure leaves
    assert not bl.configured(tmp_path, ninja=True)
    (tmp_path / "build.ninja").write_text("")
    assert bl.configured(tmp_path, ninja=True) and not bl.configured(tmp_path, ninja=False)
    (tmp_path / "Makefile").write_text("")
    assert bl.configured(tmp_path, ninja=False)


def test_a_failed_configure_is_retried_from_a_clean_cache(tmp_path, monkeypatch):
    """A STAND-IN cmake (a script that records its calls and writes build.ninja): after a
    configure that left only CMakeCache.txt, the next run configures again, without it."""
    bl = _build_script()
    monkeypatch.setenv("INFERCOURSE_CACHE", str(tmp_path / "cache"))
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "cmake"
    fake.write_text(f"#!{sys.executable}\nimport sys, pathlib\n"
                    "b = pathlib.Path(sys.argv[sys.argv.index('-B') + 1])\n"
                    f"open({str(calls)!r}, 'a').write(str((b / 'CMakeCache.txt').exists()) + '\\n')\n"
                    "(b / 'CMakeCache.txt').write_text(''); (b / 'build.ninja').write_text('')\n")
    fake.chmod(0o755)
    monkeypatch.setattr(bl, "tool", lambda name: str(fake) if name == "cmake" else str(tmp_path / name))
    tree = tmp_path / "llama_cpp_python-0.0.0"
    with open(tmp_path / "log", "w") as log:
        first = bl.configure(tree, ["-DGGML_CUDA=ON"], log)
        (first / "build.ninja").unlink()                       # as if that configure had failed
        assert bl.configure(tree, ["-DGGML_CUDA=ON"], log) == first
        bl.configure(tree, ["-DGGML_CUDA=ON"], log)            # configured now: not run again
    assert calls.read_text().split() == ["False", "False"]    # the stale cache was gone both times


def test_a_python_without_tar_filters_is_refused_by_name(monkeypatch):
    """`extractall(filter=)` came in 3.10.12, 3.11.4 and 3.12: older ones get a sentence, not
    a TypeError, and requires-python says the floor."""
    bl = _build_script()
    bl.check_python()                                   # this interpreter has them
    monkeypatch.delattr(tarfile, "data_filter")
    with pytest.raises(SystemExit, match=r"3\.10\.12.*3\.11\.4"):
        bl.check_python()
    from packaging.specifiers import SpecifierSet
    spec = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    assert "3.10.11" not in spec and "3.10.12" in spec and "3.12.0" in spec


# -- what each machine gets ---------------------------------------------------------------------

MACHINES = {   # PEP 508 marker variables of each machine the README's table names
    "intel-mac": {"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "x86_64"},
    "apple-silicon": {"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64"},
    "linux-x86_64": {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"},
}


def _mlx_reqs(machine: str) -> set[str]:
    from packaging.requirements import Requirement
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    reqs = [Requirement(r) for r in extras["mlx"]]
    return {r.name for r in reqs if r.marker is None or r.marker.evaluate(MACHINES[machine])}


def test_mlx_is_not_asked_for_where_it_has_no_wheels():
    assert _mlx_reqs("intel-mac") == set()        # MLX has no Intel Mac wheels: .[all] would fail
    assert _mlx_reqs("apple-silicon") == {"mlx", "mlx-lm"}
    assert _mlx_reqs("linux-x86_64") == {"mlx", "mlx-lm"}


@needs_make
def test_the_readmes_rows_say_what_the_makefile_builds(tmp_path):
    rows = [r for r in (ROOT / "README.md").read_text().splitlines() if r.startswith("|")]
    for uname, row_word in [("Darwin-x86_64", "Intel Mac"), ("Linux-x86_64", "Linux")]:
        args = _var("LLAMA_CMAKE_ARGS", tmp_path, f"UNAME={uname}")
        row = next((r for r in rows if row_word in r.split("|")[1]), None)
        assert row, f"no README row for {row_word}"
        assert ("AVX2" in row) == ("-DGGML_AVX2=ON" in args), (row, args)
    intel = next(r for r in rows if "Intel Mac" in r.split("|")[1])
    assert "MLX" in intel                       # and says it gets no MLX


# -- secrets --------------------------------------------------------------------------------------

def _vllm(tmp_path, **kw):
    from infercourse.servers import VLLMServer
    (tmp_path / "config.json").write_text("{}")
    return VLLMServer(tmp_path, python=sys.executable, **kw)


def test_vllms_key_is_in_its_environment_not_its_argv(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    srv = _vllm(tmp_path, api_key="sk-room-" + os.urandom(4).hex())
    assert not any(srv.api_key in a for a in srv.argv())          # `ps` shows argv to every user
    assert srv.child_env()["VLLM_API_KEY"] == srv.api_key            # vLLM reads --api-key from it
    assert srv.api_key not in repr(srv.describe())


def test_a_key_in_the_shell_never_reaches_a_server_started_without_one(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-the-shell")
    monkeypatch.setenv("LLAMA_API_KEY", "from-the-shell")
    assert "VLLM_API_KEY" not in _vllm(tmp_path).child_env()
    assert _vllm(tmp_path, api_key="given").child_env()["VLLM_API_KEY"] == "given"
    from infercourse.servers.process import Server

    class LlamaLike(Server):          # a stand-in with llama-server's key variable; never started
        name, api_key_flag, api_key_env = "llama-like", "--api-key", "LLAMA_API_KEY"

    assert "LLAMA_API_KEY" not in LlamaLike().child_env()
    assert LlamaLike().child_env()["PATH"] == os.environ["PATH"]   # the rest is inherited


@pytest.mark.slow
def test_llama_server_answers_despite_a_llama_api_key_in_the_shell(monkeypatch):
    """The real llama-server reads LLAMA_API_KEY: left in the shell it made /health pass and
    every request fail with 401."""
    from infercourse.core.errors import BackendMissingError
    from infercourse.servers import LlamaServer
    monkeypatch.setenv("LLAMA_API_KEY", "from-the-shell")
    try:
        srv = LlamaServer(n_parallel=1, ctx_size=512, threads=1)
    except BackendMissingError as e:
        pytest.skip(f"llama-server not installed: {e}")
    with srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
