"""What a fair benchmark's run showed, in words written from its own numbers (issue 26).

Notebook 13's markdown explains mechanisms; which route had the lowest TTFT, whether a
prefix cache or a prefill rate goes with it, and whether a 4-bit route won decode and lost
prefill on this machine can only come from the run. Each function here reads the rows of
`fair.measure_routes` (or the result of `fair.server_vs_in_process`) and returns markdown
that flips when the numbers flip; where the numbers allow more than one reading (too few
pairs for a test), the sentence says so.

**One run per route is a reading, not a ranking.** `measure_routes` runs each route once,
so its gaps have no noise band of their own; the A/A floor of the interleaved server
comparison belongs to that experiment and judges nothing else. So the route sentences name
the lowest or highest *in this run*, give the gap, and say it is not judged (`UNJUDGED`).

**Bandwidth-bound is measured, not assumed.** "Fewer bytes help decode" holds where decode
runs near its bandwidth ceiling; `rates_sentence` reads each route's share of its ceiling
and says "not bandwidth-bound here" below half of it (`measure.regime.NEAR_ROOF`).

**Cold and warm calls are reported apart.** The agent calls extend each other, so call 1
(after an unrelated warm-up) finds nothing of its prompt in any cache, and every later call
can find its predecessor's prompt there. A median over call 1 and call 2 mixes the two
regimes (with 2 calls it is their mean), so it answers neither "how fast does this route
prefill?" nor "how much does its cache save?".

**An order effect is looked for, not assumed away.** Two runs of the same route (A/A) differ
only by noise if nothing about their order matters. A sign test on the A/A ratios asks
whether the rerun came out on one side more often than chance allows; a second one asks
whether the run that went later in its block did.
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping

import pandas as pd

from infercourse.measure.regime import NEAR_ROOF, roof_share_words

__all__ = ["UNJUDGED", "sign_test_p", "ttft_sentence", "ceiling_shares", "rates_sentence", "order_sentence",
           "explain", "is_4bit", "is_float"]

UNJUDGED = "one run per route, not judged"   # a single value per route has no noise band of its own

MIN_SIGN_PAIRS = 6      # fewest pairs for which a two-sided sign test can reach p <= 0.05 (2 / 2^6)
HIT_GAP = 0.05          # cache-hit shares closer than this are "the same" (a template's few tokens)


def is_4bit(quant: Any) -> bool:
    """A 4-bit weight format by its name (Q4_1, Q4_K_M, "MLX 4-bit g64", AWQ/GPTQ int4, NF4)."""
    return bool(re.search(r"q4|4-?bit|int4|nf4|awq|gptq", str(quant), re.I))


def is_float(quant: Any) -> bool:
    """An unquantized float format by its name (F32, float32, F16, BF16, fp16)."""
    return bool(re.fullmatch(r"(b?f|fp|float|bfloat)(16|32)", str(quant).strip(), re.I))


def sign_test_p(k: int, n: int) -> float:
    """Two-sided sign test: the chance of a split at least as one-sided as k of n, when each
    pair falls on either side with probability 1/2 (exact binomial). Written out because it
    is two lines of exact integer arithmetic; scipy (`binomtest`) is not a dependency."""
    if n <= 0:
        return 1.0
    m = max(k, n - k)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(m, n + 1)) / 2 ** n)


def _ran(rows: pd.DataFrame) -> pd.DataFrame:
    return rows[rows["ran"].astype(bool)] if "ran" in rows else rows


def _q(rows: pd.DataFrame, name: str) -> str:
    q = rows.loc[name, "quantization"] if "quantization" in rows else None
    return f" ({q})" if isinstance(q, str) and q else ""


def _pct(x: float) -> str:
    return "not reported" if not math.isfinite(x) else f"{x:.0%}"


def _lowest(ran: pd.DataFrame, col: str) -> tuple[str, str | None, str]:
    """(lowest route, runner-up or None, head text) for the lowest value of `col` in this run."""
    s = ran[col].dropna().sort_values()
    best = s.index[0]
    if len(s) == 1:
        return best, None, f"only **{best}**{_q(ran, best)} measured it: {s.iloc[0]:.3g} s"
    second, r = s.index[1], float(s.iloc[1] / s.iloc[0])
    head = (f"the lowest in this run was **{best}**{_q(ran, best)} at {s.iloc[0]:.3g} s, then {second}"
            f"{_q(ran, second)} at {s.iloc[1]:.3g} s ({r:.2f}×; {UNJUDGED})")
    return best, second, head


def _first_why(ran: pd.DataFrame, best: str, second: str | None) -> str:
    rate = ran["prefill_first_tok_per_s"]
    if second is None or not math.isfinite(rate.get(best, math.nan)):
        return ""
    top = rate.dropna().idxmax()
    hit = ran["cache_hit_first"].get(best, math.nan) if "cache_hit_first" in ran else math.nan
    cached = (f" A prefix cache played no part beyond the chat template's first tokens ({_pct(hit)} of "
              f"call 1 on {best} came from a cache).") if not (math.isfinite(hit) and hit > HIT_GAP) else \
        f" A cache served {_pct(hit)} of call 1 on {best} (the warm-up shared a prefix with it)."
    if top == best:
        return (f" If the gap is more than noise, its prefill rate explains it: {rate[best]:.0f} tok/s on call 1, the "
                f"highest of the routes ({second}: {rate[second]:.0f} tok/s)." + cached)
    return (f" Its call-1 prefill rate ({rate[best]:.0f} tok/s) is not the highest ({top}: {rate[top]:.0f} tok/s): "
            f"the rate counts each route's own prompt tokens, so the routes' templates and tokenizers gave "
            f"prompts of different lengths, or time outside prefill (HTTP, tokenizing) differs." + cached)


def _later_why(ran: pd.DataFrame, best: str, second: str | None) -> str:
    if second is None:
        return ""
    hit, rate = ran["cache_hit_later"], ran["prefill_first_tok_per_s"]
    hb, hs, rb, rs = hit[best], hit[second], rate[best], rate[second]
    facts = (f"cache hits on those calls {_pct(hb)} against {_pct(hs)} for {second}; call-1 prefill rate "
             f"{rb:.0f} against {rs:.0f} tok/s")
    more_hits = math.isfinite(hb) and math.isfinite(hs) and hb - hs > HIT_GAP
    hits_known = math.isfinite(hb) and math.isfinite(hs)
    higher_rate = rb > rs
    if more_hits and not higher_rate:
        return f" If the gap is more than noise, its prefix cache explains it, not its prefill rate: {facts}."
    if higher_rate and hits_known and not more_hits:
        return f" If the gap is more than noise, its prefill rate explains it, not a prefix cache: {facts}."
    if more_hits and higher_rate:
        return f" If the gap is more than noise, both play a part, more cache hits and a higher prefill rate: {facts}."
    if not hits_known and higher_rate:
        return (f" A higher prefill rate may explain it; whether a cache did too, this run cannot say "
                f"(a route reports no cached-token count): {facts}.")
    return (f" Neither more cache hits nor a higher prefill rate goes with it ({facts}): the gap lies outside "
            f"prefill (HTTP, scheduling, prompt lengths) or in noise.")


def ttft_sentence(rows: pd.DataFrame) -> str:
    """Which route had the lowest TTFT in this run on call 1 (cold: nothing cached) and on the
    later calls (warm: each extends the last), and whether a prefill rate or cache hits go
    with it. One run per route: the gaps are given, never judged (`UNJUDGED`).

    Args:
        rows: `fair.measure_routes` rows (`ttft_first_s`, `ttft_later_p50_s`,
            `prefill_first_tok_per_s`, `cache_hit_first`, `cache_hit_later`, `calls`).
    """
    ran = _ran(rows)
    if ran.empty or ran["ttft_first_s"].dropna().empty:
        return "- TTFT: no route measured one here (see the `why` column)."
    best, second, head = _lowest(ran, "ttft_first_s")
    out = [f"- **Call 1** (cold: the same whole prompt on every route, after an unrelated warm-up): {head}."
           + _first_why(ran, best, second)]
    later = ran["ttft_later_p50_s"].dropna() if "ttft_later_p50_s" in ran else pd.Series(dtype=float)
    if later.empty:
        out.append("- **Later calls**: none here (one call per route), so no route had an earlier prompt to reuse: "
                   "replay 2 calls or more (`N_CALLS`) to see what a prefix cache changes.")
    else:
        n = int(ran["calls"].max()) if "calls" in ran else 2
        which = "call 2, one per route" if n <= 2 else f"calls 2 to {n}, their TTFT p50 per route"
        best, second, head = _lowest(ran.loc[later.index], "ttft_later_p50_s")
        out.append(f"- **Later calls** (warm: {which}, each extending the last): {head}."
                   + _later_why(ran, best, second) + _no_cache(ran.loc[later.index], best, second))
    return "\n".join(out)


def _no_cache(ran: pd.DataFrame, best: str, second: str | None) -> str:
    """The later calls of a route that reused no prefix (other than the two already named),
    against the lowest: what a cache was worth here."""
    hit = ran["cache_hit_later"]
    none = [n for n in ran.index if n not in (best, second) and math.isfinite(hit[n]) and hit[n] <= HIT_GAP]
    if not none or not math.isfinite(hit[best]) or hit[best] <= HIT_GAP:
        return ""
    n = none[0]
    t, t0 = ran.loc[n, "ttft_later_p50_s"], ran.loc[best, "ttft_later_p50_s"]
    return (f" {n}, which reused no prefix ({_pct(hit[n])} cached), took {t:.3g} s on them, {t / t0:.2f}× the "
            f"lowest ({UNJUDGED}): it prefilled each whole, longer prompt again.")


def ceiling_shares(rows: pd.DataFrame, ceilings: Mapping[str, float] | None) -> pd.Series:
    """Each route's decode rate as a share of the bandwidth ceiling of its weight format
    (NaN where no ceiling is given for that format).

    Args:
        rows: `fair.measure_routes` rows (`decode_tok_per_s`, `quantization`).
        ceilings: {quantization: decode ceiling tok/s}, bandwidth ÷ that format's weight bytes.
    """
    c = {str(k): float(v) for k, v in (ceilings or {}).items()}
    q = rows["quantization"] if "quantization" in rows else pd.Series(None, index=rows.index)
    return pd.Series([rows.loc[n, "decode_tok_per_s"] / c[str(q[n])] if str(q[n]) in c else math.nan
                      for n in rows.index], index=rows.index, dtype=float)


def _bandwidth_clause(shares: pd.Series, names: tuple[str, ...]) -> str:
    """Were these routes' decodes bandwidth-bound here? From their measured shares of the ceiling."""
    known = [(n, float(shares[n])) for n in names if math.isfinite(shares.get(n, math.nan))]
    if not known:
        return (" No bandwidth ceiling was given for their formats, so whether decode was bandwidth-bound here is "
                "not measured.")
    each = ", ".join(f"{n} {v:.0%} ({roof_share_words(v)})" for n, v in known)
    if all(NEAR_ROOF <= v <= 1 for _, v in known):
        return (f" Decode as a share of its bandwidth ceiling: {each}: near the ceiling, where fewer bytes per token "
                "do help decode.")
    return (f" Decode as a share of its bandwidth ceiling: {each}. Below half of it the bytes are not what binds "
            "decode, so the bytes a format saves do not explain a decode gap here; what each runtime does per "
            "token does.")


