"""What the four failures of notebook 19's "Four failures, live" did in this run, in words
computed from its own tables (`agent_failures`, `agent_failures_numerics`).

Token counts and log-likelihoods are exact for a given build and input: they need no noise
floor, and a sentence about them says what was counted. Times are judged against an A/A floor
(a TTFT trend against the band of the smallest request timed against itself; a decode speed-up
against the A/A rerun of the plain server), and a sentence that cannot decide says so. Every
sentence flips when its numbers do.
"""
from __future__ import annotations

import math
from typing import Any

import pandas as pd

from infercourse.measure import claims

__all__ = ["reasoning_sentence", "tools_sentence", "kv_sentence", "spec_sentence", "summary_lines"]


def reasoning_sentence(table: pd.DataFrame, runs: dict[str, pd.DataFrame]) -> str:
    """The cache each history arm lost, where the first change fell, and the prefill it cost.

    Args:
        table: `agent_failures.reasoning_table` (the template under test first, then the fixes).
        runs: the per-call frames of `reasoning_replay`, by the same names.
    """
    first, fixes = table.index[0], table.index[1:]
    row, calls = table.loc[first], runs[first]
    lost = calls[calls["cache_lost"].fillna(0) > 0]
    if row["cache_lost_total"] == 0:
        head = f"**{first}**: no call lost any of the slot's cache here, so this session did not show the failure."
    else:
        where = lost.iloc[0]
        head = (f"**{first}**: a new user message lost **{row['lost_per_user_message']:.0f}** tokens of the slot's cache "
                f"on average, a tool result **{row['lost_per_tool_result']:.0f}**. The first changed token sat in "
                f"{where['changed_in']}, where the slot held {where['held_text']!r} and the new prompt has "
                f"{where['new_text']!r}: the turn's reasoning is no longer rendered, so it and everything after "
                "it were prefilled again.")
    parts = []
    for name in fixes:
        r = table.loc[name]
        ratio = r["prefilled_total"] / row["prefilled_total"] if row["prefilled_total"] else math.nan
        what = ("lost nothing" if r["cache_lost_total"] == 0 else
                f"lost {r['lost_per_user_message']:.0f} per user message and {r['lost_per_tool_result']:.0f} per "
                "tool result")
        parts.append(f"**{name}** {what} and prefilled {r['prefilled_total']:,} tokens in all, "
                     f"{ratio:.2f}× the {row['prefilled_total']:,} of the first")
    agree = "agrees" if table["server_agrees"].all() else "does **not** agree"
    return (head + " " + "; ".join(parts) + f". The server's own `cache_n` {agree} with the first changed token "
            "on every call (token counts: exact, no noise floor needed).")


def tools_sentence(table: pd.DataFrame, floor: Any = None) -> str:
    """What more tools did to one model: the prompt per tool, the window, the cold TTFT's
    trend (against the A/A floor), and each way of asking's validity from the fewest tools to
    the most that fit.

    Args:
        table: `agent_failures.tools_table` rows of one model (index: tools offered).
        floor: the model's `ttft_floor` (None: the TTFT trend is not judged).
    """
    fit = table[table["fits"]]
    out = []
    if len(fit) >= 2:
        lo, hi = fit.index[0], fit.index[-1]
        per_tool = (fit.loc[hi, "prompt_tokens"] - fit.loc[lo, "prompt_tokens"]) / (hi - lo)
        out.append(f"Each tool schema added **{per_tool:.0f}** prompt tokens on average.")
        out.append(claims.trend_sentence(list(fit.index), fit["ttft_s"], None if floor is None else float(floor),
                                         what="Cold TTFT (s)", x_name="tools"))
        for mode, col, what in (("auto", "auto_called", "answered with a call at all"),
                                ("free", "free_valid", "wrote a valid call (parses, a tool offered, valid arguments)"),
                                ("required", "required_valid", "came back as a valid call"),
                                ("required", "required_right", "named the tool the request needs")):
            if col not in fit or fit[col].isna().all():
                continue
            a, b = fit.loc[lo, col], fit.loc[hi, col]
            move = "held at" if a == b else "rose from" if b > a else "fell from"
            shares = f"{a:.0%}" if a == b else f"{a:.0%} to {b:.0%}"
            out.append(f"`{mode}`: the share that {what} {move} {shares} from {lo} to {hi} tools.")
    for n, r in table[~table["fits"]].iterrows():
        out.append(f"**{n} tools** ({r['prompt_tokens']:,} prompt tokens) do not fit the window: "
                   f"{r['refused'] or 'not sent'}.")
    return " ".join(out) if out else "No count of tools was measured."


