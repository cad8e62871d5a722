"""The course's small size, read in one place: `notebooks/ci_params.json`, the parameters
`make test` injects into each notebook (`course.ci_params`) and the set durations the forecast
keeps unscaled at that size (`pace.fixed_s`). Here, below both, because `ops` may not import
`course` (the layers contract in pyproject.toml)."""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["CI_PARAMS", "ci_params"]

CI_PARAMS = Path(__file__).resolve().parents[2] / "notebooks" / "ci_params.json"


def ci_params(stem: str) -> dict:
    """The CI-size parameters of the notebook named `stem` (e.g. "15_stability"); {} for a
    notebook that runs at its full size in CI too."""
    table = json.loads(CI_PARAMS.read_text())
    table.pop("_about", None)
    return dict(table.get(stem, {}))
