"""Issue 31 §2: every place that judges a comparison says so when its pairs were too few.

`noise.compare` itself says "too few pairs" (never "within noise") below the pairs its test
needs. What can still go wrong is a caller that turns a verdict into its own words, and says
"within noise" or "did not clear the floor" for anything that is not a winner. So the callers
are audited: the set below is every function in the library that calls `compare` or
`compare_arms`, each with how it passes the verdict on; a new caller fails this test until it
is read and added. The words of the callers that write their own are checked with too few pairs.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import infercourse
from infercourse.measure import noise

# function -> how a too-few verdict reaches the learner
AUDITED = {
    "cli/report.py:report_main": "results.compare (a table of the runs), not noise.compare: no verdict",
    "lessons/agent_failures_numerics.py:spec_table": "verdict column is Comparison.said; spec_sentence words it "
                                                      "with claims.verdict_sentence",
    "lessons/capstone.py:route_comparison": "Comparisons passed to fastest(), which counts too_few",
    "lessons/capstone.py:changed_most": "names the routes judged on too few calls (tested below)",
    "lessons/capstone.py:delay_text": "claims.verdict_sentence",
    "lessons/classic_problems.py:like_for_like": "claims.verdict_sentence",
    "lessons/concurrency.py:np_sweep": "verdict column (the verdict string)",
    "lessons/concurrency.py:cb_compare": "verdict column; cb_sentence uses claims.verdict_sentence",
    "lessons/draft_verify.py:compare_drafters": "verdict column; spec_claims.loop_verdicts (tested below)",
    "lessons/draft_verify.py:pass_cost": "verdict column: Comparison.said (tested below)",
    "lessons/fair.py:fair_table": "results.compare, not noise.compare: no verdict",
    "lessons/fair.py:server_vs_in_process": "Comparison.said in fair_claims",
    "lessons/fair.py:peer_beside_ours": "results.compare, not noise.compare: no verdict",
    "lessons/latency.py:clock_verdicts": "verdict column (the verdict string, tested below)",
    "lessons/long_prefill_claims.py:compare_configs": "claims.verdict_sentence in the per-setting sentences",
    "lessons/memory.py:_judged": "verdict column (the verdict string)",
    "lessons/model_routing.py:judge": "_verdict_lines (tested below)",
    "lessons/moe_claims.py:batch1_comparisons": "claims.verdict_sentence in speed_sentence, which ranks only .decided",
    "lessons/plumbing.py:explain_layers": "claims.verdict_sentence",
    "lessons/mtp_decode.py:draft_length_run": "draft_verify.compare_drafters' verdict column",
    "lessons/routing.py:judge_policies": "claims.verdict_sentence in policy_text",
    "lessons/speculative.py:_judge": "verdict column; spec_claims.outcome() (tested below)",
    "lessons/symptoms.py:context_growth": "Comparison.said",
    "lessons/symptoms.py:cpu_contention": "Comparison.said",
    "ops/recorder_cost.py:compare": "claims.verdict_sentence in recorder_sentence; its goal line says 'too few pairs'",
    "measure/quant_speed.py:request_trials": "decode_verdict column; quant_explain.speed_class (tested below)",
    "measure/stream_regime.py:thread_check": "claims.verdict_sentence in ThreadCheck.text; PhaseRegime.short prints the verdict string",
    "measure/tuning_log.py:decide": "its own 'why' (tested below)",
}


def _callers() -> set[str]:
    root = Path(infercourse.__file__).parent
    found = set()
    for p in sorted(root.rglob("*.py")):
        if p.name == "noise.py":
            continue
        for fn in ast.walk(ast.parse(p.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(fn):
                    if isinstance(n, ast.Call):
                        f = n.func
                        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                        if name in ("compare", "compare_arms"):
                            found.add(f"{p.relative_to(root).as_posix()}:{fn.name}")
    return found


def test_every_caller_of_compare_is_audited():
    new, gone = _callers() - set(AUDITED), set(AUDITED) - _callers()
    assert not new, f"read these callers and add them to AUDITED (how do they say 'too few pairs'?): {sorted(new)}"
    assert not gone, f"no longer callers: remove {sorted(gone)}"


def _few(labels=("A", "B"), n=2):
    a = np.linspace(1.0, 1.1, n)
    return noise.compare(a, a * 1.5, noise.noise_floor(a, a * 1.01), labels=labels)


def _no_bare_within_noise(text: str) -> None:
    assert "within noise" not in text and "did not clear" not in text, text
    assert "too few" in text or "cannot pass" in text, text


def test_writers_of_their_own_words_say_too_few():
    from infercourse.lessons import capstone, model_routing, quant_explain, spec_claims
    from infercourse.measure import claims
    c = _few()
    assert c.verdict == noise.TOO_FEW
    _no_bare_within_noise(claims.verdict_sentence(c))
    _no_bare_within_noise(spec_claims.outcome(c.verdict, "B", "A"))
    assert quant_explain.speed_class({"decode_verdict": c.verdict, "format": "B", "speedup_vs": "A"}) == "too few pairs"
    wide = pd.DataFrame({"awake": [1.0, 1.1], "awake A/A": [1.01, 1.1], "after sleep": [3.0, 3.3]})
    lines = model_routing._verdict_lines(wide, "median TTFT", "a wins", "b wins", "- did not clear the A/A floor")
    _no_bare_within_noise(lines[0])
    calls = pd.DataFrame({"route": ["C", "C"], "request_id": [0, 1], "status": ["ok", "ok"], "error": ["", ""],
                          "ttft_s": [0.5, 0.6], "e2e_s": [1.0, 1.1]})
    route, why = capstone.changed_most(calls, calls.assign(e2e_s=[2.0, 2.2]))
    assert route is None and "too few calls to judge on C" in why


def test_the_tuning_log_and_the_pass_cost_say_too_few():
    from infercourse.measure import tuning_log
    before = pd.DataFrame({"request_id": range(4), "status": ["ok"] * 4, "ttft_s": [1.0, 1.1, 0.9, 1.0]})
    after = before.assign(ttft_s=before["ttft_s"] * 0.5)
    d = tuning_log.decide(before, after, "ttft_s", floor=0.05)
    assert d["decision"] == "revert"
    _no_bare_within_noise(d["why"])


def test_clock_verdicts_say_too_few_pairs():
    """10's table: 4 pairs judged against the band of an A/A of other requests (a sign-flip test that
    needs 6) printed "within noise" beside 7.22×."""
    from infercourse.lessons import latency
    un = pd.DataFrame({"status": ["ok"] * 4, "ttft_s": [1.0, 1.1, 0.9, 1.05],
                       "ttft_from_send_s": [1.0, 1.1, 0.9, 1.05], "scheduled_t": range(4)})
    loaded = pd.DataFrame({"status": ["ok"] * 8, "ttft_s": np.linspace(2, 9, 8),
                           "ttft_from_send_s": np.linspace(1, 1.1, 8), "scheduled_t": range(8)})
    t = latency.clock_verdicts(un, loaded)
    for v in t["verdict"]:
        assert v == noise.TOO_FEW, t


def test_a_p_at_its_floor_says_so():
    """Issue 33 §4: 21 quoted p = 0.037 as if the data had pushed it there; with 3 pairs of A, its
    A/A rerun and B it is 1/3^3, the smallest p those pairs can give, whatever the effect."""
    from infercourse.measure import claims
    p_words = claims.p_text
    a = np.array([1.0, 1.02, 0.99])
    floor = noise.noise_floor(a, a * 1.01)
    at_floor = noise.compare(a, a * 2, floor, labels=("x", "y"))
    assert at_floor.p == pytest.approx(1 / 27) and re.search(r"\bthe smallest p 3 pairs can give\b", p_words(at_floor))
    assert "(p = 0.037, the smallest p 3 pairs can give; at most 0.05 false positives)" in claims.verdict_sentence(at_floor)
    mixed = noise.compare(np.r_[a, 1.0, 1.01], np.r_[a * 2, 0.9, 1.3], floor, labels=("x", "y"))
    assert mixed.p > 1 / 3 ** 5 and "smallest" not in p_words(mixed)