def rates_sentence(rows: pd.DataFrame, ceilings: Mapping[str, float] | None = None) -> str:
    """This run's prefill and decode rates across routes, and what they say of 4-bit against
    float weights here: the best 4-bit route against the best float route in each phase, and
    whether their decode was bandwidth-bound (its measured share of the ceiling). One run per
    route: a reading, never judged.

    Args:
        rows: `fair.measure_routes` rows (`prefill_first_tok_per_s`, `decode_tok_per_s`, `quantization`).
        ceilings: {quantization: decode ceiling tok/s} (bandwidth ÷ that format's weight bytes).
    """
    ran = _ran(rows)
    ran = ran[ran["prefill_first_tok_per_s"].notna() & ran["decode_tok_per_s"].notna()]
    if ran.empty:
        return "- Rates: no route measured both a prefill and a decode rate here."

    def order(col: str) -> str:
        s = ran[col].sort_values(ascending=False)
        return ", ".join(f"{n}{_q(ran, n)} {v:.3g}" for n, v in s.items())
    out = [f"- Prefill rate of call 1, tok/s, highest first in this run: {order('prefill_first_tok_per_s')}.",
           f"- Decode rate, tok/s, highest first in this run: {order('decode_tok_per_s')} ({UNJUDGED})."]
    shares = ceiling_shares(ran, ceilings)
    four = ran[ran["quantization"].map(is_4bit)] if "quantization" in ran else ran.iloc[:0]
    flt = ran[ran["quantization"].map(is_float)] if "quantization" in ran else ran.iloc[:0]
    if four.empty or flt.empty:
        out.append("- No 4-bit route and float route both ran here, so this run cannot set the two bounds "
                   "side by side." + _bandwidth_clause(shares, tuple(ran.index)))
        return "\n".join(out)
    lead, words = {}, []
    for col, phase in (("prefill_first_tok_per_s", "prefill"), ("decode_tok_per_s", "decode")):
        f4, ff = four[col].idxmax(), flt[col].idxmax()
        r = float(four.loc[f4, col] / flt.loc[ff, col])
        lead[phase] = "ahead" if r > 1 else "behind"
        words.append(f"{phase}: {f4} {r:.2f}× {ff}")
    out.append("- Best 4-bit route against best float route, " + "; ".join(words) + f" ({UNJUDGED}).")
    pair = (four["decode_tok_per_s"].idxmax(), flt["decode_tok_per_s"].idxmax())
    bw = _bandwidth_clause(shares, pair)
    p, d = lead["prefill"], lead["decode"]
    if (d, p) == ("ahead", "behind"):
        out.append("- In this run 4-bit led decode and trailed prefill: prefill pays in full for unpacking 4-bit "
                   "blocks, which is arithmetic." + bw)
    elif (d, p) == ("ahead", "ahead"):
        out.append("- In this run 4-bit led both phases: its kernels unpacked fast enough that prefill did not lose."
                   + bw)
    elif (d, p) == ("behind", "behind"):
        out.append("- In this run the float route led both phases: the 4-bit kernels' arithmetic cost more than the "
                   "bytes they saved, even in decode." + bw)
    else:
        out.append("- In this run 4-bit trailed decode and led prefill, the opposite of what bytes and arithmetic "
                   "predict: check threads and kernels before reading it as a property of the format." + bw)
    return "\n".join(out)


