"""lessons.long_prefill and its claims: the sentences flip with synthetic runs; a real llama-server at the CI
size answers each asked length with exactly that many prefilled tokens, cold, and takes longer
for longer prompts."""
import re

import pandas as pd
import pytest

from infercourse.lessons import long_prefill as lp
from infercourse.lessons import long_prefill_claims as lpc
from infercourse.measure.prefill_curve import PrefillFit
from infercourse.ops.agent_lab import extend_flags

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
AT = (1024, 2048, 4096)
REF, OFF, UB, AA = "fa on, ub 512", "fa off, ub 512", "fa on, ub 2048", "fa on, ub 512 (A/A)"


def _run(a=0.05, b=3e-3, c=4e-7, *, off=1.0, ub=1.0, aa=(1.01, 0.99, 1.02), off_grows=False) -> pd.DataFrame:
    """A synthetic `prefill_curve_run` frame: the reference on a + b·n + c·n², the others
    at AT as multiples of it (fa off's multiple grows with n when `off_grows`)."""
    rows = []

    def add(arm, role, n, t):
        rows.append({"arm": arm, "config": arm.replace(" (A/A)", ""), "role": role, "n_asked": n, "prompt_n": n,
                     "flash_attn": "off" if arm == OFF else "on", "ubatch": 2048 if arm == UB else 512,
                     "cache_n": 0, "prefill_s": t, "ttft_s": t + 0.01, "tok_per_s": n / t, "status": "ok"})
    base = {n: a + b * n + c * n * n for n in LENGTHS}
    for n in LENGTHS:
        add(REF, "reference", n, base[n])
    for i, n in enumerate(AT):
        add(OFF, "alternative", n, base[n] * (off ** (i + 1) if off_grows else off))
        add(UB, "alternative", n, base[n] * ub)
        if aa:
            add(AA, "A/A", n, base[n] * aa[i])
    return pd.DataFrame(rows)


def _words(text, phrase):
    return re.search(rf"\b{re.escape(phrase)}\b", text) is not None


def test_rate_falls_because_of_attention_vs_rate_held():
    falls = _run(c=4e-7)
    fit = lpc.fit_reference(falls)
    text = lpc.rate_sentence(falls, fit, lpc.aa_floor(falls).floor)
    assert _words(text, "the rate falls with length because attention grows as n²")
    assert not _words(text, "the rate held")
    held = _run(c=1e-11)                  # a tiny n² term: the rate stays flat past the fixed cost
    fit = lpc.fit_reference(held)
    text = lpc.rate_sentence(held, fit, 0.2)
    assert _words(text, "the rate held") and _words(text, "the linear term dominates up to 16,384 tokens")
    assert not _words(text, "because attention grows as n²")


def test_a_rough_fit_hedges_the_attribution():
    df = _run(c=4e-7)
    df.loc[(df["role"] == "reference") & (df["n_asked"] == 8192), "prefill_s"] *= 2.5   # one point ran slowed
    df["tok_per_s"] = df["prompt_n"] / df["prefill_s"]
    fit = lpc.fit_reference(df)
    assert fit.rel_rms > lpc.ROUGH_FIT
    text = lpc.rate_sentence(df, fit, lpc.aa_floor(df).floor)
    assert _words(text, "the rate fell") and "cannot put the fall on attention alone" in text
    assert not _words(text, "because attention grows as n²")
    assert "read these terms as rough" in lpc.fit_sentence(fit)
    assert "rough" not in lpc.fit_sentence(lpc.fit_reference(_run(c=4e-7)))


def test_rate_inside_a_wide_band_cannot_tell_a_fall_from_noise():
    df = _run(c=4e-7, aa=(3.0, 0.3, 1.5))      # an A/A pair 3.3x apart: a band of ±233%
    text = lpc.rate_sentence(df, lpc.fit_reference(df), lpc.aa_floor(df).floor)
    assert "cannot tell a fall from noise" in text
    assert not _words(text, "the rate held") and not _words(text, "because attention grows as n²")


