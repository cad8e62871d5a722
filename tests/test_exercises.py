"""Self-checks never leak the expected value on a wrong answer; guesses are scored as ratios."""
import pytest

from infercourse.lessons.exercises import check, choose, predict_then_measure, score_guess


def test_check_hints_without_the_answer(capsys):
    assert check(None, 42) is None
    assert check(41, 42, rtol=0.1) is True
    assert check(10, 4242, explain="look at the slope") is False
    out = capsys.readouterr().out
    assert "look at the slope" in out and "4242" not in out


def test_choose_shows_the_reason_and_rejects_unknown_keys(capsys):
    opts = {"a": "bandwidth", "b": "compute"}
    assert choose("A", opts, "a", why="one token per pass") is True
    assert choose("b", opts, "a", why="one token per pass") is False
    assert choose("z", opts, "a", why="w") is False
    assert "one token per pass" in capsys.readouterr().out
    with pytest.raises(ValueError):
        choose("a", opts, "c", why="w")


def test_score_guess_ratios_and_the_bound_name(capsys):
    out = score_guess(50.0, 100.0, 25.0, unit="ms", bound="floor")
    assert out["guess_over_measured"] == pytest.approx(2.0)
    assert out["measured_over_ceiling"] == pytest.approx(0.25)
    text = capsys.readouterr().out
    assert "floor 100 ms" in text and "measured/floor" in text
    assert score_guess(None, 1.0, 1.0) is None
    with pytest.raises(ValueError):
        score_guess(-1.0, 1.0, 1.0)


def test_predict_then_measure_runs_nothing_until_predicted_and_scores_both_ways(capsys):
    calls = []

    def measure():
        calls.append(1)
        return 40.0
    assert predict_then_measure(None, measure) is None and not calls          # unanswered: not run
    right = predict_then_measure(45.0, measure, unit="tok/s", rtol=0.25)
    wrong = predict_then_measure(80.0, measure, unit="tok/s", rtol=0.25)
    assert len(calls) == 2 and right["right"] and not wrong["right"]
    assert right["ratio"] == pytest.approx(45 / 40) and wrong["ratio"] == pytest.approx(2.0)
    assert "✓" in capsys.readouterr().out
    assert predict_then_measure(30.0, lambda: 40.0, rtol=0.25)["right"] is False     # 0.75 < 1/1.25
    with pytest.raises(ValueError):
        predict_then_measure(-1.0, measure)
