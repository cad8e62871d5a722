"""Every notebook of the course executes top to bottom on the embedded model, and is
committed clean (no outputs, no execution counts), with the house arc.

The execution test runs each notebook at its CI size (notebooks/ci_params.json, injected
into the parameters cell); INFERCOURSE_NOTEBOOK_SIZE=full runs the defaults instead."""
import json
import os

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


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path):
    params = ci_params(path) if os.environ.get("INFERCOURSE_NOTEBOOK_SIZE", "ci") == "ci" else {}
    info = run_notebook(path, tmp_path, html=False, params=params)
    executed = json.loads((tmp_path / "notebooks" / path.name).read_text())
    errors = [o for c in executed["cells"] if c["cell_type"] == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
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
