"""The course's claims about itself, held against the code and the notebooks (issue 25 §7).

Each test reads a committed file (README, GLOSSARY, cheat sheet, the notebooks' JSON) and
the library table it must agree with, so that a claim cannot go stale silently.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / "notebooks"


def _notebooks() -> dict[str, Path]:
    """{"07": path, ...}: every numbered notebook by its number."""
    return {p.name.split("_")[0]: p for p in sorted(NB.glob("[0-9][0-9]*_*.ipynb"))}


def _cells(path: Path, kind: str | None = None) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text(encoding="utf-8"))["cells"]
            if kind is None or c["cell_type"] == kind]


def _text(path: Path) -> str:
    return "\n".join(_cells(path)) if path.suffix == ".ipynb" else path.read_text(encoding="utf-8")


def _mentions(text: str, name: str) -> bool:
    """`name` as a word (its start on a word boundary; inflections allowed: "dequantize" in "dequantized")."""
    return re.search(r"(?<![\w-])" + re.escape(name), text, re.IGNORECASE) is not None


# ---- GLOSSARY: each term is used where the "measured in" column says ----------------------------

def _glossary_rows() -> list[tuple[str, list[str], str]]:
    """(term, the names it goes by, "measured in" column) per row of GLOSSARY.md."""
    rows = []
    for line in (NB / "GLOSSARY.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| \*\*(.+?)\*\*(?: \(also: (.+?)\))? \| .* \| (.+?) \|$", line)
        if not m:
            continue
        term, also, where = m.groups()
        head = re.sub(r"\s*\(.*?\)", "", term).strip()
        names = [h.strip() for h in head.split(" / ")]
        for inner in re.findall(r"\((.*?)\)", term):
            names.append(f"{head} {inner}")
            # an acronym's expansion, or a flag in backticks, is a name of its own
            if head.isupper() or "`" in inner:
                names += [x.strip("` ") for x in inner.split(",")]
        names += [a.strip() for a in (also or "").split(",") if a.strip()]
        rows.append((term, names, where))
    return rows


def _cited(where: str) -> list[tuple[str, bool]]:
    """[(notebook number, in its solution?)] from a "measured in" cell: "03, 05", "07–11",
    "explained in 07 (profile `gpu`)", "02 (solution)"; "Phase 3" names no notebook."""
    order, out = list(_notebooks()), []
    for m in re.finditer(r"\b(\d\d[a-z]?)\b(?:\s*[–-]\s*(\d\d[a-z]?)\b)?( \(solution\))?", where):
        a, b, sol = m.groups()
        out += [(k, bool(sol)) for k in (order[order.index(a):order.index(b) + 1] if b else [a])]
    return out


def test_glossary_parses_every_row():
    rows = _glossary_rows()
    table = [ln for ln in (NB / "GLOSSARY.md").read_text(encoding="utf-8").splitlines() if ln.startswith("| **")]
    assert len(rows) == len(table) > 50
    assert all(_cited(where) for _, _, where in rows), [t for t, _, w in rows if not _cited(w)]


@pytest.mark.parametrize("term,names,where", _glossary_rows(), ids=lambda v: v if isinstance(v, str) else None)
def test_glossary_term_is_used_where_it_says(term, names, where):
    nbs = _notebooks()
    for key, solution in _cited(where):
        assert key in nbs, f"{term}: no notebook {key}"
        path = (NB / "solutions" / f"{nbs[key].stem}.md") if solution else nbs[key]
        assert any(_mentions(_text(path), n) for n in names), f"{term}: {path.name} never says {names}"


def test_glossary_check_can_fail():
    """The check itself: ITL is not a word of notebook 03 (it is 10's), goodput not one of 18's."""
    nbs = _notebooks()
    assert not _mentions(_text(nbs["03"]), "ITL") and _mentions(_text(nbs["10"]), "ITL")
    assert not _mentions(_text(nbs["18"]), "goodput") and _mentions(_text(nbs["11"]), "goodput")


# ---- README: what is not measured live is listed, and marked where it appears --------------------

def _printed_only_list() -> list[str]:
    """Notebook numbers of the README's printed-only bullets ("- **14**, **17**: ...")."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    head, _, rest = text.partition("marked **printed-only** where they appear:")
    assert rest, "README no longer introduces its list of printed-only items"
    bullets = re.match(r"\s*((?:- .*\n)+)", rest).group(1)
    return [k for line in bullets.splitlines() for k in re.findall(r"\*\*(\d\d[a-z]?)\*\*", line.split(":")[0])]


def test_readme_does_not_claim_everything_is_measured():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "Every claim a notebook makes is measured" not in " ".join(text.split())


def test_every_printed_only_item_is_marked_in_its_notebook_and_listed_in_the_readme():
    nbs, listed = _notebooks(), _printed_only_list()
    assert {"07", "13", "14", "15", "21"} <= set(listed)
    marked = {k for k, p in nbs.items()
              if any(re.search(r"printed-only|printed, never run", c, re.IGNORECASE) for c in _cells(p, "markdown"))}
    assert set(listed) <= marked, f"listed in README but not marked in the notebook: {sorted(set(listed) - marked)}"
    assert marked <= set(listed), f"marked in a notebook but missing from README's list: {sorted(marked - set(listed))}"


# ---- the symptom cheat sheet is generated from the code ------------------------------------------

def test_committed_cheatsheet_is_the_generated_one():
    from infercourse.lessons.symptoms import SYMPTOMS, cheatsheet_markdown
    text = cheatsheet_markdown()
    assert (NB / "cheatsheet_symptoms.md").read_text(encoding="utf-8") == text, \
        "regenerate: notebooks/cheatsheet_symptoms.md = symptoms.cheatsheet_markdown()"
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| symptom")]
    assert [r.split(" | ")[0][2:] for r in rows] == list(SYMPTOMS)
    assert "memory_limited" not in text       # the fault 16 no longer uses


def test_cheatsheet_follows_the_table(monkeypatch):
    from infercourse.lessons import symptoms
    monkeypatch.setitem(symptoms.SYMPTOMS, "a new symptom", (("engine",), "overloaded"))
    assert "| a new symptom | engine | fault `overloaded` |" in symptoms.cheatsheet_markdown()


# ---- the stack figure names every notebook of the map --------------------------------------------

def _map_notebooks() -> list[str]:
    return re.findall(r"^\| (\d\d[a-z]?) \| \[`", (NB / "README.md").read_text(encoding="utf-8"), re.MULTILINE)


def test_stack_table_names_every_notebook_of_the_map():
    from infercourse.lessons.stack import STACK, WALK
    tagged = {nb for *_, nbs in STACK for nb in nbs} | set(WALK)
    in_map = set(_map_notebooks())
    assert len(in_map) >= 20
    assert in_map <= tagged, f"notebooks of the map the stack figure does not tag: {sorted(in_map - tagged)}"
    assert tagged <= set(_notebooks()), f"tags that are no notebook: {sorted(tagged - set(_notebooks()))}"


def test_committed_stack_png_is_drawn_from_the_current_table():
    PIL = pytest.importorskip("PIL.Image")
    from infercourse.lessons.stack import STACK, WALK
    meta = json.loads(PIL.open(NB / "img" / "stack.png").text.get("Description", "{}"))
    assert meta == {"stack": [[name, list(nbs)] for name, _, nbs in STACK], "walk": list(WALK)}, \
        'stale figure: redraw with infercourse.lessons.stack.draw_stack("notebooks/img/stack.png")'


# ---- 17: each route is named after what runs -----------------------------------------------------

class StandInEngine:
    """STAND-IN for an engine class: records how it was built, loads nothing."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def test_route_d_is_mlx_lm_where_mlx_runs_on_metal_else_named_as_what_runs(monkeypatch):
    """"auto" takes MLX-LM where it runs on an Apple GPU; its CPU build (~75 s a call on 2 cores)
    only when asked ("mlx"), so 21 keeps a workshop's pace on a CPU and names what ran."""
    from infercourse.engines import llamacpp, mlx_engine
    from infercourse.lessons import capstone
    from infercourse.models import formats
    from infercourse.ops import guide_routes
    monkeypatch.setattr(mlx_engine, "MLXEngine", StandInEngine)
    monkeypatch.setattr(formats, "mlx_folder", lambda: "/stand-in/mlx")
    monkeypatch.setattr(llamacpp, "LlamaCppEngine", StandInEngine)
    monkeypatch.setattr(guide_routes, "_on_metal", lambda: True)
    d = capstone._route_d("auto", {"usable": True, "why": "mlx 0.32 on metal"}, threads=1, ctx_size=512)
    assert d.name.startswith("MLX-LM in process") and d.engine.args == ("/stand-in/mlx",)
    monkeypatch.setattr(guide_routes, "_on_metal", lambda: False)
    d = capstone._route_d("auto", {"usable": True, "why": "mlx 0.32 on cpu"}, threads=1, ctx_size=512)
    assert d.name.startswith("llama.cpp in process") and "CPU build only" in d.name
    d = capstone._route_d("mlx", {"usable": True, "why": "mlx 0.32 on cpu"}, threads=1, ctx_size=512)
    assert d.name.startswith("MLX-LM in process")
    d = capstone._route_d("auto", {"usable": False, "why": "mlx-lm not installed"}, threads=1, ctx_size=512)
    assert d.name.startswith("llama.cpp in process") and "mlx-lm not installed" in d.name
    assert d.engine.kwargs == {"n_ctx": 512, "n_threads": 1}
    assert capstone._route_d("mlx", {"usable": False, "why": "no mlx"}, threads=1, ctx_size=512).skipped == "no mlx"
    params: dict = {}
    cell = next(c for c in json.loads((NB / "21_capstone.ipynb").read_text(encoding="utf-8"))["cells"]
                if "parameters" in c["metadata"].get("tags", []))
    exec("".join(cell["source"]), params)
    assert params["ROUTE_D"] == "auto"


def test_route_a_serves_the_course_gguf_unless_told_otherwise(monkeypatch):
    from infercourse.core.errors import ModelLayerError, ServerLayerError
    from infercourse.engines import llamacpp, ollama
    from infercourse.lessons import capstone
    from infercourse.ops import faults

    def no_server(**kw):
        raise ServerLayerError("stand-in: no llama-server in this test")

    class StandInOllama(StandInEngine):
        @classmethod
        def from_gguf(cls, gguf=None, **kw):
            eng = cls()
            eng.model = "infercourse-smollm2:0123456789ab"
            return eng
    monkeypatch.setattr(faults, "small_server", no_server)
    monkeypatch.setattr(ollama, "OllamaEngine", StandInOllama)
    monkeypatch.setattr(llamacpp, "LlamaCppEngine", StandInEngine)
    status = {"ollama": {"usable": True, "why": "Ollama 0.9"}, "mlx": {"usable": False, "why": "no mlx"},
              "vllm": {"usable": False, "why": "no vllm"}}
    import contextlib
    with contextlib.ExitStack() as stack:
        rs = {r.key: r for r in capstone.routes(stack, status=status)}
        assert rs["A"].name == "Ollama (infercourse-smollm2:0123456789ab, created from the course's GGUF)"
        assert rs["C"].skipped and rs["D"].name.startswith("llama.cpp in process")
        named = {r.key: r for r in capstone.routes(stack, status=status, ollama_model="smollm2:135m")}
        assert named["A"].name == "Ollama (smollm2:135m: its own file, not the course's)"

        def refuse(cls, gguf=None, **kw):
            raise ModelLayerError("stand-in: Ollama refused the file")
        monkeypatch.setattr(StandInOllama, "from_gguf", classmethod(refuse))
        refused = {r.key: r for r in capstone.routes(stack, status=status)}
        assert "refused the file" in refused["A"].skipped