def test_rate_rose_when_the_fixed_cost_dominates_short_prompts():
    df = _run(a=5.0, b=3e-3, c=1e-12)
    text = lpc.rate_sentence(df, lpc.fit_reference(df), 0.05)
    assert _words(text, "the rate rose") and not _words(text, "the rate held")


def test_rate_without_a_floor_is_not_judged():
    df = _run(aa=None)
    assert lpc.aa_floor(df) is None
    text = lpc.rate_sentence(df, lpc.fit_reference(df), None)
    assert "not judged" in text and not _words(text, "the rate falls with length")


def test_fit_sentence_names_the_crossover_or_its_absence():
    text = lpc.fit_sentence(PrefillFit(0.05, 3e-3, 4e-7, 512, 16384, 6, 0.01), flop_crossover=6146)
    assert "7,500 tokens" in text and "counting FLOPs predicts 6,146" in text
    flat = lpc.fit_sentence(PrefillFit(0.05, 3e-3, 0.0, 512, 16384, 6, 0.01, ("quadratic",)))
    assert _words(flat, "No n² term") and "held quadratic at 0" in flat


def test_option_sentence_flips_with_the_alternative():
    slower = _run(off=1.4)
    floor = lpc.aa_floor(slower).floor
    text = lpc.option_sentence(slower, OFF, floor)
    assert re.search(r"was faster at no length; slower at 1,024, 2,048, 4,096\b", text)
    faster = _run(ub=0.7)
    text = lpc.option_sentence(faster, UB, lpc.aa_floor(faster).floor)
    assert re.search(r"was faster at 1,024, 2,048, 4,096; slower at no length", text)
    same = _run(off=1.005)
    text = lpc.option_sentence(same, OFF, lpc.aa_floor(same).floor)
    assert re.search(r"within noise at 1,024, 2,048, 4,096\.", text)
    grows = _run(off=1.2, off_grows=True)        # 1.2x, 1.44x, 1.73x against a ±30% band
    text = lpc.option_sentence(grows, OFF, 0.3)
    assert re.search(r"slower at 2,048, 4,096; within noise at 1,024\.", text)


def test_ubatch_at_or_below_the_prompt_pass_is_the_same_work():
    df = _run(ub=0.7)
    df.loc[df["n_asked"] == 1024, "n_asked"] = 512          # one compared length a single pass under both
    text = lpc.option_sentence(df, UB, lpc.aa_floor(df).floor)
    assert "At 512 tokens both run the prompt in one pass" in text and "2,048 tokens both" not in text
    assert "one pass" not in lpc.option_sentence(df, OFF, lpc.aa_floor(df).floor)   # fa differs: not the same work


def test_compare_configs_uses_the_aa_rerun_and_can_decide_with_three_lengths():
    comps = lpc.compare_configs(_run(off=1.5, ub=1.0))
    assert comps[OFF].verdict == f"{REF} faster"
    assert not comps[UB].decided


def test_agent_sentence_forecasts_and_checks_against_the_real_ttft():
    fit = PrefillFit(0.0, 3e-3, 4e-7, 512, 8192, 5, 0.0)
    text = lpc.agent_sentence(fit, {"Claude Code": 10650, "Codex": 5968}, short_rate=300.0,
                             measured_s={"Claude Code": 80.1})
    cc, codex = text.splitlines()
    assert _words(cc, "extrapolated") and "measured 80.1 s" in cc and "would say 36 s" in cc
    assert cc.startswith("- Forecast, not a measurement: Claude Code's first request (10,650 tokens)")
    assert _words(codex, "interpolated") and not re.search(r"; measured \d", codex)


def test_explain_holds_every_part():
    df = _run(off=1.4)
    df.attrs.update(contention="quiet", wall_s=12.0, threads=1)
    text = lpc.explain(df)
    for part in ("Fit of prefill time", "Prefill rate from 512", "A/A noise floor", OFF, UB, "Claude Code",
                 "TTFT exceeded", "took 12 s"):
        assert part in text


