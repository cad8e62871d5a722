"""Self-checks for the exercises, and the learner's own predictions.

The expected value is always computed live by the notebook (from this machine's
measurements), never typed in, so a check on a Mac Studio tests the same idea as on a
laptop. An unanswered exercise (`None`) is reported as such and never fails the notebook,
so `make course` runs every notebook top to bottom with the exercises still open.

A wrong answer gets a hint, never the expected value: the learner keeps the exercise.
`choose` is a concept check (multiple choice) that shows the reason once answered, right
or wrong. `score_guess` turns the "Predict" step into the learner's own act: a `MY_GUESS`
written before the ceiling is computed is scored against the ceiling and the measurement.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["check", "choose", "score_guess", "predict_then_measure"]

_UNANSWERED = "… not answered yet: replace `None` with your answer and re-run this cell."


def check(answer: Any, expected: Any, *, rtol: float = 0.1, atol: float = 0.0,
          explain: str = "") -> bool | None:
    """Compare a learner's answer with the live expected value and print the verdict.

    Args:
        answer: the learner's value (None while unanswered).
        expected: the value computed from this run's measurements (shown only once right).
        rtol, atol: numeric tolerance (relative, absolute).
        explain: the hint printed when the answer is off, pointing at the idea to revisit.

    Returns True/False, or None when unanswered.
    """
    if answer is None:
        print(_UNANSWERED)
        return None
    if isinstance(expected, (int, float)) and isinstance(answer, (int, float)):
        ok = math.isclose(float(answer), float(expected), rel_tol=rtol, abs_tol=atol)
    else:
        ok = str(answer).strip().lower() == str(expected).strip().lower()
    if ok:
        print(f"✓ correct ({answer!r}; this machine gives {expected!r})")
    else:
        print(f"✗ not quite ({answer!r}). Hint: {explain or 're-read the Explain section and try again.'}")
    return ok


def choose(answer: str | None, options: Mapping[str, str], correct: str, why: str) -> bool | None:
    """A concept check: pick one of `options` by its key; the reason is shown once answered.

    Args:
        answer: the learner's key, e.g. "b" (None while unanswered).
        options: key -> option text, printed with the verdict.
        correct: the right key.
        why: the reasoning, shown after any answer (the point of the check).
    """
    if correct not in options:
        raise ValueError(f"correct key {correct!r} is not one of {sorted(options)}")
    if answer is None:
        print(_UNANSWERED + " Options: " + "; ".join(f"{k}) {v}" for k, v in options.items()))
        return None
    key = str(answer).strip().lower()
    if key not in options:
        print(f"? {answer!r} is not an option; choose one of {', '.join(options)}")
        return False
    ok = key == correct
    print(f"{'✓ right' if ok else '✗ not this one'}: {key}) {options[key]}\nWhy: {why}")
    return ok


def score_guess(guess: float | None, ceiling: float, measured: float, *, unit: str = "",
                bound: str = "ceiling") -> dict[str, Any] | None:
    """Score a prediction made before measuring: how far it was from the computed ceiling
    and from what this machine really did, as ratios (1.0 = exact).

    Args:
        guess: the learner's `MY_GUESS` (None: not guessed; nothing to score).
        ceiling: the back-of-envelope bound computed in the Predict step.
        measured: the measurement.
        unit: printed after the numbers, e.g. "tok/s".
        bound: what the computed value is called in the printout ("ceiling"; "floor" for
            a minimum time such as TTFT; "prediction" for plain arithmetic).
    """
    if guess is None:
        print("Not answered yet: write your guess in this cell's MY_... variable before it runs, then compare.")
        return None
    if not all(math.isfinite(x) and x > 0 for x in (float(guess), ceiling, measured)):
        raise ValueError("guess, ceiling and measurement must be positive numbers")
    out = {"guess": float(guess), "ceiling": ceiling, "measured": measured,
           "guess_over_measured": guess / measured, "guess_over_ceiling": guess / ceiling,
           "measured_over_ceiling": measured / ceiling}
    closer = f"the {bound}" if abs(math.log(guess / ceiling)) < abs(math.log(guess / measured)) else "the measurement"
    print(f"your guess {guess:.4g} {unit} · {bound} {ceiling:.4g} {unit} · measured {measured:.4g} {unit}\n"
          f"guess/measured = {out['guess_over_measured']:.2f}, measured/{bound} = "
          f"{out['measured_over_ceiling']:.0%}; your guess was closer to {closer}.")
    return out


def predict_then_measure(prediction: float | None, measure: Any, *, unit: str = "", rtol: float = 0.25,
                         what: str = "the measurement") -> dict[str, Any] | None:
    """Score a prediction against a measurement made *after* it was written down.

    Args:
        prediction: the learner's number for the changed setting (None: nothing is run).
        measure: a function of no arguments that runs the changed experiment and returns the
            number (called only once a prediction exists).
        unit: printed after the numbers.
        rtol: how close counts as right (0.25: within 25 %), a judgement of what a
            back-of-envelope prediction can reach, not a property of the machine.
        what: the name of the measured number, for the printout.

    Returns {"prediction", "measured", "ratio", "right"} or None when unanswered.
    """
    if prediction is None:
        print(_UNANSWERED + f" (nothing is measured until you predict {what})")
        return None
    if not (math.isfinite(float(prediction)) and float(prediction) > 0):
        raise ValueError(f"a prediction must be a positive number, got {prediction!r}")
    measured = float(measure())
    if not (math.isfinite(measured) and measured > 0):
        print(f"{what} could not be measured this time ({measured}): rerun the cell")
        return None
    ratio = float(prediction) / measured
    right = abs(math.log(ratio)) <= math.log1p(rtol)
    print(f"you predicted {float(prediction):.4g} {unit} · measured {measured:.4g} {unit} · "
          f"prediction/measured = {ratio:.2f}: " + ("✓ within " if right else "✗ outside ") + f"±{rtol:.0%}")
    return {"prediction": float(prediction), "measured": measured, "ratio": ratio, "right": right}
