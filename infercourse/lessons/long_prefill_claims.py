"""The sentences of the long-prefill lesson (`lessons.long_prefill`), computed from its run.

A run's rows are read three ways: the reference curve is fitted (`fit_reference`: a + b·n +
c·n², `measure.prefill_curve`); each alternative setting is set against the reference at
every length both ran, and against the A/A rerun's spread (`aa_floor`, `compare_configs`:
the permutation test of `measure.noise`, which needs 3 lengths at least ever to call a
difference); and the fit forecasts an agent's cold first call. Each sentence below states
an outcome only when the numbers decide it, says "cannot tell" when they sit inside the
noise, and flips when they flip (tests/test_long_prefill.py).
"""
from __future__ import annotations

from typing import Mapping

import pandas as pd

from infercourse.measure import noise
from infercourse.measure.claims import band_verdict, verdict_sentence
from infercourse.measure.prefill_curve import PrefillFit, fit_prefill, predict_prefill_s
from infercourse.ops.agent_doctor import agent_shape

__all__ = ["AGENT_FIRST_REQUEST", "ROUGH_FIT", "fit_reference", "config_table", "aa_floor", "compare_configs",
           "fit_sentence", "rate_sentence", "option_sentence", "agent_sentence", "explain"]

# the agents' first requests as notebook 20 measured them (the server's count, SmolLM2's tokenizer and
# the course's template), read from the one file that holds them: data/agent_shapes.json
AGENT_FIRST_REQUEST = {name: int(agent_shape(agent)["prompt_tokens"])
                       for name, agent in (("Claude Code", "claude-code"), ("Codex", "codex"))}
# relative rms residual above which a three-term fit is called rough: clean runs fit within a few %
ROUGH_FIT = 0.10


def _arm(df: pd.DataFrame, role: str) -> str | None:
    arms = df.loc[df["role"] == role, "arm"].unique()
    return str(arms[0]) if len(arms) else None


def fit_reference(df: pd.DataFrame) -> PrefillFit:
    """`fit_prefill` on the reference rows: server prompt_n against server prefill seconds."""
    ref = df[(df["role"] == "reference") & (df["status"] == "ok")]
    return fit_prefill(ref["prompt_n"], ref["prefill_s"])


def config_table(df: pd.DataFrame, value: str = "prefill_s") -> pd.DataFrame:
    """Lengths x arms of `value` (median per cell), at the lengths every arm ran."""
    wide = df[df["status"] == "ok"].pivot_table(index="n_asked", columns="arm", values=value, aggfunc="median")
    return wide.dropna()


def aa_floor(df: pd.DataFrame) -> noise.NoiseFloor | None:
    """The A/A noise floor of prefill seconds, paired by length (None without an A/A arm)."""
    ref, aa = _arm(df, "reference"), _arm(df, "A/A")
    if aa is None:
        return None
    wide = config_table(df)
    return noise.noise_floor(wide[ref], wide[aa])


def compare_configs(df: pd.DataFrame) -> dict[str, noise.Comparison]:
    """Each alternative against the reference on prefill seconds, paired by length, with the
    A/A rerun as a second reference in every pair (`noise.compare`; 3 lengths at least can
    call a difference)."""
    ref, floor, wide = _arm(df, "reference"), aa_floor(df), config_table(df)
    return {alt: noise.compare(wide[ref], wide[alt], floor if floor is not None else 0.0,
                               higher_is_better=False, labels=(ref, alt))
            for alt in df.loc[df["role"] == "alternative", "arm"].unique()}


# ---- sentences, computed from the run -----------------------------------------------------------
def _ns(seconds: float) -> str:
    v = seconds * 1e9
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def fit_sentence(fit: PrefillFit, flop_crossover: float | None = None) -> str:
    """The three fitted terms, and where attention's term overtakes the weights' (against the
    FLOP count's prediction when given)."""
    head = (f"Fit of prefill time = a + b·n + c·n² on {fit.n_points} points ({fit.n_min:,} to {fit.n_max:,} tokens, "
            f"relative rms residual {fit.rel_rms:.1%}): fixed **{fit.a * 1e3:.0f} ms**, linear **{fit.b * 1e3:.2f} ms "
            f"per token** (the weights{f'; alone they would run {1 / fit.b:,.0f} tok/s' if fit.b > 0 else ''}), "
            f"quadratic **{_ns(fit.c)} ns per token²** (attention)")
    pinned = f"; the fit held {', '.join(fit.pinned)} at 0 (negative otherwise)" if fit.pinned else ""
    rough = (f" The points stray from the curve by {fit.rel_rms:.0%} rms, far more than a steady machine gives (a few "
             "%): its speed likely changed between lengths (the `load_1m` column), so read these terms as rough."
             if fit.rel_rms > ROUGH_FIT else "")
    if fit.c <= 0:
        return head + pinned + f". No n² term: up to {fit.n_max:,} tokens the fit needs none." + rough
    if fit.b <= 0:
        return head + pinned + ". With no linear term the fit cannot say where attention overtakes the weights." + rough
    n_star = fit.crossover_tokens
    flop = (f"; counting FLOPs predicts {flop_crossover:,.0f} (measured ÷ predicted = {n_star / flop_crossover:.2f})"
            if flop_crossover else "")
    return head + pinned + f". Attention costs as much as the weights at **{n_star:,.0f} tokens**{flop}." + rough