def test_plot_curve_draws_every_arm_and_the_extrapolation():
    import matplotlib
    matplotlib.use("Agg")
    df = _run()
    ax = lp.plot_curve(df, lpc.fit_reference(df), extend_to=20000)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {REF, OFF, UB, AA, "fit, extrapolated"} <= set(labels)


def test_configs_build_the_flags_and_compare_at_must_be_measured():
    assert lp.PrefillConfig("x", flash_attn="off", ubatch=4096, batch=2048).args() == \
        ["-fa", "off", "-ub", "4096", "-b", "4096"]
    assert extend_flags(4096) == []
    assert 6000 < lp.model_crossover_tokens() < 6300          # SmolLM2-135M's FLOP crossover
    # by FLOPs alone the rate at n falls as 1 / (1 + n / n*): at n* it is half the rate near 0
    n_star = lp.model_crossover_tokens()
    assert lp.flop_rate_ratio(1, n_star) == pytest.approx((1 + 1 / n_star) / 2)
    assert lp.flop_rate_ratio(512, 16384) == pytest.approx((1 + 512 / n_star) / (1 + 16384 / n_star))
    ext = extend_flags(16640)
    assert "llama.context_length=int:16640" in ext and ext[ext.index("--yarn-orig-ctx") + 1] == "8192"
    with pytest.raises(ValueError, match="compare_at"):
        lp.prefill_curve_run((128, 256, 512), (1024,))


@pytest.mark.slow
def test_real_server_prefills_each_asked_length_cold(tmp_path):
    lengths = (64, 128, 256)
    df = lp.prefill_curve_run(lengths, (64, 256), threads=1, results_root=tmp_path)
    assert set(df["role"]) == {"reference", "alternative", "A/A"} and (df["status"] == "ok").all()
    assert len(df) == 3 + 3 * 2 and sorted(df["slot"]) == list(range(len(df)))
    assert (df["prompt_n"] == df["n_asked"]).all() and (df["cache_n"] == 0).all()
    assert (df["prefill_s"] > 0).all() and (df["ttft_s"] > 0).all()
    for _, g in df.groupby("arm"):                # 4x the prompt is never faster to prefill
        t = g.sort_values("n_asked")["prefill_s"].to_numpy()
        assert t[-1] > t[0]
    fit = lpc.fit_reference(df)
    assert fit.n_max == 256 and fit.time_s(256) > 0
    assert "Fit of prefill time" in lpc.explain(df)


def test_prefill_at_refuses_a_length_past_the_runs_window():
    df = _run()
    df.attrs.update(ctx=1024, context_flags=[], threads=1)
    with pytest.raises(ValueError, match="window"):
        lp.prefill_at(2048, df)


def test_extension_flags_come_from_the_models_own_file():
    """A model trained on 32,768 tokens gets no YaRN at 32,768 and, past it, its own architecture's
    key and its own trained length (issue 33 §3: the flags once assumed llama and 8,192)."""
    from infercourse.models import gemma3
    from infercourse.ops.agent_lab import extend_flags, trained_context
    ok, why = gemma3.available()
    if not ok:
        pytest.skip(why)
    g = gemma3.gemma3_gguf()
    arch, trained = trained_context(str(g))
    assert arch == "gemma3" and trained == 32768
    assert extend_flags(32768, g) == [] and extend_flags(8192, None) == []
    ext = extend_flags(65536, g)
    assert "gemma3.context_length=int:65536" in ext and ext[ext.index("--yarn-orig-ctx") + 1] == "32768"
    assert ext[ext.index("--rope-scale") + 1] == "2"
    assert extend_flags(16384, None)[ext.index("--rope-scale") + 1] == "2"   # SmolLM2: trained on 8,192


@pytest.mark.slow
def test_the_extension_cost_does_not_depend_on_its_threads():
    """Notebook 20 scored the extension on one thread (18 s of its run); the NLLs are the same
    on two, bit for bit, so the lesson takes the faster."""
    from infercourse.lessons.context_extension import extension_cost
    one, two = (extension_cost(32768, n_words=80, n_threads=k) for k in (1, 2))
    assert one == two and one["tokens"] > 50 and one["trained"] == 8192
