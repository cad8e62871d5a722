"""The one llama.cpp build: the binding and llama-server share one set of libraries."""
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import build_llamacpp  # noqa: E402


def test_pinned_version_is_pyprojects():
    v = build_llamacpp.pinned_version()
    assert f'"llama-cpp-python=={v}"' in (ROOT / "pyproject.toml").read_text()


@pytest.mark.parametrize("line, want", [
    ("[12/212] Building C object ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o", "ggml"),
    ("[80/212] Building CXX object src/CMakeFiles/llama.dir/models/qwen3.cpp.o", "libllama"),
    ("[150/212] Building CXX object tools/server/CMakeFiles/server-context.dir/server-context.cpp.o",
     "llama-server"),
    ("[140/212] Building CXX object tools/mtmd/CMakeFiles/mtmd.dir/clip.cpp.o", "mtmd"),
])
def test_progress_names_the_component(line, want):
    assert build_llamacpp.component(line).startswith(want)


def test_only_the_course_targets_are_built():
    # no tests, examples, unified app or tools other than the server
    args = " ".join(build_llamacpp.BASE_ARGS)
    for off in ("LLAMA_BUILD_TESTS=OFF", "LLAMA_BUILD_EXAMPLES=OFF", "LLAMA_BUILD_APP=OFF"):
        assert off in args
    assert build_llamacpp.TARGETS == ["llama", "mtmd", "llama-server"]


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