def rate_sentence(df: pd.DataFrame, fit: PrefillFit, floor: float | None) -> str:
    """How much the measured rate fell from the shortest to the longest reference length,
    judged against the A/A band, and whether the fit puts the fall on attention's n² term.
    The band comes from pairs run back to back; the two ends ran minutes apart, so a machine
    that slowed in between is not in it: a rough fit (`ROUGH_FIT`) is what gives that away."""
    ref = df[(df["role"] == "reference") & (df["status"] == "ok")].groupby("n_asked")["tok_per_s"].median()
    lo, hi = int(ref.index.min()), int(ref.index.max())
    r = float(ref[hi] / ref[lo])
    share = fit.share_at(hi)
    q, lin = share["quadratic"], share["linear"]
    head = (f"Prefill rate from {lo:,} to {hi:,} tokens: {ref[lo]:,.0f} → {ref[hi]:,.0f} tok/s "
            f"({r:.2f}×, {abs(1 - r):.0%} {'lower' if r < 1 else 'higher'})")
    kind, band = band_verdict(r, floor)
    split = f"at {hi:,} tokens the fitted n² term is {q:.0%} of the prefill time, the linear term {lin:.0%}"
    if kind == "unjudged":
        return f"{head}; {band}. By the fit, {split}."
    if kind == "within":
        edges = f"inside the A/A noise band {noise.band_text(floor)}"
        if q < lin:
            return f"{head}, {edges}: **the rate held**: the linear term dominates up to {hi:,} tokens ({split})."
        return (f"{head}, {edges}: this run cannot tell a fall from noise, though by the fit {split}; "
                "a quieter machine (a narrower A/A band) can decide it.")
    if r > 1:
        return (f"{head}, {band}: **the rate rose** with length: the fixed {fit.a * 1e3:.0f} ms per request weighs "
                "on short prompts more than attention on long ones.")
    if fit.c <= 0:
        return (f"{head}, {band}, but the fit finds no n² term: by this fit the fall is not attention's (a machine "
                "that slowed during the run reads the same).")
    if fit.rel_rms > ROUGH_FIT:
        return (f"{head}, {band}: **the rate fell**; by the fit {split}, but the fit is rough ({fit.rel_rms:.0%} rms): "
                "a machine that slowed during the run also lowers the rate at the lengths measured then, so this run "
                "cannot put the fall on attention alone.")
    past = (f" Up to {hi:,} tokens the weights still cost more; past {fit.crossover_tokens:,.0f}, attention does."
            if q < lin else f" Past {fit.crossover_tokens:,.0f} tokens attention costs more than the weights."
            if fit.b > 0 else "")
    return f"{head}, {band}: **the rate falls with length because attention grows as n²**: {split}.{past}"


def option_sentence(df: pd.DataFrame, alt: str, floor: float | None,
                    comparison: noise.Comparison | None = None) -> str:
    """One alternative against the reference at each compared length (its time ÷ the
    reference's, inside or outside the A/A band), and the paired test over all of them."""
    ref, wide = _arm(df, "reference"), config_table(df)
    faster, slower, same, parts = [], [], [], []
    for n, row in wide.iterrows():
        r = float(row[alt] / row[ref])
        kind, _ = band_verdict(r, floor)
        (same if kind != "outside" else faster if r < 1 else slower).append(f"{int(n):,}")
        parts.append(f"{int(n):,}: {r:.2f}×")
    band = "no A/A band, so no length is judged" if floor is None else f"A/A band ±{floor:.0%}"
    verdict = (f"faster at {', '.join(faster) or 'no length'}; slower at {', '.join(slower) or 'no length'}; "
               f"within noise at {', '.join(same) or 'no length'}") if floor is not None else band
    text = f"{alt} vs {ref}, prefill time ÷ the reference's ({'; '.join(parts)}; {band}): {alt} was {verdict}."
    text += _same_work(df, ref, alt, list(wide.index))
    return text + (" " + verdict_sentence(comparison, "prefill seconds") if comparison is not None else "")


