"""Every notebook of the course executes top to bottom on the embedded model, and is
committed clean (no outputs, no execution counts), with the house arc."""
import json

import pytest

from infercourse.course import notebooks, run_notebook

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
    info = run_notebook(path, tmp_path, html=False)
    executed = json.loads((tmp_path / "notebooks" / path.name).read_text())
    errors = [o for c in executed["cells"] if c["cell_type"] == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    print(f"{path.name}: {info['seconds']} s")