def explain(rows: pd.DataFrame, runs: Mapping[str, Any], predicted_ratio: float,
            base: str = "llama.cpp in process", other: str = "transformers",
            paired: Mapping[str, Any] | None = None) -> str:
    """The Explain paragraph, computed from the measured rows and runs (no number typed in).
    One run per route: the highest decode rate is named as this run's, not as a ranking, and
    the decode ratio is not judged (the A/A floor of the interleaved comparison judges only
    that comparison). Whether the server costs TTFT is said only from `paired`
    (`fair.server_vs_in_process`: interleaved trials judged against their A/A floor).

    Args:
        rows, runs: `fair.measure_routes`' rows and {route: Run}.
        predicted_ratio: the bytes ratio (float32 ÷ 4-bit weight bytes) the notebook predicted.
        base, other: the two routes whose decode rates are set side by side.
        paired: `fair.server_vs_in_process`'s result, or None.
    """
    ran = _ran(rows)
    if ran.empty:
        return "No route could run here: see the `why` column."
    d = ran["decode_tok_per_s"].dropna().sort_values(ascending=False)
    head = f"- Highest decode rate in this run: **{d.index[0]}** at {d.iloc[0]:.3g} tok/s{_q(ran, d.index[0])}"
    if len(d) > 1:
        head += f", then {d.index[1]} at {d.iloc[1]:.3g} ({d.iloc[0] / d.iloc[1]:.2f}×)"
    out = [head + " (one run each, not a ranking)."]
    if {base, other} <= set(ran.index):
        r = ran.loc[base, "decode_tok_per_s"] / ran.loc[other, "decode_tok_per_s"]
        out.append(f"- Decode rate, {base} ÷ {other}: {r:.2f}× (one run each, not judged); the bytes alone predicted "
                   f"{predicted_ratio:.1f}×. That ratio mixes *quantization* with the engines: the table labels it.")
    if paired is not None:
        out.append(f"- Same runtime behind HTTP, TTFT of one agent call, interleaved: **{paired['comparison'].said}** "
                   f"({paired['comparison'].text}); {paired['floor'].text()}.")
    elif {base, "llama-server"} <= set(runs):
        out.append("- llama-server against in process: one sequential run per route cannot separate a server's "
                   "cost from this machine's noise, so no verdict here (the interleaved A/A/B comparison gives one).")
    hits = ", ".join(f"{n} {v:.0%}" for n, v in ran["cache_hit"].items())
    out.append(f"- Prompt tokens served from a prefix cache: {hits}.")
    out.append(f"- Memory: {', '.join(f'{n} {v:.0f} MB' for n, v in ran['memory_mb'].items())} "
               f"(in-process routes: growth of this Python process; servers: their own RSS).")
    for n, why in rows.loc[~rows["ran"].astype(bool), "why"].items():
        out.append(f"- **{n}** did not run: {str(why)[:160]}")
    return "\n".join(out)


