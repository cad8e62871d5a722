"""No fixed outcome in the prose (issue 26 §1).

A markdown cell or a solution that says "3 positions cost 2× one" or "the mean sits above
the median" is right on the machine it was written on and wrong on the next. Outcomes are
written by `measure.claims` (and the lesson modules) from the run's own numbers; fixed
text explains mechanisms. This test reads the notebooks' markdown (outside the Question
and Predict cells, where a number frames the question) and their solutions, and fails on
a number with a unit or a comparison word, unless the line is on the allow-list below
with its reason. Notebooks join `CHECKED` as their prose is rewritten.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / "notebooks"

ALLOW_DIR = Path(__file__).parent / "data" / "claims_allow"
ALL = sorted(p.name[:2] for p in NB.glob("[0-9][0-9]_*.ipynb"))
# notebooks whose prose is still being rewritten (issue 26); `_hits("NN")` lists what is left
PENDING: list[str] = []
CHECKED = [k for k in ALL if k not in PENDING]

# a number with a unit (a measured figure), and words that rank or compare an outcome; "2 × 30"
# (a product of two numbers, card arithmetic) is not a multiple, "1.36×" and "5.7 × S" are
NUMBER_UNIT = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?\s*(?:ms|s|tok/s|%|(?:×|x)(?!\s*[\d(]))(?![\w/])")
COMPARISON = re.compile(r"\b(faster|slower|above the median|below the median|steep(?:er|ly)?)\b", re.I)


def _allow() -> list[tuple[str, str, str]]:
    """(notebook, regex the line must match, reason), from tests/data/claims_allow/NN.json: one
    file per notebook, each entry `{"match": regex, "why": reason}`. Every entry must be used."""
    out = []
    for f in sorted(ALLOW_DIR.glob("*.json")):
        out += [(f.stem, e["match"], e["why"]) for e in json.loads(f.read_text(encoding="utf-8"))]
    return out


ALLOW = _allow()


def _prose(key: str) -> list[tuple[str, str]]:
    """[(where, text)] of a notebook's checked markdown cells and its solution file."""
    nb = next(NB.glob(f"{key}_*.ipynb"))
    out = []
    for i, c in enumerate(json.loads(nb.read_text(encoding="utf-8"))["cells"]):
        src = "".join(c["source"])
        if c["cell_type"] != "markdown" or i == 0 or src.lstrip().startswith("## Predict"):
            continue          # the Question (title) and Predict cells frame the question with numbers
        out.append((f"{nb.name} cell {i}", src))
    sol = NB / "solutions" / nb.with_suffix(".md").name
    out.append((f"solutions/{sol.name}", sol.read_text(encoding="utf-8")))
    return out


def _hits(key: str) -> tuple[list[str], set[int]]:
    """Unallowed hits ("where: line"), and the indices of the allow entries that matched."""
    bad, used = [], set()
    allow = [(i, re.compile(rx)) for i, (k, rx, _) in enumerate(ALLOW) if k == key]
    for where, text in _prose(key):
        for line in text.splitlines():
            found = [m.group(0) for m in NUMBER_UNIT.finditer(line)] + [m.group(0) for m in COMPARISON.finditer(line)]
            if not found:
                continue
            ok = [i for i, rx in allow if rx.search(line)]
            used.update(ok)
            if not ok:
                bad.append(f"{where}: {found} in: {line.strip()[:160]}")
    return bad, used


@pytest.mark.parametrize("key", CHECKED)
def test_no_fixed_outcome_in_prose(key):
    bad, _ = _hits(key)
    assert not bad, "fixed outcomes in prose (write them with measure.claims, or allow-list with a reason):\n" \
        + "\n".join(bad)


def test_allow_list_has_reasons_and_no_stale_entries():
    used = set()
    for key in CHECKED:
        used |= _hits(key)[1]
    stale = [ALLOW[i][:2] for i in range(len(ALLOW)) if i not in used and ALLOW[i][0] in CHECKED]
    assert not stale, f"allow-list entries that match nothing (remove them): {stale}"
    assert all(len(reason) > 20 for *_, reason in ALLOW)


@pytest.mark.parametrize("text,caught", [
    ("3 positions cost 129.9 ms", True), ("the ratio was 1.36×", True), ("44.9 % of the ceiling", True),
    ("22.5 tok/s here", True), ("the mean sits above the median", True), ("medusa was slower", True),
    ("the fall is steep", True), ("each head reads h_t", False), ("notebook 03's table", False),
    ("≈ 5.7 × S", True), ("2 × 30 layers", False),
])
def test_the_checker_catches_what_it_should(text, caught):
    assert bool(NUMBER_UNIT.search(text) or COMPARISON.search(text)) is caught
