"""Every notebook of the course executes top to bottom on the embedded model, and is
committed clean (no outputs, no execution counts), with the house arc.

The execution test runs each notebook at its CI size (notebooks/ci_params.json, injected
into the parameters cell); INFERCOURSE_NOTEBOOK_SIZE=full runs the defaults instead."""
import ast
import json
import os
import re

import nbformat
import pytest

from infercourse.course import ci_params, inject, notebook_parameters, notebooks, run_notebook

NOTEBOOKS = notebooks()


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_clean_with_the_house_arc(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert not any(c.get("outputs") or c.get("execution_count") for c in code), "outputs committed"
    assert "parameters" in code[0]["metadata"].get("tags", []), "first code cell must be the parameters cell"
    md_cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
    title = md_cells[0].splitlines()[0]
    assert title.startswith("# ") and "?" in title, "the title cell states the question"
    md = "\n".join(md_cells)
    for heading in ("## Predict", "## Measure", "## Summary", "## Exercises"):
        assert heading in md, f"missing {heading}"
    assert any("check(" in "".join(c["source"]) for c in code), "exercises need self-check cells"
    assert (path.parent / "solutions" / f"{path.stem}.md").is_file(), "instructor solutions missing"


def undisplayed_markdown(source: str) -> list[str]:
    """`Markdown(...)` calls in a cell that nothing displays: neither the cell's last
    expression nor inside `display(...)`. Such a sentence is computed and never seen."""
    tree = ast.parse(source)
    shown: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "display":
            shown |= {id(m) for a in n.args for m in ast.walk(a)}
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        shown |= {id(m) for m in ast.walk(tree.body[-1].value)}
    return [ast.unparse(n)[:80] for n in ast.walk(tree)
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Markdown" and id(n) not in shown]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_computed_sentence_is_displayed(path):
    """Issue 31 §3: 02's main result was a `Markdown(...)` that was not its cell's last
    expression, so nothing rendered."""
    nb = json.loads(path.read_text())
    bad = {i: b for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
           and (b := undisplayed_markdown("".join(c["source"])))}
    assert not bad, f"cells whose Markdown is never shown: {bad}"


def test_the_display_check_can_fail():
    assert undisplayed_markdown('Markdown("a")\nx = 1') == ["Markdown('a')"]
    assert undisplayed_markdown('display(Markdown("a"))\nx = 1') == []
    assert undisplayed_markdown('y = 2\nMarkdown(f"{y}")') == []


TOO_FEW_SAID = re.compile(r"too few|cannot pass|can never pass|not judged")


def bare_within_noise(outputs_text: str) -> list[str]:
    """Lines that call a result "within noise" beside a pair count no test can judge (1 or 2
    pairs, or blocks: every test here needs 3 at least) without saying so."""
    return [ln.strip()[:160] for ln in outputs_text.splitlines() if "within noise" in ln
            and re.search(r"\b[12] (pairs?|blocks?)\b", ln) and not TOO_FEW_SAID.search(ln)]


def test_the_too_few_check_can_fail():
    assert bare_within_noise("x: within noise (2 pairs, range [0.9, 1.1])")
    assert not bare_within_noise("x: too few pairs: 2 pairs cannot pass a test that needs 3")
    assert not bare_within_noise("x: within noise (6 pairs)")


def _output_text(executed: dict) -> str:
    out = []
    for c in executed["cells"]:
        for o in c.get("outputs", []) if c["cell_type"] == "code" else []:
            data = o.get("data", {})
            for key in ("text/markdown", "text/plain"):
                if key in data:
                    out.append("".join(data[key]))
            if o.get("output_type") == "stream":
                out.append("".join(o.get("text", "")))
    return "\n".join(out)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path):
    params = ci_params(path) if os.environ.get("INFERCOURSE_NOTEBOOK_SIZE", "ci") == "ci" else {}
    info = run_notebook(path, tmp_path, html=False, params=params)
    executed = json.loads((tmp_path / "notebooks" / path.name).read_text())
    errors = [o for c in executed["cells"] if c["cell_type"] == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    # issue 31 §2: the CI size runs few repeats; nothing it prints may call too few pairs "within noise"
    assert not bare_within_noise(_output_text(executed))
    print(f"{path.name}: {info['seconds']} s")


def test_ci_sizes_name_real_parameters():
    """Every CI size sets only names the notebook's parameters cell defines (a renamed
    parameter would otherwise silently run the full size in CI)."""
    table = json.loads((NOTEBOOKS[0].parent / "ci_params.json").read_text())
    stems = {p.stem for p in NOTEBOOKS}
    for stem, params in table.items():
        if stem.startswith("_"):
            continue
        assert stem in stems, f"ci_params.json names no notebook {stem}"
        names = notebook_parameters(NOTEBOOKS[0].parent / f"{stem}.ipynb")
        assert set(params) <= set(names), f"{stem}: {set(params) - set(names)} not in its parameters cell"


def test_inject_replaces_in_place_and_keeps_derived_values():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell('PROFILE = "cpu"  # the profile\nP = {"cpu": 1, "gpu": 8}[PROFILE]\n'
                                     'LEVELS = (\n  1,\n  2)\nN = P * 2')
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell]
    inject(nb, {"PROFILE": "gpu", "LEVELS": [1, 4]})
    ns: dict = {}
    exec(nb.cells[0].source, ns)
    assert (ns["PROFILE"], ns["P"], ns["LEVELS"], ns["N"]) == ("gpu", 8, [1, 4], 16)
    assert "injected-parameters" in nb.cells[0].metadata["tags"]
    assert nb.metadata["infercourse"]["parameters"] == {"PROFILE": "gpu", "LEVELS": [1, 4]}


def test_results_dir_is_new_on_every_run(tmp_path, monkeypatch):
    """A second `make course` (or a learner running a notebook again) must not meet the last
    run's folders: a run folder refuses a second write, and 11 failed on exactly that."""
    from infercourse.course import results_dir
    from infercourse.measure.results import RunWriter
    monkeypatch.setenv("INFERCOURSE_RESULTS", str(tmp_path))
    first, second = results_dir("11_concurrency_batching"), results_dir("11_concurrency_batching")
    assert first != second and first.parent == second.parent == tmp_path / "11_concurrency_batching"
    manifest = {"engine": {}, "model": "m", "sampling": {}, "load": {}, "workload": {}}
    for out in (first, second):
        with RunWriter(out / "np_sweep" / "np1-r0", manifest):
            pass
    with pytest.raises(FileExistsError, match="set-up"):
        RunWriter(first / "np_sweep" / "np1-r0", manifest)


def test_claims_file_lists_computed_sentences_only(tmp_path):
    """`make course` writes build/claims.md: each notebook's markdown *outputs* (sentences the
    library computed from the run), never its fixed markdown cells or plain prints."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

    from infercourse.course import run_claims, write_claims
    nb = new_notebook(cells=[
        new_markdown_cell("Fixed text: the mechanism."),
        new_code_cell("x", outputs=[new_output("stream", name="stdout", text="a print\n")]),
        new_code_cell("Markdown(s)", outputs=[new_output("execute_result", data={"text/markdown": "Decode ran **2.0×** prefill."},
                                                         execution_count=1)]),
        new_code_cell("display(Markdown(t))", outputs=[new_output("display_data", data={"text/markdown": "Within noise."})]),
    ])
    assert run_claims(nb) == ["cell 2: Decode ran **2.0×** prefill.", "cell 3: Within noise."]
    (tmp_path / "notebooks").mkdir()
    nbformat.write(nb, tmp_path / "notebooks" / "03_x.ipynb")
    nbformat.write(new_notebook(cells=[new_markdown_cell("only fixed")]), tmp_path / "notebooks" / "04_y.ipynb")
    text = write_claims(tmp_path).read_text(encoding="utf-8")
    assert "## 03_x" in text and "- cell 3: Within noise." in text and "a print" not in text
    assert "## 04_y\n\n(no computed sentences)" in text and "Fixed text" not in text
