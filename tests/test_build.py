"""The one llama.cpp build: the binding and llama-server share one set of libraries."""
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import build_llamacpp  # noqa: E402


def _built_here():
    from infercourse.servers import llama_build_info
    info = llama_build_info()
    if info is None:
        pytest.skip("llama.cpp was not built by tools/build_llamacpp.py here (LLAMA_SERVER_BIN / conda route)")
    return info


def test_the_installed_binding_and_build_are_the_pinned_version():
    """What is installed matches the pin: a pin bumped in pyproject.toml without a rebuild
    (or a binding pip upgraded behind the build's back) fails here."""
    import importlib.metadata
    info = _built_here()
    pin = build_llamacpp.pinned_version()
    assert importlib.metadata.version("llama-cpp-python") == pin
    assert info["llama_cpp_python"] == pin, info


def test_a_missing_pin_stops_the_build_with_a_message(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text('dependencies = ["llama-cpp-python>=0.3"]\n')
    monkeypatch.setattr(build_llamacpp, "ROOT", tmp_path)
    with pytest.raises(SystemExit, match="pins no llama-cpp-python"):
        build_llamacpp.pinned_version()


@pytest.mark.parametrize("line, want", [
    ("[12/212] Building C object ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o", "ggml"),
    ("[80/212] Building CXX object src/CMakeFiles/llama.dir/models/qwen3.cpp.o", "libllama"),
    ("[150/212] Building CXX object tools/server/CMakeFiles/server-context.dir/server-context.cpp.o",
     "llama-server"),
    ("[140/212] Building CXX object tools/mtmd/CMakeFiles/mtmd.dir/clip.cpp.o", "mtmd"),
])
def test_progress_names_the_component(line, want):
    assert build_llamacpp.component(line).startswith(want)


def test_every_compile_line_of_the_real_build_names_its_component():
    """The progress line's component, read over the last real build's log: a compile step
    under a folder the table does not know (llama.cpp moved its sources) fails here."""
    _built_here()
    log = build_llamacpp.cache_dir() / "llama.cpp" / "build.log"
    lines = [ln for ln in log.read_text(errors="replace").splitlines()
             if re.match(r"\[\d+/\d+\] Building C", ln)] if log.is_file() else []
    if not lines:
        pytest.skip("the last install compiled nothing (its build folder was kept)")
    assert [ln for ln in lines if build_llamacpp.component(ln) is None] == []


def test_only_the_course_targets_were_built():
    """The kept build folder holds llama-server and shared libraries, and no other program:
    no tests, examples or other tools were configured or compiled."""
    info = _built_here()
    bins = Path(info["build_dir"]) / "bin"
    if not bins.is_dir():
        pytest.skip(f"the build folder {bins.parent} is gone (cache cleared)")
    programs = sorted(f.name for f in bins.iterdir()
                      if f.is_file() and os.access(f, os.X_OK) and ".so" not in f.name and f.suffix != ".dylib")
    assert programs == ["llama-server"], programs


def test_the_build_folder_is_keyed_by_flags_not_tool_paths(tmp_path, monkeypatch):
    """configure() runs cmake with the course's flags plus the user's; another flag gets
    another folder (no stale objects), another ccache/ninja path the same one (kept)."""
    monkeypatch.setenv("INFERCOURSE_CACHE", str(tmp_path / "cache"))
    runs = []

    def fake_run(cmd, **kw):
        runs.append(cmd)
        Path(cmd[cmd.index("-B") + 1], "CMakeCache.txt").write_text("")   # configured: the cache
        Path(cmd[cmd.index("-B") + 1], "build.ninja").write_text("")      # and the generator's file
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(build_llamacpp.subprocess, "run", fake_run)
    tree = tmp_path / "llama_cpp_python-9.9.9"

    def folder(user_args, where):
        monkeypatch.setattr(build_llamacpp, "tool", lambda name: f"/{where}/{name}")
        with open(tmp_path / "log", "w") as log:
            return build_llamacpp.configure(tree, user_args, log)
    cpu, again, cuda = folder([], "a"), folder([], "b"), folder(["-DGGML_CUDA=ON"], "a")
    assert cpu == again and cpu != cuda
    assert len(runs) == 2                                   # the kept folder was not configured twice
    assert "-DGGML_CUDA=ON" in runs[1] and "-DGGML_CUDA=ON" not in runs[0]
    for cmd in runs:
        assert cmd[cmd.index("-S") + 1] == str(tree / "vendor" / "llama.cpp")
        assert {"-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"} <= set(cmd)
        assert "-DCMAKE_CXX_COMPILER_LAUNCHER=/a/ccache" in cmd


def test_build_progress_and_failure(tmp_path, monkeypatch, capsys):
    """build() asks cmake for the course's targets, reports the component being compiled
    as the steps go, and stops with the log's name when the compiler fails."""
    out = ["[1/4] Building C object ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o\n",
           "[2/4] Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o\n",
           "[4/4] Linking CXX executable bin/llama-server\n"]

    class FakeBuild:
        def __init__(self, cmd, **kw):
            self.cmd, self.stdout, self.rc = cmd, iter(out), rc
            seen.append(cmd)

        def poll(self):
            return self.rc

        def wait(self):
            return self.rc
    seen = []
    monkeypatch.setattr(build_llamacpp.subprocess, "Popen", FakeBuild)
    monkeypatch.setattr(build_llamacpp, "tool", lambda name: f"/x/{name}")
    rc = 0
    with open(tmp_path / "build.log", "w") as log:
        build_llamacpp.build(tmp_path, 2, log)
    cmd = seen[0]
    assert cmd[cmd.index("--target") + 1:] == ["llama", "mtmd", "llama-server"]
    said = capsys.readouterr().out
    assert "25% (1/4 steps)" in said and "now: ggml" in said and "now: libllama" in said, said
    assert "".join(out) == (tmp_path / "build.log").read_text()    # the compiler's lines go to the log
    rc = 1
    with open(tmp_path / "build.log", "w") as log, pytest.raises(SystemExit, match="build.log"):
        build_llamacpp.build(tmp_path, 2, log)


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("ldd") is None,
                    reason="ldd is Linux's")
def test_server_and_binding_load_the_same_libllama():
    from infercourse.servers import llama_build_info, llama_server_binary
    if llama_build_info() is None:
        pytest.skip("llama.cpp was not built by tools/build_llamacpp.py here (LLAMA_SERVER_BIN / conda route)")
    lib = Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib"
    server = llama_server_binary()
    assert server.parent == lib
    out = subprocess.run(["ldd", str(server)], capture_output=True, text=True).stdout
    # ldd lists every library by its SONAME (libllama.so.0) with the file it resolved to
    resolved = {ln.split()[0].split(".so")[0]: ln.split("=>")[1].split()[0]
                for ln in out.splitlines() if "=>" in ln}
    for name in ("libllama", "libggml", "libggml-cpu"):
        assert Path(resolved[name]).resolve() == (lib / f"{name}.so").resolve(), out
