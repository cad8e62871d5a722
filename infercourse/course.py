"""Run the course headless: every notebook in order, executed copies + HTML + results.

`make course` and the notebook tests both call `run_notebook`, so CI executes exactly
what a learner executes. Notebooks are committed without outputs; the executed copies
land in `build/notebooks/`, HTML renderings in `build/html/`, and whatever the notebooks
save through `infercourse.measure.results` in `build/results/<notebook>/<time>/`, a new
folder each time a notebook runs (the kernel gets `INFERCOURSE_RESULTS` in its environment).

Sizes. Every notebook keeps its sizes (requests, tokens, trials) in its parameters cell, and
its defaults are the course's full size. `make test` runs each notebook at a small, stated
size instead: the values in `notebooks/ci_params.json` are injected into the parameters
cell, and the executed copy records them (cell tag `injected-parameters`, notebook metadata
`infercourse.parameters`). The same mechanism serves a workshop:
`infercourse course --param PROFILE=gpu --param URL=...` sets a parameter in every notebook
that has it. Written here rather than with papermill, which injects a new cell *after* the
parameters cell: values a parameters cell derives from a profile (`P = profile(PROFILE)`,
`LEVELS = P.concurrencies`) would then keep the old profile's. Replacing the assignment in
place keeps everything the cell derives consistent.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import sys
import time
from pathlib import Path

from infercourse.ops import ci_size

__all__ = ["NOTEBOOK_DIR", "notebooks", "notebook_parameters", "ci_params", "parse_params",
           "inject", "results_dir", "run_notebook", "course_main"]

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"


def notebooks(folder: str | Path = NOTEBOOK_DIR) -> list[Path]:
    """The course's notebooks in map order (NN_name.ipynb: the numbers follow the map)."""
    return sorted(p for p in Path(folder).glob("[0-9][0-9]*_*.ipynb"))


def notebook_parameters(path: str | Path) -> dict[str, str]:
    """The names assigned in a notebook's parameters cell, with their source text."""
    nb = json.loads(Path(path).read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code" and "parameters" in cell["metadata"].get("tags", []):
            tree = ast.parse("".join(cell["source"]))
            return {t.id: ast.get_source_segment("".join(cell["source"]), node.value)
                    for node in tree.body if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Name)}
    return {}


def inject(nb, params: dict) -> None:
    """Set `params` in the parameters cell of `nb` (an nbformat notebook), in place: each
    top-level `NAME = ...` statement of the cell becomes `NAME = <value>`, the rest of the
    cell (what it derives from them) stays."""
    cell = next(c for c in nb.cells if c.cell_type == "code" and "parameters" in c.metadata.get("tags", []))
    lines = cell.source.splitlines()
    for node in sorted(ast.parse(cell.source).body, key=lambda n: -n.lineno):
        names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        if isinstance(node, ast.Assign) and len(names) == 1 and names[0] in params:
            lines[node.lineno - 1:node.end_lineno] = [
                f"{names[0]} = {params[names[0]]!r}  # injected by infercourse course"]
    cell.source = "\n".join(lines)
    cell.metadata.setdefault("tags", []).append("injected-parameters")
    nb.metadata["infercourse"] = {"parameters": dict(params)}


def ci_params(path: str | Path) -> dict:
    """The small size `make test` runs a notebook at (notebooks/ci_params.json)."""
    return ci_size.ci_params(Path(path).stem)


def parse_params(items: list[str] | None) -> dict:
    """`NAME=VALUE` strings to a dict; VALUE is a Python literal, else a plain string."""
    out = {}
    for item in items or []:
        name, sep, text = item.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"--param {item!r}: expected NAME=VALUE")
        try:
            out[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[name] = text
    return out


def results_dir(name: str) -> Path:
    """A new folder for this run of a notebook's results:
    `$INFERCOURSE_RESULTS/<name>/<YYYYmmdd-HHMMSS>` (else under build/results), with a
    suffix when that second is taken. New on every call, so running a notebook again (or a
    second `make course`) never meets the runs of the last time: a run folder is
    append-only and refuses to be written twice (11 failed so on the second `make course`).
    """
    root = Path(os.environ.get("INFERCOURSE_RESULTS", Path.cwd() / "build" / "results")) / name
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1, 1000):
        path = root / (stamp if i == 1 else f"{stamp}-{i}")
        try:
            path.mkdir(parents=True, exist_ok=False)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{root}: no free results folder for {stamp}")


def run_notebook(path: str | Path, out: str | Path = "build", *, timeout_s: int = 900,
                 html: bool = True, params: dict | None = None) -> dict:
    """Execute one notebook top to bottom in a fresh kernel; write the executed copy (and
    HTML). Raises nbclient's CellExecutionError, naming the failing cell, on any error.

    Args:
        path: the .ipynb to run.
        out: build folder for executed notebooks, HTML and results.
        timeout_s: per-cell limit.
        html: also render HTML.
        params: values injected after the parameters cell (only names the cell defines).
    """
    import nbformat
    from nbclient import NotebookClient

    path, out = Path(path), Path(out).resolve()
    nb = nbformat.read(path, as_version=4)
    known = notebook_parameters(path)
    params = {k: v for k, v in (params or {}).items() if k in known}
    if params:
        inject(nb, params)
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
    return {"notebook": path.name, "seconds": round(seconds, 1), "cells": len(nb.cells),
            "params": params}


