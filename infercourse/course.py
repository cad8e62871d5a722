"""Run the course headless: every notebook in order, executed copies + HTML + results.

`make course` and the notebook tests both call `run_notebook`, so CI executes exactly
what a learner executes. Notebooks are committed without outputs; the executed copies
land in `build/notebooks/`, HTML renderings in `build/html/`, and whatever the notebooks
save through `infercourse.measure.results` in `build/results/<notebook>/` (the kernel gets
`INFERCOURSE_RESULTS` in its environment).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

__all__ = ["NOTEBOOK_DIR", "notebooks", "results_dir", "run_notebook", "course_main"]

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"


def notebooks(folder: str | Path = NOTEBOOK_DIR) -> list[Path]:
    """The course's notebooks in order (NN_name.ipynb)."""
    return sorted(p for p in Path(folder).glob("[0-9][0-9]_*.ipynb"))


def results_dir(name: str) -> Path:
    """Where a notebook saves its runs: $INFERCOURSE_RESULTS/<name>, else build/results/<name>."""
    root = Path(os.environ.get("INFERCOURSE_RESULTS", Path.cwd() / "build" / "results"))
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_notebook(path: str | Path, out: str | Path = "build", *, timeout_s: int = 900,
                 html: bool = True) -> dict:
    """Execute one notebook top to bottom in a fresh kernel; write the executed copy (and
    HTML). Raises nbclient's CellExecutionError, naming the failing cell, on any error.

    Args:
        path: the .ipynb to run.
        out: build folder for executed notebooks, HTML and results.
        timeout_s: per-cell limit.
        html: also render HTML.
    """
    import nbformat
    from nbclient import NotebookClient

    path, out = Path(path), Path(out).resolve()
    nb = nbformat.read(path, as_version=4)
    env_results = out / "results"
    old = os.environ.get("INFERCOURSE_RESULTS")
    os.environ["INFERCOURSE_RESULTS"] = str(env_results)  # inherited by the kernel
    t0 = time.perf_counter()
    try:
        # the kernel's own start-up warnings (e.g. "running over TCP without encryption" on
        # loopback) are about the harness, not the lesson: errors still show
        client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}},
                                extra_arguments=["--IPKernelApp.log_level=ERROR"])
        try:
            client.execute()
        finally:
            (out / "notebooks").mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, out / "notebooks" / path.name)
    finally:
        if old is None:
            os.environ.pop("INFERCOURSE_RESULTS", None)
        else:
            os.environ["INFERCOURSE_RESULTS"] = old
    seconds = time.perf_counter() - t0
    if html:
        from nbconvert import HTMLExporter
        body, _ = HTMLExporter().from_notebook_node(nb)
        (out / "html").mkdir(parents=True, exist_ok=True)
        (out / "html" / path.with_suffix(".html").name).write_text(body, encoding="utf-8")
    # figures the notebooks link to (e.g. img/stack.png) travel with both copies
    if (path.parent / "img").is_dir():
        for sub in ("notebooks", "html"):
            if (out / sub).is_dir():
                shutil.copytree(path.parent / "img", out / sub / "img", dirs_exist_ok=True)
    return {"notebook": path.name, "seconds": round(seconds, 1), "cells": len(nb.cells)}


def course_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="infercourse course",
                                 description="Execute every notebook in order, headless.")
    ap.add_argument("--out", default="build", help="build folder (default: build)")
    ap.add_argument("--only", nargs="*", help="run only notebooks whose name contains one of these")
    ap.add_argument("--timeout", type=int, default=900, help="per-cell timeout in seconds")
    args = ap.parse_args(argv)
    todo = [p for p in notebooks() if not args.only or any(k in p.name for k in args.only)]
    if not todo:
        print(f"no notebooks found in {NOTEBOOK_DIR}", file=sys.stderr)
        return 2
    failed = []
    for p in todo:
        print(f"== {p.name}", flush=True)
        try:
            info = run_notebook(p, args.out, timeout_s=args.timeout)
            print(f"   ok in {info['seconds']} s", flush=True)
        except Exception as e:  # keep going: one broken lesson must not hide the others
            failed.append(p.name)
            print(f"   FAILED: {str(e)[-2000:]}", flush=True)
    print(f"executed notebooks and HTML are in {Path(args.out).resolve()}")
    if failed:
        print(f"{len(failed)} notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