def order_sentence(paired: Mapping[str, Any], ref: str = "in process", aa: str = "in process (A/A)") -> str:
    """Is there an order effect in the interleaved A/A/B trials? Two sign tests on the A/A
    pairs: did the rerun come out slower more often than chance allows, and did the
    reference that ran later in its block?

    Args:
        paired: `fair.server_vs_in_process`'s result ("values" {arm: [s per block]}, "order"
            [(block, arm)] as run).
        ref, aa: the reference arm and its A/A rerun.
    """
    a, a2 = paired["values"][ref], paired["values"][aa]
    pos = {(b, arm): i for i, (b, arm) in enumerate(paired["order"])}
    pairs = [(x, y, pos[(i, aa)] > pos[(i, ref)]) for i, (x, y) in enumerate(zip(a, a2))
             if x > 0 and y > 0 and math.isfinite(x) and math.isfinite(y) and x != y]
    n = len(pairs)
    if n == 0:
        return "- A/A order: no usable pair (failed or identical trials)."
    ratios = ", ".join(f"{y / x:.2f}" for x, y, _ in pairs)
    k = sum(y > x for x, y, _ in pairs)
    late = sum((y > x) == later for x, y, later in pairs)       # the later-run one took longer
    p, p_late = sign_test_p(k, n), sign_test_p(late, n)
    head = (f"- A/A order: the rerun ({aa}) took longer than {ref} in {k} of {n} pairs (ratios {ratios}); "
            f"the one that ran later in its block took longer in {late} of {n}.")
    if n < MIN_SIGN_PAIRS:
        return head + (f" With {n} pairs a sign test cannot reach p ≤ 0.05 (it needs {MIN_SIGN_PAIRS} pairs, all on "
                       "one side), so this run cannot tell an order effect from noise.")
    if p_late <= 0.05:
        return head + (f" A position effect (sign test p = {p_late:.2g}): whichever runs later in a block takes "
                       f"{'longer' if late > n / 2 else 'less time'}. The schedule shuffles each block, so which "
                       "arm sat where was chance, as the relabelling test assumes: a position effect adds noise, "
                       "not a false verdict, and widens the A/A floor, which makes the verdict cautious.")
    if p <= 0.05:
        return head + (f" A split this one-sided has p = {p:.2g} under pure noise: two runs of the same thing "
                       "differ systematically, and not by their position in the block. Look for state one arm "
                       "leaves for the next before trusting the floor.")
    return head + (f" Both splits are ones noise produces (sign tests p = {p:.2g} and {p_late:.2g}): "
                   "no sign of an order effect in this run.")
