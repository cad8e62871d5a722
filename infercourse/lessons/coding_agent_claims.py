"""What notebook 19's run showed, in words computed from its own numbers.

Notebook 19's markdown explains mechanisms (the prefix cache, a header that changes on every
request, the window, a tool-aware template); what this run's calls reused, whether the
changing header busted the cache, what each prefilled tool call did and whether the two APIs
cost the same tokens can only come from the run. Each function here reads the tables
`lessons.coding_agent` builds and returns text that flips when the numbers flip.
"""
from __future__ import annotations

import pandas as pd

__all__ = ["prefill_sentence", "header_verdicts", "summary_lines"]


def prefill_sentence(rows: pd.DataFrame) -> str:
    """What the `prefilled_call` rows did, in words: for each prefill, a parsed `tool_use`
    block, an error that ended the stream, or neither."""
    given = lambda v: v is not None and not (isinstance(v, float) and v != v)   # noqa: E731 (a frame turns None into NaN)
    out = []
    for r in rows.itertuples():
        kind = "a complete call" if "</tool_call>" in r.prefill else "the opening of a call"
        if given(r.error) and r.error:
            out.append(f"- Prefilled with {kind}: the stream ended in an **error** ({r.error}).")
        elif given(r.tool_use):
            out.append(f"- Prefilled with {kind}: the server's parser streamed a **tool_use** block {r.tool_use}.")
        else:
            out.append(f"- Prefilled with {kind}: **no tool_use** block and no error (stop reason {r.stop_reason}).")
    return "\n".join(out)



def header_verdicts(table: pd.DataFrame, restored: float = 0.9) -> pd.Series:
    """Per variant, from the numbers: did the calls after the first reuse about as much of
    their prompt as the baseline (the first row) did? `restored` is the share of the
    baseline's cached share that counts as restored. Moving the header behind the static
    block is not always enough: a chat template renders the tool schemas *after* the system
    text, so a header at the end of the system prompt still precedes (and busts) the tools."""
    base = float(table["cached_share"].iloc[0])
    out = {}
    for name, share in table["cached_share"].items():
        share = float(share)
        out[name] = (f"reuses {share:.0%} of its prompt, as the baseline does ({base:.0%})" if share >= restored * base
                     else f"still busted: reuses {share:.0%} of its prompt (baseline {base:.0%}); "
                          f"everything after the changing text is prefilled again")
    return pd.Series(out, name="verdict")



def summary_lines(table: pd.DataFrame, per_api: pd.DataFrame | None = None) -> str:
    """The Summary's outcome lines, from the numbers: what share of their prompt the later
    calls reused with a fixed header (the first row) and with the changing one first (the
    second), the tokens the buster left, its TTFT against the baseline (one run per variant,
    no A/A floor: reported, not judged), and what the two APIs cost in tokens."""
    base, bust = table.iloc[0], table.iloc[1]
    lines = [f"- {table.index[0]}: the calls after the first reused **{base['cached_share']:.0%}** of their prompt.",
             f"- {table.index[1]}: they reused **{bust['cached_share']:.0%}**, and its median TTFT was "
             f"**{bust['ttft_vs_first']:.1f}×** the first row's (one run each, no A/A floor: a ratio near 1 is not a "
             "finding)." + (" The cache was busted." if bust["cached_share"] < base["cached_share"] / 2 else
                            " The changing header did not halve the reuse here.")]
    if per_api is not None and "anthropic / openai" in per_api.index:
        r = per_api.loc["anthropic / openai"]
        prompt = ("the same prompt tokens: one translation of one request" if abs(r["prompt_tokens"] - 1) < 0.01 else
                  "different prompt tokens: the two renderings differ, so compare what each template adds")
        cached = ("and the same cached tokens." if abs(r["cached_tokens"] - 1) < 0.01 else
                  "the cached counts differ: each request reuses what the slot holds from the request before it in the "
                  "interleaved order, so read the prompt tokens for what the API itself costs.")
        lines.append(f"- `/v1/messages` ÷ `/v1/chat/completions`: prompt tokens {r['prompt_tokens']:.2f}, cached "
                     f"{r['cached_tokens']:.2f}: {prompt}; {cached}")
    return "\n".join(lines)
