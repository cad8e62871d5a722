"""Self-checks for the exercises: a learner computes an answer, `check` says if it holds.

The expected value is always computed live by the notebook (from this machine's
measurements), never typed in, so a check on a Mac Studio tests the same idea as on a
laptop. An unanswered exercise (`None`) is reported as such and never fails the notebook,
so `make course` runs every notebook top to bottom with the exercises still open.
"""
from __future__ import annotations

import math
from typing import Any

__all__ = ["check"]


def check(answer: Any, expected: Any, *, rtol: float = 0.1, atol: float = 0.0,
          explain: str = "") -> bool | None:
    """Compare a learner's answer with the live expected value and print the verdict.

    Args:
        answer: the learner's value (None while unanswered).
        expected: the value computed from this run's measurements.
        rtol, atol: numeric tolerance (relative, absolute).
        explain: one line printed when the answer is off, pointing at the idea to revisit.

    Returns True/False, or None when unanswered.
    """
    if answer is None:
        print("… not answered yet: replace `None` with your answer and re-run this cell.")
        return None
    if isinstance(expected, (int, float)) and isinstance(answer, (int, float)):
        ok = math.isclose(float(answer), float(expected), rel_tol=rtol, abs_tol=atol)
    else:
        ok = str(answer).strip().lower() == str(expected).strip().lower()
    if ok:
        print(f"✓ correct ({answer!r}; measured/expected {expected!r})")
    else:
        print(f"✗ not quite: you said {answer!r}, this machine gives {expected!r}. {explain}".rstrip())
    return ok
