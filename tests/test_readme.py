"""The README's layer table names every module of the package, and nothing that is gone.

A learner reads that table to find where a concept lives; a module missing from it is a
concept they cannot find, and a name that no longer exists sends them nowhere. The package
indexes (`lessons/__init__.py` and friends) are held to the same rule for their own package.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import infercourse

ROOT = Path(infercourse.__file__).resolve().parents[1]
PKG = ROOT / "infercourse"
SUBPACKAGES = ("cli", "lessons", "ops", "measure", "servers", "engines", "models", "core")


def _modules(sub: str) -> set[str]:
    return {p.stem for p in (PKG / sub).glob("*.py") if p.stem != "__init__"}


def _row(sub: str) -> str:
    rows = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith(f"| `{sub}/`")]
    assert len(rows) == 1, f"README.md's layer table needs one row for {sub}/"
    return rows[0]


@pytest.mark.parametrize("sub", SUBPACKAGES)
def test_the_readme_layer_table_names_every_module(sub):
    named = set(re.findall(r"`([a-z_0-9]+)`", _row(sub)))
    missing, gone = _modules(sub) - named, named - _modules(sub) - {sub}
    assert not missing, f"README.md's {sub}/ row does not name: {sorted(missing)}"
    assert not gone, f"README.md's {sub}/ row names modules that do not exist: {sorted(gone)}"


@pytest.mark.parametrize("sub", ("lessons", "ops", "measure", "models"))
def test_each_package_index_names_every_module(sub):
    doc = (PKG / sub / "__init__.py").read_text()
    named = set(re.findall(r"`([a-z_0-9]+)`", doc))
    missing = _modules(sub) - named
    assert not missing, f"infercourse/{sub}/__init__.py's table does not name: {sorted(missing)}"