def kv_sentence(table: pd.DataFrame, tol: float) -> str:
    """Each quantized cache against f16 at every context: the change in the reference call's
    NLL (nats/token; counted as no change within ±`tol`), whether that change grows with the
    context, the greedy calls that differ from f16's at the same length, and the seconds each
    cache took (one run each: reported, not judged).

    Args:
        table: `agent_failures_numerics.kv_long_context` rows (kv_type "f16" among them).
        tol: nats per token within which two NLLs count as the same (`agent_failures_numerics.NLL_TOL`).
    """
    base = table[table["kv_type"] == "f16"].set_index("target")
    out = []
    for kv in [k for k in table["kv_type"].unique() if k != "f16"]:
        mine = table[table["kv_type"] == kv].set_index("target")
        d = mine["nll_mean"] - base["nll_mean"]
        steps = ", ".join(f"{mine.loc[t, 'context_tokens']:,} tokens: {v:+.3f}" for t, v in d.items())
        worse = [t for t, v in d.items() if v > tol]
        if not worse:
            verdict = f"within ±{tol} nats/token of f16 at every length: no change to the call's likelihood worth the name"
        else:
            t = worse[-1]
            verdict = (f"above f16 by more than {tol} at {len(worse)} of {len(d)} lengths; at the longest of them the "
                       f"reference call is {math.exp(d[t] * mine.loc[t, 'ref_tokens']):.2f}× less likely as a whole")
        grows = "was measured at one length only" if len(d) < 2 else "grows with the context" if \
            d.iloc[-1] > d.iloc[0] + tol else "shrinks with the context" if d.iloc[-1] < d.iloc[0] - tol else \
            "does not grow with the context"
        moved = [t for t in d.index if mine.loc[t, "call"] != base.loc[t, "call"]]
        calls = ("the greedy call was f16's at every length" if not moved else "the greedy call differed from f16's at "
                 + ", ".join(f"{mine.loc[t, 'context_tokens']:,} tokens ({mine.loc[t, 'name'] or 'no call'} instead of "
                             f"{base.loc[t, 'name'] or 'no call'})" for t in moved))
        out.append(f"**{kv}** vs f16, the reference call's NLL (nats/token): {steps}: {verdict}; the change {grows}; "
                   f"{calls}.")
    right = table.groupby("kv_type", sort=False)["right_call"].sum()
    out.append("The greedy call was the reference itself " + ", ".join(f"{int(n)} time(s) with {k}" for k, n in
                                                                          right.items()) + f" of {len(base)}.")
    secs = table.groupby("kv_type", sort=False)["seconds"].first()
    out.append("Each cache took " + ", ".join(f"{s:.0f} s ({k})" for k, s in secs.items()) +
               " in all, prefill included (one run each: reported, not judged).")
    return " ".join(out)


def spec_sentence(table: pd.DataFrame) -> str:
    """Per drafter against the plain server: were the generated tokens the same, was the call
    the same, and the decode speed-up with its verdict against the A/A rerun.

    Args:
        table: `agent_failures_numerics.spec_table` (the reference first, its `comparison`s).
    """
    out = []
    for arm, r in table.iloc[1:].iterrows():
        if "(A/A)" in arm:
            continue
        same = ("the same tokens on every request" if r["tokens_differ"] == 0 else
                f"**different tokens** on {r['tokens_differ']} of {r['answers']} answers (first at generated token "
                f"{r['first_diff_at']}), {r['call_differs']} of them a different call")
        acc = "" if r["acceptance"] is None or pd.isna(r["acceptance"]) else \
            f", {r['acceptance']:.0%} of its drafted tokens accepted"
        speed = claims.verdict_sentence(r["comparison"], "decode tok/s") if r["comparison"] is not None else ""
        out.append(f"**{arm}**: {same}{acc}. {speed}")
    aa = table.loc[[a for a in table.index if "(A/A)" in a]]
    if len(aa) and aa["tokens_differ"].iloc[0]:
        out.append("The plain server's own rerun (A/A) also changed tokens: the differences are not the drafter's alone.")
    return " ".join(out)


def _tools(n: int) -> str:
    return f"{n} tool" if n == 1 else f"{n} tools"


def summary_lines(reasoning: pd.DataFrame, tools: pd.DataFrame, kv: pd.DataFrame, spec: pd.DataFrame,
                  tol: float) -> str:
    """The Summary's four outcome lines, one per failure, from the four tables.

    Args:
        reasoning: `reasoning_table`; tools: `tools_table` (all models); kv: `kv_long_context`
        rows; spec: `spec_table`; tol: `agent_failures_numerics.NLL_TOL`.
    """
    first, keep = reasoning.iloc[0], reasoning.iloc[1]
    lines = [f"- Reasoning dropped: each new user message lost **{first['lost_per_user_message']:.0f}** cached tokens "
             f"through the Qwen3-style template, **{keep['lost_per_user_message']:.0f}** with reasoning kept."]
    for model, t in tools.groupby(level="model", sort=False):
        t = t.droplevel("model")
        fit = t[t["fits"]]
        if len(fit) and fit["required_right"].notna().any():
            lines.append(f"- Many tools, {model}: the right tool (required, valid by construction) "
                         f"{fit['required_right'].iloc[0]:.0%} at {_tools(fit.index[0])}, "
                         f"{fit['required_right'].iloc[-1]:.0%} at {fit.index[-1]}"
                         + (f"; {t[~t['fits']].index[0]} tools did not fit the window." if (~t["fits"]).any() else "."))
    base = kv[kv["kv_type"] == "f16"].set_index("target")["nll_mean"]
    longest = base.index.max()
    for q, g in kv[kv["kv_type"] != "f16"].groupby("kv_type", sort=False):
        d = g.set_index("target")["nll_mean"][longest] - base[longest]
        lines.append(f"- KV cache {q} at the longest context: NLL of the reference call {d:+.3f} nats/token vs f16 "
                     f"({'beyond' if abs(d) > tol else 'within'} ±{tol}).")
    for arm, r in spec.iloc[1:].iterrows():
        if "(A/A)" not in arm:
            lines.append(f"- Speculative decoding, {arm}: {r['tokens_differ']} of {r['answers']} answers with different "
                         f"tokens; speed: {r['verdict']}.")
    return "\n".join(lines)
