"""The course map: the notebooks in map order, what each needs first, and workshop cuts.

The files are numbered in the order of the map (phase 1: 00-02, phase 2: 03-09, phase 3:
10-16, phase 4: 17-21), so a learner who opens them by name follows the map. Everything a
notebook says about its place is read from the notebook itself: the `**Prerequisites:**`
links and `**Study time:**` of its first cell, the previous/next links of its first and last
cells. `check_navigation` compares them with the file order (a test runs it), and
`workshop_table` adds a cut's study time and the reference machine's measured run times
(`data/reference_machine.json`, a full `make course`), the table in `notebooks/INSTRUCTOR.md`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from .course import NOTEBOOK_DIR, notebooks

__all__ = ["PHASES", "WORKSHOP_CUTS", "notebook_info", "check_navigation", "workshop_table"]

PHASES = {"1 · the layers": ("00", "02"), "2 · core concepts": ("03", "09"),
          "3 · metrics and practice": ("10", "16"), "4 · troubleshooting": ("17", "21")}

# Each day is a list of notebooks taught in the room, in order; the rest are for self-study.
# Chosen so every notebook's prerequisites come earlier in the same cut (checked by a test).
WORKSHOP_CUTS = {
    "one day": [["00", "01", "02", "03", "04", "05", "08", "10", "17"]],
    "two days": [["00", "01", "02", "03", "04", "05", "06", "08"],
                 ["10", "11", "13", "17", "18", "19", "21"]],
}

REFERENCE = Path(__file__).resolve().parent.parent / "data" / "reference_machine.json"
_LINK = re.compile(r"\[(\d\d) · [^\]]*\]\((\d\d_[a-z_]+)\.ipynb\)")


def _cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text(encoding="utf-8"))["cells"]]


def notebook_info(folder: str | Path = NOTEBOOK_DIR) -> dict[str, dict]:
    """{"07": {"file", "prerequisites", "study_min", "previous", "next", "footer"}} read from the notebooks.

    previous/next are the targets of the first cell's navigation links; footer is the same
    pair read from the last cell ("← Previous: [..](..) · Next: [..](..) →").
    """
    out = {}
    for p in notebooks(folder):
        cells = _cells(p)
        first, last = cells[0], cells[-1]
        pre = first[first.index("**Prerequisites:**"):first.index("**Study time:**")] \
            if "**Prerequisites:**" in first and "**Study time:**" in first else ""
        study = re.search(r"\*\*Study time:\*\* ~(\d+) min", first)

        def nav(text: str, word: str) -> str | None:
            m = re.search(word + r":?(?:\*\*)? \[\d\d · [^\]]*\]\((\d\d)_", text)
            return m.group(1) if m else None
        out[p.name[:2]] = {
            "file": p.name, "prerequisites": sorted({m.group(2)[:2] for m in _LINK.finditer(pre)}),
            "study_min": int(study.group(1)) if study else None,
            "previous": nav(first, "Previous"), "next": nav(first, "Next"),
            "footer": (nav(last, "Previous"), nav(last, "Next")) if "Terms: [glossary]" in last else None,
            "link_labels_ok": all(num == target[:2] for c in cells for num, target in _LINK.findall(c)),
        }
    return out


def check_navigation(folder: str | Path = NOTEBOOK_DIR) -> list[str]:
    """Every way a notebook's navigation disagrees with the file order: [] when it is consistent."""
    info = notebook_info(folder)
    keys, bad = list(info), []
    for i, k in enumerate(keys):
        n = info[k]
        prev, nxt = (keys[i - 1] if i else None), (keys[i + 1] if i + 1 < len(keys) else None)
        if n["study_min"] is None or (i and not n["prerequisites"]):
            bad.append(f"{n['file']}: no prerequisites / study-time line")
        if any(p >= k for p in n["prerequisites"]):
            bad.append(f"{n['file']}: a prerequisite comes after it in the map ({n['prerequisites']})")
        if (n["previous"], n["next"]) != (prev, nxt):
            bad.append(f"{n['file']}: first cell links {n['previous']}/{n['next']}, the map says {prev}/{nxt}")
        if n["footer"] != (prev, nxt):
            bad.append(f"{n['file']}: footer {n['footer']}, the map says {(prev, nxt)}")
        if not n["link_labels_ok"]:
            bad.append(f"{n['file']}: a link's number is not its target's")
    return bad


def workshop_table(folder: str | Path = NOTEBOOK_DIR, reference: str | Path = REFERENCE) -> str:
    """The workshop cuts as a markdown table: notebooks per day, study time, measured run time."""
    info = notebook_info(folder)
    ref = json.loads(Path(reference).read_text(encoding="utf-8"))
    run_s = {name[:2]: s for name, s in ref["notebooks_full_s"].items()}
    rows = ["| cut | day | notebooks | study time | run time on the reference machine (full size) |",
            "|---|---|---|---|---|"]
    for cut, days in WORKSHOP_CUTS.items():
        for d, day in enumerate(days, 1):
            study = sum(info[k]["study_min"] for k in day)
            run = sum(run_s[k] for k in day)
            rows.append(f"| {cut} | {d} | {', '.join(day)} | {study // 60} h {study % 60:02d} min "
                        f"| {run / 60:.1f} min |")
    rest = [k for k in info if not any(k in day for day in WORKSHOP_CUTS["two days"])]
    rows.append(f"| self-study after the two days | | {', '.join(rest)} | "
                f"{sum(info[k]['study_min'] for k in rest) / 60:.1f} h | |")
    return "\n".join(rows)