def _same_work(df: pd.DataFrame, ref: str, alt: str, lengths: list) -> str:
    """Where two settings that differ only in `-ub` do the same work: a prompt no longer than
    the smaller ubatch is one pass under both, so a difference there is noise by construction."""
    if not {"flash_attn", "ubatch"} <= set(df.columns):
        return ""
    a, b = (df.loc[df["arm"] == arm, ["flash_attn", "ubatch"]].iloc[0] for arm in (ref, alt))
    if a["flash_attn"] != b["flash_attn"] or a["ubatch"] == b["ubatch"]:
        return ""
    small = int(min(a["ubatch"], b["ubatch"]))
    same = [f"{int(n):,}" for n in lengths if n <= small]
    return (f" At {', '.join(same)} tokens both run the prompt in one pass (-ub ≥ the prompt), the same work: a "
            "difference there is noise by construction." if same else "")


def agent_sentence(fit: PrefillFit, sizes: Mapping[str, int] = AGENT_FIRST_REQUEST, *,
                   short_rate: float | None = None, measured_s: Mapping[str, float] | None = None) -> str:
    """The fitted cold prefill of each agent's first request, how far it extrapolates, what a
    constant short-prompt rate would have said, and the real cold TTFT where given."""
    out = []
    for name, n in sizes.items():
        p = predict_prefill_s(n, fit)
        line = (f"- Forecast, not a measurement: {name}'s first request ({n:,} tokens) would take **{p.seconds:.0f} s** "
                f"of cold prefill at {p.tok_per_s:,.0f} tok/s ({p.note})")
        if short_rate:
            line += f"; the short prompt's constant {short_rate:,.0f} tok/s would say {n / short_rate:.0f} s"
        m = (measured_s or {}).get(name)
        if m:
            line += f"; measured {m:.1f} s: the forecast is {p.seconds / m:.2f}× the real one"
        out.append(line + ".")
    return "\n".join(out)


def explain(df: pd.DataFrame, *, sizes: Mapping[str, int] = AGENT_FIRST_REQUEST,
            measured_s: Mapping[str, float] | None = None) -> str:
    """The Explain bullets of a `prefill_curve_run`, every one computed from its numbers.

    Args:
        df: the run's rows (its attrs: contention, wall time, the FLOP crossover length).
        sizes: {agent: first request in tokens} to forecast.
        measured_s: {agent: its real cold TTFT in seconds}, to check the forecast against.
    """
    fit, nf = fit_reference(df), aa_floor(df)
    floor = None if nf is None else nf.floor
    ref = df[(df["role"] == "reference") & (df["status"] == "ok")].groupby("n_asked")["tok_per_s"].median()
    comps = compare_configs(df)
    load = df["load_1m"].dropna() if "load_1m" in df else pd.Series(dtype=float)
    spread = (f" The 1-minute load average ran from {load.min():.1f} to {load.max():.1f} during the run."
              if len(load) else "")
    lines = [f"- Machine before the run: {df.attrs.get('contention', 'not read')}{spread}",
             f"- {fit_sentence(fit, df.attrs.get('flop_crossover_tokens'))}", f"- {rate_sentence(df, fit, floor)}",
             f"- A/A noise floor: {nf.text() if nf is not None else 'not measured (aa=False)'}."]
    lines += [f"- {option_sentence(df, alt, floor, c)}" for alt, c in comps.items()]
    ok = df[df["status"] == "ok"]
    gap = float((ok["ttft_s"] - ok["prefill_s"]).median())
    lines.append(f"- The client's TTFT exceeded the server's own prefill time by a median {gap * 1e3:.0f} ms (HTTP, "
                 f"tokenizing, sampling the one token): {gap / ok['prefill_s'].median():.1%} of a median prefill.")
    lines.append(agent_sentence(fit, sizes, short_rate=float(ref.iloc[0]), measured_s=measured_s))
    if "wall_s" in df.attrs:
        threads = df.attrs.get("threads") or "the server's default"
        lines.append(f"- The whole run took {df.attrs['wall_s']:.0f} s (threads: {threads}).")
    return "\n".join(lines)
