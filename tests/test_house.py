"""The house style, checked: a module is one concept, and one concept fits in 350 lines.

A file that passes ~300 lines is probably two concepts (STYLE.md); past 350 it is split
where a concept ends (a lesson's claim sentences are often their own module, as
`lessons/fair.py` and `lessons/fair_claims.py`). This test keeps it so as the course grows.
"""
from __future__ import annotations

from pathlib import Path

import infercourse

MAX_LINES = 350
PACKAGE = Path(infercourse.__file__).resolve().parent


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_every_module_is_at_most_350_lines():
    long = {str(p.relative_to(PACKAGE.parent)): _lines(p) for p in sorted(PACKAGE.rglob("*.py"))
            if _lines(p) > MAX_LINES}
    assert not long, (f"{len(long)} module(s) over {MAX_LINES} lines; split each where a concept ends: "
                      + ", ".join(f"{k} ({v})" for k, v in sorted(long.items(), key=lambda kv: -kv[1])))


def test_the_count_is_of_lines_as_an_editor_shows_them(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("a = 1\n" * MAX_LINES)
    assert _lines(f) == MAX_LINES                      # at the limit: allowed
    f.write_text("a = 1\n" * (MAX_LINES + 1) + "\n")
    assert _lines(f) == MAX_LINES + 2                  # a trailing blank line counts too