def run_claims(nb) -> list[str]:
    """The sentences an executed notebook computed from its run: every markdown output of a
    code cell (`Markdown(...)` fed by the library), in cell order. Fixed markdown cells are
    not outputs, so they are never listed here."""
    out = []
    for i, cell in enumerate(nb.cells):
        for o in cell.get("outputs", []) if cell.cell_type == "code" else []:
            text = (o.get("data") or {}).get("text/markdown") if o.get("output_type") in (
                "display_data", "execute_result") else None
            if text:
                out.append(f"cell {i}: " + ("".join(text) if isinstance(text, list) else text).strip())
    return out


def write_claims(out: str | Path) -> Path:
    """`<out>/claims.md`: per executed notebook in `<out>/notebooks`, what `run_claims` finds,
    so a run's generated sentences can be read (and compared with another run's) in one file."""
    import nbformat
    out = Path(out)
    lines = ["# What this run showed, notebook by notebook (sentences computed from its numbers)", ""]
    for path in sorted((out / "notebooks").glob("*.ipynb")):
        lines += [f"## {path.stem}", ""]
        claims = run_claims(nbformat.read(path, as_version=4))
        lines += [f"- {c}" for c in claims] if claims else ["(no computed sentences)"]
        lines.append("")
    dest = out / "claims.md"
    dest.write_text("\n".join(lines), encoding="utf-8")
    return dest


def _read_pace(stem: str, readings: dict) -> float:
    """Read the pace before notebook `stem` into `readings`; the seconds the reading took."""
    from infercourse.ops import pace
    t0 = time.perf_counter()
    try:
        readings[stem] = r = pace.reading(prefill=stem in pace.PREFILL_BOUND)
        print("   pace now: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
    except Exception as e:  # a reading is context for the times, never a reason to stop the course
        print(f"   pace not read: {e}", flush=True)
    return time.perf_counter() - t0


def _print_pace(size: str, times: dict, readings: dict, spent: float) -> None:
    from infercourse.ops import pace
    if not pace.REFERENCE.is_file():
        return
    t = pace.run_pace_table({"size": size, "seconds": times, "pace": readings}, json.loads(pace.REFERENCE.read_text()))
    if not t.empty:
        print(f"at the reference machine's pace (this run's median pace reading ÷ the reference run's): "
              f"{t['at_reference_s'].sum() / 60:.1f} min for the {len(t)} notebooks measured "
              f"{t['measured_s'].sum() / 60:.1f} min here; the readings took {spent:.0f} s")


def course_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="infercourse course",
                                 description="Execute every notebook in order, headless.")
    ap.add_argument("--out", default="build", help="build folder (default: build)")
    ap.add_argument("--only", nargs="*", help="run only notebooks whose name contains one of these")
    # an hour a cell: at full size notebook 20's cells run a real agent for tens of minutes on a
    # 2-core CPU (a told session that compacts: ~20 min); the limit only stops a hung cell
    ap.add_argument("--timeout", type=int, default=3600, help="per-cell timeout in seconds (default: 3600)")
    ap.add_argument("--size", choices=["full", "ci"], default="full",
                    help="full: the notebooks' defaults (default); ci: the small sizes of "
                         "notebooks/ci_params.json that `make test` runs")
    ap.add_argument("--param", action="append", metavar="NAME=VALUE",
                    help="set a parameter in every notebook whose parameters cell has it "
                         "(repeatable; VALUE is a Python literal or a string), e.g. "
                         "--param PROFILE=gpu --param URL=http://127.0.0.1:8000")
    ap.add_argument("--pace", action=argparse.BooleanOptionalAction, default=None,
                    help="read the machine's pace (a ~2 s probe) before each notebook, for `doctor course "
                         "--check` (default: on at full size)")
    args = ap.parse_args(argv)
    try:
        given = parse_params(args.param)
    except ValueError as e:
        ap.error(str(e))
    todo = [p for p in notebooks() if not args.only or any(k in p.name for k in args.only)]
    if not todo:
        print(f"no notebooks found in {NOTEBOOK_DIR}", file=sys.stderr)
        return 2
    failed, times, readings, spent = [], {}, {}, 0.0
    read_pace = args.size == "full" if args.pace is None else args.pace
    t0 = time.perf_counter()
    for p in todo:
        params = (ci_params(p) if args.size == "ci" else {}) | given
        used = {k: v for k, v in params.items() if k in notebook_parameters(p)}
        print(f"== {p.name}" + (f"  ({', '.join(f'{k}={v!r}' for k, v in used.items())})"
                                 if used else ""), flush=True)
        if read_pace:
            spent += _read_pace(p.stem, readings)
        try:
            info = run_notebook(p, args.out, timeout_s=args.timeout, params=params)
            times[p.stem] = info["seconds"]
            print(f"   ok in {info['seconds']} s", flush=True)
        except Exception as e:  # keep going: one broken lesson must not hide the others
            failed.append(p.name)
            print(f"   FAILED: {str(e)[-2000:]}", flush=True)
    total = time.perf_counter() - t0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    # the course's own run times on this machine, for the course map and `doctor` to compare
    (Path(args.out) / "course_times.json").write_text(json.dumps(
        {"size": args.size, "params": given, "seconds": times, "total_s": round(total, 1),
         "load_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
         **({"pace": readings, "pace_reading_s": round(spent, 1)} if readings else {})}, indent=1))
    claims = write_claims(args.out)
    print(f"{len(todo) - len(failed)} notebook(s) in {int(total // 60)} min {int(total % 60)} s; "
          f"executed notebooks and HTML are in {Path(args.out).resolve()}; the sentences each computed "
          f"from its run are in {claims.name}")
    if readings:
        _print_pace(args.size, times, readings, spent)
    if failed:
        print(f"{len(failed)} notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
